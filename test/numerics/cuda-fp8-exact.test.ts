/**
 * Bit-exactness of the TypeScript codecs against CUDA's own conversions (cuda_fp8.h, cuda_bf16.h),
 * compiled for the host with nvcc from test/fixtures/fp8_reference.cu.
 *
 * Inputs: every e4m3/e5m2 value, the midpoints between neighbours, ±1 float32 ulp around all of those,
 * specials (±0, ±inf, NaNs, extremes), bf16 rounding ties, and a seeded random sweep of float32 bit
 * patterns (uniform, plus one concentrated on the exponents where fp8 has codes).
 * MEGAMOE_FP8_EXHAUSTIVE=1 additionally checks all 2^32 float32 patterns (minutes).
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { fileURLToPath } from "node:url";
import { bf16FromF32Array, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import {
  E4M3_DECODE,
  E5M2_DECODE,
  encodeE4m3,
  encodeE4m3Array,
  encodeE5m2,
  encodeE5m2Array,
} from "../../src/numerics/fp8.js";
import { rngU32, testSeed } from "../helpers/random.js";

const seed = testSeed("cuda-fp8-exact");

const RANDOM_UNIFORM = 1_000_000;
const RANDOM_FP8_BAND = 500_000;
const EXHAUSTIVE_CHUNK = 1 << 24;

function findNvcc(): string | null {
  const dirs = (process.env.PATH ?? "").split(path.delimiter).filter((d) => d !== "");
  if (process.env.CUDA_HOME) dirs.push(path.join(process.env.CUDA_HOME, "bin"));
  dirs.push("/usr/local/cuda/bin");
  for (const dir of dirs) {
    const candidate = path.join(dir, "nvcc");
    try {
      fs.accessSync(candidate, fs.constants.X_OK);
      return candidate;
    } catch {
      // not here
    }
  }
  return null;
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
function bitsOf(x: number): number {
  f32[0] = x;
  return u32[0];
}

/** Float32 bit patterns of the structured cases (see the file comment). */
function structuredInputs(): number[] {
  const out: number[] = [];
  const withNeighbours = (bits: number) => out.push(bits >>> 0, (bits + 1) >>> 0, (bits - 1) >>> 0);
  for (const table of [E4M3_DECODE, E5M2_DECODE]) {
    const values = [...new Set([...table].filter((v) => !Number.isNaN(v)))].sort((a, b) => a - b);
    for (const v of values) withNeighbours(bitsOf(v));
    for (let i = 0; i + 1 < values.length; i++) {
      const mid = (values[i] + values[i + 1]) / 2; // exact in float32: fp8 values have ≤ 4 significant bits
      if (Number.isFinite(mid)) withNeighbours(bitsOf(mid));
    }
  }
  // Around saturation (half an ulp past max, and well past it) and the underflow edges.
  for (const v of [464, 480, 512, 1e6, 61440, 65536, 1e30, 2 ** -10, 2 ** -17, 2 ** -6, 2 ** -14]) {
    withNeighbours(bitsOf(v));
    withNeighbours(bitsOf(-v));
  }
  const specials = [
    0x00000000, 0x80000000, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0xff800001,
    0x7fffffff, 0xffffffff, 0x7fbfffff, 0x7f7fffff, 0xff7fffff, 0x00000001, 0x80000001, 0x007fffff,
    0x00800000,
  ];
  out.push(...specials);
  // bf16 ties and near-ties at random high halves.
  const next = rngU32(seed ^ 0x0b16);
  for (let i = 0; i < 20000; i++) {
    const high = (next() & 0xffff) << 16;
    out.push((high | 0x8000) >>> 0, (high | 0x7fff) >>> 0, (high | 0x8001) >>> 0);
  }
  return out;
}

function randomInputs(): Uint32Array {
  const next = rngU32(seed);
  const bits = new Uint32Array(RANDOM_UNIFORM + RANDOM_FP8_BAND);
  for (let i = 0; i < RANDOM_UNIFORM; i++) bits[i] = next();
  // Exponent fields 100..145 cover both formats' subnormals, normals and saturation region.
  for (let i = RANDOM_UNIFORM; i < bits.length; i++) {
    const exp = 100 + (next() % 46);
    bits[i] = ((next() & 0x80000000) | (exp << 23) | (next() & 0x7fffff)) >>> 0;
  }
  return bits;
}

interface Mismatch {
  bits: number;
  what: string;
  cuda: number;
  ts: number;
}

/** Compares CUDA's records (e4m3, e5m2, bf16 lo, bf16 hi per input) with the bulk and scalar TS codecs. */
function compare(bits: Uint32Array, cuda: Uint8Array, scalarToo: boolean): Mismatch[] {
  assert.equal(cuda.length, bits.length * 4, "reference output length");
  const src = new Float32Array(bits.buffer, bits.byteOffset, bits.length);
  const e4 = new Uint8Array(bits.length);
  const e5 = new Uint8Array(bits.length);
  encodeE4m3Array(src, e4);
  encodeE5m2Array(src, e5);
  const b16 = bf16FromF32Array(src);
  const bad: Mismatch[] = [];
  const note = (i: number, what: string, want: number, got: number) => {
    if (want !== got && bad.length < 20) bad.push({ bits: bits[i], what, cuda: want, ts: got });
  };
  for (let i = 0; i < bits.length; i++) {
    const want4 = cuda[4 * i];
    const want5 = cuda[4 * i + 1];
    const want16 = cuda[4 * i + 2] | (cuda[4 * i + 3] << 8);
    if (e4[i] !== want4 || e5[i] !== want5 || b16[i] !== want16) {
      note(i, "e4m3 bulk", want4, e4[i]);
      note(i, "e5m2 bulk", want5, e5[i]);
      note(i, "bf16 bulk", want16, b16[i]);
    }
    if (scalarToo) {
      const x = src[i];
      note(i, "e4m3 scalar", want4, encodeE4m3(x));
      note(i, "e5m2 scalar", want5, encodeE5m2(x));
      note(i, "bf16 scalar", want16, f32ToBf16Bits(x));
    }
  }
  return bad;
}

function describeMismatches(bad: Mismatch[]): string {
  return bad
    .map(
      (m) =>
        `${m.what}: bits 0x${m.bits.toString(16).padStart(8, "0")} cuda 0x${m.cuda.toString(16)} ts 0x${m.ts.toString(16)}`,
    )
    .join("\n");
}

const nvcc = findNvcc();
const skip = nvcc === null ? "nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)" : false;

describe("TypeScript codecs match CUDA bit for bit", { skip }, () => {
  let dir = "";
  let exe = "";

  const runReference = (args: string[], input?: Uint32Array): Uint8Array => {
    const r = spawnSync(exe, args, {
      input: input === undefined ? undefined : Buffer.from(input.buffer, input.byteOffset, input.byteLength),
      maxBuffer: 1 << 30,
    });
    if (r.status !== 0) throw new Error(`fp8ref ${args.join(" ")} failed (${r.status}): ${r.stderr}`);
    return new Uint8Array(r.stdout.buffer, r.stdout.byteOffset, r.stdout.byteLength);
  };

  before(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
    exe = path.join(dir, "fp8ref");
    const source = fileURLToPath(new URL("../fixtures/fp8_reference.cu", import.meta.url));
    const r = spawnSync(nvcc!, ["-std=c++17", "-o", exe, source], { encoding: "utf8" });
    if (r.status !== 0) throw new Error(`nvcc failed (${r.status}):\n${r.stderr}`);
  });

  after(() => {
    if (dir !== "") fs.rmSync(dir, { recursive: true, force: true });
  });

  it("decode tables equal CUDA's fp8 → half → float", () => {
    const out = runReference(["decode"]);
    const cuda = new Float32Array(out.slice().buffer);
    for (let code = 0; code < 256; code++) {
      for (const [name, table, offset] of [
        ["e4m3", E4M3_DECODE, 0],
        ["e5m2", E5M2_DECODE, 256],
      ] as const) {
        const want = cuda[offset + code];
        const got = table[code];
        assert.ok(
          Object.is(want, got) || (Number.isNaN(want) && Number.isNaN(got)),
          `${name} ${code}: ${want} vs ${got}`,
        );
      }
    }
  });

  it("structured inputs: fp8 values, midpoints, neighbours, specials, bf16 ties", () => {
    const bits = Uint32Array.from(structuredInputs());
    const bad = compare(bits, runReference(["encode"], bits), true);
    assert.equal(bad.length, 0, `${bits.length} inputs, mismatches:\n${describeMismatches(bad)}`);
  });

  it(`random sweep of ${RANDOM_UNIFORM + RANDOM_FP8_BAND} float32 bit patterns (seed ${seed})`, () => {
    const bits = randomInputs();
    const bad = compare(bits, runReference(["encode"], bits), true);
    assert.equal(bad.length, 0, `seed ${seed}, mismatches:\n${describeMismatches(bad)}`);
  });

  it("all 2^32 float32 bit patterns", {
    skip: process.env.MEGAMOE_FP8_EXHAUSTIVE === "1" ? false : "set MEGAMOE_FP8_EXHAUSTIVE=1 (takes minutes)",
  }, () => {
    const bits = new Uint32Array(EXHAUSTIVE_CHUNK);
    for (let start = 0; start < 2 ** 32; start += EXHAUSTIVE_CHUNK) {
      for (let i = 0; i < EXHAUSTIVE_CHUNK; i++) bits[i] = start + i;
      const bad = compare(bits, runReference(["range", String(start), String(EXHAUSTIVE_CHUNK)]), false);
      assert.equal(bad.length, 0, `chunk at 0x${start.toString(16)}:\n${describeMismatches(bad)}`);
    }
  });
});
