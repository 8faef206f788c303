import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { type MoEConfig, resolveConfig } from "../../src/config/config.js";
import { f32FromBf16Array, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { hash32, tensorKey, uniformSym } from "../../src/numerics/counter-rng.js";
import { countFp4ToFp8Inexact, quantizeMxfp4 } from "../../src/numerics/fp4.js";
import {
  ACTIVATION_BASE,
  blockExponent,
  GATE_BIAS_SCALE,
  generatorNames,
  matrixBaseScale,
} from "../../src/numerics/generator.js";
import { dequantizeWeightBlocks } from "../../src/numerics/quant.js";
import {
  GeneratedWeights,
  generateActivations,
  generateExpert,
  generateMatrix,
} from "../../src/weights/generate.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  type RoutedExpertWeights,
  requireFp8Expert,
} from "../../src/weights/types.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("weight generator tests");

function tiny(overrides: Partial<MoEConfig> = {}): MoEConfig {
  return resolveConfig("tiny", overrides);
}

function std(values: ArrayLike<number>): number {
  let sum = 0;
  let sumSq = 0;
  for (let i = 0; i < values.length; i++) {
    sum += values[i];
    sumSq += values[i] * values[i];
  }
  const mean = sum / values.length;
  return Math.sqrt(sumSq / values.length - mean * mean);
}

/** The FP8 expert (these configs are FP8). */
const fp8 = (w: RoutedExpertWeights) => requireFp8Expert(w, "test");

function copyExpert(w: ExpertWeights): ExpertWeights {
  const copy = (b: BlockQuantized): BlockQuantized => ({ ...b, q: b.q.slice(), scales: b.scales.slice() });
  return { w1: copy(w.w1), w2: copy(w.w2) };
}

/** The std a generated matrix should have, given its drawn block exponents. */
function expectedStd(name: string, blocks: number, fanIn: number): number {
  let meanSquareFactor = 0;
  for (let k = 0; k < blocks; k++) meanSquareFactor += 4 ** blockExponent(seed, name, k) / blocks;
  return matrixBaseScale(fanIn) * Math.sqrt(meanSquareFactor / 3);
}

/** Checks shape, and std against the one the block factors imply (tiny matrices have only a few blocks). */
function checkBlockQuantized(
  b: BlockQuantized,
  rows: number,
  cols: number,
  fanIn: number,
  what: string,
): void {
  assert.equal(b.rows, rows, `${what} rows`);
  assert.equal(b.cols, cols, `${what} cols`);
  assert.equal(b.q.length, rows * cols);
  assert.equal(b.scales.length, (rows / 128) * (cols / 128));
  const w = dequantizeWeightBlocks(b.q, b.scales, rows, cols);
  const expected = expectedStd(what, b.scales.length, fanIn);
  const ratio = std(w) / expected;
  assert.ok(ratio > 0.95 && ratio < 1.05, `${what}: std ${std(w)}, expected ${expected}`);
  assert.ok(new Set(b.scales).size >= Math.min(3, b.scales.length), `${what}: block scales should differ`);
}

describe("generateMatrix", () => {
  it("is uniformSym times a per-block power-of-two factor, std ≈ 1/sqrt(fanIn)", () => {
    const [rows, cols, fanIn] = [1024, 1024, 1024];
    const w = generateMatrix(seed, "m", rows, cols, fanIn);
    const base = matrixBaseScale(fanIn);
    const exponents = new Set<number>();
    for (let i = 0; i < 2000; i++) {
      const r = (i * 7919) % rows;
      const c = (i * 104729) % cols;
      const e = blockExponent(seed, "m", Math.floor(r / 128) * (cols / 128) + Math.floor(c / 128));
      exponents.add(e);
      const expected = Math.fround(
        uniformSym(seed, tensorKey("m"), r * cols + c) * Math.fround(base * 2 ** e),
      );
      assert.equal(w[r * cols + c], expected, `(${r}, ${c})`);
    }
    assert.deepEqual([...exponents].sort(), [-1, 0, 1]);
    const ratio = std(w) / expectedStd("m", 64, fanIn);
    assert.ok(ratio > 0.98 && ratio < 1.02, `std / expected = ${ratio}`);
    assert.ok(w.some((v) => v !== 0));
  });

  it("block amax follows the block factor", () => {
    const w = generateMatrix(seed + 1, "blocks", 256, 1024, 1024);
    const base = matrixBaseScale(1024);
    for (let br = 0; br < 2; br++) {
      for (let bc = 0; bc < 8; bc++) {
        let amax = 0;
        for (let r = 0; r < 128; r++) {
          for (let c = 0; c < 128; c++)
            amax = Math.max(amax, Math.abs(w[(br * 128 + r) * 1024 + bc * 128 + c]));
        }
        const factor = 2 ** blockExponent(seed + 1, "blocks", br * 8 + bc);
        assert.ok(amax <= base * factor && amax > 0.99 * base * factor, `block (${br}, ${bc})`);
      }
    }
  });
});

describe("GeneratedWeights", () => {
  it("makes one expert alone equal to the same expert made in a full run", () => {
    const config = tiny();
    const full = new GeneratedWeights(config, seed, { cachedExperts: 1 });
    const all = Array.from({ length: config.numExperts }, (_, e) => copyExpert(fp8(full.expert(e))));
    full.shared();
    full.gate();
    for (const e of [config.numExperts - 1, 0, seed % config.numExperts]) {
      assert.deepEqual(new GeneratedWeights(config, seed).expert(e), all[e], `expert ${e}`);
      assert.deepEqual(generateExpert(config, seed, e), all[e], `generateExpert ${e}`);
    }
    // A different seed gives different weights.
    assert.notDeepEqual(fp8(new GeneratedWeights(config, seed + 1).expert(0)).w1.q, all[0].w1.q);
    // Experts differ from each other.
    assert.notDeepEqual(all[0].w1.q, all[1].w1.q);
  });

  it("has the layouts and a realistic scale, never zeros", () => {
    const config = tiny({ numShared: 2 });
    const w = new GeneratedWeights(config, seed);
    const { hidden: h, intermediate: i } = config;
    for (const e of [0, 5]) {
      checkBlockQuantized(fp8(w.expert(e)).w1, 2 * i, h, h, generatorNames.expertW1(e));
      checkBlockQuantized(fp8(w.expert(e)).w2, h, i, i, generatorNames.expertW2(e));
    }
    const shared = w.shared();
    assert.ok(shared !== null);
    checkBlockQuantized(shared.w1, 4 * i, h, h, generatorNames.sharedW1);
    checkBlockQuantized(shared.w2, h, 2 * i, 2 * i, generatorNames.sharedW2);
    assert.equal(new GeneratedWeights(tiny({ numShared: 0 }), seed).shared(), null);
  });

  it("caches a few experts and regenerates evicted ones identically", () => {
    const w = new GeneratedWeights(tiny(), seed, { cachedExperts: 2 });
    const first = w.expert(3);
    assert.equal(w.expert(3), first, "a cache hit returns the same object");
    w.expert(4);
    w.expert(5);
    const again = w.expert(3);
    assert.notEqual(again, first, "expert 3 was evicted");
    assert.deepEqual(again, first);
    assert.throws(() => w.expert(8), RangeError);
    assert.throws(() => w.expert(-1), RangeError);
  });

  it("gate weight is bf16 with std ≈ 1/sqrt(H); the bias follows the config", () => {
    const config = tiny();
    const gate = new GeneratedWeights(config, seed).gate();
    assert.equal(gate.weight.length, config.numExperts * config.hidden);
    const s = std(f32FromBf16Array(gate.weight)) * Math.sqrt(config.hidden);
    assert.ok(s > 0.85 && s < 1.15, `gate std · sqrt(H) = ${s}`);
    assert.ok(gate.bias !== null);
    assert.equal(gate.bias.length, config.numExperts);
    assert.ok(gate.bias.every((b) => Math.abs(b) <= GATE_BIAS_SCALE));
    assert.ok(gate.bias.some((b) => b !== 0));
    const noBias = tiny({ router: { ...config.router, correctionBias: false } });
    assert.equal(new GeneratedWeights(noBias, seed).gate().bias, null);
  });

  it("makes a flash-shaped expert with the right shapes", () => {
    const config = resolveConfig("flash");
    const start = performance.now();
    const e = fp8(new GeneratedWeights(config, seed).expert(config.numExperts - 1));
    console.log(`one flash expert: ${(performance.now() - start).toFixed(0)} ms`);
    assert.equal(e.w1.q.length, 2 * 2048 * 4096);
    assert.equal(e.w1.scales.length, 32 * 32);
    assert.equal(e.w2.q.length, 4096 * 2048);
    assert.equal(e.w2.scales.length, 32 * 16);
    const bases = [matrixBaseScale(4096), matrixBaseScale(2048)];
    for (const [k, b] of [e.w1, e.w2].entries()) {
      // Over 512+ blocks the factors average out: std ≈ 1/sqrt(fanIn).
      const s = std(dequantizeWeightBlocks(b.q, b.scales, b.rows, b.cols)) * Math.sqrt(b.cols);
      assert.ok(s > 0.9 && s < 1.1, `std · sqrt(fanIn) = ${s}`);
      // Each block scale is about amax / 448 with amax ≈ base · 2^{−1, 0, 1}.
      for (const s of b.scales) {
        const ratio = (s * 448) / bases[k];
        assert.ok(
          [0.5, 1, 2].some((f) => ratio <= f * (1 + 1e-6) && ratio > 0.99 * f),
          `scale ratio ${ratio}`,
        );
      }
    }
  });
});

describe("generateActivations", () => {
  it("is deterministic, seed dependent, std ≈ 1, never zero rows", () => {
    const [tokens, hidden] = [64, 4096];
    const x = generateActivations(seed, tokens, hidden);
    assert.deepEqual(generateActivations(seed, tokens, hidden), x);
    assert.notDeepEqual(generateActivations(seed + 1, tokens, hidden), x);
    // A prefix of tokens is the same whatever the token count.
    assert.deepEqual(generateActivations(seed, 5, hidden), x.subarray(0, 5 * hidden));
    const f = f32FromBf16Array(x);
    const s = std(f);
    assert.ok(s > 0.7 && s < 1.4, `std ${s}`);
    const rms: number[] = [];
    for (let t = 0; t < tokens; t++) {
      const row = f.subarray(t * hidden, (t + 1) * hidden);
      assert.ok(
        row.some((v) => v !== 0),
        `token ${t} is all zeros`,
      );
      rms.push(Math.sqrt(row.reduce((a, v) => a + v * v, 0) / hidden));
    }
    assert.ok(Math.max(...rms) / Math.min(...rms) > 4, "per-token scales should vary");
  });

  it("has a few large outliers per row, exactly where the hash says", () => {
    const [tokens, hidden] = [16, 4096];
    const x = generateActivations(seed, tokens, hidden);
    const key = tensorKey("input");
    for (let t = 0; t < tokens; t++) {
      const scale =
        ACTIVATION_BASE * [0.25, 0.5, 1, 2][hash32(seed, tensorKey("input.token_scale"), t) >>> 30];
      let outliers = 0;
      for (let c = 0; c < hidden; c++) {
        const h = hash32(seed, key, t * hidden + c);
        const isOutlier = (h & 0xff) === 0;
        if (isOutlier) outliers++;
        const value = Math.fround(uniformSym(seed, key, t * hidden + c) * scale * (isOutlier ? 8 : 1));
        assert.equal(x[t * hidden + c], f32ToBf16Bits(value), `(${t}, ${c})`);
      }
      assert.ok(outliers >= 2 && outliers <= 45, `token ${t}: ${outliers} outliers`);
    }
  });
});

describe("GeneratedWeights with FP4 experts", () => {
  it("quantizes the FP8 path's fp32 values to MXFP4, deterministically, and every block converts exactly", () => {
    const config = tiny({ expertFormat: "fp4" });
    const w = new GeneratedWeights(config, seed, { cachedExperts: 1 });
    const { hidden: h, intermediate: i } = config;
    for (const e of [0, 7]) {
      const x = w.expert(e);
      assert.equal(x.format, "fp4");
      if (x.format !== "fp4") return;
      const want1 = quantizeMxfp4(generateMatrix(seed, generatorNames.expertW1(e), 2 * i, h, h), 2 * i, h);
      const want2 = quantizeMxfp4(generateMatrix(seed, generatorNames.expertW2(e), h, i, i), h, i);
      assert.deepEqual(x.w1, want1);
      assert.deepEqual(x.w2, want2);
      assert.deepEqual(generateExpert(config, seed, e), x);
      assert.equal(x.w1.packed.length, i * h);
      assert.equal(x.w1.scales.length, (2 * i * h) / 32);
      assert.equal(countFp4ToFp8Inexact(x.w1) + countFp4ToFp8Inexact(x.w2), 0);
    }
    // The shared expert stays FP8.
    assert.ok(w.shared()?.w1.q instanceof Uint8Array);
  });
});
