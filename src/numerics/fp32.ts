/**
 * fp32 arithmetic the GPU does in one instruction and JavaScript does not: the fused multiply-add
 * `fmaf` (one IEEE rounding of a·b + c to fp32, round to nearest even), the promotion step of every
 * GEMM rule (docs/numerics.md "The expert GEMMs").
 */

/** The largest finite fp32, (2 − 2^-23) · 2^127. */
export const F32_MAX = 3.4028234663852886e38;
/**
 * A non-finite value computed from finite inputs and weights: an fp32 overflow of a GEMM, the SwiGLU or
 * the combine (docs/numerics.md, "Overflow"). A RangeError, as the value left fp32's range.
 */
export class NumericsError extends RangeError {
  override name = "NumericsError";
}

/**
 * Why a block scale cannot be loaded: `largest · scale` (the format's largest magnitude, 448 for e4m3 or
 * 6 for e2m1, times the scale) rounds past fp32's range, so the block's largest weights would be
 * infinite and a forward's result too; null when it fits. Every weight load refuses such scales.
 */
export function scaleOverflowProblem(scale: number, largest: number, format: string): string | null {
  if (Number.isFinite(Math.fround(largest * scale))) return null;
  return `times ${largest}, ${format}'s largest magnitude, it exceeds fp32's largest value ${F32_MAX.toExponential(4)}`;
}

/** The midpoint of F32_MAX and 2^128: fp32 rounding overflows to inf from here on. */
const F32_OVERFLOW_MIDPOINT = 2 ** 128 - 2 ** 103;

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** The finite fp32 next to finite fp32 `x` in the direction of `toward` (≠ x); past the largest, inf. */
function nextF32(x: number, toward: number): number {
  if (x === 0) return toward > 0 ? 2 ** -149 : -(2 ** -149);
  f32[0] = x;
  // Away from zero is one step up in the magnitude's bits, toward zero one step down.
  u32[0] += toward > x === x > 0 ? 1 : -1;
  return f32[0];
}

/**
 * fmaf(a, b, c) for fp32 values a, b, c: a·b + c rounded once to fp32 (nearest, ties to even), as CUDA's
 * `fmaf` and C's `fmaf`. a·b is exact in double (two 24-bit significands); the double sum s = a·b + c
 * is the exact sum rounded once, with its error e recovered exactly (TwoSum). Rounding s to fp32 gives the
 * exact sum's rounding except where s lands on the midpoint of two fp32 neighbours (a double value), the
 * exact sum lying on one side of it: e's sign picks that side.
 */
export function fmaF32(a: number, b: number, c: number): number {
  const p = a * b;
  const s = p + c;
  const r = Math.fround(s);
  if (Number.isNaN(s) || !Number.isFinite(p) || !Number.isFinite(c)) return r;
  const v = s - p;
  const e = p - (s - v) + (c - v);
  if (e === 0 || r === s) return r;
  if (!Number.isFinite(r)) {
    // s is at or past the midpoint of the largest fp32 and 2^128, where inf begins; on it, the exact sum
    // may lie below.
    const onMid = Math.abs(s) === F32_OVERFLOW_MIDPOINT;
    return onMid && e > 0 !== s > 0 ? Math.sign(s) * F32_MAX : r;
  }
  // r is s's nearest fp32; the exact sum can round elsewhere only if s is the midpoint of r and its
  // neighbour on s's side (a double: both are fp32).
  const other = nextF32(r, s);
  if (s !== (r + other) / 2) return r;
  return e > 0 ? Math.max(r, other) : Math.min(r, other);
}
