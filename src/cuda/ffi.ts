/**
 * Lazy access to koffi, the FFI used to call libcuda and libnvrtc.
 *
 * koffi is loaded on first use through `require` so that importing megamoe never fails on a machine
 * where koffi's native part cannot load; callers get a clear error (or an availability reason) instead.
 */

import { createRequire } from "node:module";

/** The koffi module's public surface. */
export type Koffi = typeof import("koffi").default;
/** A library opened by koffi. */
export type KoffiLibrary = ReturnType<Koffi["load"]>;

let koffiModule: Koffi | undefined;
let koffiError: Error | undefined;

/** koffi, loaded once; throws with the loader's message when it cannot load. */
export function koffi(): Koffi {
  if (koffiModule) return koffiModule;
  if (koffiError) throw koffiError;
  try {
    koffiModule = createRequire(import.meta.url)("koffi") as Koffi;
    return koffiModule;
  } catch (e) {
    koffiError = new Error(`koffi (the FFI module) failed to load: ${(e as Error).message}`);
    throw koffiError;
  }
}

/** Host address of the first byte of a typed array / Buffer view (stable for ArrayBuffer-backed memory). */
export function hostAddress(view: ArrayBufferView): bigint {
  return koffi().address(view);
}

/**
 * Bind one C function from a library, typed by the caller. The declaration is a C prototype koffi
 * parses, e.g. `"int cuInit(uint32_t flags)"`.
 */
export function bindFunction<F>(lib: KoffiLibrary, declaration: string): F {
  return lib.func(declaration) as unknown as F;
}

/** Read a NUL-terminated C string at `address`. */
export function readCString(address: bigint): string {
  return koffi().decode.string(address);
}

/** A view of `bytes` bytes of native memory at `address` (no copy; valid while that memory lives). */
export function viewNativeMemory(address: bigint, bytes: number): Uint8Array {
  return new Uint8Array(koffi().view(address, bytes));
}
