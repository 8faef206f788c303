/**
 * What a CPU-only machine shows first: a usage error before any note about the GPU, and the fallback
 * to the CPU as one short line, the folders searched only with --verbose (or in `megamoe info`).
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { cudaAvailability } from "../../src/cuda/index.js";
import { runCli } from "../helpers/cli.js";

const availability = cudaAvailability();
const driverMissing = !availability.ok && /; looked in: /.test(availability.reason);
const skip = driverMissing ? false : "needs a machine without a CUDA driver";

describe("the CPU fallback's note", { skip, concurrency: 2 }, () => {
  it("a usage error comes alone, before any GPU probing is reported", async () => {
    for (const args of [
      ["run", "--pipeline", "fused"],
      ["check", "--pipeline", "unfused", "--tokens", "2"],
    ]) {
      const r = await runCli(args);
      assert.equal(r.code, 1, r.stderr);
      assert.match(r.stderr, /^error: --pipeline \w+: the pipeline applies to the "cuda" backend[^\n]*\n$/);
    }
  });

  it("run falls back in one short line that says where to look", async () => {
    const r = await runCli(["run", "--tokens", "2", "--json"]);
    assert.equal(r.code, 0, r.stderr);
    assert.equal(
      r.stderr,
      "megamoe: no CUDA driver found; running on the CPU (--verbose or megamoe info: where it looked)\n",
    );
  });

  it("--verbose lists the folders searched", async () => {
    const r = await runCli(["check", "--tokens", "2", "--verbose", "--json"]);
    assert.equal(r.code, 0, r.stderr);
    assert.match(
      r.stderr,
      /^megamoe: no GPU: libcuda not found \(libcuda\.so\.1\); looked in: \/[^\n]*; running on the CPU\n$/,
    );
    assert.match(r.stdout, /"notChecked":"the GPU layer was not checked \(no CUDA driver found\)"/);
  });

  it("--backend cuda says why in a line, --verbose in full", async () => {
    const short = await runCli(["run", "--backend", "cuda"]);
    assert.equal(short.code, 1);
    assert.equal(
      short.stderr,
      "error: --backend cuda needs a CUDA GPU: no CUDA driver found (--verbose or megamoe info: where it looked)\n",
    );
    const full = await runCli(["run", "--backend", "cuda", "--verbose"]);
    assert.match(full.stderr, /^error: --backend cuda needs a CUDA GPU: libcuda not found .*; looked in: \//);
  });
});
