/**
 * The unfused GPU pipeline against the CPU reference (same numerics) and the FP64 ideal, on fresh
 * random data, with poisoned outputs and the edge cases. Small shapes run the CPU reference live;
 * flash-ep8 compares a sample of tokens with references made beforehand on the CPU machine by
 * scripts/make-layer-fixtures.ts (MEGAMOE_FIXTURES, default .fixtures), regenerated from their seeds.
 * Skips with the reason without a GPU; with MEGAMOE_REQUIRE_GPU=1 it fails instead.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { describe, test } from "node:test";
import { type MoEConfig, resolveConfig } from "../../src/config/config.js";
import { cudaAvailability, type Device, DeviceTensor, openDevice } from "../../src/cuda/index.js";
import { MoELayer } from "../../src/layer.js";
import { bf16BitsToF32 } from "../../src/numerics/bf16.js";
import { UnfusedPipeline } from "../../src/pipeline/unfused.js";
import { calcDiff, relativeError } from "../../src/reference/metrics.js";
import { idealMoE, referenceMoE } from "../../src/reference/moe.js";
import { type RandomRoutingOptions, type Routing, randomRouting } from "../../src/reference/router.js";
import { DeviceMoEWeights } from "../../src/weights/device.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";

const seed = Number(process.env.MEGAMOE_SEED ?? Date.now() % 2 ** 31);
console.log(`unfused pipeline tests: seed ${seed}`);
const availability = cudaAvailability();
const requireGpu = process.env.MEGAMOE_REQUIRE_GPU === "1";
const skip = availability.ok || requireGpu ? false : `no usable GPU: ${availability.reason}`;

/** Same numerics, different fp32 accumulation inside the tensor cores: FP8 roundings may flip. */
const MAX_REL_VS_REFERENCE = 2e-2;
const MAX_DIFF_VS_REFERENCE = 2e-4;

const toF64 = (bits: Uint16Array) => Float64Array.from(bits, bf16BitsToF32);

interface Errors {
  relRef: number;
  diffRef: number;
  relIdeal: number;
  diffIdeal: number;
}

function errors(gpu: Uint16Array, ref: Uint16Array, ideal: Float64Array): Errors {
  const g = toF64(gpu);
  const r = toF64(ref);
  return {
    relRef: relativeError(g, r),
    diffRef: calcDiff(g, r),
    relIdeal: relativeError(g, ideal),
    diffIdeal: calcDiff(g, ideal),
  };
}

function report(label: string, e: Errors): void {
  console.log(
    `  ${label}: vs reference ‖Δ‖/‖ref‖ ${e.relRef.toExponential(2)}, calc_diff ${e.diffRef.toExponential(2)}; ` +
      `vs FP64 ideal ${e.relIdeal.toExponential(2)}, calc_diff ${e.diffIdeal.toExponential(2)}`,
  );
  assert.ok(e.relRef < MAX_REL_VS_REFERENCE, `${label}: relative error vs reference ${e.relRef}`);
  assert.ok(e.diffRef < MAX_DIFF_VS_REFERENCE, `${label}: calc_diff vs reference ${e.diffRef}`);
  assert.ok(e.relIdeal < 0.1, `${label}: relative error vs ideal ${e.relIdeal}`);
}

let cachedDevice: Device | undefined;
const device = () => {
  cachedDevice ??= openDevice(0);
  return cachedDevice;
};

/** One poisoned forward through the pipeline; returns the output (every element must be written). */
function runPipeline(
  pipeline: UnfusedPipeline,
  config: MoEConfig,
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  shared: boolean,
): Uint16Array {
  const d = device();
  const xt = DeviceTensor.fromHost(d, "bf16", [tokens, config.hidden], x);
  const ids = DeviceTensor.fromHost(d, "int32", [tokens, config.topK], routing.ids);
  const w = DeviceTensor.fromHost(d, "fp32", [tokens, config.topK], routing.weights);
  const out = DeviceTensor.empty(d, "bf16", [tokens, config.hidden]);
  try {
    out.fill(0xff); // bf16 NaN: an unwritten element fails the comparison
    pipeline.forward({ x: xt, ids, weights: w, out, tokens, shared }, null);
    d.synchronize();
    const result = out.toHost() as Uint16Array;
    const unwritten = result.indexOf(0xffff);
    assert.equal(unwritten, -1, `output element ${unwritten} was never written`);
    return result;
  } finally {
    for (const t of [xt, ids, w, out]) t.dispose();
  }
}

describe("unfused MoE pipeline on a GPU", { skip }, () => {
  const small = (overrides: Partial<MoEConfig> = {}) =>
    resolveConfig("tiny", { numExperts: 16, hidden: 512, intermediate: 256, topK: 4, ...overrides });

  for (const [name, config] of [
    ["tiny", resolveConfig("tiny")],
    [
      "E=16 H=512 IH=256 top-4",
      small({ router: { ...resolveConfig("tiny").router, nGroup: 1, topkGroup: 1 } }),
    ],
    [
      "E=16 H=512 IH=256 top-4, UE8M0, no clamp",
      small({
        scaleFormat: "ue8m0",
        swigluClamp: null,
        router: { ...resolveConfig("tiny").router, nGroup: 1, topkGroup: 1 },
      }),
    ],
  ] as const) {
    test(`${name}: T = 1, 7, 64, 129, 1024, shared on and off`, () => {
      const weights = new GeneratedWeights(config, seed);
      const dw = DeviceMoEWeights.upload(device(), weights);
      const pipeline = new UnfusedPipeline(device(), dw, 1024);
      try {
        for (const tokens of [1, 7, 64, 129, 1024]) {
          const x = generateActivations(seed + tokens, tokens, config.hidden);
          const routing = randomRouting(seed + 2 * tokens, tokens, config);
          for (const shared of [true, false]) {
            const gpu = runPipeline(pipeline, config, x, tokens, routing, shared);
            const ref = referenceMoE(x, tokens, routing, weights, { shared });
            const ideal = idealMoE(x, tokens, routing, weights, { shared });
            report(`${name} T=${tokens} shared=${shared ? 1 : 0}`, errors(gpu, ref, ideal));
          }
        }
      } finally {
        pipeline.dispose();
        dw.dispose();
      }
    });
  }

  test("edge cases: empty experts, one hot expert, masked tokens, odd counts", () => {
    const config = resolveConfig("tiny");
    const weights = new GeneratedWeights(config, seed + 7);
    const dw = DeviceMoEWeights.upload(device(), weights);
    const pipeline = new UnfusedPipeline(device(), dw, 1024);
    try {
      const cases: [string, number, RandomRoutingOptions][] = [
        ["empty experts 0,3,5", 33, { emptyExperts: [0, 3, 5] }],
        ["all tokens to expert 2", 200, { hotExpert: 2 }],
        ["masked tokens", 17, { maskedTokens: [0, 5, 16] }],
        ["one token, masked", 1, { maskedTokens: [0] }],
      ];
      for (const [label, tokens, opts] of cases) {
        const x = generateActivations(seed + 11, tokens, config.hidden);
        const routing = randomRouting(seed + 12, tokens, config, opts);
        const gpu = runPipeline(pipeline, config, x, tokens, routing, true);
        const ref = referenceMoE(x, tokens, routing, weights);
        report(label, errors(gpu, ref, idealMoE(x, tokens, routing, weights)));
      }
    } finally {
      pipeline.dispose();
      dw.dispose();
    }
  });

  test("bit-identical repeat runs", () => {
    const config = resolveConfig("tiny");
    const weights = new GeneratedWeights(config, seed + 21);
    const dw = DeviceMoEWeights.upload(device(), weights);
    const pipeline = new UnfusedPipeline(device(), dw, 1024);
    try {
      const x = generateActivations(seed + 22, 300, config.hidden);
      const routing = randomRouting(seed + 23, 300, config);
      const a = runPipeline(pipeline, config, x, 300, routing, true);
      const b = runPipeline(pipeline, config, x, 300, routing, true);
      assert.deepEqual(a, b);
    } finally {
      pipeline.dispose();
      dw.dispose();
    }
  });

  test("MoELayer with backend cuda: same API and errors as the CPU", () => {
    const config = resolveConfig("tiny");
    const source = new GeneratedWeights(config, seed + 31);
    const gpuLayer = new MoELayer(source, { backend: "cuda" });
    const cpuLayer = new MoELayer(source, { backend: "cpu" });
    try {
      const x = generateActivations(seed + 32, 65, config.hidden);
      const gpu = gpuLayer.forward(x, 65);
      const cpu = cpuLayer.forward(x, 65);
      assert.deepEqual(gpu.routing.ids, cpu.routing.ids);
      report(
        "MoELayer tiny T=65 (gate routing)",
        errors(gpu.out, cpu.out, idealMoE(x, 65, cpu.routing, source)),
      );
      assert.throws(() => gpuLayer.forward(x, 66), /expected tokens × hidden/);
      assert.throws(() => gpuLayer.forward(new Uint16Array(1025 * config.hidden), 1025), /too many tokens/);
    } finally {
      gpuLayer.dispose();
    }
  });

  const fixtureDir = process.env.MEGAMOE_FIXTURES ?? ".fixtures";
  const fixtures = fs.existsSync(fixtureDir)
    ? fs.readdirSync(fixtureDir).filter((f) => f.startsWith("flash-ep8-") && f.endsWith(".json"))
    : [];
  test("flash-ep8 at T = 1 … 4096 against sampled CPU references", {
    skip:
      fixtures.length === 0
        ? `no flash-ep8 fixtures in ${fixtureDir} (scripts/make-layer-fixtures.ts)`
        : false,
  }, () => {
    const first = JSON.parse(fs.readFileSync(path.join(fixtureDir, fixtures[0]), "utf8"));
    const config = resolveConfig("flash-ep8", { maxTokens: 8192 });
    const t0 = performance.now();
    const dw = DeviceMoEWeights.upload(
      device(),
      new GeneratedWeights(config, first.seed, { cachedExperts: 1 }),
    );
    console.log(`  flash-ep8 weights made and uploaded in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
    const pipeline = new UnfusedPipeline(device(), dw, 8192);
    try {
      for (const file of fixtures.sort(
        (a, b) => parseInt(a.split("T")[1], 10) - parseInt(b.split("T")[1], 10),
      )) {
        const f = JSON.parse(fs.readFileSync(path.join(fixtureDir, file), "utf8"));
        const x = generateActivations(f.seed + 1, f.tokens, config.hidden);
        const routing = randomRouting(f.seed + 2, f.tokens, config);
        const gpu = runPipeline(pipeline, config, x, f.tokens, routing, f.shared);
        const H = config.hidden;
        const sampled = new Uint16Array(f.sample.length * H);
        f.sample.forEach((t: number, i: number) => {
          sampled.set(gpu.subarray(t * H, (t + 1) * H), i * H);
        });
        report(
          `flash-ep8 T=${f.tokens} (${f.sample.length} tokens sampled, seed ${f.seed})`,
          errors(sampled, Uint16Array.from(f.reference), Float64Array.from(f.ideal)),
        );
      }
    } finally {
      pipeline.dispose();
      dw.dispose();
    }
  });
});
