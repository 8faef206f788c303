/**
 * safetensors files, written and read by the project (no package): the header, the dtype table, a
 * streaming writer and tensor readers. The MoE layer's names, load and save on top of it are in
 * moe-file.ts.
 *
 * File: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin,
 * end)}, "__metadata__": {string: string}} (space-padded so data starts 8-byte aligned), then the raw
 * little-endian tensor bytes; offsets are relative to the start of the data. Every problem with a file
 * throws SafetensorsError naming the file and, where there is one, the tensor.
 */
import fs from "node:fs";
import os from "node:os";
import { type OverwriteOption, overwriteProblem, targetFileProblem, writeAside } from "../io/write-aside.js";

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

export function checkLittleEndian(): void {
  // Typed arrays are written as their in-memory bytes; safetensors is little-endian.
  if (os.endianness() !== "LE") throw new SafetensorsError("safetensors I/O needs a little-endian host");
}

function dtypeSize(dtype: string): number | undefined {
  return dtype in DTYPE_SIZES ? DTYPE_SIZES[dtype as Dtype] : OTHER_DTYPE_SIZES[dtype];
}

export function shapeText(shape: readonly number[]): string {
  return `[${shape.join(", ")}]`;
}

function numel(shape: readonly number[]): number {
  return shape.reduce((a, b) => a * b, 1);
}

export function bytesOf(data: ArrayBufferView): Uint8Array {
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
    const stat = fs.fstatSync(fd);
    if (stat.isDirectory()) {
      // Opening a directory succeeds on Linux; its first read would fail with a bare EISDIR.
      throw new SafetensorsError(
        `${path}: is a directory, not a safetensors file (a DeepSeek-V4 checkpoint directory opens with openCheckpoint, or --checkpoint on the command line)`,
      );
    }
    const fileSize = stat.size;
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
    let text: string;
    try {
      text = new TextDecoder("utf-8", { fatal: true }).decode(raw);
      json = JSON.parse(text);
    } catch (err) {
      throw new SafetensorsError(`${path}: header is not valid UTF-8 JSON: ${(err as Error).message}`);
    }
    if (!isPlainObject(json)) throw new SafetensorsError(`${path}: header JSON is not an object`);
    const twice = firstRepeatedKey(text);
    if (twice !== null) {
      throw new SafetensorsError(
        twice === METADATA_KEY
          ? `${path}: the header lists ${METADATA_KEY} twice`
          : `${path}: the header lists tensor ${twice} twice (safetensors names each tensor once)`,
      );
    }
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

/**
 * The first top-level key of a JSON object text that appears twice, or null. JSON.parse keeps the last
 * of repeated keys without a word, so a header naming one tensor twice would read the last entry's bytes:
 * the keys are found in the text itself. `text` must be valid JSON (it was parsed first).
 */
function firstRepeatedKey(text: string): string | null {
  const seen = new Set<string>();
  let depth = 0;
  let keyNext = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (c === '"') {
      let j = i + 1;
      while (text[j] !== '"') j += text[j] === "\\" ? 2 : 1;
      if (depth === 1 && keyNext) {
        const key = JSON.parse(text.slice(i, j + 1)) as string;
        if (seen.has(key)) return key;
        seen.add(key);
        keyNext = false;
      }
      i = j;
    } else if (c === "{" || c === "[") {
      depth++;
      keyNext = depth === 1 && c === "{";
    } else if (c === "}" || c === "]") {
      depth--;
    } else if (c === "," && depth === 1) {
      keyNext = true;
    }
  }
  return null;
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

  /**
   * `path` is the file written; errors name `shownAs`, the file the user asked for, when `path` is its
   * temporary name (writeAside).
   */
  constructor(
    path: string,
    specs: TensorSpec[],
    metadata: Record<string, string> = {},
    readonly shownAs: string = path,
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
    if (this.closed) throw new SafetensorsError(`${this.shownAs}: write of ${name} after close`);
    const spec = this.specs.get(name);
    const range = this.offsets.get(name);
    if (spec === undefined || range === undefined)
      throw new SafetensorsError(`${this.shownAs}: unknown tensor ${name}`);
    if (this.written.has(name)) throw new SafetensorsError(`${this.shownAs}: tensor ${name} written twice`);
    const bytes = bytesOf(data);
    if (bytes.length !== range.end - range.begin) {
      throw new SafetensorsError(
        `${this.shownAs}: tensor ${name} (${spec.dtype} ${shapeText(spec.shape)}) needs ${range.end - range.begin} bytes, got ${bytes.length}`,
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
        `${this.shownAs}: closed before writing ${missing.length} tensors, first ${missing[0]}`,
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

/**
 * Writes whole tensors (in the order given) and optional string metadata, under a temporary name renamed
 * at the end (writeAside); an existing file at `path` is refused unless `overwrite` is on.
 */
export function writeSafetensors(
  path: string,
  tensors: Record<string, TensorData>,
  metadata: Record<string, string> = {},
  opts: OverwriteOption = {},
): void {
  const problem =
    overwriteProblem(opts.overwrite) ??
    targetFileProblem(path, opts.overwrite === true, "pass { overwrite: true }");
  if (problem !== null) throw new SafetensorsError(`writeSafetensors: ${problem}`);
  const specs = Object.entries(tensors).map(([name, t]) => ({ name, dtype: t.dtype, shape: t.shape }));
  writeAside([path], ([temp]) => {
    const writer = new SafetensorsWriter(temp, specs, metadata, path);
    try {
      for (const [name, t] of Object.entries(tensors)) writer.write(name, t.data);
      writer.close();
    } catch (err) {
      writer.abort();
      throw err;
    }
  });
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
