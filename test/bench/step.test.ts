/** The decode-step table (no GPU): per-block time and launches, and what the skipped pass saves. */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { stripVTControlCharacters } from "node:util";
import { stepTable } from "../../src/cli/bench.js";

const row = (impl: string, tokens: number, usPerLayer: number, launches: number) => ({
  config: "flash-ep8",
  tokens,
  shared: true,
  impl,
  layers: 8,
  us_median: 8 * usPerLayer,
  us_min: 8 * usPerLayer,
  us_max: 8 * usPerLayer,
  us_per_layer: usPerLayer,
  launches_per_layer: launches,
  floor_us: Number.NaN,
  tflops: Number.NaN,
  tbps: Number.NaN,
});

describe("decode-step table", () => {
  test("shows per-block µs and launches, and the saving of the fused path against the prequant one", () => {
    const text = stripVTControlCharacters(
      stepTable([row("step-fused", 32, 90, 4), row("step-prequant", 32, 96.5, 5)]),
    );
    const fused = text.split("\n").find((l) => l.includes("step-fused"));
    const prequant = text.split("\n").find((l) => l.includes("step-prequant"));
    assert.ok(fused?.includes("90.0") && fused.includes("4.0") && fused.includes("6.5 µs"), fused);
    assert.ok(prequant?.includes("96.5") && prequant.includes("5.0") && !prequant.includes("µs"), prequant);
    assert.ok(text.includes("720.0"), "µs per step = 8 blocks × 90");
  });
});
