/**
 * Builds test/fixtures/cuda/mock_libcuda.c (a CPU stand-in for libcuda, compiled against the real
 * cuda.h) into a temp folder. Used by the mock-driver tests; needs a C compiler and the CUDA headers.
 */
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after } from "node:test";
import koffi from "koffi";
import { compilerAvailable, packageRoot } from "../../src/cuda/jit.js";
import { locateCudaInclude } from "../../src/cuda/locate.js";

export type MockBuild = { ok: true; library: string; dir: string } | { ok: false; reason: string };

export function buildMockLibcuda(): MockBuild {
  const include = locateCudaInclude();
  if (!include.ok) return { ok: false, reason: `CUDA headers not found: ${include.reason}` };
  const cc = ["cc", "gcc"].find((c) => spawnSync(c, ["--version"]).status === 0);
  if (!cc) return { ok: false, reason: "no C compiler (cc/gcc) to build the mock libcuda" };
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
  const library = path.join(dir, "libcuda.so.1");
  const source = path.join(packageRoot(), "test", "fixtures", "cuda", "mock_libcuda.c");
  const r = spawnSync(
    cc,
    ["-shared", "-fPIC", "-O1", "-D_GNU_SOURCE", `-I${include.path}`, "-o", library, source],
    {
      encoding: "utf8",
    },
  );
  if (r.status !== 0) {
    fs.rmSync(dir, { recursive: true, force: true });
    throw new Error(`building the mock libcuda failed:\n${r.stderr}`);
  }
  return { ok: true, library, dir };
}

/** A minimal 64-bit ELF for EM_CUDA whose string table holds `names`: enough for the mock's module checks. */
export function fakeCubin(names: string[]): Uint8Array {
  const strings = Buffer.from(`\0${names.join("\0")}\0`);
  const shentsize = Math.max(64, strings.length);
  const image = Buffer.alloc(64 + shentsize);
  image.write("\x7fELF", 0, "latin1");
  image[4] = 2; // 64-bit
  image[5] = 1; // little-endian
  image.writeUInt16LE(190, 18); // EM_CUDA
  image.writeBigUInt64LE(64n, 40); // e_shoff
  image.writeUInt16LE(shentsize, 58);
  image.writeUInt16LE(1, 60);
  strings.copy(image, 64);
  return new Uint8Array(image);
}

/** The mock's introspection calls (test/fixtures/cuda/mock_libcuda.c), bound through koffi. */
export interface MockControl {
  /** Start (clearing) or stop the event log: allocations, streams, launches and declared kernels' arguments. */
  start(): void;
  stop(): void;
  read(): string[];
  /** Every synchronization fails with `code` from now on (0: healthy again). */
  failSyncs(code: number): void;
  vmmTrace(): string[];
  vmmReset(): void;
  /** Declares a kernel's parameter sizes so that its launches' argument bytes are logged. */
  declareParams(name: string, sizes: number[]): void;
}

export function bindMock(library: string): MockControl {
  const lib = koffi.load(library);
  const events = lib.func("void mock_events(int on)");
  const read = lib.func("size_t mock_events_read(void *out, size_t cap)");
  const failSyncs = lib.func("void mock_fail_syncs(int code)");
  const trace = lib.func("size_t mock_vmm_trace(void *out, size_t cap)");
  const reset = lib.func("void mock_vmm_trace_reset()");
  const declare = lib.func("int mock_declare_params(const char *name, int n, const int *sizes)");
  const lines = (f: (out: Buffer, cap: number) => unknown, size: number) => {
    const out = Buffer.alloc(size);
    f(out, out.length);
    return out
      .toString("utf8", 0, out.indexOf(0))
      .split("\n")
      .filter((l) => l.length > 0);
  };
  return {
    start: () => events(1),
    stop: () => events(0),
    read: () => lines(read, 1 << 18),
    failSyncs: (code) => failSyncs(code),
    vmmTrace: () => lines(trace, 1 << 16),
    vmmReset: () => reset(),
    declareParams: (name, sizes) => {
      if (declare(name, sizes.length, Int32Array.from(sizes)) !== 0)
        throw new Error(`mock_declare_params refused ${name} (${sizes.length} parameters)`);
    },
  };
}

/**
 * A test file's mock libcuda and private JIT cache (for stand-in images the test seeds), removed after
 * the file; `skip` says why the file cannot run here (no C compiler or CUDA headers, or no CUDA compiler
 * to key the cache by), else false.
 */
export function mockWithJitCache(): { mock: MockBuild; skip: string | false; cacheDir: string } {
  let mock: MockBuild;
  try {
    mock = buildMockLibcuda();
  } catch (e) {
    mock = { ok: false, reason: (e as Error).message };
  }
  const compiler = ["nvcc", "nvrtc"].find((c) => compilerAvailable(c as "nvcc"));
  const skip = !mock.ok
    ? mock.reason
    : compiler === undefined
      ? "no CUDA compiler to key the JIT cache"
      : false;
  const cacheDir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-jit-cache-"));
  after(() => {
    if (mock.ok) fs.rmSync(mock.dir, { recursive: true, force: true });
    fs.rmSync(cacheDir, { recursive: true, force: true });
  });
  return { mock, skip, cacheDir };
}
