/**
 * safetensors files, written and read by the project (no package), and the MoE layer's mapping to
 * DeepSeek FP8 checkpoint names.
 *
 * File: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin,
 * end)}, "__metadata__": {string: string}} (space-padded so data starts 8-byte aligned), then the raw
 * little-endian tensor bytes; offsets are relative to the start of the data. Every problem with a file
 * throws SafetensorsError naming the file and, where there is one, the tensor.
 */
import fs from "node:fs";
import os from "node:os";
import {
  expertFormatOf,
  type MoEConfig,
  QUANT_BLOCK,
  sharedIntermediate,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { E8M0_NAN } from "../numerics/fp4.js";
import { ExpertCache } from "./expert-cache.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  type Fp4ExpertWeights,
  type GateWeights,
  type MoEWeightSource,
  MXFP4_GROUP,
  type Mxfp4Matrix,
  type RoutedExpertWeights,
  requireFp8Expert,
  weightSourceProblem,
} from "./types.js";

export class SafetensorsError extends Error {
  override name = "SafetensorsError";
}

/** Bytes per element of the dtypes this module reads and writes. */
export const DTYPE_SIZES = { F8_E4M3: 1, BF16: 2, F32: 4, I32: 4, I8: 1, F8_E8M0: 1 } as const;
export type Dtype = keyof typeof DTYPE_SIZES;

/** Dtypes the writer also lays out (DeepSeek-V4 checkpoints: U8-packed FP4, I64 token tables). */
export const WRITE_DTYPE_SIZES = { ...DTYPE_SIZES, U8: 1, I64: 8 } as const;
export type WriteDtype = keyof typeof WRITE_DTYPE_SIZES;

/** Element sizes of other common dtypes, only to check the byte length of tensors we do not read. */
const OTHER_DTYPE_SIZES: Record<string, number> = {
  BOOL: 1,
  U8: 1,
  F8_E5M2: 1,
  I16: 2,
  U16: 2,
  F16: 2,
  U32: 4,
  I64: 8,
  U64: 8,
  F64: 8,
};

const HEADER_LENGTH_BYTES = 8;
/** A sanity bound: real headers are kilobytes to a few megabytes. */
const MAX_HEADER_BYTES = 256 * 1024 * 1024;
const METADATA_KEY = "__metadata__";

function checkLittleEndian(): void {
  // Typed arrays are written as their in-memory bytes; safetensors is little-endian.
  if (os.endianness() !== "LE") throw new SafetensorsError("safetensors I/O needs a little-endian host");
}

function dtypeSize(dtype: string): number | undefined {
  return dtype in DTYPE_SIZES ? DTYPE_SIZES[dtype as Dtype] : OTHER_DTYPE_SIZES[dtype];
}

function shapeText(shape: readonly number[]): string {
  return `[${shape.join(", ")}]`;
}

function numel(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

function bytesOf(data: ArrayBufferView): Uint8Array {
  return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
}

// ---------------------------------------------------------------------------------------------------
// Header

export interface TensorSpec {
  name: string;
  dtype: WriteDtype;
  shape: number[];
}

export interface TensorInfo {
  dtype: string;
  shape: number[];
  /** Byte range relative to the start of the data section. */
  begin: number;
  end: number;
}

export interface SafetensorsHeader {
  path: string;
  fileSize: number;
  /** Absolute file offset of the data section (8 + header length). */
  dataStart: number;
  metadata: Record<string, string>;
  tensors: Map<string, TensorInfo>;
}

/** The header bytes (length prefix, JSON, padding) for tensors laid out in the order given. */
function encodeHeader(specs: TensorSpec[], metadata: Record<string, string>) {
  const json: Record<string, unknown> = {};
  if (Object.keys(metadata).length > 0) json[METADATA_KEY] = metadata;
  const offsets = new Map<string, { begin: number; end: number }>();
  let at = 0;
  for (const s of specs) {
    if (s.name === METADATA_KEY) throw new SafetensorsError(`"${METADATA_KEY}" cannot be a tensor name`);
    if (offsets.has(s.name)) throw new SafetensorsError(`tensor ${s.name} is listed twice`);
    if (!s.shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
      throw new SafetensorsError(`tensor ${s.name} has an invalid shape ${shapeText(s.shape)}`);
    }
    const end = at + numel(s.shape) * WRITE_DTYPE_SIZES[s.dtype];
    json[s.name] = { dtype: s.dtype, shape: s.shape, data_offsets: [at, end] };
    offsets.set(s.name, { begin: at, end });
    at = end;
  }
  let text = JSON.stringify(json);
  const unpadded = Buffer.byteLength(text, "utf8");
  text += " ".repeat((8 - ((HEADER_LENGTH_BYTES + unpadded) % 8)) % 8);
  const body = Buffer.from(text, "utf8");
  const header = Buffer.alloc(HEADER_LENGTH_BYTES + body.length);
  header.writeBigUInt64LE(BigInt(body.length), 0);
  body.copy(header, HEADER_LENGTH_BYTES);
  return { header, offsets, dataBytes: at };
}

export function readExactly(
  fd: number,
  into: Uint8Array,
  position: number,
  what: string,
  path: string,
): void {
  let done = 0;
  while (done < into.length) {
    const n = fs.readSync(fd, into, done, into.length - done, position + done);
    if (n === 0) throw new SafetensorsError(`${path}: unexpected end of file while reading ${what}`);
    done += n;
  }
}

function isPlainObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function parseTensorInfo(path: string, name: string, entry: unknown, dataBytes: number): TensorInfo {
  const where = `${path}: tensor ${name}`;
  if (!isPlainObject(entry)) throw new SafetensorsError(`${where}: header entry is not an object`);
  const { dtype, shape, data_offsets: offsets } = entry;
  if (typeof dtype !== "string") throw new SafetensorsError(`${where}: dtype is not a string`);
  if (!Array.isArray(shape) || !shape.every((d) => Number.isSafeInteger(d) && d >= 0)) {
    throw new SafetensorsError(
      `${where}: shape ${JSON.stringify(shape)} is not a list of non-negative integers`,
    );
  }
  if (
    !Array.isArray(offsets) ||
    offsets.length !== 2 ||
    !offsets.every((o) => Number.isSafeInteger(o) && o >= 0) ||
    offsets[0] > offsets[1]
  ) {
    throw new SafetensorsError(
      `${where}: data_offsets ${JSON.stringify(offsets)} is not [begin, end] with begin ≤ end`,
    );
  }
  const [begin, end] = offsets as [number, number];
  if (end > dataBytes) {
    throw new SafetensorsError(
      `${where}: data_offsets [${begin}, ${end}] lie beyond the ${dataBytes}-byte data section (truncated file?)`,
    );
  }
  const size = dtypeSize(dtype);
  if (size !== undefined && end - begin !== numel(shape) * size) {
    throw new SafetensorsError(
      `${where}: data_offsets [${begin}, ${end}] hold ${end - begin} bytes, but ${dtype} ${shapeText(shape)} needs ${numel(shape) * size}`,
    );
  }
  return { dtype, shape: shape as number[], begin, end };
}

/** Reads and checks a file's header: JSON, metadata, and that every tensor's bytes lie in the file, disjoint. */
export function readSafetensorsHeader(path: string): SafetensorsHeader {
  const fd = openForReading(path);
  try {
    const fileSize = fs.fstatSync(fd).size;
    if (fileSize < HEADER_LENGTH_BYTES) {
      throw new SafetensorsError(
        `${path}: truncated: ${fileSize} bytes, shorter than the 8-byte header length`,
      );
    }
    const prefix = new Uint8Array(HEADER_LENGTH_BYTES);
    readExactly(fd, prefix, 0, "the header length", path);
    const view = new DataView(prefix.buffer);
    const high = view.getUint32(4, true);
    const headerBytes = high * 2 ** 32 + view.getUint32(0, true);
    if (high !== 0 || headerBytes > MAX_HEADER_BYTES || HEADER_LENGTH_BYTES + headerBytes > fileSize) {
      throw new SafetensorsError(
        `${path}: header length ${headerBytes} extends beyond the file (${fileSize} bytes): truncated or not a safetensors file`,
      );
    }
    const raw = new Uint8Array(headerBytes);
    readExactly(fd, raw, HEADER_LENGTH_BYTES, "the header", path);
    let json: unknown;
    try {
      json = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(raw));
    } catch (err) {
      throw new SafetensorsError(`${path}: header is not valid UTF-8 JSON: ${(err as Error).message}`);
    }
    if (!isPlainObject(json)) throw new SafetensorsError(`${path}: header JSON is not an object`);
    const dataStart = HEADER_LENGTH_BYTES + headerBytes;
    const dataBytes = fileSize - dataStart;
    const metadata: Record<string, string> = {};
    const tensors = new Map<string, TensorInfo>();
    for (const [name, entry] of Object.entries(json)) {
      if (name === METADATA_KEY) {
        if (!isPlainObject(entry)) throw new SafetensorsError(`${path}: ${METADATA_KEY} is not an object`);
        for (const [k, v] of Object.entries(entry)) {
          if (typeof v !== "string")
            throw new SafetensorsError(`${path}: ${METADATA_KEY}.${k} is not a string`);
          metadata[k] = v;
        }
        continue;
      }
      tensors.set(name, parseTensorInfo(path, name, entry, dataBytes));
    }
    checkDisjoint(path, tensors);
    return { path, fileSize, dataStart, metadata, tensors };
  } finally {
    fs.closeSync(fd);
  }
}

function checkDisjoint(path: string, tensors: Map<string, TensorInfo>): void {
  const ranges = [...tensors].filter(([, t]) => t.end > t.begin).sort((a, b) => a[1].begin - b[1].begin);
  for (let i = 1; i < ranges.length; i++) {
    const [prevName, prev] = ranges[i - 1];
    const [name, t] = ranges[i];
    if (t.begin < prev.end) {
      throw new SafetensorsError(
        `${path}: tensors ${prevName} [${prev.begin}, ${prev.end}] and ${name} [${t.begin}, ${t.end}] overlap`,
      );
    }
  }
}

export function openForReading(path: string): number {
  try {
    return fs.openSync(path, "r");
  } catch (err) {
    throw new SafetensorsError(`${path}: cannot open: ${(err as Error).message}`);
  }
}

// ---------------------------------------------------------------------------------------------------
// Generic tensors

export type TensorArray = Uint8Array | Uint16Array | Float32Array | Int32Array;

export interface TensorData {
  dtype: Dtype;
  shape: number[];
  /**
   * F8_E4M3 → Uint8Array (codes), BF16 → Uint16Array (bits), F32 → Float32Array, I32 → Int32Array;
   * I8 → Uint8Array (raw bytes: DeepSeek-V4 stores packed e2m1 pairs as I8), F8_E8M0 → Uint8Array.
   */
  data: TensorArray;
}

const ARRAY_OF: Record<Dtype, (buffer: ArrayBuffer, length: number) => TensorArray> = {
  F8_E4M3: (b, n) => new Uint8Array(b, 0, n),
  BF16: (b, n) => new Uint16Array(b, 0, n),
  F32: (b, n) => new Float32Array(b, 0, n),
  I32: (b, n) => new Int32Array(b, 0, n),
  I8: (b, n) => new Uint8Array(b, 0, n),
  F8_E8M0: (b, n) => new Uint8Array(b, 0, n),
};

/**
 * Writes a file in a fixed tensor order; `write` may be called in any order, each tensor once, and
 * `close` checks that all were written. Bytes go straight to their offsets, so a caller can stream
 * tensors it makes one at a time.
 */
export class SafetensorsWriter {
  private readonly fd: number;
  private readonly dataStart: number;
  private readonly specs: Map<string, TensorSpec>;
  private readonly offsets: Map<string, { begin: number; end: number }>;
  private readonly written = new Set<string>();
  private closed = false;

  constructor(
    readonly path: string,
    specs: TensorSpec[],
    metadata: Record<string, string> = {},
  ) {
    checkLittleEndian();
    const { header, offsets } = encodeHeader(specs, metadata);
    this.specs = new Map(specs.map((s) => [s.name, s]));
    this.offsets = offsets;
    this.dataStart = header.length;
    this.fd = fs.openSync(path, "w");
    try {
      fs.writeSync(this.fd, header, 0, header.length, 0);
    } catch (err) {
      fs.closeSync(this.fd);
      throw err;
    }
  }

  /** Writes tensor `name`'s bytes (the array must hold exactly its elements, in its dtype's width). */
  write(name: string, data: ArrayBufferView): void {
    if (this.closed) throw new SafetensorsError(`${this.path}: write of ${name} after close`);
    const spec = this.specs.get(name);
    const range = this.offsets.get(name);
    if (spec === undefined || range === undefined)
      throw new SafetensorsError(`${this.path}: unknown tensor ${name}`);
    if (this.written.has(name)) throw new SafetensorsError(`${this.path}: tensor ${name} written twice`);
    const bytes = bytesOf(data);
    if (bytes.length !== range.end - range.begin) {
      throw new SafetensorsError(
        `${this.path}: tensor ${name} (${spec.dtype} ${shapeText(spec.shape)}) needs ${range.end - range.begin} bytes, got ${bytes.length}`,
      );
    }
    let done = 0;
    while (done < bytes.length) {
      done += fs.writeSync(this.fd, bytes, done, bytes.length - done, this.dataStart + range.begin + done);
    }
    this.written.add(name);
  }

  /** Closes the file; throws if a tensor was never written (the file is then left incomplete). */
  close(): void {
    this.abort();
    const missing = [...this.specs.keys()].filter((n) => !this.written.has(n));
    if (missing.length > 0) {
      throw new SafetensorsError(
        `${this.path}: closed before writing ${missing.length} tensors, first ${missing[0]}`,
      );
    }
  }

  /** Closes the file without the completeness check (after an error). */
  abort(): void {
    if (this.closed) return;
    this.closed = true;
    fs.closeSync(this.fd);
  }
}

/** Writes whole tensors (in the order given) and optional string metadata. */
export function writeSafetensors(
  path: string,
  tensors: Record<string, TensorData>,
  metadata: Record<string, string> = {},
): void {
  const specs = Object.entries(tensors).map(([name, t]) => ({ name, dtype: t.dtype, shape: t.shape }));
  const writer = new SafetensorsWriter(path, specs, metadata);
  try {
    for (const [name, t] of Object.entries(tensors)) writer.write(name, t.data);
    writer.close();
  } catch (err) {
    writer.abort();
    throw err;
  }
}

/** Reads one tensor of a checked header; its dtype must be one this module reads. */
export function readTensor(header: SafetensorsHeader, name: string): TensorData {
  const info = header.tensors.get(name);
  if (info === undefined) throw new SafetensorsError(`${header.path}: missing tensor ${name}`);
  if (!(info.dtype in DTYPE_SIZES)) {
    throw new SafetensorsError(
      `${header.path}: tensor ${name} has dtype ${info.dtype}, which megamoe does not read`,
    );
  }
  checkLittleEndian();
  const dtype = info.dtype as Dtype;
  const buffer = new ArrayBuffer(info.end - info.begin);
  const fd = openForReading(header.path);
  try {
    readExactly(fd, new Uint8Array(buffer), header.dataStart + info.begin, `tensor ${name}`, header.path);
  } finally {
    fs.closeSync(fd);
  }
  return { dtype, shape: [...info.shape], data: ARRAY_OF[dtype](buffer, numel(info.shape)) };
}

/** Reads every tensor of a file (for small files and tests) and its metadata. */
export function readSafetensors(path: string): {
  tensors: Record<string, TensorData>;
  metadata: Record<string, string>;
} {
  const header = readSafetensorsHeader(path);
  const tensors: Record<string, TensorData> = {};
  for (const name of header.tensors.keys()) tensors[name] = readTensor(header, name);
  return { tensors, metadata: header.metadata };
}

// ---------------------------------------------------------------------------------------------------
// MoE layer ↔ DeepSeek FP8 checkpoint names

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

export interface SaveOptions {
  /** Checkpoint name prefix (default "model.layers.0.mlp."). */
  prefix?: string;
  /** Extra `__metadata__` strings. */
  metadata?: Record<string, string>;
  /** Called after each routed expert, the shared expert and the gate: (done, total). */
  onProgress?: (done: number, total: number) => void;
}

/**
 * Writes a layer's weights as a DeepSeek-style FP8 checkpoint, one expert at a time (the source's lazy
 * experts are never all in memory). The file is written under a temporary name and renamed at the end,
 * so a failed or interrupted save never leaves a file that looks complete.
 */
export function saveMoEWeights(path: string, source: MoEWeightSource, opts: SaveOptions = {}): void {
  if (typeof path !== "string") throw new SafetensorsError(`path must be a string, got ${String(path)}`);
  const problem = weightSourceProblem(source);
  if (problem !== null) throw new SafetensorsError(`saveMoEWeights: ${problem}`);
  const config = validateConfig(source.config); // returns at once for a validated config
  if (typeof opts !== "object" || opts === null) {
    throw new SafetensorsError(`save options must be an object, got ${String(opts)}`);
  }
  const prefix = opts.prefix ?? DEFAULT_PREFIX;
  if (typeof prefix !== "string")
    throw new SafetensorsError(`prefix must be a string, got ${String(prefix)}`);
  const metadata = {
    format: "pt",
    "megamoe.config": JSON.stringify(config),
    ...opts.metadata,
  };
  const total = config.numExperts + (config.numShared > 0 ? 1 : 0) + 1;
  const temp = `${path}.partial-${process.pid}`;
  const writer = new SafetensorsWriter(temp, moeTensorSpecs(config, prefix), metadata);
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
      if (w === null) throw new SafetensorsError("config has shared experts but the weight source has none");
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
    fs.renameSync(temp, path);
  } catch (err) {
    writer.abort();
    fs.rmSync(temp, { force: true });
    throw err;
  }
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
  if (keys.some((k) => s[k] !== config[k])) {
    const shape = (c: Partial<MoEConfig>) =>
      `E=${c.numExperts} H=${c.hidden} I=${c.intermediate} shared=${c.numShared}`;
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
        checkScales(this.header.path, scaleName, targets[proj].scales);
      }
    } finally {
      fs.closeSync(fd);
    }
    return { w1, w2 };
  }

  /** The MXFP4 counterpart of readMlp: gate and up rows into one W1 [2I, H], down into W2 [H, I]. */
  private readMlpFp4(mlp: string, inter: number): Fp4ExpertWeights {
    const h = this.config.hidden;
    const make = (rows: number, cols: number): Mxfp4Matrix => ({
      packed: new Uint8Array((rows * cols) / 2),
      scales: new Uint8Array((rows * cols) / MXFP4_GROUP),
      rows,
      cols,
    });
    const w1 = make(2 * inter, h);
    const w2 = make(h, inter);
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
  for (let i = 0; i < q.length; i++) {
    if ((q[i]! & 0x7f) === 0x7f) {
      throw new SafetensorsError(
        `${path}: tensor ${name}[${i}] holds the FP8 e4m3 NaN code 0x${q[i]!.toString(16)}`,
      );
    }
  }
}

/** Weight scales must be positive and finite: anything else means a corrupt or foreign file. */
function checkScales(path: string, name: string, scales: Float32Array): void {
  for (let i = 0; i < scales.length; i++) {
    const s = scales[i];
    if (!(s > 0 && s < Number.POSITIVE_INFINITY)) {
      throw new SafetensorsError(`${path}: tensor ${name}[${i}] = ${s} is not a positive finite scale`);
    }
  }
}

/** UE8M0 scale bytes must not be 0xFF (NaN); the error names the tensor's row and K group. */
function checkE8m0Scales(path: string, name: string, scales: Uint8Array, perRow: number): void {
  const i = scales.indexOf(E8M0_NAN);
  if (i >= 0) {
    throw new SafetensorsError(
      `${path}: tensor ${name} has UE8M0 scale byte 0xFF (NaN) at row ${Math.floor(i / perRow)}, K group ${i % perRow}`,
    );
  }
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
  const prefix = opts.prefix ?? DEFAULT_PREFIX;
  if (typeof prefix !== "string")
    throw new SafetensorsError(`prefix must be a string, got ${String(prefix)}`);
  const experts = new ExpertCache(c, opts.cachedExperts ?? 2);
  const header = readSafetensorsHeader(path);
  checkSavedShape(header, c);
  checkLayerTensors(header, moeTensorSpecs(c, prefix));
  return new SafetensorsWeights(c, header, prefix, experts);
}
