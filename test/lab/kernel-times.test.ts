/**
 * lab/kernel-times.ts (profile.sh --what times) on a committed Nsight Compute export of a decode step
 * (bench/results/…-ncu-step-flash-ep8-fp4-T1.csv: 12 launches each of the norm, the gate's two kernels and
 * the fused kernel, among the profiled program's own output lines), and on hand-made CSV.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { csvFields, formatKernelTimes, kernelTimes } from "../../lab/kernel-times.js";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const stepCsv = path.join(root, "bench/results/2026-12-05-h100-d528da5-ncu-step-flash-ep8-fp4-T1.csv");

test("a decode step's export: one row per kernel and grid, in launch order, medians in µs", () => {
  const rows = kernelTimes(fs.readFileSync(stepCsv, "utf8"));
  assert.deepEqual(
    rows.map((r) => [r.kernel, r.grid, r.launches]),
    [
      ["megamoe_rmsnorm", "(1, 1, 1)", 12],
      ["megamoe_gate_logits_exact", "(32, 1, 1)", 12],
      ["megamoe_gate_select", "(1, 1, 1)", 12],
      ["megamoe_fused", "(132, 1, 1)", 12],
    ],
  );
  // The upper median of the twelve, and the extremes: the export's "15,808" ns and its neighbours.
  assert.deepEqual(
    rows.map((r) => [r.medianUs, r.minUs, r.maxUs].map((v) => Math.round(v * 1000))),
    [
      [15808, 15584, 16320],
      [3776, 3520, 3808],
      [10848, 10560, 11040],
      [67168, 66784, 69376],
    ],
  );
  const text = formatKernelTimes(rows).split("\n");
  assert.equal(text.length, 5);
  assert.match(text[1]!, /^megamoe_rmsnorm\s+\(1, 1, 1\)\s+12\s+15\.8\s+15\.6\s+16\.3$/);
});

test("units, other metrics, quoted commas and demangled names", () => {
  const csv = [
    "==PROF== Connected to process 1",
    '"ID","Kernel Name","Grid Size","Metric Name","Metric Unit","Metric Value"',
    '"0","k(int, float)","(2, 1, 1)","gpu__time_duration.sum","usecond","1,500.5"',
    '"0","k(int, float)","(2, 1, 1)","sm__cycles_elapsed.avg.per_second","cycle/second","1.98e9"',
    '"1","k(int, float)","(2, 1, 1)","gpu__time_duration.sum","msecond","0.002"',
    '"2","k(int, float)","(4, 1, 1)","gpu__time_duration.sum","ns","800"',
    "some program output",
  ].join("\n");
  assert.deepEqual(kernelTimes(csv), [
    { kernel: "k", grid: "(2, 1, 1)", launches: 2, medianUs: 1500.5, minUs: 2, maxUs: 1500.5 },
    { kernel: "k", grid: "(4, 1, 1)", launches: 1, medianUs: 0.8, minUs: 0.8, maxUs: 0.8 },
  ]);
  assert.deepEqual(csvFields('"a,b","c""d",e'), ["a,b", 'c"d', "e"]);
});

test("inputs that are not an ncu duration export fail with the reason", () => {
  assert.throws(() => kernelTimes("no csv here\n"), /no ncu CSV header/);
  assert.throws(() => kernelTimes('"ID","Kernel Name"\n'), /no "Grid Size" column/);
  const bad = [
    '"ID","Kernel Name","Grid Size","Metric Name","Metric Unit","Metric Value"',
    '"0","k","(1, 1, 1)","gpu__time_duration.sum","cycle","12"',
  ].join("\n");
  assert.throws(() => kernelTimes(bad), /cannot read "12" "cycle" as a duration/);
});
