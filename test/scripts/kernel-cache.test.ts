/** The kernel check's compile cache: what changes its key, and what it stores. */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { test } from "node:test";
import { CompileCache, type CompileInputs, compileKey } from "../../scripts/kernel-cache.js";

/** A checkout in miniature: a .cu beside a header of its own, which includes one from the include folder. */
function fixture(): { root: string; inputs: CompileInputs; write: (rel: string, text: string) => void } {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-kcache-"));
  const write = (rel: string, text: string) => {
    fs.mkdirSync(path.dirname(path.join(root, rel)), { recursive: true });
    fs.writeFileSync(path.join(root, rel), text);
  };
  write("src/kernels/k/k.cu", '#include "local.cuh"\n#include <cuda_fp8.h>\n__global__ void k() {}\n');
  write("src/kernels/k/local.cuh", "#pragma once\n#include <megamoe/shared.cuh>\n");
  write("src/include/megamoe/shared.cuh", "#pragma once\nconstexpr int kShared = 1;\n");
  write("src/include/megamoe/unused.cuh", "#pragma once\n");
  const include = path.join(root, "src/include");
  const inputs: CompileInputs = {
    source: path.join(root, "src/kernels/k/k.cu"),
    includeDirs: [include],
    args: ["-gencode=arch=compute_90a,code=sm_90a", `-I${include}`, "-DBLOCK_M=64", "-Xptxas", "-v"],
    compiler: "nvcc\nCuda compilation tools, release 13.0, V13.0.88",
    env: {},
    root,
  };
  return { root, inputs, write };
}

test("identical inputs give the same key; a header, define, flag, compiler or env change gives another", () => {
  const { root, inputs, write } = fixture();
  try {
    const key = compileKey(inputs);
    assert.match(key, /^[0-9a-f]{64}$/);
    assert.equal(compileKey({ ...inputs }), key, "same inputs, same key");
    // A header nothing includes does not matter.
    write("src/include/megamoe/unused.cuh", "#pragma once\nint changed;\n");
    assert.equal(compileKey(inputs), key);

    const changed = (what: string, other: string) => assert.notEqual(other, key, what);
    changed(
      "define",
      compileKey({ ...inputs, args: inputs.args.map((a) => (a === "-DBLOCK_M=64" ? "-DBLOCK_M=128" : a)) }),
    );
    changed("flag", compileKey({ ...inputs, args: [...inputs.args, "-lineinfo"] }));
    changed("compiler version", compileKey({ ...inputs, compiler: inputs.compiler.replace("88", "89") }));
    changed("NVCC_APPEND_FLAGS", compileKey({ ...inputs, env: { NVCC_APPEND_FLAGS: "-G" } }));

    // A header two includes away (the .cu's own header includes it from the include folder).
    write("src/include/megamoe/shared.cuh", "#pragma once\nconstexpr int kShared = 2;\n");
    const afterShared = compileKey(inputs);
    changed("transitive header", afterShared);
    write("src/kernels/k/local.cuh", "#pragma once\n#include <megamoe/shared.cuh>\n// edited\n");
    assert.notEqual(compileKey(inputs), afterShared, "header beside the source");
  } finally {
    fs.rmSync(root, { recursive: true, force: true });
  }
});

test("a computed #include hashes every header of the include folders", () => {
  const { root, inputs, write } = fixture();
  try {
    write("src/kernels/k/k.cu", "#define H <megamoe/shared.cuh>\n#include H\n__global__ void k() {}\n");
    const key = compileKey(inputs);
    write("src/include/megamoe/unused.cuh", "#pragma once\nint changed;\n");
    assert.notEqual(compileKey(inputs), key);
  } finally {
    fs.rmSync(root, { recursive: true, force: true });
  }
});

test("the cache returns what a successful compile stored, never a failed one, and prunes the rest", () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-kcache-"));
  try {
    const log = "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n";
    const first = new CompileCache(dir);
    assert.equal(first.get("a"), undefined, "empty cache: a miss");
    first.put("a", true, { log, seconds: 1.5 });
    first.put("b", false, { log: "error: expected a ;", seconds: 0.5 });
    assert.deepEqual(first.get("a"), { log, seconds: 1.5 });
    assert.equal(first.get("b"), undefined, "a failed compile is not stored");
    assert.deepEqual(fs.readdirSync(dir), ["a.json"], "one entry, no temp file left");

    // A later run: a corrupt entry is a miss, and pruning keeps only what that run used.
    fs.writeFileSync(path.join(dir, "c.json"), '{"ok": true, "log": ');
    fs.writeFileSync(path.join(dir, "d.json"), JSON.stringify({ ok: true, log, seconds: 1 }));
    const second = new CompileCache(dir);
    assert.equal(second.get("c"), undefined);
    assert.deepEqual(second.get("d"), { log, seconds: 1 });
    assert.equal(second.prune(), 2);
    assert.deepEqual(fs.readdirSync(dir), ["d.json"]);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
