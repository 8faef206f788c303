/**
 * bf16 held as raw 16-bit patterns (the top half of a float32).
 *
 * float32 → bf16 is CUDA's `__float2bfloat16_rn`: round to nearest, ties to even on the 16 dropped bits;
 * finite values that round past the largest bf16 become ±inf (no saturation); every NaN becomes 0x7FFF.
 * bf16 → float32 is exact (append 16 zero bits).
 */

/** bf16 pattern every NaN converts to, as CUDA's host and device conversions give. */
export const BF16_NAN_BITS = 0x7fff;

const scratchF32 = new Float32Array(1);
const scratchU32 = new Uint32Array(scratchF32.buffer);

function bf16FromF32Bits(bits: number): number {
  if ((bits & 0x7fffffff) > 0x7f800000) return BF16_NAN_BITS;
  // The largest non-NaN pattern (0xFF800000) plus 0x8000 stays below 2^32, so no wrap-around here.
  return (bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16;
}

/** bf16 bits of x (x is taken as float32; a wider number is first rounded to float32). */
export function f32ToBf16Bits(x: number): number {
  scratchF32[0] = x;
  return bf16FromF32Bits(scratchU32[0]);
}

/** float32 value of a bf16 pattern (0..0xFFFF). */
/** bf16 is non-finite when its 8 exponent bits are all ones (inf or NaN). */
export function isBf16NonFinite(bits: number): boolean {
  return (bits & 0x7f80) === 0x7f80;
}

export function bf16BitsToF32(bits: number): number {
  if (!Number.isInteger(bits) || bits < 0 || bits > 0xffff) {
    throw new RangeError(`bf16 bits must be an integer in [0, 0xFFFF], got ${bits}`);
  }
  scratchU32[0] = bits << 16;
  return scratchF32[0];
}

/** x rounded to the nearest bf16 value, returned as a number. */
export function roundToBf16(x: number): number {
  scratchF32[0] = x;
  scratchU32[0] = bf16FromF32Bits(scratchU32[0]) << 16;
  return scratchF32[0];
}

function kindOf(v: unknown): string {
  return v === null || typeof v !== "object" ? String(v) : (v.constructor?.name ?? "object");
}

/** bf16 patterns of every element of src. */
export function bf16FromF32Array(src: Float32Array): Uint16Array {
  // Another kind's bytes read as float32 bits would be garbage, silently.
  if (!(src instanceof Float32Array))
    throw new TypeError(`bf16FromF32Array: src must be a Float32Array, got ${kindOf(src)}`);
  const bits = new Uint32Array(src.buffer, src.byteOffset, src.length);
  const out = new Uint16Array(src.length);
  for (let i = 0; i < src.length; i++) out[i] = bf16FromF32Bits(bits[i]);
  return out;
}

/** float32 values of bf16 patterns (exact). */
export function f32FromBf16Array(src: Uint16Array): Float32Array {
  if (!(src instanceof Uint16Array))
    throw new TypeError(`f32FromBf16Array: src must be a Uint16Array of bf16 bits, got ${kindOf(src)}`);
  const bits = new Uint32Array(src.length);
  for (let i = 0; i < src.length; i++) bits[i] = src[i] << 16;
  return new Float32Array(bits.buffer);
}
