/**
 * Lab helper (lab/torch-parity.sh runs it on the GPU host from dist-test): the Node side of the
 * Node = PyTorch check. For one layer it writes, into --out:
 *   export/                 `megamoe export`'s folder for the layer
 *   weights/NAME.bin        the weights in the engine layouts (docs/export.md, "Weights"), raw bytes
 *   cases/CASE.{x,ids,w,out}.bin   per case: x bf16 [T, H], ids int32 [T, k], weights fp32 [T, k] and
 *                           Node's fused forward's output bf16 [T, H]
 *   parity.json             shapes, dtypes and files of all of the above
 * lab/torch_parity.py then runs megamoe_torch on the same files and compares the outputs' bits.
 *   node dist-test/lab/torch-parity.js --shape tiny --experts fp8 --shared 1 --tokens 1,7,64,129,1000 --out DIR
 * Cases per T: random routing; one with masked tokens (ids −1) and an empty expert; one hot expert.
 */
import fs from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { expertFormatOf, type MoEConfig, resolveConfigForTokens } from "../src/config/config.js";
import { DeviceTensor, openDevice } from "../src/cuda/index.js";
import { compileLayerExport, writeLayerExport } from "../src/export/export.js";
import { DeviceMoEWeights } from "../src/kernels/device-weights.js";
import { FusedPipeline } from "../src/pipeline/fused.js";
import { randomRouting } from "../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../src/weights/generate.js";
import type { BlockQuantized, MoEWeightSource, Mxfp4Matrix } from "../src/weights/types.js";

const { values: args } = parseArgs({
  options: {
    shape: { type: "string", default: "tiny" },
    experts: { type: "string", default: "fp8" },
    shared: { type: "string", default: "1" },
    tokens: { type: "string", default: "1,7,64,129,1000" },
    "max-tokens": { type: "string" },
    seed: { type: "string", default: "1" },
    out: { type: "string" },
  },
});
if (args.out === undefined) throw new Error("--out DIR is required");
const out = args.out;
const seed = Number(args.seed);
const tokens = args.tokens.split(",").map(Number);
const maxTokens = Number(args["max-tokens"] ?? Math.max(...tokens));
const shared = args.shared === "1";
const format = args.experts === "fp4" ? "fp4" : "fp8";
const base = resolveConfigForTokens(args.shape, maxTokens, { expertFormat: format });
const config: MoEConfig = shared ? base : { ...base, numShared: 0 };

fs.mkdirSync(path.join(out, "weights"), { recursive: true });
fs.mkdirSync(path.join(out, "cases"), { recursive: true });
const files: Record<string, { dtype: string; shape: number[]; file: string }> = {};
function write(name: string, dir: string, dtype: string, shape: number[], bytes: ArrayBufferView): void {
  const file = path.join(dir, `${name}.bin`);
  fs.writeFileSync(path.join(out, file), new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength));
  files[name] = { dtype, shape, file };
}

// The export, compiled here as a runtime's user would.
const exp = await compileLayerExport(config, {
  maxTokens,
  shared,
  smCount: openDevice(0).smCount,
  weightScales: "fp32",
  arch: "sm_90a",
  producer: "lab/torch-parity",
});
writeLayerExport(path.join(out, "export"), exp, true);

// The weights in the engine layouts: every expert's matrices stacked.
const w = new GeneratedWeights(config, seed);
const E = config.numExperts;
const stack = (parts: Uint8Array[]) => {
  const all = new Uint8Array(parts.reduce((a, p) => a + p.length, 0));
  let at = 0;
  for (const p of parts) {
    all.set(p, at);
    at += p.length;
  }
  return all;
};
const experts = Array.from({ length: E }, (_, e) => w.expert(e));
for (const m of ["w1", "w2"] as const) {
  const name = m === "w1" ? "w13" : "w2";
  if (expertFormatOf(config) === "fp4") {
    const mats = experts.map((x) => x[m] as Mxfp4Matrix);
    const { rows, cols } = mats[0]!;
    write(name, "weights", "uint8", [E, rows, cols / 2], stack(mats.map((x) => x.packed)));
    write(`${name}_scale`, "weights", "uint8", [E, rows, cols / 32], stack(mats.map((x) => x.scales)));
  } else {
    const mats = experts.map((x) => x[m] as BlockQuantized);
    const { rows, cols } = mats[0]!;
    write(name, "weights", "float8_e4m3fn", [E, rows, cols], stack(mats.map((x) => x.q)));
    const scales = stack(
      mats.map((x) => new Uint8Array(x.scales.buffer, x.scales.byteOffset, x.scales.byteLength)),
    );
    write(`${name}_scale`, "weights", "float32", [E, rows / 128, cols / 128], scales);
  }
}
const s = w.shared();
if (s !== null) {
  for (const [m, name] of [
    ["w1", "shared_w13"],
    ["w2", "shared_w2"],
  ] as const) {
    const x = s[m];
    write(name, "weights", "float8_e4m3fn", [x.rows, x.cols], x.q);
    write(`${name}_scale`, "weights", "float32", [x.rows / 128, x.cols / 128], x.scales);
  }
}

// Node's fused forward on the same weights (uploaded: the generator's seed is not passed on).
const device = openDevice(0);
const source: MoEWeightSource = {
  config: w.config,
  expert: (e) => w.expert(e),
  shared: () => w.shared(),
  gate: () => w.gate(),
};
const weights = DeviceMoEWeights.upload(device, source);
const pipeline = new FusedPipeline(device, weights, maxTokens);
const cases: { name: string; tokens: number }[] = [];
for (const T of tokens) {
  const x = generateActivations(seed + T, T, config.hidden);
  const variants = {
    random: randomRouting(seed + T, T, config),
    masked: randomRouting(seed + T, T, config, {
      maskedTokens: Array.from({ length: Math.ceil(T / 3) }, (_, i) => 3 * i),
      emptyExperts: [0],
    }),
    hot: randomRouting(seed + T, T, config, { hotExpert: E - 1 }),
  };
  for (const [kind, r] of Object.entries(variants)) {
    const name = `t${T}-${kind}`;
    const dx = DeviceTensor.fromHost(device, "bf16", [T, config.hidden], x);
    const ids = DeviceTensor.fromHost(device, "int32", [T, config.topK], r.ids);
    const rw = DeviceTensor.fromHost(device, "fp32", [T, config.topK], r.weights);
    const y = DeviceTensor.empty(device, "bf16", [T, config.hidden]);
    y.fill(0xff);
    pipeline.forward({ x: dx, ids, weights: rw, out: y, tokens: T, shared }, null);
    pipeline.checkStatus();
    write(`${name}.x`, "cases", "bfloat16", [T, config.hidden], x);
    write(`${name}.ids`, "cases", "int32", [T, config.topK], r.ids);
    write(`${name}.w`, "cases", "float32", [T, config.topK], r.weights);
    write(`${name}.out`, "cases", "bfloat16", [T, config.hidden], y.toHost());
    for (const t of [dx, ids, rw, y]) t.dispose();
    cases.push({ name, tokens: T });
  }
}
pipeline.dispose();
weights.dispose();
fs.writeFileSync(
  path.join(out, "parity.json"),
  `${JSON.stringify({ shape: config.name, experts: format, shared, seed, maxTokens, clamp: config.swigluClamp, cases, files }, null, 1)}\n`,
);
console.log(
  `torch-parity: ${config.name} ${format} shared ${shared ? 1 : 0}, ${cases.length} cases in ${out}`,
);
