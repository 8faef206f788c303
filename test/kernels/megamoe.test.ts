/**
 * The fused kernel's host-side facts that need no GPU: which shapes it takes, its shared-memory layout
 * and stage count on every preset, the specializations CI compiles, and the layer's pipeline choice.
 */
import assert from "node:assert/strict";
import { readdirSync, readFileSync } from "node:fs";
import path from "node:path";
import { describe, test } from "node:test";
import { describeLayerWeights } from "../../src/cli/run.js";
import { PRESETS, resolveConfig } from "../../src/config/config.js";
import { collectIncludes, includeDir, packageRoot, resolveKernelSource } from "../../src/cuda/jit.js";
import {
  FUSED_TRACE_FIELDS,
  FUSED_TRACE_WORDS,
  fusedLayerProblem,
} from "../../src/kernels/megamoe/megamoe.js";
import {
  epVariants,
  FUSED_BLOCK_MS,
  FUSED_COUNTER_WORDS,
  FUSED_FP4_SWAP_MAX_STAGES,
  FUSED_SWAP_MAX_STAGES,
  fusedDefines,
  fusedExpandImageBytes,
  fusedFp4Registers,
  fusedMaxStages,
  fusedSharedBytes,
  fusedStages,
  fusedThreads,
  variants,
} from "../../src/kernels/megamoe/megamoe.variants.js";
import {
  describeFusedPlan,
  FUSED_EXPAND_MIN_ROWS,
  fusedBlockM,
  fusedBlockMsUpTo,
  fusedExpandFromTokens,
  fusedTilesUpTo,
  planFusedLaunch,
} from "../../src/kernels/megamoe/plan.js";
import { InputError, MoELayer } from "../../src/layer.js";
import { GeneratedWeights } from "../../src/weights/generate.js";

const OPTIN = 232_448;

describe("fused MoE kernel: host-side facts", () => {
  test("every preset fits 227 KB with at least 3 stages, and one more stage would not fit", () => {
    for (const preset of Object.values(PRESETS)) {
      for (const blockM of FUSED_BLOCK_MS) {
        const stages = fusedStages(preset, blockM);
        const what = `${preset.name} BLOCK_M ${blockM}`;
        assert.ok(stages >= 3, `${what}: ${stages} stages`);
        assert.ok(fusedSharedBytes(preset, stages, blockM) <= OPTIN, what);
        const cap = fusedMaxStages(preset, blockM);
        if (stages < cap)
          assert.ok(fusedSharedBytes(preset, stages + 1, blockM) > OPTIN, `${what}: could use more`);
      }
      assert.equal(fusedLayerProblem(preset), null, preset.name);
    }
  });

  test("block M: swap-AB 16 up to 6 rows per routed expert (FP4: 12), 32 up to 16 (32), 64 below 64, else 128", () => {
    const ep8 = resolveConfig("flash-ep8"); // 32 experts, top-6
    assert.equal(fusedBlockM(ep8, 1), 16);
    assert.equal(fusedBlockM(ep8, 32), 16); // 6 rows per expert
    assert.equal(fusedBlockM(ep8, 33), 32);
    assert.equal(fusedBlockM(ep8, 85), 32); // 15.9
    assert.equal(fusedBlockM(ep8, 86), 64);
    assert.equal(fusedBlockM(ep8, 341), 64); // 341 · 6 / 32 = 63.9
    assert.equal(fusedBlockM(ep8, 342), 128);
    assert.equal(fusedBlockM(resolveConfig("flash"), 256), 16); // 6 rows per expert
    assert.equal(fusedBlockM(resolveConfig("flash"), 2048), 64); // 48 rows per expert
    assert.equal(fusedBlockM(resolveConfig("flash"), 8192), 128);
    assert.equal(fusedBlockM(resolveConfig("pro"), 4095), 64);
    assert.equal(fusedBlockM(resolveConfig("pro"), 4096), 128); // exactly 64 rows per expert
    assert.deepEqual(fusedBlockMsUpTo(ep8, 32), [16]);
    assert.deepEqual(fusedBlockMsUpTo(ep8, 8192), [16, 32, 64, 128]);
    assert.deepEqual(fusedBlockMsUpTo(resolveConfig("flash"), 1000), [16, 32, 64]);
    // FP4 experts: 16 up to 12 rows, 32 up to 30.
    const ep8fp4 = resolveConfig("flash-ep8", { expertFormat: "fp4" });
    assert.equal(fusedBlockM(ep8fp4, 64), 16); // 12 rows per expert
    assert.equal(fusedBlockM(ep8fp4, 65), 32);
    assert.equal(fusedBlockM(ep8fp4, 160), 32); // 30 rows per expert
    assert.equal(fusedBlockM(ep8fp4, 161), 64); // 30.2
    assert.equal(fusedBlockM(resolveConfig("flash", { expertFormat: "fp4" }), 1280), 32); // 30
    assert.equal(fusedBlockM(resolveConfig("flash", { expertFormat: "fp4" }), 1365), 64); // 31.99
    assert.equal(fusedBlockM(ep8fp4, 341), 64);
    assert.equal(fusedBlockM(resolveConfig("pro", { expertFormat: "fp4" }), 4096), 128);
  });

  test("the host's mirrors of the kernel's trace and counter enums match its headers", () => {
    const source = ["megamoe_trace.cuh", "megamoe_layout.cuh"]
      .map((h) => readFileSync(resolveKernelSource(`megamoe/${h}`), "utf8"))
      .join("\n");
    const enumBody = (name: string): string => {
      const m = source.match(new RegExp(`enum ${name} : int \\{([^}]*)\\}`));
      assert.ok(m, `enum ${name} in the kernel's headers`);
      return (m[1] as string).replace(/\/\/.*$/gm, ""); // without the comments
    };
    const trace = enumBody("Trace");
    const names = [...trace.matchAll(/kTrace(\w+)/g)].map((m) => m[1] as string).filter((n) => n !== "Words");
    const fields = names.map((n) => n[0]?.toLowerCase() + n.slice(1));
    assert.deepEqual(fields, [...FUSED_TRACE_FIELDS]);
    assert.equal(Number(trace.match(/kTraceWords = (\d+)/)?.[1]), FUSED_TRACE_WORDS);
    assert.ok(FUSED_TRACE_FIELDS.length <= FUSED_TRACE_WORDS);
    const counter = enumBody("Counter");
    assert.equal(Number(counter.match(/kCounterWords = (\d+)/)?.[1]), FUSED_COUNTER_WORDS);
    assert.ok([...counter.matchAll(/\bk\w+,/g)].length <= FUSED_COUNTER_WORDS);
  });

  test("the JIT's cache key covers every header of the kernel, and the package ships them", () => {
    const source = resolveKernelSource("megamoe/megamoe.cu");
    const dir = path.dirname(source);
    const { files, dynamic } = collectIncludes(source, [dir, includeDir()]);
    assert.equal(dynamic, false);
    for (const h of readdirSync(dir).filter((f) => f.endsWith(".cuh")))
      assert.ok(files.includes(path.join(dir, h)), `${h} is followed from megamoe.cu`);
    const pkg = JSON.parse(readFileSync(path.join(packageRoot(), "package.json"), "utf8")) as {
      files: string[];
    };
    assert.ok(pkg.files.includes("src/kernels/**/*.cuh"), 'package.json "files" ships src/kernels/**/*.cuh');
  });

  test("a plan names its block M, stages, shared memory and grid", () => {
    const ep8 = resolveConfig("flash-ep8");
    const p = planFusedLaunch(ep8, 64, 132);
    assert.equal(p.blockM, 32);
    assert.equal(p.swapAB, true);
    assert.equal(p.stages, fusedStages(ep8, 32));
    assert.equal(p.sharedBytes, fusedSharedBytes(ep8, p.stages, 32));
    assert.deepEqual(p.defines, fusedDefines(ep8, 32));
    assert.equal(planFusedLaunch(ep8, 64, 132, 128).blockM, 128);
    assert.equal(
      describeFusedPlan(p),
      `T=64 BLOCK_M=32 swap-AB stages=${p.stages} smem=${p.sharedBytes} B grid=132×384`,
    );
    assert.throws(() => planFusedLaunch(ep8, 64, 132, 48 as 64), /blockM must be "auto" or one of/);
  });

  test("shapes it cannot run are named; a CPU layer has no GPU pipeline to choose", () => {
    const narrow = resolveConfig("tiny", { hidden: 384 });
    assert.match(String(fusedLayerProblem(narrow)), /hidden \(384\) must be a multiple of 256/);
    const cpu = new MoELayer(new GeneratedWeights(narrow, 1));
    assert.equal(cpu.pipeline, null);
    assert.throws(
      () =>
        new MoELayer(new GeneratedWeights(resolveConfig("tiny"), 1), { backend: "cpu", pipeline: "fused" }),
      (e: unknown) => e instanceof InputError && /pipeline applies to the "cuda" backend/.test(e.message),
    );
  });

  test("CI compiles one specialization per preset, scale format, expert format and block M, spills forbidden", () => {
    // Then the FP4 expand variant (block M 128) and the EP build's (test/parallel/fused-ep.test.ts).
    assert.equal(
      variants.length,
      2 * 2 * FUSED_BLOCK_MS.length * Object.keys(PRESETS).length +
        2 * Object.keys(PRESETS).length +
        epVariants.length,
    );
    assert.ok(variants.every((v) => v.noSpill));
    assert.deepEqual(
      { ...fusedDefines(resolveConfig("flash"), 128) },
      {
        BLOCK_M: 128,
        HIDDEN: 4096,
        INTER: 2048,
        SHARED_INTER: 2048,
        NUM_EXPERTS: 256,
        TOP_K: 6,
        NUM_STAGES: 4,
        SCALE_UE8M0: 0,
        SHARED_BYTES: fusedSharedBytes(resolveConfig("flash"), 4, 128),
      },
    );
    assert.equal(fusedStages(resolveConfig("flash"), 64), 5);
    // FP4 experts: the B_FP4 build; a stage adds the packed rows and their words (256 rows of 64 + 4
    // bytes), a barrier and a stage-kind word (the packed rows' 1024-byte alignment and the staging
    // area's 16-byte one aside).
    const flash4 = resolveConfig("flash", { expertFormat: "fp4" });
    assert.equal(fusedDefines(flash4, 16).B_FP4, 1);
    assert.equal(fusedDefines(resolveConfig("flash"), 16).B_FP4, undefined);
    const extra = fusedSharedBytes(flash4, 3, 128) - fusedSharedBytes(resolveConfig("flash"), 3, 128);
    assert.ok(Math.abs(extra - 3 * (256 * 68 + 8 + 4)) < 1024 + 16, `FP4 adds ${extra} bytes`);
    assert.equal(fusedStages(flash4, 64), 3);
    // Swap-AB FP4 tiles convert in registers: a stage is A, its scales, the packed rows and their words
    // (16 + 1 KB), with no e4m3 tile, fp32 scales, `loaded` barrier or stage kind, so the ring runs to 8.
    assert.equal(fusedMaxStages(flash4, 16), FUSED_FP4_SWAP_MAX_STAGES);
    assert.equal(fusedMaxStages(resolveConfig("flash"), 16), FUSED_SWAP_MAX_STAGES);
    assert.ok(fusedFp4Registers(flash4, 32) && !fusedFp4Registers(flash4, 64));
    assert.ok(!fusedFp4Registers(resolveConfig("flash"), 16));
    for (const blockM of [16, 32] as const) {
      const stage = blockM * 128 + (blockM === 16 ? 128 : 256) + 256 * (64 + 4);
      const step = fusedSharedBytes(flash4, 5, blockM) - fusedSharedBytes(flash4, 4, blockM);
      assert.ok(
        Math.abs(step - stage - 16) <= 1024,
        `BLOCK_M ${blockM}: a stage adds ${step}, want ~${stage}`,
      );
      assert.equal(fusedStages(flash4, blockM), 8);
      assert.ok(fusedSharedBytes(flash4, 8, blockM) <= OPTIN);
    }
    // BLOCK_M 16 runs four math warpgroups (640 threads): eight more warps' staging areas (16 rows at
    // the 144-byte pitch) and amax rows.
    assert.equal(fusedThreads(flash4, 16), 640);
    for (const [c, m] of [
      [flash4, 32],
      [flash4, 64],
      [resolveConfig("flash"), 16],
    ] as const) {
      assert.equal(fusedThreads(c, m), 384, `${c.name} BLOCK_M ${m}`);
    }
    assert.equal(planFusedLaunch(flash4, 1, 132).threads, 640);
    const wide = fusedSharedBytes(flash4, 8, 16) - fusedSharedBytes(resolveConfig("flash"), 8, 16);
    const narrowStage = 16 * 128 + 128 + 256 * 68;
    const fp8Stage = 16 * 128 + 128 + 256 * 128;
    assert.ok(
      Math.abs(wide - (8 * (narrowStage - fp8Stage) + 8 * 16 * 144 + 8 * 16 * 4)) <= 1024 + 16,
      `four warpgroups add ${wide}`,
    );
  });

  test("the FP4 expand variant: FP8's stages and a worker buffer; picked from 384 rows per expert", () => {
    const ep8 = resolveConfig("flash-ep8");
    const ep8fp4 = resolveConfig("flash-ep8", { expertFormat: "fp4" });
    // FP8's stages; the workers' buffer (packed rows, tile and words: 49 KB) leaves three.
    const stages = fusedStages(ep8fp4, 128, true);
    assert.equal(stages, 3);
    const extra = fusedSharedBytes(ep8fp4, stages, 128, true) - fusedSharedBytes(ep8, stages, 128);
    const want = 49 * 1024 + 8;
    assert.ok(Math.abs(extra - want) <= 1024, `expand adds ${extra} bytes, want ~${want}`);
    assert.equal(fusedDefines(ep8fp4, 128, true).FP4_EXPAND, 1);
    assert.equal(fusedDefines(ep8fp4, 128).FP4_EXPAND, undefined);
    assert.throws(() => fusedDefines(ep8fp4, 32, true), /128-row tiles, not 32/);
    assert.throws(() => fusedDefines(ep8fp4, 64, true), /128-row tiles, not 64/);
    assert.throws(() => fusedDefines(ep8, 128, true), /FP4 experts/);
    // 32 experts × (16 × 32 L1 + 16 × 16 L2 stages) × 32 KB: 0.81 GB.
    assert.equal(fusedExpandImageBytes(ep8fp4), 32 * (16 * 32 + 16 * 16) * 32 * 1024);
    const tokens = Math.ceil((FUSED_EXPAND_MIN_ROWS * ep8fp4.numExperts) / ep8fp4.topK); // 2048
    const p = planFusedLaunch(ep8fp4, tokens, 132);
    assert.ok(p.expand && p.blockM === 128);
    assert.match(describeFusedPlan(p), /BLOCK_M=128 expand stages=3 /);
    assert.equal(planFusedLaunch(ep8fp4, tokens - 1, 132).expand, false);
    assert.equal(planFusedLaunch(ep8fp4, tokens - 1, 132, 128, true).expand, true);
    assert.equal(planFusedLaunch(ep8fp4, tokens, 132, "auto", false).expand, false);
    assert.equal(planFusedLaunch(ep8fp4, 8, 132, "auto", true).expand, false); // swap-AB tiles never expand
    assert.equal(planFusedLaunch(ep8fp4, 8, 132, 64, true).expand, false); // nor 64-row ones
    assert.equal(planFusedLaunch(ep8fp4, 8, 132, 128, true).expand, true);
    assert.throws(() => planFusedLaunch(ep8, 8192, 132, "auto", true), /fp4Expand applies to FP4 experts/);
    assert.equal(planFusedLaunch(ep8, 8192, 132).expand, false);
    assert.deepEqual(fusedTilesUpTo(ep8fp4, 8192), [
      { blockM: 16, expand: false },
      { blockM: 32, expand: false },
      { blockM: 64, expand: false },
      { blockM: 128, expand: false },
      { blockM: 128, expand: true },
    ]);
    assert.deepEqual(
      fusedTilesUpTo(ep8, 8192).map((t) => t.expand),
      fusedBlockMsUpTo(ep8, 8192).map(() => false),
    );
    // What `megamoe run` reports beside the weights.
    assert.equal(fusedExpandFromTokens(ep8fp4, 8192), tokens);
    assert.equal(fusedExpandFromTokens(ep8fp4, tokens - 1), null);
    assert.equal(fusedExpandFromTokens(resolveConfig("flash", { expertFormat: "fp4" }), 8192), null);
    assert.match(
      describeLayerWeights({ ...ep8fp4, maxTokens: 8192 }),
      /453\.4 MB on a GPU \(\+ 805\.3 MB of e4m3 stages from T = 2048\)$/,
    );
    assert.match(describeLayerWeights({ ...ep8fp4, maxTokens: 2047 }), /on a GPU$/);
  });
});
