import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { type MoEConfig, PRESETS, type RouterConfig, type ScoringFunction } from "../../src/config/config.js";
import {
  gateLogits,
  RENORMALIZE_EPSILON,
  RouterError,
  randomRouting,
  routeTokens,
  scoreLogits,
  selectTopK,
  validateRouting,
} from "../../src/reference/router.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("router");

const random = rng(seed); // test/helpers' stream, independent of the router's own
const randInt = (lo: number, hi: number): number => lo + Math.floor(random() * (hi - lo + 1));
const pick = <T>(items: T[]): T => items[Math.floor(random() * items.length)];

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** Bits of a value that bf16 holds exactly (the test fails loudly otherwise). */
function bf16Of(value: number): number {
  f32[0] = value;
  assert.equal(u32[0] & 0xffff, 0, `${value} is not a bf16 value`);
  return u32[0] >>> 16;
}

/** Independent bf16 decode: the bits are the top half of an fp32. */
function decodeBf16(bits: number): number {
  u32[0] = bits << 16;
  return f32[0];
}

/** A random finite nonzero bf16 of magnitude about 2^-8 .. 2^2. */
function randomBf16(): number {
  const sign = random() < 0.5 ? 0x8000 : 0;
  const exponent = randInt(127 - 8, 127 + 2);
  return sign | (exponent << 7) | randInt(0, 127);
}

function randomBf16Array(n: number): Uint16Array {
  const a = new Uint16Array(n);
  for (let i = 0; i < n; i++) a[i] = randomBf16();
  return a;
}

function configWith(
  numExperts: number,
  topK: number,
  router: Partial<RouterConfig> = {},
  hidden = 128,
): MoEConfig {
  const base = PRESETS.tiny;
  return {
    ...base,
    name: "custom",
    numExperts,
    topK,
    hidden,
    router: { ...base.router, nGroup: 1, topkGroup: 1, correctionBias: false, ...router },
  };
}

function randomScores(n: number, levels = 0): Float32Array {
  const s = new Float32Array(n);
  // With levels > 0 the scores take few distinct values so exact ties are common.
  for (let i = 0; i < n; i++) s[i] = levels > 0 ? (randInt(1, levels) / levels) * 0.75 : random();
  return s;
}

function randomBias(n: number): Float32Array {
  const b = new Float32Array(n);
  for (let i = 0; i < n; i++) b[i] = (random() - 0.5) * 0.5;
  return b;
}

/** Brute force: rank all experts by (value desc, index asc) with Array.sort. */
function rankAll(values: ArrayLike<number>, indices: number[]): number[] {
  return [...indices].sort((a, b) => (values[b] === values[a] ? a - b : values[b] > values[a] ? 1 : -1));
}

function combinations(n: number, size: number): number[][] {
  const out: number[][] = [];
  const walk = (start: number, chosen: number[]): void => {
    if (chosen.length === size) {
      out.push([...chosen]);
      return;
    }
    for (let i = start; i < n; i++) walk(i + 1, [...chosen, i]);
  };
  walk(0, []);
  return out;
}

/** Brute-force expected routing of one token (groups chosen by checking every subset of groups). */
function bruteForceToken(scoreRow: Float32Array, bias: Float32Array | null, config: MoEConfig): number[] {
  const { numExperts, topK } = config;
  const { nGroup, topkGroup } = config.router;
  const sel = Array.from(scoreRow, (s, e) => (bias === null ? s : Math.fround(s + bias[e])));
  const experts = [...Array(numExperts).keys()];
  let allowed = experts;
  if (nGroup > 1) {
    const size = numExperts / nGroup;
    const groupScore = [...Array(nGroup).keys()].map((g) => {
      const members = sel.slice(g * size, (g + 1) * size).sort((a, b) => b - a);
      return size === 1 ? members[0] : Math.fround(members[0] + members[1]);
    });
    const beats = (a: number, b: number): boolean =>
      groupScore[a] > groupScore[b] || (groupScore[a] === groupScore[b] && a < b);
    const winners = combinations(nGroup, topkGroup).filter((subset) =>
      subset.every((g) => [...Array(nGroup).keys()].every((o) => subset.includes(o) || beats(g, o))),
    );
    assert.equal(winners.length, 1, "exactly one subset of groups beats all others");
    allowed = experts.filter((e) => winners[0].includes(Math.floor(e / size)));
  }
  return rankAll(sel, allowed).slice(0, topK);
}

function expectedWeights(scoreRow: Float32Array, ids: number[], config: MoEConfig): number[] {
  const { renormalize, routedScalingFactor } = config.router;
  const chosen = ids.map((e) => scoreRow[e]);
  const sum = chosen.reduce((a, b) => a + b, 0);
  return chosen.map((s) =>
    Math.fround(renormalize ? (s / (sum + 1e-20)) * routedScalingFactor : s * routedScalingFactor),
  );
}

function checkAgainstBruteForce(
  scores: Float32Array,
  bias: Float32Array | null,
  tokens: number,
  c: MoEConfig,
) {
  const { ids, weights } = selectTopK(scores, bias, tokens, c);
  for (let t = 0; t < tokens; t++) {
    const row = scores.subarray(t * c.numExperts, (t + 1) * c.numExperts);
    const want = bruteForceToken(row, bias, c);
    const got = Array.from(ids.subarray(t * c.topK, (t + 1) * c.topK));
    assert.deepEqual(got, want, `token ${t} ids (config ${JSON.stringify(c.router)}, k ${c.topK})`);
    assert.deepEqual(
      Array.from(weights.subarray(t * c.topK, (t + 1) * c.topK)),
      expectedWeights(row, want, c),
    );
  }
}

function divisors(n: number): number[] {
  return [...Array(n).keys()].map((i) => i + 1).filter((d) => n % d === 0);
}

describe("gate logits", () => {
  test("exact bf16 products are summed in double and rounded once to fp32", () => {
    // fp32 accumulation would give 1 (1 + 2^-24 rounds to even twice); double keeps 1 + 2^-23.
    const x = Uint16Array.from([1, 2 ** -24, 2 ** -24].map(bf16Of));
    const w = Uint16Array.from([1, 1, 1].map(bf16Of));
    assert.equal(gateLogits(x, w, 1, 3, 1)[0], 1 + 2 ** -23);
  });

  test("random bf16 inputs match an independent double-accumulated dot product", () => {
    const tokens = 5;
    const hidden = 256;
    const experts = 12;
    const x = randomBf16Array(tokens * hidden);
    const w = randomBf16Array(experts * hidden);
    const logits = gateLogits(x, w, tokens, hidden, experts);
    for (let t = 0; t < tokens; t++) {
      for (let e = 0; e < experts; e++) {
        let exact = 0;
        let fp32 = 0;
        for (let h = 0; h < hidden; h++) {
          const p = decodeBf16(x[t * hidden + h]) * decodeBf16(w[e * hidden + h]);
          assert.equal(Math.fround(p), p, "bf16 products are exact in fp32");
          exact += p;
          fp32 = Math.fround(fp32 + p);
        }
        const got = logits[t * experts + e];
        assert.equal(got, Math.fround(exact));
        // A GPU summing in fp32 lands close to, not exactly on, the reference.
        assert.ok(Math.abs(got - fp32) <= 1e-4 * (Math.abs(got) + 1), `logit ${t},${e}: ${got} vs ${fp32}`);
      }
    }
  });
});

describe("scores", () => {
  const logits = Float32Array.from([-100, -30, -20.5, -1, -1e-3, 0, 0.5, 3, 19.9, 20, 20.1, 30, 88, 100]);
  const n = logits.length;

  test("sigmoid is fround(1 / (1 + exp(-l)))", () => {
    const s = scoreLogits(logits, 1, n, "sigmoid");
    logits.forEach((l, i) => {
      assert.equal(s[i], Math.fround(1 / (1 + Math.exp(-l))));
    });
    assert.equal(s[5], 0.5);
  });

  test("sqrtsoftplus matches sqrt(max(l,0) + log1p(exp(-|l|)))", () => {
    const s = scoreLogits(logits, 1, n, "sqrtsoftplus");
    logits.forEach((l, i) => {
      const direct = Math.fround(Math.sqrt(Math.max(l, 0) + Math.log1p(Math.exp(-Math.abs(l)))));
      // At most one fp32 ulp apart: the threshold (l > 20 → l) and log1p(exp(l)) differ below 1e-8.
      assert.ok(Math.abs(s[i] - direct) <= 2 ** -23 * direct, `l=${l}: ${s[i]} vs ${direct}`);
      assert.ok(Number.isFinite(s[i]));
    });
    assert.equal(s[5], Math.fround(Math.sqrt(Math.LN2)));
    assert.equal(s[logits.length - 1], 10);
  });

  test("softmax matches exp(l) / sum exp and survives huge logits", () => {
    const moderate = Float32Array.from([-3, -1, 0, 0.25, 1, 2.5, 4, 7]);
    const s = scoreLogits(moderate, 1, moderate.length, "softmax");
    const denominator = moderate.reduce((a, l) => a + Math.exp(l), 0);
    moderate.forEach((l, i) => {
      const direct = Math.exp(l) / denominator;
      assert.ok(Math.abs(s[i] - direct) <= 2 ** -23 * direct, `softmax ${i}: ${s[i]} vs ${direct}`);
    });
    const huge = scoreLogits(Float32Array.from([1000, 999, -1000]), 1, 3, "softmax");
    assert.ok(Math.abs(huge[0] - 1 / (1 + Math.exp(-1))) < 1e-7);
    assert.equal(huge[2], 0);
    const rows = scoreLogits(logits, 1, n, "softmax");
    assert.ok(Math.abs(rows.reduce((a, b) => a + b, 0) - 1) < 1e-6);
  });

  test("each row is scored on its own", () => {
    const two = Float32Array.from([0, 1, 2, 5, 5, 5]);
    assert.deepEqual(
      Array.from(scoreLogits(two, 2, 3, "softmax").subarray(3)),
      [1 / 3, 1 / 3, 1 / 3].map(Math.fround),
    );
  });
});

describe("top-k selection", () => {
  test("matches a brute-force sort of all experts (no groups, with and without bias)", () => {
    for (let round = 0; round < 40; round++) {
      const experts = pick([4, 8, 16, 32, 64, 256]);
      const c = configWith(experts, randInt(1, Math.min(experts, 8)), {
        renormalize: random() < 0.7,
        routedScalingFactor: pick([1, 1.5, 2.5]),
      });
      const tokens = randInt(1, 12);
      const scores = randomScores(tokens * experts, round % 3 === 0 ? 4 : 0);
      checkAgainstBruteForce(scores, random() < 0.5 ? randomBias(experts) : null, tokens, c);
    }
  });

  test("group-limited selection matches a brute force over all group subsets", () => {
    for (let round = 0; round < 60; round++) {
      const experts = pick([8, 16, 24, 32, 64]);
      const nGroup = pick(divisors(experts).filter((d) => d > 1 && d <= 8));
      const topkGroup = randInt(1, nGroup);
      const topK = randInt(1, Math.min(8, (experts / nGroup) * topkGroup));
      const c = configWith(experts, topK, { nGroup, topkGroup, renormalize: random() < 0.7 });
      const tokens = randInt(1, 10);
      const scores = randomScores(tokens * experts, round % 3 === 0 ? 3 : 0);
      checkAgainstBruteForce(scores, random() < 0.5 ? randomBias(experts) : null, tokens, c);
    }
  });

  test("groups of one expert use the expert's own score", () => {
    const c = configWith(8, 2, { nGroup: 8, topkGroup: 3 });
    const scores = randomScores(3 * 8, 5);
    checkAgainstBruteForce(scores, randomBias(8), 3, c);
  });

  test("exact ties go to the lower expert index", () => {
    const c = configWith(8, 3);
    const flat = new Float32Array(8).fill(0.375);
    assert.deepEqual(Array.from(selectTopK(flat, null, 1, c).ids), [0, 1, 2]);
    const pairs = Float32Array.from([0.25, 0.5, 0.75, 0.5, 0.125, 0.75, 0.5, 0.0625]);
    assert.deepEqual(Array.from(selectTopK(pairs, null, 1, c).ids), [2, 5, 1]);
  });

  test("the group score is the sum of the top two, and group ties go to the lower group", () => {
    // Groups of 2: group 0 holds the best expert (0.875) but sums to 0.9375; groups 1 and 3 sum to 1.
    const scores = Float32Array.from([0.875, 0.0625, 0.5, 0.5, 0.125, 0.25, 0.75, 0.25]);
    const c = configWith(8, 2, { nGroup: 4, topkGroup: 1 });
    assert.deepEqual(Array.from(selectTopK(scores, null, 1, c).ids), [2, 3]);
    const two = configWith(8, 2, { nGroup: 4, topkGroup: 2 });
    assert.deepEqual(Array.from(selectTopK(scores, null, 1, two).ids), [6, 2]);
  });

  test("the bias changes which experts are chosen but not their weights", () => {
    const scores = Float32Array.from([0.875, 0.75, 0.125, 0.25]);
    const c = configWith(4, 2, { routedScalingFactor: 2 });
    const plain = selectTopK(scores, null, 1, c);
    assert.deepEqual(Array.from(plain.ids), [0, 1]);
    const biased = selectTopK(scores, Float32Array.from([0, 0, 1, 0]), 1, c);
    assert.deepEqual(Array.from(biased.ids), [2, 0]);
    const sum = 0.125 + 0.875;
    assert.deepEqual(Array.from(biased.weights), [(0.125 / sum) * 2, (0.875 / sum) * 2].map(Math.fround));
  });

  test("renormalization sums to the scaling factor; without it weights are score times the factor", () => {
    const experts = 32;
    const tokens = 16;
    const scores = randomScores(tokens * experts);
    for (const factor of [1, 1.5, 2.5]) {
      const c = configWith(experts, 6, { routedScalingFactor: factor });
      const { ids, weights } = selectTopK(scores, null, tokens, c);
      for (let t = 0; t < tokens; t++) {
        const row = Array.from(weights.subarray(t * 6, t * 6 + 6));
        const total = row.reduce((a, b) => a + b, 0);
        assert.ok(Math.abs(total - factor) <= 1e-6 * factor, `token ${t} sums to ${total}`);
        for (let j = 1; j < 6; j++) assert.ok(row[j] <= row[j - 1], "weights descend with the scores");
      }
      const raw = selectTopK(scores, null, tokens, { ...c, router: { ...c.router, renormalize: false } });
      assert.deepEqual(raw.ids, ids);
      raw.weights.forEach((w, i) => {
        const t = Math.floor(i / 6);
        assert.equal(w, Math.fround(scores[t * experts + raw.ids[i]] * factor));
      });
    }
  });

  test("the epsilon keeps all-zero chosen scores at weight 0 instead of NaN", () => {
    const c = configWith(4, 2);
    const zero = scoreLogits(Float32Array.from([-200, -300, -250, -400]), 1, 4, "sigmoid");
    assert.deepEqual(Array.from(zero), [0, 0, 0, 0]);
    const { ids, weights } = selectTopK(zero, null, 1, c);
    assert.deepEqual(Array.from(ids), [0, 1]);
    assert.deepEqual(Array.from(weights), [0, 0]);
    assert.equal(RENORMALIZE_EPSILON, 1e-20);
  });
});

describe("routeTokens", () => {
  function randomGate(c: MoEConfig, withBias: boolean) {
    return {
      weight: randomBf16Array(c.numExperts * c.hidden),
      bias: withBias ? randomBias(c.numExperts) : null,
    };
  }

  for (const scoring of ["sigmoid", "softmax", "sqrtsoftplus"] as ScoringFunction[]) {
    test(`${scoring}: equals the pieces composed and yields valid routing`, () => {
      const withBias = scoring !== "softmax";
      const c = configWith(16, 4, { scoring, nGroup: 4, topkGroup: 2, correctionBias: withBias }, 256);
      const tokens = 9;
      const x = randomBf16Array(tokens * c.hidden);
      const gate = randomGate(c, withBias);
      const r = routeTokens(x, tokens, gate, c);
      const logits = gateLogits(x, gate.weight, tokens, c.hidden, c.numExperts);
      assert.deepEqual(r.logits, logits);
      const scores = scoreLogits(logits, tokens, c.numExperts, scoring);
      const pieces = selectTopK(scores, gate.bias, tokens, c);
      assert.deepEqual(r.ids, pieces.ids);
      assert.deepEqual(r.weights, pieces.weights);
      validateRouting(r.ids, r.weights, tokens, c);
      checkAgainstBruteForce(scores, gate.bias, tokens, c);
    });
  }

  test("the tiny preset routes", () => {
    const c = PRESETS.tiny;
    const tokens = 7;
    const gate = randomGate(c, c.router.correctionBias);
    const r = routeTokens(randomBf16Array(tokens * c.hidden), tokens, gate, c);
    validateRouting(r.ids, r.weights, tokens, c);
  });

  test("masked tokens get ids -1 and weight 0, and their rows are never read", () => {
    const c = configWith(16, 3, { correctionBias: true }, 128);
    const tokens = 6;
    const x = randomBf16Array(tokens * c.hidden);
    x.fill(0x7fc0, 1 * c.hidden, 2 * c.hidden); // NaN in a masked row is not an error
    x[4 * c.hidden + 7] = 0x7f80; // nor is +inf
    const tokenMask = Uint8Array.from([1, 0, 1, 1, 0, 1]);
    const gate = randomGate(c, true);
    const r = routeTokens(x, tokens, gate, c, { tokenMask });
    validateRouting(r.ids, r.weights, tokens, c);
    const active = [0, 2, 3, 5];
    const sub = new Uint16Array(active.length * c.hidden);
    active.forEach((t, i) => {
      sub.set(x.subarray(t * c.hidden, (t + 1) * c.hidden), i * c.hidden);
    });
    const unmasked = routeTokens(sub, active.length, gate, c);
    for (let t = 0; t < tokens; t++) {
      const ids = Array.from(r.ids.subarray(t * 3, t * 3 + 3));
      const weights = Array.from(r.weights.subarray(t * 3, t * 3 + 3));
      const logits = Array.from(r.logits.subarray(t * 16, t * 16 + 16));
      const i = active.indexOf(t);
      if (i < 0) {
        assert.deepEqual(ids, [-1, -1, -1]);
        assert.deepEqual(weights, [0, 0, 0]);
        assert.deepEqual(logits, new Array(16).fill(0));
      } else {
        assert.deepEqual(ids, Array.from(unmasked.ids.subarray(i * 3, i * 3 + 3)));
        assert.deepEqual(weights, Array.from(unmasked.weights.subarray(i * 3, i * 3 + 3)));
        assert.deepEqual(logits, Array.from(unmasked.logits.subarray(i * 16, i * 16 + 16)));
      }
    }
  });
});

describe("validation errors", () => {
  const c = configWith(8, 2, { correctionBias: true }, 128);
  const tokens = 3;
  const x = randomBf16Array(tokens * c.hidden);
  const gate = { weight: randomBf16Array(c.numExperts * c.hidden), bias: randomBias(c.numExperts) };
  const fails = (fn: () => unknown, message: RegExp) =>
    assert.throws(fn, (e: unknown) => {
      assert.ok(e instanceof RouterError, `expected RouterError, got ${String(e)}`);
      assert.match(e.message, message);
      return true;
    });

  test("array lengths against the dimensions", () => {
    fails(() => routeTokens(x.subarray(1), tokens, gate, c), /^x has 383 elements, expected 384 \[?/);
    fails(
      () => routeTokens(x, tokens, { ...gate, weight: gate.weight.subarray(5) }, c),
      /gate\.weight has 1019 elements, expected 1024/,
    );
    fails(
      () => routeTokens(x, tokens, { ...gate, bias: new Float32Array(7).fill(0.5) }, c),
      /gate\.bias has 7/,
    );
    fails(() => routeTokens(x, tokens, gate, c, { tokenMask: new Uint8Array(2).fill(1) }), /tokenMask has 2/);
    fails(() => selectTopK(new Float32Array(5).fill(0.5), null, 1, c), /scores has 5 elements, expected 8/);
    fails(() => scoreLogits(new Float32Array(3).fill(1), 1, 4, "sigmoid"), /logits has 3 elements/);
    fails(() => gateLogits(x, gate.weight, -1, c.hidden, 8), /tokens must be a non-negative integer/);
  });

  test("non-finite inputs are named by index", () => {
    const badX = x.slice();
    badX[c.hidden + 5] = 0xff80; // -inf
    fails(() => routeTokens(badX, tokens, gate, c), /^x\[1, 5\] is not finite \(bf16 bits 0xff80\)/);
    const badW = gate.weight.slice();
    badW[3 * c.hidden + 7] = 0x7fc1; // NaN
    fails(() => routeTokens(x, tokens, { ...gate, weight: badW }, c), /gate\.weight\[3, 7\] is not finite/);
    const badBias = gate.bias.slice();
    badBias[2] = Number.NaN;
    fails(() => routeTokens(x, tokens, { ...gate, bias: badBias }, c), /gate\.bias\[2\] is not finite/);
    const badScores = new Float32Array(16).fill(0.25);
    badScores[11] = Number.NaN;
    fails(() => selectTopK(badScores, null, 2, c), /scores\[1, 3\] is not finite/);
    const badLogits = Float32Array.from([1, 2, Infinity, 3]);
    fails(() => scoreLogits(badLogits, 2, 2, "softmax"), /logits\[1, 0\] is not finite/);
  });

  test("bias presence must match config.router.correctionBias", () => {
    fails(
      () => routeTokens(x, tokens, { ...gate, bias: null }, c),
      /correctionBias is set but gate\.bias is null/,
    );
    const noBias = { ...c, router: { ...c.router, correctionBias: false } };
    fails(() => routeTokens(x, tokens, gate, noBias), /gate\.bias is given but .*correctionBias is false/);
  });

  test("validateRouting names the token and slot", () => {
    const w = new Float32Array(6).fill(0.75);
    validateRouting(Int32Array.from([0, 7, -1, -1, 3, 4]), w, 3, c);
    fails(
      () => validateRouting(Int32Array.from([0, 1, 2, 8, 3, 4]), w, 3, c),
      /token 1 slot 1: expert id 8 is outside/,
    );
    fails(
      () => validateRouting(Int32Array.from([0, 1, -2, 3, 3, 4]), w, 3, c),
      /token 1 slot 0: expert id -2/,
    );
    fails(
      () => validateRouting(Int32Array.from([0, 1, 2, 3, 5, 5]), w, 3, c),
      /token 2 slot 1: expert 5 already chosen in slot 0/,
    );
    const nan = w.slice();
    nan[3] = Number.NaN;
    fails(
      () => validateRouting(Int32Array.from([0, 1, 2, 3, 4, 5]), nan, 3, c),
      /token 1 slot 1: weight NaN/,
    );
    fails(() => validateRouting(new Int32Array(5), w, 3, c), /ids has 5 elements, expected 6/);
    fails(() => validateRouting(new Int32Array(6), w.subarray(1), 3, c), /weights has 5 elements/);
  });
});

describe("randomRouting", () => {
  const c = configWith(32, 6, { routedScalingFactor: 2.5 });

  test("is valid, seeded, positive, ordered and sums to the scaling factor", () => {
    const tokens = 200;
    const r = randomRouting(seed, tokens, c);
    validateRouting(r.ids, r.weights, tokens, c);
    assert.deepEqual(randomRouting(seed, tokens, c), r);
    assert.notDeepEqual(randomRouting(seed + 1, tokens, c).ids, r.ids);
    for (let t = 0; t < tokens; t++) {
      const w = Array.from(r.weights.subarray(t * 6, t * 6 + 6));
      assert.ok(w.every((v) => v > 0));
      for (let j = 1; j < 6; j++) assert.ok(w[j] <= w[j - 1]);
      assert.ok(Math.abs(w.reduce((a, b) => a + b, 0) - 2.5) < 1e-5);
    }
    const seen = new Set(r.ids);
    assert.ok(seen.size > 20, "draws spread over the experts");
  });

  test("hot expert, empty experts and masked tokens", () => {
    const tokens = 50;
    const emptyExperts = [0, 5, 9, 31];
    const r = randomRouting(seed, tokens, c, { hotExpert: 7, emptyExperts, maskedTokens: [3, 49] });
    validateRouting(r.ids, r.weights, tokens, c);
    for (let t = 0; t < tokens; t++) {
      const ids = Array.from(r.ids.subarray(t * 6, t * 6 + 6));
      if (t === 3 || t === 49) {
        assert.deepEqual(ids, [-1, -1, -1, -1, -1, -1]);
        assert.deepEqual(Array.from(r.weights.subarray(t * 6, t * 6 + 6)), [0, 0, 0, 0, 0, 0]);
      } else {
        assert.ok(ids.includes(7), `token ${t} routes to the hot expert`);
        assert.ok(ids.every((e) => !emptyExperts.includes(e)));
      }
    }
    const allToOne = randomRouting(seed, 10, configWith(8, 1), { hotExpert: 3 });
    assert.deepEqual(Array.from(allToOne.ids), new Array(10).fill(3));
    assert.deepEqual(Array.from(allToOne.weights), new Array(10).fill(1.5));
    const onlyTwo = randomRouting(seed, 10, configWith(8, 2), { emptyExperts: [0, 1, 2, 4, 5, 7] });
    for (let t = 0; t < 10; t++) assert.deepEqual([...onlyTwo.ids.subarray(2 * t, 2 * t + 2)].sort(), [3, 6]);
  });

  test("rejects impossible requests", () => {
    assert.throws(() => randomRouting(seed, 4, c, { hotExpert: 32 }), /hotExpert 32 is outside \[0, 32\)/);
    assert.throws(
      () => randomRouting(seed, 4, c, { hotExpert: 1, emptyExperts: [1] }),
      /also listed in emptyExperts/,
    );
    const many = [...Array(27).keys()];
    assert.throws(
      () => randomRouting(seed, 4, c, { emptyExperts: many }),
      /only 5 experts .* fewer than topK \(6\)/,
    );
    assert.throws(() => randomRouting(seed, 4, c, { maskedTokens: [4] }), /maskedTokens entry 4 is outside/);
    assert.throws(() => randomRouting(0.5, 4, c), /seed must be an integer/);
  });
});
