import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { expertWeightBytes, layerFloor } from "../../src/bench/layer.js";
import { resolveConfig } from "../../src/config/config.js";

describe("layer floor", () => {
  it("counts each touched expert's weights once, the shared expert, and the activations (tiny, T=2)", () => {
    const c = resolveConfig("tiny"); // E=8 H=256 IH=128 top-2
    const routing = { ids: Int32Array.from([3, 5, 3, -1]), weights: Float32Array.from([0.5, 0.5, 1, 0]) };
    const f = layerFloor(c, 2, routing, true, 4, 1500);
    const expert = 3 * 128 * 256 + ((3 * 128 * 256) / 128 ** 2) * 4; // fp8 + fp32 block scales
    assert.equal(expertWeightBytes(256, 128), expert);
    assert.equal(f.expertsTouched, 2);
    assert.equal(f.bytes, 2 * expert + expert + 2 * 2 * 256 * 2);
    assert.equal(f.flops, 2 * 3 * 3 * 128 * 256 + 2 * 2 * 3 * 128 * 256); // 3 routed rows + 2 shared rows
    assert.equal(f.floorUs, Math.max(f.bytes / 4e12, f.flops / 1.5e15) * 1e6);
  });

  it("flash at T=8192 with every expert touched is compute-bound", () => {
    const c = resolveConfig("flash");
    const ids = Int32Array.from({ length: 8192 * 6 }, (_, i) => (i * 7) % 256);
    const f = layerFloor(
      c,
      8192,
      { ids, weights: new Float32Array(ids.length).fill(1 / 6) },
      true,
      4.25,
      1500,
    );
    assert.equal(f.expertsTouched, 256);
    assert.equal(f.flops, 2 * 8192 * 6 * 3 * 2048 * 4096 + 2 * 8192 * 3 * 2048 * 4096);
    assert.ok(f.flops / 1.5e15 > f.bytes / 4.25e12);
    assert.ok(Math.abs(f.floorUs - (f.flops / 1.5e15) * 1e6) < 1e-6);
  });
});
