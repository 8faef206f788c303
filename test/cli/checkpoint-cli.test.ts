import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { hashRouting } from "../../src/cli/checkpoint.js";
import { MoELayer } from "../../src/layer.js";
import { checksum } from "../../src/reference/metrics.js";
import { type Checkpoint, openCheckpoint } from "../../src/weights/checkpoint.js";
import { CONFIG_FILE } from "../../src/weights/checkpoint-format.js";
import { generateActivations } from "../../src/weights/generate.js";
import { runCliSync } from "../helpers/cli.js";
import { writeTinyV4 } from "../helpers/v4-checkpoint.js";

function megamoe(...args: string[]) {
  return runCliSync(args);
}

let dir = "";
let ckpt = "";
before(() => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-v4-cli-"));
  ckpt = path.join(dir, "tiny-v4");
});
after(() => {
  fs.rmSync(dir, { recursive: true, force: true });
});

describe("megamoe with a V4 checkpoint", () => {
  it("run --checkpoint --layer equals the layer built from the same weights in memory, every block", () => {
    // Each test writes the checkpoint it reads (so it also runs alone), over the one before.
    const layers = writeTinyV4(ckpt, 11, { overwrite: true });
    const tokens = 5;
    const seed = 3;
    for (const { block, source } of layers) {
      const name = block.startsWith("layers.") ? block.slice(7) : block;
      const r = megamoe(
        "run",
        "--checkpoint",
        ckpt,
        "--layer",
        name,
        "--tokens",
        `${tokens}`,
        "--seed",
        `${seed}`,
        "--backend",
        "cpu",
        "--json",
      );
      assert.equal(r.code, 0, r.stderr);
      const s = JSON.parse(r.stdout);
      const x = generateActivations(seed, tokens, source.config.hidden);
      const routing = hashRouting(source, x, tokens, seed)?.routing;
      const out = new MoELayer(source).forward(x, tokens, { routing }).out;
      assert.equal(s.checksum, checksum(out), block);
      assert.equal(s.expertFormat, source.config.expertFormat ?? "fp8");
      assert.equal(s.layerRouting, source.config.router.hashRouted === true ? "hash" : "score");
    }
  });

  it("inspect prints the MoE shape, expert formats, layers, shards and bytes", () => {
    writeTinyV4(ckpt, 11, { overwrite: true });
    const r = megamoe("inspect", ckpt);
    assert.equal(r.code, 0, r.stderr);
    assert.match(r.stdout, /E=8 H=256 I=128 top-2, 1 shared/);
    assert.match(r.stdout, /fp8 \(2 blocks\), fp4 \(3 blocks\)/);
    assert.match(r.stdout, /hash-routed 0–1; score-routed 2–3/);
    assert.match(r.stdout, /mtp\s+mtp\.0/);
    assert.match(r.stdout, /shards\s+\d+ \(\d+ tensors\)/);
    assert.match(r.stdout, /problems\s+none/);
    const j = JSON.parse(megamoe("inspect", ckpt, "--json").stdout);
    assert.deepEqual(j.hashLayers, [0, 1]);
    assert.equal(j.problemCount, 0);
  });

  it("inspect --exactness counts each FP4 block's elements that e4m3 does not hold exactly", () => {
    writeTinyV4(ckpt, 11, { overwrite: true });
    const j = JSON.parse(megamoe("inspect", ckpt, "--exactness", "--json").stdout);
    const c = openCheckpoint(ckpt) as Checkpoint;
    assert.deepEqual(Object.keys(j.fp4Exactness).sort(), ["layers.1", "layers.2", "mtp.0"]);
    for (const block of ["layers.1", "layers.2", "mtp.0"]) {
      assert.deepEqual(j.fp4Exactness[block], c.byName(block).fp4Exactness(), block);
    }
    const r = megamoe("inspect", ckpt, "--exactness");
    assert.equal(r.code, 0, r.stderr);
    assert.match(r.stdout, /fp4 → e4m3\s+[\d,]+ of 2,359,296 routed elements not exact \(3 FP4 blocks/);
    assert.equal(JSON.parse(megamoe("inspect", ckpt, "--json").stdout).fp4Exactness, undefined);
  });

  it("inspect lists the first problems and exits 1", () => {
    const bad = path.join(dir, "bad");
    writeTinyV4(bad, 11);
    const cfg = path.join(bad, CONFIG_FILE);
    const j = JSON.parse(fs.readFileSync(cfg, "utf8"));
    j.moe_intermediate_size = 256;
    fs.writeFileSync(cfg, JSON.stringify(j));
    const r = megamoe("inspect", bad);
    assert.equal(r.code, 1);
    assert.match(r.stdout, /problems\s+5/);
    assert.match(
      r.stdout,
      /layers\.0: .*experts\.0\.w1\.weight has shape \[128, 256\], but config\.json implies \[256, 256\]/,
    );
    fs.rmSync(path.join(bad, "model-00003-of-00006.safetensors"));
    const gone = megamoe("inspect", bad);
    assert.equal(gone.code, 1);
    assert.match(gone.stdout, /it does not open\n.*model-00003-of-00006\.safetensors: missing shard/);
  });

  it("check --checkpoint runs a layer; bad --layer, --layer alone and bench's other impls are named", () => {
    writeTinyV4(ckpt, 11, { overwrite: true });
    const c = megamoe(
      "check",
      "--checkpoint",
      ckpt,
      "--layer",
      "2",
      "--tokens",
      "3",
      "--backend",
      "cpu",
      "--json",
    );
    assert.equal(c.code, 0, c.stderr);
    assert.match(JSON.parse(c.stdout).shape, /layers\.2$/);
    const out = megamoe("run", "--checkpoint", ckpt, "--layer", "9", "--backend", "cpu");
    assert.notEqual(out.code, 0);
    assert.match(out.stderr, /config\.json: layer 9 is out of range: num_hidden_layers is 4/);
    const none = megamoe("run", "--checkpoint", ckpt, "--backend", "cpu");
    assert.match(none.stderr, /say which layer with --layer <L> \(0\.\.3\) or mtp\.0/);
    assert.match(megamoe("run", "--layer", "2").stderr, /--layer needs --checkpoint/);
    assert.match(
      megamoe("bench", "--impl", "quant", "--checkpoint", ckpt).stderr,
      /--checkpoint times a checkpoint's layer: use it with --impl fused, unfused or fused,unfused/,
    );
    // bench reads the checkpoint before it looks for a GPU: its problems come first on any machine.
    assert.match(
      megamoe("bench", "--impl", "fused", "--checkpoint", ckpt, "--layer", "9").stderr,
      /config\.json: layer 9 is out of range: num_hidden_layers is 4/,
    );
  });
});
