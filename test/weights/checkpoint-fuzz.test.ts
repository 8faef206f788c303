/**
 * A corrupt checkpoint is a clear error, never an internal one: random edits of a tiny V4 checkpoint's
 * config.json, index and shard headers (a value replaced by one of another kind, a key removed, a number
 * moved), of its bytes (the header's or the data's) and of a shard's length, each followed by opening
 * it, reading every layer and a CPU forward of each. Every error must be one of the project's own kinds,
 * naming what is wrong.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { ConfigError } from "../../src/config/config.js";
import { InputError, MoELayer } from "../../src/layer.js";
import { RouterError } from "../../src/reference/router.js";
import { Checkpoint, generateTokenIds, openCheckpoint } from "../../src/weights/checkpoint.js";
import { generateActivations } from "../../src/weights/generate.js";
import { SafetensorsError } from "../../src/weights/safetensors.js";
import { rng, testSeed } from "../helpers/random.js";
import { VOCAB, writeTinyV4 } from "../helpers/v4-checkpoint.js";

const seed = testSeed("checkpoint fuzz");
const EDITS = 120;

let root = "";
let good = "";
before(() => {
  root = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-fuzz-"));
  good = path.join(root, "good");
  writeTinyV4(good, seed);
});
after(() => {
  fs.rmSync(root, { recursive: true, force: true });
});

const OURS = [SafetensorsError, ConfigError, InputError, RouterError];

/** Values of every JSON kind, and numbers a field's check must not let through. */
const JUNK: unknown[] = [
  null,
  true,
  0,
  -1,
  1,
  3,
  0.5,
  1e300,
  2 ** 53,
  255,
  4096,
  "",
  "x",
  "BF16",
  "F8_E4M3",
  "I8",
  "F8_E8M0",
  [],
  [1],
  [-1, 5],
  [1, 2, 3],
  {},
  { a: 1 },
];

type Json = Record<string, unknown> | unknown[];

/** Every path to a value inside `json` (keys or array indices). */
function paths(value: unknown, prefix: string[] = []): string[][] {
  if (typeof value !== "object" || value === null) return [prefix];
  const out = prefix.length > 0 ? [prefix] : [];
  for (const k of Object.keys(value))
    out.push(...paths((value as Record<string, unknown>)[k], [...prefix, k]));
  return out;
}

/** One random edit of `json` in place; returns what it did. */
function editJson(json: Json, random: () => number): string {
  const all = paths(json);
  const p = all[Math.floor(random() * all.length)];
  let parent = json as Record<string, unknown>;
  for (const k of p.slice(0, -1)) parent = parent[k] as Record<string, unknown>;
  const key = p[p.length - 1];
  const r = random();
  if (r < 0.15) {
    if (Array.isArray(parent)) parent.splice(Number(key), 1);
    else delete parent[key];
    return `${p.join(".")} removed`;
  }
  if (r < 0.3 && typeof parent[key] === "number") {
    const by = [1, -1, 8, -8, 1000][Math.floor(random() * 5)];
    parent[key] = (parent[key] as number) + by;
    return `${p.join(".")} += ${by}`;
  }
  const junk = JUNK[Math.floor(random() * JUNK.length)];
  parent[key] = junk;
  return `${p.join(".")} = ${JSON.stringify(junk)}`;
}

function editShardHeader(file: string, random: () => number): string {
  const buf = fs.readFileSync(file);
  const n = Number(buf.readBigUInt64LE(0));
  const json = JSON.parse(buf.subarray(8, 8 + n).toString("utf8"));
  const what = editJson(json, random);
  let text = JSON.stringify(json);
  text += " ".repeat((8 - ((8 + Buffer.byteLength(text)) % 8)) % 8);
  const head = Buffer.alloc(8);
  head.writeBigUInt64LE(BigInt(Buffer.byteLength(text)));
  fs.writeFileSync(file, Buffer.concat([head, Buffer.from(text), buf.subarray(8 + n)]));
  return `header: ${what}`;
}

/** Opens the checkpoint and runs what a user would: every layer's CPU forward (2 tokens). */
function useCheckpoint(dir: string): void {
  const ckpt = openCheckpoint(dir);
  assert.ok(ckpt instanceof Checkpoint);
  for (const block of ckpt.blocks()) {
    const source = ckpt.byName(block.block, { maxTokens: 8 });
    const layer = new MoELayer(source, { backend: "cpu" });
    const x = generateActivations(seed, 2, source.config.hidden);
    layer.forward(x, 2, { tokenIds: generateTokenIds(seed, 2, VOCAB) });
  }
}

describe(`a corrupt V4 checkpoint, ${EDITS} random edits`, () => {
  it("is read or refused with the project's own errors", () => {
    const random = rng(seed);
    const outcomes = { read: 0, refused: 0 };
    for (let i = 0; i < EDITS; i++) {
      const dir = path.join(root, `edit${i}`);
      fs.cpSync(good, dir, { recursive: true });
      const files = fs.readdirSync(dir).sort();
      const file = path.join(dir, files[Math.floor(random() * files.length)]);
      let what: string;
      if (file.endsWith(".json")) {
        const json = JSON.parse(fs.readFileSync(file, "utf8"));
        what = editJson(json, random);
        fs.writeFileSync(file, JSON.stringify(json));
      } else {
        const r = random();
        const buf = fs.readFileSync(file);
        const headerEnd = 8 + Number(buf.readBigUInt64LE(0));
        if (r < 0.6) {
          what = editShardHeader(file, random);
        } else if (r < 0.75) {
          const at = Math.floor(random() * buf.length);
          fs.writeFileSync(file, buf.subarray(0, at));
          what = `cut at byte ${at} of ${buf.length}`;
        } else {
          // A byte of the header's text (or its length) half the time, of the data otherwise.
          const at = Math.floor(random() * (r < 0.85 ? headerEnd : buf.length));
          buf[at] = Math.floor(random() * 256);
          fs.writeFileSync(file, buf);
          what = `byte ${at} = ${buf[at]}`;
        }
      }
      try {
        useCheckpoint(dir);
        outcomes.read++;
      } catch (e) {
        outcomes.refused++;
        const ours = OURS.some((kind) => e instanceof kind);
        assert.ok(ours, `${path.basename(file)}, ${what}: ${String(e)}\n${(e as Error).stack ?? ""}`);
      }
      fs.rmSync(dir, { recursive: true, force: true });
    }
    // Both outcomes occur, or the edits test nothing.
    assert.ok(outcomes.read > 0 && outcomes.refused > 0, JSON.stringify(outcomes));
  });
});
