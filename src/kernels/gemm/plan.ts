/**
 * The grouped GEMM's heuristics: from a problem (rows, N, K, groups, expected rows per group) and the
 * device (SMs, shared-memory budget) to a tile shape, a pipeline depth and a persistent grid, with the
 * cost estimate that chose them. Pure: no CUDA, usable on a machine without a GPU.
 * `formatGroupedGemmPlan` prints a plan in one line.
 */

import { checkOptionFields, QUANT_BLOCK } from "../../config/config.js";
import {
  FP8_PEAK_FLOPS,
  H200_SMS,
  READ_BYTES_PER_S,
  SM_READ_BYTES_PER_S,
  SM90_SHARED_OPTIN_BYTES,
} from "../../cuda/hardware.js";
import type { KernelDefines } from "../variants.js";
import {
  GEMM_BLOCK_K,
  GEMM_MAX_GROUPS,
  GEMM_TILE_NAMES,
  GEMM_TILES,
  type GemmTile,
  type GemmTileName,
  type GemmWeightFormat,
  gemmDefines,
  gemmMaxStages,
  gemmSharedBytes,
  gemmThreads,
  gemmTileNames,
} from "./fp8_grouped_gemm.variants.js";

export type GemmOutDtype = "fp32" | "bf16";

/** What the plan needs to know about a problem. */
export interface GroupedGemmProblem {
  /** Rows of A and out (all groups together). */
  mTotal: number;
  n: number;
  k: number;
  groups: number;
  /** Rows a non-empty group is expected to have (default ⌈mTotal / groups⌉). */
  expectedRowsPerGroup?: number;
  outDtype?: GemmOutDtype;
  /** How B arrives (default "fp8"): FP4 weights take the FP4 build and its tiles. */
  weightFormat?: GemmWeightFormat;
}

export interface PlanOptions {
  /** Default: 132 (H200). */
  smCount?: number;
  /** Dynamic shared memory a block may opt into (default 227 KB). */
  sharedBudgetBytes?: number;
  /** Force a tile shape (benchmarks, diagnosis). */
  tile?: GemmTileName;
  /** Force a pipeline depth (default: the deepest that fits). */
  stages?: number;
}

/** The plan's cost estimate (a model, for choosing; calibrate it against `benchmarkGroupedGemm`). */
export interface GroupedGemmEstimate {
  tiles: number;
  waves: number;
  /** Tensor-core time of the tile waves at the tile's assumed efficiency. */
  computeUs: number;
  /** Unique bytes (weights of the active groups, A, out) at the read bandwidth the CTAs can draw. */
  memoryUs: number;
  us: number;
}

/** The chosen configuration. */
export interface GroupedGemmPlan {
  tile: GemmTile;
  stages: number;
  threads: number;
  /** Dynamic shared memory of a launch. */
  sharedBytes: number;
  /** CTAs of the persistent grid: min(SMs, tiles in the worst case). */
  grid: number;
  outDtype: GemmOutDtype;
  defines: KernelDefines;
  estimate: GroupedGemmEstimate;
}

/**
 * Fraction of the dense FP8 rate each tile shape reached on the H200 at 512–4096 rows per group (the
 * flash L1/L2 shapes). Two math warpgroups hide each other's promotion; one cannot. m64n128 keeps its
 * figure from before its pipelined promotion (0.56 now): with the new one the tie rule picked it for
 * pro's decode shapes, where the unfused pipeline ran 7–10% slower than with m64n256.
 */
const TILE_EFFICIENCY: Readonly<Record<GemmTileName, number>> = {
  m128n128: 0.57,
  m128n256: 0.65,
  m64n256: 0.61,
  m64n128: 0.43,
};

/** Throws a RangeError naming the first size the kernel cannot take. */
export function checkGroupedGemmProblem(p: GroupedGemmProblem): void {
  const fail = (msg: string): never => {
    throw new RangeError(`grouped GEMM: ${msg}`);
  };
  if (!Number.isInteger(p.n) || p.n < QUANT_BLOCK || p.n % QUANT_BLOCK !== 0)
    fail(`n must be a positive multiple of ${QUANT_BLOCK}, got ${p.n}`);
  if (!Number.isInteger(p.k) || p.k < GEMM_BLOCK_K || p.k % GEMM_BLOCK_K !== 0 || p.k > 65536)
    fail(`k must be a multiple of ${GEMM_BLOCK_K} in [128, 65536], got ${p.k}`);
  if (!Number.isInteger(p.groups) || p.groups < 1 || p.groups > GEMM_MAX_GROUPS)
    fail(`groups must be an integer in [1, ${GEMM_MAX_GROUPS}], got ${p.groups}`);
  if (!Number.isInteger(p.mTotal) || p.mTotal < 0 || p.mTotal > 2 ** 31 - 256)
    fail(`mTotal must be an integer in [0, 2^31 - 256], got ${p.mTotal}`);
  if (p.groups * p.n > 2 ** 31 - 1)
    fail(`groups · n = ${p.groups * p.n} exceeds the kernel's 32-bit row index`);
  const e = p.expectedRowsPerGroup;
  if (e !== undefined && !(Number.isFinite(e) && e >= 0))
    fail(`expectedRowsPerGroup must be a non-negative number, got ${e}`);
}

/** The estimate of one tile shape on a problem. */
export function estimateGroupedGemm(
  p: GroupedGemmProblem,
  tile: GemmTile,
  smCount = H200_SMS,
): GroupedGemmEstimate {
  const expected = p.expectedRowsPerGroup ?? Math.ceil(p.mTotal / p.groups);
  const activeGroups = expected > 0 ? Math.min(p.groups, Math.max(1, Math.ceil(p.mTotal / expected))) : 0;
  const tiles = activeGroups * Math.ceil(expected / tile.blockM) * (p.n / tile.blockN);
  const waves = Math.ceil(tiles / smCount);
  const perSmFlops = FP8_PEAK_FLOPS / H200_SMS;
  const tileUs = ((2 * tile.blockM * tile.blockN * p.k) / (perSmFlops * TILE_EFFICIENCY[tile.name])) * 1e6;
  const outBytes = p.outDtype === "bf16" ? 2 : 4;
  // FP4 weights: half a byte per element plus a scale byte per 32.
  const weightBytes = p.weightFormat === "fp4" ? p.n * p.k * (0.5 + 1 / 32) : p.n * p.k;
  const bytes = activeGroups * weightBytes + p.mTotal * p.k + p.mTotal * p.n * outBytes;
  const bandwidth = Math.min(READ_BYTES_PER_S, Math.min(tiles, smCount) * SM_READ_BYTES_PER_S);
  const computeUs = waves * tileUs;
  const memoryUs = bandwidth > 0 ? (bytes / bandwidth) * 1e6 : 0;
  return { tiles, waves, computeUs, memoryUs, us: Math.max(computeUs, memoryUs) };
}

/**
 * Chooses the tile shape (least estimated time; ties, within 2%, go to the least tensor-core time, which
 * leaves the most slack) and the deepest pipeline that fits the shared-memory budget.
 */
export function planGroupedGemm(problem: GroupedGemmProblem, options: PlanOptions = {}): GroupedGemmPlan {
  checkGroupedGemmProblem(problem);
  checkOptionFields(
    "planGroupedGemm options",
    options,
    ["smCount", "sharedBudgetBytes", "tile", "stages"],
    (m) => new RangeError(m),
  );
  const smCount = options.smCount ?? H200_SMS;
  const budget = options.sharedBudgetBytes ?? SM90_SHARED_OPTIN_BYTES;
  const outDtype = problem.outDtype ?? "fp32";
  const format = problem.weightFormat ?? "fp8";
  const menu = gemmTileNames(format);
  if (options.tile !== undefined && GEMM_TILES[options.tile] !== undefined && !menu.includes(options.tile)) {
    throw new RangeError(
      `grouped GEMM: tile "${options.tile}" has no ${format} build (${format} tiles: ${menu.join(", ")})`,
    );
  }
  const candidates = (options.tile ? [options.tile] : menu)
    .map((name) => {
      const tile = GEMM_TILES[name];
      if (tile === undefined)
        throw new RangeError(`grouped GEMM: unknown tile "${name}" (${GEMM_TILE_NAMES.join(", ")})`);
      return tile;
    })
    .filter(
      (tile) =>
        problem.n % tile.blockN === 0 && gemmMaxStages(tile, problem.k, problem.groups, budget, format) > 0,
    );
  if (candidates.length === 0) {
    throw new RangeError(
      `grouped GEMM: no tile${options.tile ? ` "${options.tile}"` : ""} fits n=${problem.n}, k=${problem.k}, groups=${problem.groups} in ${budget} bytes of shared memory`,
    );
  }
  let best = candidates[0]!;
  let bestEstimate = estimateGroupedGemm(problem, best, smCount);
  for (const tile of candidates.slice(1)) {
    const e = estimateGroupedGemm(problem, tile, smCount);
    const clearlyFaster = e.us < bestEstimate.us * 0.98;
    const tiedButLighter = e.us <= bestEstimate.us * 1.02 && e.computeUs < bestEstimate.computeUs;
    if (clearlyFaster || tiedButLighter) {
      best = tile;
      bestEstimate = e;
    }
  }
  const maxStages = gemmMaxStages(best, problem.k, problem.groups, budget, format);
  const stages = options.stages ?? maxStages;
  if (!Number.isInteger(stages) || stages < 2 || stages > maxStages) {
    throw new RangeError(
      `grouped GEMM: stages must be in [2, ${maxStages}] for tile ${best.name}, got ${stages}`,
    );
  }
  // Σ_g ⌈r_g / BLOCK_M⌉ ≤ ⌊M / BLOCK_M⌋ + (groups holding a partial block, at most min(G, M)).
  const worstMBlocks = Math.floor(problem.mTotal / best.blockM) + Math.min(problem.groups, problem.mTotal);
  const worstTiles = worstMBlocks * (problem.n / best.blockN);
  return {
    tile: best,
    stages,
    threads: gemmThreads(best),
    sharedBytes: gemmSharedBytes(best, stages, problem.k, problem.groups, format),
    grid: Math.max(1, Math.min(smCount, worstTiles)),
    outDtype,
    defines: gemmDefines({
      tile: best,
      stages,
      n: problem.n,
      k: problem.k,
      groups: problem.groups,
      outBf16: outDtype === "bf16",
      format,
    }),
    estimate: bestEstimate,
  };
}

/**
 * One line for logs and benchmark notes, e.g.
 * "m128n256 × 4 stages, 384 threads, 226816 B shared, grid 132, bf16 out; est. 812.3 µs (compute 812.3, memory 401.2; 1024 tiles in 8 waves)".
 */
export function formatGroupedGemmPlan(plan: GroupedGemmPlan): string {
  const e = plan.estimate;
  return (
    `${plan.tile.name} × ${plan.stages} stages, ${plan.threads} threads, ${plan.sharedBytes} B shared, ` +
    `grid ${plan.grid}, ${plan.outDtype} out; est. ${e.us.toFixed(1)} µs (compute ${e.computeUs.toFixed(1)}, ` +
    `memory ${e.memoryUs.toFixed(1)}; ${e.tiles} tiles in ${e.waves} waves)`
  );
}
