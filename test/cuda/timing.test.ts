import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { gitCommit, median, type ResultRow, summarizeSamples, writeResults } from "../../src/cuda/timing.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("timing");

test("median and summaries", () => {
  assert.equal(median([5]), 5);
  assert.equal(median([3, 1, 2]), 2);
  assert.equal(median([4, 1, 3, 2]), 2.5);
  assert.throws(() => median([]), /empty/);
  const samples = [7.5, 3.25, 9, 4];
  const s = summarizeSamples(samples);
  assert.deepEqual(s, { usMedian: 5.75, usMin: 3.25, usMax: 9, samples });
  // random lists: the median splits them in half
  let state = seed;
  const next = () => {
    state = (state * 1103515245 + 12345) % 2 ** 31;
    return state / 2 ** 31;
  };
  const list = Array.from({ length: 101 }, () => 1 + next() * 100);
  const m = median(list);
  assert.equal(list.filter((x) => x < m).length, 50);
  assert.equal(list.filter((x) => x > m).length, 50);
});

test("writeResults writes the run's metadata and rows as JSON", () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
  try {
    const file = path.join(dir, "nested", "results.json");
    const rows: ResultRow[] = [
      {
        config: "flash",
        tokens: 128,
        shared: true,
        impl: "fused",
        us_median: 101.5,
        us_min: 99,
        us_max: 120,
        floor_us: 80,
        tflops: 512.25,
        tbps: 3.1,
        experts_per_sm: 2,
      },
    ];
    writeResults(file, { device: "Test GPU", rows });
    const doc = JSON.parse(fs.readFileSync(file, "utf8"));
    assert.equal(doc.device, "Test GPU");
    assert.deepEqual(doc.rows, rows);
    assert.equal(typeof doc.commit, "string");
    assert.ok(!Number.isNaN(Date.parse(doc.date)));
    assert.equal(typeof doc.command, "string");
    assert.equal(doc.node, process.version);
    writeResults(
      file,
      {
        device: { name: "x" },
        commit: "abc1234",
        date: "2026-01-01T00:00:00.000Z",
        command: "bench",
        rows: [],
      },
      { overwrite: true },
    );
    const again = JSON.parse(fs.readFileSync(file, "utf8"));
    assert.deepEqual(
      {
        device: again.device,
        commit: again.commit,
        date: again.date,
        command: again.command,
        rows: again.rows,
      },
      {
        device: { name: "x" },
        commit: "abc1234",
        date: "2026-01-01T00:00:00.000Z",
        command: "bench",
        rows: [],
      },
    );
    assert.deepEqual(fs.readdirSync(path.dirname(file)), ["results.json"], "no temp files left behind");
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test("gitCommit gives a short hash in a checkout and 'unknown' elsewhere", () => {
  const c = gitCommit();
  assert.match(c, /^([0-9a-f]{7,}(-dirty)?|unknown)$/);
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
  try {
    assert.equal(gitCommit(dir), "unknown");
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
