/**
 * `megamoe inspect --deep` reads every expert with run's checks, and inspect without it says the codes
 * were not scanned; `run --weights` refuses what the loads now check (a scale that overflows fp32 with
 * 448, a tensor named twice) with exit 1 and no summary, never `"norm": null`. Every checkpoint is
 * written into a fresh temporary folder.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, it } from "node:test";
import { resolveConfig } from "../../src/config/config.js";
import { type Checkpoint, openCheckpoint } from "../../src/weights/checkpoint.js";
import { v4Names } from "../../src/weights/checkpoint-format.js";
import { GeneratedWeights } from "../../src/weights/generate.js";
import { saveMoEWeights } from "../../src/weights/moe-file.js";
import { runCliSync } from "../helpers/cli.js";
import { editHeaderText, pokeTensorBytes, withTensorTwice } from "../helpers/safetensors-edit.js";
import { writeTinyV4 } from "../helpers/v4-checkpoint.js";

const root = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-inspect-deep-"));
after(() => fs.rmSync(root, { recursive: true, force: true }));
let folders = 0;
const fresh = (): string => {
  const dir = path.join(root, `case-${folders++}`);
  fs.mkdirSync(dir);
  return dir;
};

const megamoe = (...args: string[]) => runCliSync(args);
const P = "model.layers.0.mlp.";

/** The tiny V4 checkpoint, with the e4m3 NaN code 0x7F planted in layers.3 (FP8) expert 5's w3. */
function poisonedV4(): { dir: string; tensor: string } {
  const dir = path.join(fresh(), "ckpt");
  writeTinyV4(dir, 11);
  const tensor = v4Names.routed("layers.3", 5, "w3", "weight");
  pokeTensorBytes((openCheckpoint(dir) as Checkpoint).locate(tensor).file, tensor, 300, Uint8Array.of(0x7f));
  return { dir, tensor };
}

/** The tiny layer saved by megamoe into a fresh folder. */
function moeFile(): string {
  const file = path.join(fresh(), "layer.safetensors");
  saveMoEWeights(file, new GeneratedWeights(resolveConfig("tiny"), 2));
  return file;
}

describe("megamoe inspect of a checkpoint holding an e4m3 NaN code", () => {
  const { dir, tensor } = poisonedV4();
  const named = new RegExp(`tensor ${tensor.replaceAll(".", "\\.")}\\[1, 44\\] is e4m3 NaN \\(code 0x7f\\)`);

  it("without --deep: problems none, and the codes are said not to be scanned, with how to scan them", () => {
    const r = megamoe("inspect", dir);
    assert.equal(r.code, 0, r.stderr);
    assert.match(
      r.stdout,
      /codes\s+not scanned: megamoe inspect --deep reads every expert's codes and scales/,
    );
    assert.match(r.stdout, /problems\s+none/);
    const j = JSON.parse(megamoe("inspect", dir, "--json").stdout);
    assert.equal(j.codesScanned, false);
    assert.equal(j.problemCount, 0);
  });

  it("--deep: the NaN code is a problem naming block, expert and tensor; exit 1", () => {
    const r = megamoe("inspect", dir, "--deep");
    assert.equal(r.code, 1, r.stderr);
    assert.match(r.stdout, /codes\s+scanned: every expert, shared expert and gate of 5 blocks/);
    assert.match(r.stdout, /problems\s+1\n/);
    assert.match(r.stdout, /• layers\.3 expert 5: .*model-\d+-of-\d+\.safetensors: /);
    assert.match(r.stdout, named);
    const j = JSON.parse(megamoe("inspect", dir, "--deep", "--json").stdout);
    assert.equal(j.codesScanned, true);
    assert.equal(j.problemCount, 1);
    assert.match(j.problems[0], named);
  });

  it("run refuses the layer with the same words", () => {
    const r = megamoe("run", "--checkpoint", dir, "--layer", "3", "--tokens", "64", "--backend", "cpu");
    assert.equal(r.code, 1);
    assert.match(r.stderr, named);
  });

  it("--deep on a sound checkpoint: problems none, exit 0", () => {
    const clean = path.join(fresh(), "ckpt");
    writeTinyV4(clean, 11);
    const r = megamoe("inspect", clean, "--deep");
    assert.equal(r.code, 0, r.stdout + r.stderr);
    assert.match(r.stdout, /codes\s+scanned/);
    assert.match(r.stdout, /problems\s+none/);
  });
});

describe("megamoe inspect of a file saved by megamoe", () => {
  it("says its codes were not scanned; --deep reads them and lists the NaN code, exit 1", () => {
    const file = moeFile();
    const tensor = `${P}experts.4.down_proj.weight`;
    pokeTensorBytes(file, tensor, 17, Uint8Array.of(0xff));
    const r = megamoe("inspect", file);
    assert.equal(r.code, 0, r.stderr);
    assert.match(r.stdout, /one layer saved by megamoe/);
    assert.match(r.stdout, /codes\s+not scanned: megamoe inspect --deep/);
    const deep = megamoe("inspect", file, "--deep");
    assert.equal(deep.code, 1, deep.stderr);
    assert.match(deep.stdout, /problems\s+1\n/);
    assert.match(
      deep.stdout,
      new RegExp(
        `• expert 4: .*tensor ${tensor.replaceAll(".", "\\.")}\\[17\\] holds the FP8 e4m3 NaN code 0xff`,
      ),
    );
    const j = JSON.parse(megamoe("inspect", file, "--deep", "--json").stdout);
    assert.deepEqual([j.codesScanned, j.problemCount], [true, 1]);
    const sound = megamoe("inspect", moeFile(), "--deep", "--json");
    assert.equal(sound.code, 0, sound.stderr);
    assert.deepEqual(
      [JSON.parse(sound.stdout).codesScanned, JSON.parse(sound.stdout).problemCount],
      [true, 0],
    );
  });
});

describe("megamoe run --weights refuses what the loads check", () => {
  it("a block scale of 3e38: exit 1 naming tensor and block, no norm printed (with --json neither)", () => {
    const file = moeFile();
    const tensor = `${P}experts.0.gate_proj.weight_scale_inv`;
    pokeTensorBytes(file, tensor, 0, new Uint8Array(Float32Array.of(3e38).buffer));
    for (const json of [[], ["--json"]]) {
      const r = megamoe("run", "--weights", file, "--backend", "cpu", "--routing", "random", ...json);
      assert.equal(r.code, 1, r.stdout);
      assert.match(
        r.stderr,
        new RegExp(
          `tensor ${tensor.replaceAll(".", "\\.")}, block \\[0, 0\\]: the scale 3\\.0\\d*e\\+38 is too large`,
        ),
      );
      assert.equal(r.stdout, "");
    }
  });

  it("a header listing a tensor twice: exit 1 naming the tensor and the file", () => {
    const file = moeFile();
    const tensor = `${P}gate.weight`;
    editHeaderText(file, (t) => withTensorTwice(t, tensor, tensor));
    const r = megamoe("run", "--weights", file, "--backend", "cpu", "--json");
    assert.equal(r.code, 1, r.stdout);
    assert.match(
      r.stderr,
      new RegExp(`${file}: the header lists tensor ${tensor.replaceAll(".", "\\.")} twice`),
    );
    assert.equal(r.stdout, "");
  });
});
