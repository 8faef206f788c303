/**
 * The export manifest without a GPU: its token ranges cover 1 … maxTokens with the plan's choices, the
 * quantization grid's expression equals quantLaunchConfig at every T, every name it uses is defined
 * once, the fused launch's arguments follow the ABI (and, where a CUDA compiler is present, the cubins'
 * own parameter layout), and the writer leaves either the whole folder or nothing.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, test } from "node:test";
import { type MoEConfig, PRESETS, resolveConfig } from "../../src/config/config.js";
import { cubinFunction } from "../../src/cuda/cubin.js";
import { compileKernel, compilerAvailable } from "../../src/cuda/jit.js";
import { DirectoryError } from "../../src/cuda/mkdir.js";
import { writeLayerExport } from "../../src/export/export.js";
import {
  buildManifest,
  ExportError,
  exportKernelJobs,
  type LayerExportOptions,
} from "../../src/export/layer.js";
import {
  argBytes,
  type ExportLaunch,
  type ExportManifest,
  evaluateExpr,
  rangeFor,
} from "../../src/export/manifest.js";
import { FUSED_OPERANDS_BYTES, fusedMapCount } from "../../src/kernels/megamoe/abi.js";
import { fusedBlockM, fusedExpand } from "../../src/kernels/megamoe/plan.js";
import { quantLaunchConfig } from "../../src/kernels/quant/quant.js";

const base: LayerExportOptions = {
  maxTokens: 8192,
  shared: true,
  smCount: 132,
  weightScales: "fp32",
  arch: "sm_90a",
  producer: "test",
};
const fp4 = (name: string) => resolveConfig(name, { expertFormat: "fp4" });
const layers: [string, MoEConfig, Partial<LayerExportOptions>][] = [
  ["flash", PRESETS.flash!, {}],
  ["flash FP4", fp4("flash"), {}],
  ["pro, no shared expert", PRESETS.pro!, { shared: false }],
  ["flash, UE8M0 weight scales, 114 SMs", PRESETS.flash!, { weightScales: "ue8m0", smCount: 114 }],
  ["tiny FP4 to 2048 (expand)", fp4("tiny"), { maxTokens: 2048 }],
];

const launches = (m: ExportManifest): ExportLaunch[] =>
  [
    ...m.prepare,
    ...m.forward.flatMap((r) => r.steps),
    ...Object.values(m.inputConversions).flatMap((c) => c.steps),
  ].filter((s): s is ExportLaunch => s.kind === "launch");

describe("export manifest", () => {
  for (const [label, config, extra] of layers) {
    const opts = { ...base, ...extra };
    for (const registers of [32, 44]) {
      test(`${label}, ${registers} registers: ranges, grids and names`, () => {
        const m = buildManifest(config, opts, registers);
        // The ranges tile 1 … maxTokens in order.
        assert.equal(m.forward[0]!.tokens[0], 1);
        m.forward.forEach((r, i) => {
          assert.ok(r.tokens[0] <= r.tokens[1]);
          if (i > 0) assert.equal(r.tokens[0], m.forward[i - 1]!.tokens[1] + 1);
        });
        assert.equal(m.forward.at(-1)!.tokens[1], opts.maxTokens);
        assert.equal(rangeFor(m, opts.maxTokens + 1), undefined);
        const c = { ...config, numShared: opts.shared ? config.numShared : 0 };
        for (let T = 1; T <= opts.maxTokens; T++) {
          const [quant, fused] = rangeFor(m, T)!.steps as ExportLaunch[];
          const q = quantLaunchConfig(T, config.hidden, opts.smCount, registers);
          assert.equal(evaluateExpr(quant!.grid[0], T), q.blocks, `T = ${T}: quantization blocks`);
          assert.equal(quant!.block[0], q.threads);
          const blockM = fusedBlockM(c, T);
          assert.equal(fused!.kernel, `fused_m${blockM}${fusedExpand(c, T, blockM) ? "x" : ""}`, `T = ${T}`);
        }
        // Every name is defined once, and every use is defined.
        const names = [...m.buffers.map((b) => b.name), ...Object.keys(m.weights), ...Object.keys(m.inputs)];
        assert.equal(new Set(names).size, names.length, "a name defined twice");
        const kernels = new Set(m.kernels.map((k) => k.id));
        const maps = new Set(m.tensorMaps.map((t) => t.id));
        for (const t of m.tensorMaps) assert.ok(names.includes(t.buffer), `map ${t.id} reads ${t.buffer}`);
        for (const l of launches(m)) {
          assert.ok(kernels.has(l.kernel), l.kernel);
          const k = m.kernels.find((x) => x.id === l.kernel)!;
          assert.ok(l.sharedBytes <= k.maxDynamicSharedBytes);
          for (const a of l.args) {
            if (a.kind === "tensorMap") assert.ok(maps.has(a.map), a.map);
            if (a.kind === "pointer" && a.ref !== null) assert.ok(names.includes(a.ref.buffer), a.ref.buffer);
            if (a.kind === "struct")
              for (const f of a.fields)
                if (f.kind === "pointer" && f.ref !== null)
                  assert.ok(names.includes(f.ref.buffer), f.ref.buffer);
          }
        }
        for (const s of m.prepare)
          if (s.kind !== "launch")
            for (const r of [s.dst, ...("src" in s ? [s.src] : [])]) assert.ok(names.includes(r.buffer));
        // Every weight the caller hands over is read by the preparation.
        const read = JSON.stringify(m.prepare);
        for (const w of Object.keys(m.weights))
          assert.ok(read.includes(`"buffer":"${w}"`), `${w} is never read`);
        // The fused launch: its maps, then Operands whole, after the previous grid.
        for (const r of m.forward) {
          const fused = r.steps[1] as ExportLaunch;
          assert.equal(fused.args.length, fusedMapCount(c) + 1);
          const last = fused.args.at(-1)!;
          assert.ok(last.kind === "struct" && last.bytes === FUSED_OPERANDS_BYTES);
          assert.equal(fused.grid[0], opts.smCount);
          assert.equal(fused.programmaticStreamSerialization, true);
        }
        // int64 ids: converted into a buffer of the int32 input's size, one thread per id.
        const ids = m.inputConversions.topk_ids!;
        assert.equal(m.buffers.find((b) => b.name === ids.buffer)!.bytes, 4 * opts.maxTokens * config.topK);
        const convert = ids.steps[0] as ExportLaunch;
        for (const T of [1, 7, opts.maxTokens])
          assert.ok(evaluateExpr(convert.grid[0], T) * convert.block[0] >= T * config.topK);
        assert.deepEqual(JSON.parse(JSON.stringify(m)), m, "the manifest is plain JSON");
      });
    }
  }

  test("bad options are ExportErrors naming the option and the bound", () => {
    const bad: [Record<string, unknown>, RegExp][] = [
      [{ maxToken: 8 }, /unknown export options field maxToken \(did you mean maxTokens\?\)/],
      [{ maxTokens: 0 }, /maxTokens must be an integer in \[1, 65536\], got number 0/],
      [{ smCount: 1.5 }, /smCount must be an integer in \[1, 1024\]/],
      [{ shared: "1" }, /shared must be true or false, got the string "1"/],
      [{ weightScales: "bf16" }, /weightScales must be "fp32" or "ue8m0", got the string "bf16"/],
      [{ arch: "" }, /arch must be a non-empty string/],
    ];
    for (const [change, message] of bad) {
      const opts = { ...base, ...change } as LayerExportOptions;
      assert.throws(
        () => buildManifest(PRESETS.tiny!, opts, 32),
        (e: Error) => e instanceof ExportError && message.test(e.message),
      );
    }
  });

  test("a layer split across ranks is refused", () => {
    assert.throws(
      () => buildManifest({ ...PRESETS.flash!, ranks: 8 }, base, 32),
      (e: Error) => e instanceof ExportError && /one rank of 8/.test(e.message),
    );
  });
});

const cudaCompiler = ["nvcc", "nvrtc"].find((c) => compilerAvailable(c as "nvcc"));
describe("export: the launches' arguments against the cubins", {
  skip: cudaCompiler ? false : "no CUDA compiler",
}, () => {
  test("tiny FP8 and FP4: every launched kernel's parameter sizes", () => {
    for (const config of [PRESETS.tiny!, fp4("tiny")]) {
      const opts = { ...base, maxTokens: 64 };
      const m = buildManifest(config, opts, 32);
      const jobs = exportKernelJobs(config, opts);
      for (const l of launches(m)) {
        const job = jobs.find((j) => j.id === l.kernel)!;
        const fn = cubinFunction(
          compileKernel({ source: job.source, defines: job.defines }).cubin,
          job.function,
        );
        const sizes = l.args.map(argBytes);
        assert.deepEqual(
          fn.params.map((p) => p.bytes),
          sizes,
          `${l.kernel}: the manifest's arguments are not the kernel's parameters`,
        );
      }
    }
  });
});

describe("export writer", () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-export-"));
  after(() => fs.rmSync(dir, { recursive: true, force: true }));
  const manifest = buildManifest(PRESETS.tiny!, { ...base, maxTokens: 64 }, 32);
  const cubins = new Map(manifest.kernels.map((k) => [k.id, new Uint8Array([k.id.length])]));

  test("writes the manifest and one file per cubin, and refuses a non-empty folder unless told", () => {
    const out = path.join(dir, "a");
    writeLayerExport(out, { manifest, cubins });
    assert.deepEqual(JSON.parse(fs.readFileSync(path.join(out, "manifest.json"), "utf8")), manifest);
    for (const k of manifest.kernels) assert.ok(fs.existsSync(path.join(out, k.cubin)));
    assert.throws(() => writeLayerExport(out, { manifest, cubins }), DirectoryError);
    writeLayerExport(out, { manifest, cubins }, true);
    assert.deepEqual(fs.readdirSync(dir), ["a"], "nothing left aside");
  });

  test("a failure part-way leaves the folder as it was", () => {
    const out = path.join(dir, "a");
    const before = fs.readFileSync(path.join(out, "manifest.json"));
    const missing = new Map(cubins);
    missing.delete(manifest.kernels.at(-1)!.id);
    assert.throws(() => writeLayerExport(out, { manifest, cubins: missing }, true), /no cubin/);
    assert.deepEqual(fs.readFileSync(path.join(out, "manifest.json")), before);
    assert.throws(() => writeLayerExport(path.join(dir, "b"), { manifest, cubins: missing }), /no cubin/);
    assert.deepEqual(fs.readdirSync(dir), ["a"], "no partial folder");
  });
});
