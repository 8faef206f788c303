import assert from "node:assert/strict";
import { test } from "node:test";
import { cudaReasonText, shortCudaReason } from "../../src/cli/gpu-reason.js";

const notFound =
  'libcuda not found (libcuda.so.1); looked in: /a, /b/c, /d; dlopen("libcuda.so.1"): Failed to load shared library: cannot open shared object file: No such file or directory';

test("a not-found reason is said in a few words, without the folders", () => {
  assert.equal(shortCudaReason(notFound), "no CUDA driver found");
  assert.equal(shortCudaReason("libcuda not found (libcuda.so.1); looked in: /a"), "no CUDA driver found");
});

test("a loader failure other than a missing file keeps its message", () => {
  const reason = 'libcuda not found (libcuda.so.1); looked in: /a; dlopen("libcuda.so.1"): wrong ELF class';
  assert.equal(shortCudaReason(reason), 'no CUDA driver found; dlopen("libcuda.so.1"): wrong ELF class');
});

test("a reason without a folder list is unchanged", () => {
  const reason = "cuInit failed with CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected";
  assert.equal(shortCudaReason(reason), reason);
});

test("a command gives the short reason with a hint, or the full one with --verbose", () => {
  assert.equal(
    cudaReasonText(notFound, undefined, "--verbose lists them"),
    "no CUDA driver found (--verbose lists them)",
  );
  assert.equal(cudaReasonText(notFound, true, "--verbose lists them"), notFound);
  const unchanged = "no CUDA device visible (library /x/libcuda.so.1)";
  assert.equal(cudaReasonText(unchanged, false, "hint"), unchanged);
});
