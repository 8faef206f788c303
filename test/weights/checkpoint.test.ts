import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { resolveConfig } from "../../src/config/config.js";
import { InputError, MoELayer } from "../../src/layer.js";
import { countFp4ToFp8Inexact } from "../../src/numerics/fp4.js";
import { gateLogits, RouterError, routeByHash, scoreLogits } from "../../src/reference/router.js";
import { Checkpoint, generateTokenIds, openCheckpoint } from "../../src/weights/checkpoint.js";
import { CheckpointError, CONFIG_FILE, INDEX_FILE, v4Names } from "../../src/weights/checkpoint-format.js";
import { saveCheckpoint } from "../../src/weights/checkpoint-save.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import { loadMoEWeights, saveMoEWeights } from "../../src/weights/moe-file.js";
import { RandomV4Weights } from "../../src/weights/random-v4.js";
import { readSafetensorsHeader } from "../../src/weights/safetensors.js";
import type { Fp4ExpertWeights, MoEWeightSource } from "../../src/weights/types.js";
import { testSeed } from "../helpers/random.js";
import { tinyV4, VOCAB, writeTinyV4 } from "../helpers/v4-checkpoint.js";

const seed = testSeed("V4 checkpoint tests");

let root = "";
let good = "";
before(() => {
  root = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-v4-"));
  good = path.join(root, "good");
  writeTinyV4(good, seed);
});
after(() => {
  fs.rmSync(root, { recursive: true, force: true });
});

/** A fresh copy of the good checkpoint to break. */
function copy(name: string): string {
  const dir = path.join(root, name);
  fs.cpSync(good, dir, { recursive: true });
  return dir;
}

function open(dir: string): Checkpoint {
  const c = openCheckpoint(dir);
  assert.ok(c instanceof Checkpoint);
  return c;
}

const BLOCKS = ["layers.0", "layers.1", "layers.2", "layers.3", "mtp.0"] as const;

/** Rewrites a shard's header JSON (data bytes kept), re-padding it to 8 bytes. */
function rewriteHeader(
  file: string,
  mutate: (json: Record<string, { dtype: string; shape: number[]; data_offsets: number[] }>) => void,
): void {
  const buf = fs.readFileSync(file);
  const n = Number(buf.readBigUInt64LE(0));
  const json = JSON.parse(buf.subarray(8, 8 + n).toString("utf8"));
  mutate(json);
  let text = JSON.stringify(json);
  text += " ".repeat((8 - ((8 + Buffer.byteLength(text)) % 8)) % 8);
  const head = Buffer.alloc(8);
  head.writeBigUInt64LE(BigInt(Buffer.byteLength(text)));
  fs.writeFileSync(file, Buffer.concat([head, Buffer.from(text), buf.subarray(8 + n)]));
}

/** Overwrites one byte of a tensor's data in its shard. */
function pokeTensorByte(dir: string, name: string, at: number, value: number): string {
  const c = open(dir);
  const loc = c.locate(name);
  const fd = fs.openSync(loc.file, "r+");
  fs.writeSync(fd, Uint8Array.of(value), 0, 1, loc.header.dataStart + loc.info.begin + at);
  fs.closeSync(fd);
  return loc.file;
}

function editJson(file: string, edit: (j: Record<string, unknown>) => void): void {
  const j = JSON.parse(fs.readFileSync(file, "utf8"));
  edit(j);
  fs.writeFileSync(file, JSON.stringify(j));
}

describe("V4 checkpoint layout", () => {
  it("loads every layer and mtp.0 with the config, format and routing config.json and the headers say", () => {
    const c = open(good);
    assert.equal(c.model.numLayers, 4);
    assert.equal(c.model.numHashLayers, 2);
    assert.equal(c.model.expertDtype, null); // mixed formats: decided per block from the header dtype
    assert.deepEqual(
      c.blocks().map((b) => `${b.block}:${b.routing}`),
      ["layers.0:hash", "layers.1:hash", "layers.2:score", "layers.3:score", "mtp.0:score"],
    );
    const formats = BLOCKS.map((b) => c.byName(b).config.expertFormat);
    assert.deepEqual(formats, ["fp8", "fp4", "fp4", "fp8", "fp4"]);
    assert.equal(c.layer(0).config.router.hashRouted, true);
    assert.equal(c.layer(0).config.router.correctionBias, false);
    assert.equal(c.layer(3).config.router.correctionBias, true);
    assert.equal(c.layer(3).config.scaleFormat, "ue8m0");
    assert.equal(c.layer(3).config.swigluClamp, 10);
    assert.ok(c.shards.length > 3, `${c.shards.length} shards`);
    assert.ok(
      BLOCKS.some((b) => c.byName(b).files.length > 1),
      "some layer's tensors span shards",
    );
    assert.ok(c.has("embed.weight") && c.has("layers.2.attn.wq_a.weight"));
  });

  it("reads back exactly the weights written: FP8 scales as powers of two, FP4 bytes, gate, bias, tid2eid", () => {
    const c = open(good);
    const layers = writeTinyV4(path.join(root, "again"), seed);
    for (const { block, source } of layers) {
      const loaded = c.byName(block);
      for (const e of [0, 5, 7]) assert.deepEqual(loaded.expert(e), source.expert(e), `${block} expert ${e}`);
      assert.deepEqual(loaded.shared(), source.shared(), `${block} shared`);
      const g = loaded.gate();
      const s = source.gate();
      assert.deepEqual(g.weight, s.weight);
      assert.deepEqual(g.bias, s.bias);
      assert.deepEqual(g.tid2eid, s.tid2eid);
    }
  });

  it("counts a layer's FP4 elements that e4m3 does not hold exactly, as the matrices themselves do", () => {
    const c = open(good);
    const direct = (src: MoEWeightSource) => {
      let n = 0;
      for (let e = 0; e < src.config.numExperts; e++) {
        const x = src.expert(e) as Fp4ExpertWeights;
        n += countFp4ToFp8Inexact(x.w1) + countFp4ToFp8Inexact(x.w2);
      }
      return n;
    };
    const l2 = c.byName("layers.2");
    assert.deepEqual(l2.fp4Exactness(), { elements: 8 * 3 * 128 * 256, inexact: direct(l2) });
    assert.throws(() => c.byName("layers.3").fp4Exactness(), /layers\.3: the routed experts are FP8/);
    // One K block of expert 5's W2 spanning 30 bytes: its low group's odd codes round.
    const src = new RandomV4Weights(tinyV4({ expertFormat: "fp4" }), seed + 9, { vocab: VOCAB });
    const wide = Object.create(src) as RandomV4Weights;
    wide.expert = (e: number) => {
      const x = src.expert(e) as Fp4ExpertWeights;
      if (e !== 5) return x;
      const scales = Uint8Array.from(x.w2.scales);
      scales.set([140, 110, 140, 140], 4);
      return { ...x, w2: { ...x.w2, scales } };
    };
    const dir = path.join(root, "wide");
    saveCheckpoint(dir, [{ block: "layers.0", source: wide }]);
    const got = open(dir).byName("layers.0").fp4Exactness();
    assert.ok(got.inexact > 0);
    assert.equal(got.inexact, direct(wide));
  });

  it("runs each layer on the CPU bit for bit like the same weights in memory", () => {
    const c = open(good);
    const tokens = 6;
    for (const { block, source } of writeTinyV4(path.join(root, "mem"), seed)) {
      const x = generateActivations(seed + 1, tokens, 256);
      const tokenIds = generateTokenIds(seed, tokens, VOCAB);
      const a = new MoELayer(c.byName(block)).forward(x, tokens, { tokenIds });
      const b = new MoELayer(source).forward(x, tokens, { tokenIds });
      assert.deepEqual(a.routing, b.routing, block);
      assert.deepEqual(a.out, b.out, block);
    }
  });

  it("writes files other safetensors readers take: 8-byte aligned data, no holes, V4's dtype strings", () => {
    const c = open(good);
    const dtypes = new Set<string>();
    for (const shard of c.shards) {
      const h = readSafetensorsHeader(path.join(good, shard));
      assert.equal(h.dataStart % 8, 0);
      const ranges = [...h.tensors.values()].sort((a, b) => a.begin - b.begin);
      let at = 0;
      for (const t of ranges) {
        dtypes.add(t.dtype);
        assert.equal(t.begin, at, "contiguous");
        const size = { I64: 8, F32: 4, BF16: 2 }[t.dtype] ?? 1;
        assert.equal(t.begin % size, 0, `${t.dtype} aligned`);
        at = t.end;
      }
      assert.equal(at, h.fileSize - h.dataStart);
    }
    assert.deepEqual([...dtypes].sort(), ["BF16", "F32", "F8_E4M3", "F8_E8M0", "I64", "I8"]);
    const index = JSON.parse(fs.readFileSync(path.join(good, INDEX_FILE), "utf8"));
    assert.equal(typeof index.metadata.total_size, "number");
    assert.match(index.weight_map[v4Names.gateWeight("layers.3")], /^model-\d{5}-of-\d{5}\.safetensors$/);
  });

  it("routes hash layers by tid2eid, weighted by the gate's renormalized scores times the scaling factor", () => {
    const config = tinyV4({}, true);
    const w = new RandomV4Weights(config, seed, { vocab: VOCAB });
    const tokens = 5;
    const x = generateActivations(seed, tokens, config.hidden);
    const ids = Int32Array.of(0, 7, 39, 7, 12);
    const gate = w.gate();
    const r = routeByHash(x, tokens, ids, gate, config);
    const scores = scoreLogits(gateLogits(x, gate.weight, tokens, 256, 8), tokens, 8, "sqrtsoftplus");
    for (let t = 0; t < tokens; t++) {
      const table = gate.tid2eid as Int32Array;
      const chosen = [table[ids[t] * 2], table[ids[t] * 2 + 1]];
      assert.deepEqual([...r.ids.subarray(2 * t, 2 * t + 2)], chosen);
      const s = chosen.map((e) => scores[t * 8 + e]);
      const sum = s[0] + s[1];
      assert.deepEqual(
        [...r.weights.subarray(2 * t, 2 * t + 2)],
        s.map((v) => Math.fround((v / (sum + 1e-20)) * 1.5)),
      );
    }
    assert.throws(() => routeByHash(x, tokens, Int32Array.of(0, 1, 2, 3, VOCAB), gate, config), RouterError);
  });

  it("a hash-routed layer needs token ids, each in [0, vocab), and a table of distinct experts a row", () => {
    const layer = new MoELayer(open(good).layer(0));
    const x = generateActivations(seed, 2, 256);
    const refused = (options: object, message: string | RegExp, l = layer) =>
      assert.throws(
        () => l.forward(x, 2, options),
        (e: Error) =>
          e instanceof InputError &&
          (typeof message === "string" ? e.message === message : message.test(e.message)),
      );
    refused({}, /needs options.tokenIds/);
    // Checked on the host before routing, with the same InputError on the "cuda" backend (whose GPU
    // gate does not read token ids back).
    refused(
      { tokenIds: Int32Array.of(3, VOCAB) },
      `forward options.tokenIds[1] = ${VOCAB}: token 1's id is outside the vocabulary [0, ${VOCAB}) of tid2eid`,
    );
    refused({ tokenIds: Int32Array.of(-1, 0) }, /tokenIds\[0\] = -1: token 0's id is outside the vocabulary/);
    refused(
      { tokenIds: Int32Array.of(0) },
      "forward options.tokenIds has 1 elements, expected 2 (one per token)",
    );
    refused({ tokenIds: [0, 1] }, /forward options.tokenIds must be an Int32Array \[tokens=2\], got/);
    assert.equal(layer.forward(x, 2, { tokenIds: Int32Array.of(0, VOCAB - 1) }).routing.ids.length, 4);
    // Routing from the caller needs no token ids.
    const routing = { ids: Int32Array.of(0, 1, 2, 3), weights: Float32Array.of(0.5, 0.5, 0.5, 0.5) };
    assert.equal(layer.forward(x, 2, { routing }).out.length, 2 * 256);

    // A table with an expert twice in a row (V4's tables have none) or an id outside [0, E) is refused
    // whole, before any token uses that row.
    const source = new RandomV4Weights(tinyV4({}, true), seed, { vocab: VOCAB });
    const bad = (edit: (t: Int32Array) => void) => {
      const table = Int32Array.from(source.gate().tid2eid as Int32Array);
      edit(table);
      return new MoELayer({
        config: source.config,
        expert: (e) => source.expert(e),
        shared: () => source.shared(),
        gate: () => ({ ...source.gate(), tid2eid: table }),
      });
    };
    const ok = { tokenIds: Int32Array.of(0, 1) };
    refused(
      ok,
      /layer tiny-v4: tid2eid\[7\]: expert \d is in slots 0 and 1/,
      bad((t) => {
        t[15] = t[14]!;
      }),
    );
    refused(
      ok,
      "layer tiny-v4: tid2eid[9, 1] = 8 is not an expert id in [0, 8)",
      bad((t) => {
        t[19] = 8;
      }),
    );
    refused(
      ok,
      /layer tiny-v4 is hash-routed but its weights have no gate tid2eid table/,
      new MoELayer({
        config: source.config,
        expert: (e) => source.expert(e),
        shared: () => source.shared(),
        gate: () => ({ ...source.gate(), tid2eid: null }),
      }),
    );
  });

  it("opens a single legacy file as before, and a lone V4 shard beside its config.json", () => {
    const file = path.join(root, "legacy.safetensors");
    const config = resolveConfig("tiny");
    saveMoEWeights(file, new GeneratedWeights(config, seed));
    const legacy = openCheckpoint(file);
    assert.ok(!(legacy instanceof Checkpoint));
    assert.deepEqual(legacy.layer().expert(3), new GeneratedWeights(config, seed).expert(3));
    const lone = path.join(root, "lone");
    const l3 = writeTinyV4(lone, seed, { shardBytes: 1e9 })[3];
    const one = openCheckpoint(path.join(lone, "model-00001-of-00001.safetensors"));
    assert.ok(one instanceof Checkpoint);
    assert.deepEqual(one.layer(3).expert(2), l3.source.expert(2));
  });
});

describe("V4 checkpoint errors name the file and the tensor", () => {
  const fails = (fn: () => unknown, pattern: RegExp) =>
    assert.throws(fn, (e: Error) => {
      assert.ok(e instanceof CheckpointError, `${e.name}: ${e.message}`);
      assert.match(e.message, pattern);
      return true;
    });

  it("a missing shard", () => {
    const dir = copy("no-shard");
    fs.rmSync(path.join(dir, "model-00002-of-00006.safetensors"));
    fails(
      () => openCheckpoint(dir),
      /model-00002-of-00006\.safetensors: missing shard \(the index maps \S+ and others/,
    );
  });

  it("a tensor the index names but its shard lacks", () => {
    const dir = copy("lacks");
    const name = v4Names.routed("layers.2", 3, "w3", "scale");
    editJson(path.join(dir, INDEX_FILE), (j) => {
      const map = j.weight_map as Record<string, string>;
      map[name] =
        map[name] === "model-00001-of-00006.safetensors"
          ? "model-00006-of-00006.safetensors"
          : "model-00001-of-00006.safetensors";
    });
    fails(
      () => open(dir).layer(2),
      new RegExp(`safetensors: tensor ${name.replaceAll(".", "\\.")} is missing, though the index maps it`),
    );
  });

  it("a tensor the index does not name", () => {
    const dir = copy("unnamed");
    const name = v4Names.gateBias("layers.3");
    editJson(path.join(dir, INDEX_FILE), (j) => {
      delete (j.weight_map as Record<string, string>)[name];
    });
    fails(() => open(dir).layer(3), /model\.safetensors\.index\.json: no tensor layers\.3\.ffn\.gate\.bias/);
  });

  it("a layer out of range, and an MTP block that is not there", () => {
    fails(() => open(good).layer(4), /config\.json: layer 4 is out of range: num_hidden_layers is 4/);
    fails(() => open(good).mtp(1), /no MTP block 1/);
    fails(() => open(good).byName("first"), /expected a layer number/);
  });

  it("shapes that disagree with config.json", () => {
    const dir = copy("shape");
    editJson(path.join(dir, CONFIG_FILE), (j) => {
      j.moe_intermediate_size = 256;
    });
    fails(
      () => open(dir).layer(3),
      /safetensors: tensor layers\.3\.ffn\.experts\.0\.w1\.weight has shape \[128, 256\], but config\.json implies \[256, 256\]/,
    );
    fails(
      () => open(dir).layer(1),
      /experts\.0\.w1\.weight has shape \[128, 128\], but config\.json implies \[256, 128\]/,
    );
  });

  it("a NaN scale (E8M0 0xFF) in an FP8 and in an FP4 expert", () => {
    const dir = copy("nan");
    const fp8 = v4Names.routed("layers.3", 4, "w2", "scale");
    const f1 = pokeTensorByte(dir, fp8, 1, 0xff);
    fails(
      () => open(dir).layer(3).expert(4),
      new RegExp(`${path.basename(f1)}: tensor ${fp8.replaceAll(".", "\\.")}\\[1, 0\\] is 0xFF, E8M0's NaN`),
    );
    const fp4 = v4Names.routed("layers.2", 6, "w1", "scale");
    pokeTensorByte(dir, fp4, 8 + 3, 0xff);
    fails(() => open(dir).layer(2).expert(6), /layers\.2\.ffn\.experts\.6\.w1\.scale\[1, 3\] is 0xFF/);
    const shared = v4Names.shared("layers.0", "w3", "scale");
    pokeTensorByte(dir, shared, 0, 0xff);
    fails(() => open(dir).layer(0).shared(), /shared_experts\.w3\.scale\[0, 0\] is 0xFF/);
  });

  it("an unknown expert dtype, and one that contradicts config.json's expert_dtype", () => {
    const dir = copy("dtype");
    const name = v4Names.routed("layers.3", 0, "w1", "weight");
    const file = open(dir).locate(name).file;
    rewriteHeader(file, (j) => {
      j[name].dtype = "F8_E5M2";
    });
    fails(
      () => open(dir).layer(3),
      /tensor layers\.3\.ffn\.experts\.0\.w1\.weight has dtype F8_E5M2: not a routed-expert format/,
    );
    const dir2 = copy("contradict");
    editJson(path.join(dir2, CONFIG_FILE), (j) => {
      j.expert_dtype = "fp8";
    });
    fails(
      () => open(dir2).layer(2),
      /experts\.0\.w1\.weight has dtype I8 \(fp4 experts\), but config\.json says expert_dtype "fp8"/,
    );
    assert.equal(open(dir2).layer(3).config.expertFormat, "fp8");
  });

  it("config keys missing or contradictory", () => {
    const cases: [string, (j: Record<string, unknown>) => void, RegExp][] = [
      ["missing", (j) => delete j.hidden_size, /config\.json: missing key "hidden_size"/],
      [
        "topk",
        (j) => (j.num_experts_per_tok = 9),
        /"num_experts_per_tok" \(9\) exceeds "n_routed_experts" \(8\)/,
      ],
      ["hash", (j) => (j.num_hash_layers = 5), /"num_hash_layers" \(5\) exceeds "num_hidden_layers" \(4\)/],
      [
        "scoring",
        (j) => (j.scoring_func = "relu"),
        /"scoring_func" must be sqrtsoftplus, sigmoid or softmax/,
      ],
      ["dtype", (j) => (j.expert_dtype = "int4"), /"expert_dtype" must be "fp4" or "fp8"/],
      // Integers too large to mean anything (listing 1e300 MTP blocks ran out of memory).
      [
        "mtp",
        (j) => (j.num_nextn_predict_layers = 1e300),
        /"num_nextn_predict_layers" must be an integer in \[0, 65536\], got 1e\+300/,
      ],
      ["huge", (j) => (j.hidden_size = 2 ** 31), /"hidden_size" must be an integer in \[1, 2147483647\]/],
      [
        "block",
        (j) => (j.quantization_config = { weight_block_size: [64, 64] }),
        /weight_block_size" must be \[128, 128\]/,
      ],
    ];
    for (const [name, edit, pattern] of cases) {
      const dir = copy(`config-${name}`);
      editJson(path.join(dir, CONFIG_FILE), edit);
      fails(() => openCheckpoint(dir), pattern);
    }
    const dir = copy("no-config");
    fs.rmSync(path.join(dir, CONFIG_FILE));
    fails(() => openCheckpoint(dir), /config\.json: missing/);
  });

  it("a hash layer whose config.json says score-routed lacks its bias; a bad tid2eid id", () => {
    const dir = copy("hash0");
    editJson(path.join(dir, CONFIG_FILE), (j) => {
      j.num_hash_layers = 0;
    });
    fails(() => open(dir).layer(0), /index\.json: no tensor layers\.0\.ffn\.gate\.bias/);
    const dir2 = copy("tid");
    pokeTensorByte(dir2, v4Names.tid2eid("layers.1"), 8 * 3, 8);
    fails(
      () => open(dir2).layer(1).gate(),
      /tensor layers\.1\.ffn\.gate\.tid2eid\[1, 1\] is not an expert id in \[0, 8\)/,
    );
  });

  it("a megamoe file whose metadata says another shape is named as such", () => {
    const file = path.join(root, "tiny.safetensors");
    saveMoEWeights(file, new GeneratedWeights(resolveConfig("tiny"), seed));
    assert.throws(
      () => loadMoEWeights(file, resolveConfig("flash")),
      /tiny\.safetensors: its metadata says it holds a "tiny" layer \(E=8 H=256 I=128 shared=1 fp8 experts\), not the "flash" layer asked for/,
    );
  });

  it("saveCheckpoint refuses what the V4 layout cannot hold", () => {
    const gen: MoEWeightSource = new GeneratedWeights(tinyV4(), seed);
    assert.throws(
      () => saveCheckpoint(path.join(root, "gen"), [{ block: "layers.0", source: gen }]),
      /is not a power of two.*E8M0/,
    );
    const hash = new RandomV4Weights(tinyV4({}, true), seed);
    assert.throws(
      () => saveCheckpoint(path.join(root, "hash1"), [{ block: "layers.1", source: hash }]),
      /hash-routed layers must be layers 0\.\.0/,
    );
  });
});
