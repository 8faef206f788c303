/**
 * The unfused GPU pipeline (src/pipeline/unfused.ts) and its kernels (src/kernels/unfused):
 *
 * - each small kernel alone: the dispatch layout (counts, offsets, row_source and slot_row mutual
 *   inverses), the gather (exact copies), SwiGLU + re-quantization (the CPU rule up to the fp32 SwiGLU's
 *   few ulps) and the combine (bit-exact);
 * - the whole layer against the CPU reference (same numerics: ‖Δ‖/‖ref‖ < 1e-2, calc_diff < 1e-4, as
 *   they differ only by fp32 accumulation order and SwiGLU ulps, which can flip FP8 roundings) and the
 *   FP64 ideal (reported), on tiny and on E=16 H=512 IH=256 top-4, both scale formats, shared on and
 *   off, and the edge cases (empty experts, one expert for every token, masked tokens);
 * - determinism, CUDA-graph replay, and the MoELayer "cuda" backend (same API and error messages).
 *
 * Outputs and every intermediate buffer are poisoned with 0xFF (NaN) before each run, so a value that
 * no step wrote shows up. flash-ep8 compares a sample of tokens with references made beforehand on the
 * CPU machine by scripts/make-layer-fixtures.ts (MEGAMOE_FIXTURES, default .fixtures).
 * Skips with the reason without a GPU; with MEGAMOE_REQUIRE_GPU=1 it fails instead.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { describe, test } from "node:test";
import { type MoEConfig, QUANT_BLOCK, resolveConfig, type ScaleFormat } from "../../src/config/config.js";
import { CudaGraph } from "../../src/cuda/index.js";
import { DeviceMoEWeights } from "../../src/kernels/device-weights.js";
import { aScalesRows, takeGroupedGemmStatus } from "../../src/kernels/gemm/grouped_gemm.js";
import { fusedLayerProblem } from "../../src/kernels/megamoe/megamoe.js";
import { FUSED_BLOCK_MS } from "../../src/kernels/megamoe/megamoe.variants.js";
import { allocQuantOutputs, quantizeOnDevice } from "../../src/kernels/quant/quant.js";
import {
  combineOnDevice,
  dispatchLayoutOnDevice,
  gatherRowsOnDevice,
  swigluQuantizeOnDevice,
} from "../../src/kernels/unfused/moe.js";
import { variants } from "../../src/kernels/unfused/moe_unfused.variants.js";
import { DEFAULT_GPU_PIPELINE, InputError, MoELayer } from "../../src/layer.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { E4M3_DECODE } from "../../src/numerics/fp8.js";
import { quantizeRow128 } from "../../src/numerics/quant.js";
import { FusedPipeline } from "../../src/pipeline/fused.js";
import { type MoEPipeline, UnfusedPipeline } from "../../src/pipeline/unfused.js";
import { layerErrors } from "../../src/reference/error-bounds.js";
import { idealMoE, referenceMoE } from "../../src/reference/moe.js";
import { type RandomRoutingOptions, type Routing, randomRouting } from "../../src/reference/router.js";
import { swiglu } from "../../src/reference/swiglu.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import { availability, describeGpu, TestTensors, testDevice } from "../helpers/gpu.js";
import { checkLayerErrors } from "../helpers/layer-errors.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("unfused pipeline tests");

const random = rng(seed);
const randomInt = (n: number) => Math.floor(random() * n);

const tinyRouter = resolveConfig("tiny").router;
/** The custom small shape: E=16, H=512, IH=256, top-4 (no group limit). */
const custom = (overrides: Partial<MoEConfig> = {}) =>
  resolveConfig("tiny", {
    numExperts: 16,
    hidden: 512,
    intermediate: 256,
    topK: 4,
    ...overrides,
    router: { ...tinyRouter, nGroup: 1, topkGroup: 1 },
  });

const device = testDevice;

/** Float bits, for exact comparisons that NaN poison cannot fool. */
const bitsOf = (f: Float32Array) => new Uint32Array(f.buffer, f.byteOffset, f.length);
const POISON32 = 0xffffffff;

// ---------------------------------------------------------------------------------------------------
// CPU side of the comparisons

/** The combine of docs/numerics.md on host data (bit-exact reference for the kernel). */
function combineOnCpu(
  l2: Uint16Array,
  slotRow: Int32Array,
  weights: Float32Array,
  shared: Uint16Array | null,
  tokens: number,
  topK: number,
  hidden: number,
): Uint16Array {
  const out = new Uint16Array(tokens * hidden);
  for (let t = 0; t < tokens; t++) {
    for (let n = 0; n < hidden; n++) {
      let acc = 0;
      for (let s = 0; s < topK; s++) {
        const row = slotRow[t * topK + s];
        if (row < 0) continue;
        acc = Math.fround(acc + Math.fround(weights[t * topK + s] * bf16BitsToF32(l2[row * hidden + n])));
      }
      if (shared !== null) acc = Math.fround(acc + bf16BitsToF32(shared[t * hidden + n]));
      out[t * hidden + n] = f32ToBf16Bits(acc);
    }
  }
  return out;
}

/** Random finite bf16 values whose magnitude varies by row (2^-8 .. 2^4). */
function randomBf16Rows(rows: number, cols: number): Uint16Array {
  const out = new Uint16Array(rows * cols);
  for (let r = 0; r < rows; r++) {
    const m = 2 ** (randomInt(13) - 8);
    for (let c = 0; c < cols; c++) out[r * cols + c] = f32ToBf16Bits((random() * 2 - 1) * m);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Pipeline runs

/** One poisoned forward (output and every intermediate buffer NaN first); returns the output. */
function runPipeline(
  pipeline: MoEPipeline,
  config: MoEConfig,
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  shared: boolean,
): Uint16Array {
  const ts = new TestTensors();
  try {
    const xt = ts.from("bf16", [tokens, config.hidden], x);
    const ids = ts.from("int32", [tokens, config.topK], routing.ids);
    const w = ts.from("fp32", [tokens, config.topK], routing.weights);
    const out = ts.empty("bf16", [tokens, config.hidden], 0xff); // bf16 NaN: an unwritten element fails
    pipeline.fillScratch(0xff);
    pipeline.forward({ x: xt, ids, weights: w, out, tokens, shared }, null);
    pipeline.checkStatus();
    const stall = takeGroupedGemmStatus(device());
    assert.equal(stall, null, `a grouped GEMM stalled: ${JSON.stringify(stall)}`);
    const result = out.toHost();
    const unwritten = result.indexOf(0xffff);
    assert.equal(unwritten, -1, `output element ${unwritten} was never written`);
    return result;
  } finally {
    ts.dispose();
  }
}

/**
 * Runs every pipeline (unfused, and fused where the shape allows), compares each with the reference and
 * the ideal computed live on the CPU, and requires the fused output to equal the unfused one bit for bit
 * (same numerics, same K order in the tensor cores).
 */
function checkAgainstReference(
  label: string,
  pipelines: readonly MoEPipeline[],
  weights: GeneratedWeights,
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  shared: boolean,
): void {
  const config = weights.config;
  const outs = pipelines.map((p) => runPipeline(p, config, x, tokens, routing, shared));
  const ref = referenceMoE(x, tokens, routing, weights, { shared });
  const ideal = idealMoE(x, tokens, routing, weights, { shared });
  pipelines.forEach((p, i) => {
    checkLayerErrors(
      `${p.kind} ${label} T=${tokens} shared=${shared ? "on" : "off"}`,
      layerErrors(outs[i]!, ref, ideal),
      tokens,
    );
  });
  for (let i = 1; i < outs.length; i++) {
    const at = outs[i]!.findIndex((v, j) => v !== outs[0]![j]);
    assert.equal(
      at,
      -1,
      `${label} T=${tokens}: ${pipelines[i]!.kind} differs from ${pipelines[0]!.kind} at element ${at}`,
    );
  }
}

/** The GPU pipelines of a layer: the unfused one, and the fused one where the shape allows it. */
function makePipelines(dw: DeviceMoEWeights, maxTokens: number): MoEPipeline[] {
  const pipelines: MoEPipeline[] = [new UnfusedPipeline(device(), dw, maxTokens)];
  try {
    if (fusedLayerProblem(dw.config) === null) pipelines.push(new FusedPipeline(device(), dw, maxTokens));
  } catch (e) {
    for (const p of pipelines) p.dispose();
    throw e;
  }
  return pipelines;
}

/** The pipelines with uploaded weights for `config`; `body` runs with them, then all are freed. */
function withPipeline(
  config: MoEConfig,
  weightSeed: number,
  maxTokens: number,
  body: (pipelines: MoEPipeline[], weights: GeneratedWeights) => void,
): void {
  const weights = new GeneratedWeights(config, weightSeed, { cachedExperts: config.numExperts });
  const dw = DeviceMoEWeights.upload(device(), weights);
  let pipelines: MoEPipeline[] = [];
  try {
    pipelines = makePipelines(dw, maxTokens);
    body(pipelines, weights);
  } finally {
    for (const p of pipelines) p.dispose();
    dw.dispose();
  }
}

// ---------------------------------------------------------------------------------------------------

describe("unfused pipeline: checks that need no GPU", () => {
  test("kernel variants: one per scale format, no spills allowed", () => {
    assert.deepEqual(
      variants.map((v) => v.defines),
      [{ SCALE_UE8M0: 0 }, { SCALE_UE8M0: 1 }],
    );
    assert.ok(variants.every((v) => v.noSpill));
  });

  test("the cuda backend says why it cannot start", {
    skip: availability.ok ? "a GPU is present (the GPU tests below cover the backend)" : false,
  }, () => {
    const source = new GeneratedWeights(resolveConfig("tiny"), seed);
    assert.throws(
      () => new MoELayer(source, { backend: "cuda" }),
      (e: unknown) => e instanceof InputError && /backend "cuda" needs a CUDA GPU/.test(e.message),
    );
  });
});

describeGpu("unfused MoE pipeline on a GPU", () => {
  test("dispatch layout: counts, offsets, row_source and slot_row are mutual inverses", () => {
    const cases = [
      { tokens: 1, k: 1, experts: 1, hot: false },
      { tokens: 7, k: 2, experts: 8, hot: false },
      { tokens: 129, k: 6, experts: 256, hot: false },
      { tokens: 8192, k: 6, experts: 256, hot: false }, // T·k = 49152
      { tokens: 1000, k: 8, experts: 1024, hot: false },
      { tokens: 3000, k: 4, experts: 32, hot: true },
    ];
    for (const { tokens, k, experts, hot } of cases) {
      const slots = tokens * k;
      const ids = new Int32Array(slots);
      for (let i = 0; i < slots; i++) {
        const u = random();
        // Not routed: −1 mostly, and ids outside [0, E) (the kernel treats them as −1 too).
        if (u < 0.1) ids[i] = -1;
        else if (u < 0.12) ids[i] = [experts, experts + 5, -7][randomInt(3)];
        else ids[i] = hot && i % k === 0 ? 3 % experts : randomInt(experts);
      }
      const ts = new TestTensors();
      try {
        const groupOffsets = ts.empty("int32", [experts + 1], 0x7f);
        const rowSource = ts.empty("int32", [slots], 0x7f);
        const slotRow = ts.empty("int32", [slots], 0x7f);
        const sharedOffsets = ts.empty("int32", [2], 0x7f);
        dispatchLayoutOnDevice(
          device(),
          ts.from("int32", [tokens, k], ids),
          experts,
          { groupOffsets, rowSource, slotRow, sharedOffsets },
          null,
        );
        const offsets = groupOffsets.toHost();
        const source = rowSource.toHost();
        const rowOf = slotRow.toHost();
        const label = `T=${tokens} k=${k} E=${experts}`;
        assert.deepEqual(Array.from(sharedOffsets.toHost()), [0, tokens], `${label}: shared offsets`);

        const counts = new Int32Array(experts);
        for (const e of ids) if (e >= 0 && e < experts) counts[e]++;
        assert.equal(offsets[0], 0, `${label}: offsets[0]`);
        for (let e = 0; e < experts; e++) {
          assert.equal(offsets[e + 1] - offsets[e], counts[e], `${label}: count of expert ${e}`);
        }
        const m = offsets[experts];
        assert.equal(
          m,
          counts.reduce((a, b) => a + b, 0),
          `${label}: M`,
        );
        for (let i = 0; i < slots; i++) {
          const e = ids[i];
          const row = rowOf[i];
          if (e < 0 || e >= experts) {
            assert.equal(row, -1, `${label}: slot ${i} (id ${e}) must not be routed`);
            continue;
          }
          assert.ok(
            row >= offsets[e] && row < offsets[e + 1],
            `${label}: slot ${i} row ${row} outside expert ${e}`,
          );
          assert.equal(source[row], i, `${label}: row_source[slot_row[${i}]]`);
        }
        // Every row below M is some slot's row (with the check above: a bijection).
        for (let r = 0; r < m; r++) {
          const i = source[r];
          assert.ok(i >= 0 && i < slots && rowOf[i] === r, `${label}: slot_row[row_source[${r}]]`);
        }
      } finally {
        ts.dispose();
      }
    }
  });

  test("gather: sorted rows and transposed scales are exact copies; rows past M untouched", () => {
    for (const hidden of [512, 7168]) {
      const tokens = 100;
      const k = 4;
      const experts = 16;
      const slots = tokens * k;
      const kb = hidden / QUANT_BLOCK;
      const config = custom({ hidden, numExperts: experts, topK: k });
      const routing = randomRouting(seed + hidden, tokens, config, { maskedTokens: [0, 17, 99] });
      const ts = new TestTensors();
      try {
        const x = ts.from("bf16", [tokens, hidden], randomBf16Rows(tokens, hidden));
        const q = allocQuantOutputs(device(), tokens, hidden);
        try {
          quantizeOnDevice(device(), x, q, "fp32", null);
          const groupOffsets = ts.empty("int32", [experts + 1]);
          const rowSource = ts.empty("int32", [slots], 0xff);
          const slotRow = ts.empty("int32", [slots]);
          dispatchLayoutOnDevice(
            device(),
            ts.from("int32", [tokens, k], routing.ids),
            experts,
            { groupOffsets, rowSource, slotRow, sharedOffsets: null },
            null,
          );
          const pad = aScalesRows(slots);
          const aq = ts.empty("fp8_e4m3", [slots, hidden], 0xab);
          const aScales = ts.empty("fp32", [kb, pad], 0xff);
          gatherRowsOnDevice(
            device(),
            {
              xq: q.q,
              xScales: q.scales,
              rowSource,
              topK: k,
              rows: slots,
              rowCount: { offsets: groupOffsets, index: experts },
              aq,
              aScales,
            },
            null,
          );
          const tPad = aScalesRows(tokens);
          const sharedScales = ts.empty("fp32", [kb, tPad], 0xff);
          gatherRowsOnDevice(
            device(),
            {
              xq: q.q,
              xScales: q.scales,
              rowSource: null,
              topK: k,
              rows: tokens,
              rowCount: null,
              aq: null,
              aScales: sharedScales,
            },
            null,
          );
          const xq = q.q.toHost() as Uint8Array;
          const xs = bitsOf(q.scales.toHost() as Float32Array);
          const m = groupOffsets.toHost()[experts];
          const source = rowSource.toHost();
          const rows = aq.toHost();
          const scales = bitsOf(aScales.toHost());
          const label = `H=${hidden}`;
          for (let r = 0; r < slots; r++) {
            const row = rows.subarray(r * hidden, (r + 1) * hidden);
            if (r >= m) {
              assert.ok(
                row.every((b) => b === 0xab),
                `${label}: row ${r} ≥ M = ${m} was written`,
              );
              for (let b = 0; b < kb; b++)
                assert.equal(scales[b * pad + r], POISON32, `${label}: scale (${b}, ${r})`);
              continue;
            }
            const t = Math.floor(source[r] / k);
            assert.deepEqual(
              row,
              xq.subarray(t * hidden, (t + 1) * hidden),
              `${label}: row ${r} (token ${t})`,
            );
            for (let b = 0; b < kb; b++) {
              assert.equal(scales[b * pad + r], xs[t * kb + b], `${label}: scale (${b}, ${r}) of token ${t}`);
            }
          }
          for (let b = 0; b < kb; b++) {
            for (let r = slots; r < pad; r++)
              assert.equal(scales[b * pad + r], POISON32, `${label}: pad (${b}, ${r})`);
          }
          const st = bitsOf(sharedScales.toHost());
          for (let b = 0; b < kb; b++) {
            for (let t = 0; t < tPad; t++) {
              const want = t < tokens ? xs[t * kb + b] : POISON32;
              assert.equal(st[b * tPad + t], want, `${label}: shared scale (${b}, ${t})`);
            }
          }
        } finally {
          q.q.dispose();
          q.scales.dispose();
        }
      } finally {
        ts.dispose();
      }
    }
  });

  test("SwiGLU + re-quantization: the CPU rule within the fp32 SwiGLU's ulps; rows past M untouched", () => {
    const inter = 256;
    const rows = 77;
    const live = 70; // the device-side row count: rows 70..76 must stay untouched
    const groups = inter / QUANT_BLOCK;
    const pad = aScalesRows(rows);
    for (const format of ["fp32", "ue8m0"] as ScaleFormat[]) {
      for (const clamp of [10, null]) {
        const label = `${format}, clamp ${clamp ?? "none"}`;
        const l1 = new Float32Array(rows * 2 * inter);
        for (let r = 0; r < rows; r++) {
          const m = 2 ** (randomInt(12) - 6); // 2^-6 .. 2^5: the clamp at 10 engages
          for (let c = 0; c < 2 * inter; c++) l1[r * 2 * inter + c] = Math.fround((random() * 2 - 1) * m * 4);
        }
        const ts = new TestTensors();
        try {
          const hq = ts.empty("fp8_e4m3", [rows, inter], 0xee);
          const hScales = ts.empty("fp32", [groups, pad], 0xff);
          swigluQuantizeOnDevice(
            device(),
            {
              l1: ts.from("fp32", [rows, 2 * inter], l1),
              rows,
              rowCount: { offsets: ts.from("int32", [2], Int32Array.from([5, live])), index: 1 },
              clamp,
              format,
              hq,
              hScales,
            },
            null,
          );
          const codes = hq.toHost();
          const scales = hScales.toHost();
          const h = new Float32Array(inter);
          const wantCodes = new Uint8Array(inter);
          const wantScales = new Float32Array(groups);
          let codeMismatches = 0;
          let scaleMismatches = 0;
          for (let r = 0; r < rows; r++) {
            if (r >= live) {
              assert.ok(
                codes.subarray(r * inter, (r + 1) * inter).every((b) => b === 0xee),
                `${label}: row ${r} ≥ ${live} written`,
              );
              for (let g = 0; g < groups; g++)
                assert.ok(Number.isNaN(scales[g * pad + r]), `${label}: scale (${g}, ${r})`);
              continue;
            }
            for (let j = 0; j < inter; j++)
              h[j] = swiglu(l1[r * 2 * inter + j], l1[r * 2 * inter + inter + j], clamp);
            for (let g = 0; g < groups; g++)
              quantizeRow128(h, g * 128, 128, format, wantCodes, g * 128, wantScales, g);
            for (let g = 0; g < groups; g++) {
              const s = scales[g * pad + r];
              const want = wantScales[g];
              if (s !== want) scaleMismatches++;
              // fp32: amax is a few ulps off at most; ue8m0: the power of two may move at a boundary.
              const close =
                format === "fp32"
                  ? Math.abs(s / want - 1) <= 1e-5
                  : s === want || s === 2 * want || 2 * s === want;
              assert.ok(close, `${label}: row ${r} group ${g} scale ${s}, CPU ${want}`);
              for (let j = g * 128; j < (g + 1) * 128; j++) {
                const code = codes[r * inter + j];
                if (code !== wantCodes[j]) codeMismatches++;
                // The quantization bound of docs/numerics.md around the CPU's h, widened by a few ulps.
                const dq = E4M3_DECODE[code] * s;
                const bound =
                  Math.max(2 ** -4 * Math.abs(h[j]), 2 ** -10 * s) * (1 + 1e-5) +
                  2e-6 * Math.abs(h[j]) +
                  1e-30;
                assert.ok(
                  Math.abs(dq - h[j]) <= bound,
                  `${label}: (${r}, ${j}) dequantizes to ${dq}, h = ${h[j]}`,
                );
              }
            }
          }
          const totalCodes = live * inter;
          console.log(
            `  SwiGLU+quant ${label}: ${codeMismatches}/${totalCodes} codes and ${scaleMismatches}/${live * groups} scales differ from the CPU`,
          );
          assert.ok(codeMismatches <= totalCodes * 0.02, `${label}: ${codeMismatches} codes differ`);
          if (format === "ue8m0") assert.ok(scaleMismatches <= Math.max(1, live * groups * 0.02));
        } finally {
          ts.dispose();
        }
      }
    }
  });

  test("combine: bit-exact against the CPU rule, masked slots skipped, shared on and off", () => {
    const tokens = 150;
    const k = 6;
    const hidden = 512;
    const slots = tokens * k;
    const l2 = randomBf16Rows(slots, hidden);
    const sharedRows = randomBf16Rows(tokens, hidden);
    // Rows in a random order, ~15% of the slots unrouted, token 3 entirely.
    const order = Array.from({ length: slots }, (_, i) => i);
    for (let i = slots - 1; i > 0; i--) {
      const j = randomInt(i + 1);
      [order[i], order[j]] = [order[j], order[i]];
    }
    const slotRow = Int32Array.from(order, (row, i) =>
      random() < 0.15 || Math.floor(i / k) === 3 ? -1 : row,
    );
    const weights = Float32Array.from({ length: slots }, () => Math.fround(random() * 1.5));
    const ts = new TestTensors();
    try {
      const l2t = ts.from("bf16", [slots, hidden], l2);
      const slotRowT = ts.from("int32", [slots], slotRow);
      const weightsT = ts.from("fp32", [tokens, k], weights);
      const sharedT = ts.from("bf16", [tokens, hidden], sharedRows);
      for (const shared of [true, false]) {
        const out = ts.empty("bf16", [tokens, hidden], 0xff);
        combineOnDevice(
          device(),
          { l2: l2t, slotRow: slotRowT, weights: weightsT, sharedOut: shared ? sharedT : null, out },
          null,
        );
        const want = combineOnCpu(l2, slotRow, weights, shared ? sharedRows : null, tokens, k, hidden);
        assert.deepEqual(out.toHost(), want, `combine, shared ${shared ? "on" : "off"}`);
      }
    } finally {
      ts.dispose();
    }
  });

  const layers: [string, MoEConfig][] = [
    ["tiny", resolveConfig("tiny")],
    ["tiny UE8M0", resolveConfig("tiny", { scaleFormat: "ue8m0" })],
    ["E=16 H=512 IH=256 top-4", custom()],
    ["E=16 H=512 IH=256 top-4 UE8M0 no clamp", custom({ scaleFormat: "ue8m0", swigluClamp: null })],
  ];
  for (const [name, config] of layers) {
    test(`${name}: T = 1, 7, 64, 129, 1024 against the live CPU reference`, () => {
      withPipeline(config, seed + 1, 1024, (pipelines, weights) => {
        for (const tokens of [1, 7, 64, 129, 1024]) {
          const x = generateActivations(seed + tokens, tokens, config.hidden);
          const routing = randomRouting(seed + 2 * tokens, tokens, config);
          checkAgainstReference(name, pipelines, weights, x, tokens, routing, true);
          // Shared off on a subset: the CPU reference is the slow part.
          if (tokens === 7 || tokens === 1024) {
            checkAgainstReference(name, pipelines, weights, x, tokens, routing, false);
          }
        }
      });
    });
  }

  for (const format of ["fp32", "ue8m0"] as ScaleFormat[]) {
    test(`edge cases (${format}): empty experts, one expert for all tokens, masked tokens`, () => {
      const config = custom({ scaleFormat: format });
      withPipeline(config, seed + 7, 256, (pipelines, weights) => {
        const cases: [string, number, RandomRoutingOptions][] = [
          ["experts 0, 3, 5 empty", 33, { emptyExperts: [0, 3, 5] }],
          ["every token to expert 2", 200, { hotExpert: 2 }],
          ["masked tokens 0, 5, 16", 17, { maskedTokens: [0, 5, 16] }],
          ["one token, masked", 1, { maskedTokens: [0] }],
        ];
        for (const [label, tokens, opts] of cases) {
          const x = generateActivations(seed + 11, tokens, config.hidden);
          const routing = randomRouting(seed + 12, tokens, config, opts);
          for (const shared of [true, false]) {
            checkAgainstReference(`${format} ${label}`, pipelines, weights, x, tokens, routing, shared);
          }
        }
        // Only expert 9, in slot 0; slots 1..k−1 unused: one group holds every row, 15 are empty.
        const tokens = 150;
        const ids = new Int32Array(tokens * config.topK).fill(-1);
        const w = new Float32Array(tokens * config.topK);
        for (let t = 0; t < tokens; t++) {
          ids[t * config.topK] = 9;
          w[t * config.topK] = Math.fround(0.5 + random());
        }
        const x = generateActivations(seed + 13, tokens, config.hidden);
        for (const shared of [true, false]) {
          checkAgainstReference(
            `${format} only expert 9`,
            pipelines,
            weights,
            x,
            tokens,
            { ids, weights: w },
            shared,
          );
        }
      });
    });
  }

  test("bit-identical repeats, and a CUDA graph replay equal to the eager run", () => {
    const config = resolveConfig("tiny");
    withPipeline(config, seed + 21, 1024, (pipelines) => {
      for (const pipeline of pipelines) {
        const tokens = 300;
        const x = generateActivations(seed + 22, tokens, config.hidden);
        const routing = randomRouting(seed + 23, tokens, config);
        const a = runPipeline(pipeline, config, x, tokens, routing, true);
        const b = runPipeline(pipeline, config, x, tokens, routing, true);
        assert.deepEqual(a, b, "two eager runs differ");
        if (pipeline instanceof FusedPipeline) {
          // Other scheduling orders (fewer CTAs claim the same work in other interleavings) and every
          // block M (64 splits the tile between the warpgroups by columns, 16 and 32 swap A and B): the
          // same bits.
          for (const blockM of FUSED_BLOCK_MS) {
            for (const ctas of [1, 3, 17, device().smCount]) {
              pipeline.kernel.ctas = ctas;
              pipeline.kernel.blockM = blockM;
              try {
                assert.deepEqual(
                  runPipeline(pipeline, config, x, tokens, routing, true),
                  a,
                  `fused, BLOCK_M ${blockM}, ${ctas} CTAs`,
                );
              } finally {
                pipeline.kernel.ctas = device().smCount;
                pipeline.kernel.blockM = "auto";
              }
            }
          }
        }

        const d = device();
        const stream = d.createStream();
        const ts = new TestTensors();
        let graph: CudaGraph | undefined;
        try {
          pipeline.warmup(tokens, stream);
          const f = {
            x: ts.from("bf16", [tokens, config.hidden], x),
            ids: ts.from("int32", [tokens, config.topK], routing.ids),
            weights: ts.from("fp32", [tokens, config.topK], routing.weights),
            out: ts.empty("bf16", [tokens, config.hidden]),
            tokens,
            shared: true,
          };
          graph = CudaGraph.capture(stream, (s) => pipeline.forward(f, s));
          for (let replay = 0; replay < 2; replay++) {
            pipeline.fillScratch(0xff, stream);
            f.out.fill(0xff, stream);
            graph.launch(stream);
            stream.synchronize();
            pipeline.checkStatus();
            assert.deepEqual(
              f.out.toHost(),
              a,
              `${pipeline.kind}: graph replay ${replay} differs from the eager run`,
            );
          }
        } finally {
          graph?.destroy();
          ts.dispose();
          stream.destroy();
        }
      }
    });
  });

  test("MoELayer with backend cuda: same results and error messages as the CPU", () => {
    const config = resolveConfig("tiny");
    const source = new GeneratedWeights(config, seed + 31, { cachedExperts: config.numExperts });
    const gpuLayer = new MoELayer(source, { backend: "cuda" });
    const cpuLayer = new MoELayer(source, { backend: "cpu" });
    const ts = new TestTensors();
    try {
      const tokens = 65;
      const H = config.hidden;
      const x = generateActivations(seed + 32, tokens, H);
      const gpu = gpuLayer.forward(x, tokens);
      const cpu = cpuLayer.forward(x, tokens);
      assert.deepEqual(gpu.routing.ids, cpu.routing.ids);
      checkLayerErrors(
        "MoELayer tiny (gate routing)",
        layerErrors(gpu.out, cpu.out, idealMoE(x, tokens, cpu.routing, source)),
        tokens,
      );
      assert.equal(gpuLayer.pipeline, DEFAULT_GPU_PIPELINE);
      const other = DEFAULT_GPU_PIPELINE === "fused" ? "unfused" : "fused";
      const otherLayer = new MoELayer(source, { backend: "cuda", pipeline: other });
      try {
        assert.equal(otherLayer.pipeline, other);
        assert.deepEqual(
          otherLayer.forward(x, tokens).out,
          gpu.out,
          `pipeline ${other} differs from the default`,
        );
      } finally {
        otherLayer.dispose();
      }
      assert.throws(
        () =>
          new MoELayer(new GeneratedWeights(custom({ hidden: 384 }), 1), {
            backend: "cuda",
            pipeline: "fused",
          }),
        (e: unknown) => e instanceof InputError && /hidden \(384\) must be a multiple of 256/.test(e.message),
      );
      const off = gpuLayer.forward(x, tokens, { routing: cpu.routing, shared: false });
      const cpuOff = cpuLayer.forward(x, tokens, { routing: cpu.routing, shared: false });
      checkLayerErrors(
        "MoELayer tiny shared off",
        layerErrors(off.out, cpuOff.out, idealMoE(x, tokens, cpu.routing, source, { shared: false })),
        tokens,
      );

      // forwardDevice: the same pipeline on device tensors gives the same bits.
      const out = ts.empty("bf16", [tokens, H], 0xff);
      gpuLayer.forwardDevice({
        x: ts.from("bf16", [tokens, H], x),
        ids: ts.from("int32", [tokens, config.topK], cpu.routing.ids),
        weights: ts.from("fp32", [tokens, config.topK], cpu.routing.weights),
        out,
        tokens,
      });
      device().synchronize();
      assert.deepEqual(out.toHost(), gpu.out, "forwardDevice differs from forward");
      assert.throws(
        () =>
          gpuLayer.forwardDevice({
            x: ts.empty("fp32", [tokens, H]),
            ids: ts.empty("int32", [tokens, config.topK]),
            weights: ts.empty("fp32", [tokens, config.topK]),
            out,
            tokens,
          }),
        (e: unknown) =>
          e instanceof InputError && /x must be bf16\[65, 256\], got fp32\[65, 256\]/.test(e.message),
      );
      assert.throws(
        () => cpuLayer.forwardDevice({ x: out, ids: out, weights: out, out, tokens }),
        (e: unknown) => e instanceof InputError && /needs the "cuda" backend/.test(e.message),
      );

      // Every invalid input fails with the CPU layer's error (class and message).
      const bad = Uint16Array.from(x);
      bad[3 * H + 5] = 0x7f80; // +inf
      const badIds = Int32Array.from(cpu.routing.ids);
      badIds[3 * config.topK + 1] = config.numExperts;
      const dupIds = Int32Array.from(cpu.routing.ids);
      dupIds[4 * config.topK + 1] = dupIds[4 * config.topK];
      const badWeights = Float32Array.from(cpu.routing.weights);
      badWeights[2] = Number.NaN;
      const tooMany = config.maxTokens + 1;
      const invalid: [string, () => [Uint16Array, number, { routing?: Routing }]][] = [
        ["too many tokens", () => [new Uint16Array(tooMany * H), tooMany, {}]],
        ["wrong length", () => [x, tokens + 1, {}]],
        ["zero tokens", () => [new Uint16Array(0), 0, {}]],
        ["non-finite x", () => [bad, tokens, {}]],
        ["id out of range", () => [x, tokens, { routing: { ids: badIds, weights: cpu.routing.weights } }]],
        [
          "id twice in a token",
          () => [x, tokens, { routing: { ids: dupIds, weights: cpu.routing.weights } }],
        ],
        ["non-finite weight", () => [x, tokens, { routing: { ids: cpu.routing.ids, weights: badWeights } }]],
      ];
      for (const [label, args] of invalid) {
        let cpuError: Error | undefined;
        try {
          cpuLayer.forward(...args());
        } catch (e) {
          cpuError = e as Error;
        }
        assert.ok(cpuError !== undefined, `${label}: the CPU layer accepted it`);
        assert.throws(
          () => gpuLayer.forward(...args()),
          (e: unknown) =>
            e instanceof Error && e.constructor === cpuError!.constructor && e.message === cpuError!.message,
          `${label}: expected ${cpuError!.name}: ${cpuError!.message}`,
        );
      }
    } finally {
      ts.dispose();
      gpuLayer.dispose();
      cpuLayer.dispose();
    }
  });

  const fixtureDir = process.env.MEGAMOE_FIXTURES ?? ".fixtures";
  const fixtureFiles = fs.existsSync(fixtureDir)
    ? fs.readdirSync(fixtureDir).filter((f) => f.endsWith(".json"))
    : [];
  const byTokens = (a: string, b: string) => parseInt(a.split("-T")[1], 10) - parseInt(b.split("-T")[1], 10);
  // The large presets, each against the sampled CPU references scripts/make-layer-fixtures.ts made.
  for (const shape of ["flash-ep8", "flash", "pro"]) {
    const fixtures = fixtureFiles.filter((f) => f.startsWith(`${shape}-T`)).sort(byTokens);
    test(`${shape} against sampled CPU references`, {
      skip:
        fixtures.length === 0
          ? `no ${shape} fixtures in ${fixtureDir} (scripts/make-layer-fixtures.ts)`
          : false,
    }, () => {
      const first = JSON.parse(fs.readFileSync(path.join(fixtureDir, fixtures[0]), "utf8"));
      const config = resolveConfig(shape, { maxTokens: 8192 });
      const t0 = performance.now();
      // Made on the device: bit-identical to GeneratedWeights (test/gpu/weightgen.test.ts), seconds faster.
      const dw = DeviceMoEWeights.generate(device(), config, first.seed);
      console.log(
        `  ${shape} weights made on the device in ${((performance.now() - t0) / 1000).toFixed(1)} s`,
      );
      const pipelines = makePipelines(dw, 8192);
      try {
        for (const file of fixtures) {
          const f = JSON.parse(fs.readFileSync(path.join(fixtureDir, file), "utf8"));
          assert.equal(f.seed, first.seed, `${file}: every ${shape} fixture must come from one seed`);
          const x = generateActivations(f.seed + 1, f.tokens, config.hidden);
          const routing = randomRouting(f.seed + 2, f.tokens, config);
          const outs = pipelines.map((p) => runPipeline(p, config, x, f.tokens, routing, f.shared));
          const H = config.hidden;
          pipelines.forEach((p, k) => {
            const sampled = new Uint16Array(f.sample.length * H);
            f.sample.forEach((t: number, i: number) => {
              sampled.set(outs[k]!.subarray(t * H, (t + 1) * H), i * H);
            });
            checkLayerErrors(
              `${p.kind} ${shape} T=${f.tokens} (${f.sample.length} tokens sampled, seed ${f.seed})`,
              layerErrors(sampled, Uint16Array.from(f.reference), Float64Array.from(f.ideal)),
              f.sample.length,
            );
          });
          for (let k = 1; k < outs.length; k++) {
            const at = outs[k]!.findIndex((v, j) => v !== outs[0]![j]);
            assert.equal(
              at,
              -1,
              `${shape} T=${f.tokens}: ${pipelines[k]!.kind} differs from unfused at ${at}`,
            );
          }
        }
      } finally {
        for (const p of pipelines) p.dispose();
        dw.dispose();
      }
    });
  }
});
