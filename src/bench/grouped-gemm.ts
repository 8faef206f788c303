/**
 * The grouped GEMM's benchmark: operands filled with codes of a chosen distribution, the kernel timed
 * (L2 flushed before each run) beside its floor, max(bytes / read stream, FLOPs / FP8 rate) at the
 * H200's figures (src/cuda/hardware.ts).
 */

import { QUANT_BLOCK } from "../config/config.js";
import { FP8_PEAK_FLOPS, READ_BYTES_PER_S } from "../cuda/hardware.js";
import { type Device, DeviceTensor, type DType, type ResultRow, timeKernel } from "../cuda/index.js";
import type { GemmTileName } from "../kernels/gemm/fp8_grouped_gemm.variants.js";
import {
  aScalesRows,
  type GroupedGemmArgs,
  groupedGemmFp8,
  groupedGemmLaunchGrid,
  takeGroupedGemmStatus,
} from "../kernels/gemm/grouped_gemm.js";
import type { GemmOutDtype, GroupedGemmPlan } from "../kernels/gemm/plan.js";
import { encodeE4m3, FP8_E4M3_MAX } from "../numerics/fp8.js";
import { quantizeRow128, quantizeWeightBlocks } from "../numerics/quant.js";

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
        ctas: groupedGemmLaunchGrid(plan!, c.maxCtas),
      });
    } finally {
      for (const t of tensors) t.dispose();
    }
  }
  return rows;
}
