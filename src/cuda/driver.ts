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
 *
 * This module gathers the driver layer; each area lives in its own file:
 * - driver-api.ts: the koffi declarations, CUresult errors and checking, loading and availability;
 * - driver-constants.ts: the cuda.h values used (attributes, tensor-map enums, launch-config layout);
 * - device.ts: opening a device, its context, device memory and copies;
 * - host-memory.ts: pinned host memory and what a copy may read or write;
 * - launch.ts: loaded modules, kernels and their launches;
 * - stream.ts: streams, events and captured graphs;
 * - tensor-map.ts: TMA tensor-map validation and encoding.
 *
 * The virtual-memory entry points (cuMemCreate, cuMemMap, ...) are bound here too; their one user is the
 * symmetric heap of src/parallel/symmetric.ts, which calls them through `cu`.
 */

export { Device, openDevice } from "./device.js";
export {
  type CudaAvailability,
  CudaError,
  cudaAvailability,
  describeCudaError,
  disposeSymbol,
  FALLBACK_ERROR_NAMES,
} from "./driver-api.js";
export {
  DEFAULT_MAX_DYNAMIC_SHARED_BYTES,
  DeviceAttribute,
  FunctionAttribute,
  LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
  LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
  LAUNCH_CONFIG_LAYOUT,
  MEM_ACCESS_DESC_LAYOUT,
  MEM_ALLOCATION_PROP_LAYOUT,
  MEM_LOCATION_SIZE,
  MemAccessFlags,
  MemAllocationType,
  MemAllocGranularity,
  MemHandleType,
  MemLocationType,
  memAccessDescs,
  memAllocationProp,
  StreamCaptureMode,
  TensorMapDataType,
  TensorMapInterleave,
  TensorMapL2Promotion,
  TensorMapOobFill,
  TensorMapSwizzle,
} from "./driver-constants.js";
export { type HostMemory, PinnedBuffer } from "./host-memory.js";
export { allocTensorMapBytes, KernelArgs, type KernelArgsLayout, TENSOR_MAP_BYTES } from "./kernel-args.js";
export { type Dim3, Kernel, kernelLaunches, Module } from "./launch.js";
export { CudaGraph, Event, Stream } from "./stream.js";
export { encodeTensorMapTiled, type TensorMapTiledDesc, tensorMapTiledProblems } from "./tensor-map.js";
