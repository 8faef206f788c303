/**
 * The kernel check's compile cache (scripts/compile-kernels.ts): ptxas's report of each compile that
 * nvcc accepted, keyed by a sha256 of everything that determines the cubin — the .cu text, the path and
 * text of every project header it includes (transitively, the JIT's own `collectIncludes`), nvcc's
 * arguments (defines and flags), nvcc's path and `--version`, and the NVCC_PREPEND/APPEND_FLAGS it
 * reads. CUDA's own headers are covered by nvcc's version. A failed compile is never stored, and the
 * report is re-checked on every run, so a cached spill still fails the check.
 *
 * The cache lives in the checkout (`.cache/kernels/`, git-ignored): a fresh clone compiles every
 * variant once.
 */
import { createHash, randomBytes } from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { collectIncludes } from "../src/cuda/jit.js";

const KEY_FORMAT = "megamoe-kernels-check-v1";

/** What determines one compile's output, besides the files' contents (read by {@link compileKey}). */
export interface CompileInputs {
  /** The .cu file (absolute). */
  source: string;
  /** Folders searched for its headers (absolute), as passed to nvcc with -I. */
  includeDirs: readonly string[];
  /** nvcc's arguments other than the output and source paths: flags, -I, -D. */
  args: readonly string[];
  /** nvcc's path and `nvcc --version` output. */
  compiler: string;
  /** Environment nvcc reads (NVCC_PREPEND_FLAGS, NVCC_APPEND_FLAGS). */
  env?: Readonly<Record<string, string | undefined>>;
  /** Paths are hashed relative to this folder, so two checkouts of one commit share keys. */
  root: string;
}

function listFiles(dir: string): string[] {
  const out: string[] = [];
  for (const e of fs.readdirSync(dir, { withFileTypes: true })) {
    const p = path.join(dir, e.name);
    if (e.isDirectory()) out.push(...listFiles(p));
    else if (e.isFile()) out.push(p);
  }
  return out;
}

/** The sha256 (hex) of a compile's inputs; any change to a hashed file or argument changes it. */
export function compileKey(inputs: CompileInputs): string {
  const relative = (p: string) => (p.startsWith(inputs.root + path.sep) ? path.relative(inputs.root, p) : p);
  const includes = collectIncludes(inputs.source, [path.dirname(inputs.source), ...inputs.includeDirs]);
  // A computed `#include MACRO` could name any header: hash them all.
  const headers = includes.dynamic
    ? [...new Set([...includes.files, ...inputs.includeDirs.flatMap(listFiles)])].sort()
    : includes.files;
  const hash = createHash("sha256");
  const field = (label: string, value: Uint8Array | string): void => {
    const bytes = typeof value === "string" ? Buffer.from(value, "utf8") : value;
    hash.update(`${label}\0${bytes.byteLength}\0`);
    hash.update(bytes);
  };
  field("format", KEY_FORMAT);
  field(`source ${relative(inputs.source)}`, fs.readFileSync(inputs.source));
  for (const h of headers) field(`header ${relative(h)}`, fs.readFileSync(h));
  field("args", inputs.args.map((a) => a.split(inputs.root).join("<root>")).join("\n"));
  field("compiler", inputs.compiler);
  const env = inputs.env ?? {};
  for (const name of ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"]) field(`env ${name}`, env[name] ?? "");
  return hash.digest("hex");
}

/** One cached compile: nvcc's output (ptxas's -v report) and how long it took. */
export interface CachedCompile {
  log: string;
  seconds: number;
}

/** A folder of `<key>.json` entries. Unreadable or malformed entries count as misses. */
export class CompileCache {
  readonly dir: string;
  private readonly used = new Set<string>();

  constructor(dir: string) {
    this.dir = dir;
  }

  private file(key: string): string {
    return path.join(this.dir, `${key}.json`);
  }

  get(key: string): CachedCompile | undefined {
    let parsed: unknown;
    try {
      parsed = JSON.parse(fs.readFileSync(this.file(key), "utf8"));
    } catch {
      return undefined;
    }
    const { log, seconds, ok } = parsed as { log?: unknown; seconds?: unknown; ok?: unknown };
    if (ok !== true || typeof log !== "string" || typeof seconds !== "number") return undefined;
    this.used.add(key);
    return { log, seconds };
  }

  /** Stores a compile nvcc accepted; a failed one (`ok` false) is refused, so it is retried next run. */
  put(key: string, ok: boolean, entry: CachedCompile): void {
    if (!ok) return;
    this.used.add(key);
    try {
      fs.mkdirSync(this.dir, { recursive: true });
      // Temp file + rename: a run killed midway leaves no truncated entry.
      const temp = `${this.file(key)}.${process.pid}.${randomBytes(4).toString("hex")}.tmp`;
      fs.writeFileSync(temp, JSON.stringify({ ok: true, ...entry }));
      fs.renameSync(temp, this.file(key));
    } catch (e) {
      process.stderr.write(`kernels:check: could not write cache entry: ${(e as Error).message}\n`);
    }
  }

  /** Deletes the entries this run neither read nor wrote (stale sources); returns how many. */
  prune(): number {
    let removed = 0;
    let names: string[];
    try {
      names = fs.readdirSync(this.dir);
    } catch {
      return 0;
    }
    for (const name of names) {
      const key = name.replace(/\.json$/, "");
      if (name.endsWith(".json") && this.used.has(key)) continue;
      fs.rmSync(path.join(this.dir, name), { force: true });
      removed++;
    }
    return removed;
  }
}
