/**
 * Counter-based random numbers: value = f(seed, tensorKey, index), with no state between calls.
 *
 * Any element of any tensor can be made alone, in any order, on any thread, and a CUDA kernel can
 * reproduce it bit for bit: the algorithm uses only 32-bit integer multiplies (Math.imul), xor, add and
 * unsigned shifts, and one fp32 multiply. docs/weights.md states it exactly.
 *
 *   fmix32(h)   = murmur3's finalizer: h ^= h >>> 16; h *= 0x85EBCA6B; h ^= h >>> 13; h *= 0xC2B2AE35; h ^= h >>> 16
 *   stream      = fmix32(fmix32(seed ^ 0x9E3779B9) ^ key)                  (one per (seed, tensor))
 *   hash32      = fmix32(stream + index · 0x9E3779B9)                      (all mod 2^32)
 *   uniformSym  = ((hash32 >>> 8) − 2^23) · 2^−23                          in [−1, 1), 24 bits, exact in fp32
 */
import { describeValue } from "../config/config.js";

/** 2^32 / φ, the Weyl-sequence increment that spreads consecutive indices before the mixer. */
const GOLDEN = 0x9e3779b9;
const TWO_POW_23 = 8388608;
const TWO_POW_MINUS_23 = 1 / TWO_POW_23;
const INDEX_LIMIT = 2 ** 32;

/** Seeds are unsigned 32-bit integers: the hash takes a seed mod 2^32, so any other value would alias one. */
export const MAX_SEED = 2 ** 32 - 1;

/**
 * Throws RangeError unless seed is an integer in [0, 2^32 − 1]: the one rule of every seeded generator
 * (weights, activations, random routing; CPU and device) and of the CLI's --seed.
 */
export function checkSeed(seed: number): void {
  if (typeof seed !== "number" || !Number.isInteger(seed) || seed < 0 || seed > MAX_SEED) {
    throw new RangeError(`seed must be an integer in [0, ${MAX_SEED}], got ${describeValue(seed)}`);
  }
}

/** The --seed text of the CLI as a seed, under `checkSeed`'s rule (RangeError otherwise). */
export function parseSeed(text: string): number {
  const n = /^\s*\d+\s*$/.test(text) ? Number(text) : Number.NaN;
  if (Number.isNaN(n)) throw new RangeError(`seed must be an integer in [0, ${MAX_SEED}], got "${text}"`);
  checkSeed(n);
  return n;
}

/** murmur3's 32-bit finalizer: a bijection with full avalanche. Returns an unsigned 32-bit integer. */
export function fmix32(h: number): number {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** The per-(seed, tensor) constant every element hash of that tensor starts from. */
export function streamKey(seed: number, key: number): number {
  return fmix32(fmix32((seed ^ GOLDEN) >>> 0) ^ key);
}

/** FNV-1a (32-bit) of the UTF-8 bytes of a tensor's name. */
export function tensorKey(name: string): number {
  const bytes = new TextEncoder().encode(name);
  let h = 0x811c9dc5;
  for (let i = 0; i < bytes.length; i++) {
    h ^= bytes[i];
    h = Math.imul(h, 0x01000193);
  }
  return h >>> 0;
}

/** Unsigned 32-bit hash of (seed, key, index); all three are taken mod 2^32. */
export function hash32(seed: number, key: number, index: number): number {
  return fmix32((streamKey(seed, key) + Math.imul(index, GOLDEN)) | 0);
}

/** A value in [−1, 1) with 24 significant bits (exact in fp32), uniform over 2^24 steps of 2^−23. */
export function uniformSym(seed: number, key: number, index: number): number {
  return ((hash32(seed, key, index) >>> 8) - TWO_POW_23) * TWO_POW_MINUS_23;
}

function checkFillRange(length: number, startIndex: number, outOffset: number, count: number): void {
  if (!Number.isInteger(outOffset) || outOffset < 0 || !Number.isInteger(count) || count < 0) {
    throw new RangeError(`outOffset (${outOffset}) and count (${count}) must be non-negative integers`);
  }
  if (outOffset + count > length) {
    throw new RangeError(`outOffset + count (${outOffset + count}) exceeds out.length (${length})`);
  }
  if (!Number.isInteger(startIndex) || startIndex < 0 || startIndex + count > INDEX_LIMIT) {
    throw new RangeError(`indices [${startIndex}, ${startIndex + count}) must lie in [0, 2^32)`);
  }
}

/** out[outOffset + i] = hash32(seed, key, startIndex + i) for i < count (count defaults to the rest of out). */
export function fillHash32(
  out: Uint32Array,
  seed: number,
  key: number,
  startIndex: number,
  outOffset = 0,
  count: number = out.length - outOffset,
): void {
  checkFillRange(out.length, startIndex, outOffset, count);
  let weyl = (streamKey(seed, key) + Math.imul(startIndex, GOLDEN)) | 0;
  const end = outOffset + count;
  for (let i = outOffset; i < end; i++) {
    let h = weyl;
    h ^= h >>> 16;
    h = Math.imul(h, 0x85ebca6b);
    h ^= h >>> 13;
    h = Math.imul(h, 0xc2b2ae35);
    h ^= h >>> 16;
    out[i] = h;
    weyl = (weyl + GOLDEN) | 0;
  }
}

/**
 * out[outOffset + i] = fround(uniformSym(seed, key, startIndex + i) · scale) for i < count.
 *
 * scale must be an fp32 value (it is rounded to one); the product of two fp32 values is exact in double,
 * so the one fround equals CUDA's __fmul_rn. count defaults to the rest of `out`.
 */
export function fillUniform(
  out: Float32Array,
  seed: number,
  key: number,
  startIndex: number,
  scale: number,
  outOffset = 0,
  count: number = out.length - outOffset,
): void {
  checkFillRange(out.length, startIndex, outOffset, count);
  const stream = streamKey(seed, key);
  // The scaled step: uniformSym · scale = (m − 2^23) · (scale · 2^−23), and scale · 2^−23 is exact.
  const step = Math.fround(scale) * TWO_POW_MINUS_23;
  // Weyl counter stream + index · GOLDEN, advanced by GOLDEN per element (mod 2^32).
  let weyl = (stream + Math.imul(startIndex, GOLDEN)) | 0;
  const end = outOffset + count;
  for (let i = outOffset; i < end; i++) {
    let h = weyl;
    h ^= h >>> 16;
    h = Math.imul(h, 0x85ebca6b);
    h ^= h >>> 13;
    h = Math.imul(h, 0xc2b2ae35);
    h ^= h >>> 16;
    // Float32Array stores round the exact double product to fp32 once.
    out[i] = ((h >>> 8) - TWO_POW_23) * step;
    weyl = (weyl + GOLDEN) | 0;
  }
}
