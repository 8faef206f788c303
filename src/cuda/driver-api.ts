/**
 * The driver library through koffi: the C declarations bound, CUresult errors, and the lazy load with its
 * availability probe. The other driver modules call the bound functions through `cu`.
 */

import { bindFunction, type KoffiLibrary, koffi, readCString } from "./ffi.js";
import { locateLibcuda } from "./locate.js";

/** `Symbol.dispose` where the runtime has it, else the symbol Node 20 uses for it. */
export const disposeSymbol: typeof Symbol.dispose =
  Symbol.dispose ?? (Symbol.for("nodejs.dispose") as typeof Symbol.dispose);

// ---------------------------------------------------------------------------------------------------
// Errors

/** A few error names, for messages when `cuGetErrorName` itself is unavailable. */
export const FALLBACK_ERROR_NAMES: Record<number, string> = {
  1: "CUDA_ERROR_INVALID_VALUE",
  2: "CUDA_ERROR_OUT_OF_MEMORY",
  3: "CUDA_ERROR_NOT_INITIALIZED",
  34: "CUDA_ERROR_STUB_LIBRARY",
  100: "CUDA_ERROR_NO_DEVICE",
  101: "CUDA_ERROR_INVALID_DEVICE",
  200: "CUDA_ERROR_INVALID_IMAGE",
  201: "CUDA_ERROR_INVALID_CONTEXT",
  209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
  302: "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
  217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
  400: "CUDA_ERROR_INVALID_HANDLE",
  500: "CUDA_ERROR_NOT_FOUND",
  700: "CUDA_ERROR_ILLEGAL_ADDRESS",
  701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
  719: "CUDA_ERROR_LAUNCH_FAILED",
  800: "CUDA_ERROR_NOT_PERMITTED",
  801: "CUDA_ERROR_NOT_SUPPORTED",
  999: "CUDA_ERROR_UNKNOWN",
};

/** The driver's own texts of the codes megamoe raises itself, before (or without) a driver to ask. */
const FALLBACK_ERROR_TEXTS: Record<number, string> = {
  302: "a link to a shared object failed to resolve",
};

/** A failed driver call: `call` is the C function, `code` the CUresult, `errorName` e.g. CUDA_ERROR_INVALID_VALUE. */
export class CudaError extends Error {
  readonly call: string;
  readonly code: number;
  readonly errorName: string;
  readonly errorText: string;

  constructor(call: string, code: number, detail?: string) {
    const { name, text } = describeCudaError(code);
    super(`${call} failed: ${name} (${code}): ${text}${detail ? ` [${detail}]` : ""}`);
    this.name = "CudaError";
    this.call = call;
    this.code = code;
    this.errorName = name;
    this.errorText = text;
  }
}

/** Name and text of a CUresult, from the driver when loaded, else from a small built-in table. */
export function describeCudaError(code: number): { name: string; text: string } {
  const fallback = {
    name: FALLBACK_ERROR_NAMES[code] ?? `CUresult ${code}`,
    text: FALLBACK_ERROR_TEXTS[code] ?? "(no description available)",
  };
  if (!loaded) return fallback;
  const out = new BigUint64Array(new ArrayBuffer(8));
  let name = fallback.name;
  let text = fallback.text;
  if (loaded.api.cuGetErrorName(code, out) === 0 && out[0] !== 0n) name = readCString(out[0]!);
  if (loaded.api.cuGetErrorString(code, out) === 0 && out[0] !== 0n) text = readCString(out[0]!);
  return { name, text };
}

/** Throw a CudaError when `code` is not CUDA_SUCCESS. */
export function check(call: string, code: number, detail?: string): void {
  if (code !== 0) throw new CudaError(call, code, detail);
}

// ---------------------------------------------------------------------------------------------------
// Raw bindings

/** Anything koffi accepts for a `void*`: a typed array / Buffer (its bytes), a bigint address, or null. */
export type VoidPtr = ArrayBufferView | bigint | null;

/** The driver functions used, as bound by koffi (each returns a CUresult). */
export interface DriverApi {
  cuInit(flags: number): number;
  cuDriverGetVersion(out: Int32Array): number;
  cuGetErrorName(code: number, out: BigUint64Array): number;
  cuGetErrorString(code: number, out: BigUint64Array): number;
  cuDeviceGet(out: Int32Array, ordinal: number): number;
  cuDeviceGetCount(out: Int32Array): number;
  cuDeviceGetName(out: Uint8Array, len: number, dev: number): number;
  cuDeviceGetAttribute(out: Int32Array, attr: number, dev: number): number;
  cuDeviceTotalMem(out: BigUint64Array, dev: number): number;
  cuMemGetInfo(free: BigUint64Array, total: BigUint64Array): number;
  cuDevicePrimaryCtxRetain(out: BigUint64Array, dev: number): number;
  cuDevicePrimaryCtxRelease(dev: number): number;
  cuDeviceCanAccessPeer(out: Int32Array, dev: number, peer: number): number;
  cuCtxSetCurrent(ctx: bigint): number;
  cuCtxSynchronize(): number;
  cuCtxEnablePeerAccess(peer: bigint, flags: number): number;
  cuStreamCreate(out: BigUint64Array, flags: number): number;
  cuStreamDestroy(stream: bigint): number;
  cuStreamSynchronize(stream: bigint): number;
  cuStreamBeginCapture(stream: bigint, mode: number): number;
  cuStreamEndCapture(stream: bigint, out: BigUint64Array): number;
  cuEventCreate(out: BigUint64Array, flags: number): number;
  cuEventRecord(event: bigint, stream: bigint): number;
  cuEventSynchronize(event: bigint): number;
  cuEventElapsedTime(outMs: Float32Array, start: bigint, end: bigint): number;
  cuEventDestroy(event: bigint): number;
  cuMemAlloc(out: BigUint64Array, bytes: number): number;
  cuMemFree(ptr: bigint): number;
  cuMemsetD8(ptr: bigint, value: number, count: number): number;
  cuMemsetD32(ptr: bigint, value: number, count: number): number;
  cuMemsetD8Async(ptr: bigint, value: number, count: number, stream: bigint): number;
  cuMemsetD32Async(ptr: bigint, value: number, count: number, stream: bigint): number;
  cuMemcpyHtoD(dst: bigint, src: VoidPtr, bytes: number): number;
  cuMemcpyDtoH(dst: VoidPtr, src: bigint, bytes: number): number;
  cuMemcpyDtoD(dst: bigint, src: bigint, bytes: number): number;
  cuMemcpyHtoDAsync(dst: bigint, src: VoidPtr, bytes: number, stream: bigint): number;
  cuMemcpyDtoHAsync(dst: VoidPtr, src: bigint, bytes: number, stream: bigint): number;
  cuMemcpyDtoDAsync(dst: bigint, src: bigint, bytes: number, stream: bigint): number;
  cuMemHostAlloc(out: BigUint64Array, bytes: number, flags: number): number;
  cuMemFreeHost(ptr: bigint): number;
  cuModuleLoadData(out: BigUint64Array, image: Uint8Array): number;
  cuModuleUnload(mod: bigint): number;
  cuModuleGetFunction(out: BigUint64Array, mod: bigint, name: string): number;
  cuFuncSetAttribute(fn: bigint, attr: number, value: number): number;
  cuFuncGetAttribute(out: Int32Array, attr: number, fn: bigint): number;
  cuLaunchKernel(
    fn: bigint,
    gx: number,
    gy: number,
    gz: number,
    bx: number,
    by: number,
    bz: number,
    sharedBytes: number,
    stream: bigint,
    params: bigint,
    extra: null,
  ): number;
  cuLaunchKernelEx(config: bigint, fn: bigint, params: bigint, extra: null): number;
  cuGraphInstantiateWithFlags(out: BigUint64Array, graph: bigint, flags: bigint): number;
  cuGraphLaunch(exec: bigint, stream: bigint): number;
  cuGraphExecDestroy(exec: bigint): number;
  cuGraphDestroy(graph: bigint): number;
  cuMemGetAllocationGranularity(out: BigUint64Array, prop: Uint8Array, option: number): number;
  cuMemCreate(out: BigUint64Array, bytes: number, prop: Uint8Array, flags: bigint): number;
  cuMemRelease(handle: bigint): number;
  cuMemAddressReserve(
    out: BigUint64Array,
    bytes: number,
    alignment: number,
    addr: bigint,
    flags: bigint,
  ): number;
  cuMemAddressFree(ptr: bigint, bytes: number): number;
  cuMemMap(ptr: bigint, bytes: number, offset: number, handle: bigint, flags: bigint): number;
  cuMemUnmap(ptr: bigint, bytes: number): number;
  cuMemSetAccess(ptr: bigint, bytes: number, desc: Uint8Array, count: number): number;
  cuMemExportToShareableHandle(out: Int32Array, handle: bigint, handleType: number, flags: bigint): number;
  /** `osHandle` is the file descriptor itself, passed as a pointer-sized integer (cuda.h's `(void*)(uintptr_t)fd`). */
  cuMemImportFromShareableHandle(out: BigUint64Array, osHandle: bigint, handleType: number): number;
  cuTensorMapEncodeTiled(
    map: Uint8Array,
    dataType: number,
    rank: number,
    globalAddress: bigint,
    globalDims: BigUint64Array,
    globalStrides: BigUint64Array,
    boxDims: Uint32Array,
    elementStrides: Uint32Array,
    interleave: number,
    swizzle: number,
    l2Promotion: number,
    oobFill: number,
  ): number;
}

/**
 * C declarations per function; when a function has several candidates the first symbol the library
 * exports wins (versioned names first, as cuda.h maps them for CUDA 13).
 */
const DRIVER_DECLARATIONS: Record<keyof DriverApi, string[]> = {
  cuInit: ["int cuInit(uint32_t flags)"],
  cuDriverGetVersion: ["int cuDriverGetVersion(void *out)"],
  cuGetErrorName: ["int cuGetErrorName(int code, void *out)"],
  cuGetErrorString: ["int cuGetErrorString(int code, void *out)"],
  cuDeviceGet: ["int cuDeviceGet(void *out, int ordinal)"],
  cuDeviceGetCount: ["int cuDeviceGetCount(void *out)"],
  cuDeviceGetName: ["int cuDeviceGetName(void *out, int len, int dev)"],
  cuDeviceGetAttribute: ["int cuDeviceGetAttribute(void *out, int attr, int dev)"],
  cuDeviceTotalMem: ["int cuDeviceTotalMem_v2(void *out, int dev)"],
  cuMemGetInfo: ["int cuMemGetInfo_v2(void *free, void *total)"],
  cuDevicePrimaryCtxRetain: ["int cuDevicePrimaryCtxRetain(void *out, int dev)"],
  cuDevicePrimaryCtxRelease: [
    "int cuDevicePrimaryCtxRelease_v2(int dev)",
    "int cuDevicePrimaryCtxRelease(int dev)",
  ],
  cuDeviceCanAccessPeer: ["int cuDeviceCanAccessPeer(void *out, int dev, int peer)"],
  cuCtxSetCurrent: ["int cuCtxSetCurrent(void *ctx)"],
  cuCtxSynchronize: ["int cuCtxSynchronize()"],
  cuCtxEnablePeerAccess: ["int cuCtxEnablePeerAccess(void *peer, uint32_t flags)"],
  cuStreamCreate: ["int cuStreamCreate(void *out, uint32_t flags)"],
  cuStreamDestroy: ["int cuStreamDestroy_v2(void *stream)"],
  cuStreamSynchronize: ["int cuStreamSynchronize(void *stream)"],
  cuStreamBeginCapture: ["int cuStreamBeginCapture_v2(void *stream, int mode)"],
  cuStreamEndCapture: ["int cuStreamEndCapture(void *stream, void *out)"],
  cuEventCreate: ["int cuEventCreate(void *out, uint32_t flags)"],
  cuEventRecord: ["int cuEventRecord(void *event, void *stream)"],
  cuEventSynchronize: ["int cuEventSynchronize(void *event)"],
  cuEventElapsedTime: [
    "int cuEventElapsedTime_v2(void *outMs, void *start, void *end)",
    "int cuEventElapsedTime(void *outMs, void *start, void *end)",
  ],
  cuEventDestroy: ["int cuEventDestroy_v2(void *event)"],
  cuMemAlloc: ["int cuMemAlloc_v2(void *out, size_t bytes)"],
  cuMemFree: ["int cuMemFree_v2(uint64_t ptr)"],
  cuMemsetD8: ["int cuMemsetD8_v2(uint64_t ptr, uint8_t value, size_t count)"],
  cuMemsetD32: ["int cuMemsetD32_v2(uint64_t ptr, uint32_t value, size_t count)"],
  cuMemsetD8Async: ["int cuMemsetD8Async(uint64_t ptr, uint8_t value, size_t count, void *stream)"],
  cuMemsetD32Async: ["int cuMemsetD32Async(uint64_t ptr, uint32_t value, size_t count, void *stream)"],
  cuMemcpyHtoD: ["int cuMemcpyHtoD_v2(uint64_t dst, void *src, size_t bytes)"],
  cuMemcpyDtoH: ["int cuMemcpyDtoH_v2(void *dst, uint64_t src, size_t bytes)"],
  cuMemcpyDtoD: ["int cuMemcpyDtoD_v2(uint64_t dst, uint64_t src, size_t bytes)"],
  cuMemcpyHtoDAsync: ["int cuMemcpyHtoDAsync_v2(uint64_t dst, void *src, size_t bytes, void *stream)"],
  cuMemcpyDtoHAsync: ["int cuMemcpyDtoHAsync_v2(void *dst, uint64_t src, size_t bytes, void *stream)"],
  cuMemcpyDtoDAsync: ["int cuMemcpyDtoDAsync_v2(uint64_t dst, uint64_t src, size_t bytes, void *stream)"],
  cuMemHostAlloc: ["int cuMemHostAlloc(void *out, size_t bytes, uint32_t flags)"],
  cuMemFreeHost: ["int cuMemFreeHost(void *ptr)"],
  cuModuleLoadData: ["int cuModuleLoadData(void *out, void *image)"],
  cuModuleUnload: ["int cuModuleUnload(void *mod)"],
  cuModuleGetFunction: ["int cuModuleGetFunction(void *out, void *mod, const char *name)"],
  cuFuncSetAttribute: ["int cuFuncSetAttribute(void *fn, int attr, int value)"],
  cuFuncGetAttribute: ["int cuFuncGetAttribute(void *out, int attr, void *fn)"],
  cuLaunchKernel: [
    "int cuLaunchKernel(void *fn, uint32_t gx, uint32_t gy, uint32_t gz, uint32_t bx, uint32_t by, uint32_t bz, uint32_t sharedBytes, void *stream, void *params, void *extra)",
  ],
  cuLaunchKernelEx: ["int cuLaunchKernelEx(void *config, void *fn, void *params, void *extra)"],
  cuGraphInstantiateWithFlags: ["int cuGraphInstantiateWithFlags(void *out, void *graph, uint64_t flags)"],
  cuGraphLaunch: ["int cuGraphLaunch(void *exec, void *stream)"],
  cuGraphExecDestroy: ["int cuGraphExecDestroy(void *exec)"],
  cuGraphDestroy: ["int cuGraphDestroy(void *graph)"],
  // Virtual memory management (cuda.h maps none of these to versioned names in CUDA 13).
  cuMemGetAllocationGranularity: ["int cuMemGetAllocationGranularity(void *out, void *prop, int option)"],
  cuMemCreate: ["int cuMemCreate(void *out, size_t bytes, void *prop, uint64_t flags)"],
  cuMemRelease: ["int cuMemRelease(uint64_t handle)"],
  cuMemAddressReserve: [
    "int cuMemAddressReserve(void *out, size_t bytes, size_t alignment, uint64_t addr, uint64_t flags)",
  ],
  cuMemAddressFree: ["int cuMemAddressFree(uint64_t ptr, size_t bytes)"],
  cuMemMap: ["int cuMemMap(uint64_t ptr, size_t bytes, size_t offset, uint64_t handle, uint64_t flags)"],
  cuMemUnmap: ["int cuMemUnmap(uint64_t ptr, size_t bytes)"],
  cuMemSetAccess: ["int cuMemSetAccess(uint64_t ptr, size_t bytes, void *desc, size_t count)"],
  cuMemExportToShareableHandle: [
    "int cuMemExportToShareableHandle(void *out, uint64_t handle, int handleType, uint64_t flags)",
  ],
  cuMemImportFromShareableHandle: [
    "int cuMemImportFromShareableHandle(void *out, uintptr_t osHandle, int handleType)",
  ],
  cuTensorMapEncodeTiled: [
    "int cuTensorMapEncodeTiled(void *map, int dataType, uint32_t rank, void *globalAddress, void *globalDims, void *globalStrides, void *boxDims, void *elementStrides, int interleave, int swizzle, int l2Promotion, int oobFill)",
  ],
};

/** What availability calls before anything else: a library without them is not the CUDA driver at all. */
const CORE_DRIVER_FUNCTIONS: readonly (keyof DriverApi)[] = [
  "cuInit",
  "cuDriverGetVersion",
  "cuDeviceGetCount",
  "cuGetErrorName",
  "cuGetErrorString",
];

/**
 * Bind every driver function; a symbol the library lacks becomes a function that throws when called.
 * `missing` lists the functions none of whose symbols the library exports.
 */
function bindDriver(lib: KoffiLibrary, libPath: string): { api: DriverApi; missing: (keyof DriverApi)[] } {
  const api: Partial<Record<keyof DriverApi, unknown>> = {};
  const missing: (keyof DriverApi)[] = [];
  for (const [name, candidates] of Object.entries(DRIVER_DECLARATIONS) as [keyof DriverApi, string[]][]) {
    for (const declaration of candidates) {
      try {
        api[name] = bindFunction(lib, declaration);
        break;
      } catch {
        // symbol absent: try the next candidate
      }
    }
    if (api[name] === undefined) {
      missing.push(name);
      api[name] = () => {
        throw new Error(`${name}: none of its symbols is exported by ${libPath} (driver too old?)`);
      };
    }
  }
  return { api: api as DriverApi, missing };
}

/**
 * The CudaError of a library that lacks the driver API's core functions (another library named by
 * `$MEGAMOE_LIBCUDA`, say libc): it names the variable and its value when the variable chose it.
 */
function notDriverError(libraryPath: string, missing: readonly string[]): CudaError {
  const chosen = process.env.MEGAMOE_LIBCUDA ? `MEGAMOE_LIBCUDA=${process.env.MEGAMOE_LIBCUDA}: ` : "";
  return new CudaError(
    missing[0] ?? "cuInit",
    CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND,
    `${chosen}${libraryPath} is not the CUDA driver library (libcuda.so.1): it exports none of ${missing.join(", ")}`,
  );
}

const CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND = 302;

// ---------------------------------------------------------------------------------------------------
// Loading and availability

/** Whether CUDA can be used here, and if not, why (library missing, cuInit failed, no device). */
export type CudaAvailability =
  | { ok: true; libraryPath: string; driverVersion: number; deviceCount: number }
  | { ok: false; reason: string };

let loaded: { api: DriverApi; libraryPath: string } | undefined;
let availability: CudaAvailability | undefined;
/** The CudaError behind an unusable availability, when there is one: requireCuda throws it as it is. */
let unusable: CudaError | undefined;
/** The bound driver; set once `cudaAvailability()` succeeded (every driver class exists only after that). */
export let cu: DriverApi;

// Scratch out-parameters (single-threaded use; on stable off-heap memory).
export const outU64 = new BigUint64Array(new ArrayBuffer(8));
export const outI32 = new Int32Array(new ArrayBuffer(4));
export const outF32 = new Float32Array(new ArrayBuffer(4));

/**
 * Load libcuda, `cuInit(0)` and count devices, once per process. Never throws: a failure is reported
 * as `{ ok: false, reason }`. The reason names the step that failed and, for a missing library, every
 * place searched.
 */
export function cudaAvailability(): CudaAvailability {
  if (availability) return availability;
  availability = probeCuda();
  return availability;
}

function probeCuda(): CudaAvailability {
  let k: ReturnType<typeof koffi>;
  try {
    k = koffi();
  } catch (e) {
    return { ok: false, reason: (e as Error).message };
  }
  const located = locateLibcuda();
  let lib: KoffiLibrary;
  let libraryPath: string;
  if (located.ok) {
    libraryPath = located.path;
    try {
      lib = k.load(libraryPath);
    } catch (e) {
      return { ok: false, reason: `libcuda at ${libraryPath} failed to load: ${(e as Error).message}` };
    }
  } else {
    // Last resort: the dynamic loader's own search (ld.so.cache), unless the user named a file.
    if (process.env.MEGAMOE_LIBCUDA) return { ok: false, reason: located.reason };
    try {
      lib = k.load("libcuda.so.1");
      libraryPath = "libcuda.so.1 (dynamic loader search)";
    } catch (e) {
      return { ok: false, reason: `${located.reason}; dlopen("libcuda.so.1"): ${(e as Error).message}` };
    }
  }
  const { api, missing } = bindDriver(lib, libraryPath);
  const missingCore = CORE_DRIVER_FUNCTIONS.filter((f) => missing.includes(f));
  // Calling a missing core function would throw out of this function, which must never throw.
  if (missingCore.length > 0) {
    unusable = notDriverError(libraryPath, missingCore);
    return { ok: false, reason: unusable.message };
  }
  loaded = { api, libraryPath };
  const init = api.cuInit(0);
  if (init !== 0) {
    const { name, text } = describeCudaError(init);
    return { ok: false, reason: `cuInit failed with ${name} (${init}): ${text} (library ${libraryPath})` };
  }
  let code = api.cuDriverGetVersion(outI32);
  const driverVersion = code === 0 ? outI32[0]! : 0;
  code = api.cuDeviceGetCount(outI32);
  if (code !== 0) return { ok: false, reason: new CudaError("cuDeviceGetCount", code).message };
  const deviceCount = outI32[0]!;
  if (deviceCount === 0) {
    const visible = process.env.CUDA_VISIBLE_DEVICES;
    return {
      ok: false,
      reason: `no CUDA device visible${visible !== undefined ? ` (CUDA_VISIBLE_DEVICES=${visible})` : ""} (library ${libraryPath})`,
    };
  }
  cu = api;
  return { ok: true, libraryPath, driverVersion, deviceCount };
}

export function requireCuda(): void {
  const a = cudaAvailability();
  if (unusable !== undefined) throw unusable;
  if (!a.ok) throw new Error(`CUDA is not available: ${a.reason}`);
}
