/**
 * Bit-exactness of the FP4 codecs (src/numerics/fp4.ts) against CUDA's own conversions, compiled for the
 * host with g++ (or nvcc) from test/fixtures/fp4_reference.cpp: e2m1 encode/decode (cuda_fp4.h) and
 * UE8M0 encode (both roundings) / decode (cuda_fp8.h).
 *
 * Inputs: every e2m1 value and power of two, midpoints between e2m1 neighbours scaled by every power of
 * two the scale range reaches, ±1 float32 ulp around all of those, specials, and a seeded random sweep
 * of float32 bit patterns (uniform, plus one concentrated on e2m1's exponents).
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { decodeE8m0, E2M1_DECODE, encodeE2m1, encodeE8m0 } from "../../src/numerics/fp4.js";
import { buildFixture, findCxx } from "../helpers/host-cxx.js";
import { rngU32, testSeed } from "../helpers/random.js";

const seed = testSeed("cuda-fp4-exact");

/** The host compiler and the CUDA include folder holding cuda_fp4.h, or null without either. */
function findCompiler(): { cxx: string; include: string } | null {
  const roots = [process.env.CUDA_HOME, "/usr/local/cuda", "/usr/local/cuda-13.0"].filter(
    (d): d is string => d !== undefined && d !== "",
  );
  const include = roots
    .map((r) => path.join(r, "include"))
    .find((d) => fs.existsSync(path.join(d, "cuda_fp4.h")));
  const cxx = include === undefined ? null : findCxx();
  return include === undefined || cxx === null ? null : { cxx, include };
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
function bitsOf(x: number): number {
  f32[0] = x;
  return u32[0];
}

function structuredInputs(): number[] {
  const out: number[] = [];
  const withNeighbours = (x: number) => {
    for (const s of [1, -1]) {
      const b = bitsOf(s * x);
      out.push(b >>> 0, (b + 1) >>> 0, (b - 1) >>> 0);
    }
  };
  const grid = [0, 0.5, 1, 1.5, 2, 3, 4, 6];
  for (const v of grid) withNeighbours(v);
  for (let i = 0; i + 1 < grid.length; i++) withNeighbours((grid[i] + grid[i + 1]) / 2);
  for (const v of [0.25, 6.5, 7, 8, 1e30]) withNeighbours(v);
  // Powers of two and 1.5× them over float32's whole range: UE8M0's rounding edges.
  for (let e = -149; e <= 127; e++) {
    withNeighbours(2 ** e);
    if (e < 127) withNeighbours(1.5 * 2 ** e);
  }
  out.push(0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0xffffffff, 0x7f7fffff, 0x00000001);
  out.push(0x00400000, 0x00400001, 0x003fffff, 0x00000000, 0x80000000);
  return out;
}

function randomInputs(n: number): Uint32Array {
  const next = rngU32(seed);
  const bits = new Uint32Array(2 * n);
  for (let i = 0; i < n; i++) bits[i] = next();
  for (let i = n; i < 2 * n; i++) {
    const exp = 120 + (next() % 16); // 2^-7 .. 2^8: e2m1's subnormal, normal and saturation region
    bits[i] = ((next() & 0x80000000) | (exp << 23) | (next() & 0x7fffff)) >>> 0;
  }
  return bits;
}

const compiler = findCompiler();
const skip = compiler === null ? "no C++ compiler or CUDA headers with cuda_fp4.h" : false;

describe("FP4 codecs match CUDA bit for bit", { skip }, () => {
  let dir = "";
  let exe = "";
  const run = (arg: string, input?: Uint32Array): Uint8Array => {
    const r = spawnSync(exe, [arg], {
      input: input === undefined ? undefined : Buffer.from(input.buffer, input.byteOffset, input.byteLength),
      maxBuffer: 1 << 28,
    });
    if (r.status !== 0) throw new Error(`fp4ref ${arg} failed (${r.status}): ${r.stderr}`);
    return new Uint8Array(r.stdout.buffer, r.stdout.byteOffset, r.stdout.byteLength);
  };

  before(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-fp4-"));
    const { cxx, include } = compiler!;
    exe = buildFixture(cxx, dir, "fp4_reference", [`-I${include}`]);
  });

  after(() => {
    if (dir !== "") fs.rmSync(dir, { recursive: true, force: true });
  });

  it("decode: every e2m1 code and every UE8M0 byte", () => {
    const out = run("decode").slice();
    const values = new Float32Array(out.buffer, 0, 16);
    for (let c = 0; c < 16; c++) assert.ok(Object.is(values[c], E2M1_DECODE[c]), `e2m1 ${c}: ${values[c]}`);
    const bf16 = new Uint16Array(out.buffer, 64, 256);
    for (let b = 0; b < 256; b++) {
      u32[0] = bf16[b] << 16;
      if (b === 0xff) {
        assert.ok(Number.isNaN(f32[0]), "0xFF is NaN in CUDA");
        assert.throws(() => decodeE8m0(b, "test scale"), /test scale: UE8M0 byte 0xFF is NaN/);
      } else {
        assert.equal(decodeE8m0(b), f32[0], `e8m0 ${b}`);
      }
    }
  });

  const check = (bits: Uint32Array) => {
    const cuda = run("encode", bits);
    assert.equal(cuda.length, 3 * bits.length);
    const bad: string[] = [];
    for (let i = 0; i < bits.length && bad.length < 20; i++) {
      u32[0] = bits[i];
      const x = f32[0];
      const got = [encodeE2m1(x), encodeE8m0(x, "zero"), encodeE8m0(x, "up")];
      for (let k = 0; k < 3; k++) {
        if (got[k] !== cuda[3 * i + k]) {
          bad.push(
            `${["e2m1", "e8m0 rz", "e8m0 rp"][k]} of 0x${bits[i].toString(16)}: cuda ${cuda[3 * i + k]}, ts ${got[k]}`,
          );
        }
      }
    }
    assert.equal(bad.length, 0, bad.join("\n"));
  };

  it("encode: structured inputs (values, midpoints, powers of two, neighbours, specials)", () => {
    check(Uint32Array.from(structuredInputs()));
  });

  it(`encode: 1,000,000 random float32 bit patterns (seed ${seed})`, () => {
    check(randomInputs(500_000));
  });
});
