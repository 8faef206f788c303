/**
 * Just-in-time kernel compilation with a disk cache.
 *
 * Kernels are CUDA C++ files shipped in the package (`src/kernels/<family>/*.cu`, device helpers in
 * `src/include/common/*.cuh`). `compileKernel` turns one into a cubin with compile-time constants
 * (`defines`), through NVRTC (in process) or nvcc (subprocess), and caches the result on disk.
 *
 * Cache key = sha256 of: the source text, the path and text of every project header it includes
 * (found by following `#include`s), the defines, the extra options, the compiler name and version,
 * and the arch. CUDA's own headers are covered by the compiler version. Entries are written
 * atomically (temp file + rename) with a header holding the payload length and its sha256, so a
 * truncated or corrupt entry is detected, reported in one line, and rebuilt.
 *
 * Environment: `MEGAMOE_JIT_COMPILER=nvrtc|nvcc` (default: NVRTC when found, else nvcc),
 * `MEGAMOE_ARCH` (default sm_90a), `MEGAMOE_CACHE_DIR` (default `$XDG_CACHE_HOME/megamoe` or
 * `~/.cache/megamoe`), `MEGAMOE_NVCC`, `MEGAMOE_LIBNVRTC`.
 */

import { execFile, execFileSync, spawnSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { checkOptionFields, describeValue } from "../config/config.js";
import type { Device, Kernel, Module } from "./driver.js";
import { homeDir, locateCudaInclude, locateNvcc } from "./locate.js";
import { perDeviceMemo } from "./memo.js";
import { makeDirectory } from "./mkdir.js";
import { loadNvrtc, nvrtcCompile } from "./nvrtc.js";

/** The two compiler backends. */
export type JitCompilerName = "nvrtc" | "nvcc";

/** A compile-time constant: numbers and strings are emitted as `-DNAME=value`, booleans as 1 / 0. */
export type DefineValue = number | string | boolean;

/** What to compile. */
export interface CompileKernelOptions {
  /** The .cu file: a path relative to `<package>/src/kernels` (e.g. "quant/quant.cu") or absolute. */
  source: string;
  /** Compile-time constants (`-DNAME=value`). Names must be C identifiers. */
  defines?: Readonly<Record<string, DefineValue>>;
  /** Target, e.g. "sm_90a" (default `$MEGAMOE_ARCH` or "sm_90a"). */
  arch?: string;
  /** Additional compiler options, passed as is (they must suit the chosen compiler). */
  extraOptions?: readonly string[];
  /** Force a backend (default `$MEGAMOE_JIT_COMPILER`, else automatic). */
  compiler?: JitCompilerName;
  /** Cache folder (default from the environment, see module doc). */
  cacheDir?: string;
  /** Extra include folders, searched after the project's `src/include`. */
  includeDirs?: readonly string[];
}

/** A compiled kernel image. */
export interface CompiledKernel {
  cubin: Uint8Array;
  /** Absolute path of the .cu file. */
  sourcePath: string;
  /** Cache key (sha256 hex). */
  key: string;
  compiler: JitCompilerName;
  compilerVersion: string;
  arch: string;
  /** True when read from the disk cache. */
  fromCache: boolean;
  /** Milliseconds spent compiling (0 on a cache hit). */
  compileMs: number;
  /** Compiler warnings ("" on a cache hit). */
  log: string;
}

/** Compilation failed; `log` holds the compiler's diagnostics. */
export class KernelCompileError extends Error {
  readonly sourcePath: string;
  readonly compiler: JitCompilerName;
  readonly log: string;

  constructor(sourcePath: string, compiler: JitCompilerName, summary: string, log: string) {
    super(`${compiler} failed to compile ${sourcePath}: ${summary}${log ? `\n${log}` : ""}`);
    this.name = "KernelCompileError";
    this.sourcePath = sourcePath;
    this.compiler = compiler;
    this.log = log;
  }
}

/** Counters for tests and reports. */
export interface JitStats {
  hits: number;
  misses: number;
  /** Total milliseconds spent compiling. */
  compileMs: number;
  /** Cache entries found corrupt and rebuilt. */
  corruptEntries: number;
}

const stats: JitStats = { hits: 0, misses: 0, compileMs: 0, corruptEntries: 0 };

/** A snapshot of this process's JIT counters. */
export function jitStats(): JitStats {
  return { ...stats };
}

/** Zero the counters. */
export function resetJitStats(): void {
  stats.hits = 0;
  stats.misses = 0;
  stats.compileMs = 0;
  stats.corruptEntries = 0;
}

// ---------------------------------------------------------------------------------------------------
// Package layout

let cachedRoot: string | undefined;

/** The folder of the package.json named "megamoe", found by walking up from this file. */
export function packageRoot(): string {
  if (cachedRoot) return cachedRoot;
  let dir = path.dirname(fileURLToPath(import.meta.url));
  for (;;) {
    const candidate = path.join(dir, "package.json");
    try {
      const pkg: unknown = JSON.parse(fs.readFileSync(candidate, "utf8"));
      if (typeof pkg === "object" && pkg !== null && (pkg as { name?: unknown }).name === "megamoe") {
        cachedRoot = dir;
        return dir;
      }
    } catch {
      // no package.json here: keep walking
    }
    const parent = path.dirname(dir);
    if (parent === dir)
      throw new Error(`cannot find the megamoe package.json above ${fileURLToPath(import.meta.url)}`);
    dir = parent;
  }
}

/** `<package>/src/kernels`. */
export function kernelsDir(): string {
  return path.join(packageRoot(), "src", "kernels");
}

/** `<package>/src/include` (kernels include `<common/x.cuh>`). */
export function includeDir(): string {
  return path.join(packageRoot(), "src", "include");
}

/** The JIT cache folder: `$MEGAMOE_CACHE_DIR`, `$XDG_CACHE_HOME/megamoe` or `~/.cache/megamoe`. */
export function jitCacheDir(): string {
  const env = process.env;
  if (env.MEGAMOE_CACHE_DIR) return env.MEGAMOE_CACHE_DIR;
  if (env.XDG_CACHE_HOME) return path.join(env.XDG_CACHE_HOME, "megamoe");
  return path.join(homeDir(), ".cache", "megamoe");
}

/**
 * The arch used when none is given: `$MEGAMOE_ARCH` or "sm_90a". A `$MEGAMOE_ARCH` that is no CUDA arch
 * throws TypeError naming the variable (see {@link jitEnvProblems}).
 */
export function defaultArch(): string {
  const problem = archEnvProblem(process.env);
  if (problem !== undefined) throw new TypeError(problem);
  return process.env.MEGAMOE_ARCH || "sm_90a";
}

function archEnvProblem(env: NodeJS.ProcessEnv): string | undefined {
  const arch = env.MEGAMOE_ARCH;
  if (!arch) return undefined;
  const problem = archProblem(arch);
  return problem === undefined ? undefined : `MEGAMOE_ARCH=${arch} is ${problem}`;
}

function compilerEnvProblem(env: NodeJS.ProcessEnv): string | undefined {
  const forced = env.MEGAMOE_JIT_COMPILER;
  if (!forced || forced === "nvrtc" || forced === "nvcc") return undefined;
  return `MEGAMOE_JIT_COMPILER=${forced}: expected "nvrtc" or "nvcc"`;
}

/**
 * Why the JIT's settings in the environment cannot be used: `$MEGAMOE_JIT_COMPILER` and `$MEGAMOE_ARCH`,
 * each named with its value, as locate.ts names a bad `$MEGAMOE_NVCC` (`megamoe info` lists them; a
 * compile throws the first). Empty when they are unset or usable.
 */
export function jitEnvProblems(env: NodeJS.ProcessEnv = process.env): string[] {
  return [compilerEnvProblem(env), archEnvProblem(env)].filter((p): p is string => p !== undefined);
}

/** Absolute path of a kernel source given as in {@link CompileKernelOptions.source}. */
export function resolveKernelSource(source: string): string {
  return path.isAbsolute(source) ? source : path.join(kernelsDir(), source);
}

// ---------------------------------------------------------------------------------------------------
// Compile inputs

const IDENTIFIER = /^[A-Za-z_][A-Za-z0-9_]*$/;
const ARCH = /^sm_((\d+)[a-z]?)$/;
/** sm_50 (Maxwell): the oldest arch a CUDA 12 nvcc or NVRTC still builds for. */
const MIN_ARCH = 50;
const INCLUDE_LINE = /^[ \t]*#[ \t]*include[ \t]*(.*)$/gm;

/** `-DNAME=value` options for `defines`, sorted by name; validates names and values. */
export function defineOptions(defines: Readonly<Record<string, DefineValue>> = {}): string[] {
  return Object.keys(defines)
    .sort()
    .map((name) => {
      if (!IDENTIFIER.test(name)) throw new TypeError(`define name "${name}" is not a C identifier`);
      const v = defines[name]!;
      if (typeof v === "boolean") return `-D${name}=${v ? 1 : 0}`;
      if (typeof v === "number") {
        if (!Number.isFinite(v)) throw new TypeError(`define ${name} = ${v} is not finite`);
        return `-D${name}=${v}`;
      }
      if (typeof v !== "string" || /[\r\n]/.test(v))
        throw new TypeError(`define ${name} has an invalid value`);
      return `-D${name}=${v}`;
    });
}

/** Why `arch` is not a CUDA arch string ("sm_90a"), or undefined when it is one. */
function archProblem(arch: string): string | undefined {
  const m = typeof arch === "string" ? ARCH.exec(arch) : null;
  if (!m) return "not of the form sm_<number>[suffix], e.g. sm_90a";
  if (Number(m[2]) < MIN_ARCH) return `older than any GPU CUDA builds for (sm_${MIN_ARCH} and newer)`;
  return undefined;
}

/** Validate an arch string ("sm_90a") and return its number part ("90a"). */
export function archNumber(arch: string): string {
  const problem = archProblem(arch);
  if (problem !== undefined) throw new TypeError(`arch: ${describeValue(arch)} is ${problem}`);
  return ARCH.exec(arch)![1]!;
}

/**
 * The project headers a source includes, transitively: `#include "x"` is looked up next to the
 * including file, then in `includeDirs`; `#include <x>` in `includeDirs`. Headers not found there
 * (CUDA, the C++ library) are skipped. `dynamic` is true when some `#include` is not a literal name
 * (then the caller hashes every header in the include folders).
 */
export function collectIncludes(
  sourcePath: string,
  includeDirs: readonly string[],
): { files: string[]; dynamic: boolean } {
  const seen = new Set<string>();
  let dynamic = false;
  const visit = (file: string): void => {
    const text = fs.readFileSync(file, "utf8");
    for (const match of text.matchAll(INCLUDE_LINE)) {
      const spec = match[1]!.trim();
      const quoted = /^"([^"]+)"/.exec(spec);
      const angled = /^<([^>]+)>/.exec(spec);
      if (!quoted && !angled) {
        dynamic = true;
        continue;
      }
      const name = (quoted ?? angled)![1]!;
      const dirs = quoted ? [path.dirname(file), ...includeDirs] : includeDirs;
      for (const d of dirs) {
        const candidate = path.resolve(d, name);
        if (fs.existsSync(candidate) && fs.statSync(candidate).isFile()) {
          if (!seen.has(candidate)) {
            seen.add(candidate);
            visit(candidate);
          }
          break;
        }
      }
    }
  };
  visit(sourcePath);
  return { files: [...seen].sort(), dynamic };
}

function listFilesRecursive(dir: string): string[] {
  const out: string[] = [];
  const walk = (d: string): void => {
    let entries: fs.Dirent[];
    try {
      entries = fs.readdirSync(d, { withFileTypes: true });
    } catch {
      return;
    }
    for (const e of entries) {
      const p = path.join(d, e.name);
      if (e.isDirectory()) walk(p);
      else if (e.isFile()) out.push(p);
    }
  };
  walk(dir);
  return out.sort();
}

// ---------------------------------------------------------------------------------------------------
// Backends

interface Backend {
  name: JitCompilerName;
  version: string;
  /** Options common to every compilation with this backend, beyond defines / includes / extras. */
  compileSync(sourcePath: string, options: string[], arch: string): { cubin: Uint8Array; log: string };
  compileAsync(
    sourcePath: string,
    options: string[],
    arch: string,
  ): Promise<{ cubin: Uint8Array; log: string }>;
}

const backends = new Map<JitCompilerName, Backend | { reason: string }>();

/**
 * `nvcc --version`'s text, or why `nvcc` (a path, or a name on PATH) is not a working nvcc: the check
 * of every nvcc megamoe is told to use (`$MEGAMOE_NVCC` here, `$NVCC` in kernels:check).
 */
export function nvccVersion(nvcc: string): { version: string } | { reason: string } {
  let version: string;
  try {
    version = execFileSync(nvcc, ["--version"], {
      encoding: "utf8",
      timeout: 30_000,
      stdio: ["ignore", "pipe", "pipe"],
    }).trim();
  } catch (e) {
    // One line, and the failed program's stderr kept off ours (it is in the message).
    const message = (e as Error).message.replace(/\s*\n\s*/g, "; ").replace(/; $/, "");
    return { reason: `nvcc at ${nvcc} does not run: ${message}` };
  }
  // Any program that exits 0 would pass the run alone (/bin/true, say).
  if (!/NVIDIA \(R\) Cuda compiler driver|Cuda compilation tools/.test(version)) {
    return { reason: `${nvcc} is not nvcc: its --version does not say "Cuda compilation tools"` };
  }
  return { version };
}

function nvccBackend(): Backend | { reason: string } {
  const located = locateNvcc();
  if (!located.ok) return { reason: located.reason };
  const nvcc = located.path;
  const checked = nvccVersion(nvcc);
  if ("reason" in checked) return checked;
  const { version } = checked;
  const args = (sourcePath: string, options: string[], arch: string, outFile: string): string[] => {
    const n = archNumber(arch);
    return [
      "-cubin",
      `-gencode=arch=compute_${n},code=sm_${n}`,
      "-std=c++17",
      "-O3",
      ...options,
      "-o",
      outFile,
      sourcePath,
    ];
  };
  const tempOut = (): { dir: string; file: string } => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-nvcc-"));
    return { dir, file: path.join(dir, "out.cubin") };
  };
  const failure = (sourcePath: string, e: unknown): KernelCompileError => {
    const err = e as {
      status?: number | null;
      stderr?: string | Buffer;
      stdout?: string | Buffer;
      message: string;
    };
    const log = `${err.stdout?.toString() ?? ""}${err.stderr?.toString() ?? ""}`.trim();
    return new KernelCompileError(
      sourcePath,
      "nvcc",
      err.status != null ? `exit status ${err.status}` : err.message,
      log,
    );
  };
  return {
    name: "nvcc",
    version,
    compileSync(sourcePath, options, arch) {
      const out = tempOut();
      try {
        const r = spawnSync(nvcc, args(sourcePath, options, arch, out.file), {
          encoding: "utf8",
          maxBuffer: 64 * 1024 * 1024,
        });
        if (r.error || r.status !== 0) {
          throw failure(sourcePath, Object.assign(r.error ?? new Error("nvcc failed"), r));
        }
        return { cubin: new Uint8Array(fs.readFileSync(out.file)), log: `${r.stdout}${r.stderr}`.trim() };
      } finally {
        fs.rmSync(out.dir, { recursive: true, force: true });
      }
    },
    compileAsync(sourcePath, options, arch) {
      const out = tempOut();
      return new Promise((resolve, reject) => {
        execFile(
          nvcc,
          args(sourcePath, options, arch, out.file),
          { encoding: "utf8", maxBuffer: 64 * 1024 * 1024 },
          (error, stdout, stderr) => {
            try {
              if (error) {
                reject(failure(sourcePath, Object.assign(error, { stdout, stderr, status: error.code })));
                return;
              }
              resolve({ cubin: new Uint8Array(fs.readFileSync(out.file)), log: `${stdout}${stderr}`.trim() });
            } catch (e) {
              reject(e);
            } finally {
              fs.rmSync(out.dir, { recursive: true, force: true });
            }
          },
        );
      });
    },
  };
}

function nvrtcBackend(): Backend | { reason: string } {
  const n = loadNvrtc();
  if ("reason" in n) return n;
  const cudaInclude = locateCudaInclude(n.libraryPath);
  const compileSync = (
    sourcePath: string,
    options: string[],
    arch: string,
  ): { cubin: Uint8Array; log: string } => {
    archNumber(arch);
    const source = fs.readFileSync(sourcePath, "utf8");
    // -default-device: unannotated helpers are device code, as nvcc (which builds CI's check) treats
    // constexpr ones; without it NVRTC rejects a kernel that nvcc accepted.
    const all = [
      `--gpu-architecture=${arch}`,
      "-std=c++17",
      "-default-device",
      "-DMEGAMOE_JIT_NVRTC=1",
      ...options,
    ];
    if (cudaInclude.ok) all.push(`-I${cudaInclude.path}`);
    const outcome = nvrtcCompile(n, source, sourcePath, all);
    if (!outcome.ok) throw new KernelCompileError(sourcePath, "nvrtc", outcome.error, outcome.log);
    return { cubin: outcome.cubin, log: outcome.log };
  };
  return {
    name: "nvrtc",
    version: `NVRTC ${n.version.major}.${n.version.minor} (${n.libraryPath})`,
    compileSync,
    compileAsync: async (sourcePath, options, arch) => compileSync(sourcePath, options, arch),
  };
}

function getBackend(name: JitCompilerName): Backend | { reason: string } {
  let b = backends.get(name);
  if (!b) {
    b = name === "nvcc" ? nvccBackend() : nvrtcBackend();
    backends.set(name, b);
  }
  return b;
}

/**
 * The backend to use: `requested`, else `$MEGAMOE_JIT_COMPILER`, else NVRTC when it loads, else nvcc.
 * @throws Error listing why each candidate is unavailable
 */
export function selectCompiler(requested?: JitCompilerName): JitCompilerName {
  if (requested !== undefined && requested !== "nvrtc" && requested !== "nvcc") {
    throw new TypeError(`compiler must be "nvrtc" or "nvcc", got ${describeValue(requested)}`);
  }
  const envProblem = requested === undefined ? compilerEnvProblem(process.env) : undefined;
  if (envProblem !== undefined) throw new TypeError(envProblem);
  const forced =
    requested ?? ((process.env.MEGAMOE_JIT_COMPILER || undefined) as JitCompilerName | undefined);
  const candidates: JitCompilerName[] = forced ? [forced] : ["nvrtc", "nvcc"];
  const reasons: string[] = [];
  for (const c of candidates) {
    const b = getBackend(c);
    if ("reason" in b) reasons.push(`${c}: ${b.reason}`);
    else return c;
  }
  throw new Error(`no CUDA compiler available. ${reasons.join(". ")}`);
}

/** Whether a backend can be used here (without throwing). */
export function compilerAvailable(name: JitCompilerName): boolean {
  return !("reason" in getBackend(name));
}

/** Why a backend cannot be used here (it was loaded or run and failed), or undefined when it can. */
export function compilerProblem(name: JitCompilerName): string | undefined {
  const b = getBackend(name);
  return "reason" in b ? b.reason : undefined;
}

// ---------------------------------------------------------------------------------------------------
// Disk cache

const CACHE_MAGIC = Buffer.from("MMOEJIT1", "ascii");
const CACHE_HEADER_BYTES = CACHE_MAGIC.length + 8 + 32;
const KEY_FORMAT = "megamoe-jit-key-v1";

function sha256(data: Uint8Array | string): Buffer {
  return createHash("sha256").update(data).digest();
}

/** Serialize a cache entry: magic, payload length (u64 LE), sha256(payload), payload. */
export function encodeCacheEntry(payload: Uint8Array): Buffer {
  const header = Buffer.alloc(CACHE_HEADER_BYTES);
  CACHE_MAGIC.copy(header, 0);
  header.writeBigUInt64LE(BigInt(payload.byteLength), CACHE_MAGIC.length);
  sha256(payload).copy(header, CACHE_MAGIC.length + 8);
  return Buffer.concat([header, payload]);
}

/** Parse a cache entry; `{ problem }` says why it is unusable. */
export function decodeCacheEntry(entry: Uint8Array): { payload: Uint8Array } | { problem: string } {
  const buf = Buffer.from(entry.buffer, entry.byteOffset, entry.byteLength);
  if (buf.length < CACHE_HEADER_BYTES)
    return { problem: `only ${buf.length} bytes, shorter than the header` };
  if (!buf.subarray(0, CACHE_MAGIC.length).equals(CACHE_MAGIC)) return { problem: "bad magic" };
  const length = buf.readBigUInt64LE(CACHE_MAGIC.length);
  const actual = BigInt(buf.length - CACHE_HEADER_BYTES);
  if (length !== actual) return { problem: `payload is ${actual} bytes, header says ${length}` };
  const payload = buf.subarray(CACHE_HEADER_BYTES);
  if (!sha256(payload).equals(buf.subarray(CACHE_MAGIC.length + 8, CACHE_HEADER_BYTES))) {
    return { problem: "checksum mismatch" };
  }
  return { payload: new Uint8Array(payload) };
}

/** Path of the cache entry for `key`. */
export function cacheEntryPath(cacheDir: string, key: string): string {
  return path.join(cacheDir, "jit", `${key}.cubin`);
}

function readCacheEntry(file: string): Uint8Array | undefined {
  let raw: Buffer;
  try {
    raw = fs.readFileSync(file);
  } catch {
    return undefined;
  }
  const decoded = decodeCacheEntry(raw);
  if ("problem" in decoded) {
    stats.corruptEntries++;
    process.stderr.write(
      `megamoe: JIT cache entry ${file} is unusable (${decoded.problem}); rebuilding it\n`,
    );
    return undefined;
  }
  return decoded.payload;
}

function writeCacheEntry(file: string, payload: Uint8Array): void {
  try {
    makeDirectory(path.dirname(file));
    const temp = `${file}.${process.pid}.${randomBytes(6).toString("hex")}.tmp`;
    fs.writeFileSync(temp, encodeCacheEntry(payload));
    fs.renameSync(temp, file);
  } catch (e) {
    process.stderr.write(`megamoe: could not write JIT cache entry ${file}: ${(e as Error).message}\n`);
  }
}

// ---------------------------------------------------------------------------------------------------
// compileKernel

interface Prepared {
  sourcePath: string;
  backend: Backend;
  arch: string;
  options: string[];
  key: string;
  entry: string;
}

const COMPILE_OPTIONS: readonly (keyof CompileKernelOptions)[] = [
  "source",
  "defines",
  "arch",
  "extraOptions",
  "compiler",
  "cacheDir",
  "includeDirs",
];

function prepare(opts: CompileKernelOptions): Prepared {
  if (opts === undefined) throw new TypeError("compileKernel needs its options ({ source, … })");
  checkOptionFields("compileKernel options", opts, COMPILE_OPTIONS, (m) => new TypeError(m));
  const sourcePath = resolveKernelSource(opts.source);
  if (!fs.existsSync(sourcePath)) throw new Error(`kernel source ${sourcePath} does not exist`);
  const arch = opts.arch ?? defaultArch();
  archNumber(arch);
  const compilerName = selectCompiler(opts.compiler);
  const backend = getBackend(compilerName) as Backend;
  const projectInclude = includeDir();
  const userIncludes = (opts.includeDirs ?? []).map((d) => path.resolve(d));
  const includeDirs = [projectInclude, ...userIncludes];
  const defines = defineOptions(opts.defines);
  const extra = [...(opts.extraOptions ?? [])];
  // Source lines in the cubin, for compute-sanitizer's and the profilers' reports (part of the key).
  if (process.env.MEGAMOE_JIT_LINEINFO === "1" && !extra.includes("-lineinfo")) extra.push("-lineinfo");
  const options = [
    `-I${projectInclude}`,
    `-I${path.dirname(sourcePath)}`,
    ...userIncludes.map((d) => `-I${d}`),
    ...defines,
    ...extra,
  ];

  const includes = collectIncludes(sourcePath, [path.dirname(sourcePath), ...includeDirs]);
  const headerFiles = includes.dynamic
    ? [...new Set([...includes.files, ...includeDirs.flatMap(listFilesRecursive)])].sort()
    : includes.files;
  const root = packageRoot();
  const hash = createHash("sha256");
  const field = (label: string, value: Uint8Array | string): void => {
    const bytes = typeof value === "string" ? Buffer.from(value, "utf8") : value;
    hash.update(`${label}\0${bytes.byteLength}\0`);
    hash.update(bytes);
  };
  field("format", KEY_FORMAT);
  field("source", fs.readFileSync(sourcePath));
  for (const h of headerFiles) {
    const rel = h.startsWith(root + path.sep) ? path.relative(root, h) : h;
    field(`header ${rel}`, fs.readFileSync(h));
  }
  field("defines", defines.join("\n"));
  field("extra", extra.join("\n"));
  field("userIncludes", userIncludes.join("\n"));
  field("compiler", `${backend.name}\n${backend.version}`);
  field("arch", arch);
  const key = hash.digest("hex");
  const cacheDir = opts.cacheDir ?? jitCacheDir();
  return { sourcePath, backend, arch, options, key, entry: cacheEntryPath(cacheDir, key) };
}

function fromCache(p: Prepared): CompiledKernel | undefined {
  const cubin = readCacheEntry(p.entry);
  if (!cubin) return undefined;
  stats.hits++;
  return {
    cubin,
    sourcePath: p.sourcePath,
    key: p.key,
    compiler: p.backend.name,
    compilerVersion: p.backend.version,
    arch: p.arch,
    fromCache: true,
    compileMs: 0,
    log: "",
  };
}

function finish(p: Prepared, result: { cubin: Uint8Array; log: string }, ms: number): CompiledKernel {
  stats.misses++;
  stats.compileMs += ms;
  writeCacheEntry(p.entry, result.cubin);
  return {
    cubin: result.cubin,
    sourcePath: p.sourcePath,
    key: p.key,
    compiler: p.backend.name,
    compilerVersion: p.backend.version,
    arch: p.arch,
    fromCache: false,
    compileMs: ms,
    log: result.log,
  };
}

/** The cache file compileKernel reads for `opts` (tests seed it with a stand-in image for a mock driver). */
export function kernelCacheEntry(opts: CompileKernelOptions): string {
  return prepare(opts).entry;
}

/**
 * Compile a kernel source to a cubin, or take it from the disk cache.
 * @throws KernelCompileError (with the compiler log and the source path) when compilation fails
 */
export function compileKernel(opts: CompileKernelOptions): CompiledKernel {
  const p = prepare(opts);
  const cached = fromCache(p);
  if (cached) return cached;
  const t0 = performance.now();
  const result = p.backend.compileSync(p.sourcePath, p.options, p.arch);
  return finish(p, result, performance.now() - t0);
}

/** Like {@link compileKernel}, but nvcc runs without blocking the event loop (compile several at once). */
export async function compileKernelAsync(opts: CompileKernelOptions): Promise<CompiledKernel> {
  const p = prepare(opts);
  const cached = fromCache(p);
  if (cached) return cached;
  const t0 = performance.now();
  const result = await p.backend.compileAsync(p.sourcePath, p.options, p.arch);
  return finish(p, result, performance.now() - t0);
}

// ---------------------------------------------------------------------------------------------------
// Loading

const loadedModules = perDeviceMemo<string, { module: Module; kernels: Map<string, Kernel> }>();

/**
 * The kernel `functionName` (an `extern "C"` name) of a compiled image on `device`. Each image is
 * loaded once per device and each kernel looked up once, so repeated calls return the same `Kernel`.
 */
export function loadKernel(device: Device, compiled: CompiledKernel, functionName: string): Kernel {
  const entry = loadedModules(device, compiled.key, () => ({
    module: device.loadModule(compiled.cubin),
    kernels: new Map(),
  }));
  let kernel = entry.kernels.get(functionName);
  if (!kernel) {
    kernel = entry.module.getFunction(functionName);
    entry.kernels.set(functionName, kernel);
  }
  return kernel;
}
