/**
 * The MoE layer in one safetensors file: its mapping to DeepSeek FP8 checkpoint names, saving a layer
 * and loading one lazily (experts read at their offsets). The file format is in safetensors.ts.
 */
import fs from "node:fs";
import {
  expertFormatOf,
  type MoEConfig,
  QUANT_BLOCK,
  sharedIntermediate,
  unknownFieldProblem,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { type OverwriteOption, overwriteProblem, targetFileProblem, writeAside } from "../io/write-aside.js";
import { describeE8m0Problem, E2M1_MAX, E8M0_NAN, firstBadE8m0 } from "../numerics/fp4.js";
import { FP8_E4M3_MAX, firstE4m3Nan } from "../numerics/fp8.js";
import { scaleOverflowProblem } from "../numerics/fp32.js";
import { ExpertCache } from "./expert-cache.js";
import {
  bytesOf,
  checkLittleEndian,
  openForReading,
  readExactly,
  readSafetensorsHeader,
  readTensor,
  SafetensorsError,
  type SafetensorsHeader,
  SafetensorsWriter,
  shapeText,
  type TensorSpec,
} from "./safetensors.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  emptyMxfp4Matrix,
  type Fp4ExpertWeights,
  type GateWeights,
  type MoEWeightSource,
  MXFP4_GROUP,
  type Mxfp4Matrix,
  type RoutedExpertWeights,
  requireFp8Expert,
  weightSourceProblem,
} from "./types.js";

export const DEFAULT_PREFIX = "model.layers.0.mlp.";

type Projection = "gate_proj" | "up_proj" | "down_proj";
const PROJECTIONS: readonly Projection[] = ["gate_proj", "up_proj", "down_proj"];

/** Checkpoint names of one layer; `mlp` is `experts.{e}` or `shared_experts`. */
export const checkpointNames = {
  weight: (prefix: string, mlp: string, proj: Projection) => `${prefix}${mlp}.${proj}.weight`,
  scale: (prefix: string, mlp: string, proj: Projection) => `${prefix}${mlp}.${proj}.weight_scale_inv`,
  expert: (e: number) => `experts.${e}`,
  shared: "shared_experts",
  gateWeight: (prefix: string) => `${prefix}gate.weight`,
  gateBias: (prefix: string) => `${prefix}gate.e_score_correction_bias`,
};

/** The [rows, cols] of each projection of an MLP with intermediate size `inter`. */
function projectionShape(proj: Projection, hidden: number, inter: number): [number, number] {
  return proj === "down_proj" ? [hidden, inter] : [inter, hidden];
}

function mlpSpecs(prefix: string, mlp: string, hidden: number, inter: number, fp4 = false): TensorSpec[] {
  return PROJECTIONS.flatMap((proj): TensorSpec[] => {
    const [rows, cols] = projectionShape(proj, hidden, inter);
    if (fp4) {
      // MXFP4 (V4's routed experts): packed e2m1 pairs as I8 [rows, cols/2], UE8M0 scales [rows, cols/32].
      return [
        { name: checkpointNames.weight(prefix, mlp, proj), dtype: "I8" as const, shape: [rows, cols / 2] },
        {
          name: checkpointNames.scale(prefix, mlp, proj),
          dtype: "F8_E8M0" as const,
          shape: [rows, cols / MXFP4_GROUP],
        },
      ];
    }
    return [
      { name: checkpointNames.weight(prefix, mlp, proj), dtype: "F8_E4M3" as const, shape: [rows, cols] },
      {
        name: checkpointNames.scale(prefix, mlp, proj),
        dtype: "F32" as const,
        shape: [rows / QUANT_BLOCK, cols / QUANT_BLOCK],
      },
    ];
  });
}

/** Every tensor a layer with this config has in a checkpoint, in file order. */
export function moeTensorSpecs(config: MoEConfig, prefix = DEFAULT_PREFIX): TensorSpec[] {
  const { hidden: h, intermediate: i, numExperts: e } = config;
  const specs: TensorSpec[] = [];
  const fp4 = expertFormatOf(config) === "fp4";
  for (let x = 0; x < e; x++) specs.push(...mlpSpecs(prefix, checkpointNames.expert(x), h, i, fp4));
  if (config.numShared > 0)
    specs.push(...mlpSpecs(prefix, checkpointNames.shared, h, sharedIntermediate(config)));
  specs.push({ name: checkpointNames.gateWeight(prefix), dtype: "BF16", shape: [e, h] });
  if (config.router.correctionBias) {
    specs.push({ name: checkpointNames.gateBias(prefix), dtype: "F32", shape: [e] });
  }
  return specs;
}

/** Rows [from, to) of a block-quantized matrix: its codes and its block-row scales (from, to multiples of 128). */
function rowSlice(w: BlockQuantized, from: number, to: number) {
  const blockCols = w.cols / QUANT_BLOCK;
  return {
    q: w.q.subarray(from * w.cols, to * w.cols),
    scales: w.scales.subarray((from / QUANT_BLOCK) * blockCols, (to / QUANT_BLOCK) * blockCols),
  };
}

function writeMlp(
  writer: SafetensorsWriter,
  prefix: string,
  mlp: string,
  w: ExpertWeights,
  inter: number,
): void {
  const parts: Record<Projection, { q: Uint8Array; scales: Float32Array }> = {
    gate_proj: rowSlice(w.w1, 0, inter),
    up_proj: rowSlice(w.w1, inter, 2 * inter),
    down_proj: { q: w.w2.q, scales: w.w2.scales },
  };
  for (const proj of PROJECTIONS) {
    writer.write(checkpointNames.weight(prefix, mlp, proj), parts[proj].q);
    writer.write(checkpointNames.scale(prefix, mlp, proj), parts[proj].scales);
  }
}

/** Rows [from, to) of an MXFP4 matrix: its packed bytes and its scale bytes. */
function mxRowSlice(w: Mxfp4Matrix, from: number, to: number) {
  return {
    q: w.packed.subarray((from * w.cols) / 2, (to * w.cols) / 2),
    scales: w.scales.subarray((from * w.cols) / MXFP4_GROUP, (to * w.cols) / MXFP4_GROUP),
  };
}

function writeMlpFp4(
  writer: SafetensorsWriter,
  prefix: string,
  mlp: string,
  w: Fp4ExpertWeights,
  inter: number,
): void {
  const parts: Record<Projection, { q: Uint8Array; scales: Uint8Array }> = {
    gate_proj: mxRowSlice(w.w1, 0, inter),
    up_proj: mxRowSlice(w.w1, inter, 2 * inter),
    down_proj: { q: w.w2.packed, scales: w.w2.scales },
  };
  for (const proj of PROJECTIONS) {
    writer.write(checkpointNames.weight(prefix, mlp, proj), parts[proj].q);
    writer.write(checkpointNames.scale(prefix, mlp, proj), parts[proj].scales);
  }
}

function checkExpertShape(what: string, w: RoutedExpertWeights, hidden: number, inter: number): void {
  const ok = w.w1.rows === 2 * inter && w.w1.cols === hidden && w.w2.rows === hidden && w.w2.cols === inter;
  if (!ok) {
    throw new SafetensorsError(
      `${what}: w1 [${w.w1.rows}, ${w.w1.cols}] and w2 [${w.w2.rows}, ${w.w2.cols}] do not match [${2 * inter}, ${hidden}] and [${hidden}, ${inter}]`,
    );
  }
}

export interface SaveOptions extends OverwriteOption {
  /** Checkpoint name prefix (default "model.layers.0.mlp."). */
  prefix?: string;
  /** Extra `__metadata__` strings. */
  metadata?: Record<string, string>;
  /** Called after each routed expert, the shared expert and the gate: (done, total). */
  onProgress?: (done: number, total: number) => void;
}

/**
 * Writes a layer's weights as a DeepSeek-style FP8 checkpoint, one expert at a time (the source's lazy
 * experts are never all in memory). An existing file at `path` is refused unless `overwrite` is on. The
 * file is written under a temporary name beside it and renamed at the end (writeAside), so a failed or
 * interrupted save leaves no file that looks complete and an existing file as it was.
 */
export function saveMoEWeights(path: string, source: MoEWeightSource, opts: SaveOptions = {}): void {
  if (typeof path !== "string") throw new SafetensorsError(`path must be a string, got ${String(path)}`);
  const problem = weightSourceProblem(source);
  if (problem !== null) throw new SafetensorsError(`saveMoEWeights: ${problem}`);
  const config = validateConfig(source.config); // returns at once for a validated config
  if (typeof opts !== "object" || opts === null) {
    throw new SafetensorsError(`save options must be an object, got ${String(opts)}`);
  }
  const unknown = unknownFieldProblem("save options", opts, [
    "prefix",
    "metadata",
    "onProgress",
    "overwrite",
  ]);
  if (unknown !== null) throw new SafetensorsError(unknown);
  const prefix = opts.prefix ?? DEFAULT_PREFIX;
  if (typeof prefix !== "string")
    throw new SafetensorsError(`prefix must be a string, got ${String(prefix)}`);
  const target =
    overwriteProblem(opts.overwrite) ??
    targetFileProblem(path, opts.overwrite === true, "pass { overwrite: true }");
  if (target !== null) throw new SafetensorsError(`saveMoEWeights: ${target}`);
  const metadata = {
    format: "pt",
    "megamoe.config": JSON.stringify(config),
    ...opts.metadata,
  };
  const total = config.numExperts + (config.numShared > 0 ? 1 : 0) + 1;
  writeAside([path], ([temp]) => {
    const writer = new SafetensorsWriter(temp, moeTensorSpecs(config, prefix), metadata, path);
    try {
      let done = 0;
      for (let e = 0; e < config.numExperts; e++) {
        const w = source.expert(e);
        checkExpertShape(`expert ${e}`, w, config.hidden, config.intermediate);
        if (expertFormatOf(config) === "fp4") {
          if (w.format !== "fp4") throw new SafetensorsError(`expert ${e} is FP8 but the config says fp4`);
          writeMlpFp4(writer, prefix, checkpointNames.expert(e), w, config.intermediate);
        } else {
          const w8 = requireFp8Expert(w, `saveMoEWeights (config expertFormat fp8), expert ${e}`);
          writeMlp(writer, prefix, checkpointNames.expert(e), w8, config.intermediate);
        }
        opts.onProgress?.(++done, total);
      }
      if (config.numShared > 0) {
        const w = source.shared();
        if (w === null)
          throw new SafetensorsError("config has shared experts but the weight source has none");
        const si = sharedIntermediate(config);
        checkExpertShape("shared experts", w, config.hidden, si);
        writeMlp(writer, prefix, checkpointNames.shared, w, si);
        opts.onProgress?.(++done, total);
      }
      const gate = source.gate();
      writer.write(checkpointNames.gateWeight(prefix), gate.weight);
      if (config.router.correctionBias) {
        if (gate.bias === null)
          throw new SafetensorsError("config has a correction bias but the gate has none");
        writer.write(checkpointNames.gateBias(prefix), gate.bias);
      }
      opts.onProgress?.(++done, total);
      writer.close();
    } catch (err) {
      writer.abort();
      throw err;
    }
  });
}

export interface LoadOptions {
  prefix?: string;
  /** Routed experts kept in memory after reading (default 2). */
  cachedExperts?: number;
}

/** Checks that every tensor the config needs is present with the right dtype and shape. */
function checkLayerTensors(header: SafetensorsHeader, specs: TensorSpec[]): void {
  const missing = specs.filter((s) => !header.tensors.has(s.name));
  if (missing.length > 0) {
    const more = missing.length > 1 ? ` (and ${missing.length - 1} more)` : "";
    throw new SafetensorsError(`${header.path}: missing tensor ${missing[0].name}${more}`);
  }
  for (const s of specs) {
    const t = header.tensors.get(s.name)!;
    if (t.dtype !== s.dtype) {
      throw new SafetensorsError(
        `${header.path}: tensor ${s.name} has dtype ${t.dtype}, expected ${s.dtype}`,
      );
    }
    if (t.shape.length !== s.shape.length || t.shape.some((d, i) => d !== s.shape[i])) {
      throw new SafetensorsError(
        `${header.path}: tensor ${s.name} has shape ${shapeText(t.shape)}, expected ${shapeText(s.shape)}`,
      );
    }
  }
}

/**
 * A file saved by megamoe records its layer's config in its metadata: when that shape differs from the
 * one asked for, say so (instead of "missing tensor …" for every tensor the other shape would have).
 */
function checkSavedShape(header: SafetensorsHeader, config: MoEConfig): void {
  const saved = header.metadata["megamoe.config"];
  if (saved === undefined) return;
  let s: Partial<MoEConfig>;
  try {
    s = JSON.parse(saved) as Partial<MoEConfig>;
  } catch {
    return; // not ours to judge: the tensor checks that follow still apply
  }
  const keys = ["numExperts", "hidden", "intermediate", "numShared"] as const;
  // The format too: else an fp4 file read as fp8 fails on "dtype I8, expected F8_E4M3", naming no cause.
  const format = (c: Partial<MoEConfig>) => c.expertFormat ?? "fp8";
  if (keys.some((k) => s[k] !== config[k]) || format(s) !== format(config)) {
    const shape = (c: Partial<MoEConfig>) =>
      `E=${c.numExperts} H=${c.hidden} I=${c.intermediate} shared=${c.numShared} ${format(c)} experts`;
    throw new SafetensorsError(
      `${header.path}: its metadata says it holds a "${s.name}" layer (${shape(s)}), not the "${config.name}" layer asked for (${shape(config)})`,
    );
  }
}

/** Weights read lazily from a checked checkpoint file. */
class SafetensorsWeights implements MoEWeightSource {
  private sharedWeights: ExpertWeights | null | undefined;
  private gateWeights: GateWeights | undefined;

  constructor(
    readonly config: ValidatedConfig,
    private readonly header: SafetensorsHeader,
    private readonly prefix: string,
    private readonly experts: ExpertCache,
  ) {}

  expert(e: number): RoutedExpertWeights {
    const mlp = checkpointNames.expert(e);
    const inter = this.config.intermediate;
    return this.experts.get(e, () =>
      expertFormatOf(this.config) === "fp4" ? this.readMlpFp4(mlp, inter) : this.readMlp(mlp, inter),
    );
  }

  shared(): ExpertWeights | null {
    if (this.sharedWeights === undefined) {
      this.sharedWeights =
        this.config.numShared === 0
          ? null
          : this.readMlp(checkpointNames.shared, sharedIntermediate(this.config));
    }
    return this.sharedWeights;
  }

  gate(): GateWeights {
    if (this.gateWeights === undefined) {
      const weight = readTensor(this.header, checkpointNames.gateWeight(this.prefix)).data as Uint16Array;
      const bias = this.config.router.correctionBias
        ? (readTensor(this.header, checkpointNames.gateBias(this.prefix)).data as Float32Array)
        : null;
      this.gateWeights = { weight, bias };
    }
    return this.gateWeights;
  }

  /** Reads gate_proj and up_proj into one W1 [2I, H] (gate rows first) and down_proj as W2 [H, I]. */
  private readMlp(mlp: string, inter: number): ExpertWeights {
    const h = this.config.hidden;
    const w1: BlockQuantized = {
      q: new Uint8Array(2 * inter * h),
      scales: new Float32Array(((2 * inter) / QUANT_BLOCK) * (h / QUANT_BLOCK)),
      rows: 2 * inter,
      cols: h,
    };
    const w2: BlockQuantized = {
      q: new Uint8Array(h * inter),
      scales: new Float32Array((h / QUANT_BLOCK) * (inter / QUANT_BLOCK)),
      rows: h,
      cols: inter,
    };
    const targets: Record<Projection, { q: Uint8Array; scales: Float32Array }> = {
      gate_proj: rowSlice(w1, 0, inter),
      up_proj: rowSlice(w1, inter, 2 * inter),
      down_proj: w2,
    };
    const fd = openForReading(this.header.path);
    try {
      for (const proj of PROJECTIONS) {
        const weightName = checkpointNames.weight(this.prefix, mlp, proj);
        const scaleName = checkpointNames.scale(this.prefix, mlp, proj);
        this.readInto(fd, weightName, targets[proj].q);
        checkE4m3Codes(this.header.path, weightName, targets[proj].q);
        this.readInto(fd, scaleName, targets[proj].scales);
        const [, cols] = projectionShape(proj, h, inter);
        checkScales(this.header.path, scaleName, targets[proj].scales, cols / QUANT_BLOCK);
      }
    } finally {
      fs.closeSync(fd);
    }
    return { w1, w2 };
  }

  /** The MXFP4 counterpart of readMlp: gate and up rows into one W1 [2I, H], down into W2 [H, I]. */
  private readMlpFp4(mlp: string, inter: number): Fp4ExpertWeights {
    const h = this.config.hidden;
    const w1 = emptyMxfp4Matrix(2 * inter, h);
    const w2 = emptyMxfp4Matrix(h, inter);
    const targets: Record<Projection, { q: Uint8Array; scales: Uint8Array }> = {
      gate_proj: mxRowSlice(w1, 0, inter),
      up_proj: mxRowSlice(w1, inter, 2 * inter),
      down_proj: { q: w2.packed, scales: w2.scales },
    };
    const fd = openForReading(this.header.path);
    try {
      for (const proj of PROJECTIONS) {
        const [, cols] = projectionShape(proj, h, inter);
        const scaleName = checkpointNames.scale(this.prefix, mlp, proj);
        this.readInto(fd, checkpointNames.weight(this.prefix, mlp, proj), targets[proj].q);
        this.readInto(fd, scaleName, targets[proj].scales);
        checkE8m0Scales(this.header.path, scaleName, targets[proj].scales, cols / MXFP4_GROUP);
      }
    } finally {
      fs.closeSync(fd);
    }
    return { format: "fp4", w1, w2 };
  }

  private readInto(fd: number, name: string, into: Uint8Array | Float32Array): void {
    const info = this.header.tensors.get(name)!;
    readExactly(fd, bytesOf(into), this.header.dataStart + info.begin, `tensor ${name}`, this.header.path);
  }
}

/** e4m3 has no infinity; its NaN codes (0x7F, 0xFF) would run through the layer to a NaN output. */
function checkE4m3Codes(path: string, name: string, q: Uint8Array): void {
  const i = firstE4m3Nan(q);
  if (i >= 0) {
    throw new SafetensorsError(
      `${path}: tensor ${name}[${i}] holds the FP8 e4m3 NaN code 0x${q[i]!.toString(16)}`,
    );
  }
}

/**
 * Weight scales must be positive and finite (anything else means a corrupt or foreign file), and small
 * enough that 448 (e4m3's largest magnitude) times the scale is an fp32 value: else the block's weights,
 * and the layer's output, would be infinite. The error names the tensor and the block [row, col].
 */
function checkScales(path: string, name: string, scales: Float32Array, blockCols: number): void {
  for (let i = 0; i < scales.length; i++) {
    const s = scales[i];
    if (!(s > 0 && s < Number.POSITIVE_INFINITY)) {
      throw new SafetensorsError(`${path}: tensor ${name}[${i}] = ${s} is not a positive finite scale`);
    }
    const overflow = scaleOverflowProblem(s, FP8_E4M3_MAX, "e4m3");
    if (overflow !== null) {
      throw new SafetensorsError(
        `${path}: tensor ${name}, block [${Math.floor(i / blockCols)}, ${i % blockCols}]: the scale ${s} is too large: ${overflow}`,
      );
    }
  }
}

/**
 * UE8M0 scale bytes must not be 0xFF (NaN) nor so large that 6 (e2m1's largest magnitude) times the scale
 * overflows fp32; the error names the tensor's row and K group.
 */
function checkE8m0Scales(path: string, name: string, scales: Uint8Array, perRow: number): void {
  const i = firstBadE8m0(scales, E2M1_MAX);
  if (i < 0) return;
  const at = `row ${Math.floor(i / perRow)}, K group ${i % perRow}`;
  throw new SafetensorsError(
    scales[i] === E8M0_NAN
      ? `${path}: tensor ${name} has UE8M0 scale byte 0xFF (NaN) at ${at}`
      : `${path}: tensor ${name} at ${at}: the UE8M0 scale byte ${describeE8m0Problem(scales[i], E2M1_MAX, "e2m1")}`,
  );
}

/**
 * Opens a DeepSeek-style FP8 checkpoint for a layer of this config: reads and checks the header (every
 * needed tensor present with its dtype and shape, all offsets inside the file and disjoint), then reads
 * experts lazily at their offsets.
 */
export function loadMoEWeights(
  path: string,
  config: MoEConfig | ValidatedConfig,
  opts: LoadOptions = {},
): MoEWeightSource {
  const c = validateConfig(config); // returns at once for a validated config
  checkLittleEndian();
  if (typeof path !== "string") throw new SafetensorsError(`path must be a string, got ${String(path)}`);
  if (typeof opts !== "object" || opts === null) {
    throw new SafetensorsError(`load options must be an object, got ${String(opts)}`);
  }
  const unknown = unknownFieldProblem("load options", opts, ["prefix", "cachedExperts"]);
  if (unknown !== null) throw new SafetensorsError(unknown);
  const prefix = opts.prefix ?? DEFAULT_PREFIX;
  if (typeof prefix !== "string")
    throw new SafetensorsError(`prefix must be a string, got ${String(prefix)}`);
  const experts = new ExpertCache(c, opts.cachedExperts ?? 2);
  const header = readSafetensorsHeader(path);
  checkSavedShape(header, c);
  checkLayerTensors(header, moeTensorSpecs(c, prefix));
  return new SafetensorsWeights(c, header, prefix, experts);
}
