/**
 * The FP8 grouped GEMM (src/kernels/gemm) against a CPU implementation of the spec formula
 * (src/reference/moe.ts blockScaledGemm):
 *
 *   out[r, n] = Σ_b fp32(Σ_{k in block b} a·w) · fp32(sa[b, r] · sw[g, n/128, b]), accumulated in fp32
 *
 * on random e4m3 codes and block scales: all rows for small shapes, sampled rows (each group's first and
 * last plus random ones) for large ones, ‖Δ‖/‖ref‖ < 1e-3 for fp32 output (bf16 output: within one bf16
 * step of the rounded reference, element by element). Every case runs on every tile shape it lists, and
 * also through the CUDA-core reference kernel, against which all rows are compared: when the fast kernel
 * fails and the reference kernel passes, the fault is in the fast path (TMA, wgmma, pipeline); when
 * both fail, in the operands' layout. Outputs are poisoned with 0xFF: every row of a group must be
 * written, rows of no group left untouched. Failures are collected per case and tile and reported
 * together, so one GPU run shows the whole picture.
 *
 * GPU tests skip with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 * The plan, variant and argument-check tests at the top run everywhere.
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { groupedGemmFloorUs } from "../../src/bench/grouped-gemm.js";
import { PRESETS, QUANT_BLOCK } from "../../src/config/config.js";
import { SM90_SHARED_OPTIN_BYTES } from "../../src/cuda/hardware.js";
import { type Device, DeviceTensor, openDevice } from "../../src/cuda/index.js";
import {
  GEMM_TILE_NAMES,
  GEMM_TILES,
  type GemmTileName,
  gemmSharedBytes,
  presetGemmShapes,
  variants,
} from "../../src/kernels/gemm/fp8_grouped_gemm.variants.js";
import {
  aScalesRows,
  type GroupedGemmArgs,
  groupedGemmFp8,
  groupedGemmFp8Reference,
  type TensorLike,
  takeGroupedGemmStatus,
  validateGroupedGemmArgs,
} from "../../src/kernels/gemm/grouped_gemm.js";
import { formatGroupedGemmPlan, type GemmOutDtype, planGroupedGemm } from "../../src/kernels/gemm/plan.js";
import { describeDefines } from "../../src/kernels/variants.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { E4M3_DECODE } from "../../src/numerics/fp8.js";
import { promoteBlock } from "../../src/reference/moe.js";
import { availability, describeGpu } from "../helpers/gpu.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("grouped-gemm");

const random = rng(seed);

// ---------------------------------------------------------------------------------------------------
// Host problem and the CPU spec

interface HostProblem {
  n: number;
  k: number;
  groups: number;
  mTotal: number;
  offsets: Int32Array;
  a: Uint8Array;
  /** [K/128, M_pad] */
  aScales: Float32Array;
  b: Uint8Array;
  /** [G, N/128, K/128] */
  bScales: Float32Array;
}

/** Random e4m3 codes, NaN codes (0x7F, 0xFF) replaced; 4 bytes per generator step for speed. */
function randomCodes(count: number): Uint8Array {
  const out = new Uint8Array(count);
  const words = new Uint32Array(out.buffer, 0, count >>> 2);
  let s = Math.floor(random() * 2 ** 32) >>> 0;
  for (let i = 0; i < words.length; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    words[i] = s ^ (s >>> 13);
  }
  for (let i = words.length * 4; i < count; i++) out[i] = Math.floor(random() * 256);
  for (let i = 0; i < count; i++) if ((out[i] & 0x7f) === 0x7f) out[i] ^= 0x01;
  return out;
}

/** Positive scales of varied magnitude around 2^-6 (products of codes up to 448² stay well in range). */
function randomScales(count: number): Float32Array {
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) out[i] = 2 ** (-8 + 4 * random()) * (1 + random());
  return out;
}

function makeProblem(
  n: number,
  k: number,
  sizes: readonly number[],
  lead: number,
  tail: number,
): HostProblem {
  const groups = sizes.length;
  const offsets = new Int32Array(groups + 1);
  offsets[0] = lead;
  for (let g = 0; g < groups; g++) offsets[g + 1] = offsets[g] + sizes[g];
  const mTotal = offsets[groups] + tail;
  const kb = k / QUANT_BLOCK;
  return {
    n,
    k,
    groups,
    mTotal,
    offsets,
    a: randomCodes(mTotal * k),
    aScales: randomScales(kb * aScalesRows(mTotal)),
    b: randomCodes(groups * n * k),
    bScales: randomScales(groups * (n / QUANT_BLOCK) * kb),
  };
}

function groupOfRow(p: HostProblem, row: number): number {
  for (let g = 0; g < p.groups; g++) if (row >= p.offsets[g] && row < p.offsets[g + 1]) return g;
  return -1;
}

/** The spec formula for one row (fp32 after every step, as blockScaledGemm does). */
function specRow(p: HostProblem, row: number, weights: (g: number) => Float32Array): Float32Array {
  const { n, k } = p;
  const kb = k / QUANT_BLOCK;
  const mPad = aScalesRows(p.mTotal);
  const g = groupOfRow(p, row);
  const out = new Float32Array(n);
  const a = new Float32Array(k);
  for (let i = 0; i < k; i++) a[i] = E4M3_DECODE[p.a[row * k + i]];
  const w = weights(g);
  const sa = new Float32Array(kb);
  for (let b = 0; b < kb; b++) sa[b] = p.aScales[b * mPad + row];
  for (let col = 0; col < n; col++) {
    const base = col * k;
    const swBase = (g * (n / QUANT_BLOCK) + Math.floor(col / QUANT_BLOCK)) * kb;
    let acc = 0;
    for (let b = 0; b < kb; b++) {
      let partial = 0;
      const end = (b + 1) * QUANT_BLOCK;
      for (let i = b * QUANT_BLOCK; i < end; i++) partial += a[i] * w[base + i];
      acc = promoteBlock(acc, partial, sa[b], p.bScales[swBase + b]);
    }
    out[col] = acc;
  }
  return out;
}

/** Decoded weights of each group, built on first use. */
function weightCache(p: HostProblem): (g: number) => Float32Array {
  const cache = new Map<number, Float32Array>();
  return (g) => {
    let w = cache.get(g);
    if (w === undefined) {
      const size = p.n * p.k;
      w = new Float32Array(size);
      for (let i = 0; i < size; i++) w[i] = E4M3_DECODE[p.b[g * size + i]];
      cache.set(g, w);
    }
    return w;
  };
}

/** Rows to check on the CPU: all of them up to `limit`, else each group's first and last plus random rows. */
function sampleRows(p: HostProblem, limit: number): number[] {
  const inGroups: number[] = [];
  for (let g = 0; g < p.groups; g++) {
    if (p.offsets[g + 1] > p.offsets[g]) inGroups.push(p.offsets[g], p.offsets[g + 1] - 1);
  }
  const total = p.offsets[p.groups] - p.offsets[0];
  if (total <= limit) return Array.from({ length: total }, (_, i) => p.offsets[0] + i);
  const rows = new Set(inGroups.slice(0, limit));
  while (rows.size < limit) rows.add(p.offsets[0] + Math.floor(random() * total));
  return [...rows].sort((x, y) => x - y);
}

// ---------------------------------------------------------------------------------------------------
// Comparisons

interface Comparison {
  relError: number;
  bad: number;
  checked: number;
  firstBad: string[];
}

/** One bf16 step at |x| (the gap to the next representable value away from zero). */
function bf16Step(x: number): number {
  const e = Math.floor(Math.log2(Math.max(Math.abs(x), 2 ** -126)));
  return 2 ** (e - 7);
}

/**
 * Compares output rows with expected rows (fp32 spec values). fp32 output: an element is bad when off
 * by more than 1e-2 relative to the row's RMS. bf16 output: bad when further than one bf16 step plus
 * that bound from the expected value rounded to bf16.
 */
function compareRows(
  got: (row: number, col: number) => number,
  want: Map<number, Float32Array>,
  outDtype: GemmOutDtype,
): Comparison {
  let num = 0;
  let den = 0;
  let bad = 0;
  let checked = 0;
  const firstBad: string[] = [];
  for (const [row, ref] of want) {
    let rms = 0;
    for (const v of ref) rms += v * v;
    rms = Math.sqrt(rms / ref.length);
    for (let col = 0; col < ref.length; col++) {
      const g = got(row, col);
      const r = ref[col];
      const d = g - r;
      num += d * d;
      den += r * r;
      checked++;
      const isBad =
        outDtype === "bf16"
          ? // FP8 wgmma accumulates with less than fp32 precision (DeepSeek-V3 reports ~14 bits), so
            // allow the fp32 bound on top of one bf16 step.
            !(Math.abs(g - bf16BitsToF32(f32ToBf16Bits(r))) <= bf16Step(r) * 1.0001 + 1e-2 * rms)
          : !(Math.abs(d) <= 1e-2 * rms);
      if (isBad) {
        bad++;
        if (firstBad.length < 4) firstBad.push(`[${row}, ${col}] got ${g} want ${r}`);
      }
    }
  }
  return { relError: den > 0 ? Math.sqrt(num / den) : Number.NaN, bad, checked, firstBad };
}

/** Reads element (row, col) of a host copy of out. */
function reader(host: Float32Array | Uint16Array, n: number, outDtype: GemmOutDtype) {
  return outDtype === "bf16"
    ? (row: number, col: number) => bf16BitsToF32((host as Uint16Array)[row * n + col])
    : (row: number, col: number) => (host as Float32Array)[row * n + col];
}

/** Rows of groups must hold no poison (0xFF bytes), rows of no group nothing but poison. */
function poisonProblems(p: HostProblem, host: Float32Array | Uint16Array, outDtype: GemmOutDtype): string[] {
  const bytes = new Uint8Array(host.buffer, host.byteOffset, host.byteLength);
  const elementBytes = outDtype === "bf16" ? 2 : 4;
  const rowBytes = p.n * elementBytes;
  const problems: string[] = [];
  let unwritten = 0;
  let overwritten = 0;
  for (let row = 0; row < p.mTotal; row++) {
    const inGroup = groupOfRow(p, row) >= 0;
    for (let col = 0; col < p.n; col++) {
      const at = row * rowBytes + col * elementBytes;
      let poison = true;
      for (let i = 0; i < elementBytes; i++) poison &&= bytes[at + i] === 0xff;
      if (inGroup && poison) {
        if (unwritten++ < 3) problems.push(`row ${row} col ${col} of a group was never written`);
      } else if (!inGroup && !poison) {
        if (overwritten++ < 3) problems.push(`row ${row} col ${col} belongs to no group but was written`);
      }
    }
  }
  if (unwritten > 3) problems.push(`... ${unwritten} unwritten elements in all`);
  if (overwritten > 3) problems.push(`... ${overwritten} elements written outside every group`);
  return problems;
}

// ---------------------------------------------------------------------------------------------------
// Plans, variants, argument checks (no GPU needed)

const TOKEN_COUNTS = [1, 7, 64, 129, 512, 2048, 8192, 32768];

describe("grouped GEMM plan and variants", () => {
  test("every plan the presets can produce is a variant the CI compiles", () => {
    const compiled = new Set(variants.map((v) => describeDefines(v.defines)));
    for (const preset of Object.values(PRESETS)) {
      for (const { n, k } of presetGemmShapes(preset.hidden, preset.intermediate)) {
        for (const groups of [preset.numExperts / preset.ranks, 1]) {
          for (const tokens of TOKEN_COUNTS) {
            const mTotal = groups === 1 ? tokens : tokens * preset.topK;
            for (const outDtype of ["fp32", "bf16"] as const) {
              for (const tile of [undefined, ...GEMM_TILE_NAMES]) {
                const plan = planGroupedGemm({ mTotal, n, k, groups, outDtype }, { tile });
                const key = describeDefines(plan.defines);
                assert.ok(compiled.has(key), `${preset.name} n=${n} k=${k} G=${groups} T=${tokens}: ${key}`);
              }
            }
          }
        }
      }
    }
  });

  test("every variant fits the 227 KB opt-in, with at least 4 stages", () => {
    for (const v of variants) {
      const d = v.defines;
      const tile = Object.values(GEMM_TILES).find(
        (t) => t.blockM === d.BLOCK_M && t.blockN === d.BLOCK_N && t.mathWarpgroups === d.NUM_MATH_WARPGROUPS,
      );
      assert.ok(tile, `no tile for ${describeDefines(d)}`);
      const bytes = gemmSharedBytes(tile, d.NUM_STAGES, d.K, d.NUM_GROUPS);
      assert.ok(bytes <= SM90_SHARED_OPTIN_BYTES, `${describeDefines(d)}: ${bytes} B`);
      assert.ok(d.NUM_STAGES >= 4, `${describeDefines(d)}: ${d.NUM_STAGES} stages`);
      assert.equal(d.N % d.BLOCK_N, 0);
    }
  });

  test("small groups get 64-row tiles, large ones 128-row tiles; the grid never exceeds the SMs", () => {
    const decode = planGroupedGemm({ mTotal: 6 * 16, n: 4096, k: 4096, groups: 256 });
    assert.equal(decode.tile.blockM, 64);
    const prefill = planGroupedGemm({ mTotal: 256 * 512, n: 4096, k: 4096, groups: 256 });
    assert.equal(prefill.tile.blockM, 128);
    assert.equal(prefill.grid, 132);
    const tiny = planGroupedGemm({ mTotal: 1, n: 256, k: 128, groups: 8 });
    assert.ok(tiny.grid >= 1 && tiny.grid <= 132);
    assert.equal(planGroupedGemm({ mTotal: 0, n: 256, k: 128, groups: 8 }).grid, 1);
    for (const p of [decode, prefill, tiny]) {
      assert.ok(p.sharedBytes <= SM90_SHARED_OPTIN_BYTES && p.stages >= 2, JSON.stringify(p.defines));
      assert.ok(p.estimate.us > 0, "estimate");
    }
    assert.equal(groupedGemmFloorUs(4.3e12, 0), 1e6); // 4.3 TB of reads take one second
  });

  test("a plan prints as one line naming its tile, depth, grid and estimate", () => {
    const plan = planGroupedGemm({ mTotal: 256 * 512, n: 4096, k: 4096, groups: 256, outDtype: "bf16" });
    const line = formatGroupedGemmPlan(plan);
    assert.ok(!line.includes("\n"), line);
    assert.ok(line.startsWith(`${plan.tile.name} × ${plan.stages} stages, ${plan.threads} threads`), line);
    assert.match(line, /grid 132, bf16 out; est\. [\d.]+ µs/);
  });

  test("bad problems and operands are named in the error", () => {
    assert.throws(
      () => planGroupedGemm({ mTotal: 8, n: 200, k: 128, groups: 1 }),
      /n must be a positive multiple of 128/,
    );
    assert.throws(
      () => planGroupedGemm({ mTotal: 8, n: 256, k: 100, groups: 1 }),
      /k must be a multiple of 128/,
    );
    assert.throws(() => planGroupedGemm({ mTotal: 8, n: 256, k: 128, groups: 0 }), /groups must be/);
    assert.throws(
      () => planGroupedGemm({ mTotal: 8, n: 128, k: 128, groups: 1 }, { tile: "m64n256" }),
      /no tile "m64n256" fits/,
    );
    const t = (dtype: TensorLike["dtype"], shape: number[]): TensorLike => ({ dtype, shape });
    const good: GroupedGemmArgs<TensorLike> = {
      a: t("fp8_e4m3", [10, 256]),
      aScales: t("fp32", [2, 12]),
      b: t("fp8_e4m3", [3 * 384, 256]),
      bScales: t("fp32", [3, 3, 2]),
      groupOffsets: t("int32", [4]),
      out: t("bf16", [10, 384]),
      mTotal: 10,
      n: 384,
      k: 256,
      groups: 3,
    };
    assert.equal(validateGroupedGemmArgs(good), "bf16");
    assert.equal(
      validateGroupedGemmArgs({ ...good, b: t("fp8_e4m3", [3, 384, 256]), out: t("fp32", [10, 384]) }),
      "fp32",
    );
    assert.throws(
      () => validateGroupedGemmArgs({ ...good, a: t("uint8", [10, 256]) }),
      /a must be fp8_e4m3\[10, 256\]/,
    );
    assert.throws(
      () => validateGroupedGemmArgs({ ...good, aScales: t("fp32", [2, 10]) }),
      /aScales must be fp32\[2, 12\]/,
    );
    assert.throws(() => validateGroupedGemmArgs({ ...good, b: t("fp8_e4m3", [384, 256]) }), /b must be/);
    assert.throws(
      () => validateGroupedGemmArgs({ ...good, bScales: t("fp32", [3, 2, 2]) }),
      /bScales must be/,
    );
    assert.throws(
      () => validateGroupedGemmArgs({ ...good, groupOffsets: t("int32", [3]) }),
      /groupOffsets must be int32\[4\]/,
    );
    assert.throws(() => validateGroupedGemmArgs({ ...good, out: t("fp8_e4m3", [10, 384]) }), /out must be/);
    assert.throws(() => validateGroupedGemmArgs({ ...good, tile: "m32n32" as GemmTileName }), /unknown tile/);
  });

  test("the CPU spec follows blockScaledGemm's rounding on a small problem", () => {
    const p = makeProblem(128, 256, [2, 1], 1, 1);
    const w = weightCache(p);
    for (const row of [1, 2, 3]) {
      const got = specRow(p, row, w);
      const g = groupOfRow(p, row);
      // Same formula in float64 throughout: agrees to fp32 rounding noise.
      for (const col of [0, 77, 127]) {
        let acc = 0;
        let magnitude = 0; // Σ |terms|: fp32 rounding error is relative to it, not to a cancelled sum
        for (let b = 0; b < 2; b++) {
          let partial = 0;
          for (let i = b * 128; i < (b + 1) * 128; i++) {
            const term = E4M3_DECODE[p.a[row * 256 + i]] * E4M3_DECODE[p.b[(g * 128 + col) * 256 + i]];
            partial += term;
            magnitude += Math.abs(term) * p.aScales[b * aScalesRows(p.mTotal) + row] * p.bScales[g * 2 + b];
          }
          acc += partial * p.aScales[b * aScalesRows(p.mTotal) + row] * p.bScales[g * 2 + b];
        }
        assert.ok(
          Math.abs(got[col] - acc) <= 2 ** -20 * magnitude,
          `row ${row} col ${col}: ${got[col]} vs ${acc}`,
        );
      }
    }
  });
});

// ---------------------------------------------------------------------------------------------------
// GPU

interface GpuCase {
  name: string;
  n: number;
  k: number;
  sizes: number[];
  lead?: number;
  tail?: number;
  outDtype: GemmOutDtype;
  /** Tiles to run ("plan" = whatever the plan picks; "plan-1cta": the same on a grid of one CTA). */
  tiles: (GemmTileName | "plan" | "plan-1cta")[];
  /** Rows checked on the CPU (all when the problem has fewer). */
  cpuRows: number;
}

// One CTA walking every tile checks what a wide grid may never exercise on a small problem: the stage
// ring's phases carried from tile to tile and the double-buffered weight scales.
const ALL_TILES: GpuCase["tiles"] = [...GEMM_TILE_NAMES, "plan-1cta"];
const FALLBACK: GemmTileName = "m64n128";

function randomSizes(groups: number, max: number): number[] {
  return Array.from({ length: groups }, () => (random() < 0.2 ? 0 : Math.floor(random() * (max + 1))));
}

const CASES: GpuCase[] = [
  {
    name: "tiny L1 (N=256, K=256), M per group 1..200",
    n: 256,
    k: 256,
    sizes: [1, 7, 64, 129, 0, 200, 3, 65],
    outDtype: "fp32",
    tiles: ALL_TILES,
    cpuRows: 1e9,
  },
  {
    name: "tiny L2 (N=256, K=128: one K block), rows outside groups",
    n: 256,
    k: 128,
    sizes: [5, 0, 0, 64, 1, 127, 0, 33],
    lead: 3,
    tail: 6,
    outDtype: "fp32",
    tiles: ALL_TILES,
    cpuRows: 1e9,
  },
  {
    name: "empty groups around one group holding every row, bf16 out",
    n: 256,
    k: 256,
    sizes: [0, 0, 0, 0, 300, 0, 0, 0],
    outDtype: "bf16",
    tiles: ALL_TILES,
    cpuRows: 1e9,
  },
  {
    name: "384 groups of 0..9 rows (schedule over many groups)",
    n: 256,
    k: 128,
    sizes: randomSizes(384, 9),
    outDtype: "fp32",
    tiles: ALL_TILES,
    cpuRows: 1e9,
  },
  {
    name: "flash L2 shape (N=4096, K=2048), M per group 512 and 4096, bf16 out",
    n: 4096,
    k: 2048,
    sizes: [512, 4096],
    outDtype: "bf16",
    tiles: ALL_TILES,
    cpuRows: 48,
  },
  {
    name: "flash L1 shape (N=4096, K=4096), one group of 4096 rows (shared expert)",
    n: 4096,
    k: 4096,
    sizes: [4096],
    outDtype: "fp32",
    tiles: ["plan", FALLBACK],
    cpuRows: 32,
  },
  {
    name: "pro L1 shape (N=6144, K=7168), decode: 1, 7 and 4 rows",
    n: 6144,
    k: 7168,
    sizes: [1, 7, 4],
    tail: 1,
    outDtype: "fp32",
    tiles: ["plan", FALLBACK],
    cpuRows: 1e9,
  },
  {
    name: "pro L2 shape (N=7168, K=3072), 129 and 64 rows",
    n: 7168,
    k: 3072,
    sizes: [129, 64],
    lead: 2,
    outDtype: "bf16",
    tiles: ["plan", FALLBACK],
    cpuRows: 24,
  },
];

describeGpu("grouped GEMM on a GPU", () => {
  let device: Device;

  test("CUDA is available", () => {
    assert.ok(availability.ok, availability.ok ? "" : availability.reason);
    device = openDevice(0);
  });

  // Diagnosis: MEGAMOE_GEMM_CASE (a substring of case names) and MEGAMOE_GEMM_TILES (a comma list)
  // narrow the run, so one failing tile can be studied alone (e.g. under compute-sanitizer).
  const caseFilter = process.env.MEGAMOE_GEMM_CASE;
  const tileFilter = process.env.MEGAMOE_GEMM_TILES?.split(",");
  for (const c of CASES.filter((x) => caseFilter === undefined || x.name.includes(caseFilter))) {
    test(c.name, () => {
      const p = makeProblem(c.n, c.k, c.sizes, c.lead ?? 0, c.tail ?? 0);
      const kb = c.k / QUANT_BLOCK;
      const tensors: DeviceTensor[] = [];
      const upload = <T extends DeviceTensor>(t: T): T => {
        tensors.push(t);
        return t;
      };
      const failures: string[] = [];
      try {
        const a = upload(DeviceTensor.fromHost(device, "fp8_e4m3", [p.mTotal, c.k], p.a));
        const aScales = upload(DeviceTensor.fromHost(device, "fp32", [kb, aScalesRows(p.mTotal)], p.aScales));
        const b = upload(DeviceTensor.fromHost(device, "fp8_e4m3", [p.groups * c.n, c.k], p.b));
        const bScales = upload(
          DeviceTensor.fromHost(device, "fp32", [p.groups, c.n / QUANT_BLOCK, kb], p.bScales),
        );
        const groupOffsets = upload(DeviceTensor.fromHost(device, "int32", [p.groups + 1], p.offsets));
        const out = upload(DeviceTensor.empty(device, c.outDtype, [p.mTotal, c.n]));
        const base = {
          a,
          aScales,
          b,
          bScales,
          groupOffsets,
          out,
          mTotal: p.mTotal,
          n: c.n,
          k: c.k,
          groups: p.groups,
        };

        const rows = sampleRows(p, c.cpuRows);
        const weights = weightCache(p);
        const expected = new Map(rows.map((r) => [r, specRow(p, r, weights)] as const));

        // The CUDA-core reference kernel: checks the operand plumbing, then serves as the all-rows oracle.
        out.fill(0xff);
        groupedGemmFp8Reference(device, base, null);
        const refHost = out.toHost() as Float32Array | Uint16Array;
        const refRead = reader(refHost, c.n, c.outDtype);
        const refVsCpu = compareRows(refRead, expected, c.outDtype);
        const refPoison = poisonProblems(p, refHost, c.outDtype);
        console.log(
          `  ${c.name} | reference kernel: vs CPU ${refVsCpu.relError.toExponential(2)} on ${rows.length} rows, ${refVsCpu.bad} bad`,
        );
        if (
          !(refVsCpu.relError < 1e-3 || c.outDtype === "bf16") ||
          refVsCpu.bad > 0 ||
          refPoison.length > 0
        ) {
          failures.push(
            `reference kernel: rel ${refVsCpu.relError}, ${refVsCpu.bad} bad ${refVsCpu.firstBad.join("; ")} ${refPoison.join("; ")}`,
          );
        }
        const allRows = new Map<number, Float32Array>();
        for (let r = 0; r < p.mTotal; r++) {
          if (groupOfRow(p, r) < 0) continue;
          const v = new Float32Array(c.n);
          for (let col = 0; col < c.n; col++) v[col] = refRead(r, col);
          allRows.set(r, v);
        }

        for (const tile of c.tiles.filter((t) => tileFilter === undefined || tileFilter.includes(t))) {
          const args: GroupedGemmArgs =
            tile === "plan" ? base : tile === "plan-1cta" ? { ...base, maxCtas: 1 } : { ...base, tile };
          out.fill(0xff);
          const plan = groupedGemmFp8(device, args, null);
          const how = tile === "plan" ? ", planned" : tile === "plan-1cta" ? ", planned, 1 CTA" : "";
          const label = `${plan.tile.name} (${plan.stages} stages${how})`;
          const stall = takeGroupedGemmStatus(device);
          if (stall) {
            failures.push(`${label}: pipeline stalled ${JSON.stringify(stall)}`);
            continue;
          }
          const host = out.toHost() as Float32Array | Uint16Array;
          const read = reader(host, c.n, c.outDtype);
          const vsCpu = compareRows(read, expected, c.outDtype);
          // Against the reference kernel on every row (fp32 vs fp32; bf16 elements may differ by one step).
          const vsRef = compareRows(read, allRows, c.outDtype === "bf16" ? "bf16" : "fp32");
          const poison = poisonProblems(p, host, c.outDtype);
          console.log(
            `  ${c.name} | ${label}: vs CPU ${vsCpu.relError.toExponential(2)} (${rows.length} rows, ${vsCpu.bad} bad), ` +
              `vs reference kernel ${vsRef.relError.toExponential(2)} (${allRows.size} rows, ${vsRef.bad} bad)`,
          );
          const cpuLimit = c.outDtype === "bf16" ? 4e-3 : 1e-3;
          if (!(vsCpu.relError < cpuLimit) || vsCpu.bad > 0) {
            failures.push(
              `${label} vs CPU: rel ${vsCpu.relError}, ${vsCpu.bad}/${vsCpu.checked} bad: ${vsCpu.firstBad.join("; ")}`,
            );
          }
          if (!(vsRef.relError < cpuLimit) || vsRef.bad > 0) {
            failures.push(
              `${label} vs reference kernel: rel ${vsRef.relError}, ${vsRef.bad}/${vsRef.checked} bad: ${vsRef.firstBad.join("; ")}`,
            );
          }
          if (poison.length > 0) failures.push(`${label} poison: ${poison.join("; ")}`);
        }
      } finally {
        for (const t of tensors) t.dispose();
      }
      assert.deepEqual(failures, [], `${c.name}:\n  ${failures.join("\n  ")}`);
    });
  }

  test("mTotal = 0 launches nothing", () => {
    const groups = 4;
    const made = [
      DeviceTensor.empty(device, "fp8_e4m3", [0, 128]),
      DeviceTensor.empty(device, "fp32", [1, 0]),
      DeviceTensor.empty(device, "fp8_e4m3", [groups * 256, 128]),
      DeviceTensor.empty(device, "fp32", [groups, 2, 1]),
      DeviceTensor.fromHost(device, "int32", [groups + 1], new Int32Array(groups + 1)),
      DeviceTensor.empty(device, "fp32", [0, 256]),
    ] as const;
    try {
      const [a, aScales, b, bScales, groupOffsets, out] = made;
      const args = { a, aScales, b, bScales, groupOffsets, out, mTotal: 0, n: 256, k: 128, groups };
      assert.equal(groupedGemmFp8(device, args, null).grid, 1);
      groupedGemmFp8Reference(device, args, null);
      assert.equal(takeGroupedGemmStatus(device), null);
    } finally {
      for (const t of made) t.dispose();
    }
  });
});
