/**
 * lab/clock-windows.py (the GPU host's clock analysis) on a recorded run (copied to
 * test/fixtures/results/): it must print again, line for line, the table that run printed there. Skips,
 * saying why, where python3 is missing.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
const results = path.join(root, "test/fixtures/results");
const run = "2026-12-04-h200-2b360ea-promotion-"; // torch, ours and a diagnosis build (GEMM_DIAG_SKIP_PROMOTION=1), 3 rounds
const python = spawnSync("python3", ["--version"], { encoding: "utf8" });
const skip = python.status === 0 ? false : "python3 is not available";

test("clock-windows.py reproduces the clock table of a committed run", { skip }, () => {
  const jsons = fs
    .readdirSync(results)
    .filter((f) => f.startsWith(`${run}sustained-`) && f.endsWith(".json"))
    .sort()
    .map((f) => path.join(results, f));
  assert.equal(jsons.length, 9, "the run's nine results files");
  // nvidia-smi wrote the host's local time, which was UTC.
  const r = spawnSync(
    "python3",
    [path.join(root, "lab/clock-windows.py"), path.join(results, `${run}smi.csv`), "100", ...jsons],
    {
      encoding: "utf8",
      env: { ...process.env, TZ: "UTC" },
    },
  );
  assert.equal(r.status, 0, r.stderr);
  // The file names differ (the host's, without the prefix), so compare from the case column on.
  const cells = (text: string) =>
    text
      .trim()
      .split("\n")
      .slice(1)
      .map((line) => line.slice(35).trim());
  const committed = fs.readFileSync(path.join(results, `${run}clock-windows.txt`), "utf8");
  assert.deepEqual(cells(r.stdout), cells(committed));
  assert.match(r.stdout, /flash-L1 M=4096 torch-grouped-gemm\s+3753\.6\s+1575\s+691/);
});
