import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { bf16BitsToF32, f32FromBf16Array, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import {
  NormError,
  normEpsilon,
  premixRmsNorm,
  premixStreams,
  rmsNorm,
  rmsNormF32,
  rmsScale,
  sumOfSquares,
} from "../../src/reference/norm.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("norm");
const random = rng(seed);
const fround = Math.fround;

function randomBf16Rows(count: number, magnitude = 1): Uint16Array {
  const x = new Uint16Array(count);
  for (let i = 0; i < count; i++) x[i] = f32ToBf16Bits((random() * 2 - 1) * magnitude);
  return x;
}

describe("RMSNorm reference", () => {
  test("sum of squares: the lane order, then the butterfly (checked against a literal re-statement)", () => {
    for (const hidden of [8, 128, 256, 384, 4096]) {
      const row = new Float32Array(hidden);
      for (let h = 0; h < hidden; h++)
        row[h] = fround((random() * 2 - 1) * 2 ** Math.floor(random() * 20 - 10));
      const lanes: number[] = [];
      for (let l = 0; l < 32; l++) {
        let p = 0;
        for (let h = 0; h < hidden; h++) {
          if (Math.floor(h / 8) % 32 === l) p = fround(p + fround(row[h] * row[h]));
        }
        lanes.push(p);
      }
      // A tree: pairs (l, l+16), then (l, l+8) of those, …; lane 0's value.
      let level = lanes;
      while (level.length > 1) {
        const half = level.length / 2;
        level = level.slice(0, half).map((v, i) => fround(v + level[i + half]));
      }
      assert.equal(sumOfSquares(row, 0, hidden), level[0], `H=${hidden} (seed ${seed})`);
      // And close to the exact sum.
      const exact = row.reduce((s, v) => s + v * v, 0);
      assert.ok(Math.abs(sumOfSquares(row, 0, hidden) - exact) <= 1e-5 * exact, `H=${hidden}`);
    }
  });

  test("rmsScale is four correctly rounded fp32 steps", () => {
    assert.equal(
      rmsScale(4 * 256, 256, fround(1e-6)),
      fround(1 / fround(Math.sqrt(fround(4 + fround(1e-6))))),
    );
    assert.equal(rmsScale(0, 128, 0.25), 2); // zero row: 1/sqrt(eps)
    assert.equal(normEpsilon(1e-6), fround(1e-6));
    assert.throws(() => normEpsilon(0), /eps must be positive/);
    assert.throws(() => normEpsilon(1e-50), /eps must be positive/); // rounds to 0 in fp32
  });

  test("rows normalize to unit RMS times the weight, within bf16 rounding", () => {
    const hidden = 512;
    const tokens = 5;
    const x = randomBf16Rows(tokens * hidden, 3);
    const weight = randomBf16Rows(hidden, 2);
    const y = rmsNorm(x, weight, tokens, hidden, 1e-6);
    const xf = f32FromBf16Array(x);
    const wf = f32FromBf16Array(weight);
    for (let t = 0; t < tokens; t++) {
      let ss = 0;
      for (let h = 0; h < hidden; h++) ss += xf[t * hidden + h] ** 2;
      const r = 1 / Math.sqrt(ss / hidden + 1e-6);
      for (let h = 0; h < hidden; h++) {
        const ideal = xf[t * hidden + h] * r * wf[h];
        const got = bf16BitsToF32(y[t * hidden + h]);
        assert.ok(
          Math.abs(got - ideal) <= 2 ** -8 * Math.abs(ideal) + 1e-30,
          `t=${t} h=${h}: ${got} vs ${ideal}`,
        );
      }
    }
  });

  test("the exact rule on a hand-checked row: x = 3 everywhere", () => {
    const hidden = 128;
    const x = new Uint16Array(hidden).fill(f32ToBf16Bits(3));
    const weight = new Uint16Array(hidden).fill(f32ToBf16Bits(0.5));
    // ss = 9·128 = 1152 exactly in any order; mean 9; r = fround(1/fround(sqrt(9 + eps))).
    const eps = fround(1e-5);
    const r = fround(1 / fround(Math.sqrt(fround(9 + eps))));
    const y = rmsNorm(x, weight, 1, hidden, 1e-5);
    assert.equal(y[0], f32ToBf16Bits(fround(fround(3 * r) * 0.5)));
    assert.ok(y.every((v) => v === y[0]));
  });

  test("zero rows give zeros (r = 1/sqrt(eps) stays finite)", () => {
    const y = rmsNorm(new Uint16Array(256), randomBf16Rows(256), 1, 256, 1e-6);
    assert.ok(y.every((v) => v === 0 || v === 0x8000));
  });

  test("pre-mix: fp32 multiply and add per stream in increasing j, from +0", () => {
    const tokens = 3;
    const n = 4;
    const hidden = 128;
    const streams = randomBf16Rows(tokens * n * hidden, 5);
    const mix = new Float32Array(tokens * n).map(() => fround(random() * 2 - 0.5));
    const x = premixStreams(streams, mix, tokens, n, hidden);
    const s = f32FromBf16Array(streams);
    for (let t = 0; t < tokens; t++) {
      for (let h = 0; h < hidden; h++) {
        let acc = 0;
        for (let j = 0; j < n; j++) acc = fround(acc + fround(mix[t * n + j] * s[(t * n + j) * hidden + h]));
        assert.equal(x[t * hidden + h], acc);
      }
    }
    // −0 products sum to +0.
    const negZero = new Uint16Array(hidden).fill(0x8000);
    const z = premixStreams(negZero, new Float32Array([1]), 1, 1, hidden);
    assert.ok(z.every((v) => Object.is(v, 0)));
    // premixRmsNorm = premix then RMSNorm of the fp32 rows (no bf16 rounding in between).
    const weight = randomBf16Rows(hidden);
    assert.deepEqual(
      premixRmsNorm(streams, mix, weight, tokens, n, hidden, 1e-6),
      rmsNormF32(x, weight, tokens, hidden, 1e-6),
    );
    // One stream with weight 1 is the plain norm.
    const rows = randomBf16Rows(tokens * hidden);
    assert.deepEqual(
      premixRmsNorm(rows, new Float32Array(tokens).fill(1), weight, tokens, 1, hidden, 1e-6),
      rmsNorm(rows, weight, tokens, hidden, 1e-6),
    );
  });

  test("bad inputs are named", () => {
    const w = randomBf16Rows(128);
    assert.throws(() => rmsNorm(new Uint16Array(100), w, 1, 128, 1e-6), /x has 100 elements/);
    const bad = randomBf16Rows(256);
    bad[130] = 0x7fc0;
    assert.throws(
      () => rmsNorm(bad, w, 2, 128, 1e-6),
      (e: Error) => e instanceof NormError && /x\[1, 2\]/.test(e.message),
    );
    assert.throws(() => rmsNorm(randomBf16Rows(128), w.subarray(0, 64), 1, 128, 1e-6), /norm weight has 64/);
    assert.throws(() => rmsNorm(randomBf16Rows(100), w.subarray(0, 100), 1, 100, 1e-6), /multiple of 8/);
    assert.throws(
      () => premixStreams(randomBf16Rows(256), new Float32Array([1, Number.NaN]), 1, 2, 128),
      /mix weights\[0, 1\]/,
    );
    const badStreams = randomBf16Rows(2 * 2 * 128);
    badStreams[128 * 3 + 7] = 0x7f80;
    assert.throws(() => premixStreams(badStreams, new Float32Array(4), 2, 2, 128), /streams\[1, 1, 7\]/);
  });
});
