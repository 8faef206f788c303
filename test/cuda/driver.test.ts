/**
 * Driver-layer behaviour that needs no GPU: lazy loading, availability reasons, error formatting,
 * tensor-map validation. (test/cuda/mock-driver.test.ts runs the bindings against a CPU stand-in.)
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import path from "node:path";
import { test } from "node:test";
import { pathToFileURL } from "node:url";
import type { TensorMapTiledDesc } from "../../src/cuda/driver.js";

const driverUrl = pathToFileURL(path.resolve(import.meta.dirname, "../../src/cuda/driver.ts")).href;

test("importing the CUDA layer touches no native library and does not throw", async () => {
  const mod = await import("../../src/cuda/index.js");
  assert.equal(typeof mod.cudaAvailability, "function");
});

test("cudaAvailability says why CUDA is unusable, and openDevice throws that reason", async (t) => {
  const { cudaAvailability, openDevice } = await import("../../src/cuda/driver.js");
  const a = cudaAvailability();
  if (a.ok) return t.skip("this machine has a usable GPU");
  assert.equal(a.ok, false);
  assert.match(a.reason, /libcuda|cuInit|no CUDA device/);
  assert.ok(!a.reason.includes("undefined"), a.reason);
  assert.equal(cudaAvailability(), a, "the probe runs once");
  assert.throws(
    () => openDevice(0),
    (e: Error) => e.message.includes(a.reason),
  );
});

test("MEGAMOE_LIBCUDA pointing at a missing file is the reason given", () => {
  const script = `import { cudaAvailability } from ${JSON.stringify(driverUrl)}; console.log(JSON.stringify(cudaAvailability()));`;
  const r = spawnSync(process.execPath, ["--import", "tsx", "--input-type=module", "-e", script], {
    encoding: "utf8",
    env: { ...process.env, MEGAMOE_LIBCUDA: "/nonexistent/libcuda.so.1" },
  });
  assert.equal(r.status, 0, r.stderr);
  const a = JSON.parse(r.stdout.trim().split("\n").at(-1)!);
  assert.equal(a.ok, false);
  assert.match(a.reason, /MEGAMOE_LIBCUDA=\/nonexistent\/libcuda\.so\.1 does not name an existing file/);
});

test("CudaError names the call and the CUDA error", async () => {
  const { CudaError, describeCudaError } = await import("../../src/cuda/driver.js");
  const e = new CudaError("cuMemAlloc_v2", 2, "1024 bytes");
  assert.equal(e.call, "cuMemAlloc_v2");
  assert.equal(e.code, 2);
  assert.equal(e.errorName, "CUDA_ERROR_OUT_OF_MEMORY");
  assert.match(e.message, /^cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY \(2\): .* \[1024 bytes\]$/);
  assert.equal(describeCudaError(123456).name, "CUresult 123456");
});

test("tensor-map descriptions are validated before the driver sees them", async () => {
  const { tensorMapTiledProblems, TensorMapDataType, TensorMapSwizzle, encodeTensorMapTiled } = await import(
    "../../src/cuda/driver.js"
  );
  const good: TensorMapTiledDesc = {
    dataType: TensorMapDataType.UINT8,
    globalAddress: 0x7f0000000000n,
    globalDims: [512, 256],
    globalStridesBytes: [512],
    boxDims: [128, 64],
  };
  assert.deepEqual(tensorMapTiledProblems(good), []);
  assert.deepEqual(
    tensorMapTiledProblems({
      ...good,
      dataType: TensorMapDataType.BFLOAT16,
      boxDims: [64, 64],
      swizzle: TensorMapSwizzle.B128,
    }),
    [],
  );
  const cases: [Partial<TensorMapTiledDesc>, RegExp][] = [
    [{ globalAddress: 0x7f0000000008n }, /not 16-byte aligned/],
    [{ globalStridesBytes: [500] }, /multiple of 16/],
    [{ globalStridesBytes: [] }, /expected rank-1 = 1/],
    [{ boxDims: [128, 300] }, /boxDims\[1\] = 300/],
    [{ boxDims: [8, 64] }, /not a multiple of 16/],
    [{ swizzle: TensorMapSwizzle.B64 }, /exceeds the 64-byte swizzle span/],
    [
      {
        globalDims: [1, 2, 3, 4, 5, 6],
        globalStridesBytes: [16, 32, 48, 64, 80],
        boxDims: [16, 1, 1, 1, 1, 1],
      },
      /rank 6/,
    ],
    [{ globalDims: [0, 256] }, /globalDims\[0\] = 0/],
    [{ elementStrides: [1, 9] }, /elementStrides\[1\] = 9/],
    [{ dataType: 99 }, /unknown dataType 99/],
  ];
  for (const [change, pattern] of cases) {
    const problems = tensorMapTiledProblems({ ...good, ...change });
    assert.ok(
      problems.some((p) => pattern.test(p)),
      `${JSON.stringify(change, (_k, v) => (typeof v === "bigint" ? `${v}` : v))}: ${problems.join("; ")}`,
    );
  }
  assert.throws(
    () => encodeTensorMapTiled(new Uint8Array(128), good),
    /CUDA is not available|64-byte aligned/,
  );
});
