/**
 * `exportLayer`: compile a layer's kernels and write its export folder (docs/export.md). The folder is
 * written aside under a temporary name in the same parent and renamed into place when complete, so an
 * interrupted export never leaves a partial folder under the final name.
 */
import fs from "node:fs";
import path from "node:path";
import type { MoEConfig } from "../config/config.js";
import { cubinFunction } from "../cuda/cubin.js";
import { compileKernelAsync } from "../cuda/jit.js";
import { DirectoryError, makeDirectory } from "../cuda/mkdir.js";
import { QUANT_KERNEL_NAME } from "../kernels/quant/quant.js";
import { buildManifest, type ExportKernelJob, exportKernelJobs, type LayerExportOptions } from "./layer.js";
import type { ExportManifest } from "./manifest.js";

export interface ExportLayerOptions extends LayerExportOptions {
  /** Replace a non-empty folder (default: refuse). */
  overwrite?: boolean;
  /** Called as each kernel compiles (done of total, and the kernel's id). */
  onProgress?: (done: number, total: number, id: string) => void;
}

/** The manifest and its cubins, by kernel id. */
export interface LayerExport {
  manifest: ExportManifest;
  cubins: Map<string, Uint8Array>;
}

/** Compiles the layer's kernels (several at once) and builds the manifest; writes nothing. */
export async function compileLayerExport(
  config: MoEConfig,
  opts: LayerExportOptions & Pick<ExportLayerOptions, "onProgress">,
): Promise<LayerExport> {
  const jobs = exportKernelJobs(config, opts);
  const cubins = new Map<string, Uint8Array>();
  let done = 0;
  await Promise.all(
    jobs.map(async (job: ExportKernelJob) => {
      const compiled = await compileKernelAsync({
        source: job.source,
        defines: job.defines,
        arch: opts.arch,
      });
      cubins.set(job.id, compiled.cubin);
      opts.onProgress?.(++done, jobs.length, job.id);
    }),
  );
  const quant = cubins.get("quant");
  if (quant === undefined) throw new RangeError("export: the quantization kernel was not compiled");
  const registers = cubinFunction(quant, QUANT_KERNEL_NAME).registers;
  return { manifest: buildManifest(config, opts, registers), cubins };
}

function isEmptyOrMissing(dir: string): boolean {
  try {
    return fs.readdirSync(dir).length === 0;
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code === "ENOENT") return true;
    if (code === "ENOTDIR") throw new DirectoryError(dir, "it is a file");
    throw new DirectoryError(dir, (e as Error).message);
  }
}

/** Writes an export into `dir` (created; refused when it holds files, unless `overwrite`). */
export function writeLayerExport(dir: string, exp: LayerExport, overwrite = false): void {
  const target = path.resolve(dir);
  if (!overwrite && !isEmptyOrMissing(target)) {
    throw new DirectoryError(target, "it is not empty (pass overwrite: true, or --force, to replace it)");
  }
  makeDirectory(path.dirname(target));
  const aside = fs.mkdtempSync(path.join(path.dirname(target), `.${path.basename(target)}.partial-`));
  try {
    makeDirectory(path.join(aside, "kernels"));
    const written = new Set<string>();
    for (const k of exp.manifest.kernels) {
      if (written.has(k.cubin)) continue;
      const image = exp.cubins.get(k.id);
      if (image === undefined) throw new RangeError(`export: no cubin for kernel ${k.id}`);
      fs.writeFileSync(path.join(aside, k.cubin), image);
      written.add(k.cubin);
    }
    fs.writeFileSync(path.join(aside, "manifest.json"), `${JSON.stringify(exp.manifest, null, 1)}\n`);
    fs.chmodSync(aside, 0o755); // mkdtemp makes it private
    // The old folder goes aside first: a rename onto a non-empty folder fails.
    if (fs.existsSync(target)) {
      const old = `${aside}.old`;
      fs.renameSync(target, old);
      fs.renameSync(aside, target);
      fs.rmSync(old, { recursive: true, force: true });
    } else fs.renameSync(aside, target);
  } catch (e) {
    fs.rmSync(aside, { recursive: true, force: true });
    throw e;
  }
}

/** Compiles and writes a layer's export into `dir`; returns the manifest. */
export async function exportLayer(
  dir: string,
  config: MoEConfig,
  opts: ExportLayerOptions,
): Promise<ExportManifest> {
  const exp = await compileLayerExport(config, opts);
  writeLayerExport(dir, exp, opts.overwrite ?? false);
  return exp.manifest;
}
