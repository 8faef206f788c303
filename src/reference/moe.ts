/**
 * The CPU reference MoE layer: the numerics every backend must follow (docs/numerics.md).
 *
 * Work is grouped by expert so each expert's weights are made or read once, but every value is
 * computed exactly as the per-token formulation in the spec says: the order of fp32 operations is
 * fixed, so the result does not depend on grouping, and the output is deterministic.
 */
import {
  describeValue,
  expertFormatOf,
  type MoEConfig,
  QUANT_BLOCK,
  sharedIntermediate,
  unknownFieldProblem,
  validateConfig,
} from "../config/config.js";
import { bf16BitsToF32, f32ToBf16Bits, roundToBf16 } from "../numerics/bf16.js";
import { dequantizeMxfp4, type Fp4AsFp8, mxfp4RowsToFp8 } from "../numerics/fp4.js";
import { decodeE4m3Array, E4M3_DECODE } from "../numerics/fp8.js";
import { quantizeActivations, quantizeRow128 } from "../numerics/quant.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  expertWeightsProblem,
  type MoEWeightSource,
  type Mxfp4Matrix,
  type RoutedExpertWeights,
  weightSourceProblem,
} from "../weights/types.js";
import { RouterError, type Routing, validateRouting } from "./router.js";
import { swiglu, swigluExact } from "./swiglu.js";

export type { Routing };

export interface ReferenceOptions {
  /** Include the shared expert(s) (default: when the config has them). */
  shared?: boolean;
  /** Called after each expert (routed or shared) is done. */
  onProgress?: (done: number, total: number) => void;
  /** With FP4 experts: receives the count of converted elements and of those not exact in e4m3. */
  fp4Stats?: Fp4ConversionStats;
}

/** FP8 rows of T tokens: e4m3 codes [T, K] and fp32 scales [T, K/128]. */
interface QuantizedRows {
  q: Uint8Array;
  scales: Float32Array;
}

/** Which (token, slot) pairs each expert serves, in token order. */
export function groupByExpert(routing: Routing, tokens: number, config: MoEConfig): Int32Array[] {
  if (typeof routing !== "object" || routing === null) {
    throw new RouterError(
      `routing must be { ids: Int32Array, weights: Float32Array }, got ${String(routing)}`,
    );
  }
  validateRouting(routing.ids, routing.weights, tokens, config);
  const k = config.topK;
  const counts = new Int32Array(config.numExperts);
  for (let i = 0; i < tokens * k; i++) {
    const e = routing.ids[i];
    if (e >= 0) counts[e]++;
  }
  const lists = Array.from({ length: config.numExperts }, (_, e) => new Int32Array(counts[e]));
  counts.fill(0);
  for (let i = 0; i < tokens * k; i++) {
    const e = routing.ids[i];
    if (e >= 0) lists[e][counts[e]++] = i; // i = token·k + slot
  }
  return lists;
}

/**
 * A GEMM's weights as the promotion sees them: per output row, its e4m3 values and one fp32 scale per
 * 128-deep K block. FP8 weights give their codes and 128×128 block scales; MXFP4 weights give the
 * converted codes and per-row 2^ref (numerics/fp4.ts, mxfp4RowsToFp8), as the Hopper kernels will.
 */
interface ScaledRows {
  rows: number;
  cols: number;
  /** Fills wRow [cols] with row r's decoded e4m3 values and wScale [cols/128] with its scales. */
  load(r: number, wRow: Float32Array, wScale: Float32Array): void;
}

function fp8Rows(w: BlockQuantized): ScaledRows {
  const { rows, cols } = w;
  const kBlocks = cols / QUANT_BLOCK;
  return {
    rows,
    cols,
    load(r, wRow, wScale) {
      const base = r * cols;
      for (let i = 0; i < cols; i++) wRow[i] = E4M3_DECODE[w.q[base + i]];
      const scaleBase = Math.floor(r / QUANT_BLOCK) * kBlocks;
      for (let b = 0; b < kBlocks; b++) wScale[b] = w.scales[scaleBase + b];
    },
  };
}

/** Counts of FP4 elements whose FP8 form is not exact, summed over the matrices the reference converted. */
export interface Fp4ConversionStats {
  inexact: number;
  total: number;
}

/** MXFP4 weights converted 128 rows at a time (rows are loaded in increasing order). */
function fp4Rows(w: Mxfp4Matrix, what: string, stats?: Fp4ConversionStats): ScaledRows {
  const { rows, cols } = w;
  const kBlocks = cols / QUANT_BLOCK;
  let chunkStart = -1;
  let chunk: Fp4AsFp8 | null = null;
  return {
    rows,
    cols,
    load(r, wRow, wScale) {
      const start = r - (r % QUANT_BLOCK);
      if (chunk === null || start !== chunkStart) {
        const end = Math.min(rows, start + QUANT_BLOCK);
        chunk = mxfp4RowsToFp8(w, start, end, what);
        chunkStart = start;
        if (stats !== undefined) {
          stats.inexact += chunk.inexact;
          stats.total += (end - start) * cols;
        }
      }
      const local = r - chunkStart;
      for (let i = 0; i < cols; i++) wRow[i] = E4M3_DECODE[chunk.q[local * cols + i]];
      for (let b = 0; b < kBlocks; b++) wScale[b] = chunk.scales[local * kBlocks + b];
    },
  };
}

/**
 * One block-scaled FP8 GEMM row set: out[r, n] for the given activation rows against every row n of
 * `w`. Per 128-wide K block the exact dot of the decoded FP8 values (in double: products of two e4m3
 * values and their sums over one block are exact) is rounded to fp32, multiplied by the fp32 product
 * of the two scales (activation row's, weight row's), and added to the fp32 accumulator, blocks in
 * increasing K order.
 */
function blockScaledGemm(
  rows: Float32Array[],
  rowScales: Float32Array[],
  w: ScaledRows,
  out: Float32Array[],
): void {
  const { rows: n, cols: k } = w;
  const kBlocks = k / QUANT_BLOCK;
  const wRow = new Float32Array(k);
  const wScale = new Float32Array(kBlocks);
  for (let r = 0; r < n; r++) {
    w.load(r, wRow, wScale);
    // Two rows at a time share each weight load; the block sums are exact, so the order is free.
    let t = 0;
    for (; t + 1 < rows.length; t += 2) {
      const a0 = rows[t];
      const a1 = rows[t + 1];
      let acc0 = 0;
      let acc1 = 0;
      for (let b = 0; b < kBlocks; b++) {
        let p0 = 0;
        let p1 = 0;
        const end = (b + 1) * QUANT_BLOCK;
        for (let i = b * QUANT_BLOCK; i < end; i++) {
          const v = wRow[i];
          p0 += a0[i] * v;
          p1 += a1[i] * v;
        }
        acc0 = promote(acc0, p0, rowScales[t][b], wScale[b]);
        acc1 = promote(acc1, p1, rowScales[t + 1][b], wScale[b]);
      }
      out[t][r] = acc0;
      out[t + 1][r] = acc1;
    }
    if (t < rows.length) {
      const a = rows[t];
      let acc = 0;
      for (let b = 0; b < kBlocks; b++) {
        let partial = 0;
        const end = (b + 1) * QUANT_BLOCK;
        for (let i = b * QUANT_BLOCK; i < end; i++) partial += a[i] * wRow[i];
        acc = promote(acc, partial, rowScales[t][b], wScale[b]);
      }
      out[t][r] = acc;
    }
  }
}

/** One K block's promotion: acc + fp32(partial) · fp32(scale_a · scale_w), each step rounded to fp32. */
function promote(acc: number, partial: number, scaleA: number, scaleW: number): number {
  return Math.fround(acc + Math.fround(Math.fround(partial) * Math.fround(scaleA * scaleW)));
}

/** Both matrices of an expert in either format, as the GEMMs read them. */
function expertRows(
  w: RoutedExpertWeights,
  what: string,
  stats?: Fp4ConversionStats,
): { w1: ScaledRows; w2: ScaledRows } {
  if (w.format === "fp4") {
    return { w1: fp4Rows(w.w1, `${what} W1`, stats), w2: fp4Rows(w.w2, `${what} W2`, stats) };
  }
  return { w1: fp8Rows(w.w1), w2: fp8Rows(w.w2) };
}

/**
 * One expert MLP on FP8 rows: L1 → SwiGLU → re-quantization → L2. Returns the fp32 L2 results [H]
 * of every row, in the order given. `rowName(i)` names row i in an error ("expert 3, token 5").
 */
function expertForward(
  config: MoEConfig,
  weights: { w1: ScaledRows; w2: ScaledRows },
  rows: Float32Array[],
  rowScales: Float32Array[],
  rowName: (row: number) => string,
): Float32Array[] {
  const inter = weights.w1.rows / 2;
  const l1 = rows.map(() => new Float32Array(2 * inter));
  blockScaledGemm(rows, rowScales, weights.w1, l1);
  const hRows: Float32Array[] = [];
  const hScales: Float32Array[] = [];
  const h = new Float32Array(inter);
  const hq = new Uint8Array(inter);
  for (const [i, acc] of l1.entries()) {
    for (let n = 0; n < inter; n++) {
      h[n] = swiglu(acc[n], acc[inter + n], config.swigluClamp);
      // Finite x and weights can still overflow the fp32 L1 sums; say so, not "quantizeRow128: NaN".
      if (!Number.isFinite(h[n])) {
        throw new RangeError(
          `${rowName(i)}: the SwiGLU of the L1 results is ${h[n]} at intermediate channel ${n} (an fp32 overflow: the input or the weights are too large)`,
        );
      }
    }
    const scales = new Float32Array(inter / QUANT_BLOCK);
    quantizeRow128(h, 0, inter, config.scaleFormat, hq, 0, scales, 0);
    const hRow = new Float32Array(inter);
    decodeE4m3Array(hq, hRow);
    hRows.push(hRow);
    hScales.push(scales);
  }
  const out = rows.map(() => new Float32Array(config.hidden));
  blockScaledGemm(hRows, hScales, weights.w2, out);
  return out;
}

/**
 * One expert (routed, in either format, or shared) on rows already quantized: e4m3 codes q [rows, H] and
 * their scales [rows, H/128] in, the L2 results rounded to bf16 out (bits, [rows, H]): per row exactly
 * what `referenceMoE` computes for a slot of that expert, since no row's value depends on the others.
 * For models of kernels that place rows themselves (test/helpers/ep-protocol.ts).
 */
export function expertOnQuantizedRows(
  config: MoEConfig,
  weights: RoutedExpertWeights,
  q: Uint8Array,
  scales: Float32Array,
  rows: number,
): Uint16Array {
  const h = config.hidden;
  const kb = h / QUANT_BLOCK;
  if (q.length < rows * h || scales.length < rows * kb) {
    throw new RangeError(
      `expertOnQuantizedRows: ${rows} rows need ${rows * h} codes and ${rows * kb} scales`,
    );
  }
  const decoded = new Float32Array(rows * h);
  decodeE4m3Array(q.subarray(0, rows * h), decoded);
  const y = expertForward(
    config,
    expertRows(weights, "expert"),
    Array.from({ length: rows }, (_, r) => decoded.subarray(r * h, (r + 1) * h)),
    Array.from({ length: rows }, (_, r) => scales.subarray(r * kb, (r + 1) * kb)),
    (r) => `expertOnQuantizedRows, row ${r}`,
  );
  const out = new Uint16Array(rows * h);
  y.forEach((row, r) => {
    for (let n = 0; n < h; n++) out[r * h + n] = f32ToBf16Bits(row[n]);
  });
  return out;
}

/** Rows (views of the decoded [T, H] values, decoded once per layer) and scales of the given tokens. */
function quantizedTokenRows(x: QuantizedRows, decoded: Float32Array, tokens: number[], config: MoEConfig) {
  const h = config.hidden;
  const kb = h / QUANT_BLOCK;
  return {
    rows: tokens.map((t) => decoded.subarray(t * h, (t + 1) * h)),
    scales: tokens.map((t) => x.scales.subarray(t * kb, (t + 1) * kb)),
  };
}

/** Which experts a forward runs, in order, over which (token, slot) pairs; and whether the shared one runs. */
interface ExpertWork {
  lists: Int32Array[];
  active: number[];
  shared: ExpertWeights | null;
  /** Experts to run in all (routed and shared), for progress. */
  total: number;
}

const REFERENCE_OPTIONS: readonly string[] = ["shared", "onProgress", "fp4Stats"];

/** The options' kinds and names: a misspelt `shared` would otherwise be ignored without a word. */
function checkReferenceOptions(options: unknown): asserts options is ReferenceOptions {
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`reference options must be an object, got ${describeValue(options)}`);
  }
  const o = options as Record<string, unknown>;
  const unknown = unknownFieldProblem("reference options", o, REFERENCE_OPTIONS);
  if (unknown !== null) throw new TypeError(unknown);
  if (o.shared !== undefined && typeof o.shared !== "boolean") {
    throw new TypeError(`reference options.shared must be true or false, got ${describeValue(o.shared)}`);
  }
  if (o.onProgress !== undefined && typeof o.onProgress !== "function") {
    throw new TypeError(
      `reference options.onProgress must be a function, got ${describeValue(o.onProgress)}`,
    );
  }
}

/** source.expert(e), checked: a wrong shape or format is an error here, not a wrong output. */
function routedExpert(source: MoEWeightSource, config: MoEConfig, e: number): RoutedExpertWeights {
  const w = source.expert(e);
  const problem = expertWeightsProblem(
    w,
    `expert ${e}`,
    expertFormatOf(config),
    config.hidden,
    config.intermediate,
  );
  if (problem !== null) throw new TypeError(`the weight source's ${problem}`);
  return w;
}

function planExpertWork(
  routing: Routing,
  tokens: number,
  source: MoEWeightSource,
  options: ReferenceOptions,
): ExpertWork {
  const problem = weightSourceProblem(source);
  if (problem !== null) throw new TypeError(problem);
  const config = validateConfig(source.config); // returns at once for a validated config
  checkReferenceOptions(options);
  const lists = groupByExpert(routing, tokens, config);
  const active = lists.map((l, e) => (l.length > 0 ? e : -1)).filter((e) => e >= 0);
  let shared: ExpertWeights | null = null;
  if ((options.shared ?? true) && config.numShared > 0) {
    shared = source.shared();
    if (shared === null) throw new Error("config has shared experts but the weight source has none");
    const problem = expertWeightsProblem(
      shared,
      "shared expert",
      "fp8",
      config.hidden,
      sharedIntermediate(config),
    );
    if (problem !== null) throw new TypeError(`the weight source's ${problem}`);
  }
  return { lists, active, shared, total: active.length + (shared !== null ? 1 : 0) };
}

/**
 * The reference layer: bf16 x [T, H] and routing in, bf16 [T, H] out (raw bits).
 *
 * Combine (per token, fixed order): acc = 0; for each routed slot in slot order,
 * acc = fp32(acc + fp32(w · bf16(y_slot))); then acc = fp32(acc + bf16(y_shared)); out = bf16(acc).
 */
export function referenceMoE(
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  source: MoEWeightSource,
  options: ReferenceOptions = {},
): Uint16Array {
  const { lists, active, shared, total } = planExpertWork(routing, tokens, source, options);
  const config = source.config;
  const { hidden, topK: k } = config;
  const xq = quantizeActivations(x, tokens, hidden, config.scaleFormat);
  const xDecoded = new Float32Array(xq.q.length);
  decodeE4m3Array(xq.q, xDecoded);
  let done = 0;

  // bf16-rounded L2 results per (token, slot), as the combine reads them.
  const slotOut = new Float32Array(tokens * k * hidden);
  for (const e of active) {
    const pairs = Array.from(lists[e]);
    const tokenOf = pairs.map((p) => Math.floor(p / k));
    const { rows, scales } = quantizedTokenRows(xq, xDecoded, tokenOf, config);
    const y = expertForward(
      config,
      expertRows(routedExpert(source, config, e), `expert ${e}`, options.fp4Stats),
      rows,
      scales,
      (i) => `expert ${e}, token ${tokenOf[i]}`,
    );
    pairs.forEach((p, i) => {
      const dst = slotOut.subarray(p * hidden, (p + 1) * hidden);
      for (let n = 0; n < hidden; n++) dst[n] = roundToBf16(y[i][n]);
    });
    options.onProgress?.(++done, total);
  }

  let sharedOut: Float32Array[] | null = null;
  if (shared !== null) {
    const all = Array.from({ length: tokens }, (_, t) => t);
    const { rows, scales } = quantizedTokenRows(xq, xDecoded, all, config);
    sharedOut = expertForward(
      config,
      expertRows(shared, "shared expert"),
      rows,
      scales,
      (t) => `shared expert, token ${t}`,
    );
    options.onProgress?.(++done, total);
  }

  const out = new Uint16Array(tokens * hidden);
  for (let t = 0; t < tokens; t++) {
    for (let n = 0; n < hidden; n++) {
      let acc = 0;
      for (let s = 0; s < k; s++) {
        if (routing.ids[t * k + s] < 0) continue;
        const y = slotOut[(t * k + s) * hidden + n];
        acc = Math.fround(acc + Math.fround(routing.weights[t * k + s] * y));
      }
      if (sharedOut !== null) acc = Math.fround(acc + roundToBf16(sharedOut[t][n]));
      out[t * hidden + n] = f32ToBf16Bits(acc);
    }
  }
  return out;
}

/**
 * Dequantized weights of a block-quantized matrix, in double: decode(q) · scale is exact there, which
 * the fp32 dequantizeWeightBlocks is not (4 + 24 significant bits), and the ideal must not round.
 * Written into the front of `out`, which the caller keeps from expert to expert: a fresh array of this
 * size costs more in page faults than the decoding itself.
 */
function dequantizeToF64(w: BlockQuantized | Mxfp4Matrix, what: string, out: Float64Array): Float64Array {
  if ("packed" in w) return dequantizeMxfp4(w, what, out);
  const { rows, cols } = w;
  const kb = cols / QUANT_BLOCK;
  const values = out.subarray(0, rows * cols);
  for (let r = 0; r < rows; r++) {
    const scaleRow = Math.floor(r / QUANT_BLOCK) * kb;
    for (let b = 0; b < kb; b++) {
      const scale = w.scales[scaleRow + b];
      const start = r * cols + b * QUANT_BLOCK;
      for (let i = start; i < start + QUANT_BLOCK; i++) values[i] = E4M3_DECODE[w.q[i]] * scale;
    }
  }
  return values;
}

/**
 * The exact MLP of several rows: each weight row is read once for all of them (the matrices do not fit
 * a cache, the rows do); every dot product still sums in increasing channel order.
 */
function idealMlpRows(
  config: MoEConfig,
  w1: Float64Array,
  w2: Float64Array,
  inter: number,
  xs: Float64Array[],
): Float64Array[] {
  const hidden = config.hidden;
  const hs = xs.map(() => new Float64Array(inter));
  for (let n = 0; n < inter; n++) {
    const gate = w1.subarray(n * hidden, (n + 1) * hidden);
    const up = w1.subarray((inter + n) * hidden, (inter + n + 1) * hidden);
    for (let t = 0; t < xs.length; t++) {
      const x = xs[t];
      let g = 0;
      let u = 0;
      for (let i = 0; i < hidden; i++) {
        g += x[i] * gate[i];
        u += x[i] * up[i];
      }
      hs[t][n] = swigluExact(g, u, config.swigluClamp);
    }
  }
  const ys = xs.map(() => new Float64Array(hidden));
  for (let n = 0; n < hidden; n++) {
    const down = w2.subarray(n * inter, (n + 1) * inter);
    for (let t = 0; t < xs.length; t++) {
      const h = hs[t];
      let acc = 0;
      for (let i = 0; i < inter; i++) acc += h[i] * down[i];
      ys[t][n] = acc;
    }
  }
  return ys;
}

/** Rows per idealMlpRows call: enough to reuse each weight row, few enough to keep their results small. */
const IDEAL_ROW_CHUNK = 64;

/** idealMlpRows over xs in chunks; `use(i, y)` gets row i's result, rows in order. */
function forRowChunks(
  config: MoEConfig,
  w1: Float64Array,
  w2: Float64Array,
  inter: number,
  xs: Float64Array[],
  use: (i: number, y: Float64Array) => void,
): void {
  for (let start = 0; start < xs.length; start += IDEAL_ROW_CHUNK) {
    const ys = idealMlpRows(config, w1, w2, inter, xs.slice(start, start + IDEAL_ROW_CHUNK));
    for (const [i, y] of ys.entries()) use(start + i, y);
  }
}

/**
 * The FP64 "ideal" layer: the same weights (dequantized FP8, or the exact MXFP4 values), but no activation quantization and no
 * intermediate rounding. Its distance to `referenceMoE` is the error FP8 itself costs.
 */
export function idealMoE(
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  source: MoEWeightSource,
  options: ReferenceOptions = {},
): Float64Array {
  const { lists, active, shared, total } = planExpertWork(routing, tokens, source, options);
  const config = source.config;
  const { hidden, topK: k } = config;
  if (!(x instanceof Uint16Array) || x.length !== tokens * hidden) {
    throw new RangeError(
      `idealMoE: x must be a Uint16Array of tokens × hidden = ${tokens * hidden} bf16 values`,
    );
  }
  const xs = Array.from({ length: tokens }, (_, t) => {
    const row = new Float64Array(hidden);
    for (let i = 0; i < hidden; i++) {
      row[i] = bf16BitsToF32(x[t * hidden + i]);
      // As referenceMoE's quantization does: a NaN or ±inf would run through to a NaN output.
      if (!Number.isFinite(row[i])) {
        throw new RangeError(`idealMoE: x holds a non-finite value at token ${t}, channel ${i}`);
      }
    }
    return row;
  });
  const out = new Float64Array(tokens * hidden);
  // W1 of the larger MLP (routed or shared) holds either matrix of both.
  const most = 2 * Math.max(config.intermediate, shared === null ? 0 : sharedIntermediate(config)) * hidden;
  const w1Values = new Float64Array(most);
  const w2Values = new Float64Array(most / 2);
  let done = 0;
  for (const e of active) {
    const w = routedExpert(source, config, e);
    const w1 = dequantizeToF64(w.w1, `expert ${e} W1`, w1Values);
    const w2 = dequantizeToF64(w.w2, `expert ${e} W2`, w2Values);
    const pairs = Array.from(lists[e]);
    const tokenOf = pairs.map((p) => Math.floor(p / k));
    forRowChunks(
      config,
      w1,
      w2,
      config.intermediate,
      tokenOf.map((t) => xs[t]),
      (i, y) => {
        const t = tokenOf[i];
        const weight = routing.weights[pairs[i]];
        for (let n = 0; n < hidden; n++) out[t * hidden + n] += weight * y[n];
      },
    );
    options.onProgress?.(++done, total);
  }
  if (shared !== null) {
    const w1 = dequantizeToF64(shared.w1, "shared W1", w1Values);
    const w2 = dequantizeToF64(shared.w2, "shared W2", w2Values);
    forRowChunks(config, w1, w2, sharedIntermediate(config), xs, (t, y) => {
      for (let n = 0; n < hidden; n++) out[t * hidden + n] += y[n];
    });
    options.onProgress?.(++done, total);
  }
  return out;
}
