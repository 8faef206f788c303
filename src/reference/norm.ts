/**
 * CPU reference of the boundary before the MoE: RMSNorm of bf16 rows, optionally preceded by the
 * hyper-connection pre-mix (n residual streams combined with per-token weights).
 *
 * Every step is one IEEE fp32 operation (Math.fround after each), in an order a GPU warp reproduces
 * (the norm kernel, src/kernels/norm/norm.cu, gives the same bits). The rules are in docs/numerics.md,
 * "RMSNorm and the pre-mix":
 *
 *   pre-mix   x[h] = (((0 + w0·s0[h]) + w1·s1[h]) + …)             fp32, streams in increasing j
 *   squares   32 lane partials, lane l owning the 8-channel vectors v ≡ l (mod 32), each partial summed
 *             in increasing channel order; then an xor butterfly over offsets 16, 8, 4, 2, 1
 *   r         1 / sqrt(ss / H + eps)                               div, add, sqrt, div: each rounded
 *   y[h]      bf16((x[h] · r) · weight[h])
 */

import { f32FromBf16Array, f32ToBf16Bits } from "../numerics/bf16.js";

const fround = Math.fround;

/** Partial sums of squares per lane (a GPU warp) and channels per vector (one 16-byte bf16 load). */
export const NORM_LANES = 32;
export const NORM_VECTOR = 8;

export class NormError extends Error {
  override name = "NormError";
}

function requireCount(name: string, value: number, min: number): void {
  if (!Number.isInteger(value) || value < min) {
    throw new NormError(`${name} must be an integer ≥ ${min}, got ${value}`);
  }
}

function requireLength(name: string, array: ArrayLike<number>, expected: number, shape: string): void {
  if (array.length !== expected) {
    throw new NormError(`${name} has ${array.length} elements, expected ${expected} (${shape})`);
  }
}

function checkBf16Finite(name: string, bits: Uint16Array, where: (i: number) => string): void {
  for (let i = 0; i < bits.length; i++) {
    if ((bits[i] & 0x7f80) === 0x7f80) {
      throw new NormError(`${name}[${where(i)}] is not finite (bf16 bits 0x${bits[i].toString(16)})`);
    }
  }
}

/** eps as the fp32 the kernels use; it must be positive and finite. */
export function normEpsilon(eps: number): number {
  const e = fround(eps);
  if (!(Number.isFinite(e) && e > 0))
    throw new NormError(`eps must be positive and finite in fp32, got ${eps}`);
  return e;
}

/**
 * The hyper-connection pre-mix: streams bf16 bits [T, n, H] and weights fp32 [T, n] →
 * x fp32 [T, H], x[t, h] = Σ_j w[t, j] · stream[t, j, h] with a multiply and an add per stream, each
 * rounded to fp32, streams in increasing j, starting from +0 (so a −0 sum comes out +0).
 */
export function premixStreams(
  streams: Uint16Array,
  weights: Float32Array,
  tokens: number,
  n: number,
  hidden: number,
): Float32Array {
  requireCount("tokens", tokens, 0);
  requireCount("streams n", n, 1);
  requireCount("hidden", hidden, 1);
  requireLength("streams", streams, tokens * n * hidden, `[tokens=${tokens}, n=${n}, hidden=${hidden}]`);
  requireLength("mix weights", weights, tokens * n, `[tokens=${tokens}, n=${n}]`);
  checkBf16Finite("streams", streams, (i) => {
    const t = Math.floor(i / (n * hidden));
    const j = Math.floor(i / hidden) % n;
    return `${t}, ${j}, ${i % hidden}`;
  });
  for (let i = 0; i < weights.length; i++) {
    if (!Number.isFinite(weights[i])) {
      throw new NormError(`mix weights[${Math.floor(i / n)}, ${i % n}] is not finite (${weights[i]})`);
    }
  }
  const s = f32FromBf16Array(streams);
  const x = new Float32Array(tokens * hidden);
  for (let t = 0; t < tokens; t++) {
    for (let h = 0; h < hidden; h++) {
      let acc = 0;
      for (let j = 0; j < n; j++) {
        acc = fround(acc + fround(weights[t * n + j] * s[(t * n + j) * hidden + h]));
      }
      x[t * hidden + h] = acc;
    }
  }
  return x;
}

/**
 * The sum of squares of one row in the fixed order (module comment): 32 lane partials over
 * 8-channel vectors, then the xor butterfly. `row` holds fp32 values; H must be a multiple of 8.
 */
export function sumOfSquares(row: Float32Array, offset: number, hidden: number): number {
  const partial = new Float64Array(NORM_LANES);
  const vectors = hidden / NORM_VECTOR;
  for (let lane = 0; lane < NORM_LANES; lane++) {
    let p = 0;
    for (let v = lane; v < vectors; v += NORM_LANES) {
      for (let j = 0; j < NORM_VECTOR; j++) {
        const x = row[offset + v * NORM_VECTOR + j];
        p = fround(p + fround(x * x));
      }
    }
    partial[lane] = p;
  }
  const next = new Float64Array(NORM_LANES);
  for (let off = NORM_LANES / 2; off >= 1; off >>= 1) {
    for (let l = 0; l < NORM_LANES; l++) next[l] = fround(partial[l] + partial[l ^ off]);
    partial.set(next);
  }
  return partial[0];
}

/** r = 1 / sqrt(ss / H + eps): four fp32 operations, each correctly rounded. */
export function rmsScale(sumSq: number, hidden: number, eps: number): number {
  const mean = fround(sumSq / hidden);
  return fround(1 / fround(Math.sqrt(fround(mean + eps))));
}

/**
 * RMSNorm of fp32 rows x [T, H] with a bf16 weight [H]: y = bf16((x · r) · weight), bf16 bits [T, H].
 * H must be a multiple of 8 (the kernels need a multiple of 128 for the FP8 groups).
 */
export function rmsNormF32(
  x: Float32Array,
  weight: Uint16Array,
  tokens: number,
  hidden: number,
  eps: number,
): Uint16Array {
  requireCount("tokens", tokens, 0);
  requireCount("hidden", hidden, NORM_VECTOR);
  if (hidden % NORM_VECTOR !== 0) {
    throw new NormError(`hidden must be a multiple of ${NORM_VECTOR}, got ${hidden}`);
  }
  requireLength("x", x, tokens * hidden, `[tokens=${tokens}, hidden=${hidden}]`);
  requireLength("norm weight", weight, hidden, `[hidden=${hidden}]`);
  checkBf16Finite("norm weight", weight, (i) => `${i}`);
  const e = normEpsilon(eps);
  for (let i = 0; i < x.length; i++) {
    if (!Number.isFinite(x[i])) {
      throw new NormError(`x[${Math.floor(i / hidden)}, ${i % hidden}] is not finite (${x[i]})`);
    }
  }
  const w = f32FromBf16Array(weight);
  const out = new Uint16Array(tokens * hidden);
  for (let t = 0; t < tokens; t++) {
    const row = t * hidden;
    const r = rmsScale(sumOfSquares(x, row, hidden), hidden, e);
    for (let h = 0; h < hidden; h++) out[row + h] = f32ToBf16Bits(fround(fround(x[row + h] * r) * w[h]));
  }
  return out;
}

/** RMSNorm of bf16 rows x [T, H] (bits): the rows widened exactly to fp32, then `rmsNormF32`. */
export function rmsNorm(
  x: Uint16Array,
  weight: Uint16Array,
  tokens: number,
  hidden: number,
  eps: number,
): Uint16Array {
  requireLength("x", x, tokens * hidden, `[tokens=${tokens}, hidden=${hidden}]`);
  checkBf16Finite("x", x, (i) => `${Math.floor(i / hidden)}, ${i % hidden}`);
  return rmsNormF32(f32FromBf16Array(x), weight, tokens, hidden, eps);
}

/** The pre-mix of n streams, then RMSNorm: bf16 bits [T, H]. */
export function premixRmsNorm(
  streams: Uint16Array,
  mixWeights: Float32Array,
  weight: Uint16Array,
  tokens: number,
  n: number,
  hidden: number,
  eps: number,
): Uint16Array {
  return rmsNormF32(premixStreams(streams, mixWeights, tokens, n, hidden), weight, tokens, hidden, eps);
}
