/**
 * Writes MoE layers in DeepSeek-V4's checkpoint layout (config.json, model.safetensors.index.json,
 * shards model-0000k-of-0000n.safetensors split by a size budget), so tests and users can make small
 * V4-layout checkpoints that megamoe and other safetensors readers load. See docs/weights.md.
 */
import fs from "node:fs";
import path from "node:path";
import {
  describeValue,
  type MoEConfig,
  QUANT_BLOCK,
  unknownFieldProblem,
  validateConfig,
} from "../config/config.js";
import { type OverwriteOption, overwriteProblem, writeAside } from "../io/write-aside.js";
import {
  CheckpointError,
  CONFIG_FILE,
  INDEX_FILE,
  shardName,
  type V4Block,
  type V4Projection,
  v4Names,
} from "./checkpoint-format.js";
import { SafetensorsWriter, type TensorSpec, WRITE_DTYPE_SIZES, type WriteDtype } from "./safetensors.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  type MoEWeightSource,
  MXFP4_GROUP,
  type RoutedExpertWeights,
} from "./types.js";

export interface SaveLayer {
  /** `layers.{L}` or `mtp.{i}`. */
  block: V4Block;
  source: MoEWeightSource;
}

/** A tensor outside the MoE blocks (embeddings, norms, attention…), written as given. */
export interface ExtraTensor {
  name: string;
  dtype: WriteDtype;
  shape: number[];
  data: ArrayBufferView;
}

export interface SaveCheckpointOptions extends OverwriteOption {
  /** Most bytes of tensor data per shard (a tensor larger than this gets a shard of its own); default 4 GiB. */
  shardBytes?: number;
  /** num_hidden_layers (default: the highest layer written + 1). */
  numHiddenLayers?: number;
  /** vocab_size when no layer is hash-routed (else taken from tid2eid). */
  vocab?: number;
  /** Tensors outside the MoE blocks, written first. */
  extraTensors?: ExtraTensor[];
  /** Extra config.json keys (added last, so they may also override). */
  config?: Record<string, unknown>;
  /** Called after each expert, shared expert and gate written: (done, total). */
  onProgress?: (done: number, total: number) => void;
}

const OPTION_FIELDS = [
  "shardBytes",
  "numHiddenLayers",
  "vocab",
  "extraTensors",
  "config",
  "onProgress",
  "overwrite",
] as const;

/**
 * A directory that holds anything is refused unless `overwrite` is on: its checkpoint (or whatever else
 * it holds) would be replaced file by file.
 */
function checkTargetDir(dir: string, overwrite: boolean): void {
  let entries: string[];
  try {
    if (!fs.statSync(dir).isDirectory())
      throw new CheckpointError(`saveCheckpoint: ${dir} is a file, not a directory`);
    entries = fs.readdirSync(dir);
  } catch (e) {
    if (e instanceof CheckpointError) throw e;
    const code = (e as NodeJS.ErrnoException).code;
    if (code === "ENOENT") return; // created by the save
    throw new CheckpointError(`saveCheckpoint: ${dir}: ${(e as Error).message}`);
  }
  if (entries.length > 0 && !overwrite) {
    const shown = entries.sort().slice(0, 3).join(", ") + (entries.length > 3 ? ", …" : "");
    throw new CheckpointError(
      `saveCheckpoint: directory ${dir} is not empty (${entries.length} entries: ${shown}); pass { overwrite: true } to replace the checkpoint in it`,
    );
  }
}

/** The shards an existing index names (plain shard names only), for removal once a new checkpoint replaces it. */
function indexedShards(dir: string): string[] {
  try {
    const index = JSON.parse(fs.readFileSync(path.join(dir, INDEX_FILE), "utf8")) as {
      weight_map?: Record<string, unknown>;
    };
    const names = Object.values(index.weight_map ?? {}).filter(
      (f): f is string => typeof f === "string" && /^model-\d{5}-of-\d{5}\.safetensors$/.test(f),
    );
    return [...new Set(names)];
  } catch {
    return []; // no index, or one not ours to read: nothing is removed
  }
}

/** Removes the folders a failed save created (`first`, the outermost, and those inside it down to `dir`). */
function removeCreated(dir: string, first: string | undefined): void {
  if (first === undefined) return;
  const top = path.resolve(first);
  for (let at = path.resolve(dir); ; at = path.dirname(at)) {
    try {
      fs.rmdirSync(at);
    } catch {
      return; // not empty: something else was put there meanwhile
    }
    if (at === top || path.dirname(at) === at) return;
  }
}

/** The E8M0 byte of an exact power of two in [2^−127, 2^127]; else a CheckpointError naming the tensor. */
function e8m0Of(scale: number, name: string, i: number): number {
  const e = Math.log2(scale);
  if (!(Number.isInteger(e) && e >= -127 && e <= 127 && 2 ** e === scale)) {
    throw new CheckpointError(
      `tensor ${name}[${i}]: scale ${scale} is not a power of two in [2^-127, 2^127]; the V4 layout stores E8M0 block scales`,
    );
  }
  return e + 127;
}

interface Planned {
  spec: TensorSpec;
  /** Bytes in the file. */
  bytes: number;
}

function shapeCheck(what: string, got: [number, number], want: [number, number]): void {
  if (got[0] !== want[0] || got[1] !== want[1]) {
    throw new CheckpointError(`${what} is [${got.join(", ")}], expected [${want.join(", ")}]`);
  }
}

/** The three projections' tensors of one MLP, [rows, cols] per projection. */
function mlpSpecs(
  name: (w: V4Projection, p: "weight" | "scale") => string,
  hidden: number,
  inter: number,
  fp4: boolean,
): Planned[] {
  const out: Planned[] = [];
  for (const w of ["w1", "w3", "w2"] as const) {
    const [rows, cols] = w === "w2" ? [hidden, inter] : [inter, hidden];
    const weight: TensorSpec = fp4
      ? { name: name(w, "weight"), dtype: "I8", shape: [rows, cols / 2] }
      : { name: name(w, "weight"), dtype: "F8_E4M3", shape: [rows, cols] };
    const scale: TensorSpec = fp4
      ? { name: name(w, "scale"), dtype: "F8_E8M0", shape: [rows, cols / MXFP4_GROUP] }
      : { name: name(w, "scale"), dtype: "F8_E8M0", shape: [rows / QUANT_BLOCK, cols / QUANT_BLOCK] };
    out.push(planned(weight), planned(scale));
  }
  return out;
}

function planned(spec: TensorSpec): Planned {
  return { spec, bytes: spec.shape.reduce((a, b) => a * b, 1) * WRITE_DTYPE_SIZES[spec.dtype] };
}

function blockSpecs(block: V4Block, c: MoEConfig, vocab: number | null): Planned[] {
  const out: Planned[] = [];
  const fp4 = c.expertFormat === "fp4";
  for (let e = 0; e < c.numExperts; e++) {
    out.push(...mlpSpecs((w, p) => v4Names.routed(block, e, w, p), c.hidden, c.intermediate, fp4));
  }
  if (c.numShared > 0) {
    out.push(
      ...mlpSpecs((w, p) => v4Names.shared(block, w, p), c.hidden, c.intermediate * c.numShared, false),
    );
  }
  out.push(planned({ name: v4Names.gateWeight(block), dtype: "BF16", shape: [c.numExperts, c.hidden] }));
  if (c.router.hashRouted === true) {
    out.push(planned({ name: v4Names.tid2eid(block), dtype: "I64", shape: [vocab ?? 0, c.topK] }));
  } else if (c.router.correctionBias) {
    out.push(planned({ name: v4Names.gateBias(block), dtype: "F32", shape: [c.numExperts] }));
  }
  return out;
}

/** The config.json keys of a layer config (V4's names). */
function configJson(
  c: MoEConfig,
  numLayers: number,
  numHash: number,
  numMtp: number,
  vocab: number | null,
  expertDtype: string | null,
) {
  return {
    architectures: ["DeepseekV4ForCausalLM"],
    model_type: "deepseek_v4",
    hidden_size: c.hidden,
    moe_intermediate_size: c.intermediate,
    n_routed_experts: c.numExperts,
    num_experts_per_tok: c.topK,
    n_shared_experts: c.numShared,
    num_hidden_layers: numLayers,
    num_hash_layers: numHash,
    num_nextn_predict_layers: numMtp,
    scoring_func: c.router.scoring,
    topk_method: "noaux_tc",
    routed_scaling_factor: c.router.routedScalingFactor,
    norm_topk_prob: c.router.renormalize,
    swiglu_limit: c.swigluClamp ?? 0,
    ...(c.router.nGroup > 1 ? { n_group: c.router.nGroup, topk_group: c.router.topkGroup } : {}),
    ...(vocab === null ? {} : { vocab_size: vocab }),
    ...(expertDtype === null ? {} : { expert_dtype: expertDtype }),
    quantization_config: {
      quant_method: "fp8",
      fmt: "e4m3",
      ...(c.scaleFormat === "ue8m0" ? { scale_fmt: "ue8m0" } : {}),
      weight_block_size: [QUANT_BLOCK, QUANT_BLOCK],
    },
  };
}

/** The layers must agree on everything config.json holds once. */
function checkSameModel(layers: SaveLayer[]): void {
  const a = layers[0].source.config;
  for (const { block, source } of layers.slice(1)) {
    const b = source.config;
    const same =
      a.hidden === b.hidden &&
      a.intermediate === b.intermediate &&
      a.numExperts === b.numExperts &&
      a.topK === b.topK &&
      a.numShared === b.numShared &&
      a.swigluClamp === b.swigluClamp &&
      a.scaleFormat === b.scaleFormat &&
      a.router.scoring === b.router.scoring &&
      a.router.renormalize === b.router.renormalize &&
      a.router.routedScalingFactor === b.router.routedScalingFactor &&
      a.router.nGroup === b.router.nGroup &&
      a.router.topkGroup === b.router.topkGroup;
    if (!same) {
      throw new CheckpointError(
        `${block}: its config differs from ${layers[0].block}'s in a key config.json holds once`,
      );
    }
  }
}

/**
 * Writes `layers` as a V4 checkpoint in `dir` (created if needed). Hash-routed layers must be layers
 * 0..h−1 (num_hash_layers = h). expert_dtype is written when every block has the same expert format
 * (else readers decide per block from the header dtype). Experts are read from each source one at a
 * time and written straight to their shard offsets.
 *
 * A directory that holds anything is refused unless `overwrite` is on. Every file is written under a
 * temporary name and renamed into place only when all are complete, shards first, then the index and
 * config.json (writeAside): a source that throws midway leaves `dir` as it was (a folder the save made is
 * removed again). Replacing a checkpoint also removes the shards its old index named that the new one
 * does not.
 */
export function saveCheckpoint(dir: string, layers: SaveLayer[], opts: SaveCheckpointOptions = {}): void {
  if (typeof dir !== "string")
    throw new CheckpointError(`saveCheckpoint: dir must be a string, got ${describeValue(dir)}`);
  if (typeof opts !== "object" || opts === null || Array.isArray(opts))
    throw new CheckpointError(`saveCheckpoint: options must be an object, got ${describeValue(opts)}`);
  const optionProblem =
    unknownFieldProblem("option", opts, OPTION_FIELDS) ?? overwriteProblem(opts.overwrite);
  if (optionProblem !== null) throw new CheckpointError(`saveCheckpoint: ${optionProblem}`);
  if (layers.length === 0) throw new CheckpointError("saveCheckpoint: no layers to write");
  for (const l of layers) {
    const unknown = unknownFieldProblem("layer", l, ["block", "source"]);
    if (unknown !== null) throw new CheckpointError(`saveCheckpoint: ${unknown}`);
    validateConfig(l.source.config);
  }
  checkSameModel(layers);
  const seen = new Set<string>();
  let maxLayer = -1;
  let numHash = 0;
  let numMtp = 0;
  let vocab: number | null = opts.vocab ?? null;
  for (const { block, source } of layers) {
    if (seen.has(block)) throw new CheckpointError(`saveCheckpoint: block ${block} given twice`);
    seen.add(block);
    const m = /^(layers|mtp)\.(\d+)$/.exec(block);
    if (m === null) throw new CheckpointError(`saveCheckpoint: block "${block}" is not layers.L or mtp.I`);
    const n = Number(m[2]);
    const hash = source.config.router.hashRouted === true;
    if (m[1] === "layers") maxLayer = Math.max(maxLayer, n);
    else {
      numMtp = Math.max(numMtp, n + 1);
      if (hash) throw new CheckpointError(`saveCheckpoint: ${block}: MTP blocks are score-routed in V4`);
    }
    if (hash) {
      numHash++;
      const t = source.gate().tid2eid;
      if (t === undefined || t === null)
        throw new CheckpointError(`saveCheckpoint: ${block} is hash-routed but its gate has no tid2eid`);
      const v = t.length / source.config.topK;
      if (vocab !== null && vocab !== v) {
        throw new CheckpointError(
          `saveCheckpoint: ${block}'s tid2eid has ${v} rows, but the vocabulary is ${vocab}`,
        );
      }
      vocab = v;
    }
  }
  for (let l = 0; l < numHash; l++) {
    const given = layers.find((x) => x.block === `layers.${l}`);
    if (given === undefined || given.source.config.router.hashRouted !== true) {
      throw new CheckpointError(
        `saveCheckpoint: ${numHash} hash-routed layers must be layers 0..${numHash - 1} (V4's num_hash_layers), but layers.${l} is ${given === undefined ? "not given" : "score-routed"}`,
      );
    }
  }
  const numLayers = opts.numHiddenLayers ?? maxLayer + 1;
  if (maxLayer >= numLayers)
    throw new CheckpointError(`saveCheckpoint: layers.${maxLayer} ≥ numHiddenLayers ${numLayers}`);
  const formats = new Set(layers.map((l) => l.source.config.expertFormat ?? "fp8"));
  const expertDtype = formats.size === 1 ? [...formats][0] : null;

  // Plan: every tensor in order, shards cut at the budget.
  const plan: Planned[] = [];
  for (const t of opts.extraTensors ?? [])
    plan.push(planned({ name: t.name, dtype: t.dtype, shape: t.shape }));
  for (const { block, source } of layers) plan.push(...blockSpecs(block, source.config, vocab));
  const budget = opts.shardBytes ?? 4 * 1024 ** 3;
  if (!(budget > 0)) throw new CheckpointError(`saveCheckpoint: shardBytes must be positive, got ${budget}`);
  const groups: Planned[][] = [[]];
  let used = 0;
  for (const p of plan) {
    if (used + p.bytes > budget && groups[groups.length - 1].length > 0) {
      groups.push([]);
      used = 0;
    }
    groups[groups.length - 1].push(p);
    used += p.bytes;
  }

  const overwrite = opts.overwrite === true;
  checkTargetDir(dir, overwrite);
  const n = groups.length;
  const names = [...groups.map((_, k) => shardName(k + 1, n)), INDEX_FILE, CONFIG_FILE];
  const replaced = overwrite ? indexedShards(dir).filter((f) => !names.includes(f)) : [];
  let created: string | undefined;
  try {
    created = fs.mkdirSync(dir, { recursive: true });
  } catch (e) {
    throw new CheckpointError(`saveCheckpoint: cannot create ${dir}: ${(e as Error).message}`);
  }
  const files = names.map((f) => path.join(dir, f));
  try {
    writeAside(files, (temps) => {
      const weightMap = writeShards(temps, files, groups, layers, opts);
      const totalSize = plan.reduce((s, p) => s + p.bytes, 0);
      fs.writeFileSync(
        temps[n],
        `${JSON.stringify({ metadata: { total_size: totalSize }, weight_map: weightMap }, null, 2)}\n`,
      );
      const config = {
        ...configJson(layers[0].source.config, numLayers, numHash, numMtp, vocab, expertDtype),
        ...opts.config,
      };
      fs.writeFileSync(temps[n + 1], `${JSON.stringify(config, null, 2)}\n`);
    });
  } catch (err) {
    removeCreated(dir, created);
    throw err;
  }
  for (const f of replaced) fs.rmSync(path.join(dir, f), { force: true });
}

/**
 * Writes the shards' tensors, shard k to `temps[k]` (errors name `files[k]`), and returns the index's
 * weight map.
 */
function writeShards(
  temps: string[],
  files: string[],
  groups: Planned[][],
  layers: SaveLayer[],
  opts: SaveCheckpointOptions,
): Record<string, string> {
  const n = groups.length;
  const shardOf = new Map<string, number>();
  const writers: SafetensorsWriter[] = [];
  const weightMap: Record<string, string> = {};
  try {
    groups.forEach((g, k) => {
      // Widest dtypes first: each tensor then starts aligned to its element size, with no gaps.
      const specs = g
        .map((p) => p.spec)
        .sort((a, b) => WRITE_DTYPE_SIZES[b.dtype] - WRITE_DTYPE_SIZES[a.dtype]);
      writers.push(new SafetensorsWriter(temps[k], specs, { format: "pt" }, files[k]));
      for (const p of g) {
        shardOf.set(p.spec.name, k);
        weightMap[p.spec.name] = shardName(k + 1, n);
      }
    });
    const write = (name: string, data: ArrayBufferView) => {
      const k = shardOf.get(name);
      if (k === undefined) throw new CheckpointError(`saveCheckpoint: tensor ${name} was not planned`);
      writers[k].write(name, data);
    };
    for (const t of opts.extraTensors ?? []) write(t.name, t.data);
    const total = layers.reduce(
      (s, l) => s + l.source.config.numExperts + (l.source.config.numShared > 0 ? 1 : 0) + 1,
      0,
    );
    let done = 0;
    for (const { block, source } of layers) {
      const c = source.config;
      for (let e = 0; e < c.numExperts; e++) {
        writeExpert(
          write,
          (w, p) => v4Names.routed(block, e, w, p),
          source.expert(e),
          c,
          c.intermediate,
          `${block} expert ${e}`,
        );
        opts.onProgress?.(++done, total);
      }
      if (c.numShared > 0) {
        const s = source.shared();
        if (s === null)
          throw new CheckpointError(
            `saveCheckpoint: ${block}'s config has shared experts but its source has none`,
          );
        writeExpert(
          write,
          (w, p) => v4Names.shared(block, w, p),
          s,
          c,
          c.intermediate * c.numShared,
          `${block} shared expert`,
        );
        opts.onProgress?.(++done, total);
      }
      const gate = source.gate();
      write(v4Names.gateWeight(block), gate.weight);
      if (c.router.hashRouted === true) {
        write(
          v4Names.tid2eid(block),
          BigInt64Array.from(gate.tid2eid as Int32Array, (v) => BigInt(v)),
        );
      } else if (c.router.correctionBias) {
        if (gate.bias === null)
          throw new CheckpointError(
            `saveCheckpoint: ${block}'s config has a correction bias but its gate has none`,
          );
        write(v4Names.gateBias(block), gate.bias);
      }
      opts.onProgress?.(++done, total);
    }
    for (const w of writers) w.close();
  } catch (err) {
    for (const w of writers) w.abort();
    throw err;
  }
  return weightMap;
}

type Write = (name: string, data: ArrayBufferView) => void;

/** One MLP's six tensors: W1's gate rows as w1, its up rows as w3, W2 as w2. */
function writeExpert(
  write: Write,
  name: (w: V4Projection, p: "weight" | "scale") => string,
  x: RoutedExpertWeights | ExpertWeights,
  c: MoEConfig,
  inter: number,
  what: string,
): void {
  const h = c.hidden;
  shapeCheck(`${what}: W1`, [x.w1.rows, x.w1.cols], [2 * inter, h]);
  shapeCheck(`${what}: W2`, [x.w2.rows, x.w2.cols], [h, inter]);
  if (x.format === "fp4") {
    const gpr = h / MXFP4_GROUP;
    write(name("w1", "weight"), x.w1.packed.subarray(0, (inter * h) / 2));
    write(name("w1", "scale"), x.w1.scales.subarray(0, inter * gpr));
    write(name("w3", "weight"), x.w1.packed.subarray((inter * h) / 2));
    write(name("w3", "scale"), x.w1.scales.subarray(inter * gpr));
    write(name("w2", "weight"), x.w2.packed);
    write(name("w2", "scale"), x.w2.scales);
    return;
  }
  const rows = (m: BlockQuantized, r0: number, r1: number) => {
    const bc = m.cols / QUANT_BLOCK;
    return {
      q: m.q.subarray(r0 * m.cols, r1 * m.cols),
      scales: m.scales.subarray((r0 / QUANT_BLOCK) * bc, (r1 / QUANT_BLOCK) * bc),
    };
  };
  const parts: [V4Projection, { q: Uint8Array; scales: Float32Array }][] = [
    ["w1", rows(x.w1, 0, inter)],
    ["w3", rows(x.w1, inter, 2 * inter)],
    ["w2", rows(x.w2, 0, h)],
  ];
  for (const [w, p] of parts) {
    write(name(w, "weight"), p.q);
    write(
      name(w, "scale"),
      Uint8Array.from(p.scales, (s, i) => e8m0Of(s, name(w, "scale"), i)),
    );
  }
}
