/**
 * The MoE input buffer's tag (src/pipeline/input-tag.ts): the quantization pass may be skipped only
 * for the current batch of this buffer, with both its FP8 rows and its routing written, at exactly its
 * row count. Every other case must say no.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { canSkipQuantization } from "../../src/pipeline/fused.js";
import { MoEInputTag } from "../../src/pipeline/input-tag.js";

function written(tag: MoEInputTag, rows: number) {
  const ticket = tag.begin(rows);
  assert.ok(tag.markRows(ticket));
  assert.ok(tag.markRouting(ticket));
  return ticket;
}

describe("MoE input buffer tag", () => {
  test("ready only once both the rows and the routing of the current batch are written", () => {
    const tag = new MoEInputTag(256);
    const t = tag.begin(32);
    assert.equal(tag.ready(t, 32), false, "nothing written");
    tag.markRows(t);
    assert.equal(tag.ready(t, 32), false, "routing missing (routing given by the caller)");
    tag.markRouting(t);
    assert.equal(tag.ready(t, 32), true);
    const u = tag.begin(32);
    tag.markRouting(u);
    assert.equal(tag.ready(u, 32), false, "rows missing (a norm that did not emit FP8)");
  });

  test("a narrowed or sliced batch takes the quantization pass", () => {
    const tag = new MoEInputTag(256);
    const t = written(tag, 64);
    assert.equal(tag.ready(t, 63), false);
    assert.equal(tag.ready(t, 65), false);
    assert.equal(tag.ready(t, 64), true);
  });

  test("a newer batch kills every earlier ticket, and marks with a dead ticket change nothing", () => {
    const tag = new MoEInputTag(256);
    const old = written(tag, 16);
    const fresh = tag.begin(16);
    assert.equal(tag.ready(old, 16), false, "stale ticket of the same size");
    assert.equal(tag.markRows(old), false);
    assert.equal(tag.markRouting(old), false);
    assert.equal(tag.ready(fresh, 16), false, "the dead ticket's marks must not count for the new batch");
    tag.markRows(fresh);
    tag.markRouting(fresh);
    assert.equal(tag.ready(fresh, 16), true);
    assert.equal(tag.ready(old, 16), false);
  });

  test("any other write to the buffer (the layer's own quantization pass) invalidates it", () => {
    const tag = new MoEInputTag(256);
    const t = written(tag, 8);
    tag.invalidate();
    assert.equal(tag.ready(t, 8), false);
    assert.equal(tag.markRows(t), false, "no resurrection by a late mark");
    assert.equal(tag.ready(t, 8), false);
  });

  test("another buffer's ticket is never ready here, even with the same epoch and rows", () => {
    const a = new MoEInputTag(128);
    const b = new MoEInputTag(128);
    const ta = written(a, 4);
    const tb = written(b, 4);
    assert.equal(ta.epoch, tb.epoch);
    assert.notEqual(ta.buffer, tb.buffer);
    assert.equal(a.ready(tb, 4), false);
    assert.equal(b.ready(ta, 4), false);
    assert.equal(a.markRows(tb), false);
  });

  test("prefill over the buffer's capacity cannot begin a batch (it takes the quantization pass)", () => {
    const tag = new MoEInputTag(100);
    assert.throws(() => tag.begin(101), /rows must be an integer in \[1, 100\], got 101/);
    assert.throws(() => tag.begin(0), RangeError);
    assert.throws(() => tag.begin(1.5), RangeError);
    assert.throws(() => new MoEInputTag(0), /capacity must be a positive integer/);
    // The failed begin left the previous batch as it was.
    const t = written(tag, 100);
    assert.throws(() => tag.begin(101));
    assert.equal(tag.ready(t, 100), true);
  });

  test("the fused pipeline skips the pass only with a ready ticket and the buffer's own routing", () => {
    const tag = new MoEInputTag(64);
    const buffer = { ids: { ptr: 0x1000n }, weights: { ptr: 0x2000n } };
    const callerRouting = { ids: { ptr: 0x3000n }, weights: { ptr: 0x4000n } };
    const t = written(tag, 8);
    assert.equal(canSkipQuantization(tag, t, 8, buffer, buffer), true);
    assert.equal(canSkipQuantization(tag, undefined, 8, buffer, buffer), false, "no ticket");
    assert.equal(canSkipQuantization(tag, t, 8, callerRouting, buffer), false, "routing given by the caller");
    assert.equal(
      canSkipQuantization(tag, t, 8, { ids: buffer.ids, weights: callerRouting.weights }, buffer),
      false,
      "weights from elsewhere",
    );
    assert.equal(canSkipQuantization(tag, t, 7, buffer, buffer), false, "a narrowed batch");
    tag.invalidate();
    assert.equal(canSkipQuantization(tag, t, 8, buffer, buffer), false, "after the pipeline's own pass");
  });
});
