/**
 * `megamoe inspect <dir>` and the `--checkpoint <dir> --layer <L>` weights of run, check and bench:
 * a DeepSeek-V4 checkpoint directory (or one .safetensors file) summarized and opened layer by layer.
 */
import fs from "node:fs";
import path from "node:path";
import pc from "picocolors";
import type { MoEConfig } from "../config/config.js";
import type { Routing } from "../reference/moe.js";
import { routeByHash } from "../reference/router.js";
import { Checkpoint, generateTokenIds, openCheckpoint } from "../weights/checkpoint.js";
import { CheckpointError } from "../weights/checkpoint-format.js";
import type { Fp4Exactness, MoEWeightSource } from "../weights/types.js";
import { progressBar } from "./progress.js";

/** The weights of `layer` ("3", "layers.3" or "mtp.0") of a checkpoint, sized for `maxTokens`. */
export function checkpointLayer(
  target: string,
  layer: string | undefined,
  maxTokens: number,
): MoEWeightSource {
  const ckpt = openCheckpoint(target);
  if (ckpt instanceof Checkpoint) {
    if (layer === undefined) {
      throw new Error(
        `--checkpoint ${target}: say which layer with --layer <L> (0..${ckpt.model.numLayers - 1}) or mtp.0`,
      );
    }
    return ckpt.byName(layer, { maxTokens: Math.max(8192, maxTokens) });
  }
  if (layer !== undefined && layer !== "0") {
    throw new Error(
      `--checkpoint ${target}: a single file saved by megamoe holds one layer (0), not ${layer}`,
    );
  }
  return ckpt.layer({ maxTokens: Math.max(ckpt.config.maxTokens, maxTokens) });
}

/**
 * Routing for a run on made-up input: hash-routed layers route the seed's token ids through tid2eid
 * (returned so a caller can report them); other layers return undefined (the layer's gate routes).
 */
export function hashRouting(
  weights: MoEWeightSource,
  x: Uint16Array,
  tokens: number,
  seed: number,
): { routing: Routing; tokenIds: Int32Array } | undefined {
  const config = weights.config;
  if (config.router.hashRouted !== true) return undefined;
  const gate = weights.gate();
  const vocab = (gate.tid2eid?.length ?? 0) / config.topK;
  const tokenIds = generateTokenIds(seed, tokens, vocab);
  const { ids, weights: w } = routeByHash(x, tokens, tokenIds, gate, config);
  return { routing: { ids, weights: w }, tokenIds };
}

export interface InspectOptions {
  json?: boolean;
  /** Problems listed at most (default 5). */
  problems?: number;
  /** Also count each FP4 layer's routed elements whose e4m3 form is not exact (reads every scale). */
  exactness?: boolean;
  /**
   * Also read every block's experts, shared expert and gate as run does, so that a code or scale run
   * refuses (an e4m3 NaN code, a NaN or overflowing scale, a bad tid2eid id) is a problem here too.
   */
  deep?: boolean;
}

/** What inspect says of the codes it did not read (without --deep). */
const CODES_NOT_SCANNED =
  "not scanned: megamoe inspect --deep reads every expert's codes and scales, as run does";

/**
 * Reads every routed expert, the shared expert and the gate of `weights` through its own readers (the
 * checks run applies), adding one problem per part that fails, prefixed `where`.
 */
function readEveryPart(
  weights: MoEWeightSource,
  where: string,
  problems: string[],
  onExpert: () => void,
): void {
  const parts: [string, () => unknown][] = [
    ...Array.from({ length: weights.config.numExperts }, (_, e): [string, () => unknown] => [
      `expert ${e}`,
      () => weights.expert(e),
    ]),
    ["shared expert", () => weights.shared()],
    ["gate", () => weights.gate()],
  ];
  for (const [part, read] of parts) {
    try {
      read();
    } catch (err) {
      problems.push(`${where}${part}: ${(err as Error).message}`);
    }
    onExpert();
  }
}

/** "0–2, 5" from sorted numbers. */
function ranges(ns: number[]): string {
  const parts: string[] = [];
  for (let i = 0; i < ns.length; ) {
    let j = i;
    while (j + 1 < ns.length && ns[j + 1] === ns[j] + 1) j++;
    parts.push(i === j ? `${ns[i]}` : `${ns[i]}–${ns[j]}`);
    i = j + 1;
  }
  return parts.join(", ");
}

function gb(bytes: number): string {
  return bytes >= 1e9
    ? `${(bytes / 1e9).toFixed(2)} GB`
    : bytes >= 1e6
      ? `${(bytes / 1e6).toFixed(2)} MB`
      : `${bytes} B`;
}

/** Prints a checkpoint's MoE shape, expert format, layers, shards and the first problems; exit 1 when any. */
export function runInspect(target: string, opts: InspectOptions = {}): void {
  const limit = opts.problems ?? 5;
  let ckpt: ReturnType<typeof openCheckpoint>;
  try {
    ckpt = openCheckpoint(target);
  } catch (err) {
    // A checkpoint that does not even open (config.json, index, a missing shard) is inspect's first problem.
    if (!(err instanceof CheckpointError)) throw err;
    const summary = { dir: target, problems: [err.message], problemCount: 1 };
    process.stdout.write(
      opts.json
        ? `${JSON.stringify(summary)}\n`
        : `${pc.bold("megamoe inspect")} ${target}\n  ${pc.dim("problems".padEnd(12))} 1: it does not open\n    ${pc.red("•")} ${err.message}\n`,
    );
    process.exitCode = 1;
    return;
  }
  if (!(ckpt instanceof Checkpoint)) {
    const c = ckpt.config;
    const problems: string[] = [];
    if (opts.deep) {
      const bar = progressBar("reading every expert");
      let done = 0;
      const total = c.numExperts + 2;
      try {
        readEveryPart(ckpt.layer(), "", problems, () => bar.update(++done, total));
      } catch (err) {
        problems.push((err as Error).message);
      }
      bar.stop();
    }
    const summary = {
      kind: "megamoe file",
      file: ckpt.file,
      shape: shapeOf(c),
      expertFormat: c.expertFormat ?? "fp8",
      codesScanned: opts.deep === true,
      ...(opts.deep ? { problems: problems.slice(0, limit), problemCount: problems.length } : {}),
    };
    if (opts.json) process.stdout.write(`${JSON.stringify(summary)}\n`);
    else {
      let out = `${pc.bold("megamoe inspect")} ${ckpt.file}\n  one layer saved by megamoe: ${summary.shape}\n`;
      out += `  ${pc.dim("codes".padEnd(12))} ${opts.deep ? "scanned: every expert, the shared expert and the gate" : CODES_NOT_SCANNED}\n`;
      if (opts.deep) out += problemLines(problems, limit);
      process.stdout.write(out);
    }
    if (problems.length > 0) process.exitCode = 1;
    return;
  }
  const m = ckpt.model;
  const problems: string[] = [];
  const formats = new Map<string, string[]>();
  const blocks = ckpt.blocks();
  // --exactness: per FP4 block, its routed elements and those not exact in e4m3.
  const exactness = new Map<string, Fp4Exactness>();
  const bar = progressBar(
    opts.deep
      ? "reading every expert of every layer"
      : opts.exactness
        ? "checking layers and FP4 scales"
        : "checking layers",
  );
  // With --deep the bar counts parts read (E experts, the shared expert and the gate a block).
  const partsPerBlock = m.numExperts + 2;
  blocks.forEach((b, i) => {
    try {
      const layer = b.block.startsWith("mtp.")
        ? ckpt.mtp(Number(b.block.slice(4)))
        : ckpt.layer(Number(b.block.slice(7)));
      const f = layer.config.expertFormat ?? "fp8";
      formats.set(f, [...(formats.get(f) ?? []), b.block]);
      if (opts.exactness && f === "fp4") exactness.set(b.block, layer.fp4Exactness());
      if (opts.deep) {
        let done = i * partsPerBlock;
        readEveryPart(layer, `${b.block} `, problems, () =>
          bar.update(++done, blocks.length * partsPerBlock),
        );
      }
    } catch (err) {
      problems.push(`${b.block}: ${(err as Error).message}`);
    }
    if (!opts.deep) bar.update(i + 1, blocks.length);
  });
  bar.stop();
  const onDisk = ckpt.shards.reduce((s, f) => s + fs.statSync(path.join(ckpt.dir, f)).size, 0);
  const hash = blocks
    .filter((b) => b.routing === "hash" && b.block.startsWith("layers."))
    .map((b) => Number(b.block.slice(7)));
  const score = blocks
    .filter((b) => b.routing === "score" && b.block.startsWith("layers."))
    .map((b) => Number(b.block.slice(7)));
  const mtp = blocks.filter((b) => b.block.startsWith("mtp.")).map((b) => b.block);
  const summary = {
    dir: ckpt.dir,
    experts: m.numExperts,
    hidden: m.hidden,
    intermediate: m.intermediate,
    topK: m.topK,
    shared: m.numShared,
    scoring: m.scoring,
    routedScalingFactor: m.routedScalingFactor,
    swigluLimit: m.swigluLimit,
    expertDtype: m.expertDtype,
    expertFormats: Object.fromEntries([...formats].map(([f, bs]) => [f, bs.length])),
    layers: m.numLayers,
    hashLayers: hash,
    scoreLayers: score,
    mtp,
    shards: ckpt.shards.length,
    tensors: ckpt.weightMap.size,
    totalSize: ckpt.totalSize,
    bytesOnDisk: onDisk,
    ...(opts.exactness ? { fp4Exactness: Object.fromEntries(exactness) } : {}),
    codesScanned: opts.deep === true,
    problems: problems.slice(0, limit),
    problemCount: problems.length,
  };
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(summary)}\n`);
  } else {
    const line = (k: string, v: string | number) => `  ${pc.dim(k.padEnd(12))} ${v}\n`;
    const fmt = [...formats].map(([f, bs]) => `${f} (${bs.length} blocks)`).join(", ") || "none readable";
    let out = `${pc.bold("megamoe inspect")} ${ckpt.dir}\n`;
    out += line(
      "moe",
      `E=${m.numExperts} H=${m.hidden} I=${m.intermediate} top-${m.topK}, ${m.numShared} shared`,
    );
    out += line(
      "router",
      `${m.scoring}, scale ${m.routedScalingFactor}, renormalize ${m.renormalize}, swiglu limit ${m.swigluLimit ?? "none"}`,
    );
    out += line(
      "experts",
      `${fmt}; config.json expert_dtype ${m.expertDtype ?? "absent (decided by header dtype)"}`,
    );
    out += line(
      "layers",
      `${m.numLayers}: hash-routed ${hash.length > 0 ? ranges(hash) : "none"}; score-routed ${score.length > 0 ? ranges(score) : "none"}`,
    );
    out += line("mtp", mtp.length > 0 ? mtp.join(", ") : "none");
    if (opts.exactness) out += line("fp4 → e4m3", exactnessLine(exactness));
    out += line("shards", `${ckpt.shards.length} (${ckpt.weightMap.size} tensors)`);
    out += line(
      "bytes",
      `${gb(onDisk)} on disk${ckpt.totalSize === null ? "" : `, index total_size ${gb(ckpt.totalSize)}`}`,
    );
    out += line(
      "codes",
      opts.deep
        ? `scanned: every expert, shared expert and gate of ${blocks.length} blocks`
        : CODES_NOT_SCANNED,
    );
    out += problemLines(problems, limit);
    process.stdout.write(out);
  }
  if (problems.length > 0) process.exitCode = 1;
}

/** The "problems" line (count, or none) and the first `limit` problems, one a line. */
function problemLines(problems: string[], limit: number): string {
  const count =
    problems.length === 0 ? "none" : `${problems.length}${problems.length > limit ? `, first ${limit}` : ""}`;
  let out = `  ${pc.dim("problems".padEnd(12))} ${count}\n`;
  for (const p of problems.slice(0, limit)) out += `    ${pc.red("•")} ${p}\n`;
  return out;
}

/** "0 of 3,145,728 routed elements not exact": how run and inspect say an Fp4Exactness. */
export function describeFp4Exactness(x: Fp4Exactness): string {
  return `${x.inexact.toLocaleString("en-US")} of ${x.elements.toLocaleString("en-US")} routed elements not exact`;
}

/** describeFp4Exactness of the blocks together, then "(3 FP4 blocks)", naming the blocks with any. */
function exactnessLine(byBlock: Map<string, Fp4Exactness>): string {
  if (byBlock.size === 0) return "no FP4 blocks read";
  let elements = 0;
  let inexact = 0;
  for (const x of byBlock.values()) {
    elements += x.elements;
    inexact += x.inexact;
  }
  const where = [...byBlock]
    .filter(([, x]) => x.inexact > 0)
    .map(([b, x]) => `${b} ${x.inexact.toLocaleString("en-US")}`);
  return `${describeFp4Exactness({ elements, inexact })} (${byBlock.size} FP4 blocks${where.length > 0 ? `; ${where.join(", ")}` : ""})`;
}

function shapeOf(c: MoEConfig): string {
  return `E=${c.numExperts} H=${c.hidden} I=${c.intermediate} top-${c.topK}, ${c.numShared} shared`;
}
