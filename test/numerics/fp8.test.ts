import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  decodeE4m3,
  decodeE4m3Array,
  decodeE5m2,
  E4M3_DECODE,
  E5M2_DECODE,
  encodeE4m3,
  encodeE4m3Array,
  encodeE4m3Range,
  encodeE5m2,
  encodeE5m2Array,
  FP8_E4M3_MAX,
  FP8_E5M2_MAX,
} from "../../src/numerics/fp8.js";
import { rngU32, testSeed } from "../helpers/random.js";

const seed = testSeed("fp8");

const hex = (c: number) => `0x${c.toString(16).padStart(2, "0")}`;

describe("e4m3fn", () => {
  it("has the documented constants and special codes", () => {
    assert.equal(FP8_E4M3_MAX, 448);
    assert.equal(decodeE4m3(0x7e), 448);
    assert.equal(decodeE4m3(0xfe), -448);
    assert.ok(Number.isNaN(decodeE4m3(0x7f)));
    assert.ok(Number.isNaN(decodeE4m3(0xff)));
    assert.equal(decodeE4m3(0x01), 2 ** -9);
    assert.equal(decodeE4m3(0x08), 2 ** -6);
    assert.equal(decodeE4m3(0x38), 1);
    assert.ok(Object.is(decodeE4m3(0x80), -0));
    // Only the two NaN codes are NaN: e4m3fn has no infinities.
    assert.equal(E4M3_DECODE.filter((v) => Number.isNaN(v)).length, 2);
    assert.equal(E4M3_DECODE.filter((v) => !Number.isFinite(v) && !Number.isNaN(v)).length, 0);
  });

  it("encodes golden values", () => {
    const cases: [number, number][] = [
      [0, 0x00],
      [-0, 0x80],
      [2 ** -9, 0x01],
      [-(2 ** -9), 0x81],
      [2 ** -10, 0x00], // half the smallest subnormal: tie to even (0)
      [Math.fround(2 ** -10 * (1 + 2 ** -23)), 0x01], // just above the tie
      [3 * 2 ** -10, 0x02], // 1.5 × min subnormal: tie to even (2)
      [5 * 2 ** -10, 0x02], // 2.5 × min subnormal: tie to even (2)
      [1, 0x38],
      [1.0625, 0x38], // tie between 1.0 (even mantissa) and 1.125: → 1.0
      [1.1875, 0x3a], // tie between 1.125 (odd) and 1.25 (even): → 1.25
      [-1.1875, 0xba],
      [448, 0x7e],
      [-448, 0xfe],
      [464, 0x7e], // tie between 448 and the (nonexistent) 480: stays 448
      [480, 0x7e], // saturates
      [1e6, 0x7e],
      [-1e30, 0xfe],
      [3.4028234663852886e38, 0x7e],
      [Number.POSITIVE_INFINITY, 0x7e], // SATFINITE: inf becomes max, not NaN
      [Number.NEGATIVE_INFINITY, 0xfe],
      [Number.NaN, 0x7f],
      [-Number.NaN, 0x7f],
      [1e-30, 0x00],
      [-1e-30, 0x80],
      [1.401298464324817e-45, 0x00], // smallest float32 subnormal
      [2 ** -6 * (15 / 16), 0x08], // 7.5 subnormal steps: tie → 8 = smallest normal
    ];
    for (const [x, code] of cases) assert.equal(hex(encodeE4m3(x)), hex(code), `encodeE4m3(${x})`);
  });

  it("round-trips all 256 codes through decode → encode", () => {
    for (let code = 0; code < 256; code++) {
      const want = (code & 0x7f) === 0x7f ? 0x7f : code; // both NaN codes encode back to 0x7F
      assert.equal(hex(encodeE4m3(decodeE4m3(code))), hex(want), `code ${hex(code)}`);
    }
  });

  it("rounds to the nearest code, ties to even, on a random sweep", () => {
    const next = rngU32(seed);
    const finite = [...E4M3_DECODE.entries()].filter(([, v]) => Number.isFinite(v));
    for (let i = 0; i < 5000; i++) {
      // Magnitudes from ~512 down into the subnormals and below.
      const x = Math.fround((next() / 2 ** 32 - 0.5) * 1024 * 2 ** -(next() % 24));
      const code = encodeE4m3(x);
      const target = Math.max(-448, Math.min(448, x));
      const err = Math.abs(E4M3_DECODE[code] - target);
      for (const [other, v] of finite) {
        const d = Math.abs(v - target);
        assert.ok(d >= err, `x=${x}: got ${E4M3_DECODE[code]}, but ${v} is closer`);
        if (d === err && v !== E4M3_DECODE[code]) {
          assert.equal(
            code & 1,
            0,
            `x=${x} is a tie between ${hex(code)} and ${hex(other)}: want the even one`,
          );
        }
      }
    }
  });

  it("rejects codes outside 0..255", () => {
    assert.throws(() => decodeE4m3(256), /e4m3 code/);
    assert.throws(() => decodeE4m3(-1), /e4m3 code/);
    assert.throws(() => decodeE4m3(1.5), /e4m3 code/);
  });
});

describe("e5m2", () => {
  it("has the documented constants and special codes", () => {
    assert.equal(FP8_E5M2_MAX, 57344);
    assert.equal(decodeE5m2(0x7b), 57344);
    assert.equal(decodeE5m2(0x7c), Number.POSITIVE_INFINITY);
    assert.equal(decodeE5m2(0xfc), Number.NEGATIVE_INFINITY);
    for (const c of [0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff]) assert.ok(Number.isNaN(decodeE5m2(c)));
    assert.equal(decodeE5m2(0x01), 2 ** -16);
    assert.equal(decodeE5m2(0x3c), 1);
  });

  it("encodes golden values", () => {
    const cases: [number, number][] = [
      [0, 0x00],
      [-0, 0x80],
      [2 ** -16, 0x01],
      [2 ** -17, 0x00],
      [3 * 2 ** -17, 0x02],
      [1, 0x3c],
      [1.125, 0x3c], // tie between 1.0 (even) and 1.25
      [1.375, 0x3e], // tie between 1.25 (odd) and 1.5 (even)
      [57344, 0x7b],
      [61440, 0x7b], // would round to inf without saturation
      [1e9, 0x7b],
      [-1e9, 0xfb],
      [Number.POSITIVE_INFINITY, 0x7b],
      [Number.NEGATIVE_INFINITY, 0xfb],
      [Number.NaN, 0x7f],
    ];
    for (const [x, code] of cases) assert.equal(hex(encodeE5m2(x)), hex(code), `encodeE5m2(${x})`);
  });

  it("round-trips all 256 codes (inf saturates, NaNs become 0x7F)", () => {
    for (let code = 0; code < 256; code++) {
      let want = code;
      if ((code & 0x7f) > 0x7c) want = 0x7f;
      else if ((code & 0x7f) === 0x7c) want = code - 1;
      assert.equal(hex(encodeE5m2(decodeE5m2(code))), hex(want), `code ${hex(code)}`);
    }
  });
});

describe("bulk helpers", () => {
  it("agree with the scalar codecs", () => {
    const next = rngU32(seed ^ 0x5bd1e995);
    const bits = new Uint32Array(50000);
    for (let i = 0; i < bits.length; i++) bits[i] = next();
    const src = new Float32Array(bits.buffer);
    const e4 = new Uint8Array(src.length);
    const e5 = new Uint8Array(src.length);
    encodeE4m3Array(src, e4);
    encodeE5m2Array(src, e5);
    for (let i = 0; i < src.length; i++) {
      assert.equal(e4[i], encodeE4m3(src[i]), `e4m3 bits 0x${bits[i].toString(16)}`);
      assert.equal(e5[i], encodeE5m2(src[i]), `e5m2 bits 0x${bits[i].toString(16)}`);
    }
    const part = new Uint8Array(10);
    encodeE4m3Range(src, 100, part, 2, 8);
    assert.deepEqual([...part.subarray(2)], [...e4.subarray(100, 108)]);
    const back = new Float32Array(src.length);
    decodeE4m3Array(e4, back);
    for (let i = 0; i < 100; i++) assert.ok(Object.is(back[i], E4M3_DECODE[e4[i]]));
    assert.equal(E5M2_DECODE.length, 256);
  });

  it("reject mismatched lengths and ranges", () => {
    assert.throws(() => encodeE4m3Array(new Float32Array(3), new Uint8Array(2)), /length/);
    assert.throws(() => encodeE4m3Range(new Float32Array(3), 2, new Uint8Array(8), 0, 2), /exceeds/);
    assert.throws(() => decodeE4m3Array(new Uint8Array(3), new Float32Array(4)), /length/);
  });
});
