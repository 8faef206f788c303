import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  BF16_NAN_BITS,
  bf16BitsToF32,
  bf16FromF32Array,
  f32FromBf16Array,
  f32ToBf16Bits,
  roundToBf16,
} from "../../src/numerics/bf16.js";
import { rngU32, testSeed } from "../helpers/random.js";

const seed = testSeed("bf16");

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
function fromBits(bits: number): number {
  u32[0] = bits;
  return f32[0];
}

const hex = (b: number) => `0x${b.toString(16).padStart(4, "0")}`;

describe("bf16", () => {
  it("rounds to nearest, ties to even", () => {
    const cases: [number, number][] = [
      [0x3f808000, 0x3f80], // 1 + 2^-8: tie, 0x3F80 is even → down
      [0x3f818000, 0x3f82], // tie above an odd pattern → up
      [0x3f808001, 0x3f81], // just above the tie → up
      [0x3f807fff, 0x3f80], // just below the tie → down
      [0xbf818000, 0xbf82], // negative ties are symmetric
      [0x7f7fffff, 0x7f80], // float32 max rounds past the largest bf16: inf (no saturation)
      [0x7f7f7fff, 0x7f7f],
      [0x00000001, 0x0000], // float32 subnormal rounds to zero
      [0x00008000, 0x0000], // tie → even (0)
      [0x00018000, 0x0002], // subnormal tie → up to even
      [0x80000000, 0x8000], // -0
      [0x7f800000, 0x7f80], // +inf
      [0xff800000, 0xff80], // -inf
    ];
    for (const [bits, want] of cases) {
      assert.equal(hex(f32ToBf16Bits(fromBits(bits))), hex(want), `bits 0x${bits.toString(16)}`);
    }
  });

  it("maps every NaN to 0x7FFF", () => {
    assert.equal(BF16_NAN_BITS, 0x7fff);
    for (const bits of [0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001, 0x7fffffff, 0xffffffff]) {
      const src = new Float32Array(new Uint32Array([bits]).buffer);
      assert.equal(hex(bf16FromF32Array(src)[0]), "0x7fff", `bulk, bits 0x${bits.toString(16)}`);
    }
    assert.equal(f32ToBf16Bits(Number.NaN), 0x7fff);
    assert.ok(Number.isNaN(roundToBf16(Number.NaN)));
  });

  it("round-trips every bf16 pattern exactly", () => {
    for (let b = 0; b <= 0xffff; b++) {
      const v = bf16BitsToF32(b);
      const nanPattern = (b & 0x7f80) === 0x7f80 && (b & 0x7f) !== 0;
      assert.equal(f32ToBf16Bits(v), nanPattern ? 0x7fff : b);
    }
    const all = new Uint16Array(0x10000).map((_, i) => i);
    const back = bf16FromF32Array(f32FromBf16Array(all));
    for (let b = 0; b <= 0xffff; b++) {
      const nanPattern = (b & 0x7f80) === 0x7f80 && (b & 0x7f) !== 0;
      assert.equal(back[b], nanPattern ? 0x7fff : b);
    }
  });

  it("bulk and scalar conversions agree on random float32 patterns", () => {
    const next = rngU32(seed);
    const bits = new Uint32Array(100000);
    for (let i = 0; i < bits.length; i++) bits[i] = next();
    const src = new Float32Array(bits.buffer);
    const out = bf16FromF32Array(src);
    for (let i = 0; i < src.length; i++) {
      assert.equal(out[i], f32ToBf16Bits(src[i]));
      const r = roundToBf16(src[i]);
      if (Number.isNaN(src[i])) assert.ok(Number.isNaN(r));
      else assert.ok(Object.is(r, bf16BitsToF32(out[i])));
      // Normal range: the error is at most half a bf16 ulp, i.e. 2^-8 of the value's binade.
      const a = Math.abs(src[i]);
      if (a >= 2 ** -126 && a < 3.3e38) assert.ok(Math.abs(r - src[i]) <= a * 2 ** -8, `x=${src[i]} r=${r}`);
    }
  });

  it("roundToBf16 returns the rounded value", () => {
    assert.equal(roundToBf16(1 + 2 ** -8), 1);
    assert.equal(roundToBf16(1 + 3 * 2 ** -8), 1 + 2 ** -6);
    assert.equal(roundToBf16(Math.PI), 3.140625);
  });

  it("rejects out-of-range bit patterns", () => {
    assert.throws(() => bf16BitsToF32(0x10000), /bf16 bits/);
    assert.throws(() => bf16BitsToF32(-1), /bf16 bits/);
  });
});
