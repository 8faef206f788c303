/**
 * DeepSeek-V4 checkpoints as they ship: a directory with config.json, model.safetensors.index.json and
 * shards model-0000k-of-0000n.safetensors, MoE tensors under `layers.{L}.ffn.` and `mtp.{i}.ffn.`
 * (docs/weights.md lists the names, dtypes and shapes, with their sources).
 *
 * `openCheckpoint` reads and checks config.json and the index; `layer(L)` / `mtp(i)` check that layer's
 * tensor headers against config.json and return a MoEWeightSource that reads experts one at a time with
 * positioned reads at their shard offsets (never a whole shard in memory). Every problem throws
 * CheckpointError naming the file and, where there is one, the tensor.
 *
 * The format (names, config.json, the index, the tensors a block holds) is in checkpoint-format.ts; the
 * lazy reader of one block in checkpoint-layer.ts.
 */
import fs from "node:fs";
import path from "node:path";
import {
  ConfigError,
  checkOptionFields,
  describeValue,
  type ExpertFormat,
  type MoEConfig,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import {
  CheckpointError,
  CONFIG_FILE,
  type Expected,
  expertFormatOfDtype,
  fileExists,
  INDEX_FILE,
  parseIndex,
  parseV4Config,
  readJson,
  shapeText,
  type V4Block,
  type V4ModelConfig,
  v4BlockTensors,
  v4Names,
} from "./checkpoint-format.js";
import { CheckpointLayer } from "./checkpoint-layer.js";
import { loadMoEWeights } from "./moe-file.js";
import { readSafetensorsHeader, type SafetensorsHeader, type TensorInfo } from "./safetensors.js";
import { type MoEWeightSource, MXFP4_GROUP } from "./types.js";

export interface LayerOptions {
  /** Largest token count the layer accepts (default 8192). */
  maxTokens?: number;
  /** Routed experts kept in memory after reading (default 2). */
  cachedExperts?: number;
}

const LAYER_OPTIONS: readonly (keyof LayerOptions)[] = ["maxTokens", "cachedExperts"];

/** Throws CheckpointError unless `opts` is an object of LayerOptions fields: a misspelt one would be ignored. */
function checkLayerOptions(where: string, opts: unknown): void {
  checkOptionFields(`${where} options`, opts, LAYER_OPTIONS, (message) => new CheckpointError(message));
}

/** Throws CheckpointError unless `index` is an integer: "1" must not read as layer 1 (nor 1.5 as out of range). */
function checkBlockIndex(what: string, index: unknown): void {
  if (typeof index !== "number" || !Number.isInteger(index)) {
    throw new CheckpointError(`${what} must be an integer, got ${describeValue(index)}`);
  }
}

export interface LayerSummary {
  block: V4Block;
  routing: "hash" | "score";
}

/** Where one tensor lies: its shard and its bytes there. */
export interface TensorLocation {
  file: string;
  header: SafetensorsHeader;
  info: TensorInfo;
}

export class Checkpoint {
  /** tensor name → shard file name. */
  readonly weightMap: Map<string, string>;
  /** Shard file names, sorted. */
  readonly shards: string[];
  private readonly headers = new Map<string, SafetensorsHeader>();

  constructor(
    /** The checkpoint directory. */
    readonly dir: string,
    readonly model: V4ModelConfig,
    weightMap: Map<string, string>,
    /** The index's metadata.total_size, when it has one. */
    readonly totalSize: number | null,
  ) {
    this.weightMap = weightMap;
    this.shards = [...new Set(weightMap.values())].sort();
    for (const shard of this.shards) {
      const file = path.join(dir, shard);
      if (!fileExists(file)) {
        const first = [...weightMap].find(([, s]) => s === shard)?.[0];
        throw new CheckpointError(`${file}: missing shard (the index maps ${first} and others to it)`);
      }
    }
  }

  /** A shard's checked header (read once). */
  header(shard: string): SafetensorsHeader {
    let h = this.headers.get(shard);
    if (h === undefined) {
      h = readSafetensorsHeader(path.join(this.dir, shard));
      this.headers.set(shard, h);
    }
    return h;
  }

  /** Where tensor `name` lies; throws when the index does not name it or its shard lacks it. */
  locate(name: string): TensorLocation {
    const shard = this.weightMap.get(name);
    if (shard === undefined)
      throw new CheckpointError(`${path.join(this.dir, INDEX_FILE)}: no tensor ${name}`);
    const header = this.header(shard);
    const info = header.tensors.get(name);
    if (info === undefined) {
      throw new CheckpointError(
        `${header.path}: tensor ${name} is missing, though the index maps it to this shard`,
      );
    }
    return { file: header.path, header, info };
  }

  has(name: string): boolean {
    return this.weightMap.has(name);
  }

  /** The MoE blocks: layers 0..numLayers−1 (hash-routed below num_hash_layers), then the MTP blocks. */
  blocks(): LayerSummary[] {
    const out: LayerSummary[] = [];
    for (let l = 0; l < this.model.numLayers; l++) {
      out.push({ block: `layers.${l}`, routing: l < this.model.numHashLayers ? "hash" : "score" });
    }
    for (let i = 0; i < this.model.numMtp; i++) out.push({ block: `mtp.${i}`, routing: "score" });
    return out;
  }

  /** Layer L's MoE weights (0 ≤ L < num_hidden_layers). */
  layer(l: number, opts: LayerOptions = {}): CheckpointLayer {
    checkBlockIndex("layer", l);
    checkLayerOptions("layer", opts);
    if (l < 0 || l >= this.model.numLayers) {
      throw new CheckpointError(
        `${path.join(this.dir, CONFIG_FILE)}: layer ${l} is out of range: num_hidden_layers is ${this.model.numLayers} (layers 0..${this.model.numLayers - 1})`,
      );
    }
    return this.block(`layers.${l}`, l < this.model.numHashLayers, opts);
  }

  /** MTP block i's MoE weights (score-routed, like the layers above num_hash_layers). */
  mtp(i: number, opts: LayerOptions = {}): CheckpointLayer {
    checkBlockIndex("MTP block", i);
    checkLayerOptions("mtp", opts);
    const block: V4Block = `mtp.${i}`;
    const present =
      Number.isInteger(i) && i >= 0 && (i < this.model.numMtp || this.has(v4Names.gateWeight(block)));
    if (!present) {
      throw new CheckpointError(
        `${path.join(this.dir, CONFIG_FILE)}: no MTP block ${i}: num_nextn_predict_layers is ${this.model.numMtp} and the index has no ${v4Names.gateWeight(block)}`,
      );
    }
    return this.block(block, false, opts);
  }

  /** A block by name: "layers.3", "mtp.0", or a bare layer number "3". */
  byName(name: string, opts: LayerOptions = {}): CheckpointLayer {
    if (typeof name !== "string") {
      throw new CheckpointError(`layer name must be a string, got ${describeValue(name)}`);
    }
    const m = /^(?:layers\.)?(\d+)$/.exec(name);
    if (m !== null) return this.layer(Number(m[1]), opts);
    const t = /^mtp\.(\d+)$/.exec(name);
    if (t !== null) return this.mtp(Number(t[1]), opts);
    throw new CheckpointError(`layer "${name}": expected a layer number, layers.L or mtp.I`);
  }

  /** The expert format of a block: config.json's expert_dtype, checked against a routed expert's dtype. */
  expertFormat(block: V4Block): ExpertFormat {
    const { file, info } = this.locate(v4Names.routed(block, 0, "w1", "weight"));
    const byDtype = expertFormatOfDtype(info.dtype);
    const name = v4Names.routed(block, 0, "w1", "weight");
    if (byDtype === null) {
      throw new CheckpointError(
        `${file}: tensor ${name} has dtype ${info.dtype}: not a routed-expert format megamoe knows (I8/U8/F4: FP4; F8_E4M3: FP8)`,
      );
    }
    const declared = this.model.expertDtype;
    if (declared !== null && declared !== byDtype) {
      throw new CheckpointError(
        `${file}: tensor ${name} has dtype ${info.dtype} (${byDtype} experts), but ${CONFIG_FILE} says expert_dtype "${declared}"`,
      );
    }
    return byDtype;
  }

  /** The MoEConfig of a block, from config.json and the block's expert dtype. */
  blockConfig(block: V4Block, hash: boolean, opts: LayerOptions = {}): ValidatedConfig {
    const m = this.model;
    const config: MoEConfig = {
      name: `${path.basename(path.resolve(this.dir))} ${block}`,
      numExperts: m.numExperts,
      hidden: m.hidden,
      intermediate: m.intermediate,
      topK: m.topK,
      numShared: m.numShared,
      ranks: 1,
      swigluClamp: m.swigluLimit,
      scaleFormat: m.scaleFormat,
      router: {
        scoring: m.scoring,
        nGroup: m.nGroup,
        topkGroup: m.topkGroup,
        correctionBias: !hash,
        renormalize: m.renormalize,
        routedScalingFactor: m.routedScalingFactor,
        ...(hash ? { hashRouted: true } : {}),
      },
      expertFormat: this.expertFormat(block),
      maxTokens: opts.maxTokens ?? 8192,
    };
    let valid: ValidatedConfig;
    try {
      valid = validateConfig(config);
    } catch (err) {
      if (err instanceof ConfigError) {
        throw new CheckpointError(`${path.join(this.dir, CONFIG_FILE)}: ${block}: ${err.message}`);
      }
      throw err;
    }
    if (
      config.expertFormat === "fp4" &&
      (m.hidden % MXFP4_GROUP !== 0 || m.intermediate % MXFP4_GROUP !== 0)
    ) {
      throw new CheckpointError(
        `${path.join(this.dir, CONFIG_FILE)}: FP4 experts need hidden and intermediate multiples of 32`,
      );
    }
    return valid;
  }

  private block(block: V4Block, hash: boolean, opts: LayerOptions): CheckpointLayer {
    const config = this.blockConfig(block, hash, opts);
    const locations = new Map<string, TensorLocation>();
    for (const t of v4BlockTensors(block, config, this.model.vocab)) {
      locations.set(t.name, this.check(t));
    }
    return new CheckpointLayer(block, config, locations, opts.cachedExperts ?? 2);
  }

  /** Checks one tensor's presence, dtype, shape and byte length against what config.json implies. */
  private check(t: Expected): TensorLocation {
    const loc = this.locate(t.name);
    const { info, file } = loc;
    if (!t.dtypes.includes(info.dtype)) {
      throw new CheckpointError(
        `${file}: tensor ${t.name} has dtype ${info.dtype}, expected ${t.dtypes.join(" or ")}`,
      );
    }
    let want = t.shape;
    // An F4 header counts elements: [rows, cols] rather than the bytes' [rows, cols/2].
    if (info.dtype === "F4" && want.length === 2) want = [want[0], want[1] * 2];
    const fits =
      info.shape.length === want.length && info.shape.every((d, i) => want[i] === -1 || d === want[i]);
    if (!fits) {
      throw new CheckpointError(
        `${file}: tensor ${t.name} has shape ${shapeText(info.shape)}, but ${CONFIG_FILE} implies ${shapeText(want).replace("-1", "vocab")}`,
      );
    }
    if (t.bytes >= 0 && info.end - info.begin !== t.bytes) {
      throw new CheckpointError(
        `${file}: tensor ${t.name} holds ${info.end - info.begin} bytes, expected ${t.bytes}`,
      );
    }
    return loc;
  }
}

// ---------------------------------------------------------------------------------------------------
// Opening

/** A single legacy file: the layer megamoe saved (its metadata holds the config), V3-style FP8 names. */
export interface LegacyFile {
  kind: "file";
  file: string;
  config: MoEConfig;
  layer(opts?: LayerOptions): MoEWeightSource;
}

/**
 * Opens a V4 checkpoint directory (config.json + index + shards), or a single .safetensors file: one
 * with V4 names beside a config.json is a one-shard checkpoint; one saved by megamoe (its metadata
 * holds the layer's config) loads as before.
 */
export function openCheckpoint(target: string): Checkpoint | LegacyFile {
  let stat: fs.Stats;
  try {
    stat = fs.statSync(target);
  } catch (err) {
    throw new CheckpointError(`${target}: cannot open: ${(err as Error).message}`);
  }
  if (stat.isDirectory()) {
    const configFile = path.join(target, CONFIG_FILE);
    const indexFile = path.join(target, INDEX_FILE);
    if (!fileExists(configFile))
      throw new CheckpointError(`${configFile}: missing: a V4 checkpoint needs its config.json`);
    const model = parseV4Config(configFile, readJson(configFile));
    if (!fileExists(indexFile)) {
      // A one-shard checkpoint may ship without an index: its only .safetensors file is the map.
      let names: string[];
      try {
        names = fs.readdirSync(target);
      } catch (err) {
        throw new CheckpointError(`${target}: cannot list: ${(err as Error).message}`);
      }
      const files = names.filter((f) => f.endsWith(".safetensors"));
      if (files.length !== 1) {
        throw new CheckpointError(
          `${indexFile}: missing, and the directory holds ${files.length} .safetensors files, not one`,
        );
      }
      return singleShard(target, files[0], model);
    }
    const { weightMap, totalSize } = parseIndex(indexFile, readJson(indexFile));
    return new Checkpoint(target, model, weightMap, totalSize);
  }
  const header = readSafetensorsHeader(target);
  const dir = path.dirname(target);
  const saved = header.metadata["megamoe.config"];
  const hasV4Names = [...header.tensors.keys()].some((n) => /^(layers|mtp)\.\d+\.ffn\./.test(n));
  if (hasV4Names && fileExists(path.join(dir, CONFIG_FILE))) {
    return singleShard(
      dir,
      path.basename(target),
      parseV4Config(path.join(dir, CONFIG_FILE), readJson(path.join(dir, CONFIG_FILE))),
    );
  }
  if (saved !== undefined) {
    let config: MoEConfig;
    try {
      config = validateConfig(JSON.parse(saved) as MoEConfig);
    } catch (err) {
      throw new CheckpointError(
        `${target}: metadata megamoe.config is not a valid layer config: ${(err as Error).message}`,
      );
    }
    return {
      kind: "file",
      file: target,
      config,
      layer: (opts: LayerOptions = {}) => {
        checkLayerOptions("layer", opts);
        return loadMoEWeights(
          target,
          { ...config, maxTokens: opts.maxTokens ?? config.maxTokens },
          { cachedExperts: opts.cachedExperts },
        );
      },
    };
  }
  throw new CheckpointError(
    hasV4Names
      ? `${target}: holds V4 tensor names but there is no ${CONFIG_FILE} beside it`
      : `${target}: neither a V4 shard (layers.L.ffn.… names beside a ${CONFIG_FILE}) nor a file megamoe saved (no megamoe.config metadata)`,
  );
}

function singleShard(dir: string, shard: string, model: V4ModelConfig): Checkpoint {
  const header = readSafetensorsHeader(path.join(dir, shard));
  const weightMap = new Map([...header.tensors.keys()].map((n) => [n, shard]));
  return new Checkpoint(dir, model, weightMap, null);
}

/** Deterministic token ids in [0, vocab) for a seed (runs of hash-routed layers on made-up input). */
export function generateTokenIds(seed: number, tokens: number, vocab: number): Int32Array {
  const out = new Int32Array(tokens);
  let a = (seed ^ 0x9e3779b9) >>> 0;
  for (let t = 0; t < tokens; t++) {
    a = (a + 0x6d2b79f5) >>> 0;
    let r = Math.imul(a ^ (a >>> 15), 1 | a);
    r = (r + Math.imul(r ^ (r >>> 7), 61 | r)) ^ r;
    out[t] = ((r ^ (r >>> 14)) >>> 0) % vocab;
  }
  return out;
}
