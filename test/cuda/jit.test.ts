/**
 * JIT compilation and its disk cache, with the nvcc backend (skipped when nvcc is missing).
 * Every test works on copies of test/fixtures/jit in a fresh temp folder with its own cache.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, test } from "node:test";
import { pathToFileURL } from "node:url";
import {
  archNumber,
  cacheEntryPath,
  collectIncludes,
  compileKernel,
  compileKernelAsync,
  compilerAvailable,
  decodeCacheEntry,
  defineOptions,
  encodeCacheEntry,
  jitStats,
  KernelCompileError,
  packageRoot,
  resetJitStats,
  resolveKernelSource,
  selectCompiler,
} from "../../src/cuda/jit.js";

const nvcc = compilerAvailable("nvcc");
const skip = nvcc ? false : "nvcc not found (set MEGAMOE_NVCC or CUDA_HOME to run the JIT tests)";
const fixtures = path.join(packageRoot(), "test", "fixtures", "jit");
let work = "";
let cacheDir = "";
let source = "";

before(() => {
  work = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
  cacheDir = path.join(work, "cache");
  for (const f of fs.readdirSync(fixtures)) fs.copyFileSync(path.join(fixtures, f), path.join(work, f));
  source = path.join(work, "jit_smoke.cu");
});
after(() => fs.rmSync(work, { recursive: true, force: true }));

/** Capture what the code under test writes to stderr. */
function captureStderr<T>(fn: () => T): { value: T; stderr: string } {
  const original = process.stderr.write.bind(process.stderr);
  let text = "";
  process.stderr.write = ((chunk: string | Uint8Array) => {
    text += chunk.toString();
    return true;
  }) as typeof process.stderr.write;
  try {
    return { value: fn(), stderr: text };
  } finally {
    process.stderr.write = original;
  }
}

function isCudaCubin(bytes: Uint8Array): boolean {
  return (
    bytes[0] === 0x7f && bytes[1] === 0x45 && bytes[2] === 0x4c && bytes[3] === 0x46 && bytes[18] === 190
  );
}

test("pure pieces: defines, arch, source paths, cache entry format", () => {
  assert.deepEqual(defineOptions({ B: true, A: 3, C: "2.0f", D: false }), [
    "-DA=3",
    "-DB=1",
    "-DC=2.0f",
    "-DD=0",
  ]);
  assert.throws(() => defineOptions({ "BAD-NAME": 1 }), /not a C identifier/);
  assert.throws(() => defineOptions({ X: Number.NaN }), /not finite/);
  assert.throws(() => defineOptions({ X: "a\nb" }), /invalid value/);
  assert.equal(archNumber("sm_90a"), "90a");
  assert.throws(() => archNumber("compute_90"), /sm_<number>/);
  assert.equal(
    resolveKernelSource("quant/x.cu"),
    path.join(packageRoot(), "src", "kernels", "quant", "x.cu"),
  );
  assert.equal(resolveKernelSource("/abs/x.cu"), "/abs/x.cu");
  const payload = new Uint8Array(1000).map((_, i) => (i * 13 + 5) & 0xff);
  const entry = encodeCacheEntry(payload);
  assert.deepEqual("payload" in decodeCacheEntry(entry) && decodeCacheEntry(entry), { payload });
  assert.match(JSON.stringify(decodeCacheEntry(entry.subarray(0, 500))), /header says 1000/);
  const flipped = Buffer.from(entry);
  flipped[700]! ^= 1;
  assert.deepEqual(decodeCacheEntry(flipped), { problem: "checksum mismatch" });
  assert.deepEqual(decodeCacheEntry(new Uint8Array(10)), {
    problem: "only 10 bytes, shorter than the header",
  });
  assert.throws(() => selectCompiler("clang" as never), /must be "nvrtc" or "nvcc"/);
});

test("includes are followed transitively; CUDA headers are ignored", () => {
  const dir = path.join(work, "inc");
  fs.mkdirSync(path.join(dir, "lib", "common"), { recursive: true });
  fs.writeFileSync(
    path.join(dir, "a.cu"),
    '#include "b.cuh"\n#include <common/c.cuh>\n#include <cuda_fp8.h>\n',
  );
  fs.writeFileSync(path.join(dir, "b.cuh"), "#pragma once\n  #  include <common/c.cuh>\n");
  fs.writeFileSync(path.join(dir, "lib", "common", "c.cuh"), "#pragma once\n");
  const r = collectIncludes(path.join(dir, "a.cu"), [path.join(dir, "lib")]);
  assert.deepEqual(r.files, [path.join(dir, "b.cuh"), path.join(dir, "lib", "common", "c.cuh")].sort());
  assert.equal(r.dynamic, false);
  fs.writeFileSync(path.join(dir, "d.cu"), "#define H <x.h>\n#include H\n");
  assert.equal(collectIncludes(path.join(dir, "d.cu"), []).dynamic, true);
});

test("miss, then hit with identical bytes; defines and headers change the key", { skip }, () => {
  resetJitStats();
  const first = compileKernel({ source, defines: { FACTOR: 3 }, compiler: "nvcc", cacheDir });
  assert.equal(first.fromCache, false);
  assert.ok(isCudaCubin(first.cubin), "an ELF for EM_CUDA");
  assert.ok(Buffer.from(first.cubin).includes("jit_smoke"), "the kernel symbol is in the cubin");
  assert.equal(first.compiler, "nvcc");
  assert.equal(first.arch, "sm_90a");
  assert.ok(fs.existsSync(cacheEntryPath(cacheDir, first.key)));
  const second = compileKernel({ source, defines: { FACTOR: 3 }, compiler: "nvcc", cacheDir });
  assert.equal(second.fromCache, true);
  assert.equal(second.key, first.key);
  assert.deepEqual(second.cubin, first.cubin);
  assert.deepEqual({ hits: jitStats().hits, misses: jitStats().misses }, { hits: 1, misses: 1 });
  assert.ok(jitStats().compileMs > 0);

  const otherDefine = compileKernel({ source, defines: { FACTOR: 4 }, compiler: "nvcc", cacheDir });
  assert.notEqual(otherDefine.key, first.key);
  assert.equal(otherDefine.fromCache, false);

  const header = path.join(work, "jit_smoke_helper.cuh");
  const original = fs.readFileSync(header, "utf8");
  fs.writeFileSync(header, original.replace("+ 0.5f", "+ 0.25f"));
  try {
    const edited = compileKernel({ source, defines: { FACTOR: 3 }, compiler: "nvcc", cacheDir });
    assert.notEqual(edited.key, first.key, "editing an included header must change the key");
    assert.equal(edited.fromCache, false);
  } finally {
    fs.writeFileSync(header, original);
  }
  assert.equal(compileKernel({ source, defines: { FACTOR: 3 }, compiler: "nvcc", cacheDir }).fromCache, true);
});

test("a second process uses the cache without compiling", { skip }, () => {
  const first = compileKernel({ source, defines: { FACTOR: 3 }, compiler: "nvcc", cacheDir });
  const jitUrl = pathToFileURL(path.join(packageRoot(), "src", "cuda", "jit.ts")).href;
  const script = `
    import { compileKernel, jitStats } from ${JSON.stringify(jitUrl)};
    const k = compileKernel({ source: ${JSON.stringify(source)}, defines: { FACTOR: 3 }, compiler: "nvcc", cacheDir: ${JSON.stringify(cacheDir)} });
    console.log(JSON.stringify({ key: k.key, fromCache: k.fromCache, stats: jitStats() }));`;
  const r = spawnSync(process.execPath, ["--import", "tsx", "--input-type=module", "-e", script], {
    encoding: "utf8",
  });
  assert.equal(r.status, 0, r.stderr);
  const out = JSON.parse(r.stdout.trim().split("\n").at(-1)!);
  assert.equal(out.key, first.key);
  assert.equal(out.fromCache, true);
  assert.deepEqual(out.stats, { hits: 1, misses: 0, compileMs: 0, corruptEntries: 0 });
});

test("a truncated or corrupted entry is reported in one line and rebuilt", { skip }, () => {
  const good = compileKernel({ source, defines: { FACTOR: 5 }, compiler: "nvcc", cacheDir });
  const entry = cacheEntryPath(cacheDir, good.key);
  for (const damage of [
    (b: Buffer) => b.subarray(0, b.length - 100),
    (b: Buffer) => {
      const c = Buffer.from(b);
      c[c.length - 1]! ^= 0xff;
      return c;
    },
  ]) {
    fs.writeFileSync(entry, damage(fs.readFileSync(entry)));
    resetJitStats();
    const { value, stderr } = captureStderr(() =>
      compileKernel({ source, defines: { FACTOR: 5 }, compiler: "nvcc", cacheDir }),
    );
    assert.equal(value.fromCache, false);
    assert.deepEqual(value.cubin, good.cubin);
    assert.equal(jitStats().corruptEntries, 1);
    assert.equal(jitStats().misses, 1);
    assert.equal(stderr.trim().split("\n").length, 1, stderr);
    assert.match(stderr, /JIT cache entry .* is unusable \((payload is|checksum mismatch)/);
    assert.equal(
      compileKernel({ source, defines: { FACTOR: 5 }, compiler: "nvcc", cacheDir }).fromCache,
      true,
    );
  }
});

test("a compile error carries the compiler log and the file name", { skip }, () => {
  const bad = path.join(work, "broken_kernel.cu");
  fs.writeFileSync(bad, 'extern "C" __global__ void broken(int* p) { p[0] = undeclared_name; }\n');
  resetJitStats();
  assert.throws(
    () => compileKernel({ source: bad, compiler: "nvcc", cacheDir }),
    (e: unknown) => {
      assert.ok(e instanceof KernelCompileError);
      assert.equal(e.sourcePath, bad);
      assert.match(e.message, /nvcc failed to compile .*broken_kernel\.cu/);
      assert.match(e.log, /undeclared_name/);
      assert.match(e.message, /undeclared_name/);
      return true;
    },
  );
  assert.equal(jitStats().misses, 0);
  assert.throws(() => compileKernel({ source, compiler: "nvcc", cacheDir }), /FACTOR must be defined/);
  assert.throws(() => compileKernel({ source: path.join(work, "missing.cu"), cacheDir }), /does not exist/);
});

test("async compilation and an arch override", { skip }, async () => {
  const saved = process.env.MEGAMOE_ARCH;
  process.env.MEGAMOE_ARCH = "sm_80";
  try {
    const k = await compileKernelAsync({ source, defines: { FACTOR: 7 }, compiler: "nvcc", cacheDir });
    assert.equal(k.arch, "sm_80");
    assert.equal(k.fromCache, false);
    assert.ok(isCudaCubin(k.cubin));
    assert.equal(
      (await compileKernelAsync({ source, defines: { FACTOR: 7 }, compiler: "nvcc", cacheDir })).fromCache,
      true,
    );
  } finally {
    if (saved === undefined) delete process.env.MEGAMOE_ARCH;
    else process.env.MEGAMOE_ARCH = saved;
  }
  await assert.rejects(
    compileKernelAsync({ source: path.join(work, "broken_kernel.cu"), compiler: "nvcc", cacheDir }),
    KernelCompileError,
  );
});

test("without NVRTC, automatic selection falls back to nvcc and forcing NVRTC explains why not", {
  skip,
}, (t) => {
  if (compilerAvailable("nvrtc")) return t.skip("NVRTC is available here");
  assert.equal(selectCompiler(), "nvcc");
  assert.throws(() => selectCompiler("nvrtc"), /no CUDA compiler available\. nvrtc: libnvrtc not found/);
});
