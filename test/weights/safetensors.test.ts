import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { type MoEConfig, resolveConfig } from "../../src/config/config.js";
import { GeneratedWeights } from "../../src/weights/generate.js";
import {
  DEFAULT_PREFIX,
  loadMoEWeights,
  moeTensorSpecs,
  saveMoEWeights,
} from "../../src/weights/moe-file.js";
import {
  readSafetensors,
  readSafetensorsHeader,
  SafetensorsError,
  type TensorData,
  writeSafetensors,
} from "../../src/weights/safetensors.js";
import { requireFp8Expert } from "../../src/weights/types.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("safetensors tests");

let dir = "";
before(() => {
  dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
});
after(() => {
  fs.rmSync(dir, { recursive: true, force: true });
});

const file = (name: string) => path.join(dir, name);
const tiny = (overrides: Partial<MoEConfig> = {}) => resolveConfig("tiny", overrides);

/** A file from a raw header object and data bytes (for corrupt-file cases the writer refuses to make). */
function writeRaw(
  name: string,
  header: unknown,
  data: Uint8Array,
  headerText = JSON.stringify(header),
): string {
  const body = Buffer.from(headerText, "utf8");
  const prefix = Buffer.alloc(8);
  prefix.writeBigUInt64LE(BigInt(body.length));
  fs.writeFileSync(file(name), Buffer.concat([prefix, body, data]));
  return file(name);
}

function assertFails(fn: () => unknown, ...parts: string[]): void {
  assert.throws(fn, (err: unknown) => {
    assert.ok(err instanceof SafetensorsError, `expected SafetensorsError, got ${String(err)}`);
    for (const p of parts) assert.ok(err.message.includes(p), `message "${err.message}" lacks "${p}"`);
    return true;
  });
}

describe("safetensors files", () => {
  it("round-trip every dtype and the metadata", () => {
    const tensors: Record<string, TensorData> = {
      codes: {
        dtype: "F8_E4M3",
        shape: [3, 5],
        data: Uint8Array.from({ length: 15 }, (_, i) => (i * 37 + seed) & 0xff),
      },
      bits: {
        dtype: "BF16",
        shape: [7],
        data: Uint16Array.from({ length: 7 }, (_, i) => 0x3f80 + i + (seed & 0xff)),
      },
      values: { dtype: "F32", shape: [2, 2], data: Float32Array.from([1.5, -2.25, 3e-30, seed]) },
      ids: { dtype: "I32", shape: [4], data: Int32Array.from([-1, 0, 2 ** 31 - 1, seed]) },
      empty: { dtype: "F32", shape: [0, 4], data: new Float32Array(0) },
    };
    const p = file("generic.safetensors");
    writeSafetensors(p, tensors, { note: "hello", seed: String(seed) });
    const read = readSafetensors(p);
    assert.deepEqual(read.metadata, { note: "hello", seed: String(seed) });
    assert.deepEqual(read.tensors, tensors);
    const header = readSafetensorsHeader(p);
    assert.equal(header.dataStart % 8, 0, "data is 8-byte aligned");
    assert.equal(header.fileSize, header.dataStart + 15 + 14 + 16 + 16);
  });

  it("refuses bytes that do not fit the tensor", () => {
    assertFails(
      () =>
        writeSafetensors(file("bad.safetensors"), {
          a: { dtype: "F32", shape: [3], data: new Float32Array(2) },
        }),
      "tensor a",
      "needs 12 bytes, got 8",
    );
  });
});

describe("MoE checkpoints", () => {
  it("round-trip the tiny preset bit for bit, under the DeepSeek names", () => {
    const config = tiny();
    const source = new GeneratedWeights(config, seed);
    const p = file("tiny.safetensors");
    const progress: number[] = [];
    saveMoEWeights(p, source, { onProgress: (done, total) => progress.push(done / total) });
    assert.equal(progress.length, config.numExperts + 2);
    assert.equal(progress.at(-1), 1);
    assert.deepEqual(
      fs.readdirSync(dir).filter((n) => n.includes("partial")),
      [],
      "no temporary file is left",
    );

    const header = readSafetensorsHeader(p);
    const h = config.hidden;
    const i = config.intermediate;
    const expect = (name: string, dtype: string, shape: number[]) => {
      const t = header.tensors.get(DEFAULT_PREFIX + name);
      assert.ok(t !== undefined, `missing ${name}`);
      assert.deepEqual([t.dtype, t.shape], [dtype, shape], name);
    };
    expect("experts.7.gate_proj.weight", "F8_E4M3", [i, h]);
    expect("experts.7.up_proj.weight_scale_inv", "F32", [i / 128, h / 128]);
    expect("experts.0.down_proj.weight", "F8_E4M3", [h, i]);
    expect("shared_experts.down_proj.weight_scale_inv", "F32", [h / 128, i / 128]);
    expect("gate.weight", "BF16", [config.numExperts, h]);
    expect("gate.e_score_correction_bias", "F32", [config.numExperts]);
    assert.equal(header.tensors.size, moeTensorSpecs(config).length);
    assert.deepEqual(JSON.parse(header.metadata["megamoe.config"]), config);

    const loaded = loadMoEWeights(p, config);
    for (let e = 0; e < config.numExperts; e++)
      assert.deepEqual(loaded.expert(e), source.expert(e), `expert ${e}`);
    assert.deepEqual(loaded.shared(), source.shared());
    assert.deepEqual(loaded.gate(), source.gate());

    // The gate rows of W1 are the checkpoint's gate_proj: check one tensor against the raw bytes.
    const raw = readSafetensors(p).tensors[`${DEFAULT_PREFIX}experts.3.gate_proj.weight`].data;
    assert.deepEqual(raw, requireFp8Expert(source.expert(3), "test").w1.q.subarray(0, i * h));
  });

  it("use a custom prefix, no shared experts and no bias", () => {
    const base = tiny();
    const config = tiny({ numShared: 0, router: { ...base.router, correctionBias: false } });
    const source = new GeneratedWeights(config, seed + 1);
    const p = file("custom.safetensors");
    saveMoEWeights(p, source, { prefix: "layers.3.ffn." });
    const names = [...readSafetensorsHeader(p).tensors.keys()];
    assert.ok(names.every((n) => n.startsWith("layers.3.ffn.")));
    assert.ok(!names.some((n) => n.includes("shared") || n.includes("bias")));
    const loaded = loadMoEWeights(p, config, { prefix: "layers.3.ffn." });
    assert.equal(loaded.shared(), null);
    assert.deepEqual(loaded.gate(), source.gate());
    assert.deepEqual(loaded.expert(5), source.expert(5));
    assertFails(
      () => loadMoEWeights(p, config),
      "missing tensor model.layers.0.mlp.experts.0.gate_proj.weight",
    );
  });
});

describe("corrupt files", () => {
  const config = tiny();
  let good = "";
  let goodBytes: Buffer;
  before(() => {
    good = file("good.safetensors");
    saveMoEWeights(good, new GeneratedWeights(config, seed + 2));
    goodBytes = fs.readFileSync(good);
  });

  /** Every tensor of the good file, to rewrite with one change. */
  const goodTensors = () => readSafetensors(good).tensors;

  it("a file truncated inside the data names the first tensor out of range", () => {
    const p = file("truncated.safetensors");
    fs.writeFileSync(p, goodBytes.subarray(0, goodBytes.length - 1000));
    assertFails(() => loadMoEWeights(p, config), "truncated", "data_offsets");
  });

  it("a file shorter than the length prefix", () => {
    const p = file("short.safetensors");
    fs.writeFileSync(p, goodBytes.subarray(0, 5));
    assertFails(() => loadMoEWeights(p, config), "truncated", "5 bytes");
  });

  it("a header length beyond the file", () => {
    const p = file("header-length.safetensors");
    const bytes = Buffer.from(goodBytes);
    bytes.writeBigUInt64LE(BigInt(goodBytes.length), 0);
    fs.writeFileSync(p, bytes);
    assertFails(() => loadMoEWeights(p, config), `header length ${goodBytes.length}`, "beyond the file");
    bytes.writeBigUInt64LE(2n ** 63n, 0);
    fs.writeFileSync(p, bytes);
    assertFails(() => loadMoEWeights(p, config), "beyond the file");
  });

  it("a header that is not JSON", () => {
    const p = writeRaw("bad-json.safetensors", null, new Uint8Array(8), '{"a": {"dtype": "F32", ');
    assertFails(() => loadMoEWeights(p, config), "not valid UTF-8 JSON");
    const q = writeRaw("array-json.safetensors", [1, 2], new Uint8Array(8));
    assertFails(() => loadMoEWeights(q, config), "not an object");
  });

  it("a missing tensor is named", () => {
    const tensors = goodTensors();
    const name = `${DEFAULT_PREFIX}experts.5.up_proj.weight_scale_inv`;
    delete tensors[name];
    const p = file("missing.safetensors");
    writeSafetensors(p, tensors);
    assertFails(() => loadMoEWeights(p, config), `missing tensor ${name}`);
  });

  it("a wrong shape names the tensor and both shapes", () => {
    const tensors = goodTensors();
    const name = `${DEFAULT_PREFIX}experts.2.down_proj.weight`;
    tensors[name] = { ...tensors[name], shape: [128, 256] };
    const p = file("shape.safetensors");
    writeSafetensors(p, tensors);
    assertFails(() => loadMoEWeights(p, config), name, "shape [128, 256]", "expected [256, 128]");
  });

  it("a wrong dtype names the tensor and both dtypes", () => {
    const tensors = goodTensors();
    const name = `${DEFAULT_PREFIX}gate.weight`;
    const bits = tensors[name].data as Uint16Array;
    tensors[name] = {
      dtype: "F32",
      shape: tensors[name].shape,
      data: new Float32Array(bits.length).fill(0.5),
    };
    const p = file("dtype.safetensors");
    writeSafetensors(p, tensors);
    assertFails(() => loadMoEWeights(p, config), name, "dtype F32", "expected BF16");
  });

  it("overlapping and out-of-range offsets", () => {
    const data = new Uint8Array(64).fill(1);
    const overlap = writeRaw(
      "overlap.safetensors",
      {
        a: { dtype: "F32", shape: [8], data_offsets: [0, 32] },
        b: { dtype: "F32", shape: [8], data_offsets: [16, 48] },
      },
      data,
    );
    assertFails(() => readSafetensorsHeader(overlap), "tensors a [0, 32] and b [16, 48] overlap");
    const beyond = writeRaw(
      "beyond.safetensors",
      { a: { dtype: "F32", shape: [32], data_offsets: [0, 128] } },
      data,
    );
    assertFails(() => readSafetensorsHeader(beyond), "tensor a", "[0, 128]", "64-byte data section");
    const size = writeRaw(
      "size.safetensors",
      { a: { dtype: "F32", shape: [3], data_offsets: [0, 16] } },
      data,
    );
    assertFails(() => readSafetensorsHeader(size), "tensor a", "hold 16 bytes", "needs 12");
    const reversed = writeRaw(
      "reversed.safetensors",
      { a: { dtype: "F32", shape: [0], data_offsets: [8, 4] } },
      data,
    );
    assertFails(() => readSafetensorsHeader(reversed), "tensor a", "begin ≤ end");
  });

  it("a non-positive weight scale is caught when the expert is read", () => {
    const tensors = goodTensors();
    const name = `${DEFAULT_PREFIX}experts.1.gate_proj.weight_scale_inv`;
    const scales = (tensors[name].data as Float32Array).slice();
    scales[0] = -scales[0];
    tensors[name] = { ...tensors[name], data: scales };
    const p = file("scale.safetensors");
    writeSafetensors(p, tensors);
    const loaded = loadMoEWeights(p, config);
    loaded.expert(0);
    assertFails(() => loaded.expert(1), `${name}[0]`, "positive finite scale");
  });

  it("a file that does not exist", () => {
    assertFails(() => loadMoEWeights(file("nope.safetensors"), config), "cannot open");
  });
});

describe("FP4 (MXFP4) experts", () => {
  it("round-trip as I8 packed codes and F8_E8M0 scales; a NaN scale byte is rejected, named", () => {
    const config = tiny({ expertFormat: "fp4" });
    const { hidden: h, intermediate: i } = config;
    const source = new GeneratedWeights(config, seed + 20);
    const p = file("fp4.safetensors");
    saveMoEWeights(p, source);
    const header = readSafetensorsHeader(p);
    const info = (n: string) => header.tensors.get(`${DEFAULT_PREFIX}${n}`);
    assert.deepEqual(
      [info("experts.2.up_proj.weight")?.dtype, info("experts.2.up_proj.weight")?.shape],
      ["I8", [i, h / 2]],
    );
    assert.deepEqual(
      [
        info("experts.2.down_proj.weight_scale_inv")?.dtype,
        info("experts.2.down_proj.weight_scale_inv")?.shape,
      ],
      ["F8_E8M0", [h, i / 32]],
    );
    // The shared expert stays FP8.
    assert.equal(info("shared_experts.gate_proj.weight")?.dtype, "F8_E4M3");
    const loaded = loadMoEWeights(p, config);
    for (const e of [0, 3, 7]) assert.deepEqual(loaded.expert(e), source.expert(e), `expert ${e}`);
    assert.deepEqual(loaded.shared(), source.shared());
    // Up rows start at row I of W1.
    const x = source.expert(3);
    assert.ok(x.format === "fp4");
    const raw = readSafetensors(p).tensors[`${DEFAULT_PREFIX}experts.3.up_proj.weight`].data;
    assert.deepEqual(raw, x.w1.packed.subarray((i * h) / 2));
    // An FP8 config does not accept the FP4 file, naming the format its metadata records.
    assertFails(() => loadMoEWeights(p, tiny()), "shared=1 fp4 experts), not the");

    // Corrupt one scale byte of expert 1's down_proj: row 2, K group 1.
    const t = readSafetensorsHeader(p).tensors.get(`${DEFAULT_PREFIX}experts.1.down_proj.weight_scale_inv`)!;
    const bytes = fs.readFileSync(p);
    bytes[readSafetensorsHeader(p).dataStart + t.begin + 2 * (i / 32) + 1] = 0xff;
    const bad = file("fp4-nan.safetensors");
    fs.writeFileSync(bad, bytes);
    const w = loadMoEWeights(bad, config);
    w.expert(0);
    assertFails(() => w.expert(1), "experts.1.down_proj.weight_scale_inv", "0xFF (NaN) at row 2, K group 1");
  });
});
