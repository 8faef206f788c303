import assert from "node:assert/strict";
import { test } from "node:test";
import { shortCudaReason } from "../../src/cli/gpu-reason.js";

test("a not-found reason is shortened to the folders' count, the loader's miss in words", () => {
  const reason =
    'libcuda not found (libcuda.so.1); looked in: /a, /b/c, /d; dlopen("libcuda.so.1"): Failed to load shared library: cannot open shared object file: No such file or directory';
  assert.equal(
    shortCudaReason(reason),
    "libcuda not found (libcuda.so.1) in 3 folders, nor by the dynamic loader",
  );
});

test("a loader failure other than a missing file keeps its message", () => {
  const reason = 'libcuda not found (libcuda.so.1); looked in: /a; dlopen("libcuda.so.1"): wrong ELF class';
  assert.equal(
    shortCudaReason(reason),
    'libcuda not found (libcuda.so.1) in 1 folder; dlopen("libcuda.so.1"): wrong ELF class',
  );
});

test("a reason without a folder list is unchanged", () => {
  const reason = "cuInit failed with CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected";
  assert.equal(shortCudaReason(reason), reason);
});
