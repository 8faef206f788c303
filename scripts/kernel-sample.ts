/**
 * Which variants `npm run kernels:check` compiles by default (scripts/compile-kernels.ts): a sample that
 * keeps every .cu source and every code path its variants select, so the everyday check (and
 * `npm test`) stays short; `--all` (CI's second step) compiles every variant.
 *
 * The rule, derived from each source's variant list (src/kernels/variants.ts):
 * - a source with at most {@link SMALL_FAMILY} variants compiles them all (they are few and quick, and
 *   their sizes may pick code, e.g. gate.cu's experts per warp);
 * - a larger family compiles the first variant of each distinct code path, a variant's code path being
 *   its defines less the size defines ({@link SIZE_DEFINES}: dimensions, counts, stages and bytes, which
 *   set constants, not branches), with EP_RANKS reduced to whether the build is expert-parallel. For
 *   megamoe.cu that is every block M (so swap-AB and not) × expert format × scale format, one-rank and
 *   expert-parallel, and the FP4 expand build; for fp8_grouped_gemm.cu every tile × output type × weight
 *   format.
 */
import { existsSync, readdirSync } from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import type { KernelVariant } from "../src/kernels/variants.js";

const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const kernelsDir = path.join(repoRoot, "src", "kernels");
const DEFAULT_VARIANT: KernelVariant = { defines: {}, noSpill: true };

/** Families of at most this many variants are compiled whole. */
export const SMALL_FAMILY = 8;

/** Defines that size a kernel rather than choose its code (EP_RANKS: only whether it is set counts). */
export const SIZE_DEFINES: readonly string[] = [
  "HIDDEN",
  "INTER",
  "SHARED_INTER",
  "NUM_EXPERTS",
  "TOP_K",
  "NUM_STAGES",
  "SHARED_BYTES",
  "N",
  "K",
  "NUM_GROUPS",
  "EP_RANKS",
];

/** A variant's code path: its non-size defines' values, and which size defines it sets. */
export function codePath(variant: KernelVariant): string {
  const names = Object.keys(variant.defines).sort();
  return names
    .map((n) => {
      const value = variant.defines[n]!;
      if (n === "EP_RANKS") return `${n}${value > 1 ? ">1" : "=1"}`;
      return SIZE_DEFINES.includes(n) ? n : `${n}=${value}`;
    })
    .join(" ");
}

/** The indices (into `variants`, in order) of one source's sample. */
export function sampleIndices(variants: readonly KernelVariant[]): number[] {
  if (variants.length <= SMALL_FAMILY) return variants.map((_, i) => i);
  const seen = new Set<string>();
  const picked: number[] = [];
  variants.forEach((v, i) => {
    const path = codePath(v);
    if (seen.has(path)) return;
    seen.add(path);
    picked.push(i);
  });
  return picked;
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

/** One compile of the check. */
export interface CompileJob {
  source: string; // path relative to the repository root
  variant: KernelVariant;
}

/**
 * The check's compiles: every variant of every `src/kernels/**\/*.cu` with `all`, else each source's
 * sample; with the sources (absolute paths) and how many variants they list in all.
 */
export async function compileJobs(
  all: boolean,
): Promise<{ jobs: CompileJob[]; sources: string[]; variantCount: number }> {
  const sources = listCudaSources(kernelsDir);
  const jobs: CompileJob[] = [];
  let variantCount = 0;
  for (const source of sources) {
    const variants = await variantsFor(source);
    variantCount += variants.length;
    const picked = all ? variants.map((_, i) => i) : sampleIndices(variants);
    for (const i of picked) jobs.push({ source: path.relative(repoRoot, source), variant: variants[i]! });
  }
  return { jobs, sources, variantCount };
}
