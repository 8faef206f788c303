/**
 * Finding the CUDA pieces on disk: the driver library, NVRTC, the CUDA headers and nvcc.
 *
 * Each lookup walks a fixed, documented list of places and returns either the first hit or a reason
 * that lists every place it looked, so "CUDA not found" is always actionable. An explicit env
 * override (`MEGAMOE_LIBCUDA`, `MEGAMOE_LIBNVRTC`, `MEGAMOE_NVCC`) is trusted alone: when it names a
 * missing file the lookup fails instead of silently picking another copy.
 */

import { execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

/** Outcome of a lookup: the path found, or why nothing was found; `searched` lists every candidate tried. */
export type LocateResult =
  | { ok: true; path: string; searched: string[] }
  | { ok: false; reason: string; searched: string[] };

/** What a lookup may read from its surroundings; tests replace these. */
export interface LocateEnv {
  env: NodeJS.ProcessEnv;
  fileExists: (file: string) => boolean;
  /** Python site-packages folders (searched for pip `nvidia-*` wheels). */
  sitePackages: () => string[];
  /** Folders named `/usr/local/cuda-<version>`, newest first. */
  versionedCudaRoots: () => string[];
}

function isFile(file: string): boolean {
  try {
    return fs.statSync(file).isFile();
  } catch {
    return false;
  }
}

/** `x86_64-linux` / `sbsa-linux`: the per-target folder names CUDA uses under `targets/`. */
function cudaTargetDir(): string {
  return process.arch === "arm64" ? "sbsa-linux" : "x86_64-linux";
}

/** Debian multiarch folder for this CPU. */
function multiarchDir(): string {
  return process.arch === "arm64" ? "aarch64-linux-gnu" : "x86_64-linux-gnu";
}

let cachedSitePackages: string[] | undefined;

/**
 * Python's site-packages folders, asked of `python3` once per process (about 0.1 s), plus the
 * folders of an active venv / conda env found without running Python. Empty when python3 is absent.
 */
export function pythonSitePackages(): string[] {
  if (cachedSitePackages) return cachedSitePackages;
  const found = new Set<string>();
  for (const prefix of [process.env.VIRTUAL_ENV, process.env.CONDA_PREFIX]) {
    if (!prefix) continue;
    const libDir = path.join(prefix, "lib");
    try {
      for (const entry of fs.readdirSync(libDir)) {
        if (entry.startsWith("python3")) found.add(path.join(libDir, entry, "site-packages"));
      }
    } catch {
      // not a readable env: nothing to add
    }
  }
  try {
    const out = execFileSync(
      "python3",
      ["-c", "import json,site;print(json.dumps(site.getsitepackages()+[site.getusersitepackages()]))"],
      { encoding: "utf8", timeout: 5000, stdio: ["ignore", "pipe", "ignore"] },
    );
    const dirs: unknown = JSON.parse(out);
    if (Array.isArray(dirs)) for (const d of dirs) if (typeof d === "string") found.add(d);
  } catch {
    // python3 missing or broken: pip wheels are simply not searched
  }
  cachedSitePackages = [...found];
  return cachedSitePackages;
}

function listVersionedCudaRoots(): string[] {
  try {
    return fs
      .readdirSync("/usr/local")
      .filter((e) => /^cuda-\d+(\.\d+)*$/.test(e))
      .sort((a, b) => compareVersionsDesc(a.slice(5), b.slice(5)))
      .map((e) => path.join("/usr/local", e));
  } catch {
    return [];
  }
}

function compareVersionsDesc(a: string, b: string): number {
  const pa = a.split(".").map(Number);
  const pb = b.split(".").map(Number);
  for (let i = 0; i < Math.max(pa.length, pb.length); i++) {
    const d = (pb[i] ?? 0) - (pa[i] ?? 0);
    if (d !== 0) return d;
  }
  return 0;
}

/** The real machine: process.env, the file system, python3. */
export const defaultLocateEnv: LocateEnv = {
  env: process.env,
  fileExists: isFile,
  sitePackages: pythonSitePackages,
  versionedCudaRoots: listVersionedCudaRoots,
};

/** Library folders of a CUDA install root (CUDA_HOME style). */
function cudaRootLibDirs(root: string): string[] {
  return [
    path.join(root, "lib64"),
    path.join(root, "lib"),
    path.join(root, "targets", cudaTargetDir(), "lib"),
  ];
}

function envCudaRoots(env: NodeJS.ProcessEnv): string[] {
  return [env.CUDA_HOME, env.CUDA_PATH].filter((r): r is string => !!r);
}

function ldLibraryPathDirs(env: NodeJS.ProcessEnv): string[] {
  return (env.LD_LIBRARY_PATH ?? "").split(":").filter((d) => d.length > 0);
}

/** pip wheel folders that hold CUDA libraries (CUDA 12 wheels: nvidia/<component>/lib; CUDA 13: nvidia/cu13/lib). */
function pipLibDirs(sitePackages: string[], components: string[]): string[] {
  const dirs: string[] = [];
  for (const site of sitePackages) {
    for (const c of ["cu13", ...components]) dirs.push(path.join(site, "nvidia", c, "lib"));
  }
  return dirs;
}

function dedupe(items: string[]): string[] {
  return [...new Set(items)];
}

/**
 * Try `names` (in preference order) in each folder; for each name all folders are tried before the
 * next name, so a newer soname anywhere wins over an older one.
 */
function searchFiles(
  what: string,
  names: string[],
  dirs: string[],
  le: LocateEnv,
  pipDirs: () => string[],
): LocateResult {
  const searched: string[] = [];
  const tryDirs = (ds: string[]): string | undefined => {
    for (const name of names) {
      for (const d of ds) {
        const candidate = path.join(d, name);
        searched.push(candidate);
        if (le.fileExists(candidate)) return candidate;
      }
    }
    return undefined;
  };
  const direct = tryDirs(dedupe(dirs));
  if (direct) return { ok: true, path: direct, searched };
  // pip folders cost a python3 run: only look there when the usual places failed
  const viaPip = tryDirs(dedupe(pipDirs()));
  if (viaPip) return { ok: true, path: viaPip, searched };
  return {
    ok: false,
    searched,
    reason: `${what} not found (${names.join(" or ")}); looked in: ${dedupe(searched.map((s) => path.dirname(s))).join(", ")}`,
  };
}

/**
 * The file an override variable names (`$MEGAMOE_NVCC`, `$NVCC` of kernels:check, …), trusted alone: a
 * value that names no file fails, naming the variable and its value. Undefined when the variable is unset.
 */
export function explicitFile(
  varName: string,
  what: string,
  le: LocateEnv = defaultLocateEnv,
): LocateResult | undefined {
  const value = le.env[varName];
  if (!value) return undefined;
  if (le.fileExists(value)) return { ok: true, path: value, searched: [value] };
  return {
    ok: false,
    searched: [value],
    reason: `${what}: ${varName}=${value} does not name an existing file`,
  };
}

function systemLibDirs(le: LocateEnv): string[] {
  const dirs = [...ldLibraryPathDirs(le.env)];
  for (const root of envCudaRoots(le.env)) dirs.push(...cudaRootLibDirs(root));
  dirs.push(
    "/usr/local/nvidia/lib64",
    `/usr/lib/${multiarchDir()}`,
    `/lib/${multiarchDir()}`,
    "/usr/lib64",
    "/usr/local/cuda/lib64",
    `/usr/local/cuda/targets/${cudaTargetDir()}/lib`,
  );
  for (const root of le.versionedCudaRoots()) dirs.push(...cudaRootLibDirs(root));
  return dirs;
}

/**
 * Find the CUDA driver library `libcuda.so.1`. Order: `$MEGAMOE_LIBCUDA` (alone, when set),
 * `$LD_LIBRARY_PATH`, `$CUDA_HOME` / `$CUDA_PATH` (lib64, lib, targets/<arch>/lib), /usr/local/nvidia/lib64,
 * /usr/lib/<multiarch>, /lib/<multiarch>, /usr/lib64, /usr/local/cuda, /usr/local/cuda-<ver> (newest first),
 * then pip wheels. The toolkit's `stubs/libcuda.so` is never picked (it cannot run anything).
 */
export function locateLibcuda(le: LocateEnv = defaultLocateEnv): LocateResult {
  return (
    explicitFile("MEGAMOE_LIBCUDA", "libcuda", le) ??
    searchFiles("libcuda", ["libcuda.so.1"], systemLibDirs(le), le, () =>
      pipLibDirs(le.sitePackages(), ["cuda_runtime"]),
    )
  );
}

/**
 * Find NVRTC: `libnvrtc.so.13`, then `libnvrtc.so.12`. Same order of places as {@link locateLibcuda},
 * with `$MEGAMOE_LIBNVRTC` as the explicit override and pip's `nvidia/cuda_nvrtc/lib` / `nvidia/cu13/lib`.
 */
export function locateLibnvrtc(le: LocateEnv = defaultLocateEnv): LocateResult {
  return (
    explicitFile("MEGAMOE_LIBNVRTC", "libnvrtc", le) ??
    searchFiles("libnvrtc", ["libnvrtc.so.13", "libnvrtc.so.12"], systemLibDirs(le), le, () =>
      pipLibDirs(le.sitePackages(), ["cuda_nvrtc"]),
    )
  );
}

/**
 * Find nvcc: `$MEGAMOE_NVCC` (alone, when set), `$CUDA_HOME/bin`, `$CUDA_PATH/bin`, `$PATH`,
 * /usr/local/cuda/bin, /usr/local/cuda-<ver>/bin.
 */
export function locateNvcc(le: LocateEnv = defaultLocateEnv): LocateResult {
  const explicit = explicitFile("MEGAMOE_NVCC", "nvcc", le);
  if (explicit) return explicit;
  const dirs = envCudaRoots(le.env).map((r) => path.join(r, "bin"));
  dirs.push(...(le.env.PATH ?? "").split(":").filter((d) => d.length > 0));
  dirs.push("/usr/local/cuda/bin", ...le.versionedCudaRoots().map((r) => path.join(r, "bin")));
  return searchFiles("nvcc", ["nvcc"], dirs, le, () => []);
}

/**
 * Find the CUDA headers folder (the one holding `cuda_fp8.h`), for NVRTC's `-I`. Tries the folder next
 * to the NVRTC library first (`<root>/targets/<arch>/lib` → `<root>/targets/<arch>/include`, pip
 * `nvidia/<x>/lib` → `nvidia/<x>/include`), then CUDA_HOME / CUDA_PATH, /usr/local/cuda,
 * /usr/local/cuda-<ver>, pip `nvidia/cuda_runtime/include`.
 */
export function locateCudaInclude(nvrtcPath?: string, le: LocateEnv = defaultLocateEnv): LocateResult {
  const dirs: string[] = [];
  if (nvrtcPath) {
    const libDir = path.dirname(nvrtcPath);
    dirs.push(path.join(libDir, "..", "include"), path.join(libDir, "..", "..", "include"));
  }
  for (const root of envCudaRoots(le.env)) dirs.push(path.join(root, "include"));
  dirs.push(
    "/usr/local/cuda/include",
    `/usr/local/cuda/targets/${cudaTargetDir()}/include`,
    ...le.versionedCudaRoots().map((r) => path.join(r, "include")),
  );
  const found = searchFiles(
    "CUDA headers",
    ["cuda_fp8.h"],
    dirs.map((d) => path.normalize(d)),
    le,
    () =>
      le
        .sitePackages()
        .flatMap((s) => ["cu13", "cuda_runtime"].map((c) => path.join(s, "nvidia", c, "include"))),
  );
  return found.ok ? { ok: true, path: path.dirname(found.path), searched: found.searched } : found;
}

/** Home-relative path helper kept here so every module agrees on `~`. */
export function homeDir(): string {
  return process.env.HOME ?? os.homedir();
}
