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
import { bf16BitsToF32, f32ToBf16Bits, isBf16NonFinite, roundToBf16 } from "../numerics/bf16.js";
import { dequantizeMxfp4, type Fp4AsFp8, mxfp4RowsToFp8 } from "../numerics/fp4.js";
import { decodeE4m3Array, E4M3_DECODE } from "../numerics/fp8.js";
import { fmaF32, NumericsError } from "../numerics/fp32.js";
import { quantizeActivations, quantizeRow128 } from "../numerics/quant.js";
import { generateNumberedExpert } from "../weights/generate.js";
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
import { availableThreads, MAX_THREADS, runTasks } from "./threads.js";

export type { Routing };

export interface ReferenceOptions {
  /** Include the shared expert(s) (default: when the config has them). */
  shared?: boolean;
  /** Called after each expert (routed or shared) is done. */
  onProgress?: (done: number, total: number) => void;
  /** With FP4 experts: receives the count of converted elements and of those not exact in e4m3. */
  fp4Stats?: Fp4ConversionStats;
  /**
   * Threads for the experts (1: this one alone). Default: MEGAMOE_CPU_THREADS, else for experts of a
   * million weights or more as many as the machine has cores and memory for; the bits are the same.
   */
  threads?: number;
}

/**
 * Throws NumericsError naming the first non-finite element of a layer's bf16 output [tokens, hidden]
 * (`what` names the output: "the cuda layer's output"). The CPU reference never returns one (it throws
 * naming the cause); the GPU kernels write what fp32 gives, so a caller that reads a GPU output back
 * checks it here (the CLI's run and check do).
 */
export function checkFiniteOutput(out: Uint16Array, hidden: number, what: string): void {
  for (let i = 0; i < out.length; i++) {
    if (isBf16NonFinite(out[i])) {
      throw new NumericsError(
        `${what}[${Math.floor(i / hidden)}, ${i % hidden}] is ${bf16BitsToF32(out[i])} (bf16 bits 0x${out[i].toString(16)}): finite inputs and weights overflowed fp32 (docs/numerics.md, "Overflow")`,
      );
    }
  }
}

/** The largest |value| of a quantized row: its e4m3 values times their 128-channel block scales. */
function rowMagnitude(row: Float32Array, scales: Float32Array): number {
  let max = 0;
  for (let i = 0; i < row.length; i++)
    max = Math.max(max, Math.abs(row[i]) * scales[Math.floor(i / QUANT_BLOCK)]);
  return max;
}

/** Which (token, slot) pairs each expert serves, in token order. */
export function groupByExpert(routing: Routing, tokens: number, config: MoEConfig): Int32Array[] {
  if (typeof routing !== "object" || routing === null) {
    throw new RouterError(
      `routing must be { ids: Int32Array, weights: Float32Array }, got ${describeValue(routing)}`,
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
        acc0 = promoteBlock(acc0, p0, rowScales[t][b], wScale[b]);
        acc1 = promoteBlock(acc1, p1, rowScales[t + 1][b], wScale[b]);
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
        acc = promoteBlock(acc, partial, rowScales[t][b], wScale[b]);
      }
      out[t][r] = acc;
    }
  }
}

/**
 * One K block's promotion: fp32(acc + fp32(partial) · fp32(scale_a · scale_w)), the product and the sum
 * rounded once together (the GPU's fmaf).
 */
export function promoteBlock(acc: number, partial: number, scaleA: number, scaleW: number): number {
  return fmaF32(Math.fround(partial), Math.fround(scaleA * scaleW), acc);
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
 * of every row, in the order given. An fp32 overflow throws NumericsError naming the expert (`what`)
 * and the row (`rowName(i)`: "x[5]", the token's input).
 */
function expertForward(
  config: MoEConfig,
  weights: { w1: ScaledRows; w2: ScaledRows },
  rows: Float32Array[],
  rowScales: Float32Array[],
  what: string,
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
        throw new NumericsError(
          `${what}: ${rowName(i)} (largest |value| ${rowMagnitude(rows[i], rowScales[i]).toExponential(3)}) times W1 overflows fp32: at intermediate channel ${n} the L1 results are gate ${acc[n]}, up ${acc[inter + n]}, their SwiGLU ${h[n]} (the input or the weights are too large)`,
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
  for (const [i, y] of out.entries()) {
    const n = y.findIndex((v) => !Number.isFinite(v));
    if (n >= 0) {
      throw new NumericsError(
        `${what}: for ${rowName(i)} the L2 result is ${y[n]} at output channel ${n}: the intermediate (largest |value| ${rowMagnitude(hRows[i], hScales[i]).toExponential(3)}) times W2 overflows fp32 (the input or the weights are too large)`,
      );
    }
  }
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
    "expertOnQuantizedRows",
    (r) => `row ${r}`,
  );
  const out = new Uint16Array(rows * h);
  y.forEach((row, r) => {
    for (let n = 0; n < h; n++) out[r * h + n] = f32ToBf16Bits(row[n]);
  });
  return out;
}

/** Rows (views of the decoded [T, H] values) and scales of the given tokens. */
function tokenRows(x: Float32Array, xScales: Float32Array, tokens: number[], config: MoEConfig) {
  const h = config.hidden;
  const kb = h / QUANT_BLOCK;
  return {
    rows: tokens.map((t) => x.subarray(t * h, (t + 1) * h)),
    scales: tokens.map((t) => xScales.subarray(t * kb, (t + 1) * kb)),
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

const REFERENCE_OPTIONS: readonly string[] = ["shared", "onProgress", "fp4Stats", "threads"];

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
  if (o.threads !== undefined) checkThreads("reference options.threads", o.threads);
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

// ---------------------------------------------------------------------------------------------------
// The expert work: one task per active routed expert, then the shared expert's, each writing rows no
// other task writes. The same function runs them here or on worker threads (threads.ts, worker.ts), so
// the results are the same bits either way; the sums across tasks happen afterwards, in a fixed order.

/** What a forward's expert tasks read and write: flat, on SharedArrayBuffers when threads run them. */
interface JobBase {
  config: MoEConfig;
  /** The weight source's `generated`, or null: with it, a worker makes the routed experts itself. */
  generated: { seed: number; firstExpert: number } | null;
}

/** referenceMoE's: decoded e4m3 activations in, L2 results out. */
export interface ReferenceJob extends JobBase {
  mode: "reference";
  /** Decoded e4m3 activations [T, H] and their scales [T, H/128]. */
  x: Float32Array;
  xScales: Float32Array;
  /** bf16-rounded L2 results per (token, slot) [T·k, H]; the shared expert's fp32 L2 results [T, H]. */
  slotOut: Float32Array;
  sharedOut: Float32Array;
}

/** idealMoE's: the bf16 activations as doubles in, exact L2 results out. */
export interface IdealJob extends JobBase {
  mode: "ideal";
  /** [T, H]. */
  x: Float64Array;
  /** Per (token, slot) [T·k, H]; the shared expert's [T, H]. */
  slotOut: Float64Array;
  sharedOut: Float64Array;
}

export type ExpertJob = ReferenceJob | IdealJob;

/** A routed expert over its (token, slot) pairs (token·k + slot, in token order), or the shared expert over every token. */
export interface ExpertTask {
  expert: number | "shared";
  pairs: Int32Array;
  /** The weights, or null for a routed expert of the generator's, which the task then makes. */
  weights: RoutedExpertWeights | null;
}

/** Buffers a thread keeps from task to task: a fresh 100 MB array costs more in page faults than its use. */
export class ExpertScratch {
  private f32: Float32Array | null = null;
  private f64: [Float64Array, Float64Array] | null = null;

  /** The generator's fp32 buffer for W1 of an MLP with `inter` channels (W1 ≥ W2 in size). */
  generation(config: MoEConfig, inter: number): Float32Array {
    const need = 2 * inter * config.hidden;
    if (this.f32 === null || this.f32.length < need) this.f32 = new Float32Array(need);
    return this.f32;
  }

  /** W1 and W2 of an MLP with `inter` channels, in double. */
  ideal(config: MoEConfig, inter: number): [Float64Array, Float64Array] {
    const need = 2 * inter * config.hidden;
    if (this.f64 === null || this.f64[0].length < need) {
      this.f64 = [new Float64Array(need), new Float64Array(need / 2)];
    }
    return this.f64;
  }
}

/** Runs one task of `job`, writing its rows of slotOut or sharedOut; returns the FP4 conversion counts. */
export function runExpertTask(job: ExpertJob, task: ExpertTask, scratch: ExpertScratch): Fp4ConversionStats {
  const { config } = job;
  const { hidden: h, topK: k } = config;
  const stats: Fp4ConversionStats = { inexact: 0, total: 0 };
  const shared = task.expert === "shared";
  const inter = shared ? sharedIntermediate(config) : config.intermediate;
  let weights = task.weights;
  if (weights === null) {
    if (shared || job.generated === null)
      throw new Error(`${task.expert}: a task without weights needs the generator's`);
    const e = job.generated.firstExpert + (task.expert as number);
    weights = generateNumberedExpert(config, job.generated.seed, e, scratch.generation(config, inter));
  }
  // Row i of the task's results is pair i's row of slotOut, or token i's of sharedOut.
  const tokens = shared
    ? Array.from({ length: job.x.length / h }, (_, t) => t)
    : Array.from(task.pairs, (p) => Math.floor(p / k));
  const dst = (i: number) => (shared ? i : task.pairs[i]) * h;
  if (job.mode === "reference") {
    const what = shared ? "shared expert" : `expert ${task.expert}`;
    const { rows, scales } = tokenRows(job.x, job.xScales, tokens, config);
    const y = expertForward(
      config,
      expertRows(weights, what, stats),
      rows,
      scales,
      what,
      (i) => `x[${tokens[i]}]`,
    );
    for (const [i, row] of y.entries()) {
      if (shared) job.sharedOut.set(row, dst(i));
      else {
        const out = job.slotOut.subarray(dst(i), dst(i) + h);
        for (let n = 0; n < h; n++) out[n] = roundToBf16(row[n]);
      }
    }
  } else {
    const what = shared ? "shared" : `expert ${task.expert}`;
    const [b1, b2] = scratch.ideal(config, inter);
    const w1 = dequantizeToF64(weights.w1, `${what} W1`, b1);
    const w2 = dequantizeToF64(weights.w2, `${what} W2`, b2);
    const xs = tokens.map((t) => job.x.subarray(t * h, (t + 1) * h));
    const out = shared ? job.sharedOut : job.slotOut;
    forRowChunks(config, w1, w2, inter, xs, (i, y) => out.set(y, dst(i)));
  }
  return stats;
}

/** A routed expert's weights with each array on a buffer of its own, so that posting it copies no more. */
function compactWeights(w: RoutedExpertWeights): RoutedExpertWeights {
  const own = <T extends Uint8Array | Float32Array>(a: T): T =>
    a.byteOffset === 0 && a.byteLength === a.buffer.byteLength ? a : (a.slice() as T);
  if (w.format === "fp4") {
    const m = (x: Mxfp4Matrix): Mxfp4Matrix => ({ ...x, packed: own(x.packed), scales: own(x.scales) });
    return { ...w, w1: m(w.w1), w2: m(w.w2) };
  }
  const m = (x: BlockQuantized): BlockQuantized => ({ ...x, q: own(x.q), scales: own(x.scales) });
  return { ...w, w1: m(w.w1), w2: m(w.w2) };
}

/** Throws a RangeError naming `what` unless `value` is a thread count: an integer in [1, MAX_THREADS]. */
function checkThreads(what: string, value: unknown): void {
  if (typeof value !== "number" || !Number.isInteger(value) || value < 1 || value > MAX_THREADS) {
    throw new RangeError(`${what} must be an integer in [1, ${MAX_THREADS}], got ${describeValue(value)}`);
  }
}

/** Experts smaller than this (hidden · intermediate) run on the calling thread unless threads are asked for. */
const THREADED_EXPERT_MIN = 1 << 20;

/**
 * Threads for a forward's expert tasks: `requested` (options.threads), else MEGAMOE_CPU_THREADS, else
 * as many as the machine has, the tasks need and half the memory left to the process holds (cgroup
 * limits included; a worker keeps ~12 bytes per weight of the largest MLP, 36 for the ideal's doubles);
 * 1 for small experts, where starting threads costs more than they save.
 */
function referenceThreads(
  config: MoEConfig,
  work: ExpertWork,
  mode: ExpertJob["mode"],
  requested?: number,
): number {
  const env = process.env.MEGAMOE_CPU_THREADS;
  let asked = requested;
  if (asked === undefined && env !== undefined && env !== "") {
    asked = Number(env);
    checkThreads("MEGAMOE_CPU_THREADS", /^[0-9]+$/.test(env) ? asked : env);
  }
  if (asked !== undefined) return Math.min(asked, work.total);
  const inter = Math.max(config.intermediate, work.shared === null ? 0 : sharedIntermediate(config));
  if (config.hidden * inter < THREADED_EXPERT_MIN) return 1;
  const perWorker = (mode === "ideal" ? 36 : 12) * inter * config.hidden + (64 << 20);
  const byMemory = Math.floor(process.availableMemory() / 2 / perWorker);
  return Math.max(1, Math.min(availableThreads(), work.total, byMemory));
}

/** A job buffer of n elements, on a SharedArrayBuffer when worker threads will write it. */
function jobArray<T extends Float32Array | Float64Array>(
  Ctor: {
    new (buffer: ArrayBuffer | SharedArrayBuffer): T;
    new (length: number): T;
    BYTES_PER_ELEMENT: number;
  },
  n: number,
  shared: boolean,
): T {
  return shared ? new Ctor(new SharedArrayBuffer(Ctor.BYTES_PER_ELEMENT * n)) : new Ctor(n);
}

/** Runs a forward's expert tasks on worker threads when `threads` > 1 (and they start), else here, in order. */
function runExperts(
  job: ExpertJob,
  work: ExpertWork,
  source: MoEWeightSource,
  options: ReferenceOptions,
  threads: number,
): void {
  const tasks: ExpertTask[] = work.active.map((e) => ({ expert: e, pairs: work.lists[e], weights: null }));
  if (work.shared !== null) tasks.push({ expert: "shared", pairs: new Int32Array(0), weights: work.shared });
  let done = 0;
  const finish = (stats: Fp4ConversionStats) => {
    if (options.fp4Stats !== undefined) {
      options.fp4Stats.inexact += stats.inexact;
      options.fp4Stats.total += stats.total;
    }
    options.onProgress?.(++done, work.total);
  };
  // Here each expert comes from the source (which may cache it); on a worker the generator's are made
  // there, and others are read here and copied over.
  const weightsOf = (t: ExpertTask, worker: boolean): RoutedExpertWeights | null => {
    if (t.weights !== null) return worker ? compactWeights(t.weights) : t.weights;
    if (worker && job.generated !== null) return null;
    const w = routedExpert(source, job.config, t.expert as number);
    return worker ? compactWeights(w) : w;
  };
  const posted = (i: number): ExpertTask => ({ ...tasks[i], weights: weightsOf(tasks[i], true) });
  if (threads > 1 && runTasks(threads, job, tasks.length, posted, (_, r) => finish(r as Fp4ConversionStats)))
    return;
  const scratch = new ExpertScratch();
  for (const t of tasks) finish(runExpertTask(job, { ...t, weights: weightsOf(t, false) }, scratch));
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
  const work = planExpertWork(routing, tokens, source, options);
  const config = source.config;
  const { hidden, topK: k } = config;
  const xq = quantizeActivations(x, tokens, hidden, config.scaleFormat);
  const threads = referenceThreads(config, work, "reference", options.threads);
  const f32 = (n: number) => jobArray(Float32Array, n, threads > 1);
  const job: ReferenceJob = {
    mode: "reference",
    config,
    generated: source.generated ?? null,
    x: f32(xq.q.length),
    xScales: f32(xq.scales.length),
    slotOut: f32(tokens * k * hidden),
    sharedOut: f32(work.shared === null ? 0 : tokens * hidden),
  };
  decodeE4m3Array(xq.q, job.x);
  job.xScales.set(xq.scales);
  runExperts(job, work, source, options, threads);

  const { slotOut, sharedOut } = job;
  const out = new Uint16Array(tokens * hidden);
  for (let t = 0; t < tokens; t++) {
    for (let n = 0; n < hidden; n++) {
      let acc = 0;
      for (let s = 0; s < k; s++) {
        if (routing.ids[t * k + s] < 0) continue;
        const y = slotOut[(t * k + s) * hidden + n];
        acc = Math.fround(acc + Math.fround(routing.weights[t * k + s] * y));
      }
      if (work.shared !== null) acc = Math.fround(acc + roundToBf16(sharedOut[t * hidden + n]));
      const bits = f32ToBf16Bits(acc);
      if (isBf16NonFinite(bits)) throw combineOverflow(t, n, acc, routing, job, work.shared !== null);
      out[t * hidden + n] = bits;
    }
  }
  return out;
}

/**
 * The error of a combine whose output (token t, channel n) is not finite, naming the cause: a routing
 * weight whose product with its expert's result overflows fp32, or the sum of finite terms.
 */
function combineOverflow(
  t: number,
  n: number,
  acc: number,
  routing: Routing,
  job: ReferenceJob,
  shared: boolean,
): NumericsError {
  const { hidden, topK: k } = job.config;
  const where = `output[${t}, ${n}] is not finite`;
  const terms: string[] = [];
  for (let s = 0; s < k; s++) {
    const e = routing.ids[t * k + s];
    if (e < 0) continue;
    const w = routing.weights[t * k + s];
    const y = job.slotOut[(t * k + s) * hidden + n];
    if (!Number.isFinite(y)) {
      return new NumericsError(
        `${where}: expert ${e}'s result for x[${t}] there rounds past bf16's largest value (docs/numerics.md, "Overflow")`,
      );
    }
    if (!Number.isFinite(Math.fround(w * y))) {
      return new NumericsError(
        `${where}: the routing weight of token ${t}, slot ${s} (${w}) times expert ${e}'s result there (${y}) overflows fp32 (docs/numerics.md, "Overflow")`,
      );
    }
    terms.push(`${w} · ${y}`);
  }
  if (shared) terms.push(`shared ${roundToBf16(job.sharedOut[t * hidden + n])}`);
  const sum = Number.isFinite(acc) ? `is ${acc}, past bf16's largest value` : "overflows fp32";
  return new NumericsError(
    `${where}: the sum of token ${t}'s terms (${terms.join(", ")}) ${sum} (docs/numerics.md, "Overflow")`,
  );
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
  const work = planExpertWork(routing, tokens, source, options);
  const config = source.config;
  const { hidden, topK: k } = config;
  if (!(x instanceof Uint16Array) || x.length !== tokens * hidden) {
    throw new RangeError(
      `idealMoE: x must be a Uint16Array of tokens × hidden = ${tokens * hidden} bf16 values`,
    );
  }
  const threads = referenceThreads(config, work, "ideal", options.threads);
  const f64 = (n: number) => jobArray(Float64Array, n, threads > 1);
  const job: IdealJob = {
    mode: "ideal",
    config,
    generated: source.generated ?? null,
    x: f64(tokens * hidden),
    slotOut: f64(tokens * k * hidden),
    sharedOut: f64(work.shared === null ? 0 : tokens * hidden),
  };
  for (let i = 0; i < tokens * hidden; i++) {
    job.x[i] = bf16BitsToF32(x[i]);
    // As referenceMoE's quantization does: a NaN or ±inf would run through to a NaN output.
    if (!Number.isFinite(job.x[i])) {
      throw new RangeError(
        `idealMoE: x holds a non-finite value at token ${Math.floor(i / hidden)}, channel ${i % hidden}`,
      );
    }
  }
  runExperts(job, work, source, options, threads);
  // The sum in a fixed order: routed experts by index, each over its pairs in token order, then the shared one.
  const out = new Float64Array(tokens * hidden);
  for (const e of work.active) {
    for (const p of work.lists[e]) {
      const row = Math.floor(p / k) * hidden;
      const weight = routing.weights[p];
      for (let n = 0; n < hidden; n++) out[row + n] += weight * job.slotOut[p * hidden + n];
    }
  }
  if (work.shared !== null) for (let i = 0; i < out.length; i++) out[i] += job.sharedOut[i];
  return out;
}
