/**
 * Expert parallelism on a GPU: several ranks' layers on one device (the protocol: dispatch, each rank's
 * layer on the rows it received, combine), with both GPU pipelines, against the same ranks on the CPU
 * (the expert-parallel numerics, parallel/expert-parallel.ts) and the FP64 ideal, each rank judged as one
 * layer is (src/reference/error-bounds.ts); and bit for bit against the same protocol run through the host with the same
 * GPU layers (which checks the gather and combine kernels exactly). Fresh random activations and
 * routing each run; ranks with 0, 1 and odd token counts, masked tokens, a hot expert.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { type MoEConfig, PRESETS } from "../../src/config/config.js";
import type { GpuPipelineKind } from "../../src/layer.js";
import { bf16BitsToF32 } from "../../src/numerics/bf16.js";
import {
  combineRankOutputs,
  ExpertParallelMoE,
  gatherReceived,
  type RankInput,
  sharedExpertAlone,
} from "../../src/parallel/expert-parallel.js";
import { layerErrors } from "../../src/reference/error-bounds.js";
import { idealMoE } from "../../src/reference/moe.js";
import { randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import { describeGpu, testDevice } from "../helpers/gpu.js";
import { checkLayerErrors } from "../helpers/layer-errors.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("expert-parallel on a GPU");

const CASES: { name: string; config: MoEConfig; ranks: number; tokens: number[] }[] = [
  { name: "tiny, 2 ranks", config: { ...PRESETS.tiny!, maxTokens: 64 }, ranks: 2, tokens: [7, 1] },
  {
    name: "tiny, 4 ranks (one without tokens)",
    config: { ...PRESETS.tiny!, maxTokens: 64 },
    ranks: 4,
    tokens: [13, 0, 1, 5],
  },
  {
    name: "32 experts of 512 × 256, top-6, 8 ranks",
    config: {
      ...PRESETS.flash!,
      name: "small",
      numExperts: 32,
      hidden: 512,
      intermediate: 256,
      maxTokens: 96,
    },
    ranks: 8,
    tokens: [33, 1, 0, 64, 7, 2, 96, 17],
  },
];

/** The protocol through the host with `ep`'s own (GPU) layers: what forwardDevice must give bit for bit. */
function throughHost(ep: ExpertParallelMoE, batch: RankInput[]): Uint16Array[] {
  const plan = ep.plan(batch);
  const { hidden } = ep.config;
  const partials = plan.received.map((rows, d) => {
    if (rows.count === 0) return new Uint16Array(0);
    const routing = { ids: rows.ids, weights: rows.weights };
    return ep.layers[d]!.forward(gatherReceived(rows, batch, hidden), rows.count, { routing, shared: false })
      .out;
  });
  return batch.map((input, s) => {
    if (input.tokens === 0) return new Uint16Array(0);
    const shared = sharedExpertAlone(ep.layers[s]!, input);
    return combineRankOutputs(input.tokens, hidden, shared, partials, plan.slot[s]!);
  });
}

function inputs(config: MoEConfig, tokens: number[], base: number): RankInput[] {
  return tokens.map((t, s) => {
    if (t === 0)
      return { x: new Uint16Array(0), tokens: 0, ids: new Int32Array(0), weights: new Float32Array(0) };
    const opts = s === 0 ? { hotExpert: 1 } : t > 4 ? { maskedTokens: [2, t - 1] } : {};
    return {
      x: generateActivations(base + 13 * s, t, config.hidden),
      tokens: t,
      ...randomRouting(base + 7 * s, t, config, opts),
    };
  });
}

describeGpu("expert-parallel layer on a GPU (every rank on device 0)", () => {
  for (const c of CASES) {
    test(c.name, () => {
      const weights = new GeneratedWeights(c.config, seed);
      const cpu = new ExpertParallelMoE(weights, { ranks: c.ranks });
      const batch = inputs(c.config, c.tokens, seed + 1000);
      const want = cpu.forward(batch).out;
      const ideal = batch.map((input) =>
        idealMoE(input.x, input.tokens, { ids: input.ids, weights: input.weights }, weights),
      );
      for (const pipeline of ["fused", "unfused"] as GpuPipelineKind[]) {
        const gpu = new ExpertParallelMoE(weights, {
          ranks: c.ranks,
          backend: "cuda",
          devices: testDevice(),
          pipeline,
        });
        try {
          const { out, stats } = gpu.forward(batch);
          assert.equal(stats.received.reduce((a, b) => a + b, 0) > 0, true);
          const exact = throughHost(gpu, batch);
          out.forEach((o, s) => {
            let differ = 0;
            for (let i = 0; i < o.length; i++) if (o[i] !== exact[s]![i]) differ++;
            assert.equal(
              differ,
              0,
              `${pipeline} rank ${s}: ${differ} elements differ from the host-routed protocol`,
            );
          });
          out.forEach((o, s) => {
            assert.equal(o.length, c.tokens[s]! * c.config.hidden, `rank ${s} output size`);
            if (o.length === 0) return;
            assert.ok(
              Float32Array.from(o, bf16BitsToF32).every(Number.isFinite),
              `${pipeline} rank ${s}: non-finite`,
            );
            const label = `${c.name}, ${pipeline}, rank ${s} (${c.tokens[s]} tokens)`;
            checkLayerErrors(label, layerErrors(o, want[s]!, ideal[s]!), c.tokens[s]!);
          });
        } finally {
          gpu.dispose();
        }
      }
    });
  }
});
