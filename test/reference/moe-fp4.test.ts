/**
 * The CPU reference with FP4 (MXFP4) routed experts: close to the FP64 ideal built from the exact MXFP4
 * values, and bit-identical to the FP8 path when the FP4 weights are also exactly FP8 blocks.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { type MoEConfig, resolveConfig, type ValidatedConfig } from "../../src/config/config.js";
import { bf16BitsToF32 } from "../../src/numerics/bf16.js";
import {
  countFp4ToFp8Inexact,
  FP4_TO_FP8_EXACT_SPREAD,
  mxfp4RowsToFp8,
  mxfp4ToFp8Blocks,
} from "../../src/numerics/fp4.js";
import { calcDiff, relativeError } from "../../src/reference/metrics.js";
import { type Fp4ConversionStats, idealMoE, referenceMoE } from "../../src/reference/moe.js";
import { randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import type {
  BlockQuantized,
  ExpertWeights,
  Fp4ExpertWeights,
  MoEWeightSource,
  Mxfp4Matrix,
} from "../../src/weights/types.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("moe fp4 reference tests");

function tinyFp4(overrides: Partial<MoEConfig> = {}): ValidatedConfig {
  return resolveConfig("tiny", { expertFormat: "fp4", ...overrides });
}

function fp4Expert(w: MoEWeightSource, e: number): Fp4ExpertWeights {
  const x = w.expert(e);
  assert.equal(x.format, "fp4");
  return x as Fp4ExpertWeights;
}

/** A source with the given routed experts and `base`'s shared expert and gate. */
function withExperts<W extends ExpertWeights | Fp4ExpertWeights>(
  base: MoEWeightSource,
  config: ValidatedConfig,
  experts: W[],
): MoEWeightSource {
  return { config, expert: (e) => experts[e], shared: () => base.shared(), gate: () => base.gate() };
}

/**
 * Raises, in every 128×128 block, each row's largest group byte per K block to the block's largest, so
 * that every row of the block gets the same reference exponent (the values change; the test only needs
 * some FP4 weights of that kind). Returns the modified copy.
 */
function alignBlockMax(m: Mxfp4Matrix): Mxfp4Matrix {
  const scales = m.scales.slice();
  const perRow = m.cols / 32;
  for (let br = 0; br < m.rows / 128; br++) {
    for (let kb = 0; kb < m.cols / 128; kb++) {
      let max = 0;
      for (let r = br * 128; r < (br + 1) * 128; r++) {
        for (let g = 0; g < 4; g++) max = Math.max(max, scales[r * perRow + kb * 4 + g]);
      }
      for (let r = br * 128; r < (br + 1) * 128; r++) {
        const at = r * perRow + kb * 4;
        let arg = 0;
        for (let g = 1; g < 4; g++) if (scales[at + g] > scales[at + arg]) arg = g;
        scales[at + arg] = max;
      }
    }
  }
  return { ...m, scales };
}

/** The FP8 block form of an MXFP4 matrix whose rows share each 128×128 block's reference exponent. */
function toFp8Blocks(m: Mxfp4Matrix): BlockQuantized {
  const c = mxfp4RowsToFp8(m);
  assert.equal(c.inexact, 0, "the FP8 blocks must hold the FP4 values exactly");
  const kb = m.cols / 128;
  const scales = new Float32Array((m.rows / 128) * kb);
  for (let br = 0; br < m.rows / 128; br++) {
    for (let b = 0; b < kb; b++) {
      const s = c.scales[br * 128 * kb + b];
      for (let r = br * 128; r < (br + 1) * 128; r++) assert.equal(c.scales[r * kb + b], s);
      scales[br * kb + b] = s;
    }
  }
  return { q: c.q, scales, rows: m.rows, cols: m.cols };
}

describe("reference MoE layer with FP4 experts", () => {
  it("generated FP4 experts convert exactly and the layer is close to the FP64 ideal", () => {
    const config = tinyFp4();
    const w = new GeneratedWeights(config, seed);
    const x = generateActivations(seed + 1, 32, config.hidden);
    const routing = randomRouting(seed + 2, 32, config);
    const stats: Fp4ConversionStats = { inexact: 0, total: 0 };
    const a = referenceMoE(x, 32, routing, w, { fp4Stats: stats });
    assert.deepEqual(a, referenceMoE(x, 32, routing, w), "deterministic");
    assert.ok(stats.total > 0);
    assert.equal(stats.inexact, 0, `${stats.inexact} of ${stats.total} elements not exact`);
    const ideal = idealMoE(x, 32, routing, w);
    const ref = Float64Array.from(a, bf16BitsToF32);
    const rel = relativeError(ref, ideal);
    const diff = calcDiff(ref, ideal);
    console.log(
      `tiny fp4 T=32: ‖ref−ideal‖/‖ideal‖ = ${rel.toExponential(3)}, calc_diff = ${diff.toExponential(3)}`,
    );
    // The FP8 layer's policy (test/reference/moe.test.ts): the ideal uses the same (here MXFP4) weights,
    // so with every block exact the only error left is activation quantization and rounding, as for FP8.
    assert.ok(rel > 0 && rel < 0.08, `relative error ${rel}`);
    assert.ok(diff < 2e-3, `calc_diff ${diff}`);
  });

  it("differs from the FP8 experts of the same seed by FP4's own quantization error only", () => {
    const fp4 = new GeneratedWeights(tinyFp4(), seed + 3);
    const fp8 = new GeneratedWeights(resolveConfig("tiny"), seed + 3);
    const x = generateActivations(seed + 4, 16, fp4.config.hidden);
    const routing = randomRouting(seed + 5, 16, fp4.config);
    const a = idealMoE(x, 16, routing, fp4);
    const b = idealMoE(x, 16, routing, fp8);
    const rel = relativeError(a, b);
    console.log(`tiny: ‖ideal(fp4) − ideal(fp8)‖/‖ideal(fp8)‖ = ${rel.toExponential(3)}`);
    // e2m1 has one mantissa bit: a few times FP8's error, far from unrelated weights (≈ 1.4).
    assert.ok(rel > 0 && rel < 0.3, `relative error ${rel}`);
  });

  it("equals the FP8 path bit for bit when the FP4 weights are exactly FP8 blocks", () => {
    for (const overrides of [{}, { scaleFormat: "ue8m0" as const, swigluClamp: null }]) {
      const config = tinyFp4(overrides);
      const base = new GeneratedWeights(config, seed + 6);
      const fp4Experts: Fp4ExpertWeights[] = [];
      const fp8Experts: ExpertWeights[] = [];
      for (let e = 0; e < config.numExperts; e++) {
        const g = fp4Expert(base, e);
        const w1 = alignBlockMax(g.w1);
        const w2 = alignBlockMax(g.w2);
        for (const m of [w1, w2]) {
          // The precondition of exactness: no group further than 14 below its block's largest.
          for (let i = 0; i < m.scales.length; i += 4) {
            const s = m.scales.subarray(i, i + 4);
            assert.ok(Math.max(...s) - Math.min(...s) <= FP4_TO_FP8_EXACT_SPREAD);
          }
        }
        fp4Experts.push({ format: "fp4", w1, w2 });
        fp8Experts.push({ w1: toFp8Blocks(w1), w2: toFp8Blocks(w2) });
      }
      const srcFp4 = withExperts(base, config, fp4Experts);
      const srcFp8 = withExperts(base, resolveConfig("tiny", overrides), fp8Experts);
      const x = generateActivations(seed + 7, 11, config.hidden);
      const routing = randomRouting(seed + 8, 11, config, { emptyExperts: [1] });
      assert.deepEqual(referenceMoE(x, 11, routing, srcFp4), referenceMoE(x, 11, routing, srcFp8));
      // The ideals agree too: the same weight values, exactly.
      assert.deepEqual(idealMoE(x, 11, routing, srcFp4), idealMoE(x, 11, routing, srcFp8));
    }
  });

  it("equals the FP8 path on DeepSeek's 128×128 cast (convert.py)", () => {
    // Unlike the test above, the rows of a 128-row block have different largest bytes (each row's bytes
    // are lowered by r mod 5); every row takes its block's reference, as the cast does. Expert 1's W2
    // has one byte raised by 20, so the cast of that block rounds: the bits still agree.
    const rowShifted = (m: Mxfp4Matrix, raise = false): Mxfp4Matrix => {
      const perRow = m.cols / 32;
      const scales = m.scales.map((b, i) => b - (Math.floor(i / perRow) % 5));
      if (raise) scales[0] = Math.min(254, scales[0] + 20);
      return { ...m, scales };
    };
    for (const overrides of [{}, { scaleFormat: "ue8m0" as const }]) {
      const config = tinyFp4(overrides);
      const base = new GeneratedWeights(config, seed + 12);
      const fp4Experts: Fp4ExpertWeights[] = [];
      const fp8Experts: ExpertWeights[] = [];
      for (let e = 0; e < config.numExperts; e++) {
        const g = fp4Expert(base, e);
        const w1 = rowShifted(g.w1);
        const w2 = rowShifted(g.w2, e === 1);
        const cast = (m: Mxfp4Matrix): BlockQuantized => {
          const c = mxfp4ToFp8Blocks(m);
          assert.equal(c.inexact > 0, m === w2 && e === 1);
          return { q: c.q, scales: c.scales, rows: m.rows, cols: m.cols };
        };
        assert.notEqual(w1.scales[0], w1.scales[w1.cols / 32], "rows 0 and 1 have different bytes");
        assert.deepEqual(mxfp4RowsToFp8(w1).q, mxfp4ToFp8Blocks(w1).q, "the cast's codes");
        fp4Experts.push({ format: "fp4", w1, w2 });
        fp8Experts.push({ w1: cast(w1), w2: cast(w2) });
      }
      const srcFp4 = withExperts(base, config, fp4Experts);
      const srcFp8 = withExperts(base, resolveConfig("tiny", overrides), fp8Experts);
      const x = generateActivations(seed + 13, 9, config.hidden);
      const routing = randomRouting(seed + 14, 9, config, { hotExpert: 1 });
      assert.deepEqual(referenceMoE(x, 9, routing, srcFp4), referenceMoE(x, 9, routing, srcFp8));
    }
  });

  it("counts inexact elements when a block's spread exceeds 14", () => {
    const config = tinyFp4();
    const base = new GeneratedWeights(config, seed + 9);
    const g = fp4Expert(base, 0);
    const w1 = { ...g.w1, scales: g.w1.scales.slice() };
    // Group 0 of row 0 now 20+ above the rest: its block (rows 0..127, K block 0) takes that reference,
    // under which the other groups' small codes round.
    w1.scales[0] = Math.min(254, w1.scales[1] + 20);
    const experts = Array.from({ length: config.numExperts }, (_, e) =>
      e === 0 ? { ...g, w1 } : fp4Expert(base, e),
    );
    const src = withExperts(base, config, experts);
    const x = generateActivations(seed + 10, 4, config.hidden);
    const routing = randomRouting(seed + 11, 4, config, { hotExpert: 0 });
    const stats: Fp4ConversionStats = { inexact: 0, total: 0 };
    referenceMoE(x, 4, routing, src, { fp4Stats: stats, shared: false });
    assert.ok(stats.inexact > 0, `${stats.inexact} of ${stats.total}`);
    assert.equal(stats.inexact, countFp4ToFp8Inexact(w1));
    assert.equal(stats.inexact, mxfp4RowsToFp8(w1, 0, 128).inexact, "all in the raised block");
  });
});
