/**
 * The in-kernel expert-parallel protocol's CPU model (test/helpers/ep-protocol.ts) against the
 * host-planned ExpertParallelMoE on the CPU, whose numerics define expert parallelism
 * (src/parallel/expert-parallel.ts: out = bf16(S + Σ_d P_d), rank order, P_d the rank's layer on the
 * rows it received). For 1, 2, 4 and 8 ranks and routings with their edge cases, in several random
 * interleavings: every rank's output equal bit for bit, every owner's counts and pool order the ones the
 * host plan's row order implies (so the same in every interleaving), the bytes that cross ranks equal
 * to design.md's formulas; forwards run back to back without a host sync; a dead rank makes every live
 * rank's bounded wait name it. Each deliberate break of an order (ProtocolMutation) is shown caught.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { type MoEConfig, PRESETS, QUANT_BLOCK } from "../../src/config/config.js";
import { ExpertParallelMoE, type RankInput } from "../../src/parallel/expert-parallel.js";
import { GeneratedWeights } from "../../src/weights/generate.js";
import {
  epRoutingCases,
  type ProtocolMutation,
  type ProtocolRun,
  protocolLayout,
  runProtocol,
} from "../helpers/ep-protocol.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("ep-protocol");
const config: MoEConfig = { ...PRESETS.tiny!, numExperts: 16, topK: 4, maxTokens: 64 };
const weights = new GeneratedWeights(config, seed);
const { hidden: H, topK: k, numExperts: E } = config;
const INTERLEAVINGS = 3;

const CASES = epRoutingCases(config, 5);

/** What the host plan implies for one forward: outputs, every owner's counts and pool order, traffic. */
interface Expected {
  out: Uint16Array[];
  counts: Uint32Array[];
  poolSource: Int32Array[];
  traffic: { rows: number; results: number; descriptors: number };
}

function expected(inputs: RankInput[], shared: boolean): Expected {
  const ranks = inputs.length;
  const ep = new ExpertParallelMoE(weights, { ranks });
  const { out, stats } = ep.forward(inputs, { shared });
  const plan = ep.plan(inputs);
  const L = E / ranks;
  const counts = plan.received.map(() => new Uint32Array(ranks * L));
  let remoteSlots = 0;
  inputs.forEach((inp, s) => {
    for (const e of inp.ids) {
      if (e < 0) continue;
      const d = Math.floor(e / L);
      counts[d]![s * L + (e % L)]! += 1;
      if (d !== s) remoteSlots++;
    }
  });
  // Pool order: per local expert, the plan's received rows in order (source rank, then token), each
  // at its slot of that expert; then the owner's own tokens for the shared expert.
  const poolSource = plan.received.map((rows, d) => {
    const pool: number[] = [];
    for (let e = 0; e < L; e++) {
      for (let r = 0; r < rows.count; r++) {
        const s = rows.sourceRank[r]!;
        const t = rows.sourceToken[r]!;
        const j = inputs[s]!.ids.subarray(t * k, (t + 1) * k).indexOf(d * L + e);
        if (j >= 0) pool.push(s, t * k + j);
      }
    }
    if (shared) for (let t = 0; t < inputs[d]!.tokens; t++) pool.push(-1, t);
    return Int32Array.from(pool);
  });
  const sent = stats.sent.reduce((n, v) => n + v, 0);
  const W = 1 + 2 * Math.min(k, L);
  return {
    out,
    counts,
    poolSource,
    traffic: {
      rows: sent * (H + (4 * H) / QUANT_BLOCK),
      results: remoteSlots * 2 * H,
      descriptors: sent * 4 * W + 4 * ranks * (ranks - 1),
    },
  };
}

/** Every way forward f of `run` differs from what the host plan implies (empty: none). */
function problems(run: ProtocolRun, f: number, want: Expected): string[] {
  const found: string[] = [];
  run.forwards[f]!.forEach((r, d) => {
    if (r.error !== null) found.push(`rank ${d}: ${r.error.message}`);
    else if (r.out === null) found.push(`rank ${d}: no output`);
    else if (
      !Buffer.from(r.out.buffer, r.out.byteOffset, r.out.byteLength).equals(
        Buffer.from(want.out[d]!.buffer, want.out[d]!.byteOffset, want.out[d]!.byteLength),
      )
    ) {
      found.push(`rank ${d}: output differs from the host plan's`);
    }
    if (r.counts !== null && r.counts.join() !== want.counts[d]!.join())
      found.push(`rank ${d}: counts ${r.counts.join()} ≠ ${want.counts[d]!.join()}`);
    if (r.poolSource !== null && r.poolSource.join() !== want.poolSource[d]!.join()) {
      found.push(`rank ${d}: pool order ${r.poolSource.join()} ≠ ${want.poolSource[d]!.join()}`);
    }
  });
  return found;
}

describe("in-kernel EP protocol model: the host plan's results, counts and pool order", () => {
  for (const ranks of [1, 2, 4, 8]) {
    for (const [name, make] of Object.entries(CASES)) {
      test(`${ranks} rank(s): ${name}`, () => {
        const inputs = make(ranks, seed + 1000 * ranks);
        for (const shared of [true, false]) {
          const want = expected(inputs, shared);
          for (let i = 0; i < INTERLEAVINGS; i++) {
            const run = runProtocol(weights, [inputs], { seed: seed + 7 * i + (shared ? 0 : 3), shared });
            assert.deepEqual(problems(run, 0, want), [], `interleaving ${i}, shared ${shared}`);
            const { rows, results, descriptors } = run.traffic[0]!;
            assert.deepEqual({ rows, results, descriptors }, want.traffic, "bytes across ranks");
          }
        }
      });
    }
  }

  test("the layout sizes its regions from the shape", () => {
    const l = protocolLayout({
      ranks: 8,
      numExperts: 256,
      topK: 6,
      hidden: 4096,
      maxTokens: 8192,
      blockM: 128,
      chunkTokens: 682,
    });
    assert.equal(l.localExperts, 32);
    assert.equal(l.descriptorWords, 13);
    assert.equal(l.regions.combine.bytes, 8192 * 6 * 4096 * 2);
    assert.equal(l.regions.counts.bytes, 2 * 8 * 32 * 4);
    assert.equal(l.regions.inbox.bytes, 2 * 8 * 8192 * 13 * 4);
    assert.equal(l.poolRows, 8 * 8192 * 6 + 8192);
    for (const r of Object.values(l.regions)) assert.equal(r.offset % 16, 0);
  });
});

/** `forwards` different forwards of every rank, back to back. */
function pipelined(ranks: number, forwards: number, base: number): RankInput[][] {
  const names = Object.keys(CASES);
  return Array.from({ length: forwards }, (_, f) =>
    CASES[names[(f + ranks) % names.length]!]!(ranks, base + 97 * f),
  );
}

describe("in-kernel EP protocol model: forwards back to back", () => {
  for (const ranks of [2, 4, 8]) {
    test(`${ranks} ranks, 3 forwards without a host sync between them`, () => {
      const inputs = pipelined(ranks, 3, seed + 31 * ranks);
      const want = inputs.map((i) => expected(i, true));
      for (let i = 0; i < 2 * INTERLEAVINGS; i++) {
        const run = runProtocol(weights, inputs, { seed: seed + 13 * i });
        want.forEach((w, f) => {
          assert.deepEqual(problems(run, f, w), [], `interleaving ${i}, forward ${f}`);
        });
      }
    });
  }
});

describe("in-kernel EP protocol model: a dead peer", () => {
  const ranks = 4;
  const inputs = [
    CASES["a hot expert, T = 1 and 5"]!(ranks, seed + 5),
    CASES["masked slots and masked tokens"]!(ranks, seed + 6),
  ];

  test("a rank that never starts: every other rank's wait names it", () => {
    for (let i = 0; i < INTERLEAVINGS; i++) {
      const run = runProtocol(weights, inputs, {
        seed: seed + i,
        dead: { rank: 2, forward: 0, after: "start" },
      });
      run.forwards[0]!.forEach((r, d) => {
        if (d === 2) {
          assert.deepEqual([r.out, r.error], [null, null]);
          return;
        }
        assert.ok(r.error !== null, `rank ${d} reported no error`);
        assert.deepEqual(r.error.peers, [2]);
        assert.match(
          r.error.message,
          /^rank \d, forward 0: gave up waiting for the counts .* from rank 2: rank 2 dead/,
        );
      });
    }
  });

  test("a rank that stops after publishing: its token owners fail now, the others on the next forward", () => {
    const want = expected(inputs[0]!, true);
    const L = E / ranks;
    for (let i = 0; i < INTERLEAVINGS; i++) {
      const run = runProtocol(weights, inputs, {
        seed: seed + i,
        dead: { rank: 2, forward: 0, after: "publish" },
      });
      for (const d of [0, 1, 3]) {
        const needs = [...inputs[0]![d]!.ids].some((e) => e >= 0 && Math.floor(e / L) === 2);
        const now = run.forwards[0]![d]!;
        if (needs) {
          assert.deepEqual(now.error?.peers, [2], `rank ${d} waits for rank 2's results`);
          assert.match(now.error!.message, /expert results \(\d+ of \d+ rows from rank 2\): rank 2 dead/);
          continue;
        }
        assert.equal(now.error, null, `rank ${d} needs nothing from rank 2`);
        assert.deepEqual(now.out, want.out[d]);
        // The ranks that gave up in forward 0 never publish forward 1: rank d blames whom they blamed.
        const next = run.forwards[1]![d]!.error;
        assert.deepEqual(next?.peers, [2], `rank ${d}, next forward`);
        assert.match(next!.message, /^rank \d, forward 1: gave up waiting for the counts .*: rank 2 dead/);
      }
    }
  });
});

describe("in-kernel EP protocol model: broken orders are caught", () => {
  /**
   * Over `tries` interleavings, the problems found with `mutation`, across all forwards. A broken order
   * can also leave the model an index it cannot use (a row from another epoch): that run's error counts.
   */
  function caught(mutation: ProtocolMutation, inputs: RankInput[][], tries: number): string[] {
    const want = inputs.map((i) => expected(i, true));
    const found: string[] = [];
    for (let i = 0; i < tries && found.length === 0; i++) {
      let run: ReturnType<typeof runProtocol>;
      try {
        run = runProtocol(weights, inputs, { seed: seed + i, mutation });
      } catch (err) {
        found.push(`interleaving ${i}: the model failed: ${(err as Error).message}`);
        continue;
      }
      want.forEach((w, f) => {
        found.push(...problems(run, f, w));
      });
    }
    return found;
  }

  test("rows placed in arrival order: same outputs, but the pool order check fails", () => {
    const inputs = [CASES["a hot expert, T = 1 and 5"]!(4, seed + 8)];
    const found = caught("arrival-placement", inputs, 20);
    assert.ok(found.length > 0, "no interleaving changed the pool order");
    assert.ok(
      found.every((p) => /pool order/.test(p)),
      found.join("\n"),
    );
  });

  test("the ranks' partials added in completion order: the outputs differ", () => {
    const inputs = [CASES["weights ±1 and ±2^20"]!(4, seed + 9)];
    const found = caught("arrival-rank-combine", inputs, 20);
    assert.ok(
      found.some((p) => /output differs/.test(p)),
      "no interleaving changed an output",
    );
  });

  test("one publication buffer for every epoch: forwards back to back go wrong", () => {
    const found = caught("single-publication-buffer", pipelined(4, 3, seed + 10), 30);
    assert.ok(found.length > 0, "no interleaving let a peer's next forward overwrite a publication");
  });
});
