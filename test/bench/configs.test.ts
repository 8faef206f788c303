/** The --configs summary lines (no GPU): the heuristic's tile against the best forced one. */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { configLines } from "../../src/cli/bench.js";

const row = (impl: string, blockM: number | undefined, expand: boolean | undefined, us: number) => ({
  config: "flash-ep8",
  tokens: 2048,
  shared: false,
  impl,
  block_m: blockM,
  fp4_expand: expand,
  us_median: us,
  us_min: us,
  us_max: us,
  floor_us: Number.NaN,
  tflops: Number.NaN,
  tbps: Number.NaN,
});

describe("--configs summary", () => {
  test("a faster forced tile is a gap to the heuristic", () => {
    const [line] = configLines([
      row("fused-kernel", 32, false, 2162.0),
      row("fused-m32", 32, false, 2155.9),
      row("fused-m64", 64, false, 1914.1),
    ]);
    assert.equal(line, "T=2048: heuristic BLOCK_M 32 2162.0 µs, best fused-m64 1914.1 µs (+13.0%)");
  });

  test("the heuristic's own tile run again is not a gap", () => {
    const [line] = configLines([
      row("fused-kernel", 128, true, 1260.7),
      row("fused-m128", 128, false, 1300.2),
      row("fused-m128x", 128, true, 1203.9),
    ]);
    assert.equal(
      line,
      "T=2048: heuristic BLOCK_M 128 expand 1260.7 µs, best fused-m128x 1203.9 µs (the same tile, run again: 4.7% apart)",
    );
  });

  test("the heuristic's time at or below every forced one is the best", () => {
    const [line] = configLines([
      row("fused-kernel", 16, undefined, 182.9),
      row("fused-m16", 16, undefined, 183.0),
    ]);
    assert.equal(line, "T=2048: heuristic BLOCK_M 16 182.9 µs, best fused-m16 183.0 µs (the best)");
  });
});
