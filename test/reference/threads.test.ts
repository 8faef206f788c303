import assert from "node:assert/strict";
import { after, describe, it } from "node:test";
import { type MoEConfig, resolveConfig } from "../../src/config/config.js";
import { RankWeights } from "../../src/parallel/expert-parallel.js";
import {
  type Fp4ConversionStats,
  idealMoE,
  type ReferenceOptions,
  referenceMoE,
} from "../../src/reference/moe.js";
import { randomRouting } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import type { MoEWeightSource, RoutedExpertWeights } from "../../src/weights/types.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("reference on threads tests");

// Two shared experts: the shared task's MLP is larger than a routed one's (the workers' buffers grow).
const config: MoEConfig = resolveConfig("tiny", { numShared: 2, maxTokens: 64 });
const fp4Config: MoEConfig = resolveConfig("tiny", { expertFormat: "fp4", maxTokens: 64 });

/** The same weights without `generated`: the workers get every expert from this thread. */
function plainSource(source: MoEWeightSource, views = false): MoEWeightSource {
  // views: each array a window on a larger buffer, as a checkpoint's tensors can be.
  const view = <T extends Uint8Array | Float32Array>(a: T): T => {
    const Ctor = a.constructor as new (b: ArrayBuffer, o: number, n: number) => T;
    const big = new ArrayBuffer(a.byteLength + 64 * a.BYTES_PER_ELEMENT);
    const v = new Ctor(big, 16 * a.BYTES_PER_ELEMENT, a.length);
    v.set(a as never);
    return v;
  };
  const expert = (e: number): RoutedExpertWeights => {
    const w = source.expert(e);
    if (!views) return w;
    if (w.format === "fp4") {
      const m = (x: typeof w.w1) => ({ ...x, packed: view(x.packed), scales: view(x.scales) });
      return { ...w, w1: m(w.w1), w2: m(w.w2) };
    }
    const m = (x: typeof w.w1) => ({ ...x, q: view(x.q), scales: view(x.scales) });
    return { ...w, w1: m(w.w1), w2: m(w.w2) };
  };
  return { config: source.config, expert, shared: () => source.shared(), gate: () => source.gate() };
}

function run(source: MoEWeightSource, tokens: number, s: number, options: ReferenceOptions) {
  const c = source.config;
  const x = generateActivations(s, tokens, c.hidden);
  const routing = randomRouting(s, tokens, c, {
    emptyExperts: [1],
    maskedTokens: tokens > 3 ? [2] : [],
  });
  const fp4Stats: Fp4ConversionStats = { inexact: 0, total: 0 };
  const progress: number[] = [];
  const out = referenceMoE(x, tokens, routing, source, {
    ...options,
    fp4Stats,
    onProgress: (done, total) => progress.push(done, total),
  });
  const ideal = idealMoE(x, tokens, routing, source, options);
  return { out, ideal, fp4Stats, progress };
}

after(() => {
  delete process.env.MEGAMOE_CPU_THREADS;
});

describe("the CPU reference on worker threads", () => {
  it("gives the one-thread bits at 2 and 3 threads: FP8 with two shared experts, FP4, odd T", () => {
    for (const [c, tokens] of [
      [config, 1],
      [config, 37],
      [fp4Config, 29],
    ] as const) {
      const source = new GeneratedWeights(c, seed);
      const one = run(source, tokens, seed + tokens, { threads: 1 });
      for (const threads of [2, 3]) {
        const got = run(source, tokens, seed + tokens, { threads });
        const what = `${c.name} ${c.expertFormat ?? "fp8"} T=${tokens} threads=${threads}`;
        assert.deepEqual(got.out, one.out, `${what}: referenceMoE`);
        assert.deepEqual(got.ideal, one.ideal, `${what}: idealMoE`);
        assert.deepEqual(got.fp4Stats, one.fp4Stats, `${what}: FP4 counts`);
        const total = one.progress[1];
        assert.equal(got.progress.length, 2 * total, what);
        assert.deepEqual(
          got.progress.filter((_, i) => i % 2 === 0),
          Array.from({ length: total }, (_, i) => i + 1),
          what,
        );
      }
      if (c === fp4Config) assert.ok(one.fp4Stats.total > 0);
    }
  });

  it("takes weights from this thread when they are not the generator's, views of larger buffers too", () => {
    for (const c of [config, fp4Config]) {
      const source = new GeneratedWeights(c, seed + 1);
      const one = run(source, 23, seed, { threads: 1 });
      for (const views of [false, true]) {
        const got = run(plainSource(source, views), 23, seed, { threads: 2 });
        assert.deepEqual(got.out, one.out);
        assert.deepEqual(got.ideal, one.ideal);
        assert.deepEqual(got.fp4Stats, one.fp4Stats);
      }
    }
  });

  it("a forward started from a progress callback runs beside the threaded one, both exact", () => {
    const source = new GeneratedWeights(config, seed + 5);
    const x = generateActivations(seed, 13, config.hidden);
    const routing = randomRouting(seed, 13, config);
    const one = referenceMoE(x, 13, routing, source, { threads: 1 });
    const inner: Uint16Array[] = [];
    const outer = referenceMoE(x, 13, routing, source, {
      threads: 2,
      onProgress: (done) => {
        if (done === 1) inner.push(referenceMoE(x, 13, routing, source, { threads: 2 }));
      },
    });
    assert.equal(inner.length, 1);
    assert.deepEqual(inner[0], one);
    assert.deepEqual(outer, one);
  });

  it("makes a rank's experts from the generator's numbering (firstExpert)", () => {
    const whole = new GeneratedWeights(resolveConfig("tiny", { maxTokens: 64 }), seed + 2);
    const rank = new RankWeights(whole, 1, 2, 64);
    assert.equal(rank.generated?.firstExpert, 4);
    const one = run(plainSource(rank), 19, seed, { threads: 1 });
    const got = run(rank, 19, seed, { threads: 2 });
    assert.deepEqual(got.out, one.out);
    assert.deepEqual(got.ideal, one.ideal);
  });

  it("a worker's error is thrown here, the same kind and words as on one thread", () => {
    const source = new GeneratedWeights(config, seed + 3);
    // Scales this large (448 times one still fits fp32) overflow the fp32 L1 sums of expert 2.
    const huge: MoEWeightSource = {
      ...plainSource(source),
      expert: (e) => {
        const w = source.expert(e);
        if (e !== 2 || w.format === "fp4") return w;
        return { ...w, w1: { ...w.w1, scales: w.w1.scales.map(() => 7e35) } };
      },
    };
    const x = generateActivations(seed, 16, config.hidden);
    const routing = { ids: new Int32Array(32).fill(2), weights: new Float32Array(32).fill(0.5) };
    for (let t = 0; t < 16; t++) routing.ids[2 * t + 1] = t % 2;
    const messages = [1, 2].map((threads): string => {
      try {
        referenceMoE(x, 16, routing, huge, { threads });
      } catch (e) {
        assert.ok(e instanceof RangeError, `threads=${threads}: ${String(e)}`);
        return e.message;
      }
      return assert.fail(`threads=${threads}: no error`);
    });
    assert.match(messages[0], /^expert 2: x\[0\] \(largest \|value\| [\d.e+-]+\) times W1 overflows fp32/);
    assert.equal(messages[1], messages[0]);
    // The pool is usable after a failed call.
    assert.deepEqual(run(source, 5, seed, { threads: 2 }).out, run(source, 5, seed, { threads: 1 }).out);
  });

  it("threads come from the option, else MEGAMOE_CPU_THREADS; either is checked", () => {
    const source = new GeneratedWeights(config, seed + 4);
    const x = generateActivations(seed, 4, config.hidden);
    const routing = randomRouting(seed, 4, config);
    for (const bad of [0, 2.5, 65, Number.NaN]) {
      assert.throws(
        () => referenceMoE(x, 4, routing, source, { threads: bad }),
        /^RangeError: reference options\.threads must be an integer in \[1, 64\]/,
      );
    }
    assert.throws(
      () => referenceMoE(x, 4, routing, source, { threads: "2" as never }),
      /reference options\.threads must be an integer in \[1, 64\], got the string "2"/,
    );
    const one = referenceMoE(x, 4, routing, source, { threads: 1 });
    process.env.MEGAMOE_CPU_THREADS = "2";
    assert.deepEqual(referenceMoE(x, 4, routing, source), one);
    for (const bad of ["0", "two", "1.5", "99"]) {
      process.env.MEGAMOE_CPU_THREADS = bad;
      assert.throws(
        () => referenceMoE(x, 4, routing, source),
        /^RangeError: MEGAMOE_CPU_THREADS must be an integer in \[1, 64\], got/,
      );
      // The option wins over the variable.
      assert.deepEqual(referenceMoE(x, 4, routing, source, { threads: 1 }), one);
    }
    delete process.env.MEGAMOE_CPU_THREADS;
  });
});
