/** Host memory for copies: page-locked buffers from `Device.allocPinned`, or any typed array / Buffer. */

import { check, cu, disposeSymbol, type VoidPtr } from "./driver-api.js";
import { viewNativeMemory } from "./ffi.js";

/** Host memory a copy may read from or write to: a typed array / Buffer, or pinned memory. */
export type HostMemory = ArrayBufferView | PinnedBuffer;

export function hostPointer(m: HostMemory): VoidPtr {
  return m instanceof PinnedBuffer ? m.ptr : m;
}
export function hostBytes(m: HostMemory): number {
  return m instanceof PinnedBuffer ? m.bytes : m.byteLength;
}

/** Page-locked host memory from `Device.allocPinned`. `u8` is a live view of it. */
export class PinnedBuffer {
  readonly ptr: bigint;
  readonly bytes: number;
  private view: Uint8Array | undefined;
  private freed = false;

  /** @internal */
  constructor(ptr: bigint, bytes: number) {
    this.ptr = ptr;
    this.bytes = bytes;
  }

  /** The memory as bytes (do not use after `free`). */
  get u8(): Uint8Array {
    if (this.freed) throw new Error("PinnedBuffer used after free()");
    this.view ??= viewNativeMemory(this.ptr, this.bytes);
    return this.view;
  }

  free(): void {
    if (this.freed) return;
    check("cuMemFreeHost", cu.cuMemFreeHost(this.ptr));
    this.freed = true;
    this.view = undefined;
  }

  [disposeSymbol](): void {
    this.free();
  }
}
