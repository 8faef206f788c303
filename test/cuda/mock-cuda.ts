/**
 * Builds test/fixtures/cuda/mock_libcuda.c (a CPU stand-in for libcuda, compiled against the real
 * cuda.h) into a temp folder. Used by the mock-driver tests; needs a C compiler and the CUDA headers.
 */
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { packageRoot } from "../../src/cuda/jit.js";
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
