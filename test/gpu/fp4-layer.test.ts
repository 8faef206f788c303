/**
 * The MoE layer with FP4 (MXFP4) routed experts (config.expertFormat "fp4") on the GPU: the unfused
 * pipeline with the routed L1 and L2 through the FP4 grouped GEMM, and the fused kernel's FP4 build (the
 * shared expert stays FP8 in both), bit-identical to each other, against the CPU reference's FP4 layer
 * (docs/numerics.md "FP4 experts") within the layer error policy of test/helpers/layer-errors.ts, and
 * the FP64 ideal from the exact FP4 weights:
 *
 * - tiny (both scale formats, shared on and off) and a flash-ep8 shape (shared on; the CPU side on a sample
 *   of tokens, as tokens are independent), T = 1, 7, 64, 129, with masked tokens, empty experts, a hot
 *   expert, and every token on one expert;
 * - every run twice, bit-identical, outputs and intermediate buffers poisoned with 0xFF (NaN) first;
 * - the fused kernel at every block M (swap-AB 16 and 32, 64, 128) on 1, 3, 17 and all CTAs, the expand
 *   variant (the experts expanded into e4m3 stage images first) at 128, and on flash-ep8 at
 *   T = 1024 and 4096 with and without the expansion: the unfused pipeline's bits;
 * - beside each FP4 layer, the FP8 layer of the same seed (same generator matrices quantized to FP8) on
 *   the same inputs and routing: both distances to their FP64 ideals are printed;
 * - MoELayer on the cuda backend with FP4 experts: the fused pipeline by default, the same bits as the
 *   pipelines run directly;
 * - tiny with some 128 × 128 blocks spread over 16 binades (their lowest groups round under the block's
 *   reference) beside exact blocks: every block M against the unfused pipeline and the CPU.
 *
 * Skips with the reason without a GPU; with MEGAMOE_REQUIRE_GPU=1 it fails instead. The checks at the top
 * need no GPU.
 */
import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { type MoEConfig, resolveConfig, type ScaleFormat } from "../../src/config/config.js";
import { DeviceMoEWeights } from "../../src/kernels/device-weights.js";
import { takeGroupedGemmStatus } from "../../src/kernels/gemm/grouped_gemm.js";
import { fusedLayerProblem } from "../../src/kernels/megamoe/megamoe.js";
import {
  FUSED_BLOCK_MS,
  fusedExpandProblem,
  variants as fusedVariants,
} from "../../src/kernels/megamoe/megamoe.variants.js";
import { fusedExpand } from "../../src/kernels/megamoe/plan.js";
import { DEFAULT_GPU_PIPELINE, MoELayer } from "../../src/layer.js";
import { bf16BitsToF32 } from "../../src/numerics/bf16.js";
import { fp4BlocksExact } from "../../src/numerics/fp4.js";
import { FusedPipeline } from "../../src/pipeline/fused.js";
import { type MoEPipeline, UnfusedPipeline } from "../../src/pipeline/unfused.js";
import { layerErrors } from "../../src/reference/error-bounds.js";
import { calcDiff } from "../../src/reference/metrics.js";
import { idealMoE, referenceMoE } from "../../src/reference/moe.js";
import { type RandomRoutingOptions, type Routing, randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import type { MoEWeightSource, Mxfp4Matrix } from "../../src/weights/types.js";
import { describeGpu, TestTensors, testDevice } from "../helpers/gpu.js";
import { checkLayerErrors } from "../helpers/layer-errors.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("fp4 layer tests");
const device = testDevice;

/** One GPU layer: the CPU source of its weights (for the reference), the device weights, the pipelines. */
interface GpuLayer {
  config: MoEConfig;
  source: MoEWeightSource;
  weights: DeviceMoEWeights;
  pipeline: UnfusedPipeline;
  /** The fused kernel on the same weights (every shape here fits it). */
  fused: FusedPipeline;
}

/**
 * The layer of `config` and `weightSeed`: weights uploaded from the CPU generator ("upload") or made on
 * the device ("generate", bit-identical: flash-sized layers). `cachedExperts`: experts the CPU source
 * keeps (the reference and the ideal read each expert once then).
 */
function openLayer(
  config: MoEConfig,
  weightSeed: number,
  maxTokens: number,
  how: "upload" | "generate" | "upload-spread",
  cachedExperts: number,
): GpuLayer {
  const generated = new GeneratedWeights(config, weightSeed, { cachedExperts });
  const source = how === "upload-spread" ? spreadBlocks(generated) : generated;
  const weights =
    how === "generate"
      ? DeviceMoEWeights.generate(device(), config, weightSeed)
      : DeviceMoEWeights.upload(device(), source);
  let pipeline: UnfusedPipeline | null = null;
  try {
    pipeline = new UnfusedPipeline(device(), weights, maxTokens);
    return { config, source, weights, pipeline, fused: new FusedPipeline(device(), weights, maxTokens) };
  } catch (e) {
    pipeline?.dispose();
    weights.dispose();
    throw e;
  }
}

/**
 * The generator's FP4 experts (one scale byte per matrix: every 128 × 128 block exact) with the odd
 * experts' bytes lowered by 16 on every third row of alternate blocks: those blocks span 16 binades, so
 * under their largest byte the lowered groups' small codes round (docs/numerics.md).
 */
function spreadBlocks(source: MoEWeightSource): MoEWeightSource {
  const spread = (m: Mxfp4Matrix): Mxfp4Matrix => {
    const scales = m.scales.slice();
    const groups = m.cols / 32;
    for (let r = 0; r < m.rows; r++) {
      if ((r % 128) % 3 !== 0) continue;
      for (let g = 0; g < groups; g++) {
        if ((Math.floor(r / 128) + Math.floor(g / 4)) % 2 === 0 && scales[r * groups + g] >= 16)
          scales[r * groups + g] -= 16;
      }
    }
    return { ...m, scales };
  };
  return {
    config: source.config,
    expert: (e) => {
      const x = source.expert(e);
      if (x.format !== "fp4" || e % 2 === 0) return x;
      return { format: "fp4", w1: spread(x.w1), w2: spread(x.w2) };
    },
    shared: () => source.shared(),
    gate: () => source.gate(),
  };
}

function closeLayer(l: GpuLayer | null): void {
  l?.pipeline.dispose();
  l?.fused.dispose();
  l?.weights.dispose();
}

/**
 * One poisoned forward (output and every intermediate buffer NaN first) of the layer's unfused pipeline,
 * or of `pipeline`; returns the bf16 output.
 */
function runLayer(
  l: GpuLayer,
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  shared: boolean,
  pipeline: MoEPipeline = l.pipeline,
): Uint16Array {
  const { config } = l;
  const ts = new TestTensors();
  try {
    const xt = ts.from("bf16", [tokens, config.hidden], x);
    const ids = ts.from("int32", [tokens, config.topK], routing.ids);
    const w = ts.from("fp32", [tokens, config.topK], routing.weights);
    const out = ts.empty("bf16", [tokens, config.hidden], 0xff);
    pipeline.fillScratch(0xff);
    pipeline.forward({ x: xt, ids, weights: w, out, tokens, shared }, null);
    pipeline.checkStatus();
    const stall = takeGroupedGemmStatus(device());
    assert.equal(stall, null, `a grouped GEMM stalled: ${JSON.stringify(stall)}`);
    const result = out.toHost() as Uint16Array;
    const unwritten = result.indexOf(0xffff);
    assert.equal(unwritten, -1, `output element ${unwritten} was never written`);
    return result;
  } finally {
    ts.dispose();
  }
}

/** Rows `sample` of x [tokens, H] and of the routing (tokens are independent: the reference on a sample). */
function sampleOf(
  config: MoEConfig,
  x: Uint16Array,
  routing: Routing,
  sample: readonly number[],
): { x: Uint16Array; routing: Routing } {
  const H = config.hidden;
  const k = config.topK;
  const xs = new Uint16Array(sample.length * H);
  const ids = new Int32Array(sample.length * k);
  const ws = new Float32Array(sample.length * k);
  sample.forEach((t, i) => {
    xs.set(x.subarray(t * H, (t + 1) * H), i * H);
    ids.set(routing.ids.subarray(t * k, (t + 1) * k), i * k);
    ws.set(routing.weights.subarray(t * k, (t + 1) * k), i * k);
  });
  return { x: xs, routing: { ids, weights: ws } };
}

function sampledRows(out: Uint16Array, hidden: number, sample: readonly number[]): Uint16Array {
  const rows = new Uint16Array(sample.length * hidden);
  sample.forEach((t, i) => {
    rows.set(out.subarray(t * hidden, (t + 1) * hidden), i * hidden);
  });
  return rows;
}

/**
 * Runs the FP4 layer twice (bit-identical), checks it against the CPU reference's FP4 layer and the FP64
 * ideal on `sample` (all tokens when null) within the layer error policy; with the FP8 twin, runs it on
 * the same inputs and prints both layers' distances to their own ideals side by side.
 */
function checkCase(
  label: string,
  fp4: GpuLayer,
  fp8: GpuLayer | null,
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  shared: boolean,
  sample: readonly number[] | null,
): void {
  const H = fp4.config.hidden;
  const out = runLayer(fp4, x, tokens, routing, shared);
  const again = runLayer(fp4, x, tokens, routing, shared);
  const at = again.findIndex((v, i) => v !== out[i]);
  assert.equal(at, -1, `${label}: a repeated run differs at element ${at}`);
  assertSameBits(runLayer(fp4, x, tokens, routing, shared, fp4.fused), out, `${label} T=${tokens}: fused`);

  const picked = sample ?? Array.from({ length: tokens }, (_, t) => t);
  const s = sample === null ? { x, routing } : sampleOf(fp4.config, x, routing, picked);
  const gpu = sample === null ? out : sampledRows(out, H, picked);
  const ref = referenceMoE(s.x, picked.length, s.routing, fp4.source, { shared });
  const ideal = idealMoE(s.x, picked.length, s.routing, fp4.source, { shared });
  const what = `${label} T=${tokens} shared ${shared ? "on" : "off"}${sample === null ? "" : ` (tokens ${picked.join(", ")})`}`;
  const e = layerErrors(gpu, ref, ideal);
  checkLayerErrors(`fp4 ${what}`, e, picked.length);
  if (fp8 === null) return;

  const out8 = runLayer(fp8, x, tokens, routing, shared);
  const gpu8 = sample === null ? out8 : sampledRows(out8, H, picked);
  const ideal8 = idealMoE(s.x, picked.length, s.routing, fp8.source, { shared });
  const toF64 = (bits: Uint16Array) => Float64Array.from(bits, bf16BitsToF32);
  const diff8 = calcDiff(toF64(gpu8), ideal8);
  console.log(
    `  ${what}: calc_diff vs FP64 ideal: fp4 ${e.diffIdeal.toExponential(2)} (exact FP4 weights), ` +
      `fp8 ${diff8.toExponential(2)} (dequantized FP8 weights)`,
  );
  assert.ok(Number.isFinite(diff8), `${what}: the FP8 layer's calc_diff vs its ideal is ${diff8}`);
}

/** Requires `got` to equal the unfused pipeline's output `want` bit for bit. */
function assertSameBits(got: Uint16Array, want: Uint16Array, what: string): void {
  const at = got.findIndex((v, i) => v !== want[i]);
  assert.equal(at, -1, `${what} differs from the unfused pipeline at element ${at}`);
}

/**
 * The fused kernel at every block M (and the expand variant at 128) on each of `ctas` CTA counts:
 * the unfused pipeline's bits.
 */
function everyBlockM(
  fp4: GpuLayer,
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  shared: boolean,
  ctas: readonly number[],
  label: string,
): void {
  const want = runLayer(fp4, x, tokens, routing, shared);
  const kernel = fp4.fused.kernel;
  for (const blockM of FUSED_BLOCK_MS) {
    for (const expand of blockM === 128 ? [false, true] : [false]) {
      for (const n of ctas) {
        kernel.blockM = blockM;
        kernel.fp4Expand = expand;
        kernel.ctas = n;
        try {
          const got = runLayer(fp4, x, tokens, routing, shared, fp4.fused);
          assertSameBits(
            got,
            want,
            `${label} BLOCK_M ${blockM}${expand ? " expand" : ""}, ${n} CTAs, shared ${shared}`,
          );
        } finally {
          kernel.blockM = "auto";
          kernel.fp4Expand = "auto";
          kernel.ctas = device().smCount;
        }
      }
    }
  }
}

/** A case of the sweep: tokens and the routing's edge cases. */
interface Case {
  tokens: number;
  options: RandomRoutingOptions;
  /** Tokens the CPU side checks on the large shape (every token on tiny). */
  sample: number[];
}

/** T = 1, 7, 64, 129 with masked tokens, empty experts and a hot expert (E ≥ 8). */
function sweep(): Case[] {
  return [
    { tokens: 1, options: {}, sample: [0] },
    { tokens: 7, options: { maskedTokens: [3] }, sample: [3, 6] },
    { tokens: 64, options: { maskedTokens: [5, 40], emptyExperts: [0, 2, 5] }, sample: [5, 63] },
    { tokens: 129, options: { maskedTokens: [128], hotExpert: 7 }, sample: [0, 128] },
  ];
}

/** Every active token on expert `e` alone (its other slots unused): one group holds all rows. */
function oneExpertRouting(config: MoEConfig, tokens: number, e: number): Routing {
  const k = config.topK;
  const ids = new Int32Array(tokens * k).fill(-1);
  const weights = new Float32Array(tokens * k);
  for (let t = 0; t < tokens; t++) {
    ids[t * k] = e;
    weights[t * k] = Math.fround(0.5 + (t % 7) / 8);
  }
  return { ids, weights };
}

// ---------------------------------------------------------------------------------------------------

describe("FP4 layer: checks that need no GPU", () => {
  test("the fused kernel takes FP4 experts: every preset and block M has an FP4 build, none may spill", () => {
    assert.equal(fusedLayerProblem(resolveConfig("tiny", { expertFormat: "fp4" })), null);
    // The one-rank builds: each FP8 one has its FP4 twin (the EP builds list their own), and the FP4
    // 128-row builds their expand variant.
    const oneRank = fusedVariants.filter((v) => v.defines.EP_RANKS === undefined);
    const plain = oneRank.filter((v) => v.defines.FP4_EXPAND === undefined);
    const fp4Builds = plain.filter((v) => v.defines.B_FP4 === 1);
    assert.equal(fp4Builds.length, plain.length / 2);
    const expand = oneRank.filter((v) => v.defines.FP4_EXPAND === 1);
    assert.deepEqual(
      expand.map((v) => `${v.defines.B_FP4}/${v.defines.BLOCK_M}`).sort(),
      fp4Builds
        .filter((v) => v.defines.BLOCK_M === 128)
        .map((v) => `1/${v.defines.BLOCK_M}`)
        .sort(),
    );
    assert.ok(expand.every((v) => v.noSpill));
    for (const blockM of FUSED_BLOCK_MS) {
      assert.ok(
        fp4Builds.some((v) => v.defines.BLOCK_M === blockM),
        `no FP4 build at BLOCK_M ${blockM}`,
      );
    }
    assert.ok(fp4Builds.every((v) => v.noSpill));
  });

  test("the expand variant: FP4 experts, 128-row tiles, one rank; picked from 384 rows per expert", () => {
    const ep8 = resolveConfig("flash-ep8", { expertFormat: "fp4" });
    assert.equal(fusedExpandProblem(ep8, 128), null);
    assert.match(fusedExpandProblem(ep8, 32) ?? "", /128-row tiles, not 32/);
    assert.match(fusedExpandProblem(ep8, 64) ?? "", /128-row tiles, not 64/);
    assert.match(fusedExpandProblem(resolveConfig("flash-ep8"), 128) ?? "", /FP4 experts/);
    assert.equal(fusedExpand(ep8, 2047, 128), false); // 383.8 rows per expert
    assert.equal(fusedExpand(ep8, 2048, 128), true);
    assert.equal(fusedExpand(resolveConfig("flash", { expertFormat: "fp4" }), 8192, 128), false); // 192
  });
});

describeGpu("FP4 layer on a GPU (unfused pipeline and fused kernel)", () => {
  for (const scaleFormat of ["fp32", "ue8m0"] as ScaleFormat[]) {
    test(`tiny, ${scaleFormat} activation scales: against the CPU FP4 layer, beside FP8`, () => {
      const config4 = resolveConfig("tiny", { expertFormat: "fp4", scaleFormat });
      const config8 = resolveConfig("tiny", { scaleFormat });
      const weightSeed = seed + (scaleFormat === "fp32" ? 1 : 2);
      let fp4: GpuLayer | null = null;
      let fp8: GpuLayer | null = null;
      try {
        fp4 = openLayer(config4, weightSeed, 1024, "upload", config4.numExperts);
        fp8 = openLayer(config8, weightSeed, 1024, "upload", config8.numExperts);
        for (const c of sweep()) {
          const x = generateActivations(seed + 10 + c.tokens, c.tokens, config4.hidden);
          const routing = randomRouting(seed + 20 + c.tokens, c.tokens, config4, c.options);
          const label = `tiny ${scaleFormat} ${JSON.stringify(c.options)}`;
          for (const shared of [true, false]) checkCase(label, fp4, fp8, x, c.tokens, routing, shared, null);
        }
        const tokens = 129;
        const x = generateActivations(seed + 30, tokens, config4.hidden);
        for (const shared of [true, false]) {
          const routing = oneExpertRouting(config4, tokens, 6);
          checkCase(
            `tiny ${scaleFormat} every token on expert 6`,
            fp4,
            fp8,
            x,
            tokens,
            routing,
            shared,
            null,
          );
        }
        // Every block M of the fused kernel and other scheduling orders: the unfused pipeline's bits.
        const routing = randomRouting(seed + 31, tokens, config4, { maskedTokens: [4], emptyExperts: [1] });
        for (const shared of [true, false]) {
          everyBlockM(fp4, x, tokens, routing, shared, [1, 3, 17, device().smCount], `tiny ${scaleFormat}`);
        }
      } finally {
        closeLayer(fp4);
        closeLayer(fp8);
      }
    });
  }

  test("tiny, blocks spanning 16 binades beside exact blocks: every block M, as the CPU", () => {
    const config = resolveConfig("tiny", { expertFormat: "fp4" });
    let fp4: GpuLayer | null = null;
    try {
      fp4 = openLayer(config, seed + 4, 1024, "upload-spread", config.numExperts);
      const odd = fp4.source.expert(1);
      assert.equal(odd.format, "fp4");
      if (odd.format === "fp4") assert.ok(!fp4BlocksExact(odd.w1.scales, odd.w1.rows, odd.w1.cols));
      assert.ok((fp4.weights.fp4Exactness?.inexact ?? 0) > 0, "the upload counts the rounded elements");
      const tokens = 129;
      const x = generateActivations(seed + 40, tokens, config.hidden);
      const routing = randomRouting(seed + 41, tokens, config, { maskedTokens: [4], hotExpert: 1 });
      for (const shared of [true, false]) {
        checkCase("tiny spread blocks", fp4, null, x, tokens, routing, shared, null);
        everyBlockM(fp4, x, tokens, routing, shared, [1, device().smCount], "spread blocks");
      }
    } finally {
      closeLayer(fp4);
    }
  });

  test("flash-ep8: against the CPU FP4 layer on sampled tokens, beside FP8 at T = 64", () => {
    const config4 = resolveConfig("flash-ep8", { expertFormat: "fp4", maxTokens: 4096 });
    const config8 = resolveConfig("flash-ep8", { maxTokens: 256 });
    const weightSeed = seed + 3;
    let fp4: GpuLayer | null = null;
    let fp8: GpuLayer | null = null;
    try {
      const t0 = performance.now();
      fp4 = openLayer(config4, weightSeed, 4096, "generate", config4.numExperts);
      fp8 = openLayer(config8, weightSeed, 256, "generate", config8.topK);
      console.log(
        `  flash-ep8 layers made on the device in ${((performance.now() - t0) / 1000).toFixed(1)} s`,
      );
      for (const c of sweep()) {
        const x = generateActivations(seed + 40 + c.tokens, c.tokens, config4.hidden);
        const routing = randomRouting(seed + 50 + c.tokens, c.tokens, config4, c.options);
        const t1 = performance.now();
        checkCase(
          `flash-ep8 ${JSON.stringify(c.options)}`,
          fp4,
          c.tokens === 64 ? fp8 : null,
          x,
          c.tokens,
          routing,
          true,
          c.sample,
        );
        console.log(`  (T=${c.tokens}: ${((performance.now() - t1) / 1000).toFixed(1)} s with the CPU side)`);
      }
      // Large T, GPU only: the fused kernel's 64- and 128-row tiles against the unfused pipeline, with
      // and without the expansion (at T = 4096 the heuristic expands; an empty expert's chunks are skipped).
      for (const tokens of [1024, 4096]) {
        const x = generateActivations(seed + 70 + tokens, tokens, config4.hidden);
        const routing = randomRouting(seed + 71 + tokens, tokens, config4, {
          maskedTokens: [17],
          emptyExperts: [3],
        });
        for (const shared of [true, false]) {
          const want = runLayer(fp4, x, tokens, routing, shared);
          for (const expand of [false, true]) {
            fp4.fused.kernel.fp4Expand = expand;
            try {
              const got = runLayer(fp4, x, tokens, routing, shared, fp4.fused);
              assertSameBits(got, want, `flash-ep8 T=${tokens}${expand ? " expand" : ""} shared ${shared}`);
            } finally {
              fp4.fused.kernel.fp4Expand = "auto";
            }
          }
        }
      }
    } finally {
      closeLayer(fp4);
      closeLayer(fp8);
    }
  });

  test("MoELayer cuda with FP4 experts: the default pipeline, same bits as both pipelines run directly", () => {
    const config = resolveConfig("tiny", { expertFormat: "fp4" });
    const source = new GeneratedWeights(config, seed + 60, { cachedExperts: config.numExperts });
    const layer = new MoELayer(source, { backend: "cuda" });
    let direct: GpuLayer | null = null;
    try {
      assert.equal(layer.pipeline, DEFAULT_GPU_PIPELINE);
      const tokens = 65;
      const x = generateActivations(seed + 61, tokens, config.hidden);
      const got = layer.forward(x, tokens);
      const cpu = new MoELayer(source).forward(x, tokens);
      assert.deepEqual(got.routing.ids, cpu.routing.ids);
      checkLayerErrors(
        "MoELayer tiny fp4 (gate routing)",
        layerErrors(got.out, cpu.out, idealMoE(x, tokens, cpu.routing, source)),
        tokens,
      );
      direct = openLayer(config, seed + 60, 1024, "upload", config.numExperts);
      assert.deepEqual(
        runLayer(direct, x, tokens, got.routing, true),
        got.out,
        "MoELayer differs from the unfused pipeline run directly",
      );
      assertSameBits(
        runLayer(direct, x, tokens, got.routing, true, direct.fused),
        got.out,
        "the fused pipeline",
      );
      const unfused = new MoELayer(source, { backend: "cuda", pipeline: "unfused" });
      try {
        assert.deepEqual(
          unfused.forward(x, tokens).out,
          got.out,
          "pipeline unfused differs from the default",
        );
      } finally {
        unfused.dispose();
      }
    } finally {
      closeLayer(direct);
      layer.dispose();
    }
  });
});
