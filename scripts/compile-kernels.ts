/**
 * CI check of every CUDA kernel: compiles each `src/kernels/**\/*.cu` with nvcc for sm_90a, once per
 * specialization its family lists (`<name>.variants.ts` beside the .cu, see src/kernels/variants.ts),
 * reads ptxas's resource report, and exits non-zero when a compile fails, a kernel marked
 * no-spill spills or uses a local stack frame, or ptxas serializes a kernel's wgmmas (C7518). Without
 * nvcc it prints SKIP and exits 0, so the check stays optional on machines without the CUDA toolkit.
 *
 * By default it compiles a sample that covers every source and every code path of its variants
 * (scripts/kernel-sample.ts states the rule): about a quarter of them, so `npm test` stays short;
 * `--all` compiles every variant (CI's second step, .ci/run).
 *
 * Prints what it compiles, a progress line every 10 s off a terminal (a bar on one), and one summary
 * line; `--table` (or KERNELS_TABLE=1) adds ptxas's table of every kernel, and a failure always prints
 * its rows and nvcc's log. Compiles nvcc accepted are cached by a hash of their inputs in
 * `.cache/kernels/` (scripts/kernel-cache.ts); `--no-cache` (or KERNELS_CACHE=0) skips it.
 *
 * Run: `npm run kernels:check [-- --all] [-- --table]` (NVCC=/path/to/nvcc to pick the compiler,
 * which must then be a working nvcc: a bad one fails the check rather than falling back; KERNELS_JOBS for parallelism, default: the CPU count).
 */
import { execFile } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";
import { progressBar } from "../src/cli/progress.js";
import { defineOptions, nvccVersion } from "../src/cuda/jit.js";
import { explicitFile } from "../src/cuda/locate.js";
import { describeDefines } from "../src/kernels/variants.js";
import { CompileCache, compileKey } from "./kernel-cache.js";
import { type CompileJob, compileJobs } from "./kernel-sample.js";
import { type FunctionReport, parsePtxasReport, ptxasProblems } from "./ptxas-report.js";

const run = promisify(execFile);

const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const includeDir = path.join(repoRoot, "src", "include");
const ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"];
// Inside the checkout (git-ignored), never in $HOME: a fresh clone (CI) compiles every variant once.
const cacheDir = path.join(repoRoot, ".cache", "kernels");

interface CompileResult {
  job: CompileJob;
  ok: boolean;
  functions: FunctionReport[];
  log: string;
  seconds: number;
  /** Taken from the compile cache (ptxas's report of an earlier identical compile). */
  cached: boolean;
}

async function compile(
  nvcc: string,
  compiler: string,
  job: CompileJob,
  outDir: string,
  index: number,
  cache: CompileCache | undefined,
): Promise<CompileResult> {
  const cubin = path.join(outDir, `${index}-${path.basename(job.source, ".cu")}.cubin`);
  const flags = [
    ...ARCH_FLAGS,
    `-I${includeDir}`,
    ...defineOptions(job.variant.defines), // the JIT's own -D list, so CI compiles what it compiles
    "-Xptxas",
    "-v",
  ];
  const source = path.join(repoRoot, job.source);
  const key = cache
    ? compileKey({
        source,
        includeDirs: [includeDir],
        args: flags,
        compiler,
        env: process.env,
        root: repoRoot,
      })
    : "";
  const hit = cache?.get(key);
  if (hit)
    return { job, ok: true, functions: parsePtxasReport(hit.log), log: hit.log, seconds: 0, cached: true };
  const started = performance.now();
  let ok: boolean;
  let log: string;
  try {
    const { stdout, stderr } = await run(nvcc, [...flags, "-cubin", "-o", cubin, source], {
      cwd: repoRoot,
      maxBuffer: 16 << 20,
    });
    ok = true;
    log = `${stdout}${stderr}`;
  } catch (err) {
    const e = err as { stdout?: string; stderr?: string; message?: string };
    ok = false;
    log = `${e.stdout ?? ""}${e.stderr ?? ""}` || (e.message ?? String(err));
  }
  const seconds = (performance.now() - started) / 1000;
  cache?.put(key, ok, { log, seconds });
  return { job, ok, functions: ok ? parsePtxasReport(log) : [], log, seconds, cached: false };
}

/** Runs `worker` over `items` with at most `limit` in flight, keeping the input order in the result. */
async function mapLimited<T, R>(
  items: readonly T[],
  limit: number,
  worker: (item: T, i: number) => Promise<R>,
) {
  const results = new Array<R>(items.length);
  let next = 0;
  const lanes = Array.from({ length: Math.min(limit, items.length) }, async () => {
    while (next < items.length) {
      const i = next++;
      results[i] = await worker(items[i], i);
    }
  });
  await Promise.all(lanes);
  return results;
}

/** NVCC set to something that is not a working nvcc: an error, never a quiet SKIP or another nvcc. */
class NvccSettingError extends Error {
  override name = "NvccSettingError";
}

/**
 * `$NVCC` under the check of `$MEGAMOE_NVCC` (explicitFile, nvccVersion): a path must name a file, and
 * the program, a path or a name on PATH, must be nvcc.
 */
function explicitNvcc(nvcc: string): string {
  if (nvcc.includes(path.sep)) {
    const named = explicitFile("NVCC", "nvcc");
    if (named !== undefined && !named.ok) throw new NvccSettingError(named.reason);
  }
  const checked = nvccVersion(nvcc);
  if ("reason" in checked) {
    throw new NvccSettingError(`nvcc: NVCC=${nvcc} is not a working nvcc: ${checked.reason}`);
  }
  return nvcc;
}

async function findNvcc(): Promise<string | undefined> {
  if (process.env.NVCC) return explicitNvcc(process.env.NVCC);
  const candidates = [
    process.env.CUDA_HOME ? path.join(process.env.CUDA_HOME, "bin", "nvcc") : undefined,
    "nvcc",
    "/usr/local/cuda/bin/nvcc",
  ].filter((c): c is string => c !== undefined && c !== "");
  for (const candidate of candidates) {
    try {
      await run(candidate, ["--version"]);
      return candidate;
    } catch {
      // try the next one
    }
  }
  return undefined;
}

function table(header: string[], rows: string[][]): string {
  const widths = header.map((h, c) => Math.max(h.length, ...rows.map((r) => r[c].length)));
  const line = (cells: string[]) => cells.map((cell, c) => cell.padEnd(widths[c])).join("  ");
  return [line(header), line(widths.map((w) => "-".repeat(w))), ...rows.map(line)]
    .map((l) => l.trimEnd())
    .join("\n");
}

function problemsOf(result: CompileResult): string[] {
  if (!result.ok) return ["compile failed"];
  return ptxasProblems(result.functions, result.job.variant.noSpill === true);
}

/** The table's rows of one compile: one per entry function (or a placeholder when there is none). */
function rowsOf(r: CompileResult, status: string): string[][] {
  const variant = describeDefines(r.job.variant.defines);
  const seconds = r.cached ? "cached" : r.seconds.toFixed(2);
  if (r.functions.length === 0) return [[r.job.source, variant, "-", "-", "-", "-", "-", seconds, status]];
  return r.functions.map((f) => [
    r.job.source,
    variant,
    f.name,
    String(f.registers),
    String(f.sharedBytes),
    String(f.stackBytes),
    `${f.spillStores}/${f.spillLoads}`,
    seconds,
    status,
  ]);
}

const TABLE_HEADER = [
  "source",
  "variant",
  "kernel",
  "regs",
  "smem B",
  "stack B",
  "spill st/ld B",
  "s",
  "status",
];

const FLAGS = ["--all", "--table", "--no-cache"];

async function main(argv: readonly string[]): Promise<number> {
  const unknown = argv.filter((a) => !FLAGS.includes(a));
  if (unknown.length > 0) {
    console.error(`kernels:check: unknown argument ${unknown.join(" ")}: expected ${FLAGS.join(", ")}`);
    return 2;
  }
  const all = argv.includes("--all");
  const showTable = argv.includes("--table") || process.env.KERNELS_TABLE === "1";
  const useCache = !argv.includes("--no-cache") && process.env.KERNELS_CACHE !== "0";
  let nvcc: string | undefined;
  try {
    nvcc = await findNvcc();
  } catch (e) {
    if (!(e instanceof NvccSettingError)) throw e;
    console.error(`kernels:check FAILED: ${e.message}`);
    return 1;
  }
  if (nvcc === undefined) {
    console.log("SKIP kernels:check: nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)");
    return 0;
  }
  const { stdout: nvccVersion } = await run(nvcc, ["--version"]);
  const { jobs, sources, variantCount } = await compileJobs(all);
  const parallel = Math.max(1, Number(process.env.KERNELS_JOBS ?? os.availableParallelism()));
  const cache = useCache ? new CompileCache(cacheDir) : undefined;
  console.log(
    all
      ? `kernels:check: compiling all ${jobs.length} variants of ${sources.length} sources, ${parallel} jobs`
      : `kernels:check: compiling a sample, ${jobs.length} of ${variantCount} variants of ${sources.length} sources (every code path; --all for every variant), ${parallel} jobs`,
  );

  const outDir = mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
  const started = performance.now();
  const bar = progressBar("kernels:check", { intervalSeconds: 10 });
  let done = 0;
  let failed = 0;
  let results: CompileResult[];
  try {
    results = await mapLimited(jobs, parallel, async (job, i) => {
      const result = await compile(nvcc, `${nvcc}\n${nvccVersion}`, job, outDir, i, cache);
      if (problemsOf(result).length > 0) failed++;
      bar.update(++done, jobs.length, `${failed} failed`);
      return result;
    });
  } finally {
    bar.stop();
    rmSync(outDir, { recursive: true, force: true });
  }
  // Entries of sources or variants that no longer exist would only grow the folder; only a run of
  // every variant knows which those are (a sample's prune would drop the rest of --all's entries).
  if (all) cache?.prune();

  const failures: string[] = [];
  const failedRows: string[][] = [];
  const rows: string[][] = [];
  let spilling = 0;
  for (const r of results) {
    const problems = problemsOf(r);
    const where = `${r.job.source} [${describeDefines(r.job.variant.defines)}]`;
    for (const p of problems) failures.push(`${where}: ${p}`);
    const status = problems.length === 0 ? "ok" : "FAIL";
    rows.push(...rowsOf(r, status));
    if (problems.length > 0) failedRows.push(...rowsOf(r, status));
    spilling += r.functions.filter((f) => f.spillStores > 0 || f.spillLoads > 0 || f.stackBytes > 0).length;
  }
  if (showTable) console.log(table(TABLE_HEADER, rows));
  const seconds = ((performance.now() - started) / 1000).toFixed(1);
  const cached = results.filter((r) => r.cached).length;
  const failedJobs = results.filter((r) => problemsOf(r).length > 0).length;
  const summary =
    `${results.length}${all ? "" : ` of ${variantCount}`} variants of ${sources.length} sources, ${failedJobs} failed, ` +
    `${spilling} kernels with spills/stack; ${cached} cached, ${results.length - cached} compiled, ` +
    `${parallel} jobs, ${seconds} s`;
  if (failures.length > 0) {
    if (!showTable) console.error(table(TABLE_HEADER, failedRows));
    for (const r of results) {
      if (!r.ok)
        console.error(`\n--- ${r.job.source} [${describeDefines(r.job.variant.defines)}] ---\n${r.log}`);
    }
    console.error(`\nkernels:check FAILED: ${summary}\n  ${failures.join("\n  ")}`);
    return 1;
  }
  console.log(`kernels:check ok: ${summary}${showTable ? "" : " (KERNELS_TABLE=1: table)"}`);
  return 0;
}

process.exitCode = await main(process.argv.slice(2));
