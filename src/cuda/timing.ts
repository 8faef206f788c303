/**
 * Measuring GPU time of launches, and writing benchmark results.
 *
 * `timeKernel` brackets each timed run with a pair of events on one stream and reports the median,
 * min and max over `iters` runs. Before each timed run (outside the event pair) it overwrites a buffer
 * of twice the L2 size so every run starts with a cold L2, as a real layer would after the previous
 * layer's traffic. All runs are queued back to back and read after one final synchronization. When a
 * run is shorter than the host's launch cost and the L2 flush is off, the GPU can wait on the host
 * inside the event pair; use `graph: true` for such tiny runs.
 */

import { execFileSync } from "node:child_process";
import path from "node:path";
import { checkOptionFields } from "../config/config.js";
import { type OverwriteOption, targetFileProblem, writeFileAside } from "../io/write-aside.js";
import { CudaGraph, type Device, Event, type Stream } from "./driver.js";
import { packageRoot } from "./jit.js";
import { DirectoryError, makeDirectory } from "./mkdir.js";

/** How to time. */
export interface TimeKernelOptions {
  /** Untimed runs first (default 10). */
  warmup?: number;
  /**
   * After those, more untimed runs until about this much GPU time has passed (default 0). A run of
   * milliseconds on a power-capped card starts at a clock its first hundred milliseconds cannot hold, so
   * a sustained figure (what a long job sees) needs the clock settled first: a second or so.
   */
  warmupMs?: number;
  /** Timed runs (default 50). */
  iters?: number;
  /** Capture `fn` once into a CUDA graph and time graph replays (default false). */
  graph?: boolean;
  /** Flush L2 before each timed run (default true). */
  l2Flush?: boolean;
  /**
   * Called before every run (warmup and timed, outside the events) with the run's index, e.g. to point
   * at the next of several input buffers. With `graph: true` it may only change memory contents (the
   * graph's kernel arguments are frozen at capture), e.g. by queueing copies on `stream`.
   */
  rotate?: (i: number, stream: Stream) => void;
  /** Stream to use (default: a new one, destroyed afterwards). */
  stream?: Stream;
}

/** Cap on the runs `warmupMs` adds (a microsecond kernel would otherwise queue millions). */
const MAX_TIMED_WARMUP_RUNS = 100_000;

/** Per-run GPU times in microseconds. */
export interface Timing {
  usMedian: number;
  usMin: number;
  usMax: number;
  /** One entry per timed run, in run order. */
  samples: number[];
}

const flushBuffers = new WeakMap<Device, { ptr: bigint; words: number }>();

/** The per-device L2 flush buffer (2 × L2 size), allocated on first use and kept for the process. */
function l2FlushBuffer(device: Device): { ptr: bigint; words: number } {
  let b = flushBuffers.get(device);
  if (!b) {
    const words = Math.ceil((2 * Math.max(device.l2CacheBytes, 1 << 20)) / 4);
    b = { ptr: device.alloc(words * 4), words };
    flushBuffers.set(device, b);
  }
  return b;
}

/**
 * Overwrites the device's L2 flush buffer (2 × L2 size) on `stream` (null: the legacy stream), as
 * `timeKernel` does before each timed run: for timing what event pairs on one stream cannot bracket
 * (work on several streams that the host waits for), cold L2 included.
 */
export function flushL2(device: Device, stream: Stream | null = null, value = 1): void {
  const flush = l2FlushBuffer(device);
  device.memsetD32(flush.ptr, value, flush.words, stream);
}

/** Free the L2 flush buffer of `device`, if one was made. */
export function releaseL2FlushBuffer(device: Device): void {
  const b = flushBuffers.get(device);
  if (b) {
    device.free(b.ptr);
    flushBuffers.delete(device);
  }
}

/** Median of a non-empty list (mean of the middle two for an even count). */
export function median(values: readonly number[]): number {
  if (values.length === 0) throw new RangeError("median of an empty list");
  const s = [...values].sort((a, b) => a - b);
  const mid = s.length >> 1;
  return s.length % 2 === 1 ? s[mid]! : (s[mid - 1]! + s[mid]!) / 2;
}

/** Summarize per-run microseconds. */
export function summarizeSamples(samples: number[]): Timing {
  return {
    usMedian: median(samples),
    usMin: Math.min(...samples),
    usMax: Math.max(...samples),
    samples,
  };
}

/**
 * Time `fn`, which queues the work to measure on the stream it is given.
 * @returns median / min / max / all samples, in microseconds of GPU time
 */
export function timeKernel(
  device: Device,
  fn: (stream: Stream) => void,
  options: TimeKernelOptions = {},
): Timing {
  checkOptionFields(
    "timeKernel options",
    options,
    ["warmup", "warmupMs", "iters", "graph", "l2Flush", "rotate", "stream"],
    (m) => new RangeError(m),
  );
  const warmup = options.warmup ?? 10;
  const iters = options.iters ?? 50;
  if (!Number.isInteger(warmup) || warmup < 0)
    throw new RangeError(`warmup must be a non-negative integer, got ${warmup}`);
  if (!Number.isInteger(iters) || iters < 1)
    throw new RangeError(`iters must be a positive integer, got ${iters}`);
  const warmupMs = options.warmupMs ?? 0;
  if (!Number.isFinite(warmupMs) || warmupMs < 0)
    throw new RangeError(`warmupMs must be a finite non-negative number, got ${warmupMs}`);
  const ownStream = options.stream === undefined;
  const stream = options.stream ?? device.createStream();
  const flush = options.l2Flush === false ? undefined : l2FlushBuffer(device);
  const starts: Event[] = [];
  const ends: Event[] = [];
  let graph: CudaGraph | undefined;
  try {
    for (let i = 0; i < iters; i++) {
      starts.push(device.createEvent());
      ends.push(device.createEvent());
    }
    if (options.graph) graph = CudaGraph.capture(stream, fn);
    const run = graph ? () => graph!.launch(stream) : () => fn(stream);
    let runIndex = 0;
    for (let i = 0; i < warmup; i++) {
      options.rotate?.(runIndex++, stream);
      run();
    }
    if (warmupMs > 0) {
      // One run timed alone sizes the rest of the warm-up.
      options.rotate?.(runIndex++, stream);
      starts[0]!.record(stream);
      run();
      ends[0]!.record(stream);
      ends[0]!.synchronize();
      const runMs = Math.max(Event.elapsedMs(starts[0]!, ends[0]!), 1e-3);
      const runs = Math.min(Math.ceil(warmupMs / runMs), MAX_TIMED_WARMUP_RUNS);
      for (let i = 0; i < runs; i++) {
        options.rotate?.(runIndex++, stream);
        run();
      }
    }
    for (let i = 0; i < iters; i++) {
      options.rotate?.(runIndex++, stream);
      if (flush) device.memsetD32(flush.ptr, i + 1, flush.words, stream);
      starts[i]!.record(stream);
      run();
      ends[i]!.record(stream);
    }
    ends[iters - 1]!.synchronize();
    const samples = starts.map((s, i) => Event.elapsedMs(s, ends[i]!) * 1000);
    return summarizeSamples(samples);
  } finally {
    graph?.destroy();
    for (const e of [...starts, ...ends]) e.destroy();
    if (ownStream) stream.destroy();
  }
}

// ---------------------------------------------------------------------------------------------------
// Results

/** One benchmark measurement. Extra fields are allowed and kept. */
export interface ResultRow {
  /** Config preset name (e.g. "flash") or "custom". */
  config: string;
  tokens: number;
  /** Whether the shared expert is included. */
  shared: boolean;
  /** Which implementation was measured. */
  impl: string;
  us_median: number;
  us_min: number;
  us_max: number;
  /** Lower bound from the roofline (bytes / bandwidth, flops / peak), in µs. */
  floor_us: number;
  tflops: number;
  tbps: number;
  [extra: string]: unknown;
}

/** What a results file records about the run. */
export interface ResultsMeta<Row extends object = ResultRow> {
  /** Device description (e.g. `device.describe()`) or a structured summary. */
  device: string | Record<string, unknown>;
  /**
   * Default: `$MEGAMOE_COMMIT` (set by hand where the tree has no git history, as on the GPU host), else
   * `git rev-parse --short HEAD` (+ "-dirty" with uncommitted changes), else "unknown".
   */
  commit?: string;
  /** Default: now, ISO 8601. */
  date?: string;
  /** Default: this process's command line. */
  command?: string;
  rows: readonly Row[];
}

/** The current git commit of the package checkout, or "unknown". */
export function gitCommit(cwd: string = packageRoot()): string {
  try {
    const opts = {
      cwd,
      encoding: "utf8" as const,
      stdio: ["ignore", "pipe", "ignore"] as ("ignore" | "pipe")[],
    };
    const head = execFileSync("git", ["rev-parse", "--short", "HEAD"], opts).trim();
    const dirty =
      execFileSync("git", ["status", "--porcelain", "--untracked-files=no"], opts).trim().length > 0;
    return dirty ? `${head}-dirty` : head;
  } catch {
    return "unknown";
  }
}

/** A plain-object summary of a device, for results files. */
export function deviceSummary(device: Device): Record<string, unknown> {
  return {
    name: device.name,
    arch: device.smArch,
    sms: device.smCount,
    memoryBytes: device.totalMemoryBytes,
    l2Bytes: device.l2CacheBytes,
    clockKHz: device.clockRateKHz,
    driverVersion: device.driverVersion,
  };
}

/**
 * Write `{ device, commit, date, command, node, rows }` as pretty JSON to `file` (folders created),
 * through a temporary name (writeAside). An existing file is refused (DirectoryError) unless `overwrite`.
 */
export function writeResults<Row extends object = ResultRow>(
  file: string,
  meta: ResultsMeta<Row>,
  opts: OverwriteOption = {},
): void {
  const problem = targetFileProblem(file, opts.overwrite === true, "pass { overwrite: true }");
  if (problem !== null) throw new DirectoryError(path.dirname(path.resolve(file)), problem);
  if (meta === undefined) throw new TypeError("writeResults needs its meta ({ device, rows, … })");
  checkOptionFields(
    "writeResults meta",
    meta,
    ["device", "commit", "date", "command", "rows"],
    (m) => new TypeError(m),
  );
  const doc = {
    device: meta.device,
    commit: meta.commit ?? process.env.MEGAMOE_COMMIT ?? gitCommit(),
    date: meta.date ?? new Date().toISOString(),
    command: meta.command ?? process.argv.join(" "),
    node: process.version,
    rows: meta.rows,
  };
  makeDirectory(path.dirname(path.resolve(file)));
  writeFileAside(file, `${JSON.stringify(doc, null, 2)}\n`);
}
