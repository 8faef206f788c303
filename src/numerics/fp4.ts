/**
 * FP4 (MXFP4) codecs: e2m1 codes, UE8M0 scales, nibble packing, MXFP4 quantization of fp32 rows, exact
 * dequantization, and the FP4 → FP8 (e4m3) conversion the Hopper kernels use (docs/numerics.md, "FP4
 * experts").
 *
 * e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; no inf,
 * no NaN. Encoding is bit-exact with cuda_fp4.h's `__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)`
 * (host path; the device instruction is `cvt.rn.satfinite.e2m1x2.f32`): round to nearest, ties to even;
 * |x| > 6 (inf included) saturates to ±6; |x| ≤ 0.25 becomes a signed zero; NaN becomes +6 (code 0x7).
 * UE8M0: an 8-bit biased exponent, value 2^(b − 127); b = 0xFF is NaN.
 * test/numerics/cuda-fp4-exact.test.ts checks the codecs against the CUDA headers.
 */

import { describeValue, QUANT_BLOCK } from "../config/config.js";
import { E4M3_DECODE, e4m3FromBits } from "./fp8.js";
import { checkArrayKind } from "./quant.js";

/** Elements per UE8M0 scale along K (the MX block size). */
export const MXFP4_GROUP = 32;
/** Largest e2m1 magnitude. */
export const E2M1_MAX = 6;
/** The UE8M0 byte that encodes NaN. */
export const E8M0_NAN = 0xff;
/** UE8M0 exponent bias. */
export const E8M0_BIAS = 127;

/**
 * The index of the first UE8M0 byte in `bytes` that is NaN (0xFF) or whose scale 2^(b − 127) times
 * `largest` (a format's largest magnitude: e2m1's 6, e4m3's 448) overflows fp32, or −1: the bytes a
 * weight load refuses (describeE8m0Problem says why).
 */
export function firstBadE8m0(bytes: Uint8Array, largest: number): number {
  let limit = E8M0_NAN;
  while (limit > 0 && !Number.isFinite(Math.fround(largest * 2 ** (limit - 1 - E8M0_BIAS)))) limit--;
  for (let i = 0; i < bytes.length; i++) if (bytes[i] >= limit) return i;
  return -1;
}

/** Why a byte firstBadE8m0 found is refused, after the tensor and position that name it. */
export function describeE8m0Problem(byte: number, largest: number, format: string): string {
  const hex = `0x${byte.toString(16).toUpperCase()}`;
  if (byte === E8M0_NAN) return `is ${hex}, E8M0's NaN: not a scale`;
  return `is ${hex}, the scale 2^${byte - E8M0_BIAS}: times ${largest}, ${format}'s largest magnitude, it overflows fp32`;
}

/** Value of every e2m1 code: 0..7 positive, 8..15 their negatives (code 8 is −0). */
export const E2M1_DECODE: Float32Array = Float32Array.from([
  0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6,
]);

export function decodeE2m1(code: number): number {
  // A string or bigint index would find its entry too: decodeE2m1("1") must not decode code 1.
  const v = typeof code === "number" ? E2M1_DECODE[code] : undefined;
  if (v === undefined) {
    throw new RangeError(`e2m1 code must be an integer in [0, 15], got ${describeValue(code)}`);
  }
  return v;
}

const scratchF32 = new Float32Array(1);
const scratchU32 = new Uint32Array(scratchF32.buffer);
/**
 * e2m1 code of a non-NaN magnitude a, 0 ≤ a: round to nearest, ties to even, over {0, 0.5, 1, 1.5, 2,
 * 3, 4, 6}. The thresholds are the midpoints; at a tie (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) the even
 * code wins, hence ≤ or < by the side the even neighbour lies on.
 */
function e2m1Magnitude(a: number): number {
  if (a < 1.75) return a <= 0.25 ? 0 : a < 0.75 ? 1 : a <= 1.25 ? 2 : 3;
  return a <= 2.5 ? 4 : a < 3.5 ? 5 : a <= 5 ? 6 : 7;
}

/**
 * e2m1 codes by [k, top two mantissa bits, any lower bit set] for a float32 of exponent field 124 + k
 * (k = 0: below 0.25, code 0); the ties lie where the lower bits are zero.
 */
const E2M1_BY_BITS = Uint8Array.from({ length: 48 }, (_, i) => {
  const k = i >> 3;
  if (k === 0) return 0;
  return e2m1Magnitude(2 ** (k - 3) * (1 + ((i >> 1) & 3) / 4 + (i & 1) * 2 ** -21));
});

/** e2m1 code (0..15) of x, as `__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)`. */
export function encodeE2m1(x: number): number {
  scratchF32[0] = x;
  const f = scratchF32[0];
  if (Number.isNaN(f)) return 0x7;
  const sign = scratchU32[0] >>> 31 === 1 ? 0x8 : 0;
  return sign | e2m1Magnitude(Math.abs(f));
}

/**
 * 2^(b − 127) for a UE8M0 byte b, as a double (exact; b = 0 gives 2^−127, below fp32's normal range).
 * Throws on 0xFF (NaN), naming `where`.
 */
export function decodeE8m0(b: number, where = "UE8M0 scale"): number {
  if (!Number.isInteger(b) || b < 0 || b > 0xff) {
    throw new RangeError(`${where}: UE8M0 byte must be an integer in [0, 255], got ${describeValue(b)}`);
  }
  if (b === E8M0_NAN) throw new RangeError(`${where}: UE8M0 byte 0xFF is NaN`);
  return 2 ** (b - E8M0_BIAS);
}

/** How a float is rounded to UE8M0: toward zero (the exponent field) or up to the next power of two. */
export type E8m0Rounding = "zero" | "up";

/**
 * UE8M0 byte of x, as `__nv_cvt_float_to_e8m0(x, __NV_SATFINITE, rounding)` (host path of cuda_fp8.hpp):
 * the sign is ignored; "zero" takes x's float32 exponent field (subnormals and 0 give 0, i.e. 2^−127);
 * "up" first rounds |x| up to bf16, then takes the exponent and adds one when a mantissa bit remains and
 * |x| > 2^−127 (so it is the smallest power of two ≥ |x|, and 0 gives 2^−127). NaN gives 0xFF; overflow
 * and ±inf saturate to 0xFE (2^127).
 */
export function encodeE8m0(x: number, rounding: E8m0Rounding): number {
  // Any other string would round as "up" without a word.
  if (rounding !== "zero" && rounding !== "up") {
    throw new RangeError(`encodeE8m0: rounding must be "zero" or "up", got ${describeValue(rounding)}`);
  }
  scratchF32[0] = x;
  const ux = scratchU32[0];
  const abs = ux & 0x7fffffff;
  let bf: number;
  if (abs > 0x7f800000) bf = 0x7fff;
  else if (rounding === "zero") bf = ux >>> 16;
  else bf = abs < 0x7f800000 && (abs & 0xffff) !== 0 ? (abs >>> 16) + 1 : abs >>> 16;
  let res = (bf >>> 7) & 0xff;
  const mag = bf & 0x7fff;
  if (rounding === "up" && (bf & 0x7f) !== 0 && mag > 0x40 && mag < 0x7f80) res++;
  if (mag <= 0x7f80 && res === 0xff) res = 0xfe;
  return res;
}

/** The UE8M0 byte of an exact power of two in [2^−127, 2^127]; throws otherwise, naming `where`. */
export function e8m0OfPowerOfTwo(scale: number, where = "UE8M0 scale"): number {
  const e = Math.log2(scale);
  if (!(Number.isInteger(e) && e >= -E8M0_BIAS && e <= 127 && 2 ** e === scale)) {
    throw new RangeError(`${where}: ${scale} is not a power of two in [2^-127, 2^127]`);
  }
  return e + E8M0_BIAS;
}

/** Packs e2m1 codes two per byte: element 2j in the low nibble, 2j+1 in the high one (codes.length even). */
export function packE2m1(codes: Uint8Array): Uint8Array {
  if (codes.length % 2 !== 0) throw new RangeError(`packE2m1: length ${codes.length} is odd`);
  const out = new Uint8Array(codes.length / 2);
  for (let j = 0; j < out.length; j++) {
    const lo = codes[2 * j];
    const hi = codes[2 * j + 1];
    if (lo > 15 || hi > 15)
      throw new RangeError(`packE2m1: code at ${lo > 15 ? 2 * j : 2 * j + 1} exceeds 15`);
    out[j] = lo | (hi << 4);
  }
  return out;
}

/** Unpacks bytes into 2·length e2m1 codes (low nibble first). */
export function unpackE2m1(packed: Uint8Array): Uint8Array {
  const out = new Uint8Array(packed.length * 2);
  for (let j = 0; j < packed.length; j++) {
    out[2 * j] = packed[j] & 0xf;
    out[2 * j + 1] = packed[j] >>> 4;
  }
  return out;
}

/** e2m1 code of element i of a packed row-major buffer. */
export function e2m1At(packed: Uint8Array, i: number): number {
  const b = packed[i >>> 1];
  return i & 1 ? b >>> 4 : b & 0xf;
}

/**
 * Packed bytes in the device order the FP4 kernels read (docs/numerics.md "FP4 experts", the device
 * order; common/fp4.cuh fp4_order_word): each row's K block of 128 elements (64 bytes) becomes 16 little-
 * endian words, word (q, s) at byte 16q + 4s holding L_v = element 32s + 4q + v and H_v = element
 * 32s + 16 + 4q + v (v = 0..3): |L_v| at bit 4v, |H_v| at 16 + 4v, sign(L_v) at 8v + 7, sign(H_v) at
 * 8v + 3. `packed` is row-major stored bytes whose rows are whole K blocks (length a multiple of 64).
 */
export function mxfp4DeviceOrder(packed: Uint8Array): Uint8Array {
  return reorderMxfp4Blocks(packed, "mxfp4DeviceOrder", true);
}

/** The inverse of `mxfp4DeviceOrder`: device-order bytes back to the stored order. */
export function mxfp4StoredOrder(device: Uint8Array): Uint8Array {
  return reorderMxfp4Blocks(device, "mxfp4StoredOrder", false);
}

/**
 * Packed bytes of stacked rows of K elements (all experts' [rows, K/2] matrices, or a grouped GEMM's G·N
 * rows) in the stored order → the device layout the FP4 kernels load (docs/numerics.md "the device
 * layout"): K-block-major, [K/128, rows, 64 bytes], so that one K block of consecutive rows (a TMA box)
 * is contiguous in memory, each 64-byte block in the device order (`mxfp4DeviceOrder`) with its 16-byte
 * quarters where the 64-byte swizzle puts them (quarter q of row n at q ^ ((n >> 1) & 3)).
 */
export function mxfp4DeviceLayout(packed: Uint8Array, k: number): Uint8Array {
  const rows = checkMxfp4Layout("mxfp4DeviceLayout", packed, k);
  return transposeMxfp4Blocks(mxfp4DeviceOrder(packed), rows, k / QUANT_BLOCK, true);
}

/** The inverse of `mxfp4DeviceLayout`: device-layout bytes back to stored rows. */
export function mxfp4StoredLayout(device: Uint8Array, k: number): Uint8Array {
  const rows = checkMxfp4Layout("mxfp4StoredLayout", device, k);
  return mxfp4StoredOrder(transposeMxfp4Blocks(device, rows, k / QUANT_BLOCK, false));
}

/** Rows of K elements in `bytes`, after checking that it holds whole ones. */
function checkMxfp4Layout(where: string, bytes: Uint8Array, k: number): number {
  if (!Number.isInteger(k) || k < QUANT_BLOCK || k % QUANT_BLOCK !== 0) {
    throw new RangeError(`${where}: k must be a positive multiple of 128, got ${k}`);
  }
  if (bytes.length % (k / 2) !== 0) {
    throw new RangeError(`${where}: ${bytes.length} bytes are not whole rows of ${k / 2}`);
  }
  return bytes.length / (k / 2);
}

/**
 * 64-byte blocks [rows, kBlocks] ↔ [kBlocks, rows], the 16-byte quarter q of row n's blocks kept at
 * q ^ ((n >> 1) & 3) on the device side (the 64-byte swizzle's place for it, common/fp4.cuh).
 */
function transposeMxfp4Blocks(src: Uint8Array, rows: number, kBlocks: number, toDevice: boolean): Uint8Array {
  const block = QUANT_BLOCK / 2;
  const out = new Uint8Array(src.length);
  for (let n = 0; n < rows; n++) {
    const swizzle = (n >> 1) & 3;
    for (let b = 0; b < kBlocks; b++) {
      const stored = (n * kBlocks + b) * block;
      const device = (b * rows + n) * block;
      for (let q = 0; q < 4; q++) {
        const s = stored + 16 * q;
        const d = device + 16 * (q ^ swizzle);
        if (toDevice) out.set(src.subarray(s, s + 16), d);
        else out.set(src.subarray(d, d + 16), s);
      }
    }
  }
  return out;
}

function reorderMxfp4Blocks(src: Uint8Array, where: string, toDevice: boolean): Uint8Array {
  if (src.length % (QUANT_BLOCK / 2) !== 0) {
    throw new RangeError(`${where}: ${src.length} bytes are not whole 128-element K blocks (64 bytes each)`);
  }
  const out = new Uint8Array(src.length);
  for (let base = 0; base < src.length; base += QUANT_BLOCK / 2) {
    for (let s = 0; s < 4; s++) {
      for (let q = 0; q < 4; q++) {
        const at = base + 16 * q + 4 * s;
        for (let v = 0; v < 4; v++) {
          const l = base * 2 + 32 * s + 4 * q + v; // element indices in the row-major stored buffer
          const h = l + 16;
          if (toDevice) {
            const lc = e2m1At(src, l);
            const hc = e2m1At(src, h);
            // Each element's bits in word (q, s): magnitudes in nibbles v and 4 + v, signs at 8v + 7 / 8v + 3.
            out[at + (v >> 1)] |= (lc & 7) << (4 * (v & 1));
            out[at + 2 + (v >> 1)] |= (hc & 7) << (4 * (v & 1));
            out[at + v] |= ((lc >> 3) << 7) | ((hc >> 3) << 3);
          } else {
            const lc = ((src[at + (v >> 1)] >> (4 * (v & 1))) & 7) | ((src[at + v] >> 7) << 3);
            const hc = ((src[at + 2 + (v >> 1)] >> (4 * (v & 1))) & 7) | (((src[at + v] >> 3) & 1) << 3);
            out[l >> 1] |= lc << (4 * (l & 1));
            out[h >> 1] |= hc << (4 * (h & 1));
          }
        }
      }
    }
  }
  return out;
}

/** An MXFP4 matrix (the same shape as weights/types.ts's Mxfp4Matrix, restated to keep numerics standalone). */
export interface Mxfp4 {
  packed: Uint8Array;
  scales: Uint8Array;
  rows: number;
  cols: number;
}

const F32_INF_BITS = 0x7f800000;
/** Floor of a group's amax: its scale is then at least 2^−126 (DeepSeek's fp4 quantization uses the same). */
export const MXFP4_MIN_AMAX = 6 * 2 ** -126;

/**
 * The UE8M0 scale byte of a 32-group whose largest magnitude is amax: the smallest power of two s with
 * amax / s ≤ 6, i.e. s = ue8m0Ceil(fround(max(amax, 6·2^−126) / 6)). fround(a/6) ≤ 2^k exactly when
 * a ≤ 6·2^k (a float32), so no value of the group saturates. Bytes range over [1, 253].
 */
export function mxfp4ScaleByte(amax: number): number {
  const a = Math.max(amax, MXFP4_MIN_AMAX);
  scratchF32[0] = a / E2M1_MAX;
  const bits = scratchU32[0];
  // A nonzero mantissa bumps the exponent field (the quotient is ≥ 2^−126, always normal).
  return ((bits >>> 23) & 0xff) + ((bits & 0x7fffff) !== 0 ? 1 : 0);
}

function checkMxShape(what: string, rows: number, cols: number): void {
  if (!Number.isInteger(rows) || rows < 1 || !Number.isInteger(cols) || cols < MXFP4_GROUP) {
    throw new RangeError(`${what}: rows and cols must be positive integers (cols ≥ 32), got ${rows}×${cols}`);
  }
  if (cols % MXFP4_GROUP !== 0) throw new RangeError(`${what}: cols ${cols} is not a multiple of 32`);
}

/**
 * MXFP4 quantization of an fp32 matrix [rows, cols] (row-major): per 32-group along a row, the scale
 * byte of mxfp4ScaleByte, then q = e2m1(x · 2^(127 − b)) (the product is exact: a power of two, and
 * |x · 2^(127−b)| ≤ 6). Throws on a non-finite value, naming its row and column.
 */
export function quantizeMxfp4(w: Float32Array, rows: number, cols: number): Mxfp4 {
  checkArrayKind("quantizeMxfp4: w", w, Float32Array); // read through its bits: an array would read as zeros
  checkMxShape("quantizeMxfp4", rows, cols);
  if (w.length < rows * cols) throw new RangeError(`quantizeMxfp4: ${w.length} values < ${rows}·${cols}`);
  const packed = new Uint8Array((rows * cols) / 2);
  const scales = new Uint8Array((rows * cols) / MXFP4_GROUP);
  // The bit patterns give each value's sign (−0 included) and a finiteness test without a float round trip.
  const bits = new Int32Array(w.buffer, w.byteOffset, rows * cols);
  for (let g = 0; g < scales.length; g++) {
    const base = g * MXFP4_GROUP;
    let amaxBits = 0;
    for (let j = 0; j < MXFP4_GROUP; j++) {
      const a = bits[base + j] & 0x7fffffff;
      if (a > amaxBits) amaxBits = a; // non-negative floats order as their bit patterns
    }
    if (amaxBits >= F32_INF_BITS) throwNonFinite(w, base, cols);
    scratchU32[0] = amaxBits;
    const b = mxfp4ScaleByte(scratchF32[0]);
    scales[g] = b;
    // x · 2^(127 − b) only moves a normal x's exponent field: k = (scaled exponent field) − 124, clamped
    // at 0 (everything below 0.25 is code 0), indexes a table with x's top two mantissa bits and whether
    // any lower bit is set. Branch-free, as random codes defeat the branch predictor; subnormal x (the
    // exponent field 0) take encodeE2m1 of the exact product.
    const shift = 3 - b;
    for (let j = 0; j < MXFP4_GROUP / 2; j++) {
      const lo = bits[base + 2 * j];
      const hi = bits[base + 2 * j + 1];
      // Written out twice: as a helper function it stayed a call and cost a third of the time.
      let kl = ((lo >>> 23) & 0xff) + shift;
      kl &= ~(kl >> 31);
      let kh = ((hi >>> 23) & 0xff) + shift;
      kh &= ~(kh >> 31);
      const cl =
        (lo & F32_INF_BITS) === 0
          ? encodeE2m1(w[base + 2 * j] * 2 ** (E8M0_BIAS - b))
          : ((lo >>> 28) & 0x8) |
            E2M1_BY_BITS[(kl << 3) | ((lo >>> 20) & 6) | (((lo & 0x1fffff) + 0x1fffff) >>> 21)];
      const ch =
        (hi & F32_INF_BITS) === 0
          ? encodeE2m1(w[base + 2 * j + 1] * 2 ** (E8M0_BIAS - b))
          : ((hi >>> 28) & 0x8) |
            E2M1_BY_BITS[(kh << 3) | ((hi >>> 20) & 6) | (((hi & 0x1fffff) + 0x1fffff) >>> 21)];
      packed[(base >>> 1) + j] = cl | (ch << 4);
    }
  }
  return { packed, scales, rows, cols };
}

/** Names the first non-finite value of the group at `base`. */
function throwNonFinite(w: Float32Array, base: number, cols: number): never {
  let i = base;
  while (Number.isFinite(w[i])) i++;
  throw new RangeError(
    `quantizeMxfp4: non-finite value ${w[i]} at row ${Math.floor(i / cols)}, column ${i % cols}`,
  );
}

function checkMxfp4(what: string, m: Mxfp4): void {
  checkMxShape(what, m.rows, m.cols);
  const n = m.rows * m.cols;
  if (m.packed.length !== n / 2 || m.scales.length !== n / MXFP4_GROUP) {
    throw new RangeError(
      `${what}: packed ${m.packed.length} and scales ${m.scales.length} bytes do not fit [${m.rows}, ${m.cols}] (want ${n / 2} and ${n / MXFP4_GROUP})`,
    );
  }
}

/** Throws naming the row and group of the first 0xFF (NaN) scale byte, if any. */
export function checkMxfp4Scales(what: string, m: Mxfp4): void {
  const i = m.scales.indexOf(E8M0_NAN);
  if (i >= 0) {
    const perRow = m.cols / MXFP4_GROUP;
    throw new RangeError(
      `${what}: UE8M0 scale byte 0xFF (NaN) at row ${Math.floor(i / perRow)}, K group ${i % perRow} (columns ${(i % perRow) * MXFP4_GROUP}..${(i % perRow) * MXFP4_GROUP + 31})`,
    );
  }
}

/**
 * The exact values e2m1 · 2^(b − 127), in double (fp32 cannot hold 6 · 2^127). Rejects NaN scales.
 * Written into `out` when given (it must hold rows·cols; a view of that length is returned).
 */
export function dequantizeMxfp4(m: Mxfp4, what = "dequantizeMxfp4", out?: Float64Array): Float64Array {
  checkMxfp4(what, m);
  checkMxfp4Scales(what, m);
  const n = m.rows * m.cols;
  if (out !== undefined) {
    checkArrayKind(`${what}: out`, out, Float64Array);
    if (out.length < n) throw new RangeError(`${what}: out holds ${out.length} < ${n} values`);
  }
  const result = out === undefined ? new Float64Array(n) : out.subarray(0, n);
  dequantizeMxfp4Into(m, result);
  return result;
}

function dequantizeMxfp4Into(m: Mxfp4, out: Float64Array): void {
  for (let g = 0; g < m.scales.length; g++) {
    const s = 2 ** (m.scales[g] - E8M0_BIAS);
    const base = g * MXFP4_GROUP;
    for (let j = 0; j < MXFP4_GROUP; j++) out[base + j] = E2M1_DECODE[e2m1At(m.packed, base + j)] * s;
  }
}

/** Groups per 128-deep K block. */
const GROUPS_PER_BLOCK = QUANT_BLOCK / MXFP4_GROUP;
/** The largest d with 6 · 2^d ≤ 448 (e4m3's max): the largest group of a block is placed at this offset. */
export const FP4_TO_FP8_TOP = 6;
/** Groups whose offset d = b − ref lies in [−8, 6] convert exactly (0.5 · 2^−8 is e4m3's smallest subnormal). */
export const FP4_TO_FP8_EXACT_SPREAD = 14;

/** The fp32 weight scale 2^(R − 127 − 6) of the codes converted under reference byte R (exact for R ≤ 254). */
export function fp4ReferenceScale(referenceByte: number): number {
  return 2 ** (referenceByte - E8M0_BIAS - FP4_TO_FP8_TOP);
}

/**
 * The reference exponent (unbiased) of one row's 128-deep K block from its four UE8M0 bytes:
 * max(b) − 127 − 6. The block's fp32 scale 2^ref is exact (ref ∈ [−133, 121]).
 */
export function fp4BlockRefExponent(scales: Uint8Array, at: number): number {
  let max = 0;
  for (let g = 0; g < GROUPS_PER_BLOCK; g++) if (scales[at + g] > max) max = scales[at + g];
  return max - E8M0_BIAS - FP4_TO_FP8_TOP;
}

/** Per-row-per-K-block FP8 form of an MXFP4 matrix: what the Hopper kernels feed wgmma. */
export interface Fp4AsFp8 {
  /** e4m3 codes [rows, cols]. */
  q: Uint8Array;
  /** fp32 2^ref per row per 128-deep K block, [rows, cols/128]. */
  scales: Float32Array;
  /** Elements whose e4m3 code times 2^ref differs from the MXFP4 value (0 when every block's spread ≤ 14). */
  inexact: number;
}

// One float32 scratch word: the fp8 encoder takes a value with its bit pattern.
const convScratch = new Float32Array(1);
const convBits = new Uint32Array(convScratch.buffer);

/**
 * The e4m3 code of e2m1 `code` × 2^d (d ≤ 6): round to nearest even of the exact value, as
 * `__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)`; below half of 2^−9 it is a signed zero.
 * v is a float32 whenever d ≥ −140; below that it is under 2^−137 and rounds to zero either way.
 */
export function e2m1ToE4m3(code: number, d: number): number {
  convScratch[0] = E2M1_DECODE[code] * 2 ** Math.max(d, -160);
  return e4m3FromBits(convBits[0], convScratch[0]);
}

/** Per group offset d: the e4m3 codes of e2m1 codes 0..15 × 2^d, then 16 flags (1: not exact). */
const fp4ToFp8Tables: (Uint8Array | undefined)[] = [];

/** The conversion of one group with offset d as a 32-byte table (e2m1ToE4m3's codes, built once per d). */
function fp4ToFp8Table(d: number): Uint8Array {
  let t = fp4ToFp8Tables[FP4_TO_FP8_TOP - d];
  if (t === undefined) {
    t = new Uint8Array(32);
    const p = 2 ** Math.max(d, -160);
    for (let code = 0; code < 16; code++) {
      t[code] = e2m1ToE4m3(code, d);
      t[16 + code] = E4M3_DECODE[t[code]] === E2M1_DECODE[code] * p ? 0 : 1;
    }
    fp4ToFp8Tables[FP4_TO_FP8_TOP - d] = t;
  }
  return t;
}

/**
 * Converts one 32-group: its 16 packed bytes from packed[p] go to 32 e4m3 codes at q[at], through the
 * group's table; returns how many of them are not exact.
 */
function convertGroup(packed: Uint8Array, p: number, t: Uint8Array, q: Uint8Array, at: number): number {
  let inexact = 0;
  for (let j = 0; j < MXFP4_GROUP / 2; j++) {
    const byte = packed[p + j];
    const lo = byte & 0xf;
    const hi = byte >>> 4;
    q[at + 2 * j] = t[lo];
    q[at + 2 * j + 1] = t[hi];
    inexact += t[16 + lo] + t[16 + hi];
  }
  return inexact;
}

/**
 * The reference bytes of the 128 × 128 blocks of block rows [b0, b1) (rows 128·b0 … of the matrix, the
 * last block shorter), [b1 − b0, cols/128]: each block's largest UE8M0 byte, the reference every row of
 * the block takes (DeepSeek's cast; docs/numerics.md).
 */
export function fp4BlockReferences(m: Mxfp4, b0 = 0, b1 = Math.ceil(m.rows / QUANT_BLOCK)): Uint8Array {
  return blockReferencesOf(m.scales, m.rows, m.cols, b0, b1).refs;
}

/**
 * Each 128 × 128 block's fp32 weight scale 2^(R − 133) (R its reference byte, fp4BlockReferences),
 * [⌈rows/128⌉, cols/128]: the FP8 weights' block-scale layout, which the kernels' promotions read.
 */
export function fp4BlockScales(m: Mxfp4): Float32Array {
  return Float32Array.from(fp4BlockReferences(m), fp4ReferenceScale);
}

/**
 * fp4BlockReferences on the scale bytes alone ([rows, cols/32]), with each block's span (largest −
 * smallest byte: at most 14 converts exactly).
 */
function blockReferencesOf(
  scales: Uint8Array,
  rows: number,
  cols: number,
  b0: number,
  b1: number,
): { refs: Uint8Array; spans: Uint8Array } {
  const kBlocks = cols / QUANT_BLOCK;
  const groupsPerRow = cols / MXFP4_GROUP;
  const refs = new Uint8Array((b1 - b0) * kBlocks);
  const spans = new Uint8Array((b1 - b0) * kBlocks);
  for (let b = b0; b < b1; b++) {
    const rowEnd = Math.min((b + 1) * QUANT_BLOCK, rows);
    for (let kb = 0; kb < kBlocks; kb++) {
      let lo = 255;
      let hi = 0;
      for (let r = b * QUANT_BLOCK; r < rowEnd; r++) {
        for (let g = 0; g < GROUPS_PER_BLOCK; g++) {
          const v = scales[r * groupsPerRow + kb * GROUPS_PER_BLOCK + g];
          if (v < lo) lo = v;
          if (v > hi) hi = v;
        }
      }
      refs[(b - b0) * kBlocks + kb] = hi;
      spans[(b - b0) * kBlocks + kb] = hi - lo;
    }
  }
  return { refs, spans };
}

/** Bit 30 of a reference word: a group lies more than 11 binades under R (the kernels' exact tables). */
export const FP4_EXACT_FLAG = 0x40000000;
/** The offsets the kernels' fast tables hold. */
const FP4_FAST_OFFSETS = 11;
/** The largest group offset a reference word stores; every offset from 19 on converts to zeros. */
const FP4_OFFSET_CLAMP = 31;

/**
 * The reference words of MXFP4 scale bytes [rows, cols/32] (docs/numerics.md, "the device layout"):
 * Uint32Array [rows, cols/128], row r's K block kb as the kernels read it (fp4.cuh fp4_reference_word):
 * bits 0..7 the reference byte R the rule gives it (fp4ReferenceBytes), bits 8 + 5g .. 12 + 5g the
 * offset min(R − b_g, 31) of group g, bit 30 (FP4_EXACT_FLAG) set where an offset passes 11.
 * Throws on a 0xFF (NaN) byte, naming its row and K group.
 */
export function mxfp4ReferenceWords(scales: Uint8Array, rows: number, cols: number): Uint32Array {
  checkMxShape("mxfp4ReferenceWords", rows, cols);
  if (cols % QUANT_BLOCK !== 0)
    throw new RangeError(`mxfp4ReferenceWords: cols ${cols} is not a multiple of 128`);
  const groupsPerRow = cols / MXFP4_GROUP;
  if (scales.length !== rows * groupsPerRow) {
    throw new RangeError(
      `mxfp4ReferenceWords: ${scales.length} scale bytes do not fit [${rows}, ${groupsPerRow}]`,
    );
  }
  const nan = scales.indexOf(E8M0_NAN);
  if (nan >= 0) {
    throw new RangeError(
      `mxfp4ReferenceWords: UE8M0 scale byte 0xFF (NaN) at row ${Math.floor(nan / groupsPerRow)}, K group ${nan % groupsPerRow}`,
    );
  }
  const kBlocks = cols / QUANT_BLOCK;
  const { refs } = blockReferencesOf(scales, rows, cols, 0, Math.ceil(rows / QUANT_BLOCK));
  const out = new Uint32Array(rows * kBlocks);
  for (let r = 0; r < rows; r++) {
    for (let kb = 0; kb < kBlocks; kb++) {
      const at = r * groupsPerRow + kb * GROUPS_PER_BLOCK;
      const ref = refs[Math.floor(r / QUANT_BLOCK) * kBlocks + kb];
      let w = ref;
      for (let g = 0; g < GROUPS_PER_BLOCK; g++) {
        const o = ref - scales[at + g];
        w |= Math.min(o, FP4_OFFSET_CLAMP) << (8 + 5 * g);
        if (o > FP4_FAST_OFFSETS) w |= FP4_EXACT_FLAG;
      }
      out[r * kBlocks + kb] = w >>> 0;
    }
  }
  return out;
}

/**
 * The reference byte (the UE8M0 byte the codes are relative to) of each row's 128-deep K blocks, rows
 * [r0, r1), [r1 − r0, cols/128], by docs/numerics.md's rule: its 128 × 128 block's largest byte
 * (fp4BlockReferences).
 */
export function fp4ReferenceBytes(m: Mxfp4, r0 = 0, r1 = m.rows): Uint8Array {
  const kBlocks = m.cols / QUANT_BLOCK;
  const b0 = Math.floor(r0 / QUANT_BLOCK);
  const blocks = fp4BlockReferences(m, b0, Math.ceil(r1 / QUANT_BLOCK));
  const out = new Uint8Array((r1 - r0) * kBlocks);
  for (let r = r0; r < r1; r++) {
    const block = (Math.floor(r / QUANT_BLOCK) - b0) * kBlocks;
    out.set(blocks.subarray(block, block + kBlocks), (r - r0) * kBlocks);
  }
  return out;
}

/**
 * Converts rows [r0, r1) of an MXFP4 matrix to e4m3 codes relative to the reference each row takes in
 * each 128-deep K block (fp4ReferenceBytes; docs/numerics.md): for a group with byte b under reference
 * byte M, ref = M − 127 − 6 and each element is e4m3(e2m1 · 2^(b − 127 − ref)), rounded to nearest even
 * (exact when b ≥ M − 14). `references` ([r1 − r0, cols/128], each at least its row's largest byte there)
 * replaces the rule's, as a kernel handed other references would convert (the header tests).
 */
export function mxfp4RowsToFp8(
  m: Mxfp4,
  r0 = 0,
  r1 = m.rows,
  what = "mxfp4RowsToFp8",
  references?: Uint8Array,
): Fp4AsFp8 {
  checkMxfp4(what, m);
  if (m.cols % QUANT_BLOCK !== 0) throw new RangeError(`${what}: cols ${m.cols} is not a multiple of 128`);
  if (!(Number.isInteger(r0) && Number.isInteger(r1) && 0 <= r0 && r0 <= r1 && r1 <= m.rows)) {
    throw new RangeError(`${what}: row range [${r0}, ${r1}) outside [0, ${m.rows})`);
  }
  const cols = m.cols;
  const kBlocks = cols / QUANT_BLOCK;
  const groupsPerRow = cols / MXFP4_GROUP;
  const n = (r1 - r0) * cols;
  const q = new Uint8Array(n);
  const scales = new Float32Array((r1 - r0) * kBlocks);
  // The rows' whole 128-row blocks, whose bytes choose the references.
  const blockEnd = Math.min(Math.ceil(r1 / QUANT_BLOCK) * QUANT_BLOCK, m.rows);
  for (let r = r0 - (r0 % QUANT_BLOCK); r < blockEnd; r++) {
    for (let g = 0; g < groupsPerRow; g++) {
      if (m.scales[r * groupsPerRow + g] === E8M0_NAN) {
        throw new RangeError(`${what}: UE8M0 scale byte 0xFF (NaN) at row ${r}, K group ${g}`);
      }
    }
  }
  if (references !== undefined) {
    if (references.length !== (r1 - r0) * kBlocks) {
      throw new RangeError(
        `${what}: ${references.length} references for ${r1 - r0} rows of ${kBlocks} K blocks`,
      );
    }
    for (let i = 0; i < references.length; i++) {
      const at = (r0 + Math.floor(i / kBlocks)) * groupsPerRow + (i % kBlocks) * GROUPS_PER_BLOCK;
      if (
        references[i] > 254 ||
        references[i] < fp4BlockRefExponent(m.scales, at) + E8M0_BIAS + FP4_TO_FP8_TOP
      ) {
        throw new RangeError(`${what}: reference byte ${references[i]} below its row's largest, or 0xFF`);
      }
    }
  }
  const refs = references ?? fp4ReferenceBytes(m, r0, r1);
  let inexact = 0;
  for (let r = r0; r < r1; r++) {
    for (let kb = 0; kb < kBlocks; kb++) {
      const sAt = r * groupsPerRow + kb * GROUPS_PER_BLOCK;
      const refByte = refs[(r - r0) * kBlocks + kb];
      const ref = refByte - E8M0_BIAS - FP4_TO_FP8_TOP;
      scales[(r - r0) * kBlocks + kb] = fp4ReferenceScale(refByte);
      for (let g = 0; g < GROUPS_PER_BLOCK; g++) {
        const t = fp4ToFp8Table(m.scales[sAt + g] - E8M0_BIAS - ref);
        const at = r * cols + kb * QUANT_BLOCK + g * MXFP4_GROUP;
        inexact += convertGroup(m.packed, at >>> 1, t, q, at - r0 * cols);
      }
    }
  }
  return { q, scales, inexact };
}

/**
 * Whether every 128 × 128 block of MXFP4 scale bytes [rows, cols/32] (rows 128i …, the last block
 * shorter, per K block) spans at most 14 binades, so that the whole matrix converts to e4m3 exactly.
 */
export function fp4BlocksExact(scales: Uint8Array, rows: number, cols: number): boolean {
  checkMxShape("fp4BlocksExact", rows, cols);
  if (cols % QUANT_BLOCK !== 0) throw new RangeError(`fp4BlocksExact: cols ${cols} is not a multiple of 128`);
  if (scales.length !== (rows * cols) / MXFP4_GROUP) {
    throw new RangeError(
      `fp4BlocksExact: ${scales.length} scale bytes do not fit [${rows}, ${cols / MXFP4_GROUP}]`,
    );
  }
  const { spans } = blockReferencesOf(scales, rows, cols, 0, Math.ceil(rows / QUANT_BLOCK));
  return spans.every((span) => span <= FP4_TO_FP8_EXACT_SPREAD);
}

/**
 * Inexact elements of the whole matrix's conversion (for the per-layer "n of N elements not exact"):
 * mxfp4RowsToFp8's count without its codes. A 128 × 128 block whose scale bytes span ≤ 14 converts
 * exactly, so only the groups more than 14 below their block's largest byte are looked at element by
 * element; a layer's count costs about one pass over its scale bytes.
 */
export function countFp4ToFp8Inexact(m: Mxfp4, what = "countFp4ToFp8Inexact"): number {
  checkMxfp4(what, m);
  checkMxfp4Scales(what, m);
  if (m.cols % QUANT_BLOCK !== 0) throw new RangeError(`${what}: cols ${m.cols} is not a multiple of 128`);
  const kBlocks = m.cols / QUANT_BLOCK;
  const groupsPerRow = m.cols / MXFP4_GROUP;
  const { refs, spans } = blockReferencesOf(m.scales, m.rows, m.cols, 0, Math.ceil(m.rows / QUANT_BLOCK));
  let inexact = 0;
  for (let i = 0; i < refs.length; i++) {
    if (spans[i] <= FP4_TO_FP8_EXACT_SPREAD) continue;
    const b = Math.floor(i / kBlocks);
    const kb = i % kBlocks;
    const rowEnd = Math.min((b + 1) * QUANT_BLOCK, m.rows);
    for (let r = b * QUANT_BLOCK; r < rowEnd; r++) {
      for (let g = 0; g < GROUPS_PER_BLOCK; g++) {
        const at = r * groupsPerRow + kb * GROUPS_PER_BLOCK + g;
        const d = m.scales[at] - refs[i] + FP4_TO_FP8_TOP;
        if (d >= FP4_TO_FP8_TOP - FP4_TO_FP8_EXACT_SPREAD) continue;
        const t = fp4ToFp8Table(d);
        const first = (at * MXFP4_GROUP) >>> 1;
        for (let j = 0; j < MXFP4_GROUP / 2; j++) {
          const byte = m.packed[first + j];
          inexact += t[16 + (byte & 0xf)] + t[16 + (byte >>> 4)];
        }
      }
    }
  }
  return inexact;
}

/** An MXFP4 matrix cast to FP8 with one scale per 128×128 block (the FP8 experts' layout). */
export interface Fp4AsFp8Blocks {
  /** e4m3 codes [rows, cols]. */
  q: Uint8Array;
  /** fp32 2^ref per 128×128 block, [rows/128, cols/128]. */
  scales: Float32Array;
  /** Elements whose e4m3 code times 2^ref differs from the MXFP4 value. */
  inexact: number;
}

/**
 * DeepSeek's offline cast (V4 `inference/convert.py`, `cast_e2m1fn_to_e4m3fn`), which is the rule
 * itself: mxfp4RowsToFp8's codes with its scales as one per 128×128 block, so the result runs on the FP8
 * kernels as they are and gives the same bits as the FP4 experts (docs/numerics.md).
 */
export function mxfp4ToFp8Blocks(m: Mxfp4, what = "mxfp4ToFp8Blocks"): Fp4AsFp8Blocks {
  checkMxfp4(what, m);
  checkMxfp4Scales(what, m);
  const { rows, cols } = m;
  if (rows % QUANT_BLOCK !== 0 || cols % QUANT_BLOCK !== 0) {
    throw new RangeError(`${what}: [${rows}, ${cols}] is not a multiple of 128 in both dimensions`);
  }
  const x = mxfp4RowsToFp8(m, 0, rows, what);
  // Every row of a 128-row block takes its block's reference: the block's scales are its first row's.
  const kBlocks = cols / QUANT_BLOCK;
  const scales = new Float32Array((rows / QUANT_BLOCK) * kBlocks);
  for (let b = 0; b < rows / QUANT_BLOCK; b++) {
    scales.set(
      x.scales.subarray(b * QUANT_BLOCK * kBlocks, b * QUANT_BLOCK * kBlocks + kBlocks),
      b * kBlocks,
    );
  }
  return { q: x.q, scales, inexact: x.inexact };
}
