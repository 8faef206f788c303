/**
 * CUDA from TypeScript: driver bindings, device tensors, JIT compilation and timing.
 * Knows nothing of MoE; everything GPU-facing in megamoe is built on these pieces.
 *
 * @example
 * const device = openDevice(0); // throws cudaAvailability().reason when CUDA is unusable
 * const compiled = compileKernel({ source: "quant/quant.cu", defines: { HIDDEN: 7168, SCALE_UE8M0: 0 } });
 * const kernel = loadKernel(device, compiled, "megamoe_quantize_act"); // extern "C" name
 * const x = DeviceTensor.fromHost(device, "bf16", [tokens, hidden], bits);
 * const args = new KernelArgs(4).ptr(0, x.ptr).ptr(1, q.ptr).ptr(2, scales.ptr).u32(3, tokens); // once per launch site
 * kernel.launch([blocks, 1, 1], 256, 0, stream, args);
 * const t = timeKernel(device, (s) => kernel.launch(blocks, 256, 0, s, args));
 *
 * GPU tests: on the CPU machine `npm run build:test` compiles test/ and src/ to dist-test/; the GPU host
 * (no dev dependencies, no tsx) then runs `npm run test:gpu`.
 */

export {
  type CudaAvailability,
  CudaError,
  CudaGraph,
  cudaAvailability,
  DEFAULT_MAX_DYNAMIC_SHARED_BYTES,
  Device,
  DeviceAttribute,
  type Dim3,
  describeCudaError,
  disposeSymbol,
  Event,
  encodeTensorMapTiled,
  FunctionAttribute,
  type HostMemory,
  Kernel,
  kernelLaunches,
  Module,
  openDevice,
  PinnedBuffer,
  Stream,
  StreamCaptureMode,
  TensorMapDataType,
  TensorMapInterleave,
  TensorMapL2Promotion,
  TensorMapOobFill,
  TensorMapSwizzle,
  type TensorMapTiledDesc,
  tensorMapTiledProblems,
} from "./driver.js";
export {
  FP8_PEAK_FLOPS,
  H200_SMS,
  READ_BYTES_PER_S,
  SM_READ_BYTES_PER_S,
  SM90_SHARED_OPTIN_BYTES,
} from "./hardware.js";
export {
  type CompiledKernel,
  type CompileKernelOptions,
  compileKernel,
  compileKernelAsync,
  compilerAvailable,
  compilerProblem,
  type DefineValue,
  defaultArch,
  includeDir,
  type JitCompilerName,
  type JitStats,
  jitCacheDir,
  jitEnvProblems,
  jitStats,
  KernelCompileError,
  kernelsDir,
  loadKernel,
  packageRoot,
  resetJitStats,
  resolveKernelSource,
  selectCompiler,
} from "./jit.js";
export {
  alignedHostBytes,
  allocTensorMapBytes,
  KernelArgs,
  type KernelArgsLayout,
  TENSOR_MAP_ALIGN,
  TENSOR_MAP_BYTES,
} from "./kernel-args.js";
export { type LocateResult, locateCudaInclude, locateLibcuda, locateLibnvrtc, locateNvcc } from "./locate.js";
export { type PerDeviceMemo, type PerDeviceOnce, perDeviceMemo, perDeviceOnce } from "./memo.js";
export { DirectoryError, directoryProblem, makeDirectory, outputFileProblem } from "./mkdir.js";
export {
  allocHostArray,
  checkHostArray,
  contiguousStrides,
  DeviceTensor,
  DTYPE_BYTES,
  DTYPES,
  type DType,
  describeTensor,
  elementCount,
  expectOnDevice,
  expectOperand,
  expectTensor,
  type HostArray,
  isDType,
  sameShape,
  type TensorLike,
  tensorBytes,
} from "./tensor.js";
export {
  deviceSummary,
  flushL2,
  gitCommit,
  median,
  type ResultRow,
  type ResultsMeta,
  releaseL2FlushBuffer,
  summarizeSamples,
  type TimeKernelOptions,
  type Timing,
  timeKernel,
  writeResults,
} from "./timing.js";
