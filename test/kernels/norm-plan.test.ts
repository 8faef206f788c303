import assert from "node:assert/strict";
import { test } from "node:test";
import { normWideWarps } from "../../src/kernels/norm/norm.js";

// norm.cu's kWideWarps: 256-channel warp steps, at most 8 warps, each warp the same number of steps.
test("the few-token norm's block has a warp per ceil(steps / 8) steps", () => {
  assert.equal(normWideWarps(256), 1); // one step
  assert.equal(normWideWarps(384), 2); // one and a half
  assert.equal(normWideWarps(4096), 8); // flash: 16 steps, 2 per warp
  assert.equal(normWideWarps(7168), 7); // pro: 28 steps, 4 per warp
  assert.equal(normWideWarps(2048), 8);
});
