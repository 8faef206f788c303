/**
 * The boundary kernel (src/kernels/norm) against the CPU reference (src/reference/norm.ts), bit for
 * bit: bf16 rows, and the FP8 codes and scales against `quantizeActivations` of the reference's bf16
 * rows (the quantization kernel's rule and layout), for plain rows and the hyper-connection pre-mix,
 * both scale formats. Outputs are poisoned (0xFF) before every run, so an element never written shows.
 *
 * GPU tests skip with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 */

import assert from "node:assert/strict";
import { test } from "node:test";
import { QUANT_BLOCK, type ScaleFormat } from "../../src/config/config.js";
import { DeviceTensor } from "../../src/cuda/index.js";
import { type NormInput, rmsNormOnDevice } from "../../src/kernels/norm/norm.js";
import { allocQuantOutputs, quantizeOnDevice } from "../../src/kernels/quant/quant.js";
import { f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { quantizeActivations } from "../../src/numerics/quant.js";
import { premixRmsNorm, rmsNorm } from "../../src/reference/norm.js";
import { availability, describeGpu, testDevice } from "../helpers/gpu.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("norm-gpu");
const random = rng(seed);

const HIDDENS = [256, 384, 4096, 7168]; // tiny, an odd number of 128-groups, flash, pro
const TOKENS = [1, 7, 129, 1000];
const EPS = 1e-6;

/** Random bf16 rows; each row gets its own magnitude (2^-20 .. 2^20), a few rows are all zero. */
function randomRows(rows: number, hidden: number): Uint16Array {
  const x = new Uint16Array(rows * hidden);
  for (let r = 0; r < rows; r++) {
    if (r % 17 === 5) continue; // zero row
    const magnitude = 2 ** Math.floor(random() * 41 - 20);
    for (let h = 0; h < hidden; h++) x[r * hidden + h] = f32ToBf16Bits((random() * 2 - 1) * magnitude);
  }
  return x;
}

function hex(v: number, digits: number): string {
  return `0x${v.toString(16).padStart(digits, "0")}`;
}

/** Names the first differing element of two equal-length integer arrays, or returns null. */
function firstDifference(
  expected: ArrayLike<number>,
  got: ArrayLike<number>,
): { at: number; count: number } | null {
  let at = -1;
  let count = 0;
  for (let i = 0; i < expected.length; i++) {
    if (expected[i] !== got[i]) {
      if (at < 0) at = i;
      count++;
    }
  }
  return at < 0 ? null : { at, count };
}

interface Case {
  what: string;
  tokens: number;
  hidden: number;
  /** Plain rows, or streams [T, n, H] + mix [T, n]. */
  x?: Uint16Array;
  streams?: { data: Uint16Array; mix: Float32Array; n: number };
  weight: Uint16Array;
}

function expectedOf(c: Case): Uint16Array {
  return c.streams
    ? premixRmsNorm(c.streams.data, c.streams.mix, c.weight, c.tokens, c.streams.n, c.hidden, EPS)
    : rmsNorm(c.x!, c.weight, c.tokens, c.hidden, EPS);
}

/** Runs the kernel on poisoned outputs: bf16 rows (when `wantY`) and FP8 (when `format`). */
function runOnDevice(c: Case, wantY: boolean, format: ScaleFormat | null) {
  const d = testDevice();
  const made: DeviceTensor[] = [];
  const keep = <T extends DeviceTensor>(t: T): T => {
    made.push(t);
    return t;
  };
  try {
    let input: NormInput;
    if (c.streams) {
      input = {
        streams: keep(DeviceTensor.fromHost(d, "bf16", [c.tokens, c.streams.n, c.hidden], c.streams.data)),
        mix: keep(DeviceTensor.fromHost(d, "fp32", [c.tokens, c.streams.n], c.streams.mix)),
      };
    } else {
      input = { x: keep(DeviceTensor.fromHost(d, "bf16", [c.tokens, c.hidden], c.x!)) };
    }
    const weight = keep(DeviceTensor.fromHost(d, "bf16", [c.hidden], c.weight));
    const y = wantY ? keep(DeviceTensor.empty(d, "bf16", [c.tokens, c.hidden])) : null;
    const q = format ? keep(DeviceTensor.empty(d, "fp8_e4m3", [c.tokens, c.hidden])) : null;
    const scales = format ? keep(DeviceTensor.empty(d, "fp32", [c.tokens, c.hidden / QUANT_BLOCK])) : null;
    for (const t of [y, q, scales]) t?.fill(0xff);
    rmsNormOnDevice(
      d,
      input,
      weight,
      EPS,
      { y, fp8: format ? { q: q!, scales: scales!, format } : null },
      null,
    );
    return {
      y: y ? (y.toHost() as Uint16Array) : null,
      q: q ? (q.toHost() as Uint8Array) : null,
      scales: scales ? (scales.toHost() as Float32Array) : null,
    };
  } finally {
    for (const t of made) t.dispose();
  }
}

function assertRows(c: Case, expected: Uint16Array, got: Uint16Array): void {
  const diff = firstDifference(expected, got);
  if (diff === null) return;
  const t = Math.floor(diff.at / c.hidden);
  const h = diff.at % c.hidden;
  assert.fail(
    `${c.what}: ${diff.count} of ${expected.length} bf16 outputs differ; first at token ${t}, channel ${h}: ` +
      `expected ${hex(expected[diff.at]!, 4)}, got ${hex(got[diff.at]!, 4)}` +
      (got[diff.at] === 0xffff ? " (the poison: never written)" : "") +
      ` (seed ${seed})`,
  );
}

function assertFp8(c: Case, format: ScaleFormat, y: Uint16Array, q: Uint8Array, scales: Float32Array): void {
  const expected = quantizeActivations(y, c.tokens, c.hidden, format);
  const groups = c.hidden / QUANT_BLOCK;
  const expBits = new Uint32Array(expected.scales.buffer, expected.scales.byteOffset, expected.scales.length);
  const gotBits = new Uint32Array(scales.buffer, scales.byteOffset, scales.length);
  const ds = firstDifference(expBits, gotBits);
  if (ds !== null) {
    assert.fail(
      `${c.what} ${format}: ${ds.count} of ${expBits.length} scales differ; first at token ${Math.floor(ds.at / groups)}, ` +
        `group ${ds.at % groups}: expected ${expected.scales[ds.at]} (${hex(expBits[ds.at]!, 8)}), ` +
        `got ${scales[ds.at]} (${hex(gotBits[ds.at]!, 8)}) (seed ${seed})`,
    );
  }
  const dq = firstDifference(expected.q, q);
  if (dq !== null) {
    assert.fail(
      `${c.what} ${format}: ${dq.count} of ${q.length} e4m3 codes differ; first at token ${Math.floor(dq.at / c.hidden)}, ` +
        `channel ${dq.at % c.hidden}: bf16 y ${hex(y[dq.at]!, 4)}, scale ${expected.scales[Math.floor(dq.at / QUANT_BLOCK)]}, ` +
        `expected ${hex(expected.q[dq.at]!, 2)}, got ${hex(q[dq.at]!, 2)} (seed ${seed})`,
    );
  }
}

function plainCase(tokens: number, hidden: number): Case {
  return {
    what: `rmsnorm T=${tokens} H=${hidden}`,
    tokens,
    hidden,
    x: randomRows(tokens, hidden),
    weight: randomRows(1, hidden),
  };
}

function premixCase(tokens: number, hidden: number, n: number): Case {
  const mix = new Float32Array(tokens * n);
  for (let i = 0; i < mix.length; i++)
    mix[i] = Math.fround((random() * 2 - 0.5) * 2 ** Math.floor(random() * 5 - 2));
  return {
    what: `premix n=${n} + rmsnorm T=${tokens} H=${hidden}`,
    tokens,
    hidden,
    streams: { data: randomRows(tokens * n, hidden), mix, n },
    weight: randomRows(1, hidden),
  };
}

describeGpu("boundary kernel (RMSNorm, pre-mix, FP8) on a GPU", () => {
  test("CUDA is available", () => {
    assert.ok(availability.ok, availability.ok ? "" : availability.reason);
  });

  for (const hidden of HIDDENS) {
    test(`RMSNorm, H=${hidden}, T ∈ {${TOKENS.join(", ")}}: bf16 rows and FP8 (both formats) bit-exact`, () => {
      for (const tokens of TOKENS) {
        const c = plainCase(tokens, hidden);
        const expected = expectedOf(c);
        const both = runOnDevice(c, true, "fp32");
        assertRows(c, expected, both.y!);
        assertFp8(c, "fp32", expected, both.q!, both.scales!);
        const fp8Only = runOnDevice(c, false, "ue8m0");
        assertFp8(c, "ue8m0", expected, fp8Only.q!, fp8Only.scales!);
        const yOnly = runOnDevice(c, true, null);
        assertRows({ ...c, what: `${c.what} (bf16 only)` }, expected, yOnly.y!);
      }
    });

    test(`pre-mix (n = 1, 4) + RMSNorm, H=${hidden}: bf16 rows and FP8 bit-exact`, () => {
      for (const tokens of TOKENS) {
        for (const n of [1, 4]) {
          const c = premixCase(tokens, hidden, n);
          const expected = expectedOf(c);
          const got = runOnDevice(c, true, hidden === 4096 ? "ue8m0" : "fp32");
          assertRows(c, expected, got.y!);
          assertFp8(c, hidden === 4096 ? "ue8m0" : "fp32", expected, got.q!, got.scales!);
        }
      }
    });
  }

  test("FP8 rows equal quantizeOnDevice run on the kernel's own bf16 rows", () => {
    const d = testDevice();
    const c = plainCase(129, 7168);
    const fused = runOnDevice(c, true, "ue8m0");
    const y = DeviceTensor.fromHost(d, "bf16", [c.tokens, c.hidden], fused.y!);
    const out = allocQuantOutputs(d, c.tokens, c.hidden);
    try {
      quantizeOnDevice(d, y, out, "ue8m0", null);
      assertFp8(c, "ue8m0", fused.y!, out.q.toHost() as Uint8Array, out.scales.toHost() as Float32Array);
      assert.deepEqual(out.q.toHost(), fused.q, "codes differ from the quantization kernel's");
      assert.deepEqual(out.scales.toHost(), fused.scales, "scales differ from the quantization kernel's");
    } finally {
      y.dispose();
      out.q.dispose();
      out.scales.dispose();
    }
  });

  test("operand errors are named", () => {
    const d = testDevice();
    const x = DeviceTensor.empty(d, "bf16", [2, 256]);
    const w = DeviceTensor.empty(d, "bf16", [256]);
    const y = DeviceTensor.empty(d, "bf16", [2, 256]);
    const badW = DeviceTensor.empty(d, "bf16", [128]);
    const odd = DeviceTensor.empty(d, "bf16", [2, 200]);
    try {
      assert.throws(
        () => rmsNormOnDevice(d, { x }, badW, EPS, { y, fp8: null }, null),
        /weight must be bf16\[256\]/,
      );
      assert.throws(() => rmsNormOnDevice(d, { x: odd }, w, EPS, { y, fp8: null }, null), /multiple of 128/);
      assert.throws(() => rmsNormOnDevice(d, { x }, w, 0, { y, fp8: null }, null), /eps must be positive/);
      assert.throws(() => rmsNormOnDevice(d, { x }, w, EPS, { y: null, fp8: null }, null), /no output/);
      assert.throws(
        () => rmsNormOnDevice(d, { streams: x, mix: w }, w, EPS, { y, fp8: null }, null),
        /streams must be bf16\[tokens, n, hidden\]/,
      );
    } finally {
      for (const t of [x, w, y, badW, odd]) t.dispose();
    }
  });
});
