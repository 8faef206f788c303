/**
 * DeviceMoEWeights' sizes without a GPU: `bytesFor` adds up exactly the tensors it allocates, for FP8
 * and FP4 (MXFP4) routed experts (the GPU test test/gpu/weightgen.test.ts checks the allocation itself).
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { type MoEConfig, PRESETS, sharedIntermediate } from "../../src/config/config.js";
import { DeviceMoEWeights } from "../../src/kernels/device-weights.js";

/** The layer's tensors as docs/weights.md lists them, in bytes. */
function expected(c: MoEConfig): number {
  const { numExperts: E, hidden: H, intermediate: I } = c;
  const fp8Pair = (experts: number, inter: number) =>
    experts * (3 * inter * H + (4 * 3 * inter * H) / 128 ** 2);
  const routed =
    c.expertFormat === "fp4"
      ? E *
        ((2 * I * H) / 2 +
          (H / 128) * 2 * I * 4 +
          (H * I) / 2 +
          (I / 128) * H * 4 +
          (4 * 3 * I * H) / 128 ** 2)
      : fp8Pair(E, I);
  const shared = c.numShared > 0 ? fp8Pair(1, sharedIntermediate(c)) : 0;
  return routed + shared + 2 * E * H + (c.router.correctionBias ? 4 * E : 0);
}

describe("DeviceMoEWeights.bytesFor", () => {
  for (const name of Object.keys(PRESETS)) {
    for (const format of ["fp8", "fp4"] as const) {
      it(`${name} with ${format} experts`, () => {
        const c: MoEConfig = { ...PRESETS[name]!, expertFormat: format };
        assert.equal(DeviceMoEWeights.bytesFor(c), expected(c));
      });
    }
  }

  it("a flash layer: ~6.4 GB with FP8 experts, ~3.4 GB with FP4 (the shared expert stays FP8)", () => {
    const fp8 = DeviceMoEWeights.bytesFor(PRESETS.flash!);
    const fp4 = DeviceMoEWeights.bytesFor({ ...PRESETS.flash!, expertFormat: "fp4" });
    assert.equal(fp8, 6_471_293_952);
    assert.equal(fp4, 3_451_395_072);
  });
});
