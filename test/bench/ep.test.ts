/**
 * The expert-parallel benchmark's pure parts (src/bench/ep.ts): the --ranks and --tokens checks, the
 * host-planned path's bytes across ranks (by hand and against planDispatch), the floor of one rank's
 * expert work, a case's model, its rows, the table and the notes under it. The timing needs a GPU.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { stripVTControlCharacters as plain } from "node:util";
import {
  EP_IMPLS,
  EP_RANKS,
  EP_SHAPE,
  EP_TOKENS,
  epCaseModel,
  epNotes,
  epRanksProblem,
  epRow,
  epTable,
  epTokensProblem,
  hostEpTraffic,
  rankExpertFloor,
  trafficBytes,
} from "../../src/bench/ep.js";
import { expertWeightBytes, layerFloor } from "../../src/bench/layer.js";
import { resolveConfig } from "../../src/config/config.js";
import type { ResultRow } from "../../src/cuda/index.js";
import { planDispatch } from "../../src/parallel/dispatch.js";
import { fusedEpLayout, fusedEpTraffic } from "../../src/parallel/fused-ep.js";
import { randomRouting } from "../../src/reference/router.js";
import { testSeed } from "../helpers/random.js";

const tiny = resolveConfig("tiny"); // E=8 H=256 IH=128 top-2, one shared expert of 128
const flash = resolveConfig("flash");
const seed = testSeed("ep bench");

/** Rank s's slice of a routing of R·T tokens. */
function split(ids: Int32Array, ranks: number, tokens: number, k: number): Int32Array[] {
  return Array.from({ length: ranks }, (_, s) => ids.subarray(s * tokens * k, (s + 1) * tokens * k));
}

describe("ep bench: defaults and checks", () => {
  it("sweeps the issue's grid on the whole flash layer, both paths", () => {
    assert.equal(EP_SHAPE, "flash");
    assert.deepEqual(EP_RANKS, [2, 4, 8]);
    assert.deepEqual(EP_TOKENS, [1, 8, 64, 512, 4096, 8192]);
    assert.deepEqual([...EP_IMPLS], ["fused-ep", "host-ep"]);
    for (const r of EP_RANKS) assert.equal(epRanksProblem(r, flash.numExperts), null);
    for (const r of EP_RANKS) assert.equal(epTokensProblem(r, 8192), null);
  });

  it("refuses ranks outside 2 … 8 and ranks that do not divide the experts", () => {
    assert.match(epRanksProblem(1, 256)!, /must be in 2 … 8/);
    assert.match(epRanksProblem(16, 256)!, /must be in 2 … 8/);
    assert.match(epRanksProblem(2.5, 256)!, /must be in 2 … 8/);
    assert.equal(epRanksProblem(3, 256), "must divide the 256 routed experts");
    assert.equal(epRanksProblem(6, 8, "tiny"), "must divide the 8 routed experts of tiny");
  });

  it("refuses tokens a host-planned rank could not receive from every rank", () => {
    assert.equal(epTokensProblem(8, 8192), null);
    assert.match(epTokensProblem(8, 8193)!, /8 × 8193 = 65544 rows, more than a layer's 65536/);
  });
});

describe("hostEpTraffic", () => {
  it("one bf16 row out and one partial back per (token, other rank) pair, by hand", () => {
    // tiny split 2 ways: experts 0-3 on rank 0, 4-7 on rank 1. H = 256: a row is 512 bytes.
    const r0 = Int32Array.from([0, 5, 4, 6, 1, 2, -1, 7]); // to rank 1, to rank 1 (once), stays, to rank 1
    const r1 = Int32Array.from([0, 1, 4, 5, -1, -1]); // to rank 0 (once), stays, nothing
    const t = hostEpTraffic([r0, r1], 8, 2, 256);
    assert.deepEqual(t, { gather: 4 * 512, combine: 4 * 512 });
    assert.equal(trafficBytes(t), 8 * 512);
  });

  for (const ranks of [2, 4, 8]) {
    it(`R ${ranks}: the rows planDispatch sends to other ranks, and fusedEpTraffic's rows`, () => {
      const T = 37;
      const k = tiny.topK;
      const routing = randomRouting(seed + ranks, ranks * T, tiny, { maskedTokens: [3, 40] });
      const ids = split(routing.ids, ranks, T, k);
      const plan = planDispatch(
        ids.map((a, s) => ({
          ids: a,
          weights: routing.weights.subarray(s * T * k, (s + 1) * T * k),
          tokens: T,
        })),
        tiny.numExperts,
        k,
      );
      let sent = 0;
      plan.received.forEach((into, d) => {
        for (let s = 0; s < ranks; s++) if (s !== d) sent += into.sourceStart[s + 1]! - into.sourceStart[s]!;
      });
      const H = tiny.hidden;
      const host = hostEpTraffic(ids, tiny.numExperts, k, H);
      assert.equal(host.gather, sent * 2 * H);
      assert.equal(host.combine, sent * 2 * H);
      // The in-kernel path pulls the same rows, in FP8 with fp32 scales.
      const layout = fusedEpLayout({ ranks, numExperts: tiny.numExperts, topK: k, hidden: H, maxTokens: T });
      assert.equal(fusedEpTraffic(layout, ids).rows, sent * (H + (4 * H) / 128));
    });
  }

  it("refuses a split that does not divide the experts", () => {
    assert.throws(
      () => hostEpTraffic([new Int32Array(0), new Int32Array(0), new Int32Array(0)], 8, 2, 256),
      /8 experts cannot be split among 3 ranks/,
    );
  });
});

describe("rankExpertFloor", () => {
  const one = expertWeightBytes(256, 128); // 98 328

  it("by hand: each rank's experts over the rows routed to them, its own tokens in and out", () => {
    // Rank 0 brings token [0, 5], rank 1 brings [4, 6]: rank 0 computes expert 0 once, rank 1 experts
    // 4, 5 and 6 (three rows), so rank 1 is the slowest.
    const f = rankExpertFloor(tiny, [Int32Array.from([0, 5]), Int32Array.from([4, 6])], false, 4, 1500);
    assert.equal(f.rank, 1);
    assert.equal(f.bytes, 3 * one + 2 * 1 * 256 * 2);
    assert.equal(f.flops, 2 * 3 * (256 * 2 * 128 + 128 * 256));
    assert.equal(f.bound, "memory");
    assert.ok(Math.abs(f.floorUs - (f.bytes / 4e12) * 1e6) < 1e-9);
  });

  it("the shared expert runs on a rank's own tokens only", () => {
    const ids = [Int32Array.from([0, 1, 2, 3]), Int32Array.from([-1, -1])]; // rank 0: 2 tokens, rank 1: 1
    const off = rankExpertFloor(tiny, ids, false, 4, 1500);
    const on = rankExpertFloor(tiny, ids, true, 4, 1500);
    assert.equal(on.rank, 0);
    assert.equal(on.bytes - off.bytes, expertWeightBytes(256, 128));
    assert.equal(on.flops - off.flops, 2 * 2 * (256 * 2 * 128 + 128 * 256));
  });

  it("one rank holding every expert is the whole layer's floor (without the others' tokens)", () => {
    // Every token routes to rank 0's experts: rank 0's floor is layerFloor's routed part.
    const ids = [Int32Array.from([0, 1, 2, 3]), Int32Array.from([1, 2])];
    const f = rankExpertFloor(tiny, ids, false, 4, 1500);
    const whole = layerFloor(tiny, 3, { ids: Int32Array.from([0, 1, 2, 3, 1, 2]) }, false, 4, 1500);
    assert.equal(f.rank, 0);
    assert.equal(f.flops, whole.flops);
    assert.equal(f.bytes, whole.bytes - 2 * 1 * 256 * 2); // rank 1's token in and out are not rank 0's
  });

  it("refuses bad rates and splits", () => {
    assert.throws(() => rankExpertFloor(tiny, [new Int32Array(0)], false, 0, 1500), /rates must be positive/);
    assert.throws(
      () =>
        rankExpertFloor(
          tiny,
          [0, 1, 2].map(() => new Int32Array(0)),
          false,
        ),
      /cannot be split among 3/,
    );
  });
});

describe("a case's model, rows, table and notes", () => {
  const R = 4;
  const T = 16;
  const routing = randomRouting(seed, R * T, tiny);
  const ids = split(routing.ids, R, T, tiny.topK);
  const model = epCaseModel(tiny, ids, true, 4, 1500);

  it("the model: the layer floor over R·T tokens, the slowest rank's floor, both paths' traffic", () => {
    assert.equal(model.ranks, R);
    assert.equal(model.tokens, T);
    assert.equal(model.config, "tiny");
    const whole = layerFloor(tiny, R * T, routing, true, 4, 1500);
    assert.equal(model.floor.floorUs, whole.floorUs);
    assert.equal(model.floor.bytes, whole.bytes);
    assert.deepEqual(model.rankFloor, rankExpertFloor(tiny, ids, true, 4, 1500));
    assert.ok(model.rankFloor.floorUs < model.floor.floorUs);
    const layout = fusedEpLayout({ ranks: R, numExperts: 8, topK: 2, hidden: 256, maxTokens: T });
    assert.deepEqual(model.traffic["fused-ep"], fusedEpTraffic(layout, ids));
    assert.deepEqual(model.traffic["host-ep"], hostEpTraffic(ids, 8, 2, 256));
  });

  it("refuses ranks with different token counts", () => {
    assert.throws(
      () => epCaseModel(tiny, [new Int32Array(2), new Int32Array(4)], true),
      /every rank must bring the same number of tokens/,
    );
  });

  const fusedRow = epRow(model, {
    impl: "fused-ep",
    usMedian: 100,
    usMin: 90,
    usMax: 130,
    gpuUsMedian: 80,
    mismatched: 0,
    compared: R * T * 256,
  });
  const hostRow = epRow(model, { impl: "host-ep", usMedian: 250, usMin: 240, usMax: 300 });

  it("rows: the times, the floors, the rates against the one-GPU floor, the bytes across ranks", () => {
    assert.equal(fusedRow.impl, "fused-ep");
    assert.equal(fusedRow.ranks, R);
    assert.equal(fusedRow.tokens, T);
    assert.equal(fusedRow.tokens_total, R * T);
    assert.equal(fusedRow.shared, true);
    assert.equal(fusedRow.us_median, 100);
    assert.equal(fusedRow.floor_us, model.floor.floorUs);
    assert.equal(fusedRow.rank_floor_us, model.rankFloor.floorUs);
    assert.equal(fusedRow.tbps, model.floor.bytes / 100e6);
    assert.equal(fusedRow.tflops, model.floor.flops / 100e6);
    assert.equal(fusedRow.bytes_across, trafficBytes(model.traffic["fused-ep"]));
    assert.deepEqual(fusedRow.traffic, model.traffic["fused-ep"]);
    assert.equal(fusedRow.gpu_us_median, 80);
    assert.equal(fusedRow.mismatched, 0);
    assert.equal(hostRow.bytes_across, trafficBytes(model.traffic["host-ep"]));
    assert.equal("gpu_us_median" in hostRow, false);
    assert.equal("mismatched" in hostRow, false);
    // Rows survive the results file.
    assert.deepEqual(JSON.parse(JSON.stringify(fusedRow)), fusedRow);
  });

  it("the table: both paths, host / fused on the fused row, a dash where a path has no GPU span", () => {
    const text = plain(epTable([fusedRow, hostRow]));
    for (const head of [
      "R",
      "T / rank",
      "µs median",
      "GPU µs",
      "floor µs",
      "rank floor µs",
      "MB across",
      "host/fused",
    ]) {
      assert.ok(text.includes(head), head);
    }
    const lines = text.split("\n");
    const fusedLine = lines.find((l) => l.includes("fused-ep"))!;
    const hostLine = lines.find((l) => l.includes("host-ep"))!;
    assert.match(fusedLine, /100\.0/);
    assert.match(fusedLine, /80\.0/);
    assert.match(fusedLine, /2\.50×/);
    assert.match(hostLine, /250\.0/);
    assert.match(hostLine, /—/);
    assert.doesNotMatch(hostLine, /×/);
  });

  it("FP4 experts and one rank per GPU: the format on the row and in the table, floor/time per rank", () => {
    assert.equal(fusedRow.experts, "fp8");
    const fp4 = epCaseModel({ ...tiny, expertFormat: "fp4" }, ids, true, 4, 1500);
    assert.equal(fp4.experts, "fp4");
    assert.ok(fp4.floor.bytes < model.floor.bytes, "FP4 experts stream fewer bytes");
    const row = epRow(fp4, { impl: "fused-ep", usMedian: 100, usMin: 90, usMax: 110 });
    assert.match(plain(epTable([row])), /tiny fp4/);
    // On R GPUs floor/time is against the slowest rank's floor, not all ranks' work on one GPU.
    const percent = (r: ResultRow) => plain(epTable([r])).match(/(\d+)%/)?.[1];
    assert.equal(percent(fusedRow), String(Math.round((100 * model.floor.floorUs) / 100)));
    assert.equal(
      percent({ ...fusedRow, gpus: R }),
      String(Math.round((100 * model.rankFloor.floorUs) / 100)),
    );
  });

  it("notes: the floors' rates, an output that differs, a failed forward", () => {
    const notes = (rows: ResultRow[]) => plain(epNotes(rows, 4.3, 1500).join("\n"));
    const clean = notes([fusedRow, hostRow]);
    assert.match(clean, /4\.30 TB\/s, FLOPs \/ 1500 TFLOP\/s/);
    assert.doesNotMatch(clean, /differs|failed/);
    const differs = notes([{ ...fusedRow, mismatched: 7 }]);
    assert.match(differs, /R=4 T=16: fused-ep differs from host-ep in 7 of 16384 bf16 values/);
    const failed = {
      ...epRow(model, { impl: "fused-ep", usMedian: Number.NaN, usMin: Number.NaN, usMax: Number.NaN }),
      error: "rank 2: gave up",
    };
    assert.match(notes([failed]), /R=4 T=16: fused-ep failed: rank 2: gave up/);
    assert.match(plain(epTable([failed])), /fused-ep failed/);
  });
});
