/**
 * The CUDA driver API through koffi: devices, memory, streams, events, modules, launches, graphs, TMA maps.
 *
 * Loading is lazy: importing this module touches no native library. The first `openDevice` (or
 * `cudaAvailability`) locates and loads libcuda, calls `cuInit` and counts devices; when any step fails
 * `cudaAvailability()` says which and why, and `openDevice` throws that reason.
 *
 * Every driver call is checked; a failure throws {@link CudaError} naming the call and the CUDA error.
 * Handles (contexts, streams, events, modules, functions, graphs) and device pointers are bigints.
 * The hot path (launch, async copy/memset, event record, graph launch) is synchronous and allocates
 * nothing per call: out-parameters use preallocated scratch arrays, kernel arguments a reusable
 * {@link KernelArgs}, and `launchEx` a per-kernel preallocated `CUlaunchConfig`.
 *
 * Streams are created blocking (not CU_STREAM_NON_BLOCKING) so that the synchronous copies used by
 * `DeviceTensor.toHost()` on the legacy default stream wait for kernels queued on our streams.
 */

import { bindFunction, type KoffiLibrary, koffi, readCString, viewNativeMemory } from "./ffi.js";
import { alignedHostBytes, type KernelArgs } from "./kernel-args.js";
import { locateLibcuda } from "./locate.js";

export { allocTensorMapBytes, KernelArgs, type KernelArgsLayout, TENSOR_MAP_BYTES } from "./kernel-args.js";

/** `Symbol.dispose` where the runtime has it, else the symbol Node 20 uses for it. */
export const disposeSymbol: typeof Symbol.dispose =
  Symbol.dispose ?? (Symbol.for("nodejs.dispose") as typeof Symbol.dispose);

// ---------------------------------------------------------------------------------------------------
// Constants (values from cuda.h, CUDA 13.0; test/cuda/cuda-header.test.ts checks them against the header)

/** `CUdevice_attribute` values used here. */
export const DeviceAttribute = {
  MAX_THREADS_PER_BLOCK: 1,
  MAX_SHARED_MEMORY_PER_BLOCK: 8,
  WARP_SIZE: 10,
  MAX_REGISTERS_PER_BLOCK: 12,
  CLOCK_RATE: 13,
  MULTIPROCESSOR_COUNT: 16,
  PCI_BUS_ID: 33,
  MEMORY_CLOCK_RATE: 36,
  GLOBAL_MEMORY_BUS_WIDTH: 37,
  L2_CACHE_SIZE: 38,
  COMPUTE_CAPABILITY_MAJOR: 75,
  COMPUTE_CAPABILITY_MINOR: 76,
  MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: 81,
  MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 97,
  CLUSTER_LAUNCH: 120,
} as const;

/** `CUfunction_attribute` values. */
export const FunctionAttribute = {
  MAX_THREADS_PER_BLOCK: 0,
  SHARED_SIZE_BYTES: 1,
  CONST_SIZE_BYTES: 2,
  LOCAL_SIZE_BYTES: 3,
  NUM_REGS: 4,
  PTX_VERSION: 5,
  BINARY_VERSION: 6,
  MAX_DYNAMIC_SHARED_SIZE_BYTES: 8,
  PREFERRED_SHARED_MEMORY_CARVEOUT: 9,
  NON_PORTABLE_CLUSTER_SIZE_ALLOWED: 14,
} as const;

/** `CUtensorMapDataType`. */
export const TensorMapDataType = {
  UINT8: 0,
  UINT16: 1,
  UINT32: 2,
  INT32: 3,
  UINT64: 4,
  INT64: 5,
  FLOAT16: 6,
  FLOAT32: 7,
  FLOAT64: 8,
  BFLOAT16: 9,
  FLOAT32_FTZ: 10,
  TFLOAT32: 11,
  TFLOAT32_FTZ: 12,
} as const;

/** `CUtensorMapSwizzle` (the 128B_ATOM variants are Blackwell-only and left out). */
export const TensorMapSwizzle = { NONE: 0, B32: 1, B64: 2, B128: 3 } as const;
/** `CUtensorMapInterleave`. */
export const TensorMapInterleave = { NONE: 0, B16: 1, B32: 2 } as const;
/** `CUtensorMapL2promotion`. */
export const TensorMapL2Promotion = { NONE: 0, B64: 1, B128: 2, B256: 3 } as const;
/** `CUtensorMapFloatOOBfill`. */
export const TensorMapOobFill = { NONE: 0, NAN_REQUEST_ZERO_FMA: 1 } as const;

/** `CUstreamCaptureMode`. */
export const StreamCaptureMode = { GLOBAL: 0, THREAD_LOCAL: 1, RELAXED: 2 } as const;

/** `CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`. */
export const LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4;
/** Byte layout of `CUlaunchConfig` / `CUlaunchAttribute` on 64-bit Linux (checked against cuda.h by a test). */
export const LAUNCH_CONFIG_LAYOUT = {
  size: 56,
  gridDimX: 0,
  blockDimX: 12,
  sharedMemBytes: 24,
  hStream: 32,
  attrs: 40,
  numAttrs: 48,
  attributeSize: 72,
  attributeValue: 8,
} as const;

/** Dynamic shared memory a kernel may use without opting in through `setMaxDynamicSharedMemory`. */
export const DEFAULT_MAX_DYNAMIC_SHARED_BYTES = 48 * 1024;

/** Element size in bytes of each tensor-map data type. */
const TENSOR_MAP_ELEMENT_BYTES: Record<number, number> = {
  0: 1,
  1: 2,
  2: 4,
  3: 4,
  4: 8,
  5: 8,
  6: 2,
  7: 4,
  8: 8,
  9: 2,
  10: 4,
  11: 4,
  12: 4,
};

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
  400: "CUDA_ERROR_INVALID_HANDLE",
  500: "CUDA_ERROR_NOT_FOUND",
  700: "CUDA_ERROR_ILLEGAL_ADDRESS",
  701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
  719: "CUDA_ERROR_LAUNCH_FAILED",
  999: "CUDA_ERROR_UNKNOWN",
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
    text: "(no description available)",
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
function check(call: string, code: number, detail?: string): void {
  if (code !== 0) throw new CudaError(call, code, detail);
}

// ---------------------------------------------------------------------------------------------------
// Raw bindings

/** Anything koffi accepts for a `void*`: a typed array / Buffer (its bytes), a bigint address, or null. */
type VoidPtr = ArrayBufferView | bigint | null;

/** The driver functions used, as bound by koffi (each returns a CUresult). */
interface DriverApi {
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
  cuTensorMapEncodeTiled: [
    "int cuTensorMapEncodeTiled(void *map, int dataType, uint32_t rank, void *globalAddress, void *globalDims, void *globalStrides, void *boxDims, void *elementStrides, int interleave, int swizzle, int l2Promotion, int oobFill)",
  ],
};

/** Bind every driver function; a symbol the library lacks becomes a function that throws when called. */
function bindDriver(lib: KoffiLibrary, libPath: string): DriverApi {
  const api: Partial<Record<keyof DriverApi, unknown>> = {};
  for (const [name, candidates] of Object.entries(DRIVER_DECLARATIONS) as [keyof DriverApi, string[]][]) {
    for (const declaration of candidates) {
      try {
        api[name] = bindFunction(lib, declaration);
        break;
      } catch {
        // symbol absent: try the next candidate
      }
    }
    api[name] ??= () => {
      throw new Error(`${name}: none of its symbols is exported by ${libPath} (driver too old?)`);
    };
  }
  return api as DriverApi;
}

// ---------------------------------------------------------------------------------------------------
// Loading and availability

/** Whether CUDA can be used here, and if not, why (library missing, cuInit failed, no device). */
export type CudaAvailability =
  | { ok: true; libraryPath: string; driverVersion: number; deviceCount: number }
  | { ok: false; reason: string };

let loaded: { api: DriverApi; libraryPath: string } | undefined;
let availability: CudaAvailability | undefined;
/** The bound driver; set once `cudaAvailability()` succeeded (every class below exists only after that). */
let cu: DriverApi;

// Scratch out-parameters (single-threaded use; on stable off-heap memory).
const outU64 = new BigUint64Array(new ArrayBuffer(8));
const outI32 = new Int32Array(new ArrayBuffer(4));
const outF32 = new Float32Array(new ArrayBuffer(4));

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
  const api = bindDriver(lib, libraryPath);
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

function requireCuda(): void {
  const a = cudaAvailability();
  if (!a.ok) throw new Error(`CUDA is not available: ${a.reason}`);
}

// ---------------------------------------------------------------------------------------------------
// Device

/** Grid / block / cluster dimensions: a number means (n, 1, 1). */
export type Dim3 = number | readonly [number, number, number];

function dimX(d: Dim3): number {
  return typeof d === "number" ? d : d[0];
}
function dimY(d: Dim3): number {
  return typeof d === "number" ? 1 : d[1];
}
function dimZ(d: Dim3): number {
  return typeof d === "number" ? 1 : d[2];
}

/** Host memory a copy may read from or write to: a typed array / Buffer, or pinned memory. */
export type HostMemory = ArrayBufferView | PinnedBuffer;

function hostPointer(m: HostMemory): VoidPtr {
  return m instanceof PinnedBuffer ? m.ptr : m;
}
function hostBytes(m: HostMemory): number {
  return m instanceof PinnedBuffer ? m.bytes : m.byteLength;
}

let currentContext = 0n;
const openDevices = new Map<number, Device>();

/**
 * Open GPU `ordinal` (retain its primary context and make it current). Returns the same object for the
 * same ordinal; properties are read once here.
 * @throws Error with the availability reason when CUDA cannot be used
 */
export function openDevice(ordinal = 0): Device {
  const existing = openDevices.get(ordinal);
  if (existing) {
    existing.makeCurrent();
    return existing;
  }
  requireCuda();
  const device = new Device(ordinal);
  openDevices.set(ordinal, device);
  return device;
}

/** One GPU with its primary context. Create through {@link openDevice}. */
export class Device {
  readonly ordinal: number;
  /** The `CUdevice` handle. */
  readonly handle: number;
  /** The primary `CUcontext`. */
  readonly context: bigint;
  readonly name: string;
  readonly smCount: number;
  readonly computeCapability: { major: number; minor: number };
  /** Total device memory in bytes. */
  readonly totalMemoryBytes: number;
  readonly l2CacheBytes: number;
  /** Largest dynamic shared memory one block may opt into (bytes). */
  readonly maxSharedMemoryPerBlockOptin: number;
  readonly maxSharedMemoryPerSm: number;
  /** SM clock in kHz (as reported by CU_DEVICE_ATTRIBUTE_CLOCK_RATE). */
  readonly clockRateKHz: number;
  readonly memoryClockRateKHz: number;
  readonly memoryBusWidthBits: number;
  /** Driver version as an integer, e.g. 13000. */
  readonly driverVersion: number;
  /** The legacy default stream (handle 0). */
  readonly nullStream: Stream;
  private readonly allocations = new Map<bigint, number>();
  private allocatedTotal = 0;
  private released = false;

  /** @internal use {@link openDevice} */
  constructor(ordinal: number) {
    this.ordinal = ordinal;
    check("cuDeviceGet", cu.cuDeviceGet(outI32, ordinal), `ordinal ${ordinal}`);
    this.handle = outI32[0]!;
    check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(outU64, this.handle));
    this.context = outU64[0]!;
    this.makeCurrent();
    const nameBytes = new Uint8Array(256);
    check("cuDeviceGetName", cu.cuDeviceGetName(nameBytes, nameBytes.length, this.handle));
    const end = nameBytes.indexOf(0);
    this.name = new TextDecoder().decode(nameBytes.subarray(0, end < 0 ? nameBytes.length : end));
    check("cuDeviceTotalMem_v2", cu.cuDeviceTotalMem(outU64, this.handle));
    this.totalMemoryBytes = Number(outU64[0]);
    this.smCount = this.attribute(DeviceAttribute.MULTIPROCESSOR_COUNT);
    this.computeCapability = {
      major: this.attribute(DeviceAttribute.COMPUTE_CAPABILITY_MAJOR),
      minor: this.attribute(DeviceAttribute.COMPUTE_CAPABILITY_MINOR),
    };
    this.l2CacheBytes = this.attribute(DeviceAttribute.L2_CACHE_SIZE);
    this.maxSharedMemoryPerBlockOptin = this.attribute(DeviceAttribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    this.maxSharedMemoryPerSm = this.attribute(DeviceAttribute.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR);
    this.clockRateKHz = this.attribute(DeviceAttribute.CLOCK_RATE);
    this.memoryClockRateKHz = this.attribute(DeviceAttribute.MEMORY_CLOCK_RATE);
    this.memoryBusWidthBits = this.attribute(DeviceAttribute.GLOBAL_MEMORY_BUS_WIDTH);
    check("cuDriverGetVersion", cu.cuDriverGetVersion(outI32));
    this.driverVersion = outI32[0]!;
    this.nullStream = new Stream(this, 0n);
  }

  /** e.g. "sm_90" (add the "a" suffix yourself for arch-specific features). */
  get smArch(): string {
    return `sm_${this.computeCapability.major}${this.computeCapability.minor}`;
  }

  /** Bytes currently allocated through {@link alloc} and not freed. */
  get allocatedBytes(): number {
    return this.allocatedTotal;
  }

  /**
   * Free and total memory of the device as the driver reports them (cuMemGetInfo): everything any
   * process or the driver holds, modules and local memory included, unlike {@link allocatedBytes}.
   */
  memoryInfo(): { freeBytes: number; totalBytes: number } {
    this.makeCurrent();
    const free = new BigUint64Array(1);
    const total = new BigUint64Array(1);
    check("cuMemGetInfo_v2", cu.cuMemGetInfo(free, total));
    return { freeBytes: Number(free[0]), totalBytes: Number(total[0]) };
  }

  /** Read any `CUdevice_attribute` (see {@link DeviceAttribute}). */
  attribute(attr: number): number {
    check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(outI32, attr, this.handle), `attribute ${attr}`);
    return outI32[0]!;
  }

  /** Make this device's context current on the calling thread (cheap when it already is). */
  makeCurrent(): void {
    if (currentContext === this.context) return;
    if (this.released) throw new Error(`device ${this.ordinal} was closed`);
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(this.context));
    currentContext = this.context;
  }

  /** Wait for all work on this device. */
  synchronize(): void {
    this.makeCurrent();
    check("cuCtxSynchronize", cu.cuCtxSynchronize());
  }

  /** Allocate `bytes` of device memory (uninitialized). Zero bytes gives the null pointer. */
  alloc(bytes: number): bigint {
    if (!Number.isSafeInteger(bytes) || bytes < 0) throw new RangeError(`alloc: bad byte count ${bytes}`);
    if (bytes === 0) return 0n;
    this.makeCurrent();
    check(
      "cuMemAlloc_v2",
      cu.cuMemAlloc(outU64, bytes),
      `${bytes} bytes; ${this.allocatedTotal} already allocated`,
    );
    const ptr = outU64[0]!;
    this.allocations.set(ptr, bytes);
    this.allocatedTotal += bytes;
    return ptr;
  }

  /** Free memory from {@link alloc}. Freeing 0n is a no-op. */
  free(ptr: bigint): void {
    if (ptr === 0n) return;
    const bytes = this.allocations.get(ptr);
    if (bytes === undefined)
      throw new Error(`free: 0x${ptr.toString(16)} was not allocated by device ${this.ordinal}`);
    this.makeCurrent();
    check("cuMemFree_v2", cu.cuMemFree(ptr));
    this.allocations.delete(ptr);
    this.allocatedTotal -= bytes;
  }

  /** Allocate page-locked host memory (fast, truly asynchronous copies). */
  allocPinned(bytes: number): PinnedBuffer {
    if (!Number.isSafeInteger(bytes) || bytes <= 0)
      throw new RangeError(`allocPinned: bad byte count ${bytes}`);
    this.makeCurrent();
    check("cuMemHostAlloc", cu.cuMemHostAlloc(outU64, bytes, 0), `${bytes} bytes`);
    return new PinnedBuffer(outU64[0]!, bytes);
  }

  /**
   * Copy host → device. Without a stream the copy is synchronous; with one it is queued on it (then the
   * host memory must stay alive and unchanged until the stream reaches the copy).
   */
  copyHtoD(dst: bigint, src: HostMemory, bytes = hostBytes(src), stream?: Stream | null): void {
    if (stream) {
      check("cuMemcpyHtoDAsync_v2", cu.cuMemcpyHtoDAsync(dst, hostPointer(src), bytes, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemcpyHtoD_v2", cu.cuMemcpyHtoD(dst, hostPointer(src), bytes));
    }
  }

  /** Copy device → host; synchronous without a stream, queued with one (wait on the stream before reading). */
  copyDtoH(dst: HostMemory, src: bigint, bytes = hostBytes(dst), stream?: Stream | null): void {
    if (stream) {
      check("cuMemcpyDtoHAsync_v2", cu.cuMemcpyDtoHAsync(hostPointer(dst), src, bytes, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemcpyDtoH_v2", cu.cuMemcpyDtoH(hostPointer(dst), src, bytes));
    }
  }

  /** Copy device → device. */
  copyDtoD(dst: bigint, src: bigint, bytes: number, stream?: Stream | null): void {
    if (stream) {
      check("cuMemcpyDtoDAsync_v2", cu.cuMemcpyDtoDAsync(dst, src, bytes, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemcpyDtoD_v2", cu.cuMemcpyDtoD(dst, src, bytes));
    }
  }

  /** Set `count` bytes at `ptr` to `value` (0..255). */
  memsetD8(ptr: bigint, value: number, count: number, stream?: Stream | null): void {
    if (stream) {
      check("cuMemsetD8Async", cu.cuMemsetD8Async(ptr, value, count, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemsetD8_v2", cu.cuMemsetD8(ptr, value, count));
    }
  }

  /** Set `count` 32-bit words at `ptr` (4-byte aligned) to `value`. */
  memsetD32(ptr: bigint, value: number, count: number, stream?: Stream | null): void {
    if (stream) {
      check("cuMemsetD32Async", cu.cuMemsetD32Async(ptr, value >>> 0, count, stream.handle));
    } else {
      this.makeCurrent();
      check("cuMemsetD32_v2", cu.cuMemsetD32(ptr, value >>> 0, count));
    }
  }

  /** A new (blocking) stream. */
  createStream(): Stream {
    this.makeCurrent();
    check("cuStreamCreate", cu.cuStreamCreate(outU64, 0));
    return new Stream(this, outU64[0]!);
  }

  /** A new event; `timing: false` makes a lighter event that cannot be timed. */
  createEvent(options: { timing?: boolean; blockingSync?: boolean } = {}): Event {
    this.makeCurrent();
    const flags = (options.blockingSync ? 1 : 0) | (options.timing === false ? 2 : 0);
    check("cuEventCreate", cu.cuEventCreate(outU64, flags));
    return new Event(this, outU64[0]!);
  }

  /** Load a cubin (ELF image) into this context. */
  loadModule(image: Uint8Array): Module {
    this.makeCurrent();
    check("cuModuleLoadData", cu.cuModuleLoadData(outU64, image), `${image.byteLength}-byte image`);
    return new Module(this, outU64[0]!);
  }

  /** Whether this device can map `peer`'s memory directly. */
  canAccessPeer(peer: Device): boolean {
    check("cuDeviceCanAccessPeer", cu.cuDeviceCanAccessPeer(outI32, this.handle, peer.handle));
    return outI32[0] !== 0;
  }

  /** Let kernels on this device access `peer`'s memory. Enabling twice is not an error. */
  enablePeerAccess(peer: Device): void {
    this.makeCurrent();
    const code = cu.cuCtxEnablePeerAccess(peer.context, 0);
    if (code !== 704 /* CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED */) {
      check("cuCtxEnablePeerAccess", code, `device ${this.ordinal} → ${peer.ordinal}`);
    }
  }

  /** Release the primary context; the object is unusable afterwards. */
  close(): void {
    if (this.released) return;
    check("cuDevicePrimaryCtxRelease_v2", cu.cuDevicePrimaryCtxRelease(this.handle));
    this.released = true;
    if (currentContext === this.context) currentContext = 0n;
    openDevices.delete(this.ordinal);
  }

  /** A short description, e.g. "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB, L2 60 MiB)". */
  describe(): string {
    const gib = (this.totalMemoryBytes / 2 ** 30).toFixed(1);
    const l2 = (this.l2CacheBytes / 2 ** 20).toFixed(0);
    return `${this.name} (${this.smArch}, ${this.smCount} SMs, ${gib} GiB, L2 ${l2} MiB)`;
  }
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

/** A CUDA stream. Work queued on it runs in order. */
export class Stream {
  readonly device: Device;
  /** The `CUstream` (0n for the legacy default stream). */
  readonly handle: bigint;
  private destroyed = false;

  /** @internal use `device.createStream()` */
  constructor(device: Device, handle: bigint) {
    this.device = device;
    this.handle = handle;
  }

  /** Wait until everything queued so far has finished. */
  synchronize(): void {
    check("cuStreamSynchronize", cu.cuStreamSynchronize(this.handle));
  }

  destroy(): void {
    if (this.destroyed || this.handle === 0n) return;
    check("cuStreamDestroy_v2", cu.cuStreamDestroy(this.handle));
    this.destroyed = true;
  }

  [disposeSymbol](): void {
    this.destroy();
  }
}

/** A CUDA event, for ordering and timing. */
export class Event {
  readonly device: Device;
  readonly handle: bigint;
  private destroyed = false;

  /** @internal use `device.createEvent()` */
  constructor(device: Device, handle: bigint) {
    this.device = device;
    this.handle = handle;
  }

  /** Record this event at the current end of `stream`. */
  record(stream: Stream): void {
    check("cuEventRecord", cu.cuEventRecord(this.handle, stream.handle));
  }

  /** Wait until the recorded work is done. */
  synchronize(): void {
    check("cuEventSynchronize", cu.cuEventSynchronize(this.handle));
  }

  /** Milliseconds between two recorded (and completed) events. */
  static elapsedMs(start: Event, end: Event): number {
    check("cuEventElapsedTime", cu.cuEventElapsedTime(outF32, start.handle, end.handle));
    return outF32[0]!;
  }

  destroy(): void {
    if (this.destroyed) return;
    check("cuEventDestroy_v2", cu.cuEventDestroy(this.handle));
    this.destroyed = true;
  }

  [disposeSymbol](): void {
    this.destroy();
  }
}

/** A loaded cubin. */
export class Module {
  readonly device: Device;
  readonly handle: bigint;
  private unloaded = false;

  /** @internal use `device.loadModule()` */
  constructor(device: Device, handle: bigint) {
    this.device = device;
    this.handle = handle;
  }

  /** The kernel named `name` (its symbol name: use `extern "C"` kernels to avoid C++ mangling). */
  getFunction(name: string): Kernel {
    this.device.makeCurrent();
    check("cuModuleGetFunction", cu.cuModuleGetFunction(outU64, this.handle, name), `kernel "${name}"`);
    return new Kernel(this, name, outU64[0]!);
  }

  unload(): void {
    if (this.unloaded) return;
    this.device.makeCurrent();
    check("cuModuleUnload", cu.cuModuleUnload(this.handle));
    this.unloaded = true;
  }

  [disposeSymbol](): void {
    this.unload();
  }
}

/** One kernel of a loaded module, launchable with {@link KernelArgs}. */
let kernelLaunchCount = 0;

/**
 * Kernel launches queued by this process so far (every `Kernel.launch`, captured ones included): the
 * difference over a piece of work is how many launches it costs.
 */
export function kernelLaunches(): number {
  return kernelLaunchCount;
}

export class Kernel {
  readonly module: Module;
  readonly device: Device;
  readonly name: string;
  /** The `CUfunction`. */
  readonly handle: bigint;
  private maxDynamicShared = DEFAULT_MAX_DYNAMIC_SHARED_BYTES;
  /** Preallocated `CUlaunchConfig` + one `CUlaunchAttribute` for `launchEx`. */
  private exConfig: DataView | undefined;
  private exConfigAddress = 0n;

  /** @internal use `module.getFunction()` */
  constructor(module: Module, name: string, handle: bigint) {
    this.module = module;
    this.device = module.device;
    this.name = name;
    this.handle = handle;
  }

  /** Read a `CUfunction_attribute` (see {@link FunctionAttribute}). */
  getAttribute(attr: number): number {
    check(
      "cuFuncGetAttribute",
      cu.cuFuncGetAttribute(outI32, attr, this.handle),
      `${this.name}, attribute ${attr}`,
    );
    return outI32[0]!;
  }

  /** Set a `CUfunction_attribute`. */
  setAttribute(attr: number, value: number): this {
    check(
      "cuFuncSetAttribute",
      cu.cuFuncSetAttribute(this.handle, attr, value),
      `${this.name}, attribute ${attr} = ${value}`,
    );
    if (attr === FunctionAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES) this.maxDynamicShared = value;
    return this;
  }

  /** Allow launches with up to `bytes` of dynamic shared memory (needed above 48 KiB). */
  setMaxDynamicSharedMemory(bytes: number): this {
    if (bytes > this.device.maxSharedMemoryPerBlockOptin) {
      throw new RangeError(
        `${this.name}: ${bytes} bytes of dynamic shared memory exceed the device's ${this.device.maxSharedMemoryPerBlockOptin}`,
      );
    }
    return this.setAttribute(FunctionAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes);
  }

  /** Registers per thread, as compiled. */
  get numRegisters(): number {
    return this.getAttribute(FunctionAttribute.NUM_REGS);
  }

  private checkShared(sharedBytes: number): void {
    if (sharedBytes > this.maxDynamicShared) {
      throw new RangeError(
        `${this.name}: launch asks ${sharedBytes} bytes of dynamic shared memory but the limit set is ${this.maxDynamicShared}; call setMaxDynamicSharedMemory first`,
      );
    }
  }

  /** Launch on `stream` (null: the legacy default stream). Synchronous to queue, no per-call allocation. */
  launch(grid: Dim3, block: Dim3, sharedBytes: number, stream: Stream | null, args: KernelArgs): void {
    if (sharedBytes > DEFAULT_MAX_DYNAMIC_SHARED_BYTES) this.checkShared(sharedBytes);
    if (currentContext !== this.device.context) this.device.makeCurrent();
    const code = cu.cuLaunchKernel(
      this.handle,
      dimX(grid),
      dimY(grid),
      dimZ(grid),
      dimX(block),
      dimY(block),
      dimZ(block),
      sharedBytes,
      stream === null ? 0n : stream.handle,
      args.paramsAddress,
      null,
    );
    if (code !== 0) check("cuLaunchKernel", code, this.launchDetail(grid, block, sharedBytes));
    kernelLaunchCount += 1;
  }

  /**
   * Launch with a thread-block cluster of `cluster` blocks (grid dims must be multiples of it), through
   * `cuLaunchKernelEx` and CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION.
   */
  launchEx(
    grid: Dim3,
    block: Dim3,
    sharedBytes: number,
    stream: Stream | null,
    args: KernelArgs,
    cluster: Dim3,
  ): void {
    if (sharedBytes > DEFAULT_MAX_DYNAMIC_SHARED_BYTES) this.checkShared(sharedBytes);
    if (currentContext !== this.device.context) this.device.makeCurrent();
    const c = this.exConfig ?? this.createExConfig();
    const L = LAUNCH_CONFIG_LAYOUT;
    c.setUint32(L.gridDimX, dimX(grid), true);
    c.setUint32(L.gridDimX + 4, dimY(grid), true);
    c.setUint32(L.gridDimX + 8, dimZ(grid), true);
    c.setUint32(L.blockDimX, dimX(block), true);
    c.setUint32(L.blockDimX + 4, dimY(block), true);
    c.setUint32(L.blockDimX + 8, dimZ(block), true);
    c.setUint32(L.sharedMemBytes, sharedBytes, true);
    c.setBigUint64(L.hStream, stream === null ? 0n : stream.handle, true);
    const attr = L.size + 8; // the attribute follows the config, 64-bit aligned (see createExConfig)
    c.setUint32(attr + L.attributeValue, dimX(cluster), true);
    c.setUint32(attr + L.attributeValue + 4, dimY(cluster), true);
    c.setUint32(attr + L.attributeValue + 8, dimZ(cluster), true);
    const code = cu.cuLaunchKernelEx(this.exConfigAddress, this.handle, args.paramsAddress, null);
    if (code !== 0) {
      check(
        "cuLaunchKernelEx",
        code,
        `${this.launchDetail(grid, block, sharedBytes)}, cluster ${dimX(cluster)}x${dimY(cluster)}x${dimZ(cluster)}`,
      );
    }
    kernelLaunchCount += 1;
  }

  private createExConfig(): DataView {
    const L = LAUNCH_CONFIG_LAYOUT;
    const attrOffset = L.size + 8;
    const block = alignedHostBytes(attrOffset + L.attributeSize, 16);
    const view = new DataView(block.view.buffer, block.view.byteOffset, block.view.byteLength);
    view.setBigUint64(L.attrs, block.address + BigInt(attrOffset), true);
    view.setUint32(L.numAttrs, 1, true);
    view.setUint32(attrOffset, LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, true);
    this.exConfig = view;
    this.exConfigAddress = block.address;
    return view;
  }

  private launchDetail(grid: Dim3, block: Dim3, sharedBytes: number): string {
    return `kernel ${this.name}, grid ${dimX(grid)}x${dimY(grid)}x${dimZ(grid)}, block ${dimX(block)}x${dimY(block)}x${dimZ(block)}, ${sharedBytes} B shared`;
  }
}

/** A captured, instantiated CUDA graph: replay a fixed sequence of launches with one call. */
export class CudaGraph {
  readonly device: Device;
  private graph: bigint;
  private exec: bigint;

  private constructor(device: Device, graph: bigint, exec: bigint) {
    this.device = device;
    this.graph = graph;
    this.exec = exec;
  }

  /**
   * Record what `body` queues on `stream` (which must not be the legacy default stream) into a graph
   * and instantiate it. Nothing runs during capture. Kernel arguments are copied at capture time, so
   * later changes to a `KernelArgs` do not affect the graph.
   */
  static capture(
    stream: Stream,
    body: (stream: Stream) => void,
    mode: number = StreamCaptureMode.THREAD_LOCAL,
  ): CudaGraph {
    if (stream.handle === 0n)
      throw new Error("CudaGraph.capture: the legacy default stream cannot be captured");
    stream.device.makeCurrent();
    check("cuStreamBeginCapture_v2", cu.cuStreamBeginCapture(stream.handle, mode));
    let bodyError: unknown;
    try {
      body(stream);
    } catch (e) {
      bodyError = e;
    }
    const endCode = cu.cuStreamEndCapture(stream.handle, outU64);
    const graph = outU64[0]!;
    if (bodyError !== undefined) {
      if (endCode === 0 && graph !== 0n) cu.cuGraphDestroy(graph);
      throw bodyError;
    }
    check("cuStreamEndCapture", endCode);
    const instantiated = cu.cuGraphInstantiateWithFlags(outU64, graph, 0n);
    if (instantiated !== 0) {
      cu.cuGraphDestroy(graph);
      check("cuGraphInstantiateWithFlags", instantiated);
    }
    return new CudaGraph(stream.device, graph, outU64[0]!);
  }

  /** Queue one replay on `stream`. */
  launch(stream: Stream): void {
    if (this.exec === 0n) throw new Error("CudaGraph used after destroy()");
    check("cuGraphLaunch", cu.cuGraphLaunch(this.exec, stream.handle));
  }

  destroy(): void {
    if (this.exec !== 0n) check("cuGraphExecDestroy", cu.cuGraphExecDestroy(this.exec));
    if (this.graph !== 0n) check("cuGraphDestroy", cu.cuGraphDestroy(this.graph));
    this.exec = 0n;
    this.graph = 0n;
  }

  [disposeSymbol](): void {
    this.destroy();
  }
}

// ---------------------------------------------------------------------------------------------------
// TMA tensor maps

/** Description of a tiled tensor map (dimension 0 is the innermost, contiguous one). */
export interface TensorMapTiledDesc {
  /** A {@link TensorMapDataType} value. */
  dataType: number;
  /** Device address of element (0, 0, ...); 16-byte aligned. */
  globalAddress: bigint;
  /** Size of each dimension in elements, innermost first (1 to 5 dims). */
  globalDims: readonly number[];
  /** Byte stride of dimensions 1..rank-1 (rank-1 values; multiples of 16). */
  globalStridesBytes: readonly number[];
  /** Box (tile) size in elements per dimension, each 1..256. */
  boxDims: readonly number[];
  /** Traversal step per dimension (default all 1). */
  elementStrides?: readonly number[];
  interleave?: number;
  swizzle?: number;
  l2Promotion?: number;
  oobFill?: number;
}

/**
 * Check a tensor-map description against the driver's documented rules; returns the list of problems
 * (empty when valid). Pure: usable without a GPU.
 */
export function tensorMapTiledProblems(desc: TensorMapTiledDesc): string[] {
  const problems: string[] = [];
  const rank = desc.globalDims.length;
  const elementBytes = TENSOR_MAP_ELEMENT_BYTES[desc.dataType];
  const interleave = desc.interleave ?? TensorMapInterleave.NONE;
  const swizzle = desc.swizzle ?? TensorMapSwizzle.NONE;
  if (elementBytes === undefined) problems.push(`unknown dataType ${desc.dataType}`);
  if (rank < 1 || rank > 5) problems.push(`rank ${rank} is not in 1..5`);
  if (interleave !== TensorMapInterleave.NONE && rank < 3) problems.push("interleaved maps need rank >= 3");
  const addressAlign = interleave === TensorMapInterleave.B32 ? 32n : 16n;
  if (desc.globalAddress % addressAlign !== 0n) {
    problems.push(`globalAddress 0x${desc.globalAddress.toString(16)} is not ${addressAlign}-byte aligned`);
  }
  desc.globalDims.forEach((d, i) => {
    if (!Number.isInteger(d) || d < 1 || d > 2 ** 32)
      problems.push(`globalDims[${i}] = ${d} is not in 1..2^32`);
  });
  if (desc.globalStridesBytes.length !== Math.max(rank - 1, 0)) {
    problems.push(
      `globalStridesBytes has ${desc.globalStridesBytes.length} entries, expected rank-1 = ${rank - 1}`,
    );
  }
  const strideAlign = interleave === TensorMapInterleave.B32 ? 32 : 16;
  desc.globalStridesBytes.forEach((s, i) => {
    if (!Number.isInteger(s) || s <= 0 || s % strideAlign !== 0 || s >= 2 ** 40) {
      problems.push(
        `globalStridesBytes[${i}] = ${s} is not a positive multiple of ${strideAlign} below 2^40`,
      );
    }
  });
  if (desc.boxDims.length !== rank)
    problems.push(`boxDims has ${desc.boxDims.length} entries, expected ${rank}`);
  desc.boxDims.forEach((b, i) => {
    if (!Number.isInteger(b) || b < 1 || b > 256) problems.push(`boxDims[${i}] = ${b} is not in 1..256`);
  });
  const elementStrides = desc.elementStrides ?? [];
  if (desc.elementStrides && elementStrides.length !== rank) {
    problems.push(`elementStrides has ${elementStrides.length} entries, expected ${rank}`);
  }
  elementStrides.forEach((e, i) => {
    if (!Number.isInteger(e) || e < 1 || e > 8) problems.push(`elementStrides[${i}] = ${e} is not in 1..8`);
  });
  if (elementBytes !== undefined && desc.boxDims.length > 0 && interleave === TensorMapInterleave.NONE) {
    const innerBytes = desc.boxDims[0]! * elementBytes;
    if (innerBytes % 16 !== 0) problems.push(`inner box ${innerBytes} bytes is not a multiple of 16`);
    const span =
      swizzle === TensorMapSwizzle.B32 ? 32 : swizzle === TensorMapSwizzle.B64 ? 64 : swizzle >= 3 ? 128 : 0;
    if (span > 0 && innerBytes > span)
      problems.push(`inner box ${innerBytes} bytes exceeds the ${span}-byte swizzle span`);
  }
  if (interleave === TensorMapInterleave.B32 && swizzle !== TensorMapSwizzle.B32) {
    problems.push("32-byte interleave requires 32-byte swizzle");
  }
  return problems;
}

/**
 * Encode a tiled TMA descriptor into `out` (128 bytes, 64-byte aligned at least: a `KernelArgs.tensorMap(i)` slot
 * or `allocTensorMapBytes()`). The description is validated first so mistakes read as sentences
 * rather than CUDA_ERROR_INVALID_VALUE.
 */
export function encodeTensorMapTiled(out: Uint8Array, desc: TensorMapTiledDesc): void {
  requireCuda();
  if (out.byteLength !== 128)
    throw new RangeError(`tensor map buffer must be 128 bytes, got ${out.byteLength}`);
  if (koffi().address(out) % 64n !== 0n) throw new RangeError("tensor map buffer must be 64-byte aligned");
  const problems = tensorMapTiledProblems(desc);
  if (problems.length > 0) throw new RangeError(`invalid tensor map: ${problems.join("; ")}`);
  const rank = desc.globalDims.length;
  const dims = BigUint64Array.from(desc.globalDims, (d) => BigInt(d));
  const strides = new BigUint64Array(Math.max(rank - 1, 1));
  desc.globalStridesBytes.forEach((s, i) => {
    strides[i] = BigInt(s);
  });
  const box = Uint32Array.from(desc.boxDims);
  const elementStrides = Uint32Array.from(desc.elementStrides ?? desc.boxDims.map(() => 1));
  check(
    "cuTensorMapEncodeTiled",
    cu.cuTensorMapEncodeTiled(
      out,
      desc.dataType,
      rank,
      desc.globalAddress,
      dims,
      strides,
      box,
      elementStrides,
      desc.interleave ?? TensorMapInterleave.NONE,
      desc.swizzle ?? TensorMapSwizzle.NONE,
      desc.l2Promotion ?? TensorMapL2Promotion.NONE,
      desc.oobFill ?? TensorMapOobFill.NONE,
    ),
    `dims [${desc.globalDims.join(", ")}], box [${desc.boxDims.join(", ")}]`,
  );
}
