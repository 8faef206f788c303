/**
 * Finite inputs and weights that a forward cannot keep finite: the CPU reference raises NumericsError
 * naming the cause (the routing weight, x[token], the expert), the gate names x[token], and a custom
 * source's NaN code or overflowing scale is named before any work. A GPU output read back is checked by
 * checkFiniteOutput. docs/numerics.md, "Overflow", says where each is caught.
 */
import assert from "node:assert/strict";
import { describe, it } from "node:test";
import { resolveConfig } from "../../src/config/config.js";
import { MoELayer } from "../../src/layer.js";
import { bf16FromF32Array, f32FromBf16Array } from "../../src/numerics/bf16.js";
import { NumericsError } from "../../src/numerics/fp32.js";
import { checkFiniteOutput, referenceMoE } from "../../src/reference/moe.js";
import { RouterError, randomRouting, routeTokens } from "../../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../../src/weights/generate.js";
import type { ExpertWeights, MoEWeightSource } from "../../src/weights/types.js";

const tiny = resolveConfig("tiny");
const T = 4;
const H = tiny.hidden;
const k = tiny.topK;
const weights = new GeneratedWeights(tiny, 3);
const x = generateActivations(3, T, H);
const routing = randomRouting(3, T, tiny);
/** bf16's largest finite value, 3.3895e38. */
const BF16_MAX_BITS = 0x7f7f;

/** `run` throws `kind` itself (its name too) with a message matching `message`. */
function fails(run: () => unknown, kind: new (...a: never[]) => Error, message: RegExp): void {
  assert.throws(run, (e: unknown) => {
    assert.ok(e instanceof kind, `expected ${kind.name}, got ${String(e)}`);
    assert.equal((e as Error).name, kind.name);
    assert.match((e as Error).message, message);
    return true;
  });
}

/** The tiny layer's weights with routed expert `only`'s (default: every one's) W1 or W2 edited by `edit`. */
function editedSource(
  matrix: "w1" | "w2",
  edit: (q: Uint8Array, scales: Float32Array) => void,
  only?: number,
): MoEWeightSource {
  return {
    config: tiny,
    expert: (e) => {
      const w = weights.expert(e) as ExpertWeights;
      if (only !== undefined && e !== only) return w;
      const m = { ...w[matrix], q: w[matrix].q.slice(), scales: w[matrix].scales.slice() };
      edit(m.q, m.scales);
      return { ...w, [matrix]: m };
    },
    shared: () => weights.shared(),
    gate: () => weights.gate(),
  };
}

const isNonFinite = (bits: number) => (bits & 0x7f80) === 0x7f80;

describe("routing weights whose combine overflows fp32", () => {
  it("1e38 on every slot: NumericsError naming the output element and the token's terms", () => {
    const big = { ids: routing.ids, weights: routing.weights.map(() => 1e38) };
    for (const run of [
      () => new MoELayer(weights).forward(x, T, { routing: big }),
      () => referenceMoE(x, T, big, weights),
    ]) {
      fails(
        run,
        NumericsError,
        /^output\[\d+, \d+\] is not finite: the sum of token \d+'s terms \(9\.99\d*e\+37 · [-\d.e+]+, 9\.99\d*e\+37 · [-\d.e+]+, shared [-\d.e+]+\) overflows fp32/,
      );
    }
  });

  it("3e38 on one slot alone: the product with its expert's result is named", () => {
    // x a hundred times larger gives expert results past 1, which 3e38 takes past fp32's range.
    const louder = bf16FromF32Array(f32FromBf16Array(x).map((v) => v * 100));
    const ids = routing.ids.slice();
    const w = new Float32Array(T * k);
    w[0] = 3e38;
    fails(
      () => referenceMoE(louder, T, { ids, weights: w }, weights, { shared: false }),
      NumericsError,
      new RegExp(
        `^output\\[0, \\d+\\] is not finite: the routing weight of token 0, slot 0 \\(3\\.0\\d*e\\+38\\) times expert ${ids[0]}'s result there \\([-\\d.e+]+\\) overflows fp32`,
      ),
    );
  });

  it("accepted: a routing weight of 1e30 has no bound of its own and gives a finite output", () => {
    const large = { ids: routing.ids, weights: routing.weights.map(() => 1e30) };
    const { out } = new MoELayer(weights).forward(x, T, { routing: large });
    assert.ok(!out.some(isNonFinite));
  });
});

describe("x near bf16's largest value", () => {
  const huge = new Uint16Array(T * H).fill(BF16_MAX_BITS);

  it("the gate names x[token] and its largest element, not a logit", () => {
    for (const run of [
      () => new MoELayer(weights).forward(huge, T),
      () => routeTokens(huge, T, weights.gate(), tiny),
    ]) {
      fails(
        run,
        RouterError,
        /^x\[0\] is too large for the gate: its logit for expert \d+ is -?[\d.]+e\+38, past fp32's range \(x\[0, 0\] = 3\.3895\d*e\+38, the largest of token 0; gate\.weight\[\d+\] is at most [\d.e-]+ in magnitude\)/,
      );
    }
  });

  it("with routing given, the L1 overflow names the expert and x[token]", () => {
    // Experts run in index order, each over its tokens in order: the first to fail is the lowest id's first.
    const e = Math.min(...routing.ids);
    const t = Math.floor(routing.ids.indexOf(e) / k);
    fails(
      () => new MoELayer(weights).forward(huge, T, { routing }),
      NumericsError,
      new RegExp(
        `^expert ${e}: x\\[${t}\\] \\(largest \\|value\\| 3\\.390e\\+38\\) times W1 overflows fp32: at intermediate channel \\d+`,
      ),
    );
  });
});

describe("a custom weight source's weights", () => {
  it("an e4m3 NaN code in W1 is named: matrix, expert, row and column", () => {
    const source = editedSource("w1", (q) => {
      q[3 * H + 5] = 0x7f;
    });
    fails(
      () => new MoELayer(source).forward(x, T, { routing }),
      TypeError,
      /^the weight source's expert \d+ W1\.q\[773\] \(row 3, column 5\) is the e4m3 NaN code 0x7f$/,
    );
  });

  it("an e4m3 NaN code 0xFF in W2", () => {
    const source = editedSource("w2", (q) => {
      q[1] = 0xff;
    });
    fails(
      () => referenceMoE(x, T, routing, source),
      TypeError,
      /expert \d+ W2\.q\[1\] \(row 0, column 1\) is the e4m3 NaN code 0xff/,
    );
  });

  it("a block scale that 448 times overflows fp32 is named with its block", () => {
    const source = editedSource("w1", (_, scales) => {
      scales[1] = 3e38;
    });
    fails(
      () => referenceMoE(x, T, routing, source),
      TypeError,
      /expert \d+ W1\.scales\[1\] \(block \[0, 1\]\) = 3\.0\d*e\+38 is too large: times 448, e4m3's largest magnitude/,
    );
  });

  it("scales that fit but overflow the L1 sums: NumericsError naming the expert and x[token]", () => {
    const source = editedSource("w1", (_, scales) => scales.fill(7e35));
    fails(
      () => referenceMoE(x, T, routing, source),
      NumericsError,
      /^expert \d+: x\[\d+\] \(largest \|value\| [\d.]+e[+-]\d+\) times W1 overflows fp32: at intermediate channel \d+ the L1 results are gate/,
    );
  });

  it("W2 codes and scales that overflow the L2 sums: NumericsError naming the expert, x[token] and channel", () => {
    const source = editedSource("w2", (q, scales) => {
      q.fill(0x7e); // 448
      scales.fill(7e35);
    });
    fails(
      () => referenceMoE(x, T, routing, source),
      NumericsError,
      /^expert \d+: for x\[\d+\] the L2 result is -?Infinity at output channel \d+: the intermediate \(largest \|value\| [\d.]+e[+-]\d+\) times W2 overflows fp32/,
    );
  });

  it("the error crosses worker threads as a NumericsError", () => {
    // One expert overflows, so that one thread or two meet the same first error.
    const source = editedSource("w1", (_, scales) => scales.fill(7e35), routing.ids[0]);
    const messages = [1, 2].map((threads) => {
      try {
        referenceMoE(x, T, routing, source, { threads });
      } catch (e) {
        assert.ok(e instanceof NumericsError, `threads=${threads}: ${String(e)}`);
        return e.message;
      }
      return assert.fail(`threads=${threads}: no error`);
    });
    assert.equal(messages[1], messages[0]);
  });
});

describe("checkFiniteOutput, for outputs read back from a GPU", () => {
  it("names the first non-finite element: token, channel, value and bits", () => {
    const out = new Uint16Array(3 * 8).fill(0x3f80);
    out[1 * 8 + 3] = 0x7f80;
    out[2 * 8] = 0x7fc0;
    fails(
      () => checkFiniteOutput(out, 8, "the cuda layer's output"),
      NumericsError,
      /^the cuda layer's output\[1, 3\] is Infinity \(bf16 bits 0x7f80\): finite inputs and weights overflowed fp32/,
    );
    out[1 * 8 + 3] = 0xff80;
    fails(() => checkFiniteOutput(out, 8, "out"), NumericsError, /^out\[1, 3\] is -Infinity/);
    out[1 * 8 + 3] = 0;
    fails(() => checkFiniteOutput(out, 8, "out"), NumericsError, /^out\[2, 0\] is NaN \(bf16 bits 0x7fc0\)/);
  });

  it("accepted: bf16's largest finite values pass", () => {
    checkFiniteOutput(Uint16Array.of(BF16_MAX_BITS, 0xff7f, 0, 0x8000), 2, "out");
  });
});
