/**
 * Folders megamoe writes in (the JIT cache, results, plots): created without recursive mkdir, which
 * spins forever under /proc. Each case runs in a child process with a timeout, so a regression to the
 * hang fails the test instead of hanging it.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, describe, it } from "node:test";
import { compilerAvailable, packageRoot } from "../../src/cuda/jit.js";
import { DirectoryError, directoryProblem, makeDirectory, outputFileProblem } from "../../src/cuda/mkdir.js";

const root = packageRoot();
const TIMEOUT_MS = 60_000;

/** Runs `code` (an ES module body) in a fresh Node with tsx; a hang is killed after TIMEOUT_MS. */
function child(code: string, env: NodeJS.ProcessEnv = {}) {
  const r = spawnSync(process.execPath, ["--import", "tsx", "--input-type=module", "-e", code], {
    cwd: root,
    encoding: "utf8",
    timeout: TIMEOUT_MS,
    env: { ...process.env, ...env },
  });
  assert.notEqual(r.signal, "SIGTERM", `timed out after ${TIMEOUT_MS} ms (the recursive mkdir hang?)`);
  return r;
}

let work = "";
before(() => {
  work = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-mkdir-"));
});
after(() => fs.rmSync(work, { recursive: true, force: true }));

describe("makeDirectory", () => {
  it("creates missing parents and accepts an existing folder", () => {
    const dir = path.join(work, "a", "b", "c");
    makeDirectory(dir);
    assert.ok(fs.statSync(dir).isDirectory());
    makeDirectory(dir);
    assert.equal(directoryProblem(dir), undefined);
  });

  it("names a file in the way", () => {
    const file = path.join(work, "plain");
    fs.writeFileSync(file, "x");
    assert.throws(
      () => makeDirectory(path.join(file, "sub")),
      (e: unknown) => e instanceof DirectoryError && /plain is not a folder/.test(e.message),
    );
    assert.match(directoryProblem(path.join(file, "sub")) ?? "", /is not a folder/);
  });

  it("fails under /proc instead of spinning", () => {
    const r = child(
      `import { makeDirectory } from "./src/cuda/mkdir.ts";
       try { makeDirectory("/proc/nope/jit"); console.log("created"); }
       catch (e) { console.log(e.name + ": " + e.message); }`,
    );
    assert.equal(r.status, 0, r.stderr);
    assert.match(
      r.stdout,
      /DirectoryError: folder \/proc\/nope\/jit is not usable: cannot create \/proc\/nope/,
    );
  });
});

describe("outputFileProblem", () => {
  it("accepts a new file in a new folder under a writable one", () => {
    assert.equal(outputFileProblem(path.join(work, "new", "deeper", "out.json")), undefined);
    assert.equal(fs.existsSync(path.join(work, "new")), false, "checking creates nothing");
  });

  it("refuses a folder, a path through a file, and pseudo file systems", () => {
    assert.match(outputFileProblem(work) ?? "", /is a folder/);
    const file = path.join(work, "file.txt");
    fs.writeFileSync(file, "x");
    assert.match(outputFileProblem(path.join(file, "out.json")) ?? "", /file\.txt is not a folder/);
    assert.match(outputFileProblem("/proc/nope/out.json") ?? "", /is under \/proc, a pseudo file system/);
    assert.match(outputFileProblem("/sys/out.svg") ?? "", /is under \/sys/);
  });
});

describe("the JIT cache in an unusable folder", {
  skip: compilerAvailable("nvcc") ? false : "nvcc not found",
}, () => {
  it("compiles, says in one line the entry was not written, and does not hang", () => {
    const source = path.join(root, "test", "fixtures", "jit", "jit_smoke.cu");
    const r = child(
      `import { compileKernel } from "./src/cuda/jit.ts";
       const k = compileKernel({ source: ${JSON.stringify(source)}, defines: { FACTOR: 3 }, compiler: "nvcc" });
       console.log(JSON.stringify({ bytes: k.cubin.length, fromCache: k.fromCache }));`,
      { MEGAMOE_CACHE_DIR: "/proc/nope" },
    );
    assert.equal(r.status, 0, r.stderr);
    const out = JSON.parse(r.stdout.trim().split("\n").at(-1)!);
    assert.ok(out.bytes > 0);
    assert.equal(out.fromCache, false);
    assert.match(
      r.stderr,
      /could not write JIT cache entry \/proc\/nope\/jit\/[0-9a-f]+\.cubin: .*cannot create \/proc\/nope/,
    );
  });
});
