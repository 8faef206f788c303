/**
 * The driver bindings end to end against a CPU stand-in for libcuda (test/fixtures/cuda/mock_libcuda.c,
 * compiled against the real cuda.h): symbol names, argument marshalling, struct layouts, error paths,
 * tensor lifetime. Also runs the GPU test file against it. Skipped without a C compiler / CUDA headers.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { after, before, describe, test } from "node:test";
import { pathToFileURL } from "node:url";
import v8 from "node:v8";
import vm from "node:vm";
import koffi from "koffi";
import {
  CudaError,
  cudaAvailability,
  type Device,
  DeviceTensor,
  KernelArgs,
  openDevice,
  packageRoot,
  timeKernel,
} from "../../src/cuda/index.js";
import { compilerAvailable } from "../../src/cuda/jit.js";
import { tensorLeakWarnings } from "../../src/cuda/tensor.js";
import { testSeed } from "../helpers/random.js";
import { buildMockLibcuda, fakeCubin, type MockBuild } from "./mock-cuda.js";

const seed = testSeed("mock-driver");

let mock: MockBuild = { ok: false, reason: "not built" };
try {
  mock = buildMockLibcuda();
} catch (e) {
  mock = { ok: false, reason: (e as Error).message };
}
const skip = mock.ok ? false : mock.reason;
after(() => {
  if (mock.ok) fs.rmSync(mock.dir, { recursive: true, force: true });
});

function runNode(
  args: string[],
  env: Record<string, string>,
): { status: number | null; stdout: string; stderr: string } {
  // Without NODE_TEST_CONTEXT a nested `node --test` reports normally instead of to this runner.
  const { NODE_TEST_CONTEXT: _, ...parentEnv } = process.env;
  return spawnSync(process.execPath, ["--import", "tsx", ...args], {
    encoding: "utf8",
    env: { ...parentEnv, ...env },
  });
}

describe("against the mock libcuda", { skip }, () => {
  let device: Device;
  let mockLive: () => number;
  let mockLastLaunch: (out: Uint32Array) => void;

  before(() => {
    if (!mock.ok) return;
    process.env.MEGAMOE_LIBCUDA = mock.library;
    const lib = koffi.load(mock.library);
    mockLive = lib.func("long mock_live_allocations()") as () => number;
    mockLastLaunch = lib.func("void mock_last_launch(void *out)") as (out: Uint32Array) => void;
  });

  test("availability, device properties and the CUDA 13 symbol names", () => {
    const a = cudaAvailability();
    assert.ok(a.ok, a.ok ? "" : a.reason);
    if (a.ok) {
      assert.equal(a.libraryPath, process.env.MEGAMOE_LIBCUDA);
      assert.equal(a.driverVersion, 13000);
      assert.equal(a.deviceCount, 1);
    }
    device = openDevice(0);
    assert.equal(device.name, "Mock H200 (CPU)");
    assert.equal(device.smCount, 132);
    assert.deepEqual(device.computeCapability, { major: 9, minor: 0 });
    assert.equal(device.totalMemoryBytes, 150_000_000_000);
    assert.equal(device.maxSharedMemoryPerBlockOptin, 232448);
    assert.equal(device.smArch, "sm_90");
    device.synchronize();
    device.nullStream.synchronize();
    assert.equal(device.canAccessPeer(device), false);
    device.enablePeerAccess(device);
    const pinned = device.allocPinned(64);
    pinned.u8.fill(7);
    assert.equal(pinned.u8[63], 7);
    pinned.free();
    assert.throws(() => pinned.u8, /after free/);
    assert.throws(() => openDevice(1), /cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE|cuDeviceGet failed/);
  });

  test("allocation bookkeeping, tensors, poison and round trips", () => {
    const live = mockLive();
    const bytes = new Uint8Array(1000).map((_, i) => (i * 31 + seed) & 0xff || 1);
    const t = DeviceTensor.fromHost(device, "uint8", [10, 100], bytes);
    assert.equal(mockLive(), live + 1);
    assert.equal(device.allocatedBytes, 1000);
    assert.deepEqual(t.toHost(), bytes);
    t.fill(0xee);
    assert.ok(t.toHost().every((b) => b === 0xee));
    t.dispose();
    t.dispose(); // idempotent
    assert.equal(mockLive(), live);
    assert.equal(device.allocatedBytes, 0);
    assert.throws(() => t.ptr, /used after dispose/);
    assert.throws(() => t.toHost(), /used after dispose/);
    assert.throws(() => DeviceTensor.fromHost(device, "fp32", [4], new Float32Array(5)), /has 4 elements/);
    assert.equal(mockLive(), live, "a rejected fromHost allocates nothing");
    // tiny typed arrays may live on the JS heap: they must still copy both ways
    const tiny = DeviceTensor.fromHost(device, "fp32", [3], new Float32Array([1.5, -2, 3.25]));
    assert.deepEqual([...tiny.toHost()], [1.5, -2, 3.25]);
    tiny.dispose();
    const empty = DeviceTensor.empty(device, "bf16", [0, 7]);
    assert.equal(empty.ptr, 0n);
    assert.equal(empty.toHost().length, 0);
    empty.dispose();
    assert.throws(() => device.free(12345n), /was not allocated/);
  });

  test("errors name the call, the CUDA error and the context", () => {
    const module = device.loadModule(fakeCubin(["vector_add"]));
    assert.throws(
      () => module.getFunction("missing_kernel"),
      (e: unknown) =>
        e instanceof CudaError &&
        e.call === "cuModuleGetFunction" &&
        e.errorName === "CUDA_ERROR_NOT_FOUND" &&
        /^cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND \(500\): mock error description \[kernel "missing_kernel"\]$/.test(
          e.message,
        ),
    );
    assert.throws(
      () => device.loadModule(new Uint8Array(64)),
      /cuModuleLoadData failed: CUDA_ERROR_INVALID_IMAGE/,
    );
    module.unload();
  });

  test("launch, launchEx and launchAfterPrevious pass grid, block, shared bytes and attributes through", () => {
    const module = device.loadModule(fakeCubin(["cluster_ids", "other_kernel"]));
    const other = module.getFunction("other_kernel");
    const last = new Uint32Array(9);
    const args = new KernelArgs(1).ptr(0, 0n);
    other.launch([3, 4, 5], [32, 2, 1], 1000, null, args);
    mockLastLaunch(last);
    assert.deepEqual([...last], [3, 4, 5, 32, 2, 1, 1000, 1, 0]);
    other.setMaxDynamicSharedMemory(100_000);
    assert.equal(other.getAttribute(8), 100_000);
    const stream = device.createStream();
    other.launchEx([8, 2, 1], 64, 100_000, stream, args, [4, 1, 1]);
    mockLastLaunch(last);
    assert.deepEqual([...last], [8, 2, 1, 64, 1, 1, 100_000, 4, 0]);
    // Programmatic stream serialization: the attribute's value reaches the driver, the cluster stays 1;
    // the cluster launch after it keeps its own attribute.
    other.launchAfterPrevious([7, 1, 1], 96, 100_000, stream, args);
    mockLastLaunch(last);
    assert.deepEqual([...last], [7, 1, 1, 96, 1, 1, 100_000, 1, 1]);
    other.launchEx([8, 2, 1], 64, 0, stream, args, [2, 1, 1]);
    mockLastLaunch(last);
    assert.deepEqual([...last], [8, 2, 1, 64, 1, 1, 0, 2, 0]);
    assert.throws(() => other.launchAfterPrevious(1, 32, 200_000, stream, args), /limit set is 100000/);
    assert.throws(
      () => other.launchEx(6, 64, 0, stream, args, 4),
      /cuLaunchKernelEx failed: CUDA_ERROR_INVALID_CLUSTER_SIZE.*cluster 4x1x1/,
    );
    assert.throws(() => other.launch(1, 32, 200_000, stream, args), /limit set is 100000/);
    assert.throws(() => other.setMaxDynamicSharedMemory(300_000), /exceed the device's 232448/);
    stream.destroy();
    module.unload();
  });

  test("timeKernel: rotate sees every run, samples come from the events", () => {
    const module = device.loadModule(fakeCubin(["other_kernel"]));
    const k = module.getFunction("other_kernel");
    const args = new KernelArgs(1).ptr(0, 0n);
    const seen: number[] = [];
    const live = mockLive();
    const r = timeKernel(device, (s) => k.launch(1, 32, 0, s, args), {
      warmup: 2,
      iters: 5,
      rotate: (i) => seen.push(i),
    });
    assert.deepEqual(seen, [0, 1, 2, 3, 4, 5, 6]);
    assert.equal(r.samples.length, 5);
    for (const s of r.samples) assert.ok(Math.abs(s - 5) < 0.01, `sample ${s} us`); // the mock ticks 5 us per launch
    assert.equal(mockLive(), live + 1, "only the L2 flush buffer stays allocated");
    const g = timeKernel(device, (s) => k.launch(1, 32, 0, s, args), {
      iters: 3,
      graph: true,
      l2Flush: false,
    });
    assert.equal(g.samples.length, 3);
    assert.equal(mockLive(), live + 1, "the flush buffer is reused");
    // warmupMs: one run sizes the rest (5 us each), so 0.098 ms adds 1 + 20 untimed runs.
    let runs = 0;
    const w = timeKernel(device, (s) => k.launch(1, 32, 0, s, args), {
      warmup: 2,
      warmupMs: 0.098,
      iters: 5,
      rotate: () => runs++,
    });
    assert.equal(runs, 2 + 1 + 20 + 5);
    assert.equal(w.samples.length, 5);
    assert.throws(() => timeKernel(device, () => {}, { warmupMs: -1 }), /warmupMs/);
    assert.throws(() => timeKernel(device, () => {}, { warmupMs: Number.NaN }), /warmupMs/);
    module.unload();
  });

  test("a tensor garbage-collected without dispose() warns once with dtype, shape and allocation site", async () => {
    v8.setFlagsFromString("--expose-gc");
    const gc = vm.runInNewContext("gc") as () => void;
    const before = tensorLeakWarnings();
    const original = process.stderr.write.bind(process.stderr);
    let text = "";
    process.stderr.write = ((chunk: string | Uint8Array) => {
      text += chunk.toString();
      return true;
    }) as typeof process.stderr.write;
    try {
      (function allocateAndForget() {
        DeviceTensor.empty(device, "bf16", [3, 5]);
      })();
      DeviceTensor.empty(device, "fp32", [2]).dispose(); // disposed: no warning
      for (let i = 0; i < 50 && tensorLeakWarnings() === before; i++) {
        gc();
        await new Promise((r) => setTimeout(r, 10));
      }
    } finally {
      process.stderr.write = original;
    }
    assert.equal(tensorLeakWarnings(), before + 1);
    assert.match(text, /DeviceTensor bf16\[3, 5\] \(30 bytes\) was garbage-collected without dispose\(\)/);
    assert.match(text, /allocated at .*mock-driver\.test\.ts/);
    assert.equal(text.trim().split("\n").length, 1);
  });
});

describe("availability reasons from a failing driver", { skip }, () => {
  const driverUrl = pathToFileURL(path.join(packageRoot(), "src", "cuda", "driver.ts")).href;
  const probe = `import { cudaAvailability } from ${JSON.stringify(driverUrl)}; console.log(JSON.stringify(cudaAvailability()));`;
  const reasonWith = (env: Record<string, string>): string => {
    if (!mock.ok) return "";
    const r = runNode(["--input-type=module", "-e", probe], { MEGAMOE_LIBCUDA: mock.library, ...env });
    assert.equal(r.status, 0, r.stderr);
    const a = JSON.parse(r.stdout.trim().split("\n").at(-1)!);
    assert.equal(a.ok, false);
    return a.reason;
  };

  test("cuInit failing", () => {
    assert.match(
      reasonWith({ MOCK_CUDA_INIT_ERROR: "100" }),
      /^cuInit failed with CUDA_ERROR_NO_DEVICE \(100\): mock error description/,
    );
  });

  test("no device", () => {
    assert.match(
      reasonWith({ MOCK_CUDA_DEVICES: "0", CUDA_VISIBLE_DEVICES: "" }),
      /^no CUDA device visible \(CUDA_VISIBLE_DEVICES=\)/,
    );
  });
});

test("the GPU test file passes against the mock (JIT through nvcc)", {
  skip: skip || (!compilerAvailable("nvcc") && "nvcc not found"),
}, () => {
  if (!mock.ok) return;
  const cache = fs.mkdtempSync(path.join(mock.dir, "cache-"));
  const r = runNode(
    ["--test", "--test-reporter=spec", path.join(packageRoot(), "test", "gpu", "cuda-runtime.test.ts")],
    {
      MEGAMOE_LIBCUDA: mock.library,
      MEGAMOE_REQUIRE_GPU: "1",
      MEGAMOE_CACHE_DIR: cache,
      MEGAMOE_JIT_COMPILER: "nvcc",
      MEGAMOE_SEED: String(seed),
    },
  );
  assert.equal(r.status, 0, `${r.stdout}\n${r.stderr}`);
  assert.match(r.stdout, /pass 10/);
  assert.match(r.stdout, /fail 0/);
});
