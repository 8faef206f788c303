/**
 * A DeepSeek-V4-layout checkpoint on the GPU: every block of the tiny checkpoint (hash and score routed,
 * FP8 and FP4 experts, one layer split across shards) run by the cuda backend from the files equals the
 * same weights run from memory, bit for bit, on every GPU pipeline the layer takes.
 *
 * GPU tests skip with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, test } from "node:test";
import { expertFormatOf } from "../../src/config/config.js";
import { type GpuPipelineKind, MoELayer } from "../../src/layer.js";
import { Checkpoint, generateTokenIds, openCheckpoint } from "../../src/weights/checkpoint.js";
import { generateActivations } from "../../src/weights/generate.js";
import type { MoEWeightSource } from "../../src/weights/types.js";
import { describeGpu, testDevice } from "../helpers/gpu.js";
import { testSeed } from "../helpers/random.js";
import { VOCAB, writeTinyV4 } from "../helpers/v4-checkpoint.js";

const seed = testSeed("V4 checkpoint GPU tests");
const root = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-v4-gpu-"));
after(() => fs.rmSync(root, { recursive: true, force: true }));

function run(source: MoEWeightSource, pipeline: GpuPipelineKind, tokens: number) {
  const layer = new MoELayer(source, { backend: "cuda", device: testDevice(), pipeline });
  try {
    const x = generateActivations(seed + tokens, tokens, source.config.hidden);
    const tokenIds = source.config.router.hashRouted ? generateTokenIds(seed, tokens, VOCAB) : undefined;
    return layer.forward(x, tokens, tokenIds === undefined ? {} : { tokenIds });
  } finally {
    layer.dispose();
  }
}

describeGpu("V4 checkpoint layers on a GPU", () => {
  test("each block from the files equals the same weights from memory, bit for bit", () => {
    const dir = path.join(root, "tiny");
    const layers = writeTinyV4(dir, seed);
    const checkpoint = openCheckpoint(dir);
    assert.ok(checkpoint instanceof Checkpoint, "a V4 directory opens as a Checkpoint");
    for (const { block, source } of layers) {
      const fromFiles = checkpoint.byName(block);
      const pipelines: GpuPipelineKind[] =
        expertFormatOf(source.config) === "fp4" ? ["unfused"] : ["fused", "unfused"];
      for (const pipeline of pipelines) {
        for (const tokens of [1, 6, 33]) {
          const a = run(fromFiles, pipeline, tokens);
          const b = run(source, pipeline, tokens);
          const label = `${block} (${expertFormatOf(source.config)}) ${pipeline} T=${tokens}`;
          assert.deepEqual(a.routing, b.routing, `${label}: routing`);
          assert.deepEqual(a.out, b.out, `${label}: output`);
          assert.ok(
            a.out.some((v) => v !== 0),
            `${label}: a non-zero output`,
          );
        }
      }
    }
  });
});
