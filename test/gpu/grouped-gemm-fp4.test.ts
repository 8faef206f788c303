/**
 * The grouped GEMM with FP4 (MXFP4) weights (src/kernels/gemm/fp4_grouped_gemm.ts, the B_FP4 build of
 * fp8_grouped_gemm.cu) against the CPU rule of docs/numerics.md "FP4 experts (MXFP4)", bit for bit:
 *
 *   q8, sw = mxfp4RowsToFp8(W)                          (per weight row and K block: codes and 2^ref)
 *   acc    = fp32(acc + fp32(Σ_block a·q8) · fp32(sa[b, r] · sw[n, b]))   one rounding (fmaf), blocks in K order
 *
 * Two kinds of data:
 *  - exact: each activation row uses one 32-group per K block (the others are zero) with values in
 *    {0, ±1, ±2, ±3}·2^e, so every block sum has at most ~10 significant bits and the tensor cores sum
 *    it exactly: the fast kernel must then equal the CPU rule in every bit (conversion, per-column
 *    scales, the promotion's roundings, subnormal scale products and all);
 *  - random: random e4m3 activations; the tensor cores' fp32 block sums round differently from the
 *    exact sums, so the fast kernel is compared with tolerances, while the CUDA-core reference kernel
 *    (exact conversion, block sums in double) must still equal the CPU rule in every bit.
 * Weight scale bytes: rows with spreads 0, 14, 15 and 30 and maxima running over every byte 0..254 (the
 * maximum in each group position; under their 128 × 128 block's reference the rows below its largest
 * round), every other 128 × 128 block within 14 of one maximum (exact), and uniform random bytes. Group sizes include
 * empty groups, 1-row groups, rows outside every group and 384 small groups; outputs are poisoned with
 * 0xFF first, and rows of no group must stay poisoned. Every case runs on each FP4 tile and on a grid of
 * one CTA.
 *
 * GPU tests skip with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 * The layout and argument tests at the top run everywhere.
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { PRESETS, QUANT_BLOCK } from "../../src/config/config.js";
import { DeviceTensor } from "../../src/cuda/index.js";
import {
  fp4GemmBlockScales,
  fp4GemmScaleWords,
  type GroupedGemmFp4Args,
  groupedGemmFp4,
  groupedGemmFp4Reference,
  validateGroupedGemmFp4Args,
} from "../../src/kernels/gemm/fp4_grouped_gemm.js";
import {
  FP4_GEMM_TILE_NAMES,
  GEMM_TILES,
  type GemmTileName,
  gemmSharedBytes,
  presetGemmShapes,
  variants,
} from "../../src/kernels/gemm/fp8_grouped_gemm.variants.js";
import { aScalesRows, type TensorLike, takeGroupedGemmStatus } from "../../src/kernels/gemm/grouped_gemm.js";
import { planGroupedGemm } from "../../src/kernels/gemm/plan.js";
import { describeDefines, SM90_SHARED_OPTIN_BYTES } from "../../src/kernels/variants.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import {
  type Fp4AsFp8,
  fp4BlockScales,
  mxfp4DeviceLayout,
  mxfp4ReferenceWords,
  mxfp4RowsToFp8,
} from "../../src/numerics/fp4.js";
import { E4M3_DECODE, encodeE4m3 } from "../../src/numerics/fp8.js";
import { promoteBlock } from "../../src/reference/moe.js";
import { availability, describeGpu, testDevice } from "../helpers/gpu.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("grouped-gemm-fp4");
const random = rng(seed);

type OutDtype = "fp32" | "bf16";

interface Problem {
  n: number;
  k: number;
  groups: number;
  mTotal: number;
  offsets: Int32Array;
  a: Uint8Array;
  /** [K/128, M_pad] */
  aScales: Float32Array;
  /** [G·N, K/2] */
  packed: Uint8Array;
  /** [G·N, K/32] */
  scales: Uint8Array;
}

const randInt = (n: number) => Math.floor(random() * n);

/**
 * Scale bytes of one weight row's K block: adversarial spreads with maxima over 0..254, or random; in the
 * "exact" kind every other 128 × 128 block has all its bytes within 14 of one maximum (exact).
 */
function blockBytes(kind: "exact" | "random", row: number, kb: number, maxByte: number): number[] {
  if (kind === "exact" && (Math.floor(row / 128) + kb) % 2 === 0) {
    const top = 14 + ((Math.floor(row / 128) * 53 + kb * 29) % (maxByte - 13));
    const at = (row + kb) % 4;
    return [0, 1, 2, 3].map((g) => (g === at && row % 128 === 7 ? top : top - randInt(15)));
  }
  if (kind === "random" || (row + kb) % 5 === 4) return [0, 1, 2, 3].map(() => randInt(maxByte + 1));
  const spread = [0, 14, 15, 30][(row + kb) % 4];
  const max = (row * 37 + kb * 101) % (maxByte + 1);
  const at = (row + 3 * kb) % 4;
  const low = Math.max(0, max - spread);
  return [0, 1, 2, 3].map((g) => (g === at ? max : g === (at + 1) % 4 ? low : max - randInt(max - low + 1)));
}

function makeProblem(
  kind: "exact" | "random",
  n: number,
  k: number,
  sizes: readonly number[],
  lead: number,
  tail: number,
): Problem {
  const groups = sizes.length;
  const offsets = new Int32Array(groups + 1);
  offsets[0] = lead;
  for (let g = 0; g < groups; g++) offsets[g + 1] = offsets[g] + sizes[g];
  const mTotal = offsets[groups] + tail;
  const kBlocks = k / QUANT_BLOCK;
  const mPad = aScalesRows(mTotal);
  const a = new Uint8Array(mTotal * k);
  const aScales = new Float32Array(kBlocks * mPad);
  for (let r = 0; r < mTotal; r++) {
    for (let b = 0; b < kBlocks; b++) {
      if (kind === "exact") {
        // One active 32-group per (row, block); values {0, ±1, ±2, ±3} · 2^e. Scales 2^[-40, -20) · [1, 2):
        // with weight maxima up to 2^121 nothing overflows, and tiny weight scales give subnormal s_b.
        const active = (r + b) % 4;
        const e = randInt(5) - 2;
        for (let j = 0; j < 32; j++) {
          const v = (randInt(7) - 3) * 2 ** e;
          a[r * k + b * QUANT_BLOCK + active * 32 + j] = encodeE4m3(v);
        }
        aScales[b * mPad + r] = Math.fround(2 ** (-40 + 20 * random()) * (1 + random()));
      } else {
        for (let i = b * QUANT_BLOCK; i < (b + 1) * QUANT_BLOCK; i++) {
          let c = randInt(256);
          if ((c & 0x7f) === 0x7f) c ^= 1; // no NaN codes
          a[r * k + i] = c;
        }
        aScales[b * mPad + r] = Math.fround(2 ** (-30 + 20 * random()) * (1 + random()));
      }
    }
  }
  const rows = groups * n;
  const packed = new Uint8Array((rows * k) / 2);
  for (let i = 0; i < packed.length; i++) packed[i] = randInt(256);
  const scales = new Uint8Array((rows * k) / 32);
  // Exact data keeps block sums ≤ 2^18, so maxima up to 254 stay finite; random sums reach 2^25: ≤ 200.
  const maxByte = kind === "exact" ? 254 : 200;
  for (let r = 0; r < rows; r++) {
    for (let b = 0; b < kBlocks; b++) scales.set(blockBytes(kind, r, b, maxByte), r * (k / 32) + 4 * b);
  }
  return { n, k, groups, mTotal, offsets, a, aScales, packed, scales };
}

function groupOfRow(p: Problem, row: number): number {
  for (let g = 0; g < p.groups; g++) if (row >= p.offsets[g] && row < p.offsets[g + 1]) return g;
  return -1;
}

/** The CPU rule (src/reference/moe.ts blockScaledGemm on mxfp4RowsToFp8's rows) for one output row. */
function specRow(p: Problem, row: number, weights: (g: number) => Fp4AsFp8): Float32Array {
  const { n, k } = p;
  const kBlocks = k / QUANT_BLOCK;
  const mPad = aScalesRows(p.mTotal);
  const w = weights(groupOfRow(p, row));
  const a = new Float64Array(k);
  for (let i = 0; i < k; i++) a[i] = E4M3_DECODE[p.a[row * k + i]];
  const out = new Float32Array(n);
  for (let col = 0; col < n; col++) {
    let acc = 0;
    for (let b = 0; b < kBlocks; b++) {
      let partial = 0;
      for (let i = b * QUANT_BLOCK; i < (b + 1) * QUANT_BLOCK; i++)
        partial += a[i] * E4M3_DECODE[w.q[col * k + i]];
      acc = promoteBlock(acc, partial, p.aScales[b * mPad + row], w.scales[col * kBlocks + b]);
    }
    out[col] = acc;
  }
  return out;
}

function weightCache(p: Problem): (g: number) => Fp4AsFp8 {
  const cache = new Map<number, Fp4AsFp8>();
  const m = { packed: p.packed, scales: p.scales, rows: p.groups * p.n, cols: p.k };
  return (g) => {
    let w = cache.get(g);
    if (w === undefined) {
      w = mxfp4RowsToFp8(m, g * p.n, (g + 1) * p.n, `group ${g}`);
      cache.set(g, w);
    }
    return w;
  };
}

// ---------------------------------------------------------------------------------------------------
// No GPU needed

const t = (dtype: TensorLike["dtype"], shape: number[]): TensorLike => ({ dtype, shape });

describe("FP4 grouped GEMM layout and arguments", () => {
  test("the scale transform puts row n's reference word of K block b at (b, 4n)", () => {
    const rows = 3;
    const k = 256;
    const scales = Uint8Array.from({ length: rows * 8 }, (_, i) => i);
    const words = fp4GemmScaleWords(scales, rows, k);
    const want = mxfp4ReferenceWords(scales, rows, k);
    const view = new DataView(words.buffer, words.byteOffset, words.byteLength);
    for (let n = 0; n < rows; n++) {
      for (let b = 0; b < 2; b++) assert.equal(view.getUint32((b * rows + n) * 4, true), want[n * 2 + b]);
    }
    const bad = scales.slice();
    bad[13] = 0xff;
    assert.throws(() => fp4GemmScaleWords(bad, rows, k), /0xFF \(NaN\) at row 1, K group 5/);
    assert.throws(() => fp4GemmScaleWords(scales, rows, 200), /multiple of 128/);
  });

  test("the block scales read from the scale words are fp4BlockScales', spans past 14 and a short block included", () => {
    const rows = 300; // two whole 128-row blocks and a short one
    const k = 256;
    const scales = Uint8Array.from({ length: (rows * k) / 32 }, (_, i) => 100 + ((i * 37) % 29));
    scales[5] = 140; // a span of 40 in the first block
    const packed = new Uint8Array((rows * k) / 2);
    const words = fp4GemmScaleWords(scales, rows, k);
    assert.deepEqual(fp4GemmBlockScales(words, rows, k), fp4BlockScales({ rows, cols: k, packed, scales }));
    assert.throws(() => fp4GemmBlockScales(words.subarray(4), rows, k), /do not fit/);
  });

  test("plans for FP4 weights use the FP4 tiles and name the B_FP4 build", () => {
    for (const [mTotal, groups] of [
      [6 * 16, 256],
      [256 * 512, 256],
      [1, 8],
    ] as const) {
      const plan = planGroupedGemm({ mTotal, n: 4096, k: 4096, groups, weightFormat: "fp4" });
      assert.ok(FP4_GEMM_TILE_NAMES.includes(plan.tile.name), plan.tile.name);
      assert.equal(plan.defines.B_FP4, 1);
      assert.ok(plan.stages >= 4, `${plan.tile.name}: ${plan.stages} stages`);
    }
    assert.equal(planGroupedGemm({ mTotal: 8, n: 256, k: 128, groups: 1 }).defines.B_FP4, undefined);
    assert.throws(
      () =>
        planGroupedGemm({ mTotal: 8, n: 256, k: 128, groups: 1, weightFormat: "fp4" }, { tile: "m128n256" }),
      /no fp4 build/,
    );
  });

  test("every FP4 plan the presets can produce is a variant the CI compiles, and each fits", () => {
    const compiled = new Set(variants.map((v) => describeDefines(v.defines)));
    for (const preset of Object.values(PRESETS)) {
      const groups = preset.numExperts / preset.ranks;
      for (const { n, k } of presetGemmShapes(preset.hidden, preset.intermediate)) {
        for (const tokens of [1, 7, 64, 129, 512, 2048, 8192, 32768]) {
          for (const outDtype of ["fp32", "bf16"] as const) {
            for (const tile of [undefined, ...FP4_GEMM_TILE_NAMES]) {
              const plan = planGroupedGemm(
                { mTotal: tokens * preset.topK, n, k, groups, outDtype, weightFormat: "fp4" },
                { tile },
              );
              const key = describeDefines(plan.defines);
              assert.ok(compiled.has(key), `${preset.name} n=${n} k=${k} T=${tokens}: ${key}`);
            }
          }
        }
      }
    }
    for (const v of variants.filter((x) => x.defines.B_FP4 === 1)) {
      const d = v.defines;
      const tile = Object.values(GEMM_TILES).find(
        (x) => x.blockM === d.BLOCK_M && x.blockN === d.BLOCK_N && x.mathWarpgroups === d.NUM_MATH_WARPGROUPS,
      );
      assert.ok(tile && FP4_GEMM_TILE_NAMES.includes(tile.name), `no FP4 tile for ${describeDefines(d)}`);
      const bytes = gemmSharedBytes(tile, d.NUM_STAGES, d.K, d.NUM_GROUPS, "fp4");
      assert.ok(bytes <= SM90_SHARED_OPTIN_BYTES, `${describeDefines(d)}: ${bytes} B`);
      assert.ok(d.NUM_STAGES >= 4, `${describeDefines(d)}: ${d.NUM_STAGES} stages`);
    }
  });

  test("bad operands are named", () => {
    const good: GroupedGemmFp4Args<TensorLike> = {
      a: t("fp8_e4m3", [10, 256]),
      aScales: t("fp32", [2, 12]),
      b: t("uint8", [3 * 256, 128]),
      bScales: t("uint8", [2, 3 * 256 * 4]),
      groupOffsets: t("int32", [4]),
      out: t("bf16", [10, 256]),
      mTotal: 10,
      n: 256,
      k: 256,
      groups: 3,
    };
    assert.equal(validateGroupedGemmFp4Args(good), "bf16");
    assert.equal(validateGroupedGemmFp4Args({ ...good, b: t("uint8", [3, 256, 128]) }), "bf16");
    assert.throws(
      () => validateGroupedGemmFp4Args({ ...good, b: t("fp8_e4m3", [768, 256]) }),
      /b must be uint8/,
    );
    assert.throws(
      () => validateGroupedGemmFp4Args({ ...good, bScales: t("uint8", [3 * 256, 8]) }),
      /bScales must be/,
    );
    assert.throws(() => validateGroupedGemmFp4Args({ ...good, tile: "m64n256" }), /no FP4 build/);
  });
});

// ---------------------------------------------------------------------------------------------------
// GPU

interface GpuCase {
  name: string;
  kind: "exact" | "random";
  n: number;
  k: number;
  sizes: number[];
  lead?: number;
  tail?: number;
  outDtype: OutDtype;
  /** Rows checked against the CPU rule (all when fewer); the reference kernel covers every row. */
  cpuRows: number;
}

const sizes384 = Array.from({ length: 384 }, () => (random() < 0.2 ? 0 : randInt(10)));

const CASES: GpuCase[] = [
  {
    name: "exact, N=256 K=512 (four K blocks: spreads 0/14/15/30), groups of 1..200 rows",
    kind: "exact",
    n: 256,
    k: 512,
    sizes: [1, 7, 64, 129, 0, 200, 3, 65],
    outDtype: "fp32",
    cpuRows: 1e9,
  },
  {
    name: "exact, N=512 K=1024, rows outside groups, empty groups, bf16 out",
    kind: "exact",
    n: 512,
    k: 1024,
    sizes: [5, 0, 0, 64, 1, 127, 0, 33],
    lead: 3,
    tail: 6,
    outDtype: "bf16",
    cpuRows: 1e9,
  },
  {
    name: "exact, 384 groups of 0..9 rows (N=256, K=128: one K block)",
    kind: "exact",
    n: 256,
    k: 128,
    sizes: sizes384,
    outDtype: "fp32",
    cpuRows: 1e9,
  },
  {
    name: "exact, pro L2 shape (N=7168, K=3072), decode: 1, 7 and 4 rows",
    kind: "exact",
    n: 7168,
    k: 3072,
    sizes: [1, 7, 4],
    tail: 1,
    outDtype: "bf16",
    cpuRows: 1e9,
  },
  {
    name: "random, N=256 K=512, groups of 1..300 rows",
    kind: "random",
    n: 256,
    k: 512,
    sizes: [0, 1, 300, 0, 17, 128],
    outDtype: "fp32",
    cpuRows: 1e9,
  },
  {
    name: "random, flash L1 shape (N=4096, K=4096), 600 rows in 2 groups, bf16 out",
    kind: "random",
    n: 4096,
    k: 4096,
    sizes: [512, 88],
    outDtype: "bf16",
    cpuRows: 12,
  },
];

type Tile = GemmTileName | "plan-1cta";
const TILES: Tile[] = [...FP4_GEMM_TILE_NAMES, "plan-1cta"];

const bitsOf = (x: Float32Array) => new Uint32Array(x.buffer, x.byteOffset, x.length);

/** Elements of `got` rows (fp32 or bf16 bits) that differ from the expected fp32 rows in the output's bits. */
function bitMismatches(
  got: Float32Array | Uint16Array,
  want: Map<number, Float32Array>,
  n: number,
  outDtype: OutDtype,
): { bad: number; first: string[] } {
  let bad = 0;
  const first: string[] = [];
  // Raw output bits: bf16 as stored, fp32 through a view of the same bytes.
  const gotBits = outDtype === "bf16" ? got : bitsOf(got as Float32Array);
  for (const [row, ref] of want) {
    const refBits = bitsOf(ref);
    for (let col = 0; col < n; col++) {
      const g = got[row * n + col];
      const w = outDtype === "bf16" ? f32ToBf16Bits(ref[col]) : refBits[col];
      const gBits = gotBits[row * n + col];
      if (gBits !== w) {
        if (first.length < 4) {
          const gv = outDtype === "bf16" ? bf16BitsToF32(g) : g;
          first.push(
            `[${row}, ${col}] got ${gv} (0x${gBits.toString(16)}) want ${ref[col]} (0x${w.toString(16)})`,
          );
        }
        bad++;
      }
    }
  }
  return { bad, first };
}

/** Tolerance check for random data: |Δ| ≤ 1e-2 · row RMS (+ one bf16 step in bf16), and ‖Δ‖/‖ref‖. */
function closeTo(
  got: Float32Array | Uint16Array,
  want: Map<number, Float32Array>,
  n: number,
  outDtype: OutDtype,
) {
  let num = 0;
  let den = 0;
  let bad = 0;
  const first: string[] = [];
  for (const [row, ref] of want) {
    let rms = 0;
    for (const v of ref) rms += v * v;
    rms = Math.sqrt(rms / ref.length);
    for (let col = 0; col < n; col++) {
      const g = outDtype === "bf16" ? bf16BitsToF32(got[row * n + col]) : got[row * n + col];
      const r = ref[col];
      num += (g - r) ** 2;
      den += r * r;
      const step =
        outDtype === "bf16" ? 2 ** (Math.floor(Math.log2(Math.max(Math.abs(r), 2 ** -126))) - 7) : 0;
      if (!(Math.abs(g - r) <= 1e-2 * rms + step * 1.0001)) {
        if (first.length < 4) first.push(`[${row}, ${col}] got ${g} want ${r}`);
        bad++;
      }
    }
  }
  return { rel: den > 0 ? Math.sqrt(num / den) : 0, bad, first };
}

/** Rows of groups hold no poison (all-0xFF elements); rows of no group nothing else. */
function poisonProblems(p: Problem, host: Float32Array | Uint16Array, outDtype: OutDtype): string[] {
  const bytes = new Uint8Array(host.buffer, host.byteOffset, host.byteLength);
  const eb = outDtype === "bf16" ? 2 : 4;
  const problems: string[] = [];
  for (let row = 0; row < p.mTotal && problems.length < 4; row++) {
    const inGroup = groupOfRow(p, row) >= 0;
    for (let col = 0; col < p.n && problems.length < 4; col++) {
      let poison = true;
      for (let i = 0; i < eb; i++) poison &&= bytes[(row * p.n + col) * eb + i] === 0xff;
      if (inGroup && poison) problems.push(`row ${row} col ${col} of a group was never written`);
      if (!inGroup && !poison) problems.push(`row ${row} col ${col} belongs to no group but was written`);
    }
  }
  return problems;
}

function sampleRows(p: Problem, limit: number): number[] {
  const first = p.offsets[0];
  const total = p.offsets[p.groups] - first;
  const rows = new Set<number>();
  for (let g = 0; g < p.groups; g++) {
    if (p.offsets[g + 1] > p.offsets[g]) rows.add(p.offsets[g]).add(p.offsets[g + 1] - 1);
  }
  if (total <= limit) return Array.from({ length: total }, (_, i) => first + i);
  while (rows.size < limit) rows.add(first + randInt(total));
  return [...rows].slice(0, Math.max(limit, 1)).sort((x, y) => x - y);
}

describeGpu("FP4 grouped GEMM on a GPU", () => {
  test("CUDA is available", () => {
    assert.ok(availability.ok, availability.ok ? "" : availability.reason);
  });

  for (const c of CASES) {
    test(c.name, () => {
      const device = testDevice();
      const p = makeProblem(c.kind, c.n, c.k, c.sizes, c.lead ?? 0, c.tail ?? 0);
      const kb = c.k / QUANT_BLOCK;
      const made: DeviceTensor[] = [];
      const keep = <T extends DeviceTensor>(x: T): T => {
        made.push(x);
        return x;
      };
      const failures: string[] = [];
      try {
        const words = fp4GemmScaleWords(p.scales, p.groups * c.n, c.k);
        const base: GroupedGemmFp4Args = {
          a: keep(DeviceTensor.fromHost(device, "fp8_e4m3", [p.mTotal, c.k], p.a)),
          aScales: keep(DeviceTensor.fromHost(device, "fp32", [kb, aScalesRows(p.mTotal)], p.aScales)),
          b: keep(
            DeviceTensor.fromHost(
              device,
              "uint8",
              [p.groups * c.n, c.k / 2],
              mxfp4DeviceLayout(p.packed, c.k),
            ),
          ),
          bScales: keep(DeviceTensor.fromHost(device, "uint8", [kb, p.groups * c.n * 4], words)),
          groupOffsets: keep(DeviceTensor.fromHost(device, "int32", [p.groups + 1], p.offsets)),
          out: keep(DeviceTensor.empty(device, c.outDtype, [p.mTotal, c.n])),
          mTotal: p.mTotal,
          n: c.n,
          k: c.k,
          groups: p.groups,
        };
        const out = base.out;
        const rows = sampleRows(p, c.cpuRows);
        const weights = weightCache(p);
        const expected = new Map(rows.map((r) => [r, specRow(p, r, weights)] as const));

        // The CUDA-core reference: the CPU rule bit for bit on any data.
        out.fill(0xff);
        groupedGemmFp4Reference(device, base, null);
        const refHost = out.toHost() as Float32Array | Uint16Array;
        const refVsCpu = bitMismatches(refHost, expected, c.n, c.outDtype);
        const refPoison = poisonProblems(p, refHost, c.outDtype);
        console.log(
          `  ${c.name} | reference kernel: ${refVsCpu.bad} bits differ from the CPU rule (${rows.length} rows)`,
        );
        if (refVsCpu.bad > 0 || refPoison.length > 0) {
          failures.push(
            `reference kernel vs CPU: ${refVsCpu.bad} differ: ${refVsCpu.first.join("; ")} ${refPoison.join("; ")}`,
          );
        }
        const allRows = new Map<number, Float32Array>();
        for (let r = 0; r < p.mTotal; r++) {
          if (groupOfRow(p, r) < 0) continue;
          const v = new Float32Array(c.n);
          for (let col = 0; col < c.n; col++) {
            v[col] = c.outDtype === "bf16" ? bf16BitsToF32(refHost[r * c.n + col]) : refHost[r * c.n + col];
          }
          allRows.set(r, v);
        }

        for (const tile of TILES) {
          const args = tile === "plan-1cta" ? { ...base, maxCtas: 1 } : { ...base, tile };
          out.fill(0xff);
          const plan = groupedGemmFp4(device, args, null);
          const label = `${plan.tile.name} (${plan.stages} stages${tile === "plan-1cta" ? ", 1 CTA" : ""})`;
          const stall = takeGroupedGemmStatus(device);
          if (stall) {
            failures.push(`${label}: pipeline stalled ${JSON.stringify(stall)}`);
            continue;
          }
          const host = out.toHost() as Float32Array | Uint16Array;
          const poison = poisonProblems(p, host, c.outDtype);
          if (poison.length > 0) failures.push(`${label} poison: ${poison.join("; ")}`);
          if (c.kind === "exact") {
            const vsCpu = bitMismatches(host, expected, c.n, c.outDtype);
            // Every row against the reference kernel's output, raw bits (fp32 or bf16 alike).
            const hostBits = new Uint8Array(host.buffer, host.byteOffset, host.byteLength);
            const refBits = new Uint8Array(refHost.buffer, refHost.byteOffset, refHost.byteLength);
            const eb = c.outDtype === "bf16" ? 2 : 4;
            let vsRef = 0;
            for (const row of allRows.keys()) {
              for (let i = row * c.n * eb; i < (row + 1) * c.n * eb; i++)
                if (hostBits[i] !== refBits[i]) vsRef++;
            }
            console.log(
              `  ${c.name} | ${label}: ${vsCpu.bad} elements differ from the CPU rule, ${vsRef} bytes from the reference kernel`,
            );
            if (vsCpu.bad > 0)
              failures.push(`${label} vs CPU: ${vsCpu.bad} differ: ${vsCpu.first.join("; ")}`);
            if (vsRef > 0) failures.push(`${label} vs reference kernel: ${vsRef} bytes differ`);
          } else {
            const vsCpu = closeTo(host, expected, c.n, c.outDtype);
            const vsRef = closeTo(host, allRows, c.n, c.outDtype);
            console.log(
              `  ${c.name} | ${label}: vs CPU ${vsCpu.rel.toExponential(2)} (${vsCpu.bad} bad), vs reference kernel ${vsRef.rel.toExponential(2)} (${vsRef.bad} bad)`,
            );
            const limit = c.outDtype === "bf16" ? 4e-3 : 1e-3;
            for (const [what, r] of [
              ["CPU", vsCpu],
              ["reference kernel", vsRef],
            ] as const) {
              if (!(r.rel < limit) || r.bad > 0)
                failures.push(`${label} vs ${what}: rel ${r.rel}, ${r.bad} bad: ${r.first.join("; ")}`);
            }
          }
        }
      } finally {
        for (const x of made) x.dispose();
      }
      assert.deepEqual(failures, [], `${c.name}:\n  ${failures.join("\n  ")}`);
    });
  }
});
