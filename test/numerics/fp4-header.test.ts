/**
 * src/include/common/fp4.cuh (the GPU kernels' FP4 → e4m3 conversion) against the TypeScript rule
 * (src/numerics/fp4.ts mxfp4RowsToFp8), byte for byte: the header is compiled for the host with g++
 * from test/fixtures/fp4_convert.cpp, and both its exact path and its fast path (prmt emulated on the
 * host; test/gpu/fp4-convert.test.ts runs the device instruction) convert the same blocks.
 *
 * Blocks: every scale byte 0..254 as the block maximum with spreads 0, 14, 15 and 30 below it (the
 * maximum in each group position; every code in every group), a spread sweep 0..254 at several
 * maxima, and seeded random blocks (bytes uniform over 0..254, and within windows of 0..20).
 *
 * Stages: test/fixtures/fp4_stage.cpp runs the converter threads' pass over whole stages
 * (fp4_stage_convert, as common/fp4_stage.cuh calls it on the device) into the swizzled tile, on
 * seeded random stages, against the exact path. test/fixtures/fp4_frag.cpp runs the fused kernel's
 * swap-AB register path (fp4_fragment_k128) for every thread of a warpgroup over 64B-swizzled stages
 * and checks each A register byte against that tile at the wgmma fragment position.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { type Mxfp4, mxfp4RowsToFp8 } from "../../src/numerics/fp4.js";
import { buildFixture, findCxx } from "../helpers/host-cxx.js";
import { rngU32, testSeed } from "../helpers/random.js";

const seed = testSeed("fp4-header");

const RECORD_IN = 69;
const RECORD_OUT = 264;

/** A batch of blocks: row i of a [rows, 128] MXFP4 matrix is block i. */
class Blocks {
  scales: number[] = [];
  packed: number[] = [];
  /** Per block the reference byte the header is handed (0xFF: the row's own largest). */
  refs: number[] = [];
  add(bytes: readonly number[], codes: (k: number) => number, ref = 0xff): void {
    this.scales.push(...bytes);
    for (let j = 0; j < 64; j++) this.packed.push(codes(2 * j) | (codes(2 * j + 1) << 4));
    this.refs.push(ref);
  }
  /** The references as mxfp4RowsToFp8 takes them: 0xFF made the row's own largest byte. */
  references(): Uint8Array {
    return Uint8Array.from(this.refs, (ref, r) =>
      ref === 0xff ? Math.max(...this.scales.slice(4 * r, 4 * r + 4)) : ref,
    );
  }
  get rows(): number {
    return this.scales.length / 4;
  }
  matrix(): Mxfp4 {
    return {
      packed: Uint8Array.from(this.packed),
      scales: Uint8Array.from(this.scales),
      rows: this.rows,
      cols: 128,
    };
  }
  input(): Uint8Array {
    const out = new Uint8Array(this.rows * RECORD_IN);
    for (let r = 0; r < this.rows; r++) {
      out.set(this.scales.slice(4 * r, 4 * r + 4), r * RECORD_IN);
      out.set(this.packed.slice(64 * r, 64 * r + 64), r * RECORD_IN + 4);
      out[r * RECORD_IN + 68] = this.refs[r];
    }
    return out;
  }
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

const cxx = findCxx();
const skip = cxx === null ? "no C++ compiler (g++, c++, clang++)" : false;

describe("fp4.cuh converts FP4 blocks as mxfp4RowsToFp8 does", { skip }, () => {
  let dir = "";
  let exe = "";

  before(() => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-fp4conv-"));
    exe = buildFixture(cxx!, dir, "fp4_convert");
  });

  after(() => {
    if (dir !== "") fs.rmSync(dir, { recursive: true, force: true });
  });

  const check = (blocks: Blocks) => {
    const r = spawnSync(exe, [], { input: blocks.input(), maxBuffer: 1 << 30 });
    if (r.status !== 0) throw new Error(`fp4conv failed (${r.status}): ${r.stderr}`);
    const out = new Uint8Array(r.stdout.buffer, r.stdout.byteOffset, r.stdout.byteLength);
    assert.equal(out.length, blocks.rows * RECORD_OUT);
    const want = mxfp4RowsToFp8(blocks.matrix(), 0, blocks.rows, "fp4-header", blocks.references());
    const bad: string[] = [];
    for (let row = 0; row < blocks.rows && bad.length < 20; row++) {
      const rec = out.subarray(row * RECORD_OUT, (row + 1) * RECORD_OUT);
      const bytes = blocks.scales.slice(4 * row, 4 * row + 4).join(",");
      f32[0] = want.scales[row];
      const scaleBits = u32[0];
      const dv = new DataView(rec.buffer, rec.byteOffset + 256, 8);
      for (const [what, at] of [
        ["exact", 0],
        ["fast", 4],
      ] as const) {
        const got = dv.getUint32(at, true);
        if (got !== scaleBits)
          bad.push(
            `block ${row} [${bytes}] ${what}: 2^ref 0x${got.toString(16)}, want 0x${scaleBits.toString(16)}`,
          );
      }
      for (let k = 0; k < 128 && bad.length < 20; k++) {
        const w = want.q[row * 128 + k];
        for (const [what, at] of [
          ["exact", 0],
          ["fast", 128],
        ] as const) {
          if (rec[at + k] !== w) {
            const code = (blocks.packed[row * 64 + (k >> 1)] >> (4 * (k & 1))) & 0xf;
            bad.push(
              `block ${row} [${bytes}] element ${k} (e2m1 ${code}) ${what}: 0x${rec[at + k].toString(16)}, want 0x${w.toString(16)}`,
            );
          }
        }
      }
    }
    assert.deepEqual(bad, [], bad.join("\n"));
  };

  it("every maximum byte 0..254 with spreads 0, 14, 15, 30, every code in every group", () => {
    const blocks = new Blocks();
    for (let max = 0; max <= 254; max++) {
      for (const spread of [0, 14, 15, 30]) {
        for (let at = 0; at < 4; at++) {
          const low = Math.max(0, max - spread);
          // The maximum in group `at`, the others at max − spread, one of them halfway.
          const bytes = [0, 1, 2, 3].map((g) =>
            g === at ? max : g === (at + 2) % 4 ? max - Math.floor((max - low) / 2) : low,
          );
          blocks.add(bytes, (k) => (k + max + at) & 15);
        }
      }
    }
    check(blocks);
  });

  it("spreads 0..254 at maxima 254, 200, 133, 127 and 20", () => {
    const blocks = new Blocks();
    for (const max of [254, 200, 133, 127, 20]) {
      for (let spread = 0; spread <= max; spread++) {
        blocks.add(
          [max - spread, max, max - spread, max - Math.min(spread, 7)],
          (k) => (k * 7 + spread) & 15,
        );
      }
    }
    check(blocks);
  });

  /** Builds test/fixtures/NAME.cpp against the device headers, runs it with the seed, expects "ok N". */
  const runFixture = (name: string) => {
    const exe = buildFixture(cxx!, dir, name);
    const r = spawnSync(exe, [String(seed >>> 0)], { encoding: "utf8" });
    assert.equal(r.status, 0, r.stdout + r.stderr);
    assert.match(r.stdout, /^ok \d+/);
  };

  it(`whole stages through fp4_stage_convert, every thread's share, swizzled (seed ${seed})`, () => {
    runFixture("fp4_stage");
  });

  it(`swap-AB A fragments through fp4_fragment_k128, every thread and register byte (seed ${seed})`, () => {
    runFixture("fp4_frag");
  });

  it("references above the row's own (a 128 × 128 block's): every maximum byte, 1 to 20 above", () => {
    const blocks = new Blocks();
    for (let max = 0; max <= 254; max++) {
      for (const above of [1, 2, 3, 8, 11, 12, 14, 15, 20]) {
        if (max + above > 254) continue;
        const bytes = [max, Math.max(0, max - 3), max, Math.max(0, max - 1)];
        blocks.add(bytes, (k) => (k * 5 + above) & 15, max + above);
      }
    }
    check(blocks);
  });

  it(`random blocks (seed ${seed})`, () => {
    const next = rngU32(seed);
    const blocks = new Blocks();
    for (let i = 0; i < 20_000; i++) {
      let bytes: number[];
      if (i % 2 === 0) {
        bytes = [0, 1, 2, 3].map(() => next() % 255);
      } else {
        const window = next() % 21;
        const base = next() % (255 - window);
        bytes = [0, 1, 2, 3].map(() => base + (next() % (window + 1)));
      }
      const codes = Array.from({ length: 128 }, () => next() & 15);
      // A third of the blocks take a reference above their own largest byte, as a 128 × 128 block's.
      const own = Math.max(...bytes);
      blocks.add(bytes, (k) => codes[k], i % 3 === 0 ? Math.min(254, own + (next() % 16)) : 0xff);
    }
    check(blocks);
  });
});
