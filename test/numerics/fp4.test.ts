import assert from "node:assert/strict";
import { describe, it } from "node:test";
import {
  countFp4ToFp8Inexact,
  dequantizeMxfp4,
  E2M1_DECODE,
  e2m1At,
  encodeE2m1,
  FP4_EXACT_FLAG,
  FP4_TO_FP8_EXACT_SPREAD,
  fp4BlockReferences,
  fp4BlocksExact,
  fp4ReferenceBytes,
  type Mxfp4,
  mxfp4DeviceLayout,
  mxfp4DeviceOrder,
  mxfp4ReferenceWords,
  mxfp4RowsToFp8,
  mxfp4ScaleByte,
  mxfp4StoredLayout,
  mxfp4StoredOrder,
  mxfp4ToFp8Blocks,
  packE2m1,
  quantizeMxfp4,
  unpackE2m1,
} from "../../src/numerics/fp4.js";
import { E4M3_DECODE } from "../../src/numerics/fp8.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("fp4");

describe("e2m1 packing", () => {
  it("puts element 2j in the low nibble and round-trips every pair", () => {
    assert.deepEqual(packE2m1(Uint8Array.from([0x1, 0x2])), Uint8Array.from([0x21]));
    const codes = new Uint8Array(512);
    for (let i = 0; i < 256; i++) {
      codes[2 * i] = i & 0xf;
      codes[2 * i + 1] = i >> 4;
    }
    const packed = packE2m1(codes);
    assert.deepEqual(
      packed,
      Uint8Array.from({ length: 256 }, (_, i) => i),
    );
    assert.deepEqual(unpackE2m1(packed), codes);
    for (let i = 0; i < 512; i++) assert.equal(e2m1At(packed, i), codes[i]);
    assert.throws(() => packE2m1(Uint8Array.from([16, 0])), /exceeds 15/);
  });
});

describe("the device order of packed rows", () => {
  it("gives word (q, s) of each K block elements 32s + 4q + v and + 16, bits as docs/numerics.md states", () => {
    const r = rng(seed ^ 0x0d0e);
    const stored = Uint8Array.from({ length: 64 * 40 }, () => Math.floor(r() * 256));
    const device = mxfp4DeviceOrder(stored);
    const words = new DataView(device.buffer);
    for (let e = 0; e < stored.length * 2; e++) {
      const base = Math.floor(e / 128) * 64;
      const k = e % 128;
      const s = Math.floor(k / 32);
      const high = k % 32 >= 16;
      const q = Math.floor((k % 16) / 4);
      const v = k % 4;
      const w = words.getUint32(base + 16 * q + 4 * s, true);
      const mag = (w >>> (high ? 16 + 4 * v : 4 * v)) & 7;
      const sign = (w >>> (high ? 8 * v + 3 : 8 * v + 7)) & 1;
      assert.equal((sign << 3) | mag, e2m1At(stored, e), `element ${e}`);
    }
    assert.deepEqual(mxfp4StoredOrder(device), stored);
  });

  it("refuses bytes that are not whole 128-element K blocks", () => {
    assert.throws(() => mxfp4DeviceOrder(new Uint8Array(96)), /not whole 128-element K blocks/);
    assert.throws(() => mxfp4StoredOrder(new Uint8Array(32)), /not whole 128-element K blocks/);
  });
});

describe("the device layout of packed rows", () => {
  it("puts K block b of row n at 64-byte block b·rows + n, in the device order, quarters swizzled", () => {
    const r = rng(seed ^ 0x1a70);
    const [rows, k] = [7, 384];
    const stored = Uint8Array.from({ length: (rows * k) / 2 }, () => Math.floor(r() * 256));
    const device = mxfp4DeviceLayout(stored, k);
    const ordered = mxfp4DeviceOrder(stored);
    for (let n = 0; n < rows; n++)
      for (let b = 0; b < k / 128; b++) {
        for (let q = 0; q < 4; q++) {
          const from = (n * (k / 128) + b) * 64 + 16 * q;
          const to = (b * rows + n) * 64 + 16 * (q ^ ((n >> 1) & 3));
          assert.deepEqual(
            device.subarray(to, to + 16),
            ordered.subarray(from, from + 16),
            `n${n} b${b} q${q}`,
          );
        }
      }
    assert.deepEqual(mxfp4StoredLayout(device, k), stored);
    // One row: the device order alone (row 0's quarters stay in place).
    const row = stored.subarray(0, k / 2);
    assert.deepEqual(mxfp4DeviceLayout(row, k), mxfp4DeviceOrder(row));
  });

  it("refuses bytes that are not whole rows, and a bad K", () => {
    assert.throws(() => mxfp4DeviceLayout(new Uint8Array(64 * 5), 256), /not whole rows of 128/);
    assert.throws(() => mxfp4StoredLayout(new Uint8Array(64), 96), /multiple of 128/);
  });
});

describe("MXFP4 quantization", () => {
  it("picks the smallest power of two mapping amax to ≤ 6, and rounds each element to nearest even", () => {
    const next = rng(seed);
    const rows = 8;
    const cols = 256;
    const w = new Float32Array(rows * cols);
    for (let i = 0; i < w.length; i++) w[i] = (next() - 0.5) * 2 ** Math.floor(next() * 40 - 20);
    w.fill(0, 0, 32); // an all-zero group gets the floor scale 2^-126
    const m = quantizeMxfp4(w, rows, cols);
    assert.equal(m.scales[0], 1);
    for (let g = 1; g < m.scales.length; g++) {
      const group = w.subarray(g * 32, g * 32 + 32);
      const amax = Math.max(...Array.from(group, Math.abs));
      const s = 2 ** (m.scales[g] - 127);
      assert.ok(amax / s <= 6 && amax / s > 3, `group ${g}: amax ${amax}, scale ${s}`);
      for (let j = 0; j < 32; j++) {
        const code = e2m1At(m.packed, g * 32 + j);
        assert.equal(code, encodeE2m1(group[j] / s));
        // Nearest: no other code is strictly closer.
        const err = Math.abs(E2M1_DECODE[code] - group[j] / s);
        for (const v of E2M1_DECODE) assert.ok(Math.abs(v - group[j] / s) >= err);
      }
    }
    const exact = dequantizeMxfp4(m);
    for (let i = 0; i < w.length; i++) {
      assert.equal(exact[i], E2M1_DECODE[e2m1At(m.packed, i)] * 2 ** (m.scales[i >> 5] - 127));
    }
    // Into a caller's buffer: the same values in its front, the rest untouched; too small is an error.
    const buffer = new Float64Array(w.length + 3).fill(7);
    assert.deepEqual(dequantizeMxfp4(m, "w", buffer), exact);
    assert.deepEqual(Array.from(buffer.subarray(w.length)), [7, 7, 7]);
    assert.throws(
      () => dequantizeMxfp4(m, "expert 2 W1", new Float64Array(w.length - 1)),
      /expert 2 W1: out holds/,
    );
    assert.throws(
      () => dequantizeMxfp4(m, "w", new Float32Array(w.length) as unknown as Float64Array),
      /w: out must be a Float64Array/,
    );
  });

  it("re-quantizes its own values to the same bytes when every group holds a ±4 or ±6", () => {
    const next = rng(seed ^ 1);
    const codes = new Uint8Array(4 * 128);
    const scales = new Uint8Array(codes.length / 32);
    for (let g = 0; g < scales.length; g++) {
      scales[g] = 1 + Math.floor(next() * 230); // values stay in fp32's range: 6·2^103 < 2^128
      for (let j = 0; j < 32; j++) codes[g * 32 + j] = Math.floor(next() * 16);
      codes[g * 32 + Math.floor(next() * 32)] = next() < 0.5 ? 6 : 15;
    }
    const m: Mxfp4 = { packed: packE2m1(codes), scales, rows: 4, cols: 128 };
    const again = quantizeMxfp4(Float32Array.from(dequantizeMxfp4(m)), 4, 128);
    assert.deepEqual(again.scales, m.scales);
    assert.deepEqual(again.packed, m.packed);
  });

  it("codes ties, their neighbours, subnormals and −0 as encodeE2m1 of x / s, at every scale", () => {
    const bits = new Uint32Array(1);
    const f32 = new Float32Array(bits.buffer);
    const step = (x: number, ulps: number) => {
      f32[0] = x;
      if (f32[0] !== 0) bits[0] += ulps; // marks that underflow to zero stay zero
      return f32[0];
    };
    // The e2m1 midpoints (ties) and grid points; each appears exact and one ulp either side.
    const marks = [0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6];
    const cols = 32 * 8;
    for (let e = -150; e <= 124; e++) {
      const w = new Float32Array(cols);
      for (let g = 0; g < 8; g++) {
        const amax = [6, 5.5, 4.5, 4.1, 3.01, 6, 5, 4][g];
        for (let j = 0; j < 32; j++) {
          const mark = marks[(j + 3 * g) % marks.length] * 2 ** e;
          const v = j === 0 ? amax * 2 ** e : j === 31 ? -0 : step(mark, (j % 3) - 1);
          w[g * 32 + j] = (j + g) % 2 === 1 ? -v : v;
        }
      }
      const m = quantizeMxfp4(w, 1, cols);
      for (let i = 0; i < cols; i++) {
        const s = 2 ** (m.scales[i >> 5] - 127);
        assert.equal(e2m1At(m.packed, i), encodeE2m1(w[i] / s), `2^${e}: element ${i} = ${w[i]}, scale ${s}`);
      }
    }
  });

  it("states the scale rule at the edges", () => {
    assert.equal(mxfp4ScaleByte(6), 127);
    assert.equal(mxfp4ScaleByte(Math.fround(6 * (1 + 2 ** -23))), 128);
    assert.equal(mxfp4ScaleByte(4), 127);
    assert.equal(mxfp4ScaleByte(3), 126);
    assert.equal(mxfp4ScaleByte(0), 1);
    assert.equal(mxfp4ScaleByte(3.4028234663852886e38), 253);
  });

  it("rejects non-finite values and NaN scales, naming where", () => {
    const w = new Float32Array(64);
    w[40] = Number.NaN;
    assert.throws(() => quantizeMxfp4(w, 1, 64), /non-finite value NaN at row 0, column 40/);
    const plain = Array.from({ length: 64 }, (_, i) => i) as unknown as Float32Array;
    assert.throws(() => quantizeMxfp4(plain, 1, 64), /quantizeMxfp4: w must be a Float32Array, got Array/);
    const m: Mxfp4 = { packed: new Uint8Array(128), scales: new Uint8Array(8).fill(127), rows: 2, cols: 128 };
    m.scales[6] = 0xff;
    assert.throws(() => dequantizeMxfp4(m, "expert 3 w2"), /expert 3 w2: .*0xFF \(NaN\) at row 1, K group 2/);
    assert.throws(() => mxfp4RowsToFp8(m), /0xFF \(NaN\) at row 1, K group 2/);
  });
});

/** e4m3's value nearest to v (ties to even), for |v| below 2^-6 (its subnormal step 2^-9), independently. */
function e4m3SubnormalOracle(v: number): number {
  const q = Math.abs(v) * 512;
  const f = Math.floor(q);
  const r = q - f;
  const n = r > 0.5 ? f + 1 : r < 0.5 ? f : f % 2 === 0 ? f : f + 1;
  return Math.sign(v) * n * 2 ** -9;
}

describe("FP4 → FP8 conversion (per 128-deep K block of a block of rows)", () => {
  // Every row is one K block whose four groups hold all 16 codes twice; the groups' bytes are
  // [M, M − s, M − ⌊s/2⌋, M − s] (clipped at 0) for every M in 0..254 and s in {0, 14, 15, 30}. Each row
  // is converted as a matrix of its own (a 128 × 128 block of one row), so its reference is its own M.
  const spreads = [0, 14, 15, 30];
  const rows = 255 * spreads.length;
  const codes = new Uint8Array(rows * 128);
  for (let i = 0; i < codes.length; i++) codes[i] = i % 16;
  const scales = new Uint8Array(rows * 4);
  spreads.forEach((s, k) => {
    for (let M = 0; M <= 254; M++) {
      const r = k * 255 + M;
      const bytes = [M, M - s, M - Math.floor(s / 2), M - s].map((b) => Math.max(b, 0));
      scales.set(bytes, 4 * r);
    }
  });
  const m: Mxfp4 = { packed: packE2m1(codes), scales, rows, cols: 128 };
  const rowOf = (r: number): Mxfp4 => ({
    packed: m.packed.subarray(64 * r, 64 * (r + 1)),
    scales: scales.subarray(4 * r, 4 * (r + 1)),
    rows: 1,
    cols: 128,
  });
  const conv = { q: new Uint8Array(rows * 128), scales: new Float32Array(rows), inexact: 0 };
  for (let r = 0; r < rows; r++) {
    const one = mxfp4RowsToFp8(rowOf(r));
    conv.q.set(one.q, 128 * r);
    conv.scales[r] = one.scales[0];
    conv.inexact += one.inexact;
  }
  const exact = dequantizeMxfp4(m);

  it("places the largest group at offset +6 (ref = max − 127 − 6) and never saturates", () => {
    for (let r = 0; r < rows; r++) {
      const max = Math.max(...scales.subarray(4 * r, 4 * r + 4));
      assert.equal(conv.scales[r], 2 ** (max - 127 - 6), `row ${r}`);
    }
    for (const c of conv.q) assert.ok(Math.abs(E4M3_DECODE[c]) <= 384);
  });

  it("is exact where the spread is ≤ 14, and rounds to nearest even (ties, underflow to zero) elsewhere", () => {
    let expectInexact = 0;
    for (let r = 0; r < rows; r++) {
      const bytes = scales.subarray(4 * r, 4 * r + 4);
      const max = Math.max(...bytes);
      const ref = conv.scales[r];
      for (let i = r * 128; i < (r + 1) * 128; i++) {
        const d = bytes[(i % 128) >> 5] - max + 6;
        const v = E2M1_DECODE[codes[i]] * 2 ** d; // the element relative to 2^ref, exactly
        assert.equal(v * ref, exact[i]);
        const got = E4M3_DECODE[conv.q[i]];
        if (d >= 6 - FP4_TO_FP8_EXACT_SPREAD) {
          assert.equal(got, v, `row ${r}, element ${i % 128}: d ${d} must be exact`);
        } else {
          assert.equal(got, e4m3SubnormalOracle(v), `row ${r}, element ${i % 128}: d ${d}, v ${v}`);
        }
        if (got !== v) expectInexact++;
      }
      if (max - Math.min(...bytes) <= FP4_TO_FP8_EXACT_SPREAD) {
        for (let i = r * 128; i < (r + 1) * 128; i++) assert.equal(E4M3_DECODE[conv.q[i]] * ref, exact[i]);
      }
    }
    assert.equal(conv.inexact, expectInexact);
    // Spread 15 (rows with M ≥ 15): each d = −9 group loses ±0.5 and ±1.5 (8 of its 32 elements); the two
    // such groups per row make 16.
    assert.equal(mxfp4RowsToFp8(rowOf(2 * 255 + 100)).inexact, 16);
    // Spread 14 and 0: none.
    for (let r = 0; r < 2 * 255; r++) assert.equal(mxfp4RowsToFp8(rowOf(r)).inexact, 0);
    // The layer's count (only the blocks spanning more than 14 looked at) says the same.
    let counted = 0;
    for (let r = 0; r < rows; r++) counted += countFp4ToFp8Inexact(rowOf(r));
    assert.equal(counted, conv.inexact);
  });

  it("treats each K block on its own", () => {
    // Two blocks in one row: a wide spread in the first must not affect the second.
    const two: Mxfp4 = {
      packed: packE2m1(Uint8Array.from({ length: 256 }, (_, i) => i % 16)),
      scales: Uint8Array.from([200, 170, 200, 200, 10, 10, 12, 16]),
      rows: 1,
      cols: 256,
    };
    const c = mxfp4RowsToFp8(two);
    assert.deepEqual(Array.from(c.scales), [2 ** (200 - 133), 2 ** (16 - 133)]);
    assert.equal(c.inexact, 32 - 4); // the d = −24 group: only its four zeros (±0, twice) stay exact
    assert.equal(countFp4ToFp8Inexact(two), 32 - 4);
    const nan = { ...two, scales: Uint8Array.from([200, 170, 200, 200, 10, 255, 12, 16]) };
    assert.throws(() => countFp4ToFp8Inexact(nan), /0xFF/);
  });
});

describe("FP4 → FP8 references: each 128 × 128 block's largest byte (the cast's)", () => {
  // 300 rows (blocks of 128, 128 and 44 rows) × 256 columns (two K blocks). Row r's bytes in K block 0:
  // 120 − (r mod 9), a span of 8 in every block; in K block 1: 90 − (r mod 9), except that row 200 has a
  // group 20 below its others, which makes the second block's K block 1 span 28.
  const rows = 300;
  const cols = 256;
  const scales = new Uint8Array(rows * 8);
  for (let r = 0; r < rows; r++) {
    scales.fill(120 - (r % 9), 8 * r, 8 * r + 4);
    scales.fill(90 - (r % 9), 8 * r + 4, 8 * r + 8);
  }
  scales[8 * 200 + 5] -= 20;
  const m: Mxfp4 = {
    packed: packE2m1(Uint8Array.from({ length: rows * cols }, (_, i) => (i * 7) % 16)),
    scales,
    rows,
    cols,
  };
  const refs = fp4ReferenceBytes(m);

  it("gives every row its block's largest byte, that of a block spanning more than 14 too", () => {
    for (let r = 0; r < rows; r++) {
      assert.equal(refs[2 * r], 120, `row ${r}, K block 0`);
      assert.equal(refs[2 * r + 1], 90, `row ${r}, K block 1`);
    }
    assert.deepEqual(Array.from(fp4BlockReferences(m)), [120, 90, 120, 90, 120, 90]);
    assert.deepEqual(Array.from(fp4BlockReferences(m, 1, 2)), [120, 90]);
  });

  it("converts as the cast does, exactly but for the groups more than 14 under their block's largest", () => {
    const conv = mxfp4RowsToFp8(m, 0, 256);
    const cast = mxfp4ToFp8Blocks({
      packed: m.packed.subarray(0, (256 * cols) / 2),
      scales: scales.subarray(0, 256 * 8),
      rows: 256,
      cols,
    });
    assert.deepEqual(conv.q, cast.q);
    assert.equal(conv.inexact, cast.inexact);
    const exact = dequantizeMxfp4(m);
    // Only row 200's group 1 of K block 1 lies more than 14 under its block's 90 (at 90 − 20 − 2 = 68).
    assert.ok(conv.inexact > 0);
    assert.equal(conv.inexact, mxfp4RowsToFp8(m, 200, 201).inexact);
    assert.equal(conv.inexact, countFp4ToFp8Inexact(m));
    for (let r = 0; r < 256; r++) {
      for (let kb = 0; kb < 2; kb++) {
        const ref = 2 ** (refs[2 * r + kb] - 133);
        assert.equal(conv.scales[2 * r + kb], ref);
        assert.equal(cast.scales[Math.floor(r / 128) * 2 + kb], ref);
        for (let k = kb * 128; k < kb * 128 + 128; k++) {
          if (r === 200 && k >= 160 && k < 192) continue;
          assert.equal(E4M3_DECODE[conv.q[r * cols + k]] * ref, exact[r * cols + k], `row ${r}, k ${k}`);
        }
      }
    }
  });

  it("says whether every 128 × 128 block spans at most 14", () => {
    assert.equal(fp4BlocksExact(scales, rows, cols), false);
    const narrow = scales.slice();
    narrow[8 * 200 + 5] += 8;
    assert.equal(fp4BlocksExact(narrow, rows, cols), true);
    // Blocks of 100 with one byte 14 above (block 0) or below (block 1): exact; one more row of block 1
    // at 115, a span of 29 across its rows (each row's own span at most 15): not.
    const across = new Uint8Array(rows * 8).fill(100);
    across[8 * 3] = 114;
    across[8 * 130] = 86;
    assert.equal(fp4BlocksExact(across, rows, cols), true);
    across[8 * 131] = 115;
    assert.equal(fp4BlocksExact(across, rows, cols), false);
    assert.throws(() => fp4BlocksExact(scales, rows, 160), /not a multiple of 128/);
  });

  it("gives a range of rows the references their whole blocks choose", () => {
    const whole = mxfp4RowsToFp8(m);
    for (const [r0, r1] of [
      [0, 1],
      [100, 140],
      [199, 201],
      [250, 300],
      [290, 300],
    ]) {
      const part = mxfp4RowsToFp8(m, r0, r1);
      assert.deepEqual(part.q, whole.q.subarray(r0 * cols, r1 * cols), `rows [${r0}, ${r1})`);
      assert.deepEqual(part.scales, whole.scales.subarray(2 * r0, 2 * r1), `rows [${r0}, ${r1})`);
      assert.deepEqual(fp4ReferenceBytes(m, r0, r1), refs.subarray(2 * r0, 2 * r1));
    }
  });

  it("refuses a NaN byte anywhere in the rows' blocks", () => {
    const nan = { ...m, scales: scales.slice() };
    nan.scales[8 * 5] = 0xff;
    assert.throws(() => mxfp4RowsToFp8(nan, 100, 101), /0xFF/);
  });

  it("stores each row's K block as the kernels' reference word: R, offsets, the exact tables' flag", () => {
    const words = mxfp4ReferenceWords(scales, rows, cols);
    for (let r = 0; r < rows; r++) {
      for (let kb = 0; kb < 2; kb++) {
        const w = words[2 * r + kb];
        const R = refs[2 * r + kb];
        assert.equal(w & 0xff, R, `row ${r}, K block ${kb}`);
        const offsets = [0, 1, 2, 3].map((g) => R - scales[8 * r + 4 * kb + g]);
        assert.deepEqual(
          [0, 1, 2, 3].map((g) => (w >>> (8 + 5 * g)) & 31),
          offsets,
          `row ${r}, K block ${kb}`,
        );
        assert.equal(
          (w & FP4_EXACT_FLAG) !== 0,
          offsets.some((o) => o > 11),
          `row ${r}, K block ${kb}`,
        );
        assert.equal(w & 0xb0000000, 0);
      }
    }
    // An offset past 31 is stored as 31 (every offset from 19 converts to zeros alike).
    const far = mxfp4ReferenceWords(Uint8Array.of(200, 10, 200, 199), 1, 128)[0];
    assert.equal(far, (200 | (31 << 13) | (1 << 23) | FP4_EXACT_FLAG) >>> 0);
    assert.throws(
      () => mxfp4ReferenceWords(Uint8Array.of(1, 2, 0xff, 4), 1, 128),
      /0xFF \(NaN\) at row 0, K group 2/,
    );
    assert.throws(
      () => mxfp4ReferenceWords(Uint8Array.of(1, 2, 3), 1, 128),
      /3 scale bytes do not fit \[1, 4\]/,
    );
  });
});
