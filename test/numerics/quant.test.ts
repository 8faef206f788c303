import assert from "node:assert/strict";
import { describe, it } from "node:test";
import type { ScaleFormat } from "../../src/config/config.js";
import { f32FromBf16Array, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { E4M3_DECODE, encodeE4m3 } from "../../src/numerics/fp8.js";
import {
  dequantizeActivations,
  dequantizeWeightBlocks,
  MIN_AMAX,
  quantizeActivations,
  quantizeRow128,
  quantizeWeightBlocks,
  ue8m0Ceil,
} from "../../src/numerics/quant.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("quant");

/**
 * Round-trip bound. With y = fround(x·inv) the value handed to the e4m3 encoder, round-to-nearest errs by
 * at most half an e4m3 ulp: 2^-4·|y| for normals (|y| ≥ 2^-6; 3 mantissa bits), 2^-10 for subnormals, and
 * saturation at 448 costs less than that since |y| ≤ 448·(1 + 2^-22). Scaling back by s (dequantization)
 * gives 2^-4·|x| or 2^-10·s; the three float32 roundings (1/s, x·inv, decode·s) add at most ~3·2^-24·|x|.
 * So |x − deq| ≤ max(2^-4·|x|, 2^-10·s)·(1 + 2^-20) + 2^-21·|x|.
 */
function roundTripBound(x: number, scale: number): number {
  return Math.max(2 ** -4 * Math.abs(x), 2 ** -10 * scale) * (1 + 2 ** -20) + 2 ** -21 * Math.abs(x);
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
function isPowerOfTwo(x: number): boolean {
  f32[0] = x;
  return x > 0 && (u32[0] & 0x007fffff) === 0 && (u32[0] & 0x7f800000) !== 0;
}

/** bf16 activations whose 128-channel groups span very different magnitudes (and mixed ones). */
function randomActivations(next: () => number, tokens: number, hidden: number): Uint16Array {
  const x = new Uint16Array(tokens * hidden);
  for (let g = 0; g < (tokens * hidden) / 128; g++) {
    const groupExp = Math.floor(next() * 40) - 30; // 2^-30 .. 2^9
    const mixed = next() < 0.25;
    for (let j = 0; j < 128; j++) {
      const e = mixed ? groupExp - Math.floor(next() * 20) : groupExp;
      let v = (next() * 2 - 1) * 2 ** e;
      if (v === 0) v = 2 ** e;
      x[g * 128 + j] = f32ToBf16Bits(v);
    }
  }
  return x;
}

function groupAmax(values: Float32Array, start: number): number {
  let m = 0;
  for (let j = 0; j < 128; j++) m = Math.max(m, Math.abs(values[start + j]));
  return m;
}

describe("ue8m0Ceil", () => {
  it("rounds up to a power of two", () => {
    assert.equal(ue8m0Ceil(1), 1);
    assert.equal(ue8m0Ceil(0.75), 1);
    assert.equal(ue8m0Ceil(1.5), 2);
    assert.equal(ue8m0Ceil(Math.fround(1 + 2 ** -23)), 2);
    assert.equal(ue8m0Ceil(2 ** -40), 2 ** -40);
    assert.equal(ue8m0Ceil(Math.fround(3e-13)), 2 ** -41);
  });

  it("rejects non-positive and non-finite scales", () => {
    for (const bad of [0, -1, Number.NaN, Number.POSITIVE_INFINITY, 1e-50, 1e39]) {
      assert.throws(() => ue8m0Ceil(bad), /positive finite float32/);
    }
  });
});

describe("activation quantization", () => {
  for (const format of ["fp32", "ue8m0"] as ScaleFormat[]) {
    it(`round-trips within the bound (${format} scales)`, () => {
      const next = rng(seed ^ (format === "fp32" ? 1 : 2));
      const tokens = 9;
      const hidden = 640;
      const x = randomActivations(next, tokens, hidden);
      const xf = f32FromBf16Array(x);
      const { q, scales } = quantizeActivations(x, tokens, hidden, format);
      assert.equal(q.length, tokens * hidden);
      assert.equal(scales.length, tokens * (hidden / 128));
      const deq = dequantizeActivations(q, scales, tokens, hidden);
      for (let g = 0; g < scales.length; g++) {
        const amax = groupAmax(xf, g * 128);
        const fp32Scale = Math.fround(Math.max(amax, MIN_AMAX) / 448);
        const s = scales[g];
        if (format === "fp32") assert.equal(s, fp32Scale, `group ${g}`);
        else {
          assert.ok(isPowerOfTwo(s), `group ${g}: scale ${s} is not a power of two`);
          assert.ok(s >= fp32Scale && s < 2 * fp32Scale, `group ${g}: ${s} vs fp32 scale ${fp32Scale}`);
        }
        const inv = Math.fround(1 / s);
        for (let j = 0; j < 128; j++) {
          const i = g * 128 + j;
          // Codes are exactly the rule applied element by element, at the right place.
          assert.equal(q[i], encodeE4m3(Math.fround(xf[i] * inv)), `code at ${i}`);
          assert.equal(deq[i], Math.fround(E4M3_DECODE[q[i]] * s));
          const err = Math.abs(xf[i] - deq[i]);
          assert.ok(err <= roundTripBound(xf[i], s), `index ${i}: x=${xf[i]} deq=${deq[i]} scale=${s}`);
        }
      }
    });
  }

  it("maps a row of equal values to ±448 (fp32) and one shared code (ue8m0)", () => {
    for (const v of [0.3, -7.5, 1234, 3e-5]) {
      const x = new Uint16Array(256).fill(f32ToBf16Bits(v));
      const xv = f32FromBf16Array(x.subarray(0, 1))[0];
      const fp32 = quantizeActivations(x, 2, 128, "fp32");
      assert.ok(
        fp32.q.every((c) => c === (v > 0 ? 0x7e : 0xfe)),
        `v=${v}`,
      );
      assert.equal(fp32.scales[0], Math.fround(Math.abs(xv) / 448));
      const d = dequantizeActivations(fp32.q, fp32.scales, 2, 128);
      assert.ok(d.every((y) => Math.abs(y - xv) <= Math.abs(xv) * 2 ** -20));
      const ue = quantizeActivations(x, 2, 128, "ue8m0");
      assert.ok(ue.q.every((c) => c === ue.q[0]));
      const y = E4M3_DECODE[ue.q[0]];
      assert.ok(Math.abs(y) >= 224 && Math.abs(y) <= 448, `v=${v}: code value ${y}`);
    }
  });

  it("saturates a product just above 448 to 0x7E", () => {
    // For amax = 1.0234375, fround(amax · fround(1 / fround(amax/448))) = 448.00003: above the largest
    // e4m3 value, so the encoder must saturate rather than round to NaN.
    const amax = 1.0234375;
    const inv = Math.fround(1 / Math.fround(amax / 448));
    assert.ok(Math.fround(amax * inv) > 448);
    const x = new Uint16Array(128);
    for (let j = 0; j < 128; j++) x[j] = f32ToBf16Bits(j % 2 ? amax : -amax * (0.5 + j / 256));
    const { q, scales } = quantizeActivations(x, 1, 128, "fp32");
    for (let j = 1; j < 128; j += 2) assert.equal(q[j], 0x7e);
    assert.equal(q[0], encodeE4m3(Math.fround(-amax * 0.5 * inv)));
    const deq = dequantizeActivations(q, scales, 1, 128);
    assert.ok(Math.abs(deq[1] - amax) <= amax * 2 ** -20);
  });

  it("gives an all-zero group the floor scale and zero codes", () => {
    const x = new Uint16Array(256);
    for (let j = 128; j < 256; j++) x[j] = f32ToBf16Bits(1 + j / 256);
    const { q, scales } = quantizeActivations(x, 1, 256, "fp32");
    assert.equal(scales[0], Math.fround(MIN_AMAX / 448));
    assert.ok(q.subarray(0, 128).every((c) => c === 0));
    assert.ok(q.subarray(128).some((c) => c !== 0));
  });

  it("quantizeRow128 handles float32 rows at offsets like quantizeActivations", () => {
    const next = rng(seed ^ 3);
    const hidden = 384;
    const x = randomActivations(next, 1, hidden);
    const values = new Float32Array(10 + hidden);
    values.set(f32FromBf16Array(x), 10);
    const q = new Uint8Array(5 + hidden);
    const scales = new Float32Array(2 + hidden / 128);
    quantizeRow128(values, 10, hidden, "ue8m0", q, 5, scales, 2);
    const want = quantizeActivations(x, 1, hidden, "ue8m0");
    assert.deepEqual([...q.subarray(5)], [...want.q]);
    assert.deepEqual([...scales.subarray(2)], [...want.scales]);
    assert.equal(q[0], 0);
    assert.equal(scales[0], 0);
  });

  it("rejects bad shapes", () => {
    assert.throws(() => quantizeActivations(new Uint16Array(200), 1, 200, "fp32"), /multiple of 128/);
    assert.throws(
      () => quantizeActivations(new Uint16Array(256), 1, 128, "fp32"),
      /length 256 != tokens·hidden/,
    );
    assert.throws(() => quantizeActivations(new Uint16Array(256), -2, -128, "fp32"), /tokens must be/);
    assert.throws(
      () => quantizeActivations(new Uint16Array(256), 2, 128, "fp16" as ScaleFormat),
      /scale format/,
    );
    assert.throws(
      () =>
        quantizeRow128(new Float32Array(256), 0, 100, "fp32", new Uint8Array(256), 0, new Float32Array(2), 0),
      /multiple of 128/,
    );
    assert.throws(
      () =>
        quantizeRow128(new Float32Array(256), 1, 256, "fp32", new Uint8Array(256), 0, new Float32Array(2), 0),
      /values: range \[1, 257\) exceeds length 256/,
    );
    assert.throws(
      () =>
        quantizeRow128(new Float32Array(256), 0, 256, "fp32", new Uint8Array(256), 0, new Float32Array(1), 0),
      /scalesOut/,
    );
    assert.throws(
      () => dequantizeActivations(new Uint8Array(256), new Float32Array(3), 2, 128),
      /scales length 3 != tokens·hidden\/128 = 2/,
    );
  });

  it("rejects NaN and ±inf, naming the first bad index", () => {
    for (const bad of [0x7fc0, 0xffc0, 0x7f80, 0xff80]) {
      const x = new Uint16Array(512).fill(f32ToBf16Bits(0.5));
      x[300] = bad;
      x[400] = bad;
      assert.throws(
        () => quantizeActivations(x, 2, 256, "fp32"),
        /non-finite bf16 0x[0-9a-f]+ at index 300 \(token 1, channel 44\)/,
      );
    }
    const values = new Float32Array(256).fill(0.25);
    values[130] = Number.NEGATIVE_INFINITY;
    assert.throws(
      () => quantizeRow128(values, 0, 256, "fp32", new Uint8Array(256), 0, new Float32Array(2), 0),
      /non-finite value -Infinity at index 130/,
    );
  });
});

describe("weight quantization", () => {
  it("uses one scale per 128×128 block and round-trips within the bound", () => {
    const next = rng(seed ^ 4);
    const n = 256;
    const k = 384;
    const w = new Float32Array(n * k);
    const blockExp = [-12, 3, 0, -1, 7, -20];
    for (let r = 0; r < n; r++) {
      for (let c = 0; c < k; c++) {
        const e = blockExp[((r / 128) | 0) * 3 + ((c / 128) | 0)];
        w[r * k + c] = Math.fround((next() * 2 - 1 || 0.5) * 2 ** e);
      }
    }
    const { q, scales } = quantizeWeightBlocks(w, n, k);
    assert.equal(scales.length, 6);
    const deq = dequantizeWeightBlocks(q, scales, n, k);
    for (let br = 0; br < 2; br++) {
      for (let bc = 0; bc < 3; bc++) {
        let amax = 0;
        for (let r = br * 128; r < br * 128 + 128; r++) {
          for (let c = bc * 128; c < bc * 128 + 128; c++) amax = Math.max(amax, Math.abs(w[r * k + c]));
        }
        const s = scales[br * 3 + bc];
        assert.equal(s, Math.fround(Math.max(amax, MIN_AMAX) / 448), `block (${br}, ${bc})`);
        const inv = Math.fround(1 / s);
        for (let r = br * 128; r < br * 128 + 128; r++) {
          for (let c = bc * 128; c < bc * 128 + 128; c++) {
            const i = r * k + c;
            assert.equal(q[i], encodeE4m3(Math.fround(w[i] * inv)));
            assert.ok(
              Math.abs(w[i] - deq[i]) <= roundTripBound(w[i], s),
              `(${r}, ${c}): ${w[i]} vs ${deq[i]}`,
            );
          }
        }
      }
    }
  });

  it("rejects bad shapes and non-finite weights", () => {
    assert.throws(() => quantizeWeightBlocks(new Float32Array(128 * 200), 128, 200), /multiples of 128/);
    assert.throws(() => quantizeWeightBlocks(new Float32Array(128 * 128), 256, 128), /length 16384 != n·k/);
    assert.throws(
      () => dequantizeWeightBlocks(new Uint8Array(256 * 128), new Float32Array(1), 256, 128),
      /scales length 1/,
    );
    const w = new Float32Array(256 * 256).fill(0.125);
    w[129 * 256 + 3] = Number.NaN;
    assert.throws(
      () => quantizeWeightBlocks(w, 256, 256),
      /non-finite value NaN at index 33027 \(row 129, column 3\)/,
    );
  });
});
