/**
 * The in-kernel expert-parallel layer (src/parallel/fused-expert-parallel.ts, megamoe_ep.cuh) on one GPU:
 * R = 2, 4, 8 virtual ranks, each an EP launch on its own stream. Outputs bit for bit against
 * ExpertParallelMoE with the fused pipeline on the same GPU (the host-planned protocol, whose numerics
 * define expert parallelism), with and without the shared expert, over the routing edge cases of
 * test/parallel/ep-protocol.test.ts; every rank's count phase and pool order against the CPU model
 * (runProtocol); FP4 routed experts at 4 ranks in both conversion paths and expanded; forwards back to back with no host sync between them; and last (the trap ends the
 * context) a rank left out of a forward, named in every other rank's error within seconds.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { DeviceTensor } from "../../src/cuda/index.js";
import { ExpertParallelMoE } from "../../src/parallel/expert-parallel.js";
import { FusedExpertParallel, FusedExpertParallelError } from "../../src/parallel/fused-expert-parallel.js";
import { GeneratedWeights } from "../../src/weights/generate.js";
import { epRoutingCases, runProtocol } from "../helpers/ep-protocol.js";
import { EP_GPU_CONFIG as config, differing, EP_GPU_MAX_TOKENS as MAX_TOKENS } from "../helpers/fused-ep.js";
import { describeGpu, testDevice } from "../helpers/gpu.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("fused expert parallel on a GPU");
const weights = new GeneratedWeights(config, seed);
const { hidden: H, numExperts: E } = config;

/** test/parallel/ep-protocol.test.ts's routing edge cases, at this file's shape. */
const CASES = epRoutingCases(config, MAX_TOKENS);

describeGpu("in-kernel expert parallelism on one GPU (virtual ranks)", () => {
  for (const ranks of [2, 4, 8]) {
    test(`${ranks} ranks: the host plan's outputs bit for bit, the model's counts and pool order`, () => {
      const device = testDevice();
      const host = new ExpertParallelMoE(weights, {
        ranks,
        backend: "cuda",
        devices: device,
        pipeline: "fused",
      });
      const ep = new FusedExpertParallel(weights, { ranks, devices: device, maxTokens: MAX_TOKENS });
      const L = E / ranks;
      try {
        for (const [name, make] of Object.entries(CASES)) {
          const inputs = make(ranks, seed + 1000 * ranks);
          for (const shared of [true, false]) {
            const label = `${name}, shared ${shared}`;
            const want = host.forward(inputs, { shared }).out;
            const got = ep.forward(inputs, { shared }).out;
            got.forEach((o, s) => {
              assert.equal(differing(o, want[s]!), 0, `${label}: rank ${s}'s output vs ExpertParallelMoE`);
            });
            const model = runProtocol(weights, [inputs], { seed, shared }).forwards[0]!;
            const states = ep.kernels.map((k, d) =>
              k.readEpState(inputs[d]!.tokens, (model[d]!.poolSource?.length ?? 0) / 2),
            );
            model.forEach((m, d) => {
              // counts[s·L + e] on owner d: source s's count phase for global expert d·L + e.
              const counts = Uint32Array.from({ length: ranks * L }, (_, i) => {
                const s = Math.floor(i / L);
                return states[s]!.slotsPerExpert[d * L + (i % L)]!;
              });
              assert.deepEqual([...counts], [...m.counts!], `${label}: rank ${d}'s counts`);
              assert.deepEqual(
                [...states[d]!.poolSource],
                [...m.poolSource!],
                `${label}: rank ${d}'s pool order`,
              );
            });
          }
        }
      } finally {
        ep.dispose();
        host.dispose();
      }
    });
  }

  // Block M 16 and 32 convert in the math threads, 64 and 128 in the converter warps or, expanded (128),
  // in the producer warpgroup's workers before the tiles need them.
  const fp4Cases = [
    ["auto", "auto"],
    [64, "auto"],
    [128, "auto"],
    [128, true],
  ] as const;
  for (const [blockM, fp4Expand] of fp4Cases) {
    const what = `block M ${blockM}${fp4Expand === true ? ", expanded" : ""}`;
    test(`FP4 routed experts, 4 ranks, ${what}: the host plan's outputs bit for bit`, () => {
      const ranks = 4;
      const device = testDevice();
      const fp4 = new GeneratedWeights({ ...config, expertFormat: "fp4" }, seed + 5);
      const host = new ExpertParallelMoE(fp4, { ranks, backend: "cuda", devices: device, pipeline: "fused" });
      const ep = new FusedExpertParallel(fp4, {
        ranks,
        devices: device,
        maxTokens: MAX_TOKENS,
        blockM,
        fp4Expand,
      });
      try {
        for (const name of [
          "random routing, uneven tokens per rank, a rank without tokens",
          `a hot expert, T = 1 and ${MAX_TOKENS}`,
        ]) {
          const inputs = CASES[name]!(ranks, seed + 3);
          for (const shared of [true, false]) {
            const want = host.forward(inputs, { shared }).out;
            const got = ep.forward(inputs, { shared }).out;
            got.forEach((o, s) => {
              assert.equal(differing(o, want[s]!), 0, `${name}, shared ${shared}: rank ${s}'s output`);
            });
          }
        }
      } finally {
        ep.dispose();
        host.dispose();
      }
    });
  }

  test("forwards back to back without a host sync: each the host plan's", () => {
    const ranks = 4;
    const device = testDevice();
    const host = new ExpertParallelMoE(weights, {
      ranks,
      backend: "cuda",
      devices: device,
      pipeline: "fused",
    });
    const ep = new FusedExpertParallel(weights, { ranks, devices: device, maxTokens: MAX_TOKENS });
    const owned: DeviceTensor[] = [];
    // Outputs start as NaN bits (0xffff), so a row no forward writes cannot match the host plan's.
    const upload = <D extends "bf16" | "int32" | "fp32">(dtype: D, shape: number[], data?: never) => {
      const t = DeviceTensor.empty(device, dtype, [Math.max(1, shape[0]!), shape[1]!]);
      owned.push(t);
      const v = t.view(shape);
      if (shape[0]! > 0) v.copyFromHost(data ?? (new Uint16Array(v.numel).fill(0xffff) as never));
      return v;
    };
    try {
      const names = Object.keys(CASES);
      const batches = [0, 1, 2, 3, 4].map((f) => CASES[names[f % names.length]!]!(ranks, seed + 77 * f));
      const outs = batches.map((inputs) =>
        inputs.map((i) => ({
          x: upload("bf16", [i.tokens, H], i.x as never),
          ids: upload("int32", [i.tokens, config.topK], i.ids as never),
          weights: upload("fp32", [i.tokens, config.topK], i.weights as never),
          out: upload("bf16", [i.tokens, H]),
          tokens: i.tokens,
        })),
      );
      device.synchronize();
      for (const o of outs) ep.forwardDevice(o);
      ep.synchronize();
      batches.forEach((inputs, f) => {
        const want = host.forward(inputs).out;
        outs[f]!.forEach((o, s) => {
          const got = o.tokens === 0 ? new Uint16Array(0) : (o.out.toHost() as Uint16Array);
          assert.equal(differing(got, want[s]!), 0, `forward ${f}, rank ${s}`);
        });
      });
    } finally {
      for (const t of owned) t.dispose();
      ep.dispose();
      host.dispose();
    }
  });

  // Last: the watchdog's trap loses the CUDA context for every later test in this process.
  test("a rank left out of a forward is named in every other rank's error within seconds", () => {
    const ranks = 4;
    const ep = new FusedExpertParallel(weights, { ranks, devices: testDevice(), maxTokens: MAX_TOKENS });
    const inputs = CASES["random routing, uneven tokens per rank, a rank without tokens"]!(ranks, seed);
    const started = performance.now();
    let err: unknown;
    try {
      ep.forward(inputs, { skipRank: 2 });
    } catch (e) {
      err = e;
    }
    const seconds = (performance.now() - started) / 1000;
    assert.ok(
      err instanceof FusedExpertParallelError,
      `expected a FusedExpertParallelError, got ${String(err)}`,
    );
    assert.ok(seconds < 10, `the error came after ${seconds.toFixed(1)} s`);
    for (const r of [0, 1, 3]) {
      assert.deepEqual(err.records.get(r)?.blamed, [2], `rank ${r} blames rank 2: ${err.message}`);
    }
    assert.equal(err.records.has(2), false, "the skipped rank never ran");
    try {
      ep.dispose();
    } catch {
      // the context is gone: freeing fails; nothing else runs in this process
    }
  });
});
