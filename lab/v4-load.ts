/**
 * Writes a flash-sized DeepSeek-V4-layout checkpoint (FP4 experts, sharded like the real one) and
 * measures loading a layer from it: the time to open it (config.json, index, headers), to read every
 * routed expert one at a time, and each phase's peak host memory (max RSS of its own process), to show
 * that a layer never needs a shard, or a layer, in memory.
 *
 * Run: node --import tsx lab/v4-load.ts [--dir /tmp/v4-flash] [--layers 1] [--experts 256]
 *      [--shard-gb 4] [--keep]
 * A flash layer's FP4 experts are ~3.4 GB on disk: check free space first, or pass fewer --experts.
 */
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import type { MoEConfig } from "../src/config/config.js";
import { openCheckpoint } from "../src/weights/checkpoint.js";
import { type SaveLayer, saveCheckpoint } from "../src/weights/checkpoint-save.js";
import { RandomV4Weights } from "../src/weights/random-v4.js";

function arg(name: string, fallback: string): string {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : fallback;
}

const dir = arg("dir", "/tmp/megamoe-v4-flash");
const layers = Number(arg("layers", "1"));
const experts = Number(arg("experts", "256"));
const shardGb = Number(arg("shard-gb", "4"));
const mode = arg("mode", "all");

/** DeepSeek-V4-Flash's MoE (docs/weights.md), with FP4 experts; layers 0..2 would be hash-routed. */
function flash(hash: boolean): MoEConfig {
  return {
    name: "flash-v4",
    numExperts: experts,
    hidden: 4096,
    intermediate: 2048,
    topK: 6,
    numShared: 1,
    ranks: 1,
    swigluClamp: 10,
    scaleFormat: "ue8m0",
    router: {
      scoring: "sqrtsoftplus",
      nGroup: 1,
      topkGroup: 1,
      correctionBias: !hash,
      renormalize: true,
      routedScalingFactor: 1.5,
      ...(hash ? { hashRouted: true } : {}),
    },
    expertFormat: "fp4",
    maxTokens: 8192,
  };
}

const maxRssMb = () => process.resourceUsage().maxRSS / 1024;

function write(): void {
  fs.rmSync(dir, { recursive: true, force: true });
  const blocks: SaveLayer[] = [];
  for (let l = 0; l < layers; l++) {
    blocks.push({
      block: `layers.${l}`,
      source: new RandomV4Weights(flash(l === 0 && layers > 1), 1 + l, { vocab: 1024 }),
    });
  }
  const t0 = performance.now();
  saveCheckpoint(dir, blocks, { shardBytes: shardGb * 1024 ** 3 });
  const bytes = fs.readdirSync(dir).reduce((s, f) => s + fs.statSync(path.join(dir, f)).size, 0);
  console.log(
    JSON.stringify({
      phase: "write",
      seconds: (performance.now() - t0) / 1000,
      gb: bytes / 1e9,
      maxRssMb: maxRssMb(),
    }),
  );
}

function load(): void {
  const t0 = performance.now();
  const ckpt = openCheckpoint(dir);
  if (!("layer" in ckpt) || typeof ckpt.layer !== "function" || "kind" in ckpt)
    throw new Error("not a V4 checkpoint");
  const layer = ckpt.layer(layers - 1);
  const opened = performance.now();
  let bytes = 0;
  for (let e = 0; e < layer.config.numExperts; e++) {
    const x = layer.expert(e);
    if (x.format === "fp4")
      bytes += x.w1.packed.length + x.w1.scales.length + x.w2.packed.length + x.w2.scales.length;
  }
  layer.shared();
  layer.gate();
  const done = performance.now();
  console.log(
    JSON.stringify({
      phase: "load",
      openSeconds: (opened - t0) / 1000,
      expertsSeconds: (done - opened) / 1000,
      expertGb: bytes / 1e9,
      gbPerSecond: bytes / 1e9 / ((done - opened) / 1000),
      shards: ckpt.shards.length,
      maxRssMb: maxRssMb(),
    }),
  );
}

if (mode === "write") write();
else if (mode === "load") load();
else {
  // Each phase in its own process, so each max RSS is that phase's own.
  const self = fileURLToPath(import.meta.url);
  for (const phase of ["write", "load"]) {
    const r = spawnSync(
      process.execPath,
      ["--import", "tsx", self, ...process.argv.slice(2), "--mode", phase],
      {
        stdio: "inherit",
      },
    );
    if (r.status !== 0) process.exit(r.status ?? 1);
  }
  if (!process.argv.includes("--keep")) fs.rmSync(dir, { recursive: true, force: true });
}
