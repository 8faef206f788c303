/** `megamoe bench`: time a kernel family over a sweep, print a table, write the results file. */
import Table from "cli-table3";
import pc from "picocolors";
import { benchmarkUnfusedLayer } from "../bench/layer.js";
import {
  cudaAvailability,
  deviceSummary,
  gitCommit,
  openDevice,
  type ResultRow,
  writeResults,
} from "../cuda/index.js";
import { measureCopyCeiling } from "../kernels/probe/probe.js";
import { benchmarkQuant } from "../kernels/quant/quant.js";
import { progressBar } from "./progress.js";

export interface BenchOptions {
  impl: string;
  shape: string;
  shared: boolean;
  seed: number;
  graph?: boolean;
  tokens?: number[];
  hidden: number[];
  format: string;
  out?: string;
  json?: boolean;
}

/** 1, 2, 4, …, 8192. */
export const LAYER_TOKENS = Array.from({ length: 14 }, (_, i) => 2 ** i);
const QUANT_TOKENS = [1, 7, 129, 1024, 4096, 8192];

export function parseList(value: string): number[] {
  const list = value.split(",").map((v) => Number(v.trim()));
  if (list.length === 0 || list.some((n) => !Number.isInteger(n) || n < 1)) {
    throw new Error(`expected a comma-separated list of positive integers, got "${value}"`);
  }
  return list;
}

/** The results table: time, floor, how close to it, and the achieved rates. */
export function resultsTable(rows: readonly ResultRow[]): string {
  const table = new Table({
    head: ["config", "tokens", "impl", "µs median", "floor µs", "floor/time", "TB/s", "TFLOP/s"].map((h) =>
      pc.bold(h),
    ),
    style: { head: [], border: [] },
    colAligns: ["left", "right", "left", "right", "right", "right", "right", "right"],
  });
  for (const r of rows) {
    const frac = r.floor_us / r.us_median;
    const pct = `${(100 * frac).toFixed(0)}%`;
    table.push([
      String(r.config),
      String(r.tokens),
      r.impl,
      r.us_median.toFixed(1),
      r.floor_us.toFixed(1),
      frac >= 0.8 ? pc.green(pct) : frac >= 0.5 ? pc.yellow(pct) : pc.red(pct),
      r.tbps.toFixed(2),
      r.tflops.toFixed(1),
    ]);
  }
  return table.toString();
}

export async function runBench(opts: BenchOptions): Promise<void> {
  const cuda = cudaAvailability();
  if (!cuda.ok) throw new Error(`bench needs a CUDA GPU: ${cuda.reason}`);
  if (opts.impl !== "quant" && opts.impl !== "unfused") {
    throw new Error(`--impl must be "quant" or "unfused", got "${opts.impl}"`);
  }
  if (opts.format !== "fp32" && opts.format !== "ue8m0") {
    throw new Error(`--format must be fp32 or ue8m0, got "${opts.format}"`);
  }
  const device = openDevice(0);
  const copy = measureCopyCeiling(device);
  const bar = progressBar(`bench ${opts.impl}`);
  const rows: ResultRow[] = [];
  if (opts.impl === "unfused") {
    rows.push(
      ...benchmarkUnfusedLayer(device, {
        shape: opts.shape,
        tokens: opts.tokens ?? LAYER_TOKENS,
        shared: opts.shared,
        seed: opts.seed,
        copyTbps: copy.tbps,
        graph: opts.graph,
        onProgress: (d, t) => bar.update(d, t),
      }),
    );
  } else {
    const tokens = opts.tokens ?? QUANT_TOKENS;
    const shapes = opts.hidden.flatMap((hidden) => tokens.map((t) => ({ tokens: t, hidden })));
    shapes.forEach((shape, i) => {
      const format = opts.format as "fp32" | "ue8m0";
      rows.push(...benchmarkQuant(device, [shape], { format, copyTbps: copy.tbps }));
      bar.update(i + 1, shapes.length);
    });
  }
  bar.stop();
  if (opts.out !== undefined) {
    writeResults(opts.out, {
      device: { ...deviceSummary(device), copy_tbps: copy.tbps },
      commit: process.env.MEGAMOE_COMMIT ?? gitCommit(),
      command: `megamoe ${process.argv.slice(2).join(" ")}`,
      rows,
    });
  }
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(rows)}\n`);
    return;
  }
  process.stdout.write(
    `${pc.bold(`megamoe bench ${opts.impl}`)} on ${device.name}, copy ceiling ${copy.tbps.toFixed(2)} TB/s\n`,
  );
  process.stdout.write(`${resultsTable(rows)}\n`);
  for (const r of rows) {
    if (typeof r.fraction_of_copy === "number" && r.tokens * Number(r.hidden) >= 8192 * 4096) {
      process.stdout.write(
        `  T=${r.tokens} H=${r.hidden}: ${(100 * r.fraction_of_copy).toFixed(1)}% of copy bandwidth\n`,
      );
    }
  }
  if (opts.out !== undefined) process.stdout.write(`results written to ${opts.out}\n`);
}
