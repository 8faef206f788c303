/** Edits of written safetensors files for tests: a tensor's bytes, or the header's JSON text itself. */
import fs from "node:fs";
import { readSafetensorsHeader } from "../../src/weights/safetensors.js";

/** Overwrites bytes of tensor `name` in `file`, from element byte `at` on. */
export function pokeTensorBytes(file: string, name: string, at: number, bytes: Uint8Array): void {
  const header = readSafetensorsHeader(file);
  const info = header.tensors.get(name);
  if (info === undefined) throw new Error(`${file} has no tensor ${name}`);
  const fd = fs.openSync(file, "r+");
  try {
    fs.writeSync(fd, bytes, 0, bytes.length, header.dataStart + info.begin + at);
  } finally {
    fs.closeSync(fd);
  }
}

/**
 * Rewrites the header's JSON as text (so that it may say what JSON.parse would hide, like a key twice),
 * re-padded to 8 bytes; the data section is kept as it was.
 */
export function editHeaderText(file: string, edit: (text: string) => string): void {
  const buf = fs.readFileSync(file);
  const n = Number(buf.readBigUInt64LE(0));
  let text = edit(
    buf
      .subarray(8, 8 + n)
      .toString("utf8")
      .trimEnd(),
  );
  text += " ".repeat((8 - ((8 + Buffer.byteLength(text)) % 8)) % 8);
  const head = Buffer.alloc(8);
  head.writeBigUInt64LE(BigInt(Buffer.byteLength(text)));
  fs.writeFileSync(file, Buffer.concat([head, Buffer.from(text), buf.subarray(8 + n)]));
}

/**
 * The header text with tensor `name` listed a second time, last, pointing at `other`'s bytes (same dtype
 * and shape): JSON.parse keeps that later entry without a word, so a reader would load `other`'s bytes.
 */
export function withTensorTwice(text: string, name: string, other: string): string {
  const entries = JSON.parse(text) as Record<string, unknown>;
  const copy = JSON.stringify({ [name]: entries[other] }).slice(1, -1);
  return `${text.slice(0, -1)},${copy}}`;
}
