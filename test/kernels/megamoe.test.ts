/**
 * The fused kernel's host-side facts that need no GPU: which shapes it takes, its shared-memory layout
 * and stage count on every preset, the specializations CI compiles, and the layer's pipeline choice.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { PRESETS, resolveConfig } from "../../src/config/config.js";
import { fusedLayerProblem } from "../../src/kernels/megamoe/megamoe.js";
import {
  fusedDefines,
  fusedSharedBytes,
  fusedStages,
  variants,
} from "../../src/kernels/megamoe/megamoe.variants.js";
import { InputError, MoELayer } from "../../src/layer.js";
import { GeneratedWeights } from "../../src/weights/generate.js";

const OPTIN = 232_448;

describe("fused MoE kernel: host-side facts", () => {
  test("every preset fits 227 KB with at least 3 stages, and one more stage would not fit", () => {
    for (const preset of Object.values(PRESETS)) {
      const stages = fusedStages(preset);
      assert.ok(stages >= 3, `${preset.name}: ${stages} stages`);
      assert.ok(fusedSharedBytes(preset, stages) <= OPTIN, preset.name);
      if (stages < 8)
        assert.ok(fusedSharedBytes(preset, stages + 1) > OPTIN, `${preset.name}: could use more`);
      assert.equal(fusedLayerProblem(preset), null, preset.name);
    }
  });

  test("shapes it cannot run are named; a CPU layer has no GPU pipeline to choose", () => {
    const narrow = resolveConfig("tiny", { hidden: 384 });
    assert.match(String(fusedLayerProblem(narrow)), /hidden \(384\) must be a multiple of 256/);
    const cpu = new MoELayer(new GeneratedWeights(narrow, 1));
    assert.equal(cpu.pipeline, null);
    assert.throws(
      () =>
        new MoELayer(new GeneratedWeights(resolveConfig("tiny"), 1), { backend: "cpu", pipeline: "fused" }),
      (e: unknown) => e instanceof InputError && /pipeline applies to the "cuda" backend/.test(e.message),
    );
  });

  test("CI compiles one specialization per preset and scale format, spills forbidden", () => {
    assert.equal(variants.length, 2 * Object.keys(PRESETS).length);
    assert.ok(variants.every((v) => v.noSpill));
    const flash = fusedDefines(resolveConfig("flash"));
    assert.deepEqual(
      { ...flash },
      {
        HIDDEN: 4096,
        INTER: 2048,
        SHARED_INTER: 2048,
        NUM_EXPERTS: 256,
        TOP_K: 6,
        NUM_STAGES: 4,
        SCALE_UE8M0: 0,
      },
    );
  });
});
