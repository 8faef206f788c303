/**
 * megamoe: the MoE layer of DeepSeek-V4-class models in FP8, with FP8 or FP4 (MXFP4) routed experts.
 *
 * The public API: configs, the layer object (and the layer split across ranks by expert), the CPU
 * reference that defines the numerics, weights (generated or from safetensors), the codecs, and the CUDA
 * layer for those who launch kernels.
 */

export {
  ConfigError,
  type ConfigOverrides,
  EXPERT_FORMATS,
  type ExpertFormat,
  expertFormatOf,
  isValidatedConfig,
  type MoEConfig,
  PRESETS,
  presetNames,
  QUANT_BLOCK,
  type RouterConfig,
  resolveConfig,
  type ScaleFormat,
  type ScoringFunction,
  sharedIntermediate,
  type ValidatedConfig,
  validateConfig,
} from "./config/config.js";
export * as cuda from "./cuda/index.js";
export { type ExportLayerOptions, exportLayer } from "./export/export.js";
export { ExportError, type LayerExportOptions } from "./export/layer.js";
export { EXPORT_VERSION, type ExportManifest } from "./export/manifest.js";
export { DeviceMoEWeights } from "./kernels/device-weights.js";
export {
  convertFp4ToFp8,
  fp4ReferenceWordsOnDevice,
  orderFp4PackedOnDevice,
} from "./kernels/fp4/fp4_convert.js";
export {
  defaultGateLogits,
  type GateLogits,
  type GateOptions,
  reserveGateWorkspace,
  routeOnDevice,
  tid2eidProblem,
  tokenIdsProblem,
} from "./kernels/gate/gate.js";
export { fp4GemmScaleWords, groupedGemmFp4 } from "./kernels/gemm/fp4_grouped_gemm.js";
export { groupedGemmFp8 } from "./kernels/gemm/grouped_gemm.js";
export { planGroupedGemm } from "./kernels/gemm/plan.js";
export { FusedMoEKernel, FusedMoEKernelError } from "./kernels/megamoe/megamoe.js";
export { rmsNormOnDevice } from "./kernels/norm/norm.js";
export { quantizeOnDevice } from "./kernels/quant/quant.js";
export {
  type Backend,
  DEFAULT_GPU_PIPELINE,
  type DeviceForwardArgs,
  type ForwardOptions,
  type ForwardResult,
  type GpuPipelineKind,
  InputError,
  MoELayer,
  type MoELayerOptions,
  validateInput,
} from "./layer.js";
export {
  bf16BitsToF32,
  bf16FromF32Array,
  f32FromBf16Array,
  f32ToBf16Bits,
  roundToBf16,
} from "./numerics/bf16.js";
export {
  countFp4ToFp8Inexact,
  decodeE2m1,
  decodeE8m0,
  dequantizeMxfp4,
  E2M1_DECODE,
  type E8m0Rounding,
  encodeE2m1,
  encodeE8m0,
  type Fp4AsFp8,
  fp4BlockScales,
  fp4BlocksExact,
  mxfp4DeviceLayout,
  mxfp4ReferenceWords,
  mxfp4RowsToFp8,
  mxfp4StoredLayout,
  mxfp4ToFp8Blocks,
  packE2m1,
  quantizeMxfp4,
  unpackE2m1,
} from "./numerics/fp4.js";
export {
  decodeE4m3,
  decodeE5m2,
  E4M3_DECODE,
  E5M2_DECODE,
  encodeE4m3,
  encodeE5m2,
  FP8_E4M3_MAX,
  FP8_E5M2_MAX,
} from "./numerics/fp8.js";
export { NumericsError } from "./numerics/fp32.js";
export {
  dequantizeActivations,
  dequantizeWeightBlocks,
  quantizeActivations,
  quantizeWeightBlocks,
} from "./numerics/quant.js";
export {
  DispatchError,
  type DispatchPlan,
  planDispatch,
  type RankRouting,
  type ReceivedRows,
  type SentRows,
  type SentRun,
  sentRows,
} from "./parallel/dispatch.js";
export {
  combineRankOutputs,
  ExpertParallelMoE,
  type ExpertParallelOptions,
  type ExpertParallelStats,
  joinRankOutputs,
  type RankDeviceInput,
  type RankInput,
  RankWeights,
  splitAmongRanks,
} from "./parallel/expert-parallel.js";
export {
  FusedExpertParallel,
  FusedExpertParallelError,
  type FusedExpertParallelJoinOptions,
  type FusedExpertParallelOptions,
  type FusedForwardOptions,
  type FusedRankDeviceInput,
} from "./parallel/fused-expert-parallel.js";
export { type JoinOptions, SymmetricHeap, SymmetricHeapError } from "./parallel/symmetric.js";
export { FusedPipeline } from "./pipeline/fused.js";
export { type MoEPipeline, type UnfusedForward, UnfusedPipeline } from "./pipeline/unfused.js";
export { calcDiff, checksum, l2Norm, relativeError } from "./reference/metrics.js";
export {
  checkFiniteOutput,
  type Fp4ConversionStats,
  groupByExpert,
  idealMoE,
  type ReferenceOptions,
  referenceMoE,
} from "./reference/moe.js";
export {
  type Gate,
  gateLogits,
  RouterError,
  type Routing,
  randomRouting,
  routeByHash,
  routeTokens,
  validateRouting,
} from "./reference/router.js";
export {
  Checkpoint,
  generateTokenIds,
  type LayerOptions,
  openCheckpoint,
} from "./weights/checkpoint.js";
export {
  CheckpointError,
  parseV4Config,
  type V4Block,
  type V4ModelConfig,
  v4Names,
} from "./weights/checkpoint-format.js";
export { CheckpointLayer } from "./weights/checkpoint-layer.js";
export {
  type ExtraTensor,
  type SaveCheckpointOptions,
  type SaveLayer,
  saveCheckpoint,
} from "./weights/checkpoint-save.js";
export { checkSeed, GeneratedWeights, generateActivations } from "./weights/generate.js";
export { loadMoEWeights, saveMoEWeights } from "./weights/moe-file.js";
export { type RandomV4Options, RandomV4Weights } from "./weights/random-v4.js";
export { SafetensorsError } from "./weights/safetensors.js";
export type {
  BlockQuantized,
  ExpertWeights,
  Fp4Exactness,
  Fp4ExpertWeights,
  GateWeights,
  MoEWeightSource,
  Mxfp4Matrix,
  RoutedExpertWeights,
} from "./weights/types.js";
export { MXFP4_GROUP, requireFp8Expert } from "./weights/types.js";
