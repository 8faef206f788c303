/**
 * fmaF32 (src/numerics/fp32.ts, the GEMM rules' promotion step) against C's fmaf, bit for bit: the
 * fixture test/fixtures/fmaf_reference.cpp is compiled with g++ and computes the same triples.
 *
 * Triples: seeded random fp32 bit patterns (uniform, and with exponents close enough that the terms
 * interact), the double-rounding cases (a·b + c whose double sum lands exactly on the midpoint of two
 * fp32 neighbours, the exact sum a little below or above it, at every binade including subnormal results
 * and the overflow threshold), exact cancellation, signed zeros, infinities and NaN.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { F32_MAX, fmaF32 } from "../../src/numerics/fp32.js";
import { buildFixture, findCxx } from "../helpers/host-cxx.js";
import { rngU32, testSeed } from "../helpers/random.js";

const seed = testSeed("fp32");

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
const bitsOf = (x: number): number => {
  f32[0] = x;
  return u32[0];
};
const fromBits = (b: number): number => {
  u32[0] = b >>> 0;
  return f32[0];
};

const cxx = findCxx();
const skip = cxx === null ? "no C++ compiler (g++, c++, clang++)" : false;

describe("fmaF32 rounds as C's fmaf", { skip }, () => {
  let dir = "";
  let exe = "";

  before(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-fmaf-"));
    // -ffp-contract=off: fmaf itself is the operation under test, nothing else fused.
    exe = buildFixture(cxx!, dir, "fmaf_reference", ["-ffp-contract=off"]);
  });

  after(() => {
    if (dir !== "") fs.rmSync(dir, { recursive: true, force: true });
  });

  /** Runs the triples (rounded to fp32 first) through fmaf and fmaF32; lists the first disagreements. */
  const check = (given: number[][]) => {
    const triples = given.map((t) => t.map(Math.fround));
    const input = new Uint8Array(12 * triples.length);
    const dv = new DataView(input.buffer);
    triples.forEach(([a, b, c], i) => {
      dv.setUint32(12 * i, bitsOf(a!), true);
      dv.setUint32(12 * i + 4, bitsOf(b!), true);
      dv.setUint32(12 * i + 8, bitsOf(c!), true);
    });
    const r = spawnSync(exe, [], { input, maxBuffer: 1 << 30 });
    if (r.status !== 0) throw new Error(`fmaf_ref failed (${r.status}): ${r.stderr}`);
    assert.equal(r.stdout.byteLength, 4 * triples.length);
    const out = new DataView(r.stdout.buffer, r.stdout.byteOffset, r.stdout.byteLength);
    const bad: string[] = [];
    for (let i = 0; i < triples.length && bad.length < 10; i++) {
      const [a, b, c] = triples[i]!;
      const want = out.getUint32(4 * i, true);
      const got = bitsOf(fmaF32(a!, b!, c!));
      // Every NaN is a NaN (the payload is not part of the rule).
      if (got !== want && !(Number.isNaN(fromBits(got)) && Number.isNaN(fromBits(want)))) {
        bad.push(`fmaf(${a}, ${b}, ${c}): got 0x${got.toString(16)}, want 0x${want.toString(16)}`);
      }
    }
    assert.deepEqual(bad, [], bad.join("\n"));
  };

  it("seeded random triples: uniform bit patterns and nearby exponents", () => {
    const next = rngU32(seed);
    const triples: number[][] = [];
    for (let i = 0; i < 200_000; i++) {
      triples.push([fromBits(next()), fromBits(next()), fromBits(next())]);
    }
    // a·b and c within a few binades of each other, as in a promotion (partial · scale + acc).
    for (let i = 0; i < 400_000; i++) {
      const ea = 127 + ((next() % 60) - 30);
      const eb = 127 + ((next() % 60) - 30);
      const ec = ea + eb - 127 + ((next() % 50) - 25);
      const mant = () => next() & 0x7fffff;
      const sign = () => (next() & 1) << 31;
      triples.push([
        fromBits(sign() | (ea << 23) | mant()),
        fromBits(sign() | (eb << 23) | mant()),
        fromBits(sign() | (Math.min(Math.max(ec, 0), 254) << 23) | mant()),
      ]);
    }
    check(triples);
  });

  it("double sums on an fp32 midpoint, the exact sum below or above it, in every binade", () => {
    const next = rngU32(seed ^ 0x5bd1e995);
    const triples: number[][] = [];
    const k = 2 ** -15;
    for (let e = 1; e <= 254; e++) {
      for (let i = 0; i < 8; i++) {
        // r in binade e (a normal fp32), u its ulp; c = r and a·b = ±u/2 · (1 − 2^-30): the exact sum is
        // 2^-31 u from the midpoint, which its double sum lands on.
        const r = fromBits((e << 23) | (next() & 0x7fffff) | ((next() & 1) << 31));
        const u = Math.abs(fromBits(bitsOf(r) + 1) - r) || 2 ** -149;
        const half = u / 2;
        if (!Number.isFinite(half * (1 + k))) continue;
        for (const s of [1, -1]) {
          triples.push([s * half * (1 + k), 1 - k, r]);
          triples.push([s * half * (1 - k), 1 + k, r]);
          triples.push([s * half, 1 + 2 ** -23, r]);
          triples.push([s * half, 1, r]);
        }
      }
    }
    // Subnormal results: c a subnormal fp32, a·b a quarter or half of its spacing, nudged.
    for (let i = 0; i < 2000; i++) {
      const c = fromBits((next() & 0x7fffff) | ((next() & 1) << 31));
      for (const s of [1, -1])
        for (const q of [0.5, 0.25, 0.75]) triples.push([s * q * 2 ** -149 * (1 + k), 1 - k, c]);
    }
    // The overflow threshold: F32_MAX + 2^103 is where fp32 rounding reaches inf.
    for (const s of [1, -1]) {
      triples.push([s * 2 ** 103 * (1 + k), 1 - k, s * F32_MAX]);
      triples.push([s * 2 ** 103 * (1 - k), 1 + k, s * F32_MAX]);
      triples.push([s * 2 ** 103, 1, s * F32_MAX]);
      triples.push([s * 2 ** 102, 1, s * F32_MAX]);
      triples.push([s * 2 ** 104, 1, s * F32_MAX]);
    }
    check(triples);
  });

  it("cancellation, signed zeros, infinities and NaN", () => {
    const inf = Number.POSITIVE_INFINITY;
    const x = fromBits(0x3fc00001);
    check([
      [x, x, -Math.fround(x * x)],
      [x, -x, Math.fround(x * x)],
      [0, 0, 0],
      [-0, 0, 0],
      [-0, 0, -0],
      [0, -0, -0],
      [1, 1, -1],
      [-1, 1, 1],
      [inf, 0, 1],
      [inf, 1, -inf],
      [inf, 1, 1],
      [1, 1, -inf],
      [Number.NaN, 1, 1],
      [1, 1, Number.NaN],
      [F32_MAX, 2, -F32_MAX],
      [F32_MAX, F32_MAX, 0],
      [2 ** -149, 2 ** -149, 0],
      [2 ** -149, -(2 ** -149), -0],
      [2 ** -75, 2 ** -75, 2 ** -149],
    ]);
  });
});
