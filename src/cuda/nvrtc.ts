/**
 * NVRTC (runtime CUDA C++ compiler) through koffi: source text in, cubin out.
 *
 * Loaded lazily from the path `locateLibnvrtc` finds. String arrays (`const char* const*`) are built by
 * hand in one host buffer so their layout does not depend on koffi's array marshalling.
 */

import { bindFunction, hostAddress, type KoffiLibrary, koffi, readCString } from "./ffi.js";
import { locateLibnvrtc } from "./locate.js";

/** The NVRTC functions used (each returns an nvrtcResult, 0 = success). */
interface NvrtcApi {
  nvrtcVersion(major: Int32Array, minor: Int32Array): number;
  nvrtcGetErrorString(code: number): bigint;
  nvrtcCreateProgram(
    out: BigUint64Array,
    src: string,
    name: string,
    numHeaders: number,
    headers: null,
    includeNames: null,
  ): number;
  nvrtcDestroyProgram(prog: BigUint64Array): number;
  nvrtcCompileProgram(prog: bigint, numOptions: number, options: bigint): number;
  nvrtcGetProgramLogSize(prog: bigint, out: BigUint64Array): number;
  nvrtcGetProgramLog(prog: bigint, out: Uint8Array): number;
  nvrtcGetCUBINSize(prog: bigint, out: BigUint64Array): number;
  nvrtcGetCUBIN(prog: bigint, out: Uint8Array): number;
}

const NVRTC_DECLARATIONS: Record<keyof NvrtcApi, string> = {
  nvrtcVersion: "int nvrtcVersion(void *major, void *minor)",
  nvrtcGetErrorString: "void *nvrtcGetErrorString(int code)",
  nvrtcCreateProgram:
    "int nvrtcCreateProgram(void *out, const char *src, const char *name, int numHeaders, void *headers, void *includeNames)",
  nvrtcDestroyProgram: "int nvrtcDestroyProgram(void *prog)",
  nvrtcCompileProgram: "int nvrtcCompileProgram(void *prog, int numOptions, void *options)",
  nvrtcGetProgramLogSize: "int nvrtcGetProgramLogSize(void *prog, void *out)",
  nvrtcGetProgramLog: "int nvrtcGetProgramLog(void *prog, void *out)",
  nvrtcGetCUBINSize: "int nvrtcGetCUBINSize(void *prog, void *out)",
  nvrtcGetCUBIN: "int nvrtcGetCUBIN(void *prog, void *out)",
};

/** A loaded NVRTC: its path, version and bound functions. */
export interface Nvrtc {
  libraryPath: string;
  version: { major: number; minor: number };
  api: NvrtcApi;
}

let nvrtc: Nvrtc | undefined;
let nvrtcFailure: string | undefined;

/** NVRTC, loaded once; `{ reason }` when it cannot be found or loaded. */
export function loadNvrtc(): Nvrtc | { reason: string } {
  if (nvrtc) return nvrtc;
  if (nvrtcFailure) return { reason: nvrtcFailure };
  const located = locateLibnvrtc();
  if (!located.ok) {
    nvrtcFailure = located.reason;
    return { reason: nvrtcFailure };
  }
  try {
    const lib: KoffiLibrary = koffi().load(located.path);
    const api: Partial<Record<keyof NvrtcApi, unknown>> = {};
    for (const [name, declaration] of Object.entries(NVRTC_DECLARATIONS) as [keyof NvrtcApi, string][]) {
      api[name] = bindFunction(lib, declaration);
    }
    const bound = api as NvrtcApi;
    const major = new Int32Array(1);
    const minor = new Int32Array(1);
    const code = bound.nvrtcVersion(major, minor);
    if (code !== 0) throw new Error(`nvrtcVersion returned ${code}`);
    nvrtc = { libraryPath: located.path, version: { major: major[0]!, minor: minor[0]! }, api: bound };
    return nvrtc;
  } catch (e) {
    nvrtcFailure = `libnvrtc at ${located.path} failed to load: ${(e as Error).message}`;
    return { reason: nvrtcFailure };
  }
}

/** NUL-terminated strings plus an array of their addresses, in stable host memory. */
function cStringArray(items: readonly string[]): { address: bigint; keepAlive: ArrayBuffer[] } {
  const encoder = new TextEncoder();
  const encoded = items.map((s) => encoder.encode(`${s}\0`));
  const total = encoded.reduce((n, e) => n + e.length, 0);
  const chars = new ArrayBuffer(Math.max(total, 1));
  const charsView = new Uint8Array(chars);
  const pointers = new ArrayBuffer(Math.max(items.length, 1) * 8);
  const pointerView = new BigUint64Array(pointers);
  const base = hostAddress(charsView);
  let offset = 0;
  encoded.forEach((e, i) => {
    charsView.set(e, offset);
    pointerView[i] = base + BigInt(offset);
    offset += e.length;
  });
  return { address: hostAddress(new Uint8Array(pointers)), keepAlive: [chars, pointers] };
}

/** Result of one NVRTC compilation. */
export type NvrtcOutcome =
  | { ok: true; cubin: Uint8Array; log: string }
  | { ok: false; error: string; log: string };

/** Compile `source` (named `name` in diagnostics) with `options`; returns the cubin or the error and log. */
export function nvrtcCompile(
  n: Nvrtc,
  source: string,
  name: string,
  options: readonly string[],
): NvrtcOutcome {
  const api = n.api;
  const errorText = (code: number): string => {
    const p = api.nvrtcGetErrorString(code);
    return p ? readCString(p) : `nvrtcResult ${code}`;
  };
  const progOut = new BigUint64Array(new ArrayBuffer(8));
  let code = api.nvrtcCreateProgram(progOut, source, name, 0, null, null);
  if (code !== 0) return { ok: false, error: `nvrtcCreateProgram: ${errorText(code)}`, log: "" };
  const prog = progOut[0]!;
  try {
    const opts = cStringArray(options);
    code = api.nvrtcCompileProgram(prog, options.length, opts.address);
    void opts.keepAlive; // the option strings must outlive the call
    const sizeOut = new BigUint64Array(new ArrayBuffer(8));
    let log = "";
    if (api.nvrtcGetProgramLogSize(prog, sizeOut) === 0 && sizeOut[0]! > 1n) {
      const logBytes = new Uint8Array(Number(sizeOut[0]));
      if (api.nvrtcGetProgramLog(prog, logBytes) === 0) {
        log = new TextDecoder().decode(logBytes.subarray(0, logBytes.length - 1)).trimEnd();
      }
    }
    if (code !== 0) return { ok: false, error: errorText(code), log };
    code = api.nvrtcGetCUBINSize(prog, sizeOut);
    if (code !== 0) return { ok: false, error: `nvrtcGetCUBINSize: ${errorText(code)}`, log };
    const cubin = new Uint8Array(Number(sizeOut[0]));
    code = api.nvrtcGetCUBIN(prog, cubin);
    if (code !== 0) return { ok: false, error: `nvrtcGetCUBIN: ${errorText(code)}`, log };
    return { ok: true, cubin, log };
  } finally {
    progOut[0] = prog;
    api.nvrtcDestroyProgram(progOut);
  }
}
