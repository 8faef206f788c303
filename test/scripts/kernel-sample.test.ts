/** The kernel check's default sample (scripts/kernel-sample.ts): what it keeps, and --all's every variant. */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { test } from "node:test";
import { codePath, compileJobs, SMALL_FAMILY, sampleIndices } from "../../scripts/kernel-sample.js";
import { GEMM_TILES } from "../../src/kernels/gemm/fp8_grouped_gemm.variants.js";
import { FUSED_BLOCK_MS } from "../../src/kernels/megamoe/megamoe.variants.js";
import type { KernelVariant } from "../../src/kernels/variants.js";
import { repoRoot } from "../helpers/cli.js";

const all = await compileJobs(true);
const sample = await compileJobs(false);
const of = (jobs: typeof all.jobs, source: string) =>
  jobs.filter((j) => j.source === source).map((j) => j.variant);
const MEGAMOE = "src/kernels/megamoe/megamoe.cu";
const GEMM = "src/kernels/gemm/fp8_grouped_gemm.cu";

test("--all is every variant of every source, each once", () => {
  assert.equal(all.jobs.length, all.variantCount);
  assert.ok(all.sources.length >= 11, `${all.sources.length} sources`);
  const keys = all.jobs.map((j) => `${j.source} ${JSON.stringify(j.variant.defines)}`);
  assert.equal(new Set(keys).size, keys.length);
});

test("the sample keeps every source, a subset of its variants, and is much shorter", () => {
  assert.equal(sample.variantCount, all.variantCount);
  const sources = (jobs: typeof all.jobs) => [...new Set(jobs.map((j) => j.source))].sort();
  assert.deepEqual(sources(sample.jobs), sources(all.jobs));
  for (const j of sample.jobs)
    assert.ok(all.jobs.some((a) => a.source === j.source && a.variant === j.variant));
  assert.ok(sample.jobs.length * 3 < all.jobs.length, `${sample.jobs.length} of ${all.jobs.length}`);
});

test("the sample keeps every code path of every source: each variant's path is compiled once", () => {
  for (const source of new Set(all.jobs.map((j) => j.source))) {
    const paths = (vs: readonly KernelVariant[]) => new Set(vs.map(codePath));
    assert.deepEqual(paths(of(sample.jobs, source)), paths(of(all.jobs, source)), source);
  }
});

test("small families compile whole", () => {
  for (const source of new Set(all.jobs.map((j) => j.source))) {
    const variants = of(all.jobs, source);
    if (variants.length <= SMALL_FAMILY)
      assert.equal(of(sample.jobs, source).length, variants.length, source);
  }
});

test("megamoe.cu: every block M × expert format × scale format, one-rank and expert-parallel, and expand", () => {
  const picked = of(sample.jobs, MEGAMOE);
  const has = (pred: (d: KernelVariant["defines"]) => boolean) => picked.some((v) => pred(v.defines));
  for (const blockM of FUSED_BLOCK_MS) {
    for (const fp4 of [false, true]) {
      for (const ep of [false, true]) {
        assert.ok(
          has(
            (d) =>
              d.BLOCK_M === blockM &&
              (d.B_FP4 === 1) === fp4 &&
              (d.EP_RANKS !== undefined) === ep &&
              d.FP4_EXPAND === undefined,
          ),
          `BLOCK_M ${blockM} ${fp4 ? "fp4" : "fp8"} ${ep ? "EP" : "one rank"}`,
        );
      }
      for (const ue8m0 of [0, 1]) {
        assert.ok(
          has((d) => d.BLOCK_M === blockM && (d.B_FP4 === 1) === fp4 && d.SCALE_UE8M0 === ue8m0),
          `BLOCK_M ${blockM} ${fp4 ? "fp4" : "fp8"} SCALE_UE8M0=${ue8m0}`,
        );
      }
    }
  }
  assert.ok(has((d) => d.FP4_EXPAND === 1 && d.EP_RANKS === undefined));
  assert.ok(has((d) => d.FP4_EXPAND === 1 && d.EP_RANKS !== undefined));
});

test("fp8_grouped_gemm.cu: every tile of each weight format, with fp32 and bf16 output", () => {
  const picked = of(sample.jobs, GEMM);
  const tilesIn = (vs: readonly KernelVariant[], fp4: boolean, bf16: number) =>
    new Set(
      vs
        .filter((v) => (v.defines.B_FP4 === 1) === fp4 && v.defines.OUT_BF16 === bf16)
        .map((v) => `m${v.defines.BLOCK_M}n${v.defines.BLOCK_N}w${v.defines.NUM_MATH_WARPGROUPS}`),
    );
  for (const fp4 of [false, true]) {
    for (const bf16 of [0, 1]) {
      const want = tilesIn(of(all.jobs, GEMM), fp4, bf16);
      assert.deepEqual(tilesIn(picked, fp4, bf16), want);
      if (!fp4) assert.equal(want.size, Object.keys(GEMM_TILES).length);
    }
  }
});

test("the rule: sizes do not make a path, EP_RANKS only as expert-parallel or not, first variant kept", () => {
  const v = (defines: Record<string, number>): KernelVariant => ({ defines, noSpill: true });
  assert.equal(codePath(v({ BLOCK_M: 64, HIDDEN: 256 })), codePath(v({ HIDDEN: 7168, BLOCK_M: 64 })));
  assert.notEqual(codePath(v({ BLOCK_M: 64 })), codePath(v({ BLOCK_M: 128 })));
  assert.equal(codePath(v({ EP_RANKS: 2 })), codePath(v({ EP_RANKS: 8 })));
  assert.notEqual(codePath(v({ EP_RANKS: 2 })), codePath(v({})));
  const family = Array.from({ length: SMALL_FAMILY + 2 }, (_, i) => v({ N: i, OUT_BF16: i % 2 }));
  assert.deepEqual(sampleIndices(family), [0, 1]);
  assert.deepEqual(sampleIndices(family.slice(0, SMALL_FAMILY)), [...Array(SMALL_FAMILY).keys()]);
});

test("kernels:check refuses an argument it does not know, before looking for nvcc", () => {
  const r = spawnSync(process.execPath, ["--import", "tsx", "scripts/compile-kernels.ts", "--al"], {
    cwd: repoRoot,
    encoding: "utf8",
  });
  assert.equal(r.status, 2, r.stderr);
  assert.equal(r.stdout, "");
  assert.match(r.stderr, /^kernels:check: unknown argument --al: expected --all, --table, --no-cache\n$/);
});
