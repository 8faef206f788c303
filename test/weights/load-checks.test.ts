/**
 * What a load checks before a layer computes anything: a header that names a tensor twice, a folder
 * given as a file, a checkpoint whose files the OS will not open (with the OS's reason, not "missing"),
 * and weight scales whose product with the format's largest code leaves fp32. Every case is written into
 * a fresh temporary folder.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, it } from "node:test";
import { resolveConfig } from "../../src/config/config.js";
import { type Checkpoint, openCheckpoint } from "../../src/weights/checkpoint.js";
import { CheckpointError, v4Names } from "../../src/weights/checkpoint-format.js";
import { GeneratedWeights } from "../../src/weights/generate.js";
import { loadMoEWeights, saveMoEWeights } from "../../src/weights/moe-file.js";
import { readSafetensorsHeader, SafetensorsError } from "../../src/weights/safetensors.js";
import { editHeaderText, pokeTensorBytes, withTensorTwice } from "../helpers/safetensors-edit.js";
import { writeTinyV4 } from "../helpers/v4-checkpoint.js";

const root = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-load-checks-"));
after(() => fs.rmSync(root, { recursive: true, force: true }));
let folders = 0;
/** A fresh, empty folder under the test's temporary root. */
const fresh = (): string => {
  const dir = path.join(root, `case-${folders++}`);
  fs.mkdirSync(dir);
  return dir;
};

const tiny = resolveConfig("tiny");
const tinyFp4 = resolveConfig("tiny", { expertFormat: "fp4" });
const P = "model.layers.0.mlp.";

/** A megamoe file of the tiny layer (FP8 experts, or FP4 with `fp4`) in a fresh folder. */
function moeFile(fp4 = false): string {
  const file = path.join(fresh(), "layer.safetensors");
  saveMoEWeights(file, new GeneratedWeights(fp4 ? tinyFp4 : tiny, 5));
  return file;
}

/** The tiny V4 checkpoint (layers.2 FP4, layers.3 FP8) in a fresh folder. */
function v4Checkpoint(): string {
  const dir = path.join(fresh(), "ckpt");
  writeTinyV4(dir, 11);
  return dir;
}

const f32Bytes = (v: number) => new Uint8Array(Float32Array.of(v).buffer);
const escaped = (s: string) => s.replaceAll(/[.*+?^${}()|[\]\\]/g, "\\$&");

/** `run` throws `kind` (exactly, not a subclass standing in) with a message matching `message`. */
function fails(run: () => unknown, kind: new (...a: never[]) => Error, message: RegExp): void {
  assert.throws(run, (e: unknown) => {
    assert.ok(e instanceof kind, `expected ${kind.name}, got ${String(e)}`);
    assert.equal((e as Error).name, kind.name);
    assert.match((e as Error).message, message);
    return true;
  });
}

describe("a safetensors header that names a tensor twice", () => {
  it("is refused by the header reader, naming the tensor and the file", () => {
    const file = path.join(fresh(), "twice.safetensors");
    // A name with a quote and a backslash: the scan of the header's keys must read escapes as JSON does.
    const name = 'we"ird\\';
    const entry = (begin: number) => ({ dtype: "F32", shape: [1], data_offsets: [begin, begin + 4] });
    const text = `{${JSON.stringify(name)}:${JSON.stringify(entry(0))},"b":${JSON.stringify(entry(4))},${JSON.stringify(name)}:${JSON.stringify(entry(4))}}`;
    const head = Buffer.alloc(8);
    const padded = text + " ".repeat((8 - ((8 + text.length) % 8)) % 8);
    head.writeBigUInt64LE(BigInt(padded.length));
    fs.writeFileSync(file, Buffer.concat([head, Buffer.from(padded), Buffer.alloc(8)]));
    fails(
      () => readSafetensorsHeader(file),
      SafetensorsError,
      new RegExp(`^${escaped(file)}: the header lists tensor ${escaped(name)} twice`),
    );
  });

  it("__metadata__ twice is refused too; keys repeated inside entries are not top-level names", () => {
    const file = moeFile();
    editHeaderText(file, (t) => `${t.slice(0, -1)},"__metadata__":{"format":"pt"}}`);
    fails(() => readSafetensorsHeader(file), SafetensorsError, /the header lists __metadata__ twice/);
    // Every entry holds "dtype", "shape" and "data_offsets": the untouched file reads.
    assert.ok(readSafetensorsHeader(moeFile()).tensors.size > 0);
  });

  it("loadMoEWeights refuses a layer file whose header lists an expert's weight twice", () => {
    const file = moeFile();
    const name = `${P}experts.0.gate_proj.weight`;
    editHeaderText(file, (t) => withTensorTwice(t, name, `${P}experts.1.gate_proj.weight`));
    fails(
      () => loadMoEWeights(file, tiny),
      SafetensorsError,
      new RegExp(`^${escaped(file)}: the header lists tensor ${escaped(name)} twice`),
    );
  });

  it("a V4 checkpoint's shard that lists a tensor twice is refused when its layer opens", () => {
    const dir = v4Checkpoint();
    const name = v4Names.routed("layers.3", 0, "w1", "weight");
    const c = openCheckpoint(dir) as Checkpoint;
    const { file } = c.locate(name);
    editHeaderText(file, (t) => withTensorTwice(t, name, name));
    fails(
      () => (openCheckpoint(dir) as Checkpoint).layer(3),
      SafetensorsError,
      new RegExp(`^${escaped(file)}: the header lists tensor ${escaped(name)} twice`),
    );
  });
});

describe("a folder where a safetensors file is expected", () => {
  it("loadMoEWeights and the header reader name the folder, and point to openCheckpoint", () => {
    const dir = fresh();
    for (const read of [() => loadMoEWeights(dir, tiny), () => readSafetensorsHeader(dir)]) {
      fails(
        read,
        SafetensorsError,
        new RegExp(`^${escaped(dir)}: is a directory, not a safetensors file \\(.*openCheckpoint`),
      );
    }
  });
});

describe("a checkpoint whose files the OS will not open gives the OS's reason", () => {
  it("config.json in a symbolic link loop: ELOOP, not missing", () => {
    const dir = fresh();
    fs.symlinkSync("config.json", path.join(dir, "config.json"));
    fails(
      () => openCheckpoint(dir),
      CheckpointError,
      new RegExp(`^${escaped(path.join(dir, "config.json"))}: cannot open: ELOOP: too many symbolic links`),
    );
  });

  it("config.json a dangling symbolic link: its target is named", () => {
    const dir = fresh();
    fs.symlinkSync("elsewhere.json", path.join(dir, "config.json"));
    fails(
      () => openCheckpoint(dir),
      CheckpointError,
      /config\.json: a symbolic link to elsewhere\.json, which does not exist/,
    );
  });

  it("a config.json that is not there is still missing", () => {
    fails(() => openCheckpoint(fresh()), CheckpointError, /config\.json: missing: a V4 checkpoint needs/);
  });

  it("the index and a shard in a symbolic link loop", () => {
    const dir = v4Checkpoint();
    const c = openCheckpoint(dir) as Checkpoint;
    const shard = path.join(dir, c.shards[0]);
    fs.rmSync(shard);
    fs.symlinkSync(c.shards[0], shard);
    fails(() => openCheckpoint(dir), CheckpointError, new RegExp(`^${escaped(shard)}: cannot open: ELOOP`));
    const index = path.join(dir, "model.safetensors.index.json");
    fs.rmSync(index);
    fs.symlinkSync("model.safetensors.index.json", index);
    fails(() => openCheckpoint(dir), CheckpointError, new RegExp(`^${escaped(index)}: cannot open: ELOOP`));
  });

  it("a checkpoint folder without permission to read it: EACCES, not missing", (t) => {
    if (process.getuid?.() === 0) {
      t.skip("root reads a folder whatever its mode: chmod 000 denies nothing to test");
      return;
    }
    const dir = fresh();
    fs.writeFileSync(path.join(dir, "config.json"), "{}");
    fs.chmodSync(dir, 0o000);
    try {
      fails(
        () => openCheckpoint(dir),
        CheckpointError,
        /config\.json: cannot open: EACCES: permission denied/,
      );
    } finally {
      fs.chmodSync(dir, 0o755);
    }
  });
});

describe("a weight scale whose product with the largest code overflows fp32 is refused at load", () => {
  it("a megamoe file's F32 scale: refused past F32_MAX/448, naming the tensor (the expert) and the block", () => {
    const file = moeFile();
    const name = `${P}experts.2.down_proj.weight_scale_inv`; // [H/128, I/128] = [2, 1]
    pokeTensorBytes(file, name, 4, f32Bytes(3e38));
    fails(
      () => loadMoEWeights(file, tiny).expert(2),
      SafetensorsError,
      new RegExp(
        `^${escaped(file)}: tensor ${escaped(name)}, block \\[1, 0\\]: the scale 3\\.0\\d*e\\+38 is too large: times 448, e4m3's largest magnitude, it exceeds fp32's largest value 3\\.4028e\\+38`,
      ),
    );
    // The largest scale that fits (448 times it is still an fp32 value) is taken.
    pokeTensorBytes(file, name, 4, f32Bytes(7.5e35));
    assert.equal(loadMoEWeights(file, tiny).expert(2).w2.scales[1], Math.fround(7.5e35));
    pokeTensorBytes(file, name, 4, f32Bytes(7.7e35));
    fails(
      () => loadMoEWeights(file, tiny).expert(2),
      SafetensorsError,
      /block \[1, 0\]: the scale 7\.69+\d*e\+35 is too large/,
    );
  });

  it("a megamoe file's UE8M0 scale byte (FP4 experts): 253 refused, 252 taken", () => {
    const file = moeFile(true);
    const name = `${P}experts.1.down_proj.weight_scale_inv`; // [H, I/32] = [256, 4]
    pokeTensorBytes(file, name, 4 * 2 + 1, Uint8Array.of(253));
    fails(
      () => loadMoEWeights(file, tinyFp4).expert(1),
      SafetensorsError,
      new RegExp(
        `${escaped(name)} at row 2, K group 1: the UE8M0 scale byte is 0xFD, the scale 2\\^126: times 6, e2m1's largest magnitude, it overflows fp32`,
      ),
    );
    pokeTensorBytes(file, name, 4 * 2 + 1, Uint8Array.of(252));
    assert.equal(loadMoEWeights(file, tinyFp4).expert(1).w2.scales[9], 252);
  });

  it("a V4 checkpoint's E8M0 scale of an FP8 expert: 247 refused (448 · 2^120 > F32_MAX), 246 taken", () => {
    const dir = v4Checkpoint();
    const name = v4Names.routed("layers.3", 4, "w2", "scale"); // [H/128, I/128] = [2, 1]
    const { file } = (openCheckpoint(dir) as Checkpoint).locate(name);
    pokeTensorBytes(file, name, 1, Uint8Array.of(247));
    fails(
      () => (openCheckpoint(dir) as Checkpoint).layer(3).expert(4),
      CheckpointError,
      new RegExp(
        `^${escaped(file)}: tensor ${escaped(name)}\\[1, 0\\] is 0xF7, the scale 2\\^120: times 448, e4m3's largest magnitude, it overflows fp32`,
      ),
    );
    pokeTensorBytes(file, name, 1, Uint8Array.of(246));
    const w = (openCheckpoint(dir) as Checkpoint).layer(3).expert(4);
    assert.ok(w.format !== "fp4");
    assert.equal(w.w2.scales[1], 2 ** 119);
  });

  it("a V4 checkpoint's E8M0 scale of an FP4 expert, and of the FP8 shared expert", () => {
    const dir = v4Checkpoint();
    const c = openCheckpoint(dir) as Checkpoint;
    const fp4 = v4Names.routed("layers.2", 6, "w1", "scale"); // [I, H/32] = [128, 8]
    pokeTensorBytes(c.locate(fp4).file, fp4, 8 + 3, Uint8Array.of(254));
    fails(
      () => (openCheckpoint(dir) as Checkpoint).layer(2).expert(6),
      CheckpointError,
      /layers\.2\.ffn\.experts\.6\.w1\.scale\[1, 3\] is 0xFE, the scale 2\^127: times 6, e2m1's largest magnitude/,
    );
    const shared = v4Names.shared("layers.3", "w3", "scale");
    pokeTensorBytes(c.locate(shared).file, shared, 0, Uint8Array.of(250));
    fails(
      () => (openCheckpoint(dir) as Checkpoint).layer(3).shared(),
      CheckpointError,
      /shared_experts\.w3\.scale\[0, 0\] is 0xFA, the scale 2\^123: times 448/,
    );
  });
});
