/**
 * FP8 (e4m3) block quantization of activations and weights, the rules every backend must reproduce.
 *
 * Activations: one scale per token per 128 channels. Weights: one scale per 128×128 block.
 * For a group with largest magnitude amax (all arithmetic in float32, each step rounded):
 *   scale = fround(max(amax, fround(1e-10)) / 448)
 *   (ue8m0 activations only) scale = ue8m0Ceil(scale)      -- next power of two at or above it
 *   inv   = fround(1 / scale)
 *   q     = e4m3(fround(x * inv))                           -- RNE, saturating to ±448
 * Dequantization is fround(decode(q) * scale). docs/numerics.md states the same rules.
 */

import { describeValue, QUANT_BLOCK, type ScaleFormat } from "../config/config.js";
import { decodeE4m3Array, E4M3_DECODE, e4m3FromBits, FP8_E4M3_MAX } from "./fp8.js";
import { F32_MAX } from "./fp32.js";

/** Floor of amax, so an all-zero group gets a tiny finite scale instead of a division by zero. */
export const MIN_AMAX = Math.fround(1e-10);

const F32_EXP_MASK = 0x7f800000;
const F32_MANTISSA_MASK = 0x007fffff;

const scratchF32 = new Float32Array(1);
const scratchU32 = new Uint32Array(scratchF32.buffer);

/**
 * Rounds a positive finite float32 scale up to a power of two: a nonzero mantissa bumps the exponent field
 * and clears the mantissa (for a normal scale: the smallest power of two ≥ scale). The result is exactly
 * representable as UE8M0 (an 8-bit biased exponent).
 */
export function ue8m0Ceil(scale: number): number {
  scratchF32[0] = scale;
  if (!(scratchF32[0] > 0 && scratchF32[0] <= F32_MAX)) {
    throw new RangeError(`ue8m0Ceil: scale must be a positive finite float32, got ${scale}`);
  }
  const bits = scratchU32[0];
  if ((bits & F32_MANTISSA_MASK) === 0) return scratchF32[0];
  // The literal bit rule: a subnormal becomes 2^-126 (above it, if not the nearest power of two). Scales
  // from quantization are ≥ fround(1e-10)/448 ≈ 2.2e-13, always normal.
  scratchU32[0] = (bits & F32_EXP_MASK) + 0x00800000;
  const up = scratchF32[0];
  if (up === Number.POSITIVE_INFINITY) throw new RangeError(`ue8m0Ceil: ${scale} rounds up past float32`);
  return up;
}

/** The float32 scale of a group whose largest magnitude is amax. */
export function scaleFromAmax(amax: number, format: ScaleFormat): number {
  const scale = Math.fround(Math.max(amax, MIN_AMAX) / FP8_E4M3_MAX);
  return format === "ue8m0" ? ue8m0Ceil(scale) : scale;
}

/** Throws TypeError unless `value` is an instance of `kind`: no other array kind is read or converted. */
export function checkArrayKind(
  what: string,
  value: unknown,
  kind: { name: string; prototype: object },
): void {
  if (!(value instanceof (kind as unknown as new () => object))) {
    throw new TypeError(`${what} must be a ${kind.name}, got ${describeValue(value)}`);
  }
}

/**
 * Throws RangeError unless every scale is positive and finite (quantization makes no other): a zero,
 * negative or NaN scale means corrupt input. Codes are not checked: the e4m3 NaN codes decode to NaN.
 */
function checkScales(what: string, scales: Float32Array): void {
  for (let i = 0; i < scales.length; i++) {
    const s = scales[i]!;
    if (!(s > 0 && s <= F32_MAX))
      throw new RangeError(`${what}: scales[${i}] = ${s} is not a positive finite scale`);
  }
}

function checkFormat(format: ScaleFormat): void {
  if (format !== "fp32" && format !== "ue8m0") {
    throw new RangeError(`scale format must be "fp32" or "ue8m0", got ${describeValue(format)}`);
  }
}

function checkDim(what: string, value: number, min: number): void {
  if (!Number.isInteger(value) || value < min) {
    throw new RangeError(`${what} must be an integer ≥ ${min}, got ${value}`);
  }
}

function checkSpan(what: string, length: number, offset: number, count: number): void {
  checkDim(`${what} offset`, offset, 0);
  if (offset + count > length) {
    throw new RangeError(`${what}: range [${offset}, ${offset + count}) exceeds length ${length}`);
  }
}

// Products x·inv of one 128-value group; storing into a Float32Array is the fround of the product, and
// the Uint32Array view hands the encoder its bit pattern.
const products = new Float32Array(QUANT_BLOCK);
const productBits = new Uint32Array(products.buffer);

/** Encodes the QUANT_BLOCK values in `products` to e4m3 at q[qOffset ..]. */
function encodeProducts(q: Uint8Array, qOffset: number): void {
  for (let j = 0; j < QUANT_BLOCK; j++) q[qOffset + j] = e4m3FromBits(productBits[j], products[j]);
}

/**
 * Quantizes count float32 values (count a multiple of 128) starting at values[offset], one scale per
 * 128 consecutive values: codes go to qOut[qOffset ..], count/128 scales to scalesOut[scaleOffset ..].
 * Throws on a non-finite value, naming its index in `values`.
 */
export function quantizeRow128(
  values: Float32Array,
  offset: number,
  count: number,
  format: ScaleFormat,
  qOut: Uint8Array,
  qOffset: number,
  scalesOut: Float32Array,
  scaleOffset: number,
): void {
  checkFormat(format);
  checkArrayKind("quantizeRow128 values", values, Float32Array);
  checkArrayKind("quantizeRow128 qOut", qOut, Uint8Array);
  checkArrayKind("quantizeRow128 scalesOut", scalesOut, Float32Array);
  checkDim("quantizeRow128 count", count, 0);
  if (count % QUANT_BLOCK !== 0) {
    throw new RangeError(`quantizeRow128: count must be a multiple of ${QUANT_BLOCK}, got ${count}`);
  }
  const groups = count / QUANT_BLOCK;
  checkSpan("quantizeRow128 values", values.length, offset, count);
  checkSpan("quantizeRow128 qOut", qOut.length, qOffset, count);
  checkSpan("quantizeRow128 scalesOut", scalesOut.length, scaleOffset, groups);

  for (let g = 0; g < groups; g++) {
    const base = offset + g * QUANT_BLOCK;
    let amax = 0;
    for (let j = 0; j < QUANT_BLOCK; j++) {
      const a = Math.abs(values[base + j]);
      // One comparison rejects NaN and ±inf (NaN compares false).
      if (!(a <= F32_MAX)) {
        throw new RangeError(`quantizeRow128: non-finite value ${values[base + j]} at index ${base + j}`);
      }
      if (a > amax) amax = a;
    }
    const scale = scaleFromAmax(amax, format);
    const inv = Math.fround(1 / scale);
    for (let j = 0; j < QUANT_BLOCK; j++) products[j] = values[base + j] * inv;
    encodeProducts(qOut, qOffset + g * QUANT_BLOCK);
    scalesOut[scaleOffset + g] = scale;
  }
}

export interface QuantizedActivations {
  /** e4m3 codes, [tokens, hidden] row-major. */
  q: Uint8Array;
  /** float32 scales, [tokens, hidden/128] row-major. */
  scales: Float32Array;
}

function checkActivationShape(what: string, length: number, tokens: number, hidden: number): void {
  checkDim(`${what}: tokens`, tokens, 0);
  checkDim(`${what}: hidden`, hidden, QUANT_BLOCK);
  if (hidden % QUANT_BLOCK !== 0) {
    throw new RangeError(`${what}: hidden must be a multiple of ${QUANT_BLOCK}, got ${hidden}`);
  }
  if (length !== tokens * hidden) {
    throw new RangeError(
      `${what}: length ${length} != tokens·hidden = ${tokens}·${hidden} = ${tokens * hidden}`,
    );
  }
}

/** Quantizes bf16 activations [tokens, hidden] to e4m3 with per-token, per-128-channel scales. */
export function quantizeActivations(
  x: Uint16Array,
  tokens: number,
  hidden: number,
  format: ScaleFormat,
): QuantizedActivations {
  checkFormat(format);
  checkArrayKind("quantizeActivations: x (bf16 bits)", x, Uint16Array);
  checkActivationShape("quantizeActivations", x.length, tokens, hidden);
  const q = new Uint8Array(tokens * hidden);
  const scales = new Float32Array(tokens * (hidden / QUANT_BLOCK));
  // One token row widened to float32 (exact: bf16 is the top half of a float32).
  const rowBits = new Uint32Array(hidden);
  const row = new Float32Array(rowBits.buffer);
  for (let t = 0; t < tokens; t++) {
    const base = t * hidden;
    for (let c = 0; c < hidden; c++) {
      const b = x[base + c];
      if ((b & 0x7f80) === 0x7f80) {
        throw new RangeError(
          `quantizeActivations: non-finite bf16 0x${b.toString(16)} at index ${base + c} (token ${t}, channel ${c})`,
        );
      }
      rowBits[c] = b << 16;
    }
    quantizeRow128(row, 0, hidden, format, q, base, scales, t * (hidden / QUANT_BLOCK));
  }
  return { q, scales };
}

/** float32 activations fround(decode(q) · scale), [tokens, hidden]. */
export function dequantizeActivations(
  q: Uint8Array,
  scales: Float32Array,
  tokens: number,
  hidden: number,
): Float32Array {
  checkArrayKind("dequantizeActivations: q (e4m3 codes)", q, Uint8Array);
  checkArrayKind("dequantizeActivations: scales", scales, Float32Array);
  checkActivationShape("dequantizeActivations", q.length, tokens, hidden);
  const groups = hidden / QUANT_BLOCK;
  if (scales.length !== tokens * groups) {
    throw new RangeError(
      `dequantizeActivations: scales length ${scales.length} != tokens·hidden/128 = ${tokens * groups}`,
    );
  }
  checkScales("dequantizeActivations", scales);
  const out = new Float32Array(tokens * hidden);
  decodeE4m3Array(q, out);
  for (let i = 0; i < out.length; i++) out[i] = out[i] * scales[(i / QUANT_BLOCK) | 0];
  return out;
}

export interface QuantizedWeights {
  /** e4m3 codes, [n, k] row-major. */
  q: Uint8Array;
  /** float32 scales, [n/128, k/128] row-major. */
  scales: Float32Array;
}

function checkWeightShape(what: string, length: number, n: number, k: number): void {
  checkDim(`${what}: n`, n, QUANT_BLOCK);
  checkDim(`${what}: k`, k, QUANT_BLOCK);
  if (n % QUANT_BLOCK !== 0 || k % QUANT_BLOCK !== 0) {
    throw new RangeError(`${what}: n and k must be multiples of ${QUANT_BLOCK}, got n=${n}, k=${k}`);
  }
  if (length !== n * k) {
    throw new RangeError(`${what}: length ${length} != n·k = ${n}·${k} = ${n * k}`);
  }
}

/** Quantizes a float32 [n, k] matrix to e4m3 with one float32 scale per 128×128 block. */
export function quantizeWeightBlocks(w: Float32Array, n: number, k: number): QuantizedWeights {
  checkArrayKind("quantizeWeightBlocks: w", w, Float32Array);
  checkWeightShape("quantizeWeightBlocks", w.length, n, k);
  const blockRows = n / QUANT_BLOCK;
  const blockCols = k / QUANT_BLOCK;
  const q = new Uint8Array(n * k);
  const scales = new Float32Array(blockRows * blockCols);
  for (let br = 0; br < blockRows; br++) {
    for (let bc = 0; bc < blockCols; bc++) {
      const origin = br * QUANT_BLOCK * k + bc * QUANT_BLOCK;
      let amax = 0;
      for (let r = 0; r < QUANT_BLOCK; r++) {
        const rowBase = origin + r * k;
        for (let c = 0; c < QUANT_BLOCK; c++) {
          const a = Math.abs(w[rowBase + c]);
          if (!(a <= F32_MAX)) {
            const i = rowBase + c;
            throw new RangeError(
              `quantizeWeightBlocks: non-finite value ${w[i]} at index ${i} (row ${(i / k) | 0}, column ${i % k})`,
            );
          }
          if (a > amax) amax = a;
        }
      }
      const scale = scaleFromAmax(amax, "fp32");
      const inv = Math.fround(1 / scale);
      for (let r = 0; r < QUANT_BLOCK; r++) {
        const rowBase = origin + r * k;
        for (let c = 0; c < QUANT_BLOCK; c++) products[c] = w[rowBase + c] * inv;
        encodeProducts(q, rowBase);
      }
      scales[br * blockCols + bc] = scale;
    }
  }
  return { q, scales };
}

/** float32 weights fround(decode(q) · scale of its block), [n, k]. */
export function dequantizeWeightBlocks(
  q: Uint8Array,
  scales: Float32Array,
  n: number,
  k: number,
): Float32Array {
  checkArrayKind("dequantizeWeightBlocks: q (e4m3 codes)", q, Uint8Array);
  checkArrayKind("dequantizeWeightBlocks: scales", scales, Float32Array);
  checkWeightShape("dequantizeWeightBlocks", q.length, n, k);
  const blockCols = k / QUANT_BLOCK;
  if (scales.length !== (n / QUANT_BLOCK) * blockCols) {
    throw new RangeError(
      `dequantizeWeightBlocks: scales length ${scales.length} != (n/128)·(k/128) = ${(n / QUANT_BLOCK) * blockCols}`,
    );
  }
  checkScales("dequantizeWeightBlocks", scales);
  const out = new Float32Array(n * k);
  for (let r = 0; r < n; r++) {
    const scaleRow = ((r / QUANT_BLOCK) | 0) * blockCols;
    const base = r * k;
    for (let c = 0; c < k; c++) {
      out[base + c] = E4M3_DECODE[q[base + c]] * scales[scaleRow + ((c / QUANT_BLOCK) | 0)];
    }
  }
  return out;
}
