/**
 * The weight layouts every backend reads. See docs/weights.md for the layouts and checkpoint names.
 */
import { describeValue, type ExpertFormat, QUANT_BLOCK, type ValidatedConfig } from "../config/config.js";
import { MXFP4_GROUP } from "../numerics/fp4.js";
import { FP8_E4M3_MAX, firstE4m3Nan } from "../numerics/fp8.js";
import { scaleOverflowProblem } from "../numerics/fp32.js";

/** An FP8 e4m3 matrix [rows, cols] (row-major) with one fp32 scale per 128×128 block. */
export interface BlockQuantized {
  q: Uint8Array;
  /** [rows/128, cols/128] row-major; value = e4m3(q) · scale of its block. */
  scales: Float32Array;
  rows: number;
  cols: number;
}

/** Elements per MXFP4 scale: one UE8M0 byte per 32 consecutive elements along K of a row. */
export { MXFP4_GROUP };

/**
 * An MXFP4 matrix [rows, cols] (row-major, cols along K), DeepSeek-V4's routed-expert format: element
 * (r, c) = e2m1(code) · 2^(scales[r·cols/32 + c/32] − 127). See docs/weights.md and src/numerics/fp4.ts.
 */
export interface Mxfp4Matrix {
  /** e2m1 codes, two per byte: element 2j in the low nibble, 2j+1 in the high one; rows·cols/2 bytes. */
  packed: Uint8Array;
  /** UE8M0 bytes [rows, cols/32] row-major; 0xFF (NaN) is invalid and rejected wherever it is read. */
  scales: Uint8Array;
  rows: number;
  cols: number;
}

/** A zero-filled [rows, cols] MXFP4 matrix for a reader to fill (codes and scale bytes). */
export function emptyMxfp4Matrix(rows: number, cols: number): Mxfp4Matrix {
  return {
    packed: new Uint8Array((rows * cols) / 2),
    scales: new Uint8Array((rows * cols) / MXFP4_GROUP),
    rows,
    cols,
  };
}

/** One FP8 expert MLP (routed, or the fused shared experts). */
export interface ExpertWeights {
  /** Absent or "fp8": the discriminant of RoutedExpertWeights, optional so FP8 literals need not name it. */
  format?: "fp8";
  /** [2I, H]: gate rows 0..I−1, then up rows I..2I−1. */
  w1: BlockQuantized;
  /** [H, I]. */
  w2: BlockQuantized;
}

/** One routed expert MLP in MXFP4 (config.expertFormat "fp4"); same shapes and row order as ExpertWeights. */
export interface Fp4ExpertWeights {
  format: "fp4";
  /** [2I, H]: gate rows 0..I−1, then up rows I..2I−1. */
  w1: Mxfp4Matrix;
  /** [H, I]. */
  w2: Mxfp4Matrix;
}

/** A routed expert in either format; narrow on `format` ("fp4", or anything else for FP8). */
export type RoutedExpertWeights = ExpertWeights | Fp4ExpertWeights;

/** A layer's FP4 routed elements and those whose e4m3 form is not exact (countFp4ToFp8Inexact). */
export interface Fp4Exactness {
  elements: number;
  inexact: number;
}

/** The FP8 expert, or an error naming `where` for an FP4 one (for paths that only take FP8 so far). */
export function requireFp8Expert(w: RoutedExpertWeights, where: string): ExpertWeights {
  if (w.format === "fp4") {
    throw new Error(`${where}: FP4 (MXFP4) experts are not supported here; it takes FP8 experts only`);
  }
  return w;
}

/** The router's weights. */
export interface GateWeights {
  /** bf16 bits [E, H]. */
  weight: Uint16Array;
  /** fp32 [E] correction bias (selection only), or null when the config has none. */
  bias: Float32Array | null;
  /**
   * Hash-routed layers (config.router.hashRouted): int32 [vocab, topK], the experts of each token id
   * (DeepSeek-V4's `gate.tid2eid`); absent or null otherwise.
   */
  tid2eid?: Int32Array | null;
}

/** Where a layer's weights come from: generated on demand, or read from a file. */
export interface MoEWeightSource {
  /** Validated (validateConfig); a layer's constructor validates a raw one once. */
  readonly config: ValidatedConfig;
  /**
   * Routed expert e (0 ≤ e < numExperts), in the config's expertFormat. Sources may make or read it
   * lazily and cache a few.
   */
  expert(e: number): RoutedExpertWeights;
  /** The fused shared-expert MLP (intermediate · numShared), always FP8, or null when numShared is 0. */
  shared(): ExpertWeights | null;
  gate(): GateWeights;
  /**
   * Set when the weights are the counter-based generator's (generate.ts) for `seed`, routed experts
   * numbered from `firstExpert` (0, or a rank's first expert): a GPU then makes them itself, bit for bit.
   */
  readonly generated?: { seed: number; firstExpert: number };
}

/**
 * Why `source` cannot be a weight source (not an object, no config object, expert/shared/gate not
 * functions), or null when its shape is right. Checks the shape only; the config is validated apart.
 */
export function weightSourceProblem(source: unknown): string | null {
  if (typeof source !== "object" || source === null) {
    return `the weight source must be an object with config, expert(), shared() and gate(), got ${describeValue(source)}`;
  }
  const s = source as Record<string, unknown>;
  if (typeof s.config !== "object" || s.config === null) {
    return `the weight source's config must be an object, got ${describeValue(s.config)}`;
  }
  for (const method of ["expert", "shared", "gate"]) {
    if (typeof s[method] !== "function") {
      return `the weight source's ${method} must be a function, got ${describeValue(s[method])}`;
    }
  }
  return null;
}

/** Why `m` is not an object of [rows, cols] with `fields` (named in the message), or null. */
function matrixShapeProblem(
  what: string,
  m: unknown,
  fields: string,
  rows: number,
  cols: number,
): string | null {
  if (typeof m !== "object" || m === null)
    return `${what} must be { ${fields}, rows, cols }, got ${describeValue(m)}`;
  const x = m as { rows?: unknown; cols?: unknown };
  if (x.rows !== rows || x.cols !== cols) {
    return `${what} is [${String(x.rows)}, ${String(x.cols)}], expected [${rows}, ${cols}]`;
  }
  return null;
}

/** Why `a` is not a `Type` of `n` elements (`unit` names them), or null. */
function typedArrayProblem(
  what: string,
  a: unknown,
  Type: Uint8ArrayConstructor | Float32ArrayConstructor,
  n: number,
  unit: string,
): string | null {
  if (a instanceof Type && a.length === n) return null;
  return `${what} must be a ${Type.name} of ${n} ${unit}, got ${describeValue(a)}${a instanceof Type ? ` of ${a.length}` : ""}`;
}

/** Why `m` is not an FP8 block-quantized [rows, cols] matrix (kinds, lengths, scales), or null. */
function blockQuantizedProblem(what: string, m: unknown, rows: number, cols: number): string | null {
  const blocks = (rows / QUANT_BLOCK) * (cols / QUANT_BLOCK);
  const b = m as Partial<BlockQuantized>;
  const problem =
    matrixShapeProblem(what, m, "q, scales", rows, cols) ??
    typedArrayProblem(`${what}.q`, b.q, Uint8Array, rows * cols, "e4m3 codes") ??
    typedArrayProblem(`${what}.scales`, b.scales, Float32Array, blocks, "block scales");
  if (problem !== null) return problem;
  // A NaN, zero or negative scale, one too large for e4m3's 448 in fp32, or an e4m3 NaN code would come
  // out later as a non-finite value in the intermediate or the output, naming no weight: the file
  // loaders refuse the same (moe-file.ts, checkpoint-layer.ts).
  const scales = b.scales as Float32Array;
  const blockCols = cols / QUANT_BLOCK;
  for (let i = 0; i < scales.length; i++) {
    const s = scales[i];
    if (!(s > 0 && s < Number.POSITIVE_INFINITY))
      return `${what}.scales[${i}] = ${s} is not a positive finite scale`;
    const overflow = scaleOverflowProblem(s, FP8_E4M3_MAX, "e4m3");
    if (overflow !== null) {
      return `${what}.scales[${i}] (block [${Math.floor(i / blockCols)}, ${i % blockCols}]) = ${s} is too large: ${overflow}`;
    }
  }
  const q = b.q as Uint8Array;
  const nan = firstE4m3Nan(q);
  return nan < 0
    ? null
    : `${what}.q[${nan}] (row ${Math.floor(nan / cols)}, column ${nan % cols}) is the e4m3 NaN code 0x${q[nan].toString(16)}`;
}

/** Why `m` is not an MXFP4 [rows, cols] matrix (kinds and lengths; 0xFF scales are refused where read), or null. */
function mxfp4Problem(what: string, m: unknown, rows: number, cols: number): string | null {
  const x = m as Partial<Mxfp4Matrix>;
  return (
    matrixShapeProblem(what, m, "packed, scales", rows, cols) ??
    typedArrayProblem(`${what}.packed`, x.packed, Uint8Array, (rows * cols) / 2, "bytes") ??
    typedArrayProblem(`${what}.scales`, x.scales, Uint8Array, (rows * cols) / MXFP4_GROUP, "UE8M0 bytes")
  );
}

/**
 * Why `w`, which a weight source returned as `what` ("expert 3", "the shared expert"), is not an expert of
 * `format` (routed: the config's expertFormat; shared: fp8) with W1 [2·inter, hidden] and W2 [hidden,
 * inter], or null: the CPU reference reads whatever it is given, so a wrong shape or format would
 * otherwise give a wrong output, not an error.
 */
export function expertWeightsProblem(
  w: unknown,
  what: string,
  format: ExpertFormat,
  hidden: number,
  inter: number,
): string | null {
  if (typeof w !== "object" || w === null) {
    return `${what} must be an object with w1 and w2, got ${describeValue(w)}`;
  }
  const e = w as Partial<RoutedExpertWeights>;
  const got: ExpertFormat = e.format === "fp4" ? "fp4" : "fp8";
  if (got !== format) return `${what} is ${got}, expected ${format}`;
  const matrix = format === "fp4" ? mxfp4Problem : blockQuantizedProblem;
  return matrix(`${what} W1`, e.w1, 2 * inter, hidden) ?? matrix(`${what} W2`, e.w2, hidden, inter);
}
