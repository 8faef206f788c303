/**
 * Specializations of megamoe.cu (the fused layer) and the pure facts about them that the launcher and
 * the CI compile check share: the -D defines of a layer shape, the shared-memory formula (mirrors the
 * kernel's layout) and the deepest stage ring that fits. No CUDA here.
 */
import {
  EXPERT_FORMATS,
  expertFormatOf,
  type MoEConfig,
  PRESETS,
  QUANT_BLOCK,
  SCALE_FORMATS,
  scaleFormatDefine,
  sharedIntermediate,
} from "../../config/config.js";
import {
  alignUp,
  aScaleStageBytes,
  type KernelDefines,
  type KernelVariant,
  SM90_SHARED_OPTIN_BYTES,
  STAGING_PITCH_NARROW,
  stagingAreaBytes,
} from "../variants.js";

/**
 * Pool rows per tile: 128 (two math warpgroups of 64 rows), 64 for few rows per expert (both warpgroups
 * on the same 64 rows, half the A bytes per stage), or 32 and 16 for a handful (swap-AB: the weights on
 * the wgmma's M side, the rows on its N side, so the tensor cores do kBlockM / 64 of a 64-row tile's
 * work). The tile's columns: L1 128 gate + 128 up channels, L2 256 outputs.
 */
export type FusedBlockM = 16 | 32 | 64 | 128;
export const FUSED_BLOCK_MS: readonly FusedBlockM[] = [16, 32, 64, 128];
/** Whether a block M runs its tiles swap-AB (megamoe.cu kSwapAB). */
export function fusedSwapAB(blockM: FusedBlockM): boolean {
  return blockM < 64;
}
export const FUSED_BLOCK_N = 256;
export const FUSED_MIN_STAGES = 2;
export const FUSED_MAX_STAGES = 8;
/**
 * Swap-AB tiles stop at 5 stages: a 16-row stage is 34 KB, so five keep 170 KB of weights in flight per
 * SM, and a deeper ring streamed no faster (the TMA weight-stream probe: 4 vs 6 stages, docs/decisions.md);
 * at 6 (flash-ep8, BLOCK_M 16) ptxas spilled the producer.
 */
export const FUSED_SWAP_MAX_STAGES = 5;
/**
 * Swap-AB tiles with FP4 experts convert in the math threads' registers (megamoe.cu kFp4Regs): a stage
 * holds no e4m3 tile, only 16 KB of packed weights and their words, so the ring runs to the kernel's
 * 8-stage limit (128 KB of packed weights in flight per SM).
 */
export const FUSED_FP4_SWAP_MAX_STAGES = 8;
/** Whether a layer and block M build the register path (megamoe.cu kFp4Regs). */
export function fusedFp4Registers(c: MoEConfig, blockM: FusedBlockM): boolean {
  return expertFormatOf(c) === "fp4" && fusedSwapAB(blockM);
}
/** Math warps per CTA (megamoe_config.cuh kMathWarps): four warpgroups in the register path at block M 16, else two. */
function fusedMathWarps(c: MoEConfig, blockM: FusedBlockM): number {
  return fusedFp4Registers(c, blockM) && blockM === 16 ? 16 : 8;
}
/**
 * Threads per CTA (megamoe_config.cuh kThreads): the math warpgroups (four in the register path at block
 * M 16, where the math threads' conversion sets the time, else two) and the producer warpgroup.
 */
export function fusedThreads(c: MoEConfig, blockM: FusedBlockM): number {
  return 32 * fusedMathWarps(c, blockM) + 128;
}
/** Int32 words of the workspace before the per-group and per-block arrays (the kernel's Counter enum). */
export const FUSED_COUNTER_WORDS = 8;

/**
 * Why a layer and block M cannot build the expand variant (megamoe_expand.cuh: FP4 experts expanded once
 * per forward into e4m3 stage images), or null: it needs FP4 experts and 64- or 128-row tiles.
 */
export function fusedExpandProblem(c: MoEConfig, blockM: FusedBlockM): string | null {
  if (expertFormatOf(c) !== "fp4") return "the expand variant is for FP4 experts";
  if (blockM !== 128) return `the expand variant has 128-row tiles, not ${blockM}`;
  return null;
}

/**
 * Bytes of the expand variant's stage images: per routed expert, every L1 stage (I/128 tiles × H/128 K
 * blocks) and L2 stage (H/256 × I/128), each the 256 × 128 e4m3 tile (megamoe_expand.cuh kImageBytes).
 */
export function fusedExpandImageBytes(c: MoEConfig): number {
  const stages =
    (c.numExperts / c.ranks) *
    ((c.intermediate / QUANT_BLOCK) * (c.hidden / QUANT_BLOCK) +
      (c.hidden / FUSED_BLOCK_N) * (c.intermediate / QUANT_BLOCK));
  return stages * FUSED_BLOCK_N * 128;
}

/** Why the fused kernel cannot run this shape, or null. */
export function fusedShapeProblem(c: MoEConfig): string | null {
  if (c.hidden % FUSED_BLOCK_N !== 0) return `hidden (${c.hidden}) must be a multiple of ${FUSED_BLOCK_N}`;
  if (c.intermediate % QUANT_BLOCK !== 0) return `intermediate must be a multiple of ${QUANT_BLOCK}`;
  if (c.numExperts / c.ranks > 1024) return "at most 1024 local experts";
  if (c.topK > 32) return "top-k above 32";
  return null;
}

/**
 * Dynamic shared memory of one CTA, byte for byte megamoe.cu's layout (+1024 to align the base). FP4
 * experts add per stage the packed rows (64 bytes per B row), their UE8M0 words and the converted
 * rows' fp32 scales (4 bytes per B row each), a `loaded` barrier and a stage-kind word. The register
 * path (swap-AB FP4) has none of the e4m3 tile, the fp32 scales, `loaded` or the stage kinds; the
 * expand variant keeps only the fp32 scales per stage, and once the expansion workers' buffer (a stage's
 * packed rows, words, e4m3 tile and scales) with its `loaded` barrier. The packed rows start at a
 * 1024-byte boundary (their 64-byte swizzle).
 */
export function fusedSharedBytes(c: MoEConfig, stages: number, blockM: FusedBlockM, expand = false): number {
  const fp4 = expertFormatOf(c) === "fp4";
  const regs = fusedFp4Registers(c, blockM);
  const converters = fp4 && !regs && !expand;
  const groups = c.numExperts / c.ranks + 1;
  const maxInter = Math.max(c.intermediate, sharedIntermediate(c));
  const maxKBlocks = Math.max(c.hidden / QUANT_BLOCK, maxInter / QUANT_BLOCK);
  const aTile = blockM * 128;
  const bTile = regs ? 0 : FUSED_BLOCK_N * 128;
  const saStride = aScaleStageBytes(blockM);
  const fp4Stage = fp4 && !expand ? FUSED_BLOCK_N * (64 + 4) : 0; // packed rows and reference words
  const offPacked = stages * (aTile + bTile + saStride);
  const expandBuffer = expand ? alignUp(FUSED_BLOCK_N * (64 + 4) + FUSED_BLOCK_N * 128, 1024) : 0;
  const offTasks = (fp4 ? alignUp(offPacked, 1024) : offPacked) + stages * fp4Stage + expandBuffer;
  const taskSlot = alignUp(32 + 2 * maxKBlocks * 4, 16); // the Task and its two weight-scale rows
  const offBars = alignUp(offTasks + 2 * taskSlot, 8);
  const bars = 2 * stages + 4 + (converters ? stages : 0) + (expand ? 1 : 0);
  const offAmax = offBars + 8 * bars + (converters ? 4 * stages : 0);
  // The L1 epilogue's amax exchange: [2][64] floats, or per math warp and row when swap-AB.
  const mathWarps = fusedMathWarps(c, blockM);
  const offOffsets = offAmax + Math.max(2 * 64, fusedSwapAB(blockM) ? mathWarps * blockM : 0) * 4;
  const offStaging = alignUp(offOffsets + 4 * (groups + 1) * 2 + 4 * groups + 16, 16);
  // One staging area per math warp (all but the producer warpgroup), at the narrow pitch.
  const bytes = offStaging + mathWarps * stagingAreaBytes(STAGING_PITCH_NARROW);
  return bytes + 1024;
}

/** The deepest ring a block M may use: FUSED_MAX_STAGES, or the swap-AB caps. */
export function fusedMaxStages(c: MoEConfig, blockM: FusedBlockM): number {
  if (!fusedSwapAB(blockM)) return FUSED_MAX_STAGES;
  return fusedFp4Registers(c, blockM) ? FUSED_FP4_SWAP_MAX_STAGES : FUSED_SWAP_MAX_STAGES;
}

/** The deepest stage ring (up to fusedMaxStages) that fits `budget`; 0 when 2 do not. */
export function fusedStages(
  c: MoEConfig,
  blockM: FusedBlockM,
  expand = false,
  budget = SM90_SHARED_OPTIN_BYTES,
): number {
  for (let s = fusedMaxStages(c, blockM); s >= FUSED_MIN_STAGES; s--) {
    if (fusedSharedBytes(c, s, blockM, expand) <= budget) return s;
  }
  return 0;
}

/** The -D macros of megamoe.cu for a layer shape (`expand`: the FP4 expand variant). */
export function fusedDefines(
  c: MoEConfig,
  blockM: FusedBlockM,
  expand = false,
  stages = fusedStages(c, blockM, expand),
): KernelDefines {
  const problem = expand ? fusedExpandProblem(c, blockM) : null;
  if (problem !== null) throw new RangeError(`fusedDefines: ${problem}`);
  return {
    BLOCK_M: blockM,
    HIDDEN: c.hidden,
    INTER: c.intermediate,
    SHARED_INTER: sharedIntermediate(c),
    NUM_EXPERTS: c.numExperts / c.ranks,
    TOP_K: c.topK,
    NUM_STAGES: stages,
    ...scaleFormatDefine(c.scaleFormat),
    ...(expertFormatOf(c) === "fp4" ? { B_FP4: 1 } : {}),
    ...(expand ? { FP4_EXPAND: 1 } : {}),
    SHARED_BYTES: fusedSharedBytes(c, stages, blockM, expand),
  };
}

/**
 * The expert-parallel build (megamoe_ep.cuh): one launch is one rank of `ranks`, its NUM_EXPERTS the
 * rank's E / R local experts, the routing's ids global. The shared memory is the one-rank layout's (the
 * EP phases borrow the epilogue staging area before the first tile).
 */
export function fusedEpDefines(
  c: MoEConfig,
  ranks: number,
  blockM: FusedBlockM,
  expand = false,
): KernelDefines {
  if (!Number.isInteger(ranks) || ranks < 2 || ranks > FUSED_EP_MAX_RANKS || c.numExperts % ranks !== 0) {
    throw new RangeError(
      `fusedEpDefines: ${c.numExperts} experts on ${ranks} ranks (2..${FUSED_EP_MAX_RANKS})`,
    );
  }
  return { ...fusedDefines({ ...c, ranks }, blockM, expand), EP_RANKS: ranks };
}
/** Ranks of the EP build (megamoe_ep.cuh: the address table and rank masks are sized for 8). */
export const FUSED_EP_MAX_RANKS = 8;

/**
 * Every preset in both scale formats, both expert formats and every block M (the layer's shapes), and
 * the FP4 expand variant's block Ms.
 */
const oneRankVariants: readonly KernelVariant[] = Object.values(PRESETS).flatMap((preset) =>
  SCALE_FORMATS.flatMap((scaleFormat) =>
    EXPERT_FORMATS.flatMap((expertFormat) => {
      const c = { ...preset, scaleFormat, expertFormat };
      return FUSED_BLOCK_MS.flatMap((blockM) =>
        [false, true]
          .filter((expand) => !expand || fusedExpandProblem(c, blockM) === null)
          .map((expand) => ({ defines: fusedDefines(c, blockM, expand), noSpill: true })),
      );
    }),
  ),
);
/**
 * The EP build, compiled by CI for no spills: tiny at 2, 4 and 8 ranks and flash at 8 (its 32 local
 * experts, flash-ep8's shape) with FP8 experts, and flash at 8 with FP4 experts; every block M, fp32
 * scales; and flash's FP4 expand variant at 8 ranks.
 */
export const epVariants: readonly KernelVariant[] = [
  ...[2, 4, 8].map((ranks) => ({ preset: PRESETS.tiny!, ranks })),
  { preset: PRESETS.flash!, ranks: 8 },
  // DeepSeek-V4's serving case: flash's FP4 experts over 8 GPUs.
  { preset: { ...PRESETS.flash!, expertFormat: "fp4" as const }, ranks: 8 },
]
  .flatMap(({ preset, ranks }) =>
    FUSED_BLOCK_MS.map((blockM) => ({ defines: fusedEpDefines(preset, ranks, blockM), noSpill: true })),
  )
  .concat([
    { defines: fusedEpDefines({ ...PRESETS.flash!, expertFormat: "fp4" }, 8, 128, true), noSpill: true },
  ]);

export const variants: readonly KernelVariant[] = [...oneRankVariants, ...epVariants];
