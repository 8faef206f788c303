/**
 * Lab helper (lab/profile.sh --what times runs it on the GPU host from dist-test): the per-kernel table of
 * an Nsight Compute CSV export of `gpu__time_duration.sum` (`ncu --csv --metrics gpu__time_duration.sum`),
 * so that a decode step's kernels (the norm, the gate's two, the fused layer) read as one line each:
 * kernel, grid, launches, median / min / max µs, in the order they first ran.
 *   node dist-test/lab/kernel-times.js FILE.csv
 * ncu profiles each kernel alone with its caches flushed, so these are cold-cache times of single kernels,
 * not a CUDA graph's: they rank the kernels, they do not add up to a step.
 */
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

export interface KernelTime {
  kernel: string;
  grid: string;
  launches: number;
  medianUs: number;
  minUs: number;
  maxUs: number;
}

const UNIT_US: Record<string, number> = { ns: 1e-3, nsecond: 1e-3, us: 1, usecond: 1, ms: 1e3, msecond: 1e3 };

/** One CSV line's fields: comma-separated, each optionally in double quotes ("" inside is a quote). */
export function csvFields(line: string): string[] {
  const out: string[] = [];
  let i = 0;
  while (i <= line.length) {
    if (line[i] === '"') {
      let v = "";
      i++;
      while (i < line.length) {
        if (line[i] === '"' && line[i + 1] === '"') {
          v += '"';
          i += 2;
        } else if (line[i] === '"') {
          i++;
          break;
        } else v += line[i++];
      }
      out.push(v);
      i++; // the comma
    } else {
      const end = line.indexOf(",", i);
      const stop = end < 0 ? line.length : end;
      out.push(line.slice(i, stop));
      i = stop + 1;
    }
  }
  return out;
}

/** The per-kernel table of an ncu CSV (its non-CSV lines, the profiled program's output, are skipped). */
export function kernelTimes(csv: string): KernelTime[] {
  const lines = csv.split(/\r?\n/).filter((l) => l.startsWith('"'));
  const header = lines.findIndex((l) => l.startsWith('"ID"'));
  if (header < 0) throw new Error('kernelTimes: no ncu CSV header ("ID", …) in the input');
  const names = csvFields(lines[header]!);
  const col = (name: string): number => {
    const c = names.indexOf(name);
    if (c < 0) throw new Error(`kernelTimes: the CSV has no "${name}" column`);
    return c;
  };
  const [kernel, grid, metric, unit, value] = [
    col("Kernel Name"),
    col("Grid Size"),
    col("Metric Name"),
    col("Metric Unit"),
    col("Metric Value"),
  ];
  const groups = new Map<string, { kernel: string; grid: string; us: number[] }>();
  for (const line of lines.slice(header + 1)) {
    const f = csvFields(line);
    if (f[metric] !== "gpu__time_duration.sum") continue;
    const scale = UNIT_US[f[unit] ?? ""];
    const v = Number((f[value] ?? "").replaceAll(",", ""));
    if (scale === undefined || !Number.isFinite(v)) {
      throw new Error(`kernelTimes: cannot read "${f[value]}" "${f[unit]}" as a duration`);
    }
    const name = (f[kernel] ?? "").replace(/\(.*$/, ""); // demangled signatures: the name alone
    const key = `${name}\u0000${f[grid]}`;
    let g = groups.get(key);
    if (g === undefined) {
      g = { kernel: name, grid: f[grid] ?? "", us: [] };
      groups.set(key, g);
    }
    g.us.push(v * scale);
  }
  return [...groups.values()].map(({ kernel, grid, us }) => {
    const s = [...us].sort((a, b) => a - b);
    return {
      kernel,
      grid,
      launches: s.length,
      medianUs: s[Math.floor(s.length / 2)]!,
      minUs: s[0]!,
      maxUs: s[s.length - 1]!,
    };
  });
}

/** The table as text, one kernel and grid per line. */
export function formatKernelTimes(rows: readonly KernelTime[]): string {
  const width = Math.max(6, ...rows.map((r) => r.kernel.length));
  const head = `${"kernel".padEnd(width)}  ${"grid".padEnd(14)}  launches  median µs  min µs  max µs`;
  const body = rows.map(
    (r) =>
      `${r.kernel.padEnd(width)}  ${r.grid.padEnd(14)}  ${String(r.launches).padStart(8)}  ${r.medianUs
        .toFixed(1)
        .padStart(9)}  ${r.minUs.toFixed(1).padStart(6)}  ${r.maxUs.toFixed(1).padStart(6)}`,
  );
  return [head, ...body].join("\n");
}

function main(argv: readonly string[]): number {
  if (argv.length !== 1 || argv[0] === "--help" || argv[0] === "-h") {
    console.error("usage: node dist-test/lab/kernel-times.js NCU.csv");
    return argv[0] === "--help" || argv[0] === "-h" ? 0 : 2;
  }
  console.log(formatKernelTimes(kernelTimes(readFileSync(argv[0]!, "utf8"))));
  return 0;
}

if (process.argv[1] !== undefined && import.meta.url === pathToFileURL(process.argv[1]).href) {
  process.exitCode = main(process.argv.slice(2));
}
