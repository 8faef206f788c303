/** The progress helper off a terminal: a plain line every few seconds, nothing for short work. */
import assert from "node:assert/strict";
import { Writable } from "node:stream";
import { test } from "node:test";
import { progressBar } from "../../src/cli/progress.js";
import { runCli } from "../helpers/cli.js";

/** A pipe-like stream (no isTTY) that keeps what is written, and a clock the test moves. */
function capture() {
  const lines: string[] = [];
  const stream = new Writable({
    write(chunk, _encoding, done) {
      lines.push(...String(chunk).split("\n").filter(Boolean));
      done();
    },
  });
  let ms = 0;
  return { lines, stream, now: () => ms, advance: (s: number) => (ms += s * 1000) };
}

test("off a terminal, work longer than the interval prints a line per interval and a last one", () => {
  const c = capture();
  const bar = progressBar("fp8 reference", { stream: c.stream, now: c.now, intervalSeconds: 5 });
  bar.update(1, 8);
  c.advance(3);
  bar.update(2, 8); // 3 s: not yet
  assert.deepEqual(c.lines, []);
  c.advance(3);
  bar.update(3, 8, "1 failed"); // 6 s
  c.advance(1);
  bar.update(4, 8); // 7 s: 1 s after the last line
  c.advance(5);
  bar.update(8, 8); // 12 s
  bar.stop();
  assert.deepEqual(c.lines, [
    "fp8 reference: 3/8, 1 failed, 6 s elapsed",
    "fp8 reference: 8/8, 12 s elapsed",
    "fp8 reference: 8/8, 12 s in all",
  ]);
});

test("off a terminal, work shorter than the interval prints nothing, not even at stop", () => {
  const c = capture();
  const bar = progressBar("saving weights", { stream: c.stream, now: c.now, intervalSeconds: 5 });
  for (let i = 1; i <= 10; i++) {
    c.advance(0.4);
    bar.update(i, 10);
  }
  bar.stop();
  assert.deepEqual(c.lines, []);
});

test("off a terminal, a timer prints the latest count while asynchronous work waits", async () => {
  const c = capture();
  // The real clock: the timer fires after 50 ms with no update in between.
  const bar = progressBar("kernels:check", { stream: c.stream, intervalSeconds: 0.05 });
  bar.update(2, 40, "0 failed");
  await new Promise((resolve) => setTimeout(resolve, 130));
  bar.stop();
  assert.ok(c.lines.length >= 2, c.lines.join("\n"));
  assert.match(c.lines[0]!, /^kernels:check: 2\/40, 0 failed, \d+ s elapsed$/);
  assert.match(c.lines.at(-1)!, /^kernels:check: 2\/40, 0 failed, \d+ s in all$/);
});

test("a stopped helper prints no more lines", async () => {
  const c = capture();
  const bar = progressBar("x", { stream: c.stream, intervalSeconds: 0.02 });
  bar.update(1, 2);
  bar.stop();
  await new Promise((resolve) => setTimeout(resolve, 60));
  assert.deepEqual(c.lines, []);
});

test("a CLI command in a pipe prints no progress when its work is short", async () => {
  const r = await runCli(["run", "--tokens", "2", "--backend", "cpu"]);
  assert.equal(r.code, 0, r.stderr);
  assert.equal(r.stderr, "");
});
