/**
 * One rank's process of test/gpu/fused-ep-gpus.test.ts: joins the group as rank $FEP_RANK of
 * $FEP_RANKS at $FEP_SOCKET on GPU $FEP_RANK (FusedExpertParallel.join) and prints "joined". Then, with
 * $FEP_GO set, waits for that file to exist first. With $FEP_OUT it forwards its rank's input of the
 * shared routing case $FEP_CASE (seed $FEP_SEED) and writes its output's bf16 bits there, exit 0; a
 * forward that fails prints one JSON line { error, blamed: [rank, [blamed ranks]][] } and exits 3.
 */
import fs from "node:fs";
import { setTimeout as sleep } from "node:timers/promises";
import { openDevice } from "../../src/cuda/index.js";
import { FusedExpertParallel, FusedExpertParallelError } from "../../src/parallel/fused-expert-parallel.js";
import { GeneratedWeights } from "../../src/weights/generate.js";
import { type EpCase, epRoutingCases } from "./ep-protocol.js";
import { EP_GPU_CONFIG, EP_GPU_MAX_TOKENS } from "./fused-ep.js";

const env = (name: string): string => {
  const v = process.env[name];
  if (v === undefined) throw new Error(`${name} is not set`);
  return v;
};
const rank = Number(env("FEP_RANK"));
const ranks = Number(env("FEP_RANKS"));
const seed = Number(env("FEP_SEED"));

const weights = new GeneratedWeights(EP_GPU_CONFIG, seed);
const ep = await FusedExpertParallel.join(weights, {
  rank,
  ranks,
  device: openDevice(rank),
  socketPath: env("FEP_SOCKET"),
  maxTokens: EP_GPU_MAX_TOKENS,
  timeoutMs: 120_000,
});
console.log("joined");
const go = process.env.FEP_GO;
if (go !== undefined) while (!fs.existsSync(go)) await sleep(20);
const out = process.env.FEP_OUT;
if (out !== undefined) {
  const make: EpCase = epRoutingCases(EP_GPU_CONFIG, EP_GPU_MAX_TOKENS)[env("FEP_CASE")]!;
  const input = make(ranks, seed)[rank]!;
  try {
    const bits = ep.forward([input]).out[0]!;
    fs.writeFileSync(out, bits);
  } catch (e) {
    const blamed = e instanceof FusedExpertParallelError ? [...e.records].map(([r, g]) => [r, g.blamed]) : [];
    console.log(JSON.stringify({ error: (e as Error).message, blamed }));
    // The trap ended this process's context: exiting is what frees its memory.
    process.exit(3);
  }
}
ep.dispose();
