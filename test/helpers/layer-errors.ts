/**
 * Asserting the layer's error policy (src/reference/error-bounds.ts, shared with `megamoe check`) in
 * every test that runs a whole layer on the GPU (one layer, or the ranks of an expert-parallel one).
 */
import assert from "node:assert/strict";
import { judgeLayerErrors, type LayerErrors } from "../../src/reference/error-bounds.js";

/**
 * Prints the errors and asserts the policy's bounds for an output of `tokens` tokens: near the
 * reference, and no further from the ideal than the reference is.
 */
export function checkLayerErrors(label: string, e: LayerErrors, tokens: number): void {
  console.log(
    `  ${label}: vs reference ‖Δ‖/‖ref‖ ${e.relRef.toExponential(2)}, calc_diff ${e.diffRef.toExponential(2)}; ` +
      `vs FP64 ideal ${e.relIdeal.toExponential(2)}, calc_diff ${e.diffIdeal.toExponential(2)} ` +
      `(reference vs ideal ${e.refRelIdeal.toExponential(2)})`,
  );
  const { vsReference, vsIdeal } = judgeLayerErrors(e, tokens);
  assert.ok(vsReference.pass, `${label}: vs reference: ${vsReference.failures.join("; ")}`);
  assert.ok(
    vsIdeal.pass,
    `${label}: vs the FP64 ideal (reference's ${e.refRelIdeal}): ${vsIdeal.failures.join("; ")}`,
  );
}
