/** ExpertParallelMoE.forward's onProgress: what `megamoe check --ranks` and `run --ranks` report on the CPU. */
import assert from "node:assert/strict";
import { test } from "node:test";
import { PRESETS } from "../../src/config/config.js";
import { ExpertParallelMoE, splitAmongRanks } from "../../src/parallel/expert-parallel.js";
import { randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";

const tiny = PRESETS.tiny!;
const weights = new GeneratedWeights(tiny, 7);

test("on the CPU, onProgress counts each rank's routed and shared pass, up to the total", () => {
  const tokens = 8;
  const x = generateActivations(7, tokens, tiny.hidden);
  const routing = randomRouting(7, tokens, tiny);
  const inputs = splitAmongRanks(x, tokens, routing, tiny.hidden, tiny.topK, 4);
  const ep = new ExpertParallelMoE(weights, { ranks: 4 });
  const calls: [number, number][] = [];
  const withProgress = ep.forward(inputs, { onProgress: (d, t) => calls.push([d, t]) }).out;
  const total = calls[0]![1];
  const receiving = ep.plan(inputs).received.filter((rows) => rows.count > 0).length;
  assert.equal(total, receiving + 4, "routed passes of ranks that received rows, and 4 shared passes");
  assert.deepEqual(
    calls,
    Array.from({ length: total }, (_, i) => [i + 1, total]),
  );
  assert.deepEqual(withProgress, ep.forward(inputs).out, "the same output without it");
});

test("onProgress must be a function", () => {
  const ep = new ExpertParallelMoE(weights, { ranks: 2 });
  assert.throws(
    () => ep.forward([], { onProgress: 1 as never }),
    /ExpertParallelMoE forward options\.onProgress must be a function, got number 1/,
  );
});
