/**
 * DeepSeek-V4 checkpoints as they ship: a directory with config.json, model.safetensors.index.json and
 * shards model-0000k-of-0000n.safetensors, MoE tensors under `layers.{L}.ffn.` and `mtp.{i}.ffn.`
 * (docs/weights.md lists the names, dtypes and shapes, with their sources).
 *
 * `openCheckpoint` reads and checks config.json and the index; `layer(L)` / `mtp(i)` check that layer's
 * tensor headers against config.json and return a MoEWeightSource that reads experts one at a time with
 * positioned reads at their shard offsets (never a whole shard in memory). Every problem throws
 * CheckpointError naming the file and, where there is one, the tensor.
 */
import fs from "node:fs";
import path from "node:path";
import {
  ConfigError,
  type ExpertFormat,
  type MoEConfig,
  QUANT_BLOCK,
  type ScaleFormat,
  type ScoringFunction,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { E4M3_DECODE } from "../numerics/fp8.js";
import { ExpertCache } from "./expert-cache.js";
import {
  loadMoEWeights,
  openForReading,
  readExactly,
  readSafetensorsHeader,
  SafetensorsError,
  type SafetensorsHeader,
  type TensorInfo,
} from "./safetensors.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  type Fp4ExpertWeights,
  type GateWeights,
  type MoEWeightSource,
  MXFP4_GROUP,
  type Mxfp4Matrix,
  type RoutedExpertWeights,
} from "./types.js";

export class CheckpointError extends SafetensorsError {
  override name = "CheckpointError";
}

export const CONFIG_FILE = "config.json";
export const INDEX_FILE = "model.safetensors.index.json";
/** E8M0's only non-number: 0xFF is NaN (there is no zero and no infinity). */
export const E8M0_NAN_BYTE = 0xff;

/** The shard file name of shard k (1-based) of n, as DeepSeek's and Hugging Face's checkpoints name them. */
export function shardName(k: number, n: number): string {
  const pad = (v: number) => String(v).padStart(5, "0");
  return `model-${pad(k)}-of-${pad(n)}.safetensors`;
}

// ---------------------------------------------------------------------------------------------------
// Names

export type V4Projection = "w1" | "w2" | "w3";
/** w1 = gate, w3 = up (both [I, H]), w2 = down ([H, I]), as DeepSeek's `Expert` module names them. */
export const V4_PROJECTIONS: readonly V4Projection[] = ["w1", "w3", "w2"];

/** A MoE block: `layers.{L}` or `mtp.{i}` (the multi-token-prediction block, also MoE). */
export type V4Block = `layers.${number}` | `mtp.${number}`;

export const v4Names = {
  ffn: (block: V4Block) => `${block}.ffn.`,
  routed: (block: V4Block, e: number, w: V4Projection, part: "weight" | "scale") =>
    `${block}.ffn.experts.${e}.${w}.${part}`,
  shared: (block: V4Block, w: V4Projection, part: "weight" | "scale") =>
    `${block}.ffn.shared_experts.${w}.${part}`,
  gateWeight: (block: V4Block) => `${block}.ffn.gate.weight`,
  gateBias: (block: V4Block) => `${block}.ffn.gate.bias`,
  tid2eid: (block: V4Block) => `${block}.ffn.gate.tid2eid`,
};

// ---------------------------------------------------------------------------------------------------
// config.json

/** The MoE part of a V4 config.json, checked. */
export interface V4ModelConfig {
  hidden: number;
  intermediate: number;
  numExperts: number;
  topK: number;
  numShared: number;
  numLayers: number;
  numHashLayers: number;
  /** MTP blocks (num_nextn_predict_layers; 0 when absent). */
  numMtp: number;
  scoring: ScoringFunction;
  routedScalingFactor: number;
  renormalize: boolean;
  swigluLimit: number | null;
  /** expert_dtype when config.json names it; null: decided from a routed expert's header dtype. */
  expertDtype: ExpertFormat | null;
  /** Activation scale format: "ue8m0" when quantization_config.scale_fmt says so. */
  scaleFormat: ScaleFormat;
  nGroup: number;
  topkGroup: number;
  vocab: number | null;
}

function isPlainObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** Checks config.json's MoE keys (missing, mistyped or contradictory ones throw, naming the key). */
export function parseV4Config(file: string, json: unknown): V4ModelConfig {
  if (!isPlainObject(json)) throw new CheckpointError(`${file}: not a JSON object`);
  const bad = (msg: string) => new CheckpointError(`${file}: ${msg}`);
  const int = (key: string, min: number, fallback?: number): number => {
    const v = json[key];
    if (v === undefined || v === null) {
      if (fallback !== undefined) return fallback;
      throw bad(`missing key "${key}"`);
    }
    if (typeof v !== "number" || !Number.isInteger(v) || v < min) {
      throw bad(`"${key}" must be an integer ≥ ${min}, got ${JSON.stringify(v)}`);
    }
    return v;
  };
  const num = (key: string, fallback?: number): number => {
    const v = json[key];
    if (v === undefined || v === null) {
      if (fallback !== undefined) return fallback;
      throw bad(`missing key "${key}"`);
    }
    if (typeof v !== "number" || !Number.isFinite(v))
      throw bad(`"${key}" must be a finite number, got ${JSON.stringify(v)}`);
    return v;
  };
  const hidden = int("hidden_size", 1);
  const intermediate = int("moe_intermediate_size", 1);
  const numExperts = int("n_routed_experts", 1);
  const topK = int("num_experts_per_tok", 1);
  const numShared = int("n_shared_experts", 0);
  const numLayers = int("num_hidden_layers", 1);
  const numHashLayers = int("num_hash_layers", 0, 0);
  const numMtp = int("num_nextn_predict_layers", 0, 0);
  const nGroup = int("n_group", 1, 1);
  const topkGroup = int("topk_group", 1, 1);
  const vocabRaw = json.vocab_size;
  const vocab = vocabRaw === undefined ? null : int("vocab_size", 1);
  const scoring = json.scoring_func;
  if (scoring === undefined) throw bad('missing key "scoring_func"');
  if (scoring !== "sqrtsoftplus" && scoring !== "sigmoid" && scoring !== "softmax") {
    throw bad(`"scoring_func" must be sqrtsoftplus, sigmoid or softmax, got ${JSON.stringify(scoring)}`);
  }
  const routedScalingFactor = num("routed_scaling_factor");
  if (!(routedScalingFactor > 0))
    throw bad(`"routed_scaling_factor" must be positive, got ${routedScalingFactor}`);
  // DeepSeek's Gate renormalizes whenever the scores are not a softmax; norm_topk_prob says so explicitly.
  const norm = json.norm_topk_prob;
  if (norm !== undefined && typeof norm !== "boolean")
    throw bad(`"norm_topk_prob" must be a boolean, got ${JSON.stringify(norm)}`);
  const renormalize = norm ?? scoring !== "softmax";
  const limit = num("swiglu_limit", 0);
  if (limit < 0) throw bad(`"swiglu_limit" must be ≥ 0 (0: no clamp), got ${limit}`);
  const dtype = json.expert_dtype;
  if (dtype !== undefined && dtype !== null && dtype !== "fp4" && dtype !== "fp8") {
    throw bad(`"expert_dtype" must be "fp4" or "fp8" (or absent), got ${JSON.stringify(dtype)}`);
  }
  let scaleFormat: ScaleFormat = "fp32";
  const q = json.quantization_config;
  if (q !== undefined && q !== null) {
    if (!isPlainObject(q)) throw bad(`"quantization_config" must be an object`);
    if (q.scale_fmt !== undefined && q.scale_fmt !== null && q.scale_fmt !== "ue8m0") {
      throw bad(
        `"quantization_config.scale_fmt" must be "ue8m0" (or absent), got ${JSON.stringify(q.scale_fmt)}`,
      );
    }
    if (q.scale_fmt === "ue8m0") scaleFormat = "ue8m0";
    const block = q.weight_block_size;
    if (
      block !== undefined &&
      !(Array.isArray(block) && block.length === 2 && block[0] === QUANT_BLOCK && block[1] === QUANT_BLOCK)
    ) {
      throw bad(`"quantization_config.weight_block_size" must be [128, 128], got ${JSON.stringify(block)}`);
    }
  }
  if (topK > numExperts)
    throw bad(`"num_experts_per_tok" (${topK}) exceeds "n_routed_experts" (${numExperts})`);
  if (numHashLayers > numLayers) {
    throw bad(`"num_hash_layers" (${numHashLayers}) exceeds "num_hidden_layers" (${numLayers})`);
  }
  return {
    hidden,
    intermediate,
    numExperts,
    topK,
    numShared,
    numLayers,
    numHashLayers,
    numMtp,
    scoring,
    routedScalingFactor,
    renormalize,
    swigluLimit: limit === 0 ? null : limit,
    expertDtype: dtype === undefined || dtype === null ? null : dtype,
    scaleFormat,
    nGroup,
    topkGroup,
    vocab,
  };
}

// ---------------------------------------------------------------------------------------------------
// Header dtypes and shapes

/** Routed-expert weight dtypes: packed FP4 (two e2m1 codes a byte) or e4m3 (experts converted to FP8). */
const FP4_DTYPES = new Set(["I8", "U8", "F4"]);
const FP8_DTYPE = "F8_E4M3";

/** The expert format a routed expert's weight dtype says, as the engines decide it; null: unknown. */
export function expertFormatOfDtype(dtype: string): ExpertFormat | null {
  if (FP4_DTYPES.has(dtype)) return "fp4";
  if (dtype === FP8_DTYPE) return "fp8";
  return null;
}

interface Expected {
  name: string;
  /** Allowed dtypes. */
  dtypes: readonly string[];
  shape: number[];
  /** Bytes the tensor must hold (checked for dtypes the header parser does not size, like F4). */
  bytes: number;
}

function shapeText(shape: readonly number[]): string {
  return `[${shape.join(", ")}]`;
}

/** The weight and scale a projection [rows, cols] has in `format`. */
function projectionTensors(
  weight: string,
  scale: string,
  rows: number,
  cols: number,
  format: ExpertFormat,
): Expected[] {
  if (format === "fp4") {
    return [
      { name: weight, dtypes: [...FP4_DTYPES], shape: [rows, cols / 2], bytes: (rows * cols) / 2 },
      {
        name: scale,
        dtypes: ["F8_E8M0"],
        shape: [rows, cols / MXFP4_GROUP],
        bytes: (rows * cols) / MXFP4_GROUP,
      },
    ];
  }
  const blocks = [rows / QUANT_BLOCK, cols / QUANT_BLOCK];
  return [
    { name: weight, dtypes: [FP8_DTYPE], shape: [rows, cols], bytes: rows * cols },
    { name: scale, dtypes: ["F8_E8M0"], shape: blocks, bytes: blocks[0] * blocks[1] },
  ];
}

function mlpTensors(
  name: (w: V4Projection, part: "weight" | "scale") => string,
  hidden: number,
  inter: number,
  format: ExpertFormat,
) {
  return V4_PROJECTIONS.flatMap((w) => {
    const [rows, cols] = w === "w2" ? [hidden, inter] : [inter, hidden];
    return projectionTensors(name(w, "weight"), name(w, "scale"), rows, cols, format);
  });
}

/** Every tensor a V4 MoE block with this config has (experts, shared expert, gate), in order. */
export function v4BlockTensors(block: V4Block, config: MoEConfig, vocab: number | null): Expected[] {
  const { hidden: h, intermediate: i, numExperts: e } = config;
  const format = config.expertFormat ?? "fp8";
  const out: Expected[] = [];
  for (let x = 0; x < e; x++) out.push(...mlpTensors((w, p) => v4Names.routed(block, x, w, p), h, i, format));
  if (config.numShared > 0) {
    out.push(...mlpTensors((w, p) => v4Names.shared(block, w, p), h, i * config.numShared, "fp8"));
  }
  out.push({ name: v4Names.gateWeight(block), dtypes: ["BF16"], shape: [e, h], bytes: e * h * 2 });
  if (config.router.hashRouted === true) {
    // vocab_size may be absent from config.json: then any row count is taken, columns must be top-k.
    const rows = vocab ?? -1;
    out.push({ name: v4Names.tid2eid(block), dtypes: ["I64", "I32"], shape: [rows, config.topK], bytes: -1 });
  } else if (config.router.correctionBias) {
    out.push({ name: v4Names.gateBias(block), dtypes: ["F32"], shape: [e], bytes: e * 4 });
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// The checkpoint

export interface LayerOptions {
  /** Largest token count the layer accepts (default 8192). */
  maxTokens?: number;
  /** Routed experts kept in memory after reading (default 2). */
  cachedExperts?: number;
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

function readJson(file: string): unknown {
  let text: string;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (err) {
    throw new CheckpointError(`${file}: cannot read: ${(err as Error).message}`);
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new CheckpointError(`${file}: not valid JSON: ${(err as Error).message}`);
  }
}

/** Checks the index: {"metadata": {"total_size"?}, "weight_map": {tensor: shard file in the directory}}. */
function parseIndex(
  file: string,
  json: unknown,
): { weightMap: Map<string, string>; totalSize: number | null } {
  if (!isPlainObject(json)) throw new CheckpointError(`${file}: not a JSON object`);
  const map = json.weight_map;
  if (!isPlainObject(map)) throw new CheckpointError(`${file}: "weight_map" is missing or not an object`);
  const weightMap = new Map<string, string>();
  for (const [tensor, shard] of Object.entries(map)) {
    if (typeof shard !== "string" || shard === "" || shard !== path.basename(shard) || shard === "..") {
      throw new CheckpointError(
        `${file}: tensor ${tensor} maps to ${JSON.stringify(shard)}, not a file name in the checkpoint directory`,
      );
    }
    weightMap.set(tensor, shard);
  }
  let totalSize: number | null = null;
  const meta = json.metadata;
  if (isPlainObject(meta) && meta.total_size !== undefined) {
    const t = Number(meta.total_size);
    if (!Number.isSafeInteger(t) || t < 0) {
      throw new CheckpointError(
        `${file}: metadata.total_size ${JSON.stringify(meta.total_size)} is not a byte count`,
      );
    }
    totalSize = t;
  }
  return { weightMap, totalSize };
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
      if (!fs.existsSync(file)) {
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
    if (!Number.isInteger(l) || l < 0 || l >= this.model.numLayers) {
      throw new CheckpointError(
        `${path.join(this.dir, CONFIG_FILE)}: layer ${l} is out of range: num_hidden_layers is ${this.model.numLayers} (layers 0..${this.model.numLayers - 1})`,
      );
    }
    return this.block(`layers.${l}`, l < this.model.numHashLayers, opts);
  }

  /** MTP block i's MoE weights (score-routed, like the layers above num_hash_layers). */
  mtp(i: number, opts: LayerOptions = {}): CheckpointLayer {
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
// One block's weights, read lazily

/** 2^(b − 127) for E8M0 bytes (exact in fp32: b = 0 is the subnormal 2^−127); 0xFF throws, naming where. */
export function e8m0ToScales(bytes: Uint8Array, file: string, name: string, cols: number): Float32Array {
  const out = new Float32Array(bytes.length);
  for (let i = 0; i < bytes.length; i++) {
    const b = bytes[i];
    if (b === E8M0_NAN_BYTE) {
      throw new CheckpointError(
        `${file}: tensor ${name}[${Math.floor(i / cols)}, ${i % cols}] is 0xFF, E8M0's NaN: not a scale`,
      );
    }
    out[i] = 2 ** (b - 127);
  }
  return out;
}

function checkE8m0(bytes: Uint8Array, file: string, name: string, cols: number): void {
  const i = bytes.indexOf(E8M0_NAN_BYTE);
  if (i >= 0) {
    throw new CheckpointError(
      `${file}: tensor ${name}[${Math.floor(i / cols)}, ${i % cols}] is 0xFF, E8M0's NaN: not a scale`,
    );
  }
}

function checkE4m3(codes: Uint8Array, file: string, name: string, cols: number): void {
  for (let i = 0; i < codes.length; i++) {
    if (Number.isNaN(E4M3_DECODE[codes[i]])) {
      throw new CheckpointError(
        `${file}: tensor ${name}[${Math.floor(i / cols)}, ${i % cols}] is e4m3 NaN (code 0x${codes[i].toString(16)})`,
      );
    }
  }
}

export class CheckpointLayer implements MoEWeightSource {
  private readonly experts: ExpertCache;
  private sharedWeights: ExpertWeights | null | undefined;
  private gateWeights: GateWeights | undefined;

  constructor(
    readonly block: V4Block,
    readonly config: ValidatedConfig,
    private readonly locations: Map<string, TensorLocation>,
    cachedExperts: number,
  ) {
    this.experts = new ExpertCache(config, cachedExperts);
  }

  /** Shards this block's tensors lie in. */
  get files(): string[] {
    return [...new Set([...this.locations.values()].map((l) => l.file))].sort();
  }

  expert(e: number): RoutedExpertWeights {
    return this.experts.get(e, () => {
      const name = (w: V4Projection, p: "weight" | "scale") => v4Names.routed(this.block, e, w, p);
      return this.config.expertFormat === "fp4"
        ? this.readFp4(name, this.config.intermediate)
        : this.readFp8(name, this.config.intermediate);
    });
  }

  shared(): ExpertWeights | null {
    if (this.sharedWeights === undefined) {
      this.sharedWeights =
        this.config.numShared === 0
          ? null
          : this.readFp8(
              (w, p) => v4Names.shared(this.block, w, p),
              this.config.intermediate * this.config.numShared,
            );
    }
    return this.sharedWeights;
  }

  gate(): GateWeights {
    if (this.gateWeights === undefined) {
      const weight = new Uint16Array(this.config.numExperts * this.config.hidden);
      this.read(v4Names.gateWeight(this.block), weight);
      let bias: Float32Array | null = null;
      let tid2eid: Int32Array | null = null;
      if (this.config.router.hashRouted === true) tid2eid = this.readTid2eid();
      else if (this.config.router.correctionBias) {
        bias = new Float32Array(this.config.numExperts);
        this.read(v4Names.gateBias(this.block), bias);
      }
      this.gateWeights = { weight, bias, tid2eid };
    }
    return this.gateWeights;
  }

  /** Positioned read of a whole tensor into `into` (byte lengths were checked when the block was opened). */
  private read(name: string, into: ArrayBufferView): void {
    const loc = this.locations.get(name);
    if (loc === undefined) throw new CheckpointError(`${this.block}: tensor ${name} was not checked`);
    const bytes = new Uint8Array(into.buffer, into.byteOffset, into.byteLength);
    if (bytes.length !== loc.info.end - loc.info.begin) {
      throw new CheckpointError(
        `${loc.file}: tensor ${name} holds ${loc.info.end - loc.info.begin} bytes, expected ${bytes.length}`,
      );
    }
    const fd = openForReading(loc.file);
    try {
      readExactly(fd, bytes, loc.header.dataStart + loc.info.begin, `tensor ${name}`, loc.file);
    } finally {
      fs.closeSync(fd);
    }
  }

  private fileOf(name: string): string {
    return this.locations.get(name)?.file ?? this.block;
  }

  /** w1 (gate) and w3 (up) stacked into W1 [2I, H], gate rows first; w2 as W2 [H, I]. */
  private readFp8(name: (w: V4Projection, p: "weight" | "scale") => string, inter: number): ExpertWeights {
    const h = this.config.hidden;
    const matrix = (rows: number, cols: number): BlockQuantized => ({
      q: new Uint8Array(rows * cols),
      scales: new Float32Array((rows / QUANT_BLOCK) * (cols / QUANT_BLOCK)),
      rows,
      cols,
    });
    const w1 = matrix(2 * inter, h);
    const w2 = matrix(h, inter);
    const part = (w: V4Projection, m: BlockQuantized, r0: number, rows: number) => {
      const q = m.q.subarray(r0 * m.cols, (r0 + rows) * m.cols);
      this.read(name(w, "weight"), q);
      checkE4m3(q, this.fileOf(name(w, "weight")), name(w, "weight"), m.cols);
      const blockCols = m.cols / QUANT_BLOCK;
      const raw = new Uint8Array((rows / QUANT_BLOCK) * blockCols);
      this.read(name(w, "scale"), raw);
      m.scales.set(
        e8m0ToScales(raw, this.fileOf(name(w, "scale")), name(w, "scale"), blockCols),
        (r0 / QUANT_BLOCK) * blockCols,
      );
    };
    part("w1", w1, 0, inter);
    part("w3", w1, inter, inter);
    part("w2", w2, 0, h);
    return { w1, w2 };
  }

  private readFp4(name: (w: V4Projection, p: "weight" | "scale") => string, inter: number): Fp4ExpertWeights {
    const h = this.config.hidden;
    const matrix = (rows: number, cols: number): Mxfp4Matrix => ({
      packed: new Uint8Array((rows * cols) / 2),
      scales: new Uint8Array((rows * cols) / MXFP4_GROUP),
      rows,
      cols,
    });
    const w1 = matrix(2 * inter, h);
    const w2 = matrix(h, inter);
    const part = (w: V4Projection, m: Mxfp4Matrix, r0: number, rows: number) => {
      this.read(name(w, "weight"), m.packed.subarray((r0 * m.cols) / 2, ((r0 + rows) * m.cols) / 2));
      const groups = m.cols / MXFP4_GROUP;
      const s = m.scales.subarray(r0 * groups, (r0 + rows) * groups);
      this.read(name(w, "scale"), s);
      checkE8m0(s, this.fileOf(name(w, "scale")), name(w, "scale"), groups);
    };
    part("w1", w1, 0, inter);
    part("w3", w1, inter, inter);
    part("w2", w2, 0, h);
    return { format: "fp4", w1, w2 };
  }

  /** tid2eid as int32 [vocab, topK]; every id must be an expert and distinct within its row. */
  private readTid2eid(): Int32Array {
    const name = v4Names.tid2eid(this.block);
    const loc = this.locations.get(name);
    if (loc === undefined) throw new CheckpointError(`${this.block}: tensor ${name} was not checked`);
    const [vocab, k] = loc.info.shape;
    const out = new Int32Array(vocab * k);
    if (loc.info.dtype === "I32") this.read(name, out);
    else {
      const wide = new BigInt64Array(vocab * k);
      this.read(name, wide);
      for (let i = 0; i < wide.length; i++) {
        const v = wide[i];
        out[i] = v >= -1n && v < BigInt(this.config.numExperts) ? Number(v) : -2;
      }
    }
    const E = this.config.numExperts;
    for (let t = 0; t < vocab; t++) {
      for (let j = 0; j < k; j++) {
        const id = out[t * k + j];
        if (id < 0 || id >= E) {
          throw new CheckpointError(
            `${loc.file}: tensor ${name}[${t}, ${j}] is not an expert id in [0, ${E})`,
          );
        }
        for (let i = 0; i < j; i++) {
          if (out[t * k + i] === id) {
            throw new CheckpointError(`${loc.file}: tensor ${name}[${t}]: expert ${id} appears twice`);
          }
        }
      }
    }
    return out;
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
    if (!fs.existsSync(configFile))
      throw new CheckpointError(`${configFile}: missing: a V4 checkpoint needs its config.json`);
    const model = parseV4Config(configFile, readJson(configFile));
    if (!fs.existsSync(indexFile)) {
      // A one-shard checkpoint may ship without an index: its only .safetensors file is the map.
      const files = fs.readdirSync(target).filter((f) => f.endsWith(".safetensors"));
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
  if (hasV4Names && fs.existsSync(path.join(dir, CONFIG_FILE))) {
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
      layer: (opts: LayerOptions = {}) =>
        loadMoEWeights(
          target,
          { ...config, maxTokens: opts.maxTokens ?? config.maxTokens },
          { cachedExperts: opts.cachedExperts },
        ),
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
