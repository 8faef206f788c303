/**
 * The DeepSeek-V4 checkpoint format: file and tensor names, config.json and the index parsed and
 * checked, and the tensors (names, dtypes, shapes) a MoE block holds. docs/weights.md lists them, with
 * their sources. checkpoint.ts opens a checkpoint on top of this; checkpoint-layer.ts reads a block.
 */
import fs from "node:fs";
import path from "node:path";
import {
  describeValue,
  type ExpertFormat,
  type MoEConfig,
  QUANT_BLOCK,
  type ScaleFormat,
  type ScoringFunction,
} from "../config/config.js";
import { SafetensorsError } from "./safetensors.js";
import { MXFP4_GROUP } from "./types.js";

export class CheckpointError extends SafetensorsError {
  override name = "CheckpointError";
}

export const CONFIG_FILE = "config.json";
export const INDEX_FILE = "model.safetensors.index.json";

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
/** The largest value any integer of config.json may hold (sizes index typed arrays and kernels' int32). */
const INT32_MAX = 2 ** 31 - 1;
/** Layer and MTP block counts: far above any model's, low enough that listing the blocks is cheap. */
const MAX_LAYERS = 1 << 16;

export function parseV4Config(file: string, json: unknown): V4ModelConfig {
  if (!isPlainObject(json)) throw new CheckpointError(`${file}: not a JSON object`);
  const bad = (msg: string) => new CheckpointError(`${file}: ${msg}`);
  const int = (key: string, min: number, fallback?: number, max = INT32_MAX): number => {
    const v = json[key];
    if (v === undefined || v === null) {
      if (fallback !== undefined) return fallback;
      throw bad(`missing key "${key}"`);
    }
    if (typeof v !== "number" || !Number.isInteger(v) || v < min || v > max) {
      throw bad(`"${key}" must be an integer in [${min}, ${max}], got ${JSON.stringify(v)}`);
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
      throw bad(`"${key}" must be a finite number, got ${describeValue(v)}`);
    return v;
  };
  const hidden = int("hidden_size", 1);
  const intermediate = int("moe_intermediate_size", 1);
  const numExperts = int("n_routed_experts", 1);
  const topK = int("num_experts_per_tok", 1);
  const numShared = int("n_shared_experts", 0);
  const numLayers = int("num_hidden_layers", 1, undefined, MAX_LAYERS);
  const numHashLayers = int("num_hash_layers", 0, 0, MAX_LAYERS);
  const numMtp = int("num_nextn_predict_layers", 0, 0, MAX_LAYERS);
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

export interface Expected {
  name: string;
  /** Allowed dtypes. */
  dtypes: readonly string[];
  shape: number[];
  /** Bytes the tensor must hold (checked for dtypes the header parser does not size, like F4). */
  bytes: number;
}

export function shapeText(shape: readonly number[]): string {
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
// Reading config.json and the index

/**
 * Whether `file` exists: false only when the OS says ENOENT (a dangling symbolic link is an error naming
 * its target); any other failure (permission denied, a symbolic link loop) is a CheckpointError with the
 * OS's reason, so that it is not reported as a missing file.
 */
export function fileExists(file: string): boolean {
  try {
    fs.statSync(file);
    return true;
  } catch (err) {
    const e = err as NodeJS.ErrnoException;
    if (e.code !== "ENOENT") throw new CheckpointError(`${file}: cannot open: ${e.message}`);
    let target: string | null = null;
    try {
      target = fs.readlinkSync(file);
    } catch {
      return false; // not a link: the file is missing
    }
    throw new CheckpointError(`${file}: a symbolic link to ${target}, which does not exist`);
  }
}

export function readJson(file: string): unknown {
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
export function parseIndex(
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
