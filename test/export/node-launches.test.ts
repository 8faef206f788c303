/**
 * The export's forward against the Node launcher, on the CPU stand-in for libcuda: for each T, the
 * launches FusedPipeline.forward makes (kernel, grid, block, shared memory, the programmatic attribute
 * and every argument's bytes, tensor maps included) equal those of the manifest's range for T, resolved
 * with the pipeline's own buffer addresses. FP8 and FP4 experts, shared expert on and off, every block
 * M and the FP4 expand variant. The kernels are stand-in images seeded into a private JIT cache (the
 * mock runs none). Skipped without a C compiler, the CUDA headers or a CUDA compiler to key the cache.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { before, describe, test } from "node:test";
import { type MoEConfig, PRESETS, resolveConfig } from "../../src/config/config.js";
import {
  type Device,
  DeviceTensor,
  encodeTensorMapTiled,
  openDevice,
  TensorMapDataType,
  TensorMapL2Promotion,
  TensorMapSwizzle,
} from "../../src/cuda/index.js";
import { encodeCacheEntry, kernelCacheEntry } from "../../src/cuda/jit.js";
import { allocTensorMapBytes } from "../../src/cuda/kernel-args.js";
import {
  buildManifest,
  exportConfig,
  exportKernelJobs,
  type LayerExportOptions,
} from "../../src/export/layer.js";
import {
  argBytes,
  type ExportArg,
  type ExportLaunch,
  type ExportManifest,
  type ExportRef,
  evaluateExpr,
  rangeFor,
} from "../../src/export/manifest.js";
import { DeviceMoEWeights } from "../../src/kernels/device-weights.js";
import { FusedPipeline } from "../../src/pipeline/fused.js";
import { GeneratedWeights } from "../../src/weights/generate.js";
import type { MoEWeightSource } from "../../src/weights/types.js";
import { bindMock, fakeCubin, type MockControl, mockWithJitCache } from "../cuda/mock-cuda.js";
import { testSeed } from "../helpers/random.js";

const seed = testSeed("export launches against the Node launcher");
const MOCK_SMS = 132; // the mock's SM count
const MOCK_REGISTERS = 32; // what the mock's cuFuncGetAttribute says of every kernel

const { mock, skip, cacheDir } = mockWithJitCache();

/** Every kernel an export of the layer holds, as a stand-in image under compileKernel's key. */
function seedCache(c: MoEConfig, opts: LayerExportOptions): void {
  const images = new Map<string, string[]>();
  for (const job of exportKernelJobs(c, opts)) {
    const file = kernelCacheEntry({ source: job.source, defines: job.defines });
    images.set(file, [...(images.get(file) ?? []), job.function]);
  }
  for (const [file, names] of images) {
    fs.mkdirSync(path.dirname(file), { recursive: true });
    fs.writeFileSync(file, encodeCacheEntry(fakeCubin(names)));
  }
}

/** The generated weights without their seed, so they are uploaded (the mock runs no weight kernels). */
function uploaded(w: GeneratedWeights): MoEWeightSource {
  return { config: w.config, expert: (e) => w.expert(e), shared: () => w.shared(), gate: () => w.gate() };
}

const byName = <T extends Record<string, number>>(
  table: T,
  name: string,
  lower = (k: string) => k.toLowerCase(),
) => {
  const hit = Object.entries(table).find(([k]) => lower(k) === name);
  assert.ok(hit, `unknown name ${name}`);
  return hit[1];
};
const swizzleOf = (name: string) =>
  byName(TensorMapSwizzle, name, (k) => (k === "NONE" ? "none" : `${k.slice(1)}B`));
const l2Of = (name: string) =>
  byName(TensorMapL2Promotion, name, (k) => (k === "NONE" ? "none" : `${k.slice(1)}B`));

const hex = (b: Uint8Array) => Buffer.from(b).toString("hex");

/** One launch's argument bytes as the manifest says, with `address` for every buffer and input. */
function resolveArgs(
  m: ExportManifest,
  launch: ExportLaunch,
  tokens: number,
  address: (name: string) => bigint,
): string {
  const at = (r: ExportRef | null) =>
    r === null ? 0n : address(r.buffer) + BigInt(evaluateExpr(r.offset, tokens));
  const scalar = (view: DataView, offset: number, kind: string, value: number) => {
    if (kind === "i32") view.setInt32(offset, value, true);
    else if (kind === "u32") view.setUint32(offset, value, true);
    else if (kind === "f32") view.setFloat32(offset, value, true);
    else view.setBigUint64(offset, BigInt(value), true);
  };
  const one = (arg: ExportArg): Uint8Array => {
    if (arg.kind === "tensorMap") {
      const e = m.tensorMaps.find((t) => t.id === arg.map);
      assert.ok(e, `no tensor map ${arg.map}`);
      const map = allocTensorMapBytes();
      encodeTensorMapTiled(map, {
        dataType: byName(TensorMapDataType, e.dataType),
        globalAddress: address(e.buffer) + BigInt(e.offset),
        globalDims: e.dims,
        globalStridesBytes: e.stridesBytes,
        boxDims: e.box,
        elementStrides: e.elementStrides,
        swizzle: swizzleOf(e.swizzle),
        l2Promotion: l2Of(e.l2Promotion),
      });
      return map;
    }
    if (arg.kind === "struct") {
      const bytes = new Uint8Array(arg.bytes);
      const view = new DataView(bytes.buffer);
      for (const f of arg.fields) {
        if (f.kind === "pointer") view.setBigUint64(f.offset, at(f.ref), true);
        else scalar(view, f.offset, f.kind, evaluateExpr(f.value, tokens));
      }
      return bytes;
    }
    const slot = new Uint8Array(arg.kind === "pointer" || arg.kind === "u64" ? 8 : 4);
    const view = new DataView(slot.buffer);
    if (arg.kind === "pointer") view.setBigUint64(0, at(arg.ref), true);
    else scalar(view, 0, arg.kind, evaluateExpr(arg.value, tokens));
    return slot;
  };
  return launch.args.map((a) => hex(one(a))).join(",");
}

const cases: { label: string; config: MoEConfig; shared: boolean; tokens: number[] }[] = [
  {
    label: "FP8, shared expert",
    config: PRESETS.tiny!,
    shared: true,
    tokens: [1, 7, 24, 25, 64, 65, 255, 256, 300],
  },
  { label: "FP8, no shared expert", config: PRESETS.tiny!, shared: false, tokens: [1, 33, 129, 300] },
  {
    label: "FP4, shared expert (expand from 1536)",
    config: resolveConfig("tiny", { expertFormat: "fp4" }),
    shared: true,
    tokens: [1, 48, 49, 120, 121, 1000, 1535, 1536, 2048],
  },
  {
    label: "FP4, no shared expert",
    config: resolveConfig("tiny", { expertFormat: "fp4" }),
    shared: false,
    tokens: [1, 100, 2048],
  },
];

describe("export: the manifest's launches are the Node launcher's", { skip }, () => {
  let m: MockControl;
  let device: Device;
  before(() => {
    if (skip !== false || !mock.ok) return;
    process.env.MEGAMOE_LIBCUDA = mock.library;
    process.env.MEGAMOE_CACHE_DIR = cacheDir;
    m = bindMock(mock.library);
    device = openDevice(0);
  });

  for (const k of cases) {
    test(k.label, () => {
      const maxTokens = Math.max(...k.tokens);
      const opts: LayerExportOptions = {
        maxTokens,
        shared: k.shared,
        smCount: MOCK_SMS,
        weightScales: "fp32",
        arch: "sm_90a",
        producer: "test",
      };
      const c = exportConfig({ ...k.config, maxTokens }, k.shared);
      seedCache(c, opts);
      const manifest = buildManifest(c, opts, MOCK_REGISTERS);
      for (const r of manifest.forward)
        for (const s of r.steps)
          if (s.kind === "launch")
            m.declareParams(manifest.kernels.find((x) => x.id === s.kernel)!.function, s.args.map(argBytes));

      const weights = DeviceMoEWeights.upload(device, uploaded(new GeneratedWeights(c, seed)));
      const pipeline = new FusedPipeline(device, weights, maxTokens);
      try {
        for (const T of k.tokens) {
          const x = DeviceTensor.empty(device, "bf16", [T, c.hidden]);
          const ids = DeviceTensor.empty(device, "int32", [T, c.topK]);
          const w = DeviceTensor.empty(device, "fp32", [T, c.topK]);
          const out = DeviceTensor.empty(device, "bf16", [T, c.hidden]);
          const inputs: Record<string, bigint> = {
            x: x.ptr,
            topk_ids: ids.ptr,
            topk_weights: w.ptr,
            out: out.ptr,
          };
          m.start();
          pipeline.forward({ x, ids, weights: w, out, tokens: T, shared: k.shared }, null);
          const lines = m.read();
          m.stop();
          const made = lines.filter((l) => l.startsWith("launch ") || l.startsWith("params "));
          const range = rangeFor(manifest, T);
          assert.ok(range, `T = ${T}: no range`);
          const expected: string[] = [];
          for (const s of range.steps) {
            assert.equal(s.kind, "launch");
            const launch = s as ExportLaunch;
            const fn = manifest.kernels.find((x) => x.id === launch.kernel)!.function;
            const grid = launch.grid.map((g) => evaluateExpr(g, T));
            expected.push(
              `launch ${fn} grid=${grid[0]} block=${launch.block[0]} shared=${launch.sharedBytes}`,
            );
            const address = (name: string) => inputs[name] ?? pipeline.bufferAddress(name as "xq");
            expected.push(
              `params ${fn} pss=${launch.programmaticStreamSerialization ? 1 : 0} ${resolveArgs(manifest, launch, T, address)}`,
            );
          }
          // The mock logs the stream after the shared bytes: Node's launches run on the null stream.
          assert.deepEqual(
            made.map((l) => l.replace(/ stream=\S+$/, "")),
            expected,
            `T = ${T}: the Node launches differ from the manifest's`,
          );
          for (const t of [x, ids, w, out]) t.dispose();
        }
      } finally {
        pipeline.dispose();
        weights.dispose();
      }
    });
  }
});
