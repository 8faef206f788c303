/**
 * The NVRTC backend of the JIT against a stand-in libnvrtc (test/fixtures/cuda/mock_libnvrtc.c) that
 * echoes its inputs: checks the option array, program name, log and cubin retrieval, and the cache
 * key's dependence on the compiler. Skipped without a C compiler.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, test } from "node:test";
import {
  compileKernel,
  includeDir,
  KernelCompileError,
  packageRoot,
  selectCompiler,
} from "../../src/cuda/jit.js";
import { locateCudaInclude } from "../../src/cuda/locate.js";

const cc = ["cc", "gcc"].find((c) => spawnSync(c, ["--version"]).status === 0);
const skip = cc ? false : "no C compiler (cc/gcc) to build the mock libnvrtc";
let work = "";

before(() => {
  work = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
  if (!cc) return;
  const library = path.join(work, "libnvrtc.so.13");
  const source = path.join(packageRoot(), "test", "fixtures", "cuda", "mock_libnvrtc.c");
  const r = spawnSync(cc, ["-shared", "-fPIC", "-O1", "-o", library, source], { encoding: "utf8" });
  assert.equal(r.status, 0, r.stderr);
  process.env.MEGAMOE_LIBNVRTC = library;
  delete process.env.MEGAMOE_JIT_COMPILER;
});
after(() => fs.rmSync(work, { recursive: true, force: true }));

function echoed(cubin: Uint8Array): { name: string; options: string[] } {
  const lines = new TextDecoder().decode(cubin).trim().split("\n");
  assert.equal(lines[0], "MOCKCUBIN");
  return {
    name: lines.find((l) => l.startsWith("name="))!.slice(5),
    options: lines.filter((l) => l.startsWith("opt=")).map((l) => l.slice(4)),
  };
}

test("NVRTC is chosen automatically and receives the arch, std, includes and defines", { skip }, () => {
  assert.equal(selectCompiler(), "nvrtc");
  const source = path.join(work, "k.cu");
  fs.writeFileSync(source, 'extern "C" __global__ void k() {}\n');
  const cacheDir = path.join(work, "cache");
  const k = compileKernel({
    source,
    defines: { TILE: 128, USE_X: true, T: "float" },
    cacheDir,
    extraOptions: ["-lineinfo"],
  });
  assert.equal(k.compiler, "nvrtc");
  assert.match(k.compilerVersion, /^NVRTC 13\.0 \(/);
  const e = echoed(k.cubin);
  assert.equal(e.name, source);
  for (const opt of [
    "--gpu-architecture=sm_90a",
    "-std=c++17",
    "-DMEGAMOE_JIT_NVRTC=1",
    `-I${includeDir()}`,
    `-I${work}`,
    "-DT=float",
    "-DTILE=128",
    "-DUSE_X=1",
    "-lineinfo",
  ]) {
    assert.ok(e.options.includes(opt), `missing ${opt} in ${e.options.join(" ")}`);
  }
  const cudaInclude = locateCudaInclude(process.env.MEGAMOE_LIBNVRTC);
  if (cudaInclude.ok)
    assert.ok(e.options.includes(`-I${cudaInclude.path}`), "the CUDA headers folder is passed");
  assert.equal(
    compileKernel({
      source,
      defines: { TILE: 128, USE_X: true, T: "float" },
      cacheDir,
      extraOptions: ["-lineinfo"],
    }).fromCache,
    true,
  );
});

test("an NVRTC compile error carries the log and the source name", { skip }, () => {
  const source = path.join(work, "bad.cu");
  fs.writeFileSync(source, "MOCK_FAIL\n");
  assert.throws(
    () => compileKernel({ source, cacheDir: path.join(work, "cache") }),
    (e: unknown) => {
      assert.ok(e instanceof KernelCompileError);
      assert.equal(e.compiler, "nvrtc");
      assert.match(
        e.message,
        /^nvrtc failed to compile .*bad\.cu: NVRTC_ERROR_COMPILATION\n.*bad\.cu\(1\): error: mock compile failure/,
      );
      return true;
    },
  );
});
