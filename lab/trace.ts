/**
 * On the GPU host: the fused kernel's per-CTA timeline at a few token counts (where the time goes:
 * dispatch phases, waits on dependencies and stages, epilogues, the combine), printed as a table of
 * min / median / max over the CTAs. Lab helper, run by lab/trace.sh from dist-test:
 * node dist-test/lab/trace.js [shape] [T,T,...] [fp8|fp4|- (the shape's)] [shared: 1|0]
 */

import { forwardOperands } from "../src/bench/layer.js";
import {
  EXPERT_FORMATS,
  type ExpertFormat,
  resolveConfig,
  sharedIntermediate,
} from "../src/config/config.js";
import { openDevice, type Stream, timeKernel } from "../src/cuda/index.js";
import { DeviceMoEWeights } from "../src/kernels/device-weights.js";
import { FUSED_TRACE_FIELDS, type FusedTraceRow } from "../src/kernels/megamoe/megamoe.js";
import { emptyLaunch, readFlush } from "../src/kernels/probe/probe.js";
import { FusedPipeline } from "../src/pipeline/fused.js";
import { randomRouting } from "../src/reference/router.js";

const shape = process.argv[2] ?? "flash-ep8";
const tokenList = (process.argv[3] ?? "1,64,8192").split(",").map(Number);
const expertsArg = process.argv[4] ?? "-";
const experts = expertsArg === "-" ? undefined : (expertsArg as ExpertFormat);
if (experts !== undefined && !EXPERT_FORMATS.includes(experts)) {
  console.error(`trace: the experts are fp8 or fp4, not ${experts}`);
  process.exit(2);
}
const sharedArg = process.argv[5] ?? "1";
if (sharedArg !== "0" && sharedArg !== "1") {
  console.error(`trace: the shared expert is 1 (on) or 0 (off), not ${sharedArg}`);
  process.exit(2);
}
const shared = sharedArg === "1";
const device = openDevice(0);
const maxTokens = Math.max(...tokenList);
const config = resolveConfig(shape, {
  maxTokens: Math.max(maxTokens, 8192),
  ...(experts === undefined ? {} : { expertFormat: experts }),
});
const weights = DeviceMoEWeights.generate(device, config, 7);
const pipeline = new FusedPipeline(device, weights, maxTokens);
const flush = readFlush(device);

const stats = (values: number[]) => {
  const v = values.filter(Number.isFinite).sort((a, b) => a - b);
  return v.length === 0
    ? [Number.NaN, Number.NaN, Number.NaN]
    : [v[0]!, v[Math.floor(v.length / 2)]!, v.at(-1)!];
};
const fmt = (ns: number) => (Number.isFinite(ns) ? (ns / 1000).toFixed(1).padStart(8) : "       -");

for (const tokens of tokenList) {
  const operands = forwardOperands(device, config, tokens, randomRouting(7, tokens, config), 7);
  const f = { ...operands, tokens, shared };
  pipeline.kernel.disableTrace();
  const forward = (s: Stream) => pipeline.forward(f, s);
  const t = timeKernel(device, forward, { warmup: 10, iters: 20 });
  // Beside it: after an L2 flush by reads (no dirty lines to write back), with no flush, and an empty
  // kernel of the fused kernel's launch shape after the usual flush.
  const clean = timeKernel(device, forward, {
    warmup: 10,
    iters: 20,
    l2Flush: false,
    rotate: (_, s) => flush.queue(s),
  });
  const warm = timeKernel(device, forward, { warmup: 10, iters: 20, l2Flush: false });
  const plan = pipeline.kernel.plan(tokens);
  const empty = timeKernel(device, emptyLaunch(device, plan.ctas, plan.threads, plan.sharedBytes), {
    iters: 20,
  });
  pipeline.kernel.enableTrace();
  pipeline.forward(f, null);
  const rows: FusedTraceRow[] = pipeline.kernel.readTrace();
  pipeline.checkStatus();
  console.log(
    `\n${shape}${experts === undefined ? "" : ` ${experts}`}${shared ? "" : " shared off"} T=${tokens}: forward ${t.usMedian.toFixed(1)} µs (untraced median); per-CTA µs min / median / max`,
  );
  console.log(
    `  forward after a read flush ${clean.usMedian.toFixed(1)} µs, with no flush ${warm.usMedian.toFixed(1)} µs; ` +
      `an empty kernel of this launch (${plan.ctas} × ${plan.threads}, ${plan.sharedBytes} B) ${empty.usMedian.toFixed(1)} µs`,
  );
  for (const field of FUSED_TRACE_FIELDS) {
    const [lo, mid, hi] = stats(rows.map((r) => r[field]));
    const count = field.endsWith("Tiles");
    const cell = (v: number) => (count ? String(v).padStart(8) : fmt(v));
    console.log(`  ${field.padEnd(18)} ${cell(lo!)} ${cell(mid!)} ${cell(hi!)}`);
  }
  // The math warpgroups' time in mainloops: from the first task to the last tile, less the epilogues
  // (with their publishes) and the waits for tasks and stages. The layer's FLOPs over its median is
  // the mainloops' rate with every CTA computing at once.
  const busy = rows.map((r) => r.mathDone - r.firstTask - r.epilogueNs - r.taskWaitNs - r.stageFullWaitNs);
  const [lo, mid, hi] = stats(busy);
  console.log(`  ${"mainloopBusy".padEnd(18)} ${fmt(lo!)} ${fmt(mid!)} ${fmt(hi!)}`);
  const inter = config.topK * config.intermediate + (shared ? sharedIntermediate(config) : 0);
  const flops = 6 * config.hidden * tokens * inter;
  console.log(
    `  mainloops ${(flops / (mid! * 1e-9) / 1e12).toFixed(0)} TFLOP/s (layer FLOPs / median mainloopBusy)`,
  );
  operands.dispose();
}
flush.dispose();
pipeline.dispose();
weights.dispose();
