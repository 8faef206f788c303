/**
 * CI check of every CUDA kernel: compiles each `src/kernels/**\/*.cu` with nvcc for sm_90a, once per
 * specialization its family lists (`<name>.variants.ts` beside the .cu, see src/kernels/variants.ts),
 * prints ptxas's resource report as a table, and exits non-zero when a compile fails, a kernel marked
 * no-spill spills or uses a local stack frame, or ptxas serializes a kernel's wgmmas (C7518). Without
 * nvcc it prints SKIP and exits 0, so the check stays optional on machines without the CUDA toolkit.
 *
 * Run: `npm run kernels:check` (NVCC=/path/to/nvcc to pick the compiler; KERNELS_JOBS for parallelism).
 */
import { execFile } from "node:child_process";
import { existsSync, mkdtempSync, readdirSync, rmSync } from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { promisify } from "node:util";
import { defineOptions } from "../src/cuda/jit.js";
import { describeDefines, type KernelVariant } from "../src/kernels/variants.js";
import { type FunctionReport, parsePtxasReport, ptxasProblems } from "./ptxas-report.js";

const run = promisify(execFile);

const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const kernelsDir = path.join(repoRoot, "src", "kernels");
const includeDir = path.join(repoRoot, "src", "include");
const ARCH_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"];
const DEFAULT_VARIANT: KernelVariant = { defines: {}, noSpill: true };

interface CompileJob {
  source: string; // path relative to the repository root
  variant: KernelVariant;
}

interface CompileResult {
  job: CompileJob;
  ok: boolean;
  functions: FunctionReport[];
  log: string;
  seconds: number;
}

function listCudaSources(dir: string): string[] {
  const found: string[] = [];
  for (const entry of readdirSync(dir, { withFileTypes: true })) {
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) found.push(...listCudaSources(full));
    else if (entry.isFile() && entry.name.endsWith(".cu")) found.push(full);
  }
  return found.sort();
}

function isKernelVariant(v: unknown): v is KernelVariant {
  if (typeof v !== "object" || v === null) return false;
  const { defines, noSpill } = v as { defines?: unknown; noSpill?: unknown };
  return (
    typeof noSpill === "boolean" &&
    typeof defines === "object" &&
    defines !== null &&
    Object.values(defines).every((d) => typeof d === "number" && Number.isFinite(d))
  );
}

async function variantsFor(source: string): Promise<readonly KernelVariant[]> {
  const variantsFile = source.replace(/\.cu$/, ".variants.ts");
  if (!existsSync(variantsFile)) return [DEFAULT_VARIANT];
  const mod: unknown = await import(pathToFileURL(variantsFile).href);
  const list = (mod as { variants?: unknown }).variants;
  if (!Array.isArray(list) || list.length === 0 || !list.every(isKernelVariant)) {
    throw new Error(
      `${path.relative(repoRoot, variantsFile)} must export a non-empty \`variants: KernelVariant[]\``,
    );
  }
  return list;
}

async function compile(nvcc: string, job: CompileJob, outDir: string, index: number): Promise<CompileResult> {
  const cubin = path.join(outDir, `${index}-${path.basename(job.source, ".cu")}.cubin`);
  const args = [
    ...ARCH_FLAGS,
    `-I${includeDir}`,
    ...defineOptions(job.variant.defines), // the JIT's own -D list, so CI compiles what it compiles
    "-Xptxas",
    "-v",
    "-cubin",
    "-o",
    cubin,
    path.join(repoRoot, job.source),
  ];
  const started = performance.now();
  try {
    const { stdout, stderr } = await run(nvcc, args, { cwd: repoRoot, maxBuffer: 16 << 20 });
    const log = `${stdout}${stderr}`;
    return {
      job,
      ok: true,
      functions: parsePtxasReport(log),
      log,
      seconds: (performance.now() - started) / 1000,
    };
  } catch (err) {
    const e = err as { stdout?: string; stderr?: string; message?: string };
    const log = `${e.stdout ?? ""}${e.stderr ?? ""}` || (e.message ?? String(err));
    return { job, ok: false, functions: [], log, seconds: (performance.now() - started) / 1000 };
  }
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

async function findNvcc(): Promise<string | undefined> {
  const candidates = [
    process.env.NVCC,
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

async function main(): Promise<number> {
  const nvcc = await findNvcc();
  if (nvcc === undefined) {
    console.log("SKIP kernels:check: nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)");
    return 0;
  }
  const sources = listCudaSources(kernelsDir);
  const jobs: CompileJob[] = [];
  for (const source of sources) {
    for (const variant of await variantsFor(source))
      jobs.push({ source: path.relative(repoRoot, source), variant });
  }
  const parallel = Math.max(1, Number(process.env.KERNELS_JOBS ?? 2));
  console.log(
    `kernels:check: ${jobs.length} compiles of ${sources.length} sources with ${nvcc}, ${parallel} at a time`,
  );

  const outDir = mkdtempSync(path.join(os.tmpdir(), "megamoe-"));
  const started = performance.now();
  let results: CompileResult[];
  try {
    results = await mapLimited(jobs, parallel, (job, i) => compile(nvcc, job, outDir, i));
  } finally {
    rmSync(outDir, { recursive: true, force: true });
  }

  const rows: string[][] = [];
  const failures: string[] = [];
  for (const r of results) {
    const problems = problemsOf(r);
    const where = `${r.job.source} [${describeDefines(r.job.variant.defines)}]`;
    for (const p of problems) failures.push(`${where}: ${p}`);
    const status = problems.length === 0 ? "ok" : "FAIL";
    if (r.functions.length === 0) {
      rows.push([r.job.source, describeDefines(r.job.variant.defines), "-", "-", "-", "-", "-", "-", status]);
    }
    for (const f of r.functions) {
      rows.push([
        r.job.source,
        describeDefines(r.job.variant.defines),
        f.name,
        String(f.registers),
        String(f.sharedBytes),
        String(f.stackBytes),
        `${f.spillStores}/${f.spillLoads}`,
        r.seconds.toFixed(2),
        status,
      ]);
    }
  }
  console.log(
    table(["source", "variant", "kernel", "regs", "smem B", "stack B", "spill st/ld B", "s", "status"], rows),
  );
  for (const r of results) {
    if (!r.ok)
      console.error(`\n--- ${r.job.source} [${describeDefines(r.job.variant.defines)}] ---\n${r.log}`);
  }
  const seconds = ((performance.now() - started) / 1000).toFixed(1);
  if (failures.length > 0) {
    console.error(`\nkernels:check FAILED (${seconds} s):\n  ${failures.join("\n  ")}`);
    return 1;
  }
  console.log(`kernels:check: ${results.length} compiles ok in ${seconds} s`);
  return 0;
}

process.exitCode = await main();
