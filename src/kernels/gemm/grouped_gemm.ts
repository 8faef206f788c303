/**
 * Launcher of the FP8 grouped GEMM (fp8_grouped_gemm.cu) with per-128 block scales:
 *
 *   out[r, n] = Σ_b (Σ_{k in block b} a[r, k] · w[g·N + n, k]) · sa[b, r] · sw[g, n/128, b]
 *
 * for every row r of group g (rows [off[g], off[g+1]) of A and out). The plan picks a tile shape and a
 * pipeline depth from the expected rows per group, N, K and the SM count; kernels are compiled through
 * the JIT once per specialization and memoized per device with their argument block, whose three TMA
 * tensor maps are re-encoded only when a pointer or the row count changes.
 *
 * Layouts (row-major): a e4m3 [M, K]; aScales fp32 [K/128, M_pad] (MN-major: a K block's scales of
 * consecutive rows are contiguous, which the kernel loads with TMA; M_pad = M rounded up to 4 so a row
 * of scales is a multiple of 16 bytes); b e4m3 [G·N, K] (or [G, N, K]); bScales fp32 [G, N/128, K/128]
 * (or [G·N/128, K/128]); groupOffsets int32 [G+1], non-decreasing, anywhere in [0, M] (rows outside
 * every group are left untouched); out fp32 or bf16 [M, N].
 */

import { QUANT_BLOCK } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  DeviceTensor,
  type DType,
  expectOnDevice,
  expectTensor,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceMemo,
  perDeviceOnce,
  type ResultRow,
  type Stream,
  type TensorLike,
  timeKernel,
} from "../../cuda/index.js";
import { encodeE4m3, FP8_E4M3_MAX } from "../../numerics/fp8.js";
import { quantizeRow128, quantizeWeightBlocks } from "../../numerics/quant.js";
import { encodeFp8RowsMap, encodeScaleColumnsMap } from "../tensor-maps.js";

export type { TensorLike };

import { describeDefines, type KernelDefines, SM90_SHARED_OPTIN_BYTES } from "../variants.js";
import {
  GEMM_BLOCK_K,
  GEMM_MAX_GROUPS,
  GEMM_TILE_NAMES,
  GEMM_TILES,
  type GemmTile,
  type GemmTileName,
  gemmDefines,
  gemmMaxStages,
  gemmSharedBytes,
  gemmThreads,
} from "./fp8_grouped_gemm.variants.js";

/** The kernel source, relative to src/kernels. */
export const GROUPED_GEMM_SOURCE = "gemm/fp8_grouped_gemm.cu";
export const GROUPED_GEMM_KERNEL = "megamoe_fp8_grouped_gemm";
/** The CUDA-core version of the same formula in the same module (slow; for diagnosis). */
export const GROUPED_GEMM_REFERENCE_KERNEL = "megamoe_fp8_grouped_gemm_reference";

/**
 * The ceilings the floor and the plan's estimate use (H200): the read stream (4.34 TB/s measured by torch,
 * `probe_read` measures ours; a GEMM's bytes are nearly all weight and A reads, so all bytes go at this
 * rate) and the dense FP8 tensor rate.
 */
export const READ_BYTES_PER_S = 4.3e12;
export const FP8_PEAK_FLOPS = 1.5e15;
const H200_SMS = 132;

export type GemmOutDtype = "fp32" | "bf16";

// ---------------------------------------------------------------------------------------------------
// Plan

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
 * Assumed tensor-core efficiency of a tile shape (fraction of the fp8 peak one SM reaches on a long K
 * loop). Two math warpgroups hide each other's promotion; one cannot. Guesses to calibrate on the GPU.
 */
// Fractions of the dense FP8 rate each tile reached on the H200 at 512–4096 rows per group (flash L1/L2
// shapes, bench/results/2026-12-03-h200-grouped-gemm-tiles.json). m64n128 reaches 0.56 since its
// pipelined promotion (…-2026-12-04-h200-gemm-pipelined-*.json) but keeps the old figure: with it, the
// tie rule picked m64n128 for pro's decode shapes, and the unfused pipeline took 7–10% longer at T = 2
// and 4 than with m64n256 in an earlier call (…-2026-12-04-h200-3b63b8b-layers-pro-unfused-small.json
// against …-v2m-pro-shared0.json).
const TILE_EFFICIENCY: Readonly<Record<GemmTileName, number>> = {
  m128n128: 0.57,
  m128n256: 0.65,
  m64n256: 0.61,
  m64n128: 0.43,
};
/** Bandwidth one SM can draw from memory with its TMA pipeline (a guess; caps small grids). */
const PER_SM_BYTES_PER_S = 1.2e11;

/** Rows of the A-scale layout: M rounded up to 4, so each K block's row of scales is 16-byte aligned. */
export function aScalesRows(mTotal: number): number {
  return Math.ceil(mTotal / 4) * 4;
}

function checkProblem(p: GroupedGemmProblem): void {
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
  const bytes = activeGroups * p.n * p.k + p.mTotal * p.k + p.mTotal * p.n * outBytes;
  const bandwidth = Math.min(READ_BYTES_PER_S, Math.min(tiles, smCount) * PER_SM_BYTES_PER_S);
  const computeUs = waves * tileUs;
  const memoryUs = bandwidth > 0 ? (bytes / bandwidth) * 1e6 : 0;
  return { tiles, waves, computeUs, memoryUs, us: Math.max(computeUs, memoryUs) };
}

/**
 * Chooses the tile shape (least estimated time; ties, within 2%, go to the least tensor-core time, which
 * leaves the most slack) and the deepest pipeline that fits the shared-memory budget.
 */
export function planGroupedGemm(problem: GroupedGemmProblem, options: PlanOptions = {}): GroupedGemmPlan {
  checkProblem(problem);
  const smCount = options.smCount ?? H200_SMS;
  const budget = options.sharedBudgetBytes ?? SM90_SHARED_OPTIN_BYTES;
  const outDtype = problem.outDtype ?? "fp32";
  const candidates = (options.tile ? [options.tile] : GEMM_TILE_NAMES)
    .map((name) => {
      const tile = GEMM_TILES[name];
      if (tile === undefined)
        throw new RangeError(`grouped GEMM: unknown tile "${name}" (${GEMM_TILE_NAMES.join(", ")})`);
      return tile;
    })
    .filter(
      (tile) => problem.n % tile.blockN === 0 && gemmMaxStages(tile, problem.k, problem.groups, budget) > 0,
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
  const maxStages = gemmMaxStages(best, problem.k, problem.groups, budget);
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
    sharedBytes: gemmSharedBytes(best, stages, problem.k, problem.groups),
    grid: Math.max(1, Math.min(smCount, worstTiles)),
    outDtype,
    defines: gemmDefines({
      tile: best,
      stages,
      n: problem.n,
      k: problem.k,
      groups: problem.groups,
      outBf16: outDtype === "bf16",
    }),
    estimate: bestEstimate,
  };
}

// ---------------------------------------------------------------------------------------------------
// Argument checks

/** Operands and sizes of one grouped GEMM. */
export interface GroupedGemmArgs<T extends TensorLike = DeviceTensor> {
  a: T;
  aScales: T;
  b: T;
  bScales: T;
  groupOffsets: T;
  out: T;
  mTotal: number;
  n: number;
  k: number;
  groups: number;
  expectedRowsPerGroup?: number;
  /** Force a tile shape (benchmarks, diagnosis). */
  tile?: GemmTileName;
  /** Cap on the persistent grid (diagnosis: 1 makes one CTA walk every tile). */
  maxCtas?: number;
}

function expect(
  what: string,
  t: TensorLike,
  dtypes: readonly DType[],
  shapes: readonly (readonly number[])[],
) {
  expectTensor("groupedGemmFp8", what, t, dtypes, shapes);
}

/**
 * Checks dtypes and shapes against the sizes; returns the output dtype. Throws an Error naming the first
 * operand that does not fit (pure: usable without a GPU).
 */
export function validateGroupedGemmArgs(args: GroupedGemmArgs<TensorLike>): GemmOutDtype {
  const { mTotal, n, k, groups } = args;
  checkProblem({ mTotal, n, k, groups, expectedRowsPerGroup: args.expectedRowsPerGroup });
  const kb = k / QUANT_BLOCK;
  expect("a", args.a, ["fp8_e4m3"], [[mTotal, k]]);
  expect("aScales", args.aScales, ["fp32"], [[kb, aScalesRows(mTotal)]]);
  expect(
    "b",
    args.b,
    ["fp8_e4m3"],
    [
      [groups * n, k],
      [groups, n, k],
    ],
  );
  expect(
    "bScales",
    args.bScales,
    ["fp32"],
    [
      [groups, n / QUANT_BLOCK, kb],
      [(groups * n) / QUANT_BLOCK, kb],
    ],
  );
  expect("groupOffsets", args.groupOffsets, ["int32"], [[groups + 1]]);
  expect("out", args.out, ["fp32", "bf16"], [[mTotal, n]]);
  if (args.maxCtas !== undefined && !(Number.isInteger(args.maxCtas) && args.maxCtas >= 1)) {
    throw new Error(`groupedGemmFp8: maxCtas must be a positive integer, got ${args.maxCtas}`);
  }
  if (args.tile !== undefined && !GEMM_TILE_NAMES.includes(args.tile)) {
    throw new Error(`groupedGemmFp8: unknown tile "${args.tile}" (${GEMM_TILE_NAMES.join(", ")})`);
  }
  return args.out.dtype === "bf16" ? "bf16" : "fp32";
}

function checkDevices(device: Device, args: GroupedGemmArgs): void {
  const named: [string, DeviceTensor][] = [
    ["a", args.a],
    ["aScales", args.aScales],
    ["b", args.b],
    ["bScales", args.bScales],
    ["groupOffsets", args.groupOffsets],
    ["out", args.out],
  ];
  for (const [what, t] of named) expectOnDevice("groupedGemmFp8", what, t, device);
}

// ---------------------------------------------------------------------------------------------------
// Kernels, memoized per device and specialization

const ARG_COUNT = 8; // map_a, map_b, map_sa, b_scales, group_offsets, out, m_total, status
const REF_ARG_COUNT = 8; // a, b, a_scales, m_pad, b_scales, group_offsets, out, m_total
const REFERENCE_BLOCK = 256;

interface GemmKernel {
  kernel: Kernel;
  reference: Kernel;
  args: KernelArgs;
  refArgs: KernelArgs;
  /** Pointers and row count the tensor maps in `args` were encoded for. */
  mapsKey: string;
}

const gemmKernels = perDeviceMemo<string, GemmKernel>();
const statusBuffers = perDeviceOnce<bigint>();

/** The device's watchdog status word (int32[4], zeroed once; the kernel writes it only on a stall). */
function statusBuffer(device: Device): bigint {
  return statusBuffers(device, () => {
    const ptr = device.alloc(16);
    device.memsetD32(ptr, 0, 4);
    return ptr;
  });
}

function gemmKernelFor(device: Device, plan: GroupedGemmPlan): GemmKernel {
  return gemmKernels(device, describeDefines(plan.defines), () => {
    const compiled = compileKernel({ source: GROUPED_GEMM_SOURCE, defines: plan.defines });
    const kernel = loadKernel(device, compiled, GROUPED_GEMM_KERNEL);
    if (plan.sharedBytes > 48 * 1024) kernel.setMaxDynamicSharedMemory(plan.sharedBytes);
    return {
      kernel,
      reference: loadKernel(device, compiled, GROUPED_GEMM_REFERENCE_KERNEL),
      args: new KernelArgs(ARG_COUNT, { tensorMaps: [0, 1, 2] }),
      refArgs: new KernelArgs(REF_ARG_COUNT),
      mapsKey: "",
    };
  });
}

function encodeMaps(entry: GemmKernel, plan: GroupedGemmPlan, args: GroupedGemmArgs): void {
  const { mTotal, n, k, groups } = args;
  const mapsKey = `${args.a.ptr}:${args.b.ptr}:${args.aScales.ptr}:${mTotal}`;
  if (entry.mapsKey === mapsKey) return;
  entry.mapsKey = "";
  const { blockM, blockN } = plan.tile;
  encodeFp8RowsMap(entry.args.tensorMap(0), args.a.ptr, k, mTotal, blockM);
  encodeFp8RowsMap(entry.args.tensorMap(1), args.b.ptr, k, groups * n, blockN);
  encodeScaleColumnsMap(entry.args.tensorMap(2), args.aScales.ptr, k, aScalesRows(mTotal), blockM + 4);
  entry.mapsKey = mapsKey;
}

function planFor(device: Device, args: GroupedGemmArgs, outDtype: GemmOutDtype): GroupedGemmPlan {
  return planGroupedGemm(
    {
      mTotal: args.mTotal,
      n: args.n,
      k: args.k,
      groups: args.groups,
      expectedRowsPerGroup: args.expectedRowsPerGroup,
      outDtype,
    },
    {
      smCount: device.smCount,
      sharedBudgetBytes: Math.min(device.maxSharedMemoryPerBlockOptin, SM90_SHARED_OPTIN_BYTES),
      tile: args.tile,
    },
  );
}

// ---------------------------------------------------------------------------------------------------
// Launch

/** CTAs a launch of `plan` runs: the plan's grid, under `maxCtas` when given. */
function launchGrid(plan: GroupedGemmPlan, maxCtas: number | undefined): number {
  return Math.min(plan.grid, maxCtas ?? plan.grid);
}

/**
 * Queues out = grouped GEMM (see the module doc) on `stream` (null: the legacy default stream) and
 * returns the plan it used. mTotal = 0 queues nothing. The first call of a specialization compiles the
 * kernel (or reads it from the JIT cache).
 */
export function groupedGemmFp8(
  device: Device,
  args: GroupedGemmArgs,
  stream: Stream | null,
): GroupedGemmPlan {
  const outDtype = validateGroupedGemmArgs(args);
  checkDevices(device, args);
  const plan = planFor(device, args, outDtype);
  if (args.mTotal === 0) return plan;
  const entry = gemmKernelFor(device, plan);
  encodeMaps(entry, plan, args);
  entry.args
    .ptr(3, args.bScales.ptr)
    .ptr(4, args.groupOffsets.ptr)
    .ptr(5, args.out.ptr)
    .i32(6, args.mTotal)
    .ptr(7, statusBuffer(device));
  entry.kernel.launch(launchGrid(plan, args.maxCtas), plan.threads, plan.sharedBytes, stream, entry.args);
  return plan;
}

/**
 * The same product on CUDA cores (one thread per output element, plain loads, no TMA or wgmma), with
 * the same operands and the same tile specialization's module. Slow: for checking the fast kernel on
 * the GPU and for telling a data-plumbing fault from a fault of the fast path.
 */
export function groupedGemmFp8Reference(device: Device, args: GroupedGemmArgs, stream: Stream | null): void {
  const outDtype = validateGroupedGemmArgs(args);
  checkDevices(device, args);
  if (args.mTotal === 0) return;
  const plan = planFor(device, args, outDtype);
  const entry = gemmKernelFor(device, plan);
  entry.refArgs
    .ptr(0, args.a.ptr)
    .ptr(1, args.b.ptr)
    .ptr(2, args.aScales.ptr)
    .i32(3, aScalesRows(args.mTotal))
    .ptr(4, args.bScales.ptr)
    .ptr(5, args.groupOffsets.ptr)
    .ptr(6, args.out.ptr)
    .i32(7, args.mTotal);
  const blocks = Math.ceil((args.mTotal * args.n) / REFERENCE_BLOCK);
  entry.reference.launch(blocks, REFERENCE_BLOCK, 0, stream, entry.refArgs);
}

/** What the kernel's watchdog recorded: a barrier wait that never completed. */
export interface GroupedGemmStall {
  /** "producer" waited on an empty slot, "math" on a full one; "shared-memory" = launch smaller than the build's layout. */
  role: "producer" | "math" | "shared-memory" | "unknown";
  block: number;
  stage: number;
  iteration: number;
  raw: [number, number, number, number];
}

/**
 * Reads and clears the device's watchdog status (waits for queued work). Null when every launch so far
 * ran to completion; a stall leaves garbage in `out`, so a test should call this after its launches.
 */
export function takeGroupedGemmStatus(device: Device): GroupedGemmStall | null {
  const ptr = statusBuffer(device);
  device.synchronize();
  const words = new Int32Array(4);
  device.copyDtoH(words, ptr, 16);
  if (words[0] === 0) return null;
  device.memsetD32(ptr, 0, 4);
  const roles = { 1: "producer", 2: "math", 3: "shared-memory" } as const;
  const role = roles[words[0] as 1 | 2 | 3] ?? "unknown";
  return {
    role,
    block: words[1]!,
    stage: words[2]!,
    iteration: words[3]!,
    raw: [words[0]!, words[1]!, words[2]!, words[3]!],
  };
}

// ---------------------------------------------------------------------------------------------------
// Floor and benchmark

/** Bytes a grouped GEMM must move at least: A, its scales, the active groups' weights and scales, out. */
export function groupedGemmBytes(
  mTotal: number,
  n: number,
  k: number,
  activeGroups: number,
  outDtype: GemmOutDtype,
): number {
  const kb = k / QUANT_BLOCK;
  return (
    mTotal * k +
    4 * kb * aScalesRows(mTotal) +
    activeGroups * n * k +
    4 * activeGroups * (n / QUANT_BLOCK) * kb +
    mTotal * n * (outDtype === "bf16" ? 2 : 4)
  );
}

/** floor = max(bytes / 4.3 TB/s read stream, flops / 1.5 PFLOP/s), in µs. */
export function groupedGemmFloorUs(bytes: number, flops: number): number {
  return Math.max(bytes / READ_BYTES_PER_S, flops / FP8_PEAK_FLOPS) * 1e6;
}

/** One benchmark case: `groups` groups of `mPerGroup` rows each. */
export interface GroupedGemmBenchCase {
  /** Preset name for the results row (default "custom"). */
  config?: string;
  /** Tokens the case stands for (default mTotal). */
  tokens?: number;
  groups: number;
  mPerGroup: number;
  n: number;
  k: number;
  outDtype?: GemmOutDtype;
  tile?: GemmTileName;
  /** Operand codes (default "quantized"): see GemmBenchCodes. */
  codes?: GemmBenchCodes;
  /** Cap on the persistent grid (default: the plan's, one CTA per SM); diagnosis of the clock under the power cap. */
  maxCtas?: number;
}

/**
 * What the benchmark's e4m3 operands hold. "quantized": uniform values in [−1, 1) scaled to the e4m3
 * range and rounded (most codes within a few binades of the maximum). "gaussian": the torch peer's data
 * in this kernel's format: Gaussian values quantized with a scale per 128-channel block of a row (A) and
 * per 128 × 128 block (B), so each block's codes reach ±448 and most lie within 1–2 binades below (the
 * peer's weight blocks differ only in magnitude, which the block scales absorb). "uniform-bytes": every
 * finite byte equally likely, tiny and subnormal codes included. The tensor cores' power, and under the
 * power cap their clock, follows the data, so the three time differently.
 */
export const GEMM_BENCH_CODES = ["quantized", "gaussian", "uniform-bytes"] as const;
export type GemmBenchCodes = (typeof GEMM_BENCH_CODES)[number];

export interface BenchmarkGroupedGemmOptions {
  /** Untimed runs first (default 5). */
  warmup?: number;
  /** Then untimed runs for about this much GPU time (default 0; see TimeKernelOptions.warmupMs). */
  warmupMs?: number;
  /** Timed runs (default 20). */
  iters?: number;
}

/** One benchmark results row. */
export interface GroupedGemmResultRow extends ResultRow {
  m_per_group: number;
  groups: number;
  n: number;
  k: number;
  tile: GemmTileName;
  stages: number;
  codes: GemmBenchCodes;
  /** CTAs launched. */
  ctas: number;
}

const FILL_CHUNK = 8 << 20;

/**
 * Finite e4m3 codes (no NaN codes 0x7F/0xFF) from a cheap LCG, distributed as `codes` says, for rows of
 * `rowBytes` codes quantized in blocks of `blockRows` rows × 128 columns ("gaussian" only; numerics/quant.ts
 * does it). Exported for its tests; the benchmark's operands are its only use.
 */
export function randomCodes(
  count: number,
  seed: number,
  codes: GemmBenchCodes,
  rowBytes: number,
  blockRows: 1 | typeof QUANT_BLOCK,
): Uint8Array {
  const out = new Uint8Array(count);
  let s = seed >>> 0;
  const next = (): number => {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    return s;
  };
  if (codes === "gaussian") {
    if (rowBytes % QUANT_BLOCK !== 0 || count % rowBytes !== 0) {
      throw new RangeError(
        `randomCodes: ${count} codes are not whole rows of ${rowBytes} in 128-wide blocks`,
      );
    }
    // Box–Muller normals, quantized as the layer's operands are: per 128-channel block of a row (A) or per
    // 128 × 128 block (B).
    const values = new Float32Array(count);
    for (let i = 0; i < count; i += 2) {
      const u1 = (next() + 1) / 2 ** 32;
      const u2 = next() / 2 ** 32;
      const r = Math.sqrt(-2 * Math.log(u1));
      values[i] = r * Math.cos(2 * Math.PI * u2);
      if (i + 1 < count) values[i + 1] = r * Math.sin(2 * Math.PI * u2);
    }
    if (blockRows === QUANT_BLOCK) return quantizeWeightBlocks(values, count / rowBytes, rowBytes).q;
    quantizeRow128(values, 0, count, "fp32", out, 0, new Float32Array(count / QUANT_BLOCK), 0);
    return out;
  }
  for (let i = 0; i < count; i++) {
    if (codes === "quantized") {
      out[i] = encodeE4m3((next() / 2 ** 31 - 1) * FP8_E4M3_MAX);
    } else {
      const code = next() >>> 24;
      out[i] = (code & 0x7f) === 0x7f ? code ^ 0x01 : code;
    }
  }
  return out;
}

/**
 * Fills a device tensor [rows, k] with copies of one random chunk of whole `blockRows`-row bands (big
 * weights in little time).
 */
function fillCodes(
  device: Device,
  t: DeviceTensor,
  seed: number,
  codes: GemmBenchCodes,
  blockRows: 1 | typeof QUANT_BLOCK,
): void {
  const k = t.shape[1]!;
  const band = blockRows * k;
  const chunkBytes = Math.min(t.bytes, Math.max(band, Math.floor(FILL_CHUNK / band) * band));
  const chunk = randomCodes(chunkBytes, seed, codes, k, blockRows);
  device.copyHtoD(t.ptr, chunk, chunk.length);
  for (let offset = chunk.length; offset < t.bytes; offset += chunk.length) {
    device.copyDtoD(t.ptr + BigInt(offset), t.ptr, Math.min(chunk.length, t.bytes - offset));
  }
}

function randomScales(count: number, seed: number): Float32Array {
  const out = new Float32Array(count);
  let s = seed >>> 0;
  for (let i = 0; i < count; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    out[i] = 2 ** -10 * (1 + s / 2 ** 32);
  }
  return out;
}

/**
 * Times the kernel (L2 flushed before each run) on each case and returns one row per case:
 * `impl: "grouped-gemm"`, floor = max(bytes / 4.3 TB/s read stream, flops / 1.5 PFLOP/s), achieved TFLOP/s
 * and TB/s.
 */
export function benchmarkGroupedGemm(
  device: Device,
  cases: readonly GroupedGemmBenchCase[],
  options: BenchmarkGroupedGemmOptions = {},
): GroupedGemmResultRow[] {
  const rows: GroupedGemmResultRow[] = [];
  for (const c of cases) {
    const { groups, mPerGroup, n, k } = c;
    if (!Number.isInteger(mPerGroup) || mPerGroup < 1) {
      throw new RangeError(`benchmarkGroupedGemm: mPerGroup must be a positive integer, got ${mPerGroup}`);
    }
    const outDtype = c.outDtype ?? "bf16";
    const mTotal = groups * mPerGroup;
    const kb = k / QUANT_BLOCK;
    const tensors: DeviceTensor[] = [];
    const alloc = <D extends DType>(dtype: D, shape: number[]): DeviceTensor<D> => {
      const t = DeviceTensor.empty(device, dtype, shape);
      tensors.push(t);
      return t;
    };
    try {
      const a = alloc("fp8_e4m3", [mTotal, k]);
      const b = alloc("fp8_e4m3", [groups * n, k]);
      const codes = c.codes ?? "quantized";
      fillCodes(device, a, 0x1234 + mTotal, codes, 1);
      fillCodes(device, b, 0x5678 + n, codes, QUANT_BLOCK);
      const aScales = alloc("fp32", [kb, aScalesRows(mTotal)]);
      aScales.copyFromHost(randomScales(aScales.numel, 11));
      const bScales = alloc("fp32", [groups, n / QUANT_BLOCK, kb]);
      bScales.copyFromHost(randomScales(bScales.numel, 13));
      const groupOffsets = alloc("int32", [groups + 1]);
      groupOffsets.copyFromHost(Int32Array.from({ length: groups + 1 }, (_, g) => g * mPerGroup));
      const out = alloc(outDtype, [mTotal, n]);
      const args: GroupedGemmArgs = {
        a,
        aScales,
        b,
        bScales,
        groupOffsets,
        out,
        mTotal,
        n,
        k,
        groups,
        expectedRowsPerGroup: mPerGroup,
        tile: c.tile,
        maxCtas: c.maxCtas,
      };
      let plan: GroupedGemmPlan | undefined;
      const timing = timeKernel(
        device,
        (s) => {
          plan = groupedGemmFp8(device, args, s);
        },
        { warmup: options.warmup ?? 5, warmupMs: options.warmupMs, iters: options.iters ?? 20 },
      );
      const stall = takeGroupedGemmStatus(device);
      if (stall) throw new Error(`grouped GEMM stalled during the benchmark: ${JSON.stringify(stall)}`);
      const bytes = groupedGemmBytes(mTotal, n, k, groups, outDtype); // mPerGroup ≥ 1: every group is active
      const flops = 2 * mTotal * n * k;
      rows.push({
        config: c.config ?? "custom",
        tokens: c.tokens ?? mTotal,
        shared: false,
        impl: "grouped-gemm",
        us_median: timing.usMedian,
        us_min: timing.usMin,
        us_max: timing.usMax,
        floor_us: groupedGemmFloorUs(bytes, flops),
        tflops: flops / (timing.usMedian * 1e6),
        tbps: bytes / (timing.usMedian * 1e6),
        m_per_group: mPerGroup,
        groups,
        n,
        k,
        out_dtype: outDtype,
        tile: plan!.tile.name,
        stages: plan!.stages,
        estimate_us: plan!.estimate.us,
        codes,
        ctas: launchGrid(plan!, c.maxCtas),
      });
    } finally {
      for (const t of tensors) t.dispose();
    }
  }
  return rows;
}
