import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { type MoEConfig, resolveConfig } from "../../src/config/config.js";
import { InputError, MoELayer } from "../../src/layer.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { E4M3_DECODE } from "../../src/numerics/fp8.js";
import { fmaF32 } from "../../src/numerics/fp32.js";
import { quantizeActivations } from "../../src/numerics/quant.js";
import { calcDiff, relativeError } from "../../src/reference/metrics.js";
import { idealMoE, type Routing, referenceMoE } from "../../src/reference/moe.js";
import { randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import { type BlockQuantized, type MoEWeightSource, requireFp8Expert } from "../../src/weights/types.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("moe reference tests");

/**
 * The spec's per-token formulation, written independently of the reference's expert grouping:
 * token by token, slot by slot, element by element, straight from the codes and scales.
 */
function naiveMoE(
  x: Uint16Array,
  tokens: number,
  routing: Routing,
  source: MoEWeightSource,
  shared: boolean,
) {
  const c = source.config;
  const H = c.hidden;
  const B = 128;
  const gemmRow = (a: Uint8Array, sa: Float32Array, w: BlockQuantized, n: number) => {
    let acc = 0;
    for (let b = 0; b < w.cols / B; b++) {
      let p = 0;
      for (let i = b * B; i < (b + 1) * B; i++) p += E4M3_DECODE[a[i]] * E4M3_DECODE[w.q[n * w.cols + i]];
      // One rounding of acc + fp32(p) · fp32(sa · sw) (fmaF32: checked against C's fmaf on its own).
      acc = fmaF32(Math.fround(p), Math.fround(sa[b] * w.scales[Math.floor(n / B) * (w.cols / B) + b]), acc);
    }
    return acc;
  };
  const mlp = (t: number, w: { w1: BlockQuantized; w2: BlockQuantized }) => {
    const row = x.subarray(t * H, (t + 1) * H);
    const xq = quantizeActivations(row, 1, H, c.scaleFormat);
    const I = w.w1.rows / 2;
    const h = new Float32Array(I);
    for (let j = 0; j < I; j++) {
      let g = gemmRow(xq.q, xq.scales, w.w1, j);
      let u = gemmRow(xq.q, xq.scales, w.w1, I + j);
      if (c.swigluClamp !== null) {
        g = Math.min(g, c.swigluClamp);
        u = Math.max(-c.swigluClamp, Math.min(u, c.swigluClamp));
      }
      h[j] = Math.fround((g / (1 + Math.exp(-g))) * u);
    }
    // Re-quantize h per 128 channels from its fp32 values (the spec's rule, written out again).
    const hq = new Uint8Array(I);
    const hs = new Float32Array(I / B);
    for (let b = 0; b < I / B; b++) {
      let amax = 0;
      for (let i = b * B; i < (b + 1) * B; i++) amax = Math.max(amax, Math.abs(h[i]));
      let s = Math.fround(Math.max(amax, Math.fround(1e-10)) / 448);
      if (c.scaleFormat === "ue8m0") s = 2 ** Math.ceil(Math.log2(s));
      const inv = Math.fround(1 / s);
      hs[b] = s;
      for (let i = b * B; i < (b + 1) * B; i++) hq[i] = encodeNearest(Math.fround(h[i] * inv));
    }
    return Float32Array.from({ length: H }, (_, n) => gemmRow(hq, hs, w.w2, n));
  };
  const out = new Uint16Array(tokens * H);
  for (let t = 0; t < tokens; t++) {
    const acc = new Float32Array(H);
    for (let s = 0; s < c.topK; s++) {
      const e = routing.ids[t * c.topK + s];
      if (e < 0) continue;
      const y = mlp(t, requireFp8Expert(source.expert(e), "test"));
      for (let n = 0; n < H; n++) {
        acc[n] = Math.fround(
          acc[n] + Math.fround(routing.weights[t * c.topK + s] * bf16BitsToF32(f32ToBf16Bits(y[n]))),
        );
      }
    }
    if (shared) {
      const y = mlp(t, source.shared()!);
      for (let n = 0; n < H; n++) acc[n] = Math.fround(acc[n] + bf16BitsToF32(f32ToBf16Bits(y[n])));
    }
    for (let n = 0; n < H; n++) out[t * H + n] = f32ToBf16Bits(acc[n]);
  }
  return out;
}

/** e4m3 by exhaustive nearest search among codes of v's sign (ties to the even code). */
function encodeNearest(v: number): number {
  const negative = v < 0 || Object.is(v, -0);
  const target = Math.min(448, Math.abs(v));
  let best = 0;
  let bestErr = Number.POSITIVE_INFINITY;
  for (let code = 0; code < 0x7f; code++) {
    const err = Math.abs(E4M3_DECODE[code] - target);
    if (err < bestErr || (err === bestErr && (code & 1) === 0)) {
      best = code;
      bestErr = err;
    }
  }
  return negative ? best | 0x80 : best;
}

function tiny(overrides: Partial<MoEConfig> = {}): MoEConfig {
  return resolveConfig("tiny", overrides);
}

describe("reference MoE layer", () => {
  it("equals the naive per-token formulation bit for bit (T=7, shared on)", () => {
    const config = tiny();
    const w = new GeneratedWeights(config, seed);
    const x = generateActivations(seed + 1, 7, config.hidden);
    const routing = randomRouting(seed + 2, 7, config);
    const ref = referenceMoE(x, 7, routing, w);
    assert.deepEqual(ref, naiveMoE(x, 7, routing, w, true));
  });

  it("equals the naive formulation with UE8M0 scales, no clamp, no shared expert", () => {
    const config = tiny({ scaleFormat: "ue8m0", swigluClamp: null });
    const w = new GeneratedWeights(config, seed + 3);
    const x = generateActivations(seed + 4, 5, config.hidden);
    const routing = randomRouting(seed + 5, 5, config);
    assert.deepEqual(referenceMoE(x, 5, routing, w, { shared: false }), naiveMoE(x, 5, routing, w, false));
  });

  it("handles one token, empty experts, one hot expert and masked tokens", () => {
    const config = tiny();
    const w = new GeneratedWeights(config, seed + 6);
    const x = generateActivations(seed + 7, 9, config.hidden);
    const cases: Routing[] = [
      randomRouting(seed + 8, 9, config, { emptyExperts: [0, 3, 5] }),
      randomRouting(seed + 9, 9, config, { hotExpert: 2 }),
      randomRouting(seed + 10, 9, config, { maskedTokens: [0, 4, 8] }),
    ];
    for (const routing of cases)
      assert.deepEqual(referenceMoE(x, 9, routing, w), naiveMoE(x, 9, routing, w, true));
    const one = randomRouting(seed + 11, 1, config);
    const x1 = x.subarray(0, config.hidden);
    assert.deepEqual(referenceMoE(x1, 1, one, w), naiveMoE(x1, 1, one, w, true));
  });

  it("equals the naive formulation on random shapes, on one thread and on two", () => {
    // E, H, IH, top-k, shared experts, clamp and scale format drawn per case; T odd or 1.
    const random = rng(seed + 40);
    const pick = <T>(xs: readonly T[]): T => xs[Math.floor(random() * xs.length)];
    for (let i = 0; i < 6; i++) {
      const numExperts = pick([2, 3, 8, 13]);
      const config = tiny({
        name: "custom",
        numExperts,
        hidden: pick([128, 256, 384]),
        intermediate: pick([128, 256]),
        topK: 1 + Math.floor(random() * Math.min(numExperts, 6)),
        numShared: pick([0, 1, 2]),
        swigluClamp: pick([null, 10, 0.5]),
        scaleFormat: pick(["fp32", "ue8m0"] as const),
        router: { ...tiny().router, nGroup: 1, topkGroup: 1 },
      });
      const tokens = pick([1, 3, 11]);
      const w = new GeneratedWeights(config, seed + 41 + i);
      const x = generateActivations(seed + 50 + i, tokens, config.hidden);
      const routing = randomRouting(seed + 60 + i, tokens, config);
      const naive = naiveMoE(x, tokens, routing, w, config.numShared > 0);
      const what = JSON.stringify({ ...config, router: undefined, tokens });
      assert.deepEqual(referenceMoE(x, tokens, routing, w, { threads: 1 }), naive, what);
      assert.deepEqual(referenceMoE(x, tokens, routing, w, { threads: 2 }), naive, what);
    }
  });

  it("a fully masked token without the shared expert is exactly zero", () => {
    const config = tiny();
    const w = new GeneratedWeights(config, seed + 12);
    const x = generateActivations(seed + 13, 3, config.hidden);
    const routing = randomRouting(seed + 14, 3, config, { maskedTokens: [1] });
    const out = referenceMoE(x, 3, routing, w, { shared: false });
    const row = out.subarray(config.hidden, 2 * config.hidden);
    assert.ok(row.every((b) => b === 0));
    assert.ok(out.subarray(0, config.hidden).some((b) => b !== 0));
  });

  it("is deterministic and close to the FP64 ideal", () => {
    const config = tiny();
    const w = new GeneratedWeights(config, seed + 15);
    const x = generateActivations(seed + 16, 32, config.hidden);
    const routing = randomRouting(seed + 17, 32, config);
    const a = referenceMoE(x, 32, routing, w);
    assert.deepEqual(a, referenceMoE(x, 32, routing, w));
    const ideal = idealMoE(x, 32, routing, w);
    const ref = Float64Array.from(a, bf16BitsToF32);
    const rel = relativeError(ref, ideal);
    const diff = calcDiff(ref, ideal);
    console.log(
      `tiny T=32: ‖ref−ideal‖/‖ideal‖ = ${rel.toExponential(3)}, calc_diff = ${diff.toExponential(3)}`,
    );
    assert.ok(rel > 0 && rel < 0.08, `relative error ${rel}`);
    assert.ok(diff < 2e-3, `calc_diff ${diff}`);
  });
});

describe("MoELayer input checks", () => {
  const config = tiny();
  const layer = new MoELayer(new GeneratedWeights(config, seed + 20));
  const x = generateActivations(seed + 21, 4, config.hidden);

  it("routes with its gate and returns bf16 [T, H]", () => {
    const { out, routing } = layer.forward(x, 4);
    assert.equal(out.length, 4 * config.hidden);
    assert.equal(routing.ids.length, 4 * config.topK);
  });

  it("rejects bad inputs with errors that name them", () => {
    assert.throws(() => layer.forward(new Float32Array(4 * config.hidden) as never, 4), /Uint16Array/);
    assert.throws(() => layer.forward(x, 3), /expected tokens × hidden/);
    assert.throws(() => layer.forward(x, 0), /positive integer/);
    assert.throws(
      () => layer.forward(new Uint16Array((config.maxTokens + 1) * config.hidden), config.maxTokens + 1),
      /too many tokens/,
    );
    const bad = x.slice();
    bad[config.hidden + 5] = 0x7fc0; // NaN
    assert.throws(
      () => layer.forward(bad, 4),
      (e: Error) => e instanceof InputError && /token 1, channel 5/.test(e.message),
    );
    const inf = x.slice();
    inf[3] = 0xff80; // −inf
    assert.throws(() => layer.forward(inf, 4), /non-finite/);
    const routing = randomRouting(seed + 22, 4, config);
    routing.ids[2] = config.numExperts;
    assert.throws(() => layer.forward(x, 4, { routing }), /token 1/);
  });
});
