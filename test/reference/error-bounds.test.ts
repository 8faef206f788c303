import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { f32ToBf16Bits } from "../../src/numerics/bf16.js";
import {
  boundsFp8VsIdeal,
  boundsVsIdeal,
  boundsVsReference,
  compareOutputs,
  FEW_TOKENS,
  judge,
  judgeLayerErrors,
  layerErrors,
  MAX_DIFF_VS_REFERENCE,
  MAX_DIFF_VS_REFERENCE_FEW_TOKENS,
  MAX_REL_VS_REFERENCE,
  MAX_REL_VS_REFERENCE_FEW_TOKENS,
  REF_DISTANCE_SHARE,
} from "../../src/reference/error-bounds.js";

describe("layer error policy", () => {
  it("widens the bounds against the reference below FEW_TOKENS tokens", () => {
    const few = boundsVsReference(FEW_TOKENS - 1, 0);
    assert.equal(few.relError, MAX_REL_VS_REFERENCE_FEW_TOKENS);
    // 0.75 · 0.02² rounds a hair above 3e-4: the same bound within rounding
    assert.ok(Math.abs(few.calcDiff - MAX_DIFF_VS_REFERENCE_FEW_TOKENS) < 1e-15, String(few.calcDiff));
    assert.deepEqual(boundsVsReference(FEW_TOKENS, 0), {
      relError: MAX_REL_VS_REFERENCE,
      calcDiff: MAX_DIFF_VS_REFERENCE,
    });
  });

  it("admits three quarters of the reference's own distance to the ideal, and 0.75 · bound² of calc_diff", () => {
    const b = boundsVsReference(100, 0.04);
    assert.equal(REF_DISTANCE_SHARE, 0.75);
    assert.equal(b.relError, 0.03);
    assert.ok(Math.abs(b.calcDiff - 0.75 * 0.03 ** 2) < 1e-15);
    assert.equal(boundsVsIdeal(0.04).relError, 1.25 * 0.04);
    assert.equal(boundsVsIdeal(0.04).calcDiff, undefined);
  });

  it("judges a figure at its bound as a pass and above it as a failure naming both", () => {
    assert.equal(judge(0.01, 1e-4, { relError: 0.01, calcDiff: 1e-4 }).pass, true);
    const v = judge(0.02, 1e-5, { relError: 0.01, calcDiff: 1e-4 });
    assert.equal(v.pass, false);
    assert.deepEqual(v.failures, ["‖a − b‖/‖b‖ 0.02 exceeds 0.01"]);
  });

  it("fails a non-finite figure even where it is not bounded", () => {
    const v = judge(Number.NaN, Number.POSITIVE_INFINITY, {});
    assert.equal(v.pass, false);
    assert.deepEqual(v.failures, ["‖a − b‖/‖b‖ is NaN", "calc_diff is Infinity"]);
  });

  it("passes two all-zero outputs (a masked token without the shared expert)", () => {
    const zeros = new Float64Array(16);
    assert.equal(compareOutputs(zeros, zeros, boundsFp8VsIdeal()).pass, true);
  });

  it("judges a layer output against the reference and the ideal", () => {
    const ideal = Float64Array.from({ length: 256 }, (_, i) => Math.sin(i + 1));
    const ref = Uint16Array.from(ideal, (v) => f32ToBf16Bits(v * 1.01));
    const same = judgeLayerErrors(layerErrors(ref, ref, ideal), 16);
    assert.equal(same.vsReference.pass, true);
    assert.equal(same.vsIdeal.pass, true);
    // 5 % off the ideal while the reference is 1 % off: near neither.
    const far = Uint16Array.from(ideal, (v) => f32ToBf16Bits(v * 1.05));
    const e = layerErrors(far, ref, ideal);
    const verdict = judgeLayerErrors(e, 16);
    assert.equal(verdict.vsReference.pass, false);
    assert.equal(verdict.vsIdeal.pass, false);
    assert.match(verdict.vsIdeal.failures[0]!, /exceeds/);
  });
});
