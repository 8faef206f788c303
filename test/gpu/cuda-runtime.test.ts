/**
 * GPU tests of the CUDA layer: device, memory, JIT + launch, events, graphs, big shared memory, clusters,
 * TMA. Skipped with the reason when no GPU is usable; with MEGAMOE_REQUIRE_GPU=1 they fail instead.
 *
 * On the GPU host (no tsx there): `npm run build:test` on the CPU machine, then `npm run test:gpu`.
 */

import assert from "node:assert/strict";
import path from "node:path";
import { test } from "node:test";
import {
  type CompiledKernel,
  CudaGraph,
  compileKernel,
  DeviceTensor,
  Event,
  encodeTensorMapTiled,
  KernelArgs,
  loadKernel,
  openDevice,
  packageRoot,
  TensorMapDataType,
  timeKernel,
} from "../../src/cuda/index.js";
import { availability, describeGpu, testDevice } from "../helpers/gpu.js";
import { rng, testSeed } from "../helpers/random.js";

const seed = testSeed("cuda-runtime");

const random = rng(seed);

function randomBytes(n: number): Uint8Array {
  const out = new Uint8Array(n);
  for (let i = 0; i < n; i++) out[i] = Math.floor(random() * 256);
  return out;
}

function randomFloats(n: number, lo: number, hi: number): Float32Array {
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = lo + (hi - lo) * random();
  return out;
}

const SCALE = 2;
let cachedKernels: CompiledKernel | undefined;

const device = testDevice;

function kernels(): CompiledKernel {
  cachedKernels ??= compileKernel({
    source: path.join(packageRoot(), "test", "fixtures", "cuda", "runtime_kernels.cu"),
    defines: { SCALE: `${SCALE}.0f` },
  });
  return cachedKernels;
}

describeGpu("CUDA runtime on a GPU", () => {
  test("CUDA is available", () => {
    assert.ok(availability.ok, availability.ok ? "" : availability.reason);
  });

  test("device properties are sane", () => {
    const d = device();
    console.log(d.describe(), `driver ${d.driverVersion}, clock ${d.clockRateKHz} kHz`);
    assert.ok(d.name.length > 0);
    assert.ok(d.smCount >= 1 && d.smCount <= 1024, `SM count ${d.smCount}`);
    assert.ok(d.computeCapability.major >= 7, `compute capability ${d.computeCapability.major}`);
    assert.ok(d.totalMemoryBytes > 2 ** 30, `memory ${d.totalMemoryBytes}`);
    assert.ok(d.l2CacheBytes >= 2 ** 20, `L2 ${d.l2CacheBytes}`);
    assert.ok(d.maxSharedMemoryPerBlockOptin >= 48 * 1024, `shared optin ${d.maxSharedMemoryPerBlockOptin}`);
    assert.ok(d.clockRateKHz > 100_000, `clock ${d.clockRateKHz} kHz`);
    assert.ok(d.driverVersion >= 12000, `driver ${d.driverVersion}`);
    assert.equal(openDevice(0), d, "openDevice returns the same object");
  });

  test("alloc / copy round trip of random bytes (sync, async, pinned, device to device)", () => {
    const d = device();
    const n = (1 << 20) + 37;
    const host = randomBytes(n);
    const a = DeviceTensor.fromHost(d, "uint8", [n], host);
    const b = DeviceTensor.empty(d, "uint8", [n]);
    const stream = d.createStream();
    const pinned = d.allocPinned(n);
    try {
      d.copyDtoD(b.ptr, a.ptr, n, stream);
      d.copyDtoH(pinned, b.ptr, n, stream);
      stream.synchronize();
      assert.deepEqual(pinned.u8, host);
      assert.deepEqual(b.toHost(), host);
      const floats = randomFloats(1000, -1e3, 1e3);
      const f = DeviceTensor.fromHost(d, "fp32", [10, 100], floats);
      assert.deepEqual(f.toHost(), floats);
      f.dispose();
    } finally {
      pinned.free();
      stream.destroy();
      a.dispose();
      b.dispose();
    }
  });

  test("fill poisons every byte; memsetD32 writes words", () => {
    const d = device();
    const t = DeviceTensor.fromHost(
      d,
      "bf16",
      [3, 333],
      new Uint16Array(999).map(() => 1 + Math.floor(random() * 60000)),
    );
    try {
      t.fill(0xab);
      assert.ok(t.toHost().every((v) => v === 0xabab));
      d.memsetD32(t.ptr, 0x12345678, Math.floor(t.bytes / 4));
      const words = new Uint32Array(t.toHost().buffer, 0, Math.floor(t.bytes / 4));
      assert.ok(words.every((w) => w === 0x12345678));
    } finally {
      t.dispose();
    }
    assert.throws(() => t.ptr, /after dispose/);
  });

  test("JIT-compiled vector add matches the CPU, timed with events", () => {
    const d = device();
    const k = loadKernel(d, kernels(), "vector_add");
    const n = 1_000_003;
    const a = randomFloats(n, -100, 100);
    const b = randomFloats(n, -100, 100);
    const ta = DeviceTensor.fromHost(d, "fp32", [n], a);
    const tb = DeviceTensor.fromHost(d, "fp32", [n], b);
    const tc = DeviceTensor.empty(d, "fp32", [n]);
    try {
      tc.fill(0xff);
      const args = new KernelArgs(4).ptr(0, ta.ptr).ptr(1, tb.ptr).ptr(2, tc.ptr).i32(3, n);
      const grid = Math.ceil(n / 256);
      const stream = d.createStream();
      const start = d.createEvent();
      const end = d.createEvent();
      start.record(stream);
      k.launch(grid, 256, 0, stream, args);
      end.record(stream);
      end.synchronize();
      const ms = Event.elapsedMs(start, end);
      assert.ok(ms > 0 && ms < 1000, `elapsed ${ms} ms`);
      const c = tc.toHost();
      for (let i = 0; i < n; i++) {
        const expected = Math.fround(a[i]! + b[i]! * SCALE); // b * 2 is exact, so FMA or not gives this
        if (c[i] !== expected) assert.fail(`c[${i}] = ${c[i]}, expected ${expected}`);
      }
      const t = timeKernel(d, (s) => k.launch(grid, 256, 0, s, args), { warmup: 3, iters: 10 });
      const g = timeKernel(d, (s) => k.launch(grid, 256, 0, s, args), { warmup: 3, iters: 10, graph: true });
      console.log(`vector add ${n}: ${t.usMedian.toFixed(1)} us (graph ${g.usMedian.toFixed(1)} us)`);
      for (const r of [t, g]) {
        assert.equal(r.samples.length, 10);
        assert.ok(r.usMin > 0 && r.usMin <= r.usMedian && r.usMedian <= r.usMax, JSON.stringify(r));
      }
      start.destroy();
      end.destroy();
      stream.destroy();
    } finally {
      ta.dispose();
      tb.dispose();
      tc.dispose();
    }
  });

  test("graph capture and replay; arguments are frozen at capture", () => {
    const d = device();
    const k = loadKernel(d, kernels(), "vector_add");
    const n = 4096;
    const x0 = new Float32Array(n).map(() => Math.floor(random() * 201) - 100 || 1);
    const x = DeviceTensor.fromHost(d, "fp32", [n], x0);
    const other = DeviceTensor.fromHost(d, "fp32", [n], x0);
    const stream = d.createStream();
    try {
      // x = x + x * 2 = 3x per replay
      const args = new KernelArgs(4).ptr(0, x.ptr).ptr(1, x.ptr).ptr(2, x.ptr).i32(3, n);
      const graph = CudaGraph.capture(stream, (s) => k.launch(n / 256, 256, 0, s, args));
      args.ptr(0, other.ptr).ptr(1, other.ptr).ptr(2, other.ptr); // must not affect the graph
      for (let r = 0; r < 3; r++) graph.launch(stream);
      stream.synchronize();
      graph.destroy();
      const got = x.toHost();
      for (let i = 0; i < n; i++) assert.equal(got[i], x0[i]! * 27);
      assert.deepEqual(other.toHost(), x0);
    } finally {
      stream.destroy();
      x.dispose();
      other.dispose();
    }
  });

  test("launch with more than 48 KiB of dynamic shared memory", () => {
    const d = device();
    const k = loadKernel(d, kernels(), "smem_reverse");
    const words = Math.min(50_000, Math.floor(d.maxSharedMemoryPerBlockOptin / 4));
    const bytes = words * 4;
    assert.ok(bytes > 48 * 1024);
    const input = new Uint32Array(words).map(() => (random() * 2 ** 32) >>> 0);
    const tin = DeviceTensor.fromHost(d, "int32", [words], new Int32Array(input.buffer));
    const tout = DeviceTensor.empty(d, "int32", [words]);
    try {
      const args = new KernelArgs(3).ptr(0, tin.ptr).ptr(1, tout.ptr).i32(2, words);
      assert.throws(() => k.launch(1, 1024, bytes, null, args), /setMaxDynamicSharedMemory/);
      k.setMaxDynamicSharedMemory(bytes);
      k.launch(1, 1024, bytes, null, args);
      const out = new Uint32Array(tout.toHost().buffer);
      for (let i = 0; i < words; i++) if (out[i] !== input[words - 1 - i]) assert.fail(`out[${i}] wrong`);
    } finally {
      tin.dispose();
      tout.dispose();
    }
  });

  test("one KernelArgs reused across launches with different values", () => {
    const d = device();
    const k = loadKernel(d, kernels(), "vector_add");
    const n = 3000;
    const a = randomFloats(n, -10, 10);
    const b = randomFloats(n, -10, 10);
    const ta = DeviceTensor.fromHost(d, "fp32", [n], a);
    const tb = DeviceTensor.fromHost(d, "fp32", [n], b);
    const outs = [0, 1, 2].map(() => DeviceTensor.empty(d, "fp32", [n]));
    const stream = d.createStream();
    try {
      const args = new KernelArgs(4).ptr(0, ta.ptr).ptr(1, tb.ptr);
      const counts = [n, 1000, 17];
      outs.forEach((o, j) => {
        o.fill(0, stream);
        args.ptr(2, o.ptr).i32(3, counts[j]!);
        k.launch(Math.ceil(n / 128), 128, 0, stream, args); // queued; args mutated right after
      });
      stream.synchronize();
      outs.forEach((o, j) => {
        const c = o.toHost();
        for (let i = 0; i < n; i++) {
          const expected = i < counts[j]! ? Math.fround(a[i]! + b[i]! * SCALE) : 0;
          if (c[i] !== expected) assert.fail(`launch ${j}: c[${i}] = ${c[i]}, expected ${expected}`);
        }
      });
    } finally {
      stream.destroy();
      for (const t of [ta, tb, ...outs]) t.dispose();
    }
  });

  test("cluster launch through cuLaunchKernelEx", (t) => {
    const d = device();
    if (d.computeCapability.major < 9) return t.skip("thread-block clusters need sm_90");
    const k = loadKernel(d, kernels(), "cluster_ids");
    const blocks = 8;
    const out = DeviceTensor.empty(d, "int32", [blocks * 3]);
    try {
      out.fill(0xff);
      k.launchEx(blocks, 32, 0, null, new KernelArgs(1).ptr(0, out.ptr), [2, 1, 1]);
      const ids = out.toHost();
      for (let b = 0; b < blocks; b++) {
        assert.deepEqual([...ids.subarray(3 * b, 3 * b + 3)], [b % 2, 2, b], `block ${b}`);
      }
    } finally {
      out.dispose();
    }
  });

  test("TMA tile loads through a tensor map passed as a kernel argument", (t) => {
    const d = device();
    if (d.computeCapability.major < 9) return t.skip("TMA needs sm_90");
    const k = loadKernel(d, kernels(), "tma_copy_tiles");
    const rows = 256;
    const cols = 512;
    const host = randomBytes(rows * cols);
    const src = DeviceTensor.fromHost(d, "uint8", [rows, cols], host);
    const dst = DeviceTensor.empty(d, "uint8", [rows, cols]);
    try {
      dst.fill(0);
      const args = new KernelArgs(3, { tensorMaps: [0] });
      encodeTensorMapTiled(args.tensorMap(0), {
        dataType: TensorMapDataType.UINT8,
        globalAddress: src.ptr,
        globalDims: [cols, rows],
        globalStridesBytes: [cols],
        boxDims: [128, 64],
      });
      args.ptr(1, dst.ptr).i32(2, cols);
      k.launch([cols / 128, rows / 64, 1], 128, 0, null, args);
      assert.deepEqual(dst.toHost(), host);
    } finally {
      src.dispose();
      dst.dispose();
    }
  });
});
