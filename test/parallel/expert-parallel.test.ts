/**
 * Expert parallelism on the CPU: the dispatch plan's bookkeeping (every routed slot reaches the rank of
 * its expert exactly once, as that rank's local id, in source-then-token order), the combine's
 * definition, and the whole expert-parallel layer against the one-device reference for 1, 2, 4 and 8
 * ranks, with the edge cases (a rank that receives nothing, masked tokens, one token, a rank without
 * tokens) and the input errors.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { type MoEConfig, PRESETS } from "../../src/config/config.js";
import { InputError, MoELayer } from "../../src/layer.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { type DispatchPlan, planDispatch, type RankRouting, sentRows } from "../../src/parallel/dispatch.js";
import { combineRankOutputs, ExpertParallelMoE, type RankInput } from "../../src/parallel/expert-parallel.js";
import { calcDiff, relativeError } from "../../src/reference/metrics.js";
import { randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("expert-parallel");
const tiny: MoEConfig = { ...PRESETS.tiny!, maxTokens: 64 };

function rankInputs(config: MoEConfig, tokens: readonly number[], base: number): RankInput[] {
  return tokens.map((t, s) => {
    const routing = randomRouting(base + 17 * s, t, config, { maskedTokens: t > 3 ? [1] : [] });
    return { x: generateActivations(base + 31 * s, t, config.hidden), tokens: t, ...routing };
  });
}

/** sentRows(plan, s) against the slots: per receiver, the tokens with a row there, in order, on consecutive rows. */
function checkSentRows(plan: DispatchPlan, s: number, tokens: number): void {
  const sent = sentRows(plan, s);
  let at = 0;
  for (let d = 0; d < plan.ranks; d++) {
    const slot = plan.slot[s]![d]!;
    const mine = Array.from({ length: tokens }, (_, t) => t).filter((t) => slot[t]! >= 0);
    const run = sent.runs.find((x) => x.rank === d);
    if (mine.length === 0) {
      assert.equal(run, undefined, `rank ${s} has no rows for rank ${d}`);
      continue;
    }
    assert.ok(run !== undefined, `rank ${s} sends rows to rank ${d}`);
    assert.deepEqual([run.at, run.rows, run.firstRow], [at, mine.length, slot[mine[0]!]!]);
    assert.deepEqual([...sent.tokens.subarray(at, at + run.rows)], mine);
    assert.deepEqual(
      mine.map((t) => slot[t]),
      mine.map((_, i) => run.firstRow + i),
    );
    at += run.rows;
  }
  assert.equal(sent.tokens.length, at);
}

describe("expert-parallel dispatch plan", () => {
  test("every routed slot reaches its expert's rank once, as a local id, in source-then-token order", () => {
    const config: MoEConfig = { ...tiny, numExperts: 16, topK: 4 };
    for (const ranks of [1, 2, 4, 8, 16]) {
      const routing: RankRouting[] = Array.from({ length: ranks }, (_, s) => {
        const tokens = 1 + ((s * 7 + ranks) % 11);
        return { ...randomRouting(seed + s, tokens, config, { maskedTokens: [0] }), tokens };
      });
      const plan = planDispatch(routing, config.numExperts, config.topK);
      const local = config.numExperts / ranks;
      assert.equal(plan.localExperts, local);
      let slots = 0;
      routing.forEach((r, s) => {
        for (let t = 0; t < r.tokens; t++) {
          for (let d = 0; d < ranks; d++) {
            const row = plan.slot[s]![d]![t]!;
            const mine = [...r.ids.subarray(t * 4, t * 4 + 4)].filter(
              (e) => e >= 0 && Math.floor(e / local) === d,
            );
            if (mine.length === 0) {
              assert.equal(row, -1, `rank ${s} token ${t} sent to rank ${d} without an expert there`);
              continue;
            }
            const into = plan.received[d]!;
            assert.equal(into.sourceRank[row], s);
            assert.equal(into.sourceToken[row], t);
            const k = plan.localTopK;
            assert.equal(k, Math.min(4, local));
            const want = [...r.ids.subarray(t * 4, t * 4 + 4)]
              .map((e, j) => [e, r.weights[t * 4 + j]!] as const)
              .filter(([e]) => e >= 0 && Math.floor(e / local) === d);
            for (let j = 0; j < k; j++) {
              assert.equal(into.ids[row * k + j], j < want.length ? want[j]![0] - d * local : -1);
              assert.equal(into.weights[row * k + j], j < want.length ? want[j]![1] : 0);
            }
            slots += want.length;
          }
        }
      });
      assert.equal(
        slots,
        routing.reduce((n, r) => n + r.ids.filter((e) => e >= 0).length, 0),
      );
      for (const into of plan.received) {
        for (let row = 1; row < into.count; row++) {
          const before = into.sourceRank[row - 1]! * 1e6 + into.sourceToken[row - 1]!;
          assert.ok(before < into.sourceRank[row]! * 1e6 + into.sourceToken[row]!, "rows out of order");
        }
        assert.equal(into.sourceStart[0], 0);
        assert.equal(into.sourceStart[ranks], into.count);
        for (let s = 0; s < ranks; s++) {
          for (let row = into.sourceStart[s]!; row < into.sourceStart[s + 1]!; row++) {
            assert.equal(into.sourceRank[row], s);
          }
        }
      }
      routing.forEach((r, s) => {
        checkSentRows(plan, s, r.tokens);
      });
    }
  });

  test("bad ids and uneven splits are errors", () => {
    const r: RankRouting = { ids: Int32Array.of(0, 8), weights: Float32Array.of(1, 1), tokens: 1 };
    assert.throws(() => planDispatch([r, r], 8, 2), /expert id 8 is outside \[-1, 8\)/);
    assert.throws(() => planDispatch([r, r, r], 8, 2), /cannot be split evenly among 3 ranks/);
    assert.throws(() => planDispatch([{ ...r, tokens: 2 }], 8, 2), /tokens × topK = 2 × 2/);
  });
});

describe("expert-parallel combine", () => {
  test("adds the shared expert, then each rank's partial in rank order, in fp32, rounding once", () => {
    const bits = (v: number[]) => Uint16Array.from(v, f32ToBf16Bits);
    const shared = bits([1, 2]);
    const partials = [bits([0.5, 0.25, 8, 8]), bits([]), bits([2 ** -9, 3])];
    const slot = [Int32Array.of(1), Int32Array.of(-1), Int32Array.of(0)];
    const out = combineRankOutputs(1, 2, shared, partials, slot);
    assert.deepEqual(
      [...out].map(bf16BitsToF32),
      [Math.fround(1 + 8 + 2 ** -9), 2 + 8 + 3].map((v) => bf16BitsToF32(f32ToBf16Bits(v))),
    );
    assert.deepEqual([...combineRankOutputs(1, 2, null, partials, slot)].map(bf16BitsToF32), [8, 11]);
  });
});

describe("expert-parallel layer on the CPU", () => {
  const weights = new GeneratedWeights(tiny, seed);
  const single = new MoELayer(weights);

  for (const ranks of [1, 2, 4, 8]) {
    test(`${ranks} rank(s) agree with the one-device layer up to the partial sums' bf16 rounding`, () => {
      const ep = new ExpertParallelMoE(weights, { ranks });
      const tokens = Array.from({ length: ranks }, (_, s) => [1, 7, 13, 2, 9, 5, 3, 11][s]!);
      const inputs = rankInputs(tiny, tokens, seed + 100 * ranks);
      const { out, stats } = ep.forward(inputs);
      inputs.forEach((input, s) => {
        const ref = single.forward(input.x, input.tokens, {
          routing: { ids: input.ids, weights: input.weights },
        }).out;
        const got = Float32Array.from(out[s]!, bf16BitsToF32);
        const want = Float32Array.from(ref, bf16BitsToF32);
        assert.ok(calcDiff(got, want) < 1e-5, `rank ${s}: calc_diff ${calcDiff(got, want)}`);
        assert.ok(relativeError(got, want) < 5e-3, `rank ${s}: rel ${relativeError(got, want)}`);
      });
      assert.equal(stats.received.length, ranks);
      if (ranks === 1) assert.deepEqual(stats.sent, [0]);
      const plan = ep.plan(inputs);
      const sent = plan.slot.map((bySource, s) =>
        bySource.reduce((n, rows, d) => (d === s ? n : n + rows.filter((r) => r >= 0).length), 0),
      );
      assert.deepEqual(stats.sent, sent);
    });
  }

  test("a rank that receives nothing, masked tokens, one token and a rank without tokens", () => {
    const ep = new ExpertParallelMoE(weights, { ranks: 4 });
    const hot = randomRouting(seed + 1, 6, tiny, {
      hotExpert: 0,
      emptyExperts: [2, 3, 4, 5, 6, 7],
      maskedTokens: [2],
    });
    const one = randomRouting(seed + 2, 1, tiny);
    const inputs: RankInput[] = [
      { x: generateActivations(seed + 3, 6, tiny.hidden), tokens: 6, ...hot },
      { x: generateActivations(seed + 4, 1, tiny.hidden), tokens: 1, ...one },
      { x: new Uint16Array(0), tokens: 0, ids: new Int32Array(0), weights: new Float32Array(0) },
      {
        x: generateActivations(seed + 5, 1, tiny.hidden),
        tokens: 1,
        ids: Int32Array.of(-1, -1),
        weights: Float32Array.of(0, 0),
      },
    ];
    const { out, stats } = ep.forward(inputs);
    assert.equal(out[2]!.length, 0);
    for (const s of [0, 1, 3]) {
      const ref = single.forward(inputs[s]!.x, inputs[s]!.tokens, {
        routing: { ids: inputs[s]!.ids, weights: inputs[s]!.weights },
      }).out;
      assert.ok(
        calcDiff(Float32Array.from(out[s]!, bf16BitsToF32), Float32Array.from(ref, bf16BitsToF32)) < 1e-5,
        `rank ${s}`,
      );
    }
    // Experts 2..7 are empty on rank 0's tokens: ranks 1–3 receive only rank 1's token, if it goes there.
    assert.ok(stats.received[0]! >= 5, `rank 0 received ${stats.received[0]}`);
    // The masked token of rank 3 is its shared expert alone.
    const shared = single.forward(inputs[3]!.x, 1, {
      routing: { ids: inputs[3]!.ids, weights: inputs[3]!.weights },
    }).out;
    assert.deepEqual([...out[3]!], [...shared]);
  });

  test("a rank sent more rows than its layer holds is an input error, before any expert runs", () => {
    // 2 ranks × 65536 tokens pass the layers' cap: every token to rank 0's experts sends it 131072 rows.
    const big = new ExpertParallelMoE(new GeneratedWeights({ ...tiny, maxTokens: 65536 }, seed), {
      ranks: 2,
    });
    const tokens = 65536;
    const x = generateActivations(seed, tokens, tiny.hidden);
    const ids = new Int32Array(tokens * 2).map((_, i) => i % 2);
    const input = { x, tokens, ids, weights: new Float32Array(tokens * 2).fill(1) };
    assert.throws(
      () => big.plan([input, input]),
      /rank 0 would receive 131072 rows, more than its layer's 65536/,
    );
  });

  test("input errors name the rank and the problem", () => {
    const ep = new ExpertParallelMoE(weights, { ranks: 2 });
    const good = rankInputs(tiny, [2, 3], seed);
    assert.throws(() => ep.forward([good[0]!]), InputError);
    assert.throws(
      () => ep.forward([good[0]!, { ...good[1]!, ids: Int32Array.of(0, 8, 1, 2, 3, 4) }]),
      /rank 1 token 0 slot 1: expert id 8/,
    );
    const nan = good[1]!.x.slice();
    nan[5] = 0x7fc0;
    assert.throws(
      () => ep.forward([good[0]!, { ...good[1]!, x: nan }]),
      /rank 1: x holds a non-finite value/,
    );
    assert.throws(
      () => ep.forward([{ ...good[0]!, weights: Float32Array.of(1, Number.NaN, 1, 1) }, good[1]!]),
      /weight NaN/,
    );
    assert.throws(
      () => new ExpertParallelMoE(weights, { ranks: 3 }),
      /8 experts cannot be split evenly among 3 ranks/,
    );
    ep.dispose();
    assert.throws(() => ep.forward(good), /after dispose/);
  });
});
