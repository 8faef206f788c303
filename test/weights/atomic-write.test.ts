/**
 * No writer leaves a damaged file under a final name: saveCheckpoint, saveMoEWeights, writeSafetensors
 * and writeResults write aside and rename at the end, refuse a non-empty target unless told to
 * overwrite, and reject option fields they do not know. Each row of the census is a call a user might
 * make, with the error class and a message fragment, or what the folder holds afterwards.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, it } from "node:test";
import { DirectoryError } from "../../src/cuda/mkdir.js";
import { writeResults } from "../../src/cuda/timing.js";
import {
  CheckpointError,
  GeneratedWeights,
  type MoEWeightSource,
  openCheckpoint,
  resolveConfig,
  SafetensorsError,
  saveCheckpoint,
  saveMoEWeights,
} from "../../src/index.js";
import { writeAside } from "../../src/io/write-aside.js";
import { readSafetensorsHeader, writeSafetensors } from "../../src/weights/safetensors.js";
import { testSeed } from "../helpers/random.js";
import { tinyV4Layers, writeTinyV4 } from "../helpers/v4-checkpoint.js";

const seed = testSeed("atomic-write");
const root = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-atomic-write-"));
after(() => fs.rmSync(root, { recursive: true, force: true }));
let serial = 0;
/** A fresh path under the test's folder (not created). */
const fresh = (name: string) => path.join(root, `${serial++}-${name}`);

/** Every entry of `dir` (hidden ones too) and its bytes; null when `dir` does not exist. */
function snapshot(dir: string): Map<string, Buffer> | null {
  if (!fs.existsSync(dir)) return null;
  const out = new Map<string, Buffer>();
  for (const name of fs.readdirSync(dir).sort()) out.set(name, fs.readFileSync(path.join(dir, name)));
  return out;
}

/** `inner`, whose routed expert `at` throws: a source that fails midway through a save. */
function failingAt(inner: MoEWeightSource, at: number): MoEWeightSource {
  return {
    config: inner.config,
    expert: (e) => {
      if (e === at) throw new Error(`the source failed at expert ${e}`);
      return inner.expert(e);
    },
    shared: () => inner.shared(),
    gate: () => inner.gate(),
  };
}

/** The tests' tiny V4 layers with layer 3 failing at expert 5: the shards before it are complete. */
function failingLayers() {
  const layers = tinyV4Layers(seed + 1);
  layers[3] = { block: layers[3].block, source: failingAt(layers[3].source, 5) };
  return layers;
}

const failed = /the source failed at expert 5/;

describe("saveCheckpoint writes aside and refuses a non-empty directory", () => {
  it("a source failing midway leaves a directory holding a checkpoint byte for byte as it was", () => {
    const dir = fresh("ckpt");
    writeTinyV4(dir, seed);
    const before = snapshot(dir)!;
    assert.ok(before.size >= 4, "a checkpoint of several shards, its index and config.json");
    assert.throws(
      () => saveCheckpoint(dir, failingLayers(), { shardBytes: 600_000, overwrite: true }),
      failed,
    );
    assert.deepEqual(snapshot(dir), before);
    // …and it still opens and reads.
    openCheckpoint(dir).layer(3).expert(7);
  });

  it("a source failing midway leaves an empty directory empty, and a new one not made", () => {
    const empty = fresh("empty");
    fs.mkdirSync(empty);
    assert.throws(() => saveCheckpoint(empty, failingLayers(), { shardBytes: 600_000 }), failed);
    assert.deepEqual(snapshot(empty), new Map());
    const parent = fresh("new");
    const nested = path.join(parent, "a", "b");
    assert.throws(() => saveCheckpoint(nested, failingLayers()), failed);
    assert.equal(fs.existsSync(parent), false, "the folders the save made are removed again");
  });

  it("a directory that holds anything is refused without overwrite, before any work", () => {
    const dir = fresh("held");
    writeTinyV4(dir, seed);
    const before = snapshot(dir)!;
    let experts = 0;
    const counting = tinyV4Layers(seed).map(({ block, source }) => ({
      block,
      source: {
        ...failingAt(source, -1),
        expert: (e: number) => {
          experts++;
          return source.expert(e);
        },
      },
    }));
    assert.throws(
      () => saveCheckpoint(dir, counting),
      (e: unknown) =>
        e instanceof CheckpointError &&
        e.message.includes(`directory ${dir} is not empty`) &&
        e.message.includes("config.json") &&
        e.message.includes("pass { overwrite: true }"),
    );
    assert.equal(experts, 0, "refused before any expert was read");
    assert.deepEqual(snapshot(dir), before);
    const other = fresh("other");
    fs.mkdirSync(other);
    fs.writeFileSync(path.join(other, "notes.txt"), "mine");
    assert.throws(() => saveCheckpoint(other, tinyV4Layers(seed)), /1 entries: notes\.txt\); pass/);
    const file = fresh("file");
    fs.writeFileSync(file, "x");
    assert.throws(
      () => saveCheckpoint(file, tinyV4Layers(seed), { overwrite: true }),
      (e: unknown) =>
        e instanceof CheckpointError && e.message.includes(`${file} is a file, not a directory`),
    );
  });

  it("overwrite: true replaces a checkpoint, removing the old shards the new index does not name", () => {
    const dir = fresh("replace");
    writeTinyV4(dir, seed);
    const oldShards = fs.readdirSync(dir).filter((f) => f.endsWith(".safetensors"));
    assert.ok(oldShards.length > 1);
    fs.writeFileSync(path.join(dir, "README"), "kept");
    const layers = tinyV4Layers(seed + 2).slice(2, 4);
    saveCheckpoint(dir, layers, { overwrite: true, numHiddenLayers: 4 });
    assert.deepEqual(fs.readdirSync(dir).sort(), [
      "README",
      "config.json",
      "model-00001-of-00001.safetensors",
      "model.safetensors.index.json",
    ]);
    const ckpt = openCheckpoint(dir);
    const e = ckpt.layer(2).expert(1);
    const want = layers[0].source.expert(1);
    assert.deepEqual(e.w1, want.w1);
  });

  it("rejects unknown and mistyped option fields, naming the field and the known ones", () => {
    const dir = fresh("options");
    const layers = tinyV4Layers(seed);
    const rows: [string, () => unknown, RegExp][] = [
      [
        "shardSize",
        () => saveCheckpoint(dir, layers, { shardSize: 1000 } as never),
        /^saveCheckpoint: unknown option field shardSize; known: shardBytes, numHiddenLayers, vocab, extraTensors, config, onProgress, overwrite$/,
      ],
      [
        "overwite",
        () => saveCheckpoint(dir, layers, { overwite: true } as never),
        /field overwite \(did you mean overwrite\?\)/,
      ],
      [
        "overwrite: 'yes'",
        () => saveCheckpoint(dir, layers, { overwrite: "yes" } as never),
        /overwrite must be true or false, got the string "yes"/,
      ],
      [
        "options null",
        () => saveCheckpoint(dir, layers, null as never),
        /options must be an object, got null/,
      ],
      [
        "a layer's extra field",
        () => saveCheckpoint(dir, [{ ...layers[2], prefix: "x." } as never]),
        /unknown layer field prefix; known: block, source/,
      ],
      ["dir 5", () => saveCheckpoint(5 as never, layers), /dir must be a string, got number 5/],
    ];
    for (const [what, run, message] of rows) {
      assert.throws(
        run,
        (e: unknown) => e instanceof CheckpointError && message.test(e.message),
        `${what}: a CheckpointError matching ${message}`,
      );
    }
    assert.equal(fs.existsSync(dir), false, "nothing was written");
  });
});

describe("saveMoEWeights, writeSafetensors and writeResults write aside and refuse an existing file", () => {
  const config = resolveConfig("tiny");

  it("saveMoEWeights: a source failing midway leaves an existing file as it was, and makes no new one", () => {
    const dir = fresh("one-file");
    fs.mkdirSync(dir);
    const file = path.join(dir, "w.safetensors");
    saveMoEWeights(file, new GeneratedWeights(config, seed));
    const before = snapshot(dir)!;
    const failing = failingAt(new GeneratedWeights(config, seed + 1), 5);
    assert.throws(() => saveMoEWeights(file, failing, { overwrite: true }), failed);
    assert.deepEqual(snapshot(dir), before);
    assert.throws(() => saveMoEWeights(path.join(dir, "none.safetensors"), failing), failed);
    assert.deepEqual(snapshot(dir), before);
  });

  it("saveMoEWeights: an existing file is refused unless overwrite is on; a folder always", () => {
    const file = fresh("w.safetensors");
    fs.writeFileSync(file, "not mine to replace");
    assert.throws(
      () => saveMoEWeights(file, new GeneratedWeights(config, seed)),
      (e: unknown) =>
        e instanceof SafetensorsError &&
        e.message === `saveMoEWeights: ${file} exists; pass { overwrite: true } to replace it`,
    );
    assert.equal(fs.readFileSync(file, "utf8"), "not mine to replace");
    saveMoEWeights(file, new GeneratedWeights(config, seed), { overwrite: true });
    assert.equal(readSafetensorsHeader(file).tensors.size > 0, true);
    assert.throws(
      () => saveMoEWeights(root, new GeneratedWeights(config, seed), { overwrite: true }),
      (e: unknown) => e instanceof SafetensorsError && e.message.includes(`${root} is a folder, not a file`),
    );
    assert.throws(
      () => saveMoEWeights(file, new GeneratedWeights(config, seed), { overwrite: 1 } as never),
      (e: unknown) =>
        e instanceof SafetensorsError && /overwrite must be true or false, got number 1/.test(e.message),
    );
    assert.throws(
      () => saveMoEWeights(file, new GeneratedWeights(config, seed), { overwrit: true } as never),
      (e: unknown) =>
        e instanceof SafetensorsError &&
        /unknown save options field overwrit \(did you mean overwrite\?\)/.test(e.message),
    );
  });

  it("saveMoEWeights through a link replaces the linked file and keeps the link", () => {
    const target = fresh("target.safetensors");
    const link = fresh("link.safetensors");
    saveMoEWeights(target, new GeneratedWeights(config, seed));
    fs.symlinkSync(target, link);
    saveMoEWeights(link, new GeneratedWeights(config, seed + 3), { overwrite: true, metadata: { v: "2" } });
    assert.equal(fs.lstatSync(link).isSymbolicLink(), true);
    assert.equal(readSafetensorsHeader(target).metadata.v, "2");
  });

  it("writeSafetensors: refused over an existing file unless overwrite; a failed write leaves it as it was", () => {
    const file = fresh("t.safetensors");
    const tensors = { a: { dtype: "F32" as const, shape: [2], data: Float32Array.from([1, 2]) } };
    writeSafetensors(file, tensors);
    const before = fs.readFileSync(file);
    assert.throws(
      () => writeSafetensors(file, tensors),
      (e: unknown) => e instanceof SafetensorsError && e.message.includes("exists; pass { overwrite: true }"),
    );
    const bad = { a: { dtype: "F32" as const, shape: [3], data: new Float32Array(2) } };
    assert.throws(
      () => writeSafetensors(file, bad, {}, { overwrite: true }),
      // The error names the file asked for, not its temporary name.
      (e: unknown) => e instanceof SafetensorsError && e.message.startsWith(`${file}: tensor a`),
    );
    assert.deepEqual(fs.readFileSync(file), before);
    writeSafetensors(file, { b: tensors.a }, {}, { overwrite: true });
    assert.deepEqual([...readSafetensorsHeader(file).tensors.keys()], ["b"]);
  });

  it("writeResults: an existing file is a DirectoryError unless overwrite", () => {
    const file = fresh("r.json");
    writeResults(file, { device: "x", rows: [] });
    assert.throws(
      () => writeResults(file, { device: "y", rows: [] }),
      (e: unknown) =>
        e instanceof DirectoryError && e.message.includes(`${file} exists; pass { overwrite: true }`),
    );
    assert.equal(JSON.parse(fs.readFileSync(file, "utf8")).device, "x");
    writeResults(file, { device: "y", rows: [] }, { overwrite: true });
    assert.equal(JSON.parse(fs.readFileSync(file, "utf8")).device, "y");
  });
});

describe("writeAside", () => {
  it("renames every file only once all are written; a failure removes the temporary files", () => {
    const dir = fresh("aside");
    fs.mkdirSync(dir);
    fs.writeFileSync(path.join(dir, "b"), "old b");
    const files = ["a", "b"].map((f) => path.join(dir, f));
    assert.throws(
      () =>
        writeAside(files, ([a]) => {
          fs.writeFileSync(a, "new a");
          throw new Error("stop");
        }),
      /stop/,
    );
    assert.deepEqual(snapshot(dir), new Map([["b", Buffer.from("old b")]]));
    // A temporary file the callback never wrote is an error, not an empty file renamed into place.
    assert.throws(() => writeAside(files, ([a]) => fs.writeFileSync(a, "new a")), /ENOENT/);
    assert.deepEqual(snapshot(dir), new Map([["b", Buffer.from("old b")]]));
    writeAside(files, (temps) => {
      for (const [i, t] of temps.entries()) fs.writeFileSync(t, `new ${i}`);
    });
    assert.deepEqual(
      snapshot(dir),
      new Map([
        ["a", Buffer.from("new 0")],
        ["b", Buffer.from("new 1")],
      ]),
    );
  });
});
