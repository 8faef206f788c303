/**
 * How the fused kernel runs a layer shape, decided on the host before any launch: the block M for a
 * token count (and with it swap-AB), the stage ring and shared memory it implies, the grid, and the
 * -D defines of the specialization. The launcher (megamoe.ts) only executes a plan; `describeFusedPlan`
 * prints one for logs and benchmarks. No CUDA here.
 */
import { expertFormatOf, type MoEConfig } from "../../config/config.js";
import type { KernelDefines } from "../variants.js";
import {
  FUSED_BLOCK_MS,
  type FusedBlockM,
  fusedDefines,
  fusedExpandProblem,
  fusedShapeProblem,
  fusedSharedBytes,
  fusedStages,
  fusedSwapAB,
  fusedThreads,
} from "./megamoe.variants.js";

/** One launch's configuration. */
export interface FusedPlan {
  tokens: number;
  blockM: FusedBlockM;
  /** Tiles with the weights on the wgmma's M side (block M 16 and 32). */
  swapAB: boolean;
  /** FP4 experts expanded once per forward into e4m3 stage images before the tiles (megamoe_expand.cuh). */
  expand: boolean;
  stages: number;
  /** Dynamic shared memory per CTA, bytes. */
  sharedBytes: number;
  /** CTAs: one per SM (persistent). */
  ctas: number;
  threads: number;
  defines: KernelDefines;
}

/** Why the fused kernel cannot run this layer, or null. */
export function fusedLayerProblem(config: MoEConfig): string | null {
  const shape = fusedShapeProblem(config);
  if (shape !== null) return shape;
  if (fusedStages(config, 128) === 0) return "its shared-memory layout does not fit 227 KB";
  return null;
}

/**
 * The block M for a launch, from the rows a routed expert averages (λ = T·k / E): swap-AB 16 while λ ≤ 6
 * and 32 while λ ≤ 16 (an expert's rows then rarely pass one block: a second block streams the expert's
 * weights again), 64 below 64 (the A tile would be mostly padding at 128), else 128 (twice the rows per
 * B tile streamed: half the weight traffic per row). FP4 experts keep the swap-AB tiles longer, 16 while
 * λ ≤ 12 and 32 while λ ≤ 30: their math threads convert the weights faster than the 64-row tiles'
 * converter warps do, which outweighs converting an expert's weights once per block; past 30 rows on
 * average too many experts need a second 32-row block (docs/decisions.md).
 */
export function fusedBlockM(c: MoEConfig, tokens: number): FusedBlockM {
  const rows = (tokens * c.topK) / c.numExperts;
  const fp4 = expertFormatOf(c) === "fp4";
  if (rows <= (fp4 ? 12 : 6)) return 16;
  if (rows <= (fp4 ? 30 : 16)) return 32;
  // At exactly 64 rows 128 won on the H200 (pro, T = 4096: 7705 vs 8230 µs, docs/decisions.md).
  return rows < 64 ? 64 : 128;
}

/**
 * Rows per routed expert (λ = T·k / E) from which FP4 layers expand their experts once per forward: each
 * of an expert's ⌈λ / 128⌉ row tiles would convert its weights again, while the expansion converts them
 * once and every tile then streams twice the bytes (the e4m3 images instead of the packed rows). Measured
 * (docs/decisions.md), since the converter tiles promote as FP8's: it loses up to 336 rows, is level at 384
 * (three whole tiles) and wins from 480 on.
 */
export const FUSED_EXPAND_MIN_ROWS = 384;

/** Whether a launch of `tokens` with `blockM` expands the FP4 experts first (the expand variant). */
export function fusedExpand(c: MoEConfig, tokens: number, blockM: FusedBlockM): boolean {
  if (fusedExpandProblem(c, blockM) !== null) return false;
  return (tokens * c.topK) / c.numExperts >= FUSED_EXPAND_MIN_ROWS;
}

/** The smallest token count up to `maxTokens` whose launch expands the FP4 experts, or null. */
export function fusedExpandFromTokens(c: MoEConfig, maxTokens: number): number | null {
  // The inverse of fusedExpand's rows-per-expert test.
  const tokens = Math.ceil((FUSED_EXPAND_MIN_ROWS * c.numExperts) / c.topK);
  return tokens <= maxTokens && fusedExpand(c, tokens, fusedBlockM(c, tokens)) ? tokens : null;
}

/** A compiled specialization of the fused kernel: its block M and whether it is the expand variant. */
export interface FusedTile {
  blockM: FusedBlockM;
  expand: boolean;
}

/** The tiles the heuristics pick for some token count in 1 .. maxTokens (block M ascending). */
export function fusedTilesUpTo(c: MoEConfig, maxTokens: number): FusedTile[] {
  const picked = new Map<string, FusedTile>();
  for (let t = 1; t <= maxTokens; t++) {
    const blockM = fusedBlockM(c, t);
    const tile = { blockM, expand: fusedExpand(c, t, blockM) };
    picked.set(`${tile.blockM}${tile.expand ? "x" : ""}`, tile);
  }
  return [...picked.values()].sort((a, b) => a.blockM - b.blockM || Number(a.expand) - Number(b.expand));
}

/** The block Ms fusedBlockM picks for some token count in 1 .. maxTokens, ascending. */
export function fusedBlockMsUpTo(c: MoEConfig, maxTokens: number): FusedBlockM[] {
  const picked = new Set(fusedTilesUpTo(c, maxTokens).map((t) => t.blockM));
  return FUSED_BLOCK_MS.filter((m) => picked.has(m));
}

/**
 * The plan for `tokens` on `ctas` CTAs; `blockM` forces the tile height, `expand` the FP4 expand variant
 * off or on (on: wherever the tile has 64 or 128 rows; swap-AB tiles never expand).
 */
export function planFusedLaunch(
  c: MoEConfig,
  tokens: number,
  ctas: number,
  blockM: "auto" | FusedBlockM = "auto",
  expand: "auto" | boolean = "auto",
): FusedPlan {
  const m = blockM === "auto" ? fusedBlockM(c, tokens) : blockM;
  if (!FUSED_BLOCK_MS.includes(m)) {
    throw new RangeError(
      `FusedMoEKernel: blockM must be "auto" or one of ${FUSED_BLOCK_MS.join(", ")}, got ${m}`,
    );
  }
  if (expand === true && expertFormatOf(c) !== "fp4") {
    throw new RangeError("FusedMoEKernel: fp4Expand applies to FP4 experts");
  }
  const x = expand === "auto" ? fusedExpand(c, tokens, m) : expand && fusedExpandProblem(c, m) === null;
  const stages = fusedStages(c, m, x);
  return {
    tokens,
    blockM: m,
    swapAB: fusedSwapAB(m),
    expand: x,
    stages,
    sharedBytes: fusedSharedBytes(c, stages, m, x),
    ctas,
    threads: fusedThreads(c, m),
    defines: fusedDefines(c, m, x, stages),
  };
}

/** One line for logs: "T=64 BLOCK_M=16 swap-AB stages=5 smem=195040 B grid=132×384". */
export function describeFusedPlan(p: FusedPlan): string {
  return (
    `T=${p.tokens} BLOCK_M=${p.blockM}${p.swapAB ? " swap-AB" : ""}${p.expand ? " expand" : ""} stages=${p.stages} ` +
    `smem=${p.sharedBytes} B grid=${p.ctas}×${p.threads}`
  );
}
