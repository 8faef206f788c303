import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { describe, it } from "node:test";
import { fileURLToPath } from "node:url";
import { stripVTControlCharacters } from "node:util";
import { matchPeerRow, parsePeerResults } from "../../src/bench/peer.js";
import { chooseFp8Rate, groupedGemmCases, resultsTable } from "../../src/cli/bench.js";
import { runPlot } from "../../src/cli/plot.js";
import type { ResultRow } from "../../src/cuda/index.js";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const torchFile = path.join(root, "test/fixtures/results/2026-12-03-h200-torch-flash-ep8-shared1.json");
const oursFile = path.join(root, "test/fixtures/results/2026-12-03-h200-unfused-flash-ep8-shared1.json");

function row(over: Partial<ResultRow>): ResultRow {
  return {
    config: "flash-ep8",
    tokens: 64,
    shared: true,
    impl: "unfused",
    us_median: 100,
    us_min: 90,
    us_max: 120,
    floor_us: 80,
    tflops: 1,
    tbps: 2,
    ...over,
  };
}

describe("peer results", () => {
  it("reads the torch peer's results file and its FP8 rate", () => {
    const peer = parsePeerResults(fs.readFileSync(torchFile, "utf8"), torchFile);
    assert.ok(peer.fp8Tflops !== undefined && peer.fp8Tflops > 1000 && peer.fp8Tflops < 2000);
    assert.equal(peer.rows.length, 14);
    assert.ok(peer.rows.every((r) => r.impl === "torch" && r.config === "flash-ep8" && r.shared === true));
    assert.equal(chooseFp8Rate(undefined, peer).tflops, peer.fp8Tflops);
    assert.match(chooseFp8Rate(undefined, peer).source, /peer/);
    assert.equal(chooseFp8Rate(1400, peer).tflops, 1400);
    assert.equal(chooseFp8Rate(undefined, undefined).tflops, 1500);
  });

  it("rejects malformed files naming the problem", () => {
    assert.throws(() => parsePeerResults("{", "f.json"), /f\.json: not JSON/);
    assert.throws(() => parsePeerResults('{"rows": 3}', "f.json"), /expected \{ rows/);
    assert.throws(
      () => parsePeerResults('{"rows": [{"config": "x", "impl": "torch", "tokens": "1"}]}', "f.json"),
      /f\.json row 0: "tokens"/,
    );
  });

  it("matches the same config, tokens, shared expert and timing mode only", () => {
    const peer = [
      row({ impl: "torch", us_median: 300 }),
      row({ impl: "torch", us_median: 200, graph: true }),
      row({ impl: "torch", tokens: 128, us_median: 400 }),
      row({ impl: "torch", shared: false, us_median: 250 }),
    ];
    assert.equal(matchPeerRow(peer, row({ graph: false }))?.us_median, 300);
    assert.equal(matchPeerRow(peer, row({ graph: true }))?.us_median, 200);
    assert.equal(matchPeerRow(peer, row({ shared: false, graph: true })), undefined);
    assert.equal(matchPeerRow(peer, row({ config: "flash" })), undefined);
  });

  it("the table shows the peer's time and peer/ours beside ours", () => {
    const table = resultsTable(
      [row({ graph: false }), row({ graph: true, us_median: 50 }), row({ tokens: 1, graph: false })],
      [row({ impl: "torch", us_median: 300 })],
    );
    const plain = stripVTControlCharacters(table);
    assert.match(plain, /torch µs/);
    assert.match(plain, /torch\/ours/);
    assert.match(plain, /300\.0\s*│\s*3\.00×/);
    assert.match(plain, /graph/);
    assert.equal((plain.match(/—/g) ?? []).length, 4); // the graph row and T=1 have no peer row
  });

  it("a peer series (the torch peer's blockwise rows) gets columns of its own", () => {
    const table = resultsTable(
      [row({ graph: false, us_median: 100 })],
      [
        row({ impl: "torch-grouped-gemm", us_median: 90 }),
        row({ impl: "torch-blockwise-loop", series: "blockwise", us_median: 130 }),
      ],
    );
    const plain = stripVTControlCharacters(table);
    assert.match(plain, /torch µs/);
    assert.match(plain, /torch blockwise µs/);
    assert.match(plain, /torch blockwise\/ours/);
    assert.match(plain, /90\.0\s*│\s*0\.90×\s*│\s*130\.0\s*│\s*1\.30×/);
  });
});

describe("grouped-GEMM cases", () => {
  it("are the flash L1 and L2 shapes at 64, 512, 4096 rows per group, 32 groups", () => {
    const cases = groupedGemmCases("flash-ep8", [64, 512, 4096]);
    assert.deepEqual(
      cases.map((c) => [c.config, c.n, c.k, c.mPerGroup, c.groups, c.tokens]),
      [
        ["flash-L1", 4096, 4096, 64, 32, 2048],
        ["flash-L1", 4096, 4096, 512, 32, 16384],
        ["flash-L1", 4096, 4096, 4096, 32, 131072],
        ["flash-L2", 4096, 2048, 64, 32, 2048],
        ["flash-L2", 4096, 2048, 512, 32, 16384],
        ["flash-L2", 4096, 2048, 4096, 32, 131072],
      ],
    );
    assert.deepEqual(
      groupedGemmCases("pro", [64]).map((c) => [c.config, c.n, c.k]),
      [
        ["pro-L1", 6144, 7168],
        ["pro-L2", 7168, 3072],
      ],
    );
  });
});

describe("megamoe plot", () => {
  it("plots our results beside the torch peer's from the results files", () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
    const write = process.stdout.write;
    try {
      const out = path.join(dir, "plot.svg");
      process.stdout.write = () => true;
      runPlot([oursFile, torchFile], { out });
      const svg = fs.readFileSync(out, "utf8");
      assert.match(svg, /^<svg /);
      assert.match(svg, /flash-ep8 · shared expert on · NVIDIA H200/);
      assert.equal((svg.match(/class="series"/g) ?? []).length, 2);
      assert.equal((svg.match(/class="floor"/g) ?? []).length, 1);
      assert.throws(() => runPlot([oursFile], { out, shape: "pro", force: true }), /no rows left/);
    } finally {
      process.stdout.write = write;
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
