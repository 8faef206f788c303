/**
 * The environment variables that choose CUDA pieces, checked as `$MEGAMOE_NVCC` is: the JIT's
 * `$MEGAMOE_JIT_COMPILER` and `$MEGAMOE_ARCH`, kernels:check's `$NVCC`, and a `$MEGAMOE_LIBCUDA` that
 * names a library other than the driver (libc, libz). Each bad value is named, with the variable, in
 * `megamoe info` and where it is used; an unusable driver library sends `run` to the CPU.
 */
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import { describe, it } from "node:test";
import {
  archNumber,
  compileKernel,
  defaultArch,
  jitEnvProblems,
  nvccVersion,
  selectCompiler,
} from "../../src/cuda/jit.js";
import { explicitFile, type LocateEnv } from "../../src/cuda/locate.js";
import { repoRoot, runCli } from "../helpers/cli.js";

/** Runs `fn` with `vars` set in process.env (undefined: unset), restoring them afterwards. */
function withEnv<T>(vars: Record<string, string | undefined>, fn: () => T): T {
  const saved = Object.fromEntries(Object.keys(vars).map((k) => [k, process.env[k]]));
  const put = (values: Record<string, string | undefined>) => {
    for (const [k, v] of Object.entries(values)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  };
  put(vars);
  try {
    return fn();
  } finally {
    put(saved);
  }
}

const multiarch = process.arch === "arm64" ? "aarch64-linux-gnu" : "x86_64-linux-gnu";
const libc = `/lib/${multiarch}/libc.so.6`;
const libz = `/lib/${multiarch}/libz.so.1`;
const noLibc = fs.existsSync(libc) ? false : `${libc} is absent here`;
const noLibz = fs.existsSync(libz) ? false : `${libz} is absent here`;

describe("MEGAMOE_JIT_COMPILER and MEGAMOE_ARCH, named with their values", () => {
  it("jitEnvProblems names each bad variable and its value", () => {
    assert.deepEqual(jitEnvProblems({ MEGAMOE_JIT_COMPILER: "bogus", MEGAMOE_ARCH: "sm_00" }), [
      'MEGAMOE_JIT_COMPILER=bogus: expected "nvrtc" or "nvcc"',
      "MEGAMOE_ARCH=sm_00 is older than any GPU CUDA builds for (sm_50 and newer)",
    ]);
    assert.deepEqual(jitEnvProblems({ MEGAMOE_ARCH: "compute_90" }), [
      "MEGAMOE_ARCH=compute_90 is not of the form sm_<number>[suffix], e.g. sm_90a",
    ]);
  });

  it("accepted: unset, empty (the default) and real arches and compilers", () => {
    assert.deepEqual(jitEnvProblems({}), []);
    assert.deepEqual(jitEnvProblems({ MEGAMOE_JIT_COMPILER: "", MEGAMOE_ARCH: "" }), []);
    for (const arch of ["sm_50", "sm_80", "sm_90", "sm_90a", "sm_100a", "sm_120"]) {
      assert.deepEqual(jitEnvProblems({ MEGAMOE_ARCH: arch }), [], arch);
    }
    for (const compiler of ["nvrtc", "nvcc"]) {
      assert.deepEqual(jitEnvProblems({ MEGAMOE_JIT_COMPILER: compiler }), [], compiler);
    }
  });

  it("a compile throws the bad variable before it compiles anything", () => {
    withEnv({ MEGAMOE_JIT_COMPILER: "bogus" }, () => {
      assert.throws(() => selectCompiler(), {
        name: "TypeError",
        message: 'MEGAMOE_JIT_COMPILER=bogus: expected "nvrtc" or "nvcc"',
      });
      // An explicit compiler is the caller's choice: the variable is not read (nvcc may still be absent).
      try {
        assert.equal(selectCompiler("nvcc"), "nvcc");
      } catch (e) {
        assert.doesNotMatch((e as Error).message, /MEGAMOE_JIT_COMPILER/);
      }
    });
    withEnv({ MEGAMOE_ARCH: "sm_00" }, () => {
      assert.throws(() => defaultArch(), /MEGAMOE_ARCH=sm_00 is older than any GPU/);
      assert.throws(
        () => compileKernel({ source: "quant/quant.cu", defines: { HIDDEN: 256 } }),
        /MEGAMOE_ARCH=sm_00 is older than any GPU/,
      );
    });
  });

  it("an arch given as an option is checked by the same rule", () => {
    assert.throws(() => archNumber("sm_00"), /arch: the string "sm_00" is older than any GPU/);
    assert.throws(() => archNumber("compute_90"), /is not of the form sm_<number>\[suffix\]/);
    assert.throws(
      () => selectCompiler("gcc" as never),
      /compiler must be "nvrtc" or "nvcc", got the string "gcc"/,
    );
    assert.equal(archNumber("sm_90a"), "90a");
  });

  it("megamoe info lists them", async () => {
    const env = { MEGAMOE_JIT_COMPILER: "bogus", MEGAMOE_ARCH: "sm_00" };
    const [text, json] = await Promise.all([
      runCli(["info", "--no-measure"], env),
      runCli(["info", "--json", "--no-measure"], env),
    ]);
    assert.equal(text.code, 0, text.stderr);
    assert.match(
      text.stdout,
      /jit env\s+not usable: MEGAMOE_JIT_COMPILER=bogus: expected "nvrtc" or "nvcc"; MEGAMOE_ARCH=sm_00 is older/,
    );
    assert.equal(json.code, 0, json.stderr);
    assert.deepEqual(JSON.parse(json.stdout).jitEnvUnusable, jitEnvProblems(env));
  });
});

describe("kernels:check's NVCC, trusted alone as MEGAMOE_NVCC is", () => {
  const check = (nvcc: string) =>
    spawnSync(process.execPath, ["--import", "tsx", path.join(repoRoot, "scripts/compile-kernels.ts")], {
      cwd: repoRoot,
      encoding: "utf8",
      env: { ...process.env, NVCC: nvcc, NO_COLOR: "1" },
      timeout: 60_000,
    });

  it("nvccVersion: the JIT's nvcc check, shared with kernels:check", () => {
    const passwd = nvccVersion("/etc/passwd");
    assert.ok("reason" in passwd && /nvcc at \/etc\/passwd does not run/.test(passwd.reason));
    const trueProgram = nvccVersion("true");
    assert.ok("reason" in trueProgram && /true is not nvcc/.test(trueProgram.reason));
  });

  it("explicitFile names the variable and its value", () => {
    const le: LocateEnv = {
      env: { NVCC: "/nonexistent/nvcc" },
      fileExists: () => false,
      sitePackages: () => [],
      versionedCudaRoots: () => [],
    };
    const r = explicitFile("NVCC", "nvcc", le);
    assert.ok(r !== undefined && !r.ok);
    assert.equal(r.reason, "nvcc: NVCC=/nonexistent/nvcc does not name an existing file");
    assert.equal(explicitFile("NVCC", "nvcc", { ...le, env: {} }), undefined);
  });

  for (const [nvcc, message] of [
    ["/etc/passwd", /kernels:check FAILED: nvcc: NVCC=\/etc\/passwd is not a working nvcc: .*does not run/],
    [
      "/nonexistent/nvcc",
      /kernels:check FAILED: nvcc: NVCC=\/nonexistent\/nvcc does not name an existing file/,
    ],
    ["true", /kernels:check FAILED: nvcc: NVCC=true is not a working nvcc: true is not nvcc/],
  ] as const) {
    it(`NVCC=${nvcc} fails the check, naming NVCC, before compiling anything`, () => {
      const r = check(nvcc);
      assert.equal(r.status, 1, r.stdout + r.stderr);
      assert.match(r.stderr, message);
      assert.doesNotMatch(r.stdout, /SKIP|kernels:check ok/);
    });
  }
});

describe("MEGAMOE_LIBCUDA naming a library that is not the CUDA driver", () => {
  const pattern = (lib: string) =>
    new RegExp(
      `CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND \\(302\\).*MEGAMOE_LIBCUDA=${lib}: ${lib} is not the CUDA driver library \\(libcuda\\.so\\.1\\): it exports none of cuInit`,
    );

  it("is an unusable CUDA whose reason is a CudaError naming the variable; openDevice throws it", {
    skip: noLibc,
  }, () => {
    const probe = [
      'const m = await import("./src/cuda/index.ts");',
      "const a = m.cudaAvailability();",
      "let thrown = null;",
      "try { m.openDevice(0); } catch (e) { thrown = { name: e.name, isCudaError: e instanceof m.CudaError, message: e.message }; }",
      "console.log(JSON.stringify({ a, thrown }));",
    ].join("\n");
    const r = spawnSync(process.execPath, ["--import", "tsx", "--input-type=module", "-e", probe], {
      cwd: repoRoot,
      encoding: "utf8",
      env: { ...process.env, MEGAMOE_LIBCUDA: libc },
    });
    assert.equal(r.status, 0, r.stderr);
    const { a, thrown } = JSON.parse(r.stdout) as {
      a: { ok: boolean; reason: string };
      thrown: { name: string; isCudaError: boolean; message: string };
    };
    assert.equal(a.ok, false);
    assert.match(a.reason, pattern(libc));
    assert.doesNotMatch(a.reason, /driver too old/);
    assert.equal(thrown.name, "CudaError");
    assert.equal(thrown.isCudaError, true);
    assert.equal(thrown.message, a.reason);
  });

  it("megamoe info reports it", { skip: noLibc }, async () => {
    const [text, json] = await Promise.all([
      runCli(["info", "--no-measure"], { MEGAMOE_LIBCUDA: libc }),
      runCli(["info", "--json", "--no-measure"], { MEGAMOE_LIBCUDA: libc }),
    ]);
    assert.equal(text.code, 0, text.stderr);
    assert.match(text.stdout, /megamoe info/);
    assert.match(text.stdout, /cuda\s+unavailable: /);
    assert.match(text.stdout, pattern(libc));
    assert.equal(json.code, 0, json.stderr);
    assert.match(JSON.parse(json.stdout).cudaUnavailable, pattern(libc));
  });

  it("run --backend auto falls back to the CPU with the reason; --backend cuda refuses", {
    skip: noLibz,
  }, async () => {
    const [auto, forced] = await Promise.all([
      runCli(["run", "--tokens", "2", "--json"], { MEGAMOE_LIBCUDA: libz }),
      runCli(["run", "--tokens", "2", "--backend", "cuda"], { MEGAMOE_LIBCUDA: libz }),
    ]);
    assert.equal(auto.code, 0, auto.stderr);
    assert.equal(JSON.parse(auto.stdout).backend, "cpu");
    assert.match(auto.stderr, new RegExp(`MEGAMOE_LIBCUDA=${libz}`));
    assert.equal(forced.code, 1);
    assert.match(forced.stderr, /--backend cuda needs a CUDA GPU: /);
    assert.match(forced.stderr, pattern(libz));
  });
});
