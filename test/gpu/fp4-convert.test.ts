/**
 * The device build of common/fp4.cuh (src/kernels/fp4/fp4_convert.cu, both paths) against the CPU
 * rule `mxfp4RowsToFp8`, byte for byte: e4m3 codes and the fp32 2^ref per row and K block, on every
 * maximum scale byte 0..254 with spreads 0, 14, 15 and 30, every code in every group, and seeded random
 * rows, and 128 × 128 blocks of rows with differing bytes, some spanning more than 14 (the words'
 * load-time pass on the device against fp4GemmScaleWords). The fast path's `prmt` is the one thing the host test (test/numerics/fp4-header.test.ts) can
 * only emulate. Outputs are poisoned first, so an element never written is caught. The device layout
 * step (stored → the FP4 kernels' layout, in place, matrix by matrix) against `mxfp4DeviceLayout`, and
 * with bad shapes refused.
 *
 * GPU tests skip with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 */
import assert from "node:assert/strict";
import { test } from "node:test";
import { DeviceTensor } from "../../src/cuda/index.js";
import {
  convertFp4ToFp8,
  FP4_CONVERT_KERNELS,
  fp4ReferenceWordsOnDevice,
  orderFp4PackedOnDevice,
  writeFp4LayoutOnDevice,
} from "../../src/kernels/fp4/fp4_convert.js";
import { fp4GemmScaleWords } from "../../src/kernels/gemm/fp4_grouped_gemm.js";
import {
  fp4BlocksExact,
  type Mxfp4,
  mxfp4DeviceLayout,
  mxfp4ReferenceWords,
  mxfp4RowsToFp8,
} from "../../src/numerics/fp4.js";
import { availability, describeGpu, testDevice } from "../helpers/gpu.js";
import { rngU32, testSeed } from "../helpers/random.js";

const seed = testSeed("fp4-convert");

/** Rows of K = 512 (four K blocks): each block's bytes from `blockBytes`, codes from `code`. */
function makeMatrix(
  rows: number,
  blockBytes: (row: number, kb: number) => number[],
  code: (row: number, k: number) => number,
): Mxfp4 {
  const k = 512;
  const scales = new Uint8Array((rows * k) / 32);
  const packed = new Uint8Array((rows * k) / 2);
  for (let r = 0; r < rows; r++) {
    for (let kb = 0; kb < 4; kb++) scales.set(blockBytes(r, kb), r * 16 + kb * 4);
    for (let j = 0; j < k / 2; j++) packed[r * 256 + j] = code(r, 2 * j) | (code(r, 2 * j + 1) << 4);
  }
  return { packed, scales, rows, cols: k };
}

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);
const bitsOf = (x: number) => {
  f32[0] = x;
  return u32[0];
};

/**
 * Both conversion paths against the rule. The kernels read each row's K blocks as reference words: the
 * rule's (its 128 × 128 block's reference), or with `rowsAlone` each row's own largest byte (the rule on
 * the row as a matrix of its own), so that every maximum byte is converted exactly where it can be.
 */
function runBoth(m: Mxfp4, rowsAlone = false): string[] {
  const d = testDevice();
  const kBlocks = m.cols / 128;
  const words = rowsAlone ? new Uint32Array(m.rows * kBlocks) : mxfp4ReferenceWords(m.scales, m.rows, m.cols);
  if (rowsAlone) {
    const perRow = m.cols / 32;
    for (let r = 0; r < m.rows; r++) {
      words.set(mxfp4ReferenceWords(m.scales.subarray(r * perRow, (r + 1) * perRow), 1, m.cols), r * kBlocks);
    }
  }
  const refs = rowsAlone ? Uint8Array.from(words, (w) => w & 0xff) : undefined;
  const want = mxfp4RowsToFp8(m, 0, m.rows, "fp4-convert", refs);
  const made: DeviceTensor[] = [];
  const keep = <T extends DeviceTensor>(t: T) => {
    made.push(t);
    return t;
  };
  const bad: string[] = [];
  try {
    const packed = keep(DeviceTensor.fromHost(d, "uint8", [m.rows, m.cols / 2], m.packed));
    const wordBytes = new Uint8Array(words.buffer, words.byteOffset, words.byteLength);
    const wordsOnDevice = keep(DeviceTensor.fromHost(d, "uint8", [m.rows, m.cols / 32], wordBytes));
    const q = keep(DeviceTensor.empty(d, "uint8", [m.rows, m.cols]));
    const sw = keep(DeviceTensor.empty(d, "fp32", [m.rows, m.cols / 128]));
    for (const path of Object.keys(FP4_CONVERT_KERNELS) as (keyof typeof FP4_CONVERT_KERNELS)[]) {
      q.fill(0xff); // 0xFF is e4m3 NaN: never a result of the conversion
      sw.fill(0xff);
      convertFp4ToFp8(d, { packed, words: wordsOnDevice, q, sw, rows: m.rows, k: m.cols }, null, path);
      const gotQ = q.toHost() as Uint8Array;
      const gotS = sw.toHost() as Float32Array;
      for (let i = 0; i < gotS.length && bad.length < 20; i++) {
        if (bitsOf(gotS[i]) !== bitsOf(want.scales[i])) {
          bad.push(
            `${path}: block ${i} [${[...m.scales.subarray(4 * i, 4 * i + 4)]}] sw ${gotS[i]}, want ${want.scales[i]}`,
          );
        }
      }
      for (let i = 0; i < gotQ.length && bad.length < 20; i++) {
        if (gotQ[i] !== want.q[i]) {
          const block = Math.floor(i / 128);
          const codeAt = (m.packed[i >> 1] >> (4 * (i & 1))) & 15;
          bad.push(
            `${path}: row ${Math.floor(i / m.cols)} k ${i % m.cols} [${[...m.scales.subarray(4 * block, 4 * block + 4)]}] e2m1 ${codeAt}: 0x${gotQ[i].toString(16)}, want 0x${want.q[i].toString(16)}`,
          );
        }
      }
    }
  } finally {
    for (const t of made) t.dispose();
  }
  return bad;
}

describeGpu("FP4 → e4m3 conversion on a GPU", () => {
  test("CUDA is available", () => {
    assert.ok(availability.ok, availability.ok ? "" : availability.reason);
  });

  test("every maximum byte 0..254, spreads 0, 14, 15, 30 (the maximum in each group), every code", () => {
    const spreads = [0, 14, 15, 30];
    // Row = max byte; K block kb = spread kb; the maximum sits in group (max + kb) % 4.
    const m = makeMatrix(
      255,
      (max, kb) => {
        const low = Math.max(0, max - spreads[kb]);
        const at = (max + kb) % 4;
        return [0, 1, 2, 3].map((g) => (g === at ? max : g === (at + 2) % 4 ? (max + low) >> 1 : low));
      },
      (r, k) => (k + r) & 15,
    );
    const bad = runBoth(m, true);
    assert.deepEqual(bad, [], bad.join("\n"));
  });

  test(`random rows: bytes over 0..254 and in narrow windows (seed ${seed})`, () => {
    const next = rngU32(seed);
    const m = makeMatrix(
      4096,
      (r) => {
        if (r % 2 === 0) return [0, 1, 2, 3].map(() => next() % 255);
        const window = next() % 21;
        const base = next() % (255 - window);
        return [0, 1, 2, 3].map(() => base + (next() % (window + 1)));
      },
      () => next() & 15,
    );
    for (const rowsAlone of [true, false]) {
      const bad = runBoth(m, rowsAlone);
      assert.deepEqual(bad, [], `${rowsAlone ? "each row alone" : "the rule"}: ${bad.join("\n")}`);
    }
  });

  test(`reference words on the device, as fp4GemmScaleWords; converted as the rule (seed ${seed})`, () => {
    const d = testDevice();
    const next = rngU32(seed ^ 0x3c3c);
    // 300 rows (blocks of 128, 128, 44), K = 512: per block row a base byte; some blocks within 14 of it,
    // some with one row's group 15 or more below (rounded under the block's reference).
    const bases = [100, 180, 20];
    const wide = new Set([1, 6, 9]); // block row · 4 + K block
    const m = makeMatrix(
      300,
      (r, kb) => {
        const b = Math.floor(r / 128);
        const base = bases[b]! - kb;
        const drop = wide.has(4 * b + kb) && r % 37 === 5 ? 15 + (next() % 10) : next() % 15;
        return [0, 1, 2, 3].map((g) => Math.max(0, g === 0 ? base - drop : base - (next() % 3)));
      },
      () => next() & 15,
    );
    assert.ok(!fp4BlocksExact(m.scales, 300, 512), "some blocks span more than 14");
    const bad = runBoth(m);
    assert.deepEqual(bad, [], bad.join("\n"));
    // Two such matrices as rows 50 .. 650 of a 700-row words tensor, the UE8M0 bytes as the GPU generator
    // writes them (row n's four bytes of K block b at (b, 4n)); rows outside stay as they were.
    const total = 700;
    const raw = new Uint8Array(4 * total * 4).fill(0x5a);
    const want = raw.slice();
    const encoded = fp4GemmScaleWords(m.scales, 300, 512);
    for (let kb = 0; kb < 4; kb++) {
      for (const first of [50, 350]) {
        for (let n = 0; n < 300; n++) {
          raw.set(m.scales.subarray(n * 16 + 4 * kb, n * 16 + 4 * kb + 4), (kb * total + first + n) * 4);
          want.set(
            encoded.subarray((kb * 300 + n) * 4, (kb * 300 + n + 1) * 4),
            (kb * total + first + n) * 4,
          );
        }
      }
    }
    const words = DeviceTensor.fromHost(d, "uint8", [4, total * 4], raw);
    try {
      fp4ReferenceWordsOnDevice(d, words, 50, 600, 300, null);
      d.nullStream.synchronize();
      const got = words.toHost() as Uint8Array;
      const firstBad = got.findIndex((v, i) => v !== want[i]);
      assert.equal(
        firstBad,
        -1,
        `byte ${firstBad} (K block ${Math.floor(firstBad / (4 * total))}, row ${Math.floor((firstBad % (4 * total)) / 4)})`,
      );
      assert.throws(
        () => fp4ReferenceWordsOnDevice(d, words, 50, 600, 280, null),
        /whole matrices of 280 rows/,
      );
      assert.throws(() => fp4ReferenceWordsOnDevice(d, words, 200, 600, 300, null), /not within the 700/);
    } finally {
      words.dispose();
    }
  });

  test(`the device layout, in place and by rows, against mxfp4DeviceLayout; bad shapes refused (seed ${seed})`, () => {
    const d = testDevice();
    const next = rngU32(seed ^ 0x5a5a);
    // Three matrices of 40 rows, K = 384: in place, then matrix 1 written again by rows from a copy.
    const [matrices, rows, k] = [3, 40, 384];
    const bytes = new Uint8Array((matrices * rows * k) / 2);
    for (let i = 0; i < bytes.length; i++) bytes[i] = next() & 0xff;
    const want = mxfp4DeviceLayout(bytes, k);
    const t = DeviceTensor.fromHost(d, "uint8", [matrices, rows, k / 2], bytes);
    const one = DeviceTensor.fromHost(d, "uint8", [rows, k / 2], bytes.subarray((rows * k) / 2, rows * k));
    const expect = (what: string, got: Uint8Array) => {
      const first = got.findIndex((b, i) => b !== want[i]);
      assert.equal(
        first,
        -1,
        `${what}: byte ${first}: 0x${got[first]?.toString(16)}, want 0x${want[first]?.toString(16)}`,
      );
    };
    try {
      orderFp4PackedOnDevice(d, t, null);
      expect("in place", t.toHost() as Uint8Array);
      // Poison matrix 1's blocks, then write its rows from the stored copy.
      for (let kb = 0; kb < k / 128; kb++) t.view([rows * 64], (kb * matrices * rows + rows) * 64).fill(0xff);
      writeFp4LayoutOnDevice(d, t, rows, one, null);
      expect("by rows", t.toHost() as Uint8Array);
      assert.throws(
        () => orderFp4PackedOnDevice(d, t.view([matrices * rows * (k / 2)]), null),
        /\[R, K\/2\] or \[G, N, K\/2\]/,
      );
      assert.throws(
        () => orderFp4PackedOnDevice(d, t.view([matrices * rows, 96]), null),
        /K a positive multiple of 128/,
      );
      assert.throws(() => writeFp4LayoutOnDevice(d, t, 2 * rows + 1, one, null), /not within dst's 120/);
    } finally {
      t.dispose();
      one.dispose();
    }
  });
});
