/**
 * FP8 codecs: e4m3fn (OCP "fn": no infinities, NaN = S.1111.111) and e5m2 (IEEE-like, with ±inf and NaN).
 *
 * Encoding is bit-exact with CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt)` (host path of
 * cuda_fp8.hpp, which the sm_89+ instruction `cvt.rn.satfinite` matches): round to nearest, ties to even;
 * any finite or infinite magnitude above the largest finite value becomes ±max; every NaN becomes the
 * positive code 0x7F, whatever its sign. test/numerics/cuda-fp8-exact.test.ts checks this against nvcc.
 *
 * The encoders work on the float32 bit pattern of the input, read through one shared scratch word, so a
 * call allocates nothing. A JS number that is not float32-representable is first rounded to float32
 * (ties to even); the contract is that callers pass float32 values.
 */
import { describeValue } from "../config/config.js";

export const FP8_E4M3_MAX = 448;
export const FP8_E5M2_MAX = 57344;

/** Code every NaN encodes to, in both formats (sign dropped, as CUDA's host path canonicalizes NaN). */
export const FP8_NAN_CODE = 0x7f;

const scratchF32 = new Float32Array(1);
const scratchU32 = new Uint32Array(scratchF32.buffer);

// Float32 bit patterns of the thresholds that pick each encoding path.
const F32_INF_BITS = 0x7f800000;
const E4M3_MAX_BITS = 0x43e00000; // 448: at or above it (after rounding) the result is ±448
const E4M3_MIN_NORMAL_BITS = 0x3c800000; // 2^-6
const E4M3_REBIAS = (127 - 7) << 23; // moves the float32 exponent field to the e4m3 bias
const E5M2_MAX_BITS = 0x47600000; // 57344
const E5M2_MIN_NORMAL_BITS = 0x38800000; // 2^-14
const E5M2_REBIAS = (127 - 15) << 23;

// Adding then subtracting 2^52 rounds a double in [0, 2^51) to an integer, ties to even.
const RNE_MAGIC = 4503599627370496;

function buildE4m3Table(): Float32Array {
  const t = new Float32Array(256);
  for (let code = 0; code < 256; code++) {
    const sign = code & 0x80 ? -1 : 1;
    const exp = (code >> 3) & 0xf;
    const man = code & 0x7;
    if (exp === 0xf && man === 0x7) t[code] = Number.NaN;
    else if (exp === 0) t[code] = sign * man * 2 ** -9;
    else t[code] = sign * (1 + man / 8) * 2 ** (exp - 7);
  }
  return t;
}

function buildE5m2Table(): Float32Array {
  const t = new Float32Array(256);
  for (let code = 0; code < 256; code++) {
    const sign = code & 0x80 ? -1 : 1;
    const exp = (code >> 2) & 0x1f;
    const man = code & 0x3;
    if (exp === 0x1f) t[code] = man === 0 ? sign * Number.POSITIVE_INFINITY : Number.NaN;
    else if (exp === 0) t[code] = sign * man * 2 ** -16;
    else t[code] = sign * (1 + man / 4) * 2 ** (exp - 15);
  }
  return t;
}

/** Value of every e4m3fn code (0x7F and 0xFF are NaN). */
export const E4M3_DECODE: Float32Array = buildE4m3Table();
/** Value of every e5m2 code (0x7C/0xFC are ±inf, 0x7D-0x7F and 0xFD-0xFF are NaN). */
export const E5M2_DECODE: Float32Array = buildE5m2Table();

function checkedLookup(table: Float32Array, code: number, format: string): number {
  // A string or bigint index would find its entry too: decodeE4m3("1") must not decode code 1.
  const v = typeof code === "number" ? table[code] : undefined;
  if (v === undefined) {
    throw new RangeError(`${format} code must be an integer in [0, 255], got ${describeValue(code)}`);
  }
  return v;
}

/** The index of the first e4m3 NaN code (0x7F or 0xFF, the format's only non-numbers) in `codes`, or −1. */
export function firstE4m3Nan(codes: Uint8Array): number {
  for (let i = 0; i < codes.length; i++) if ((codes[i] & 0x7f) === 0x7f) return i;
  return -1;
}

export function decodeE4m3(code: number): number {
  return checkedLookup(E4M3_DECODE, code, "e4m3");
}

export function decodeE5m2(code: number): number {
  return checkedLookup(E5M2_DECODE, code, "e5m2");
}

/**
 * e4m3 code of a float32 given both as its bit pattern and as its value (the value serves the subnormal
 * path only). The allocation-free primitive behind the other encoders, for hot loops over a Float32Array
 * and its Uint32Array view.
 */
export function e4m3FromBits(bits: number, value: number): number {
  const sign = (bits >>> 24) & 0x80;
  const abs = bits & 0x7fffffff;
  if (abs >= E4M3_MAX_BITS) {
    // Everything from 448 up rounds or saturates to 448 (464 is a tie and 0x7E is even); inf too.
    return abs > F32_INF_BITS ? FP8_NAN_CODE : sign | 0x7e;
  }
  if (abs >= E4M3_MIN_NORMAL_BITS) {
    // Rebias the exponent, then drop 20 mantissa bits with round-to-nearest-even; a carry out of the
    // mantissa correctly bumps the exponent.
    return sign | ((abs - E4M3_REBIAS + 0x7ffff + ((abs >>> 20) & 1)) >>> 20);
  }
  // Subnormal (or underflow to zero): the code is |x| / 2^-9 rounded to an integer, ties to even.
  return sign | (Math.abs(value) * 512 + RNE_MAGIC - RNE_MAGIC);
}

/** e5m2 code of a float32 given as its bit pattern and its value; see e4m3FromBits. */
export function e5m2FromBits(bits: number, value: number): number {
  const sign = (bits >>> 24) & 0x80;
  const abs = bits & 0x7fffffff;
  if (abs >= E5M2_MAX_BITS) {
    // SATFINITE: everything above 57344 (inf included) becomes 57344, never inf.
    return abs > F32_INF_BITS ? FP8_NAN_CODE : sign | 0x7b;
  }
  if (abs >= E5M2_MIN_NORMAL_BITS) {
    return sign | ((abs - E5M2_REBIAS + 0xfffff + ((abs >>> 21) & 1)) >>> 21);
  }
  return sign | (Math.abs(value) * 65536 + RNE_MAGIC - RNE_MAGIC);
}

/** e4m3fn code (0..255) of x, as `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`. */
export function encodeE4m3(x: number): number {
  scratchF32[0] = x;
  return e4m3FromBits(scratchU32[0], scratchF32[0]);
}

/** e5m2 code (0..255) of x, as `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)`. */
export function encodeE5m2(x: number): number {
  scratchF32[0] = x;
  return e5m2FromBits(scratchU32[0], scratchF32[0]);
}

type ArrayKind = { name: string; prototype: object };

/** TypeError unless src and dst are the array kinds named: another kind's bytes would be misread. */
function checkKinds(what: string, src: unknown, srcKind: ArrayKind, dst: unknown, dstKind: ArrayKind): void {
  for (const [role, v, kind] of [
    ["source", src, srcKind],
    ["destination", dst, dstKind],
  ] as const) {
    if (!(v instanceof (kind as unknown as new () => object))) {
      throw new TypeError(`${what}: the ${role} must be a ${kind.name}, got ${describeValue(v)}`);
    }
  }
}

function checkRange(what: string, length: number, offset: number, count: number): void {
  if (!Number.isInteger(offset) || !Number.isInteger(count) || offset < 0 || count < 0) {
    throw new RangeError(`${what}: offset ${offset} and count ${count} must be non-negative integers`);
  }
  if (offset + count > length) {
    throw new RangeError(`${what}: range [${offset}, ${offset + count}) exceeds length ${length}`);
  }
}

function bitsView(src: Float32Array): Uint32Array {
  return new Uint32Array(src.buffer, src.byteOffset, src.length);
}

/** Encodes src[srcOffset .. srcOffset+count) to e4m3 codes at dst[dstOffset ..]. */
export function encodeE4m3Range(
  src: Float32Array,
  srcOffset: number,
  dst: Uint8Array,
  dstOffset: number,
  count: number,
): void {
  checkKinds("encodeE4m3Range", src, Float32Array, dst, Uint8Array);
  checkRange("encodeE4m3Range source", src.length, srcOffset, count);
  checkRange("encodeE4m3Range destination", dst.length, dstOffset, count);
  const bits = bitsView(src);
  for (let i = 0; i < count; i++) {
    dst[dstOffset + i] = e4m3FromBits(bits[srcOffset + i], src[srcOffset + i]);
  }
}

/** Encodes every element of src to e4m3; dst must have the same length. */
export function encodeE4m3Array(src: Float32Array, dst: Uint8Array): void {
  if (src.length !== dst.length) {
    throw new RangeError(`encodeE4m3Array: source length ${src.length} != destination length ${dst.length}`);
  }
  encodeE4m3Range(src, 0, dst, 0, src.length);
}

/** Encodes every element of src to e5m2; dst must have the same length. */
export function encodeE5m2Array(src: Float32Array, dst: Uint8Array): void {
  checkKinds("encodeE5m2Array", src, Float32Array, dst, Uint8Array);
  if (src.length !== dst.length) {
    throw new RangeError(`encodeE5m2Array: source length ${src.length} != destination length ${dst.length}`);
  }
  const bits = bitsView(src);
  for (let i = 0; i < src.length; i++) dst[i] = e5m2FromBits(bits[i], src[i]);
}

/** Decodes e4m3 codes to float32; dst must have the same length. */
export function decodeE4m3Array(src: Uint8Array, dst: Float32Array): void {
  checkKinds("decodeE4m3Array", src, Uint8Array, dst, Float32Array);
  if (src.length !== dst.length) {
    throw new RangeError(`decodeE4m3Array: source length ${src.length} != destination length ${dst.length}`);
  }
  for (let i = 0; i < src.length; i++) dst[i] = E4M3_DECODE[src[i]];
}

/** Decodes e5m2 codes to float32; dst must have the same length. */
export function decodeE5m2Array(src: Uint8Array, dst: Float32Array): void {
  checkKinds("decodeE5m2Array", src, Uint8Array, dst, Float32Array);
  if (src.length !== dst.length) {
    throw new RangeError(`decodeE5m2Array: source length ${src.length} != destination length ${dst.length}`);
  }
  for (let i = 0; i < src.length; i++) dst[i] = E5M2_DECODE[src[i]];
}
