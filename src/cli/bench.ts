/** `megamoe bench`: time the layer or one kernel family over a sweep, print a table, write results and a plot. */
import path from "node:path";
import Table from "cli-table3";
import pc from "picocolors";
import {
  benchmarkExpertParallel,
  EP_RANKS,
  EP_SHAPE,
  EP_TOKENS,
  epNotes,
  epRanksProblem,
  epTable,
  epTokensProblem,
} from "../bench/ep.js";
import {
  benchmarkGroupedGemm,
  GEMM_BENCH_CODES,
  type GemmBenchCodes,
  type GroupedGemmBenchCase,
} from "../bench/grouped-gemm.js";
import { benchmarkLayer, DEFAULT_FP8_TFLOPS, DEFAULT_LAYER_ITERS, type LayerImpl } from "../bench/layer.js";
import { matchPeerRow, type PeerResults, readPeerResults } from "../bench/peer.js";
import { benchmarkDecodeStep, DEFAULT_STEP_LAYERS, STEP_TOKENS } from "../bench/step.js";
import { type ExpertFormat, MAX_TOKENS_LIMIT, QUANT_BLOCK, resolveConfig } from "../config/config.js";
import { FP8_PEAK_FLOPS, READ_BYTES_PER_S } from "../cuda/hardware.js";
import {
  cudaAvailability,
  type Device,
  deviceSummary,
  openDevice,
  type ResultRow,
  writeResults,
} from "../cuda/index.js";
import { measureCopyCeiling, measureReadCeiling } from "../kernels/probe/probe.js";
import { benchmarkQuant } from "../kernels/quant/quant.js";
import type { MoEWeightSource } from "../weights/types.js";
import { checkpointLayer } from "./checkpoint.js";
import { cudaReasonText } from "./gpu-reason.js";
import { plotTitle, renderTimePlot, writePlot } from "./plot.js";
import { type Progress, progressBar } from "./progress.js";
import { checkCheckpointExperts, checkShapeWithCheckpoint, expertsFormat } from "./run.js";
import { checkInputFile, checkOutputFile, sameFile, UsageError } from "./usage.js";

export interface BenchOptions {
  impl: string;
  /** Default: DEFAULT_BENCH_SHAPE, or EP_SHAPE for --impl ep (benchShape). */
  shape?: string;
  /** fused/unfused: a DeepSeek-V4 checkpoint whose layer `layer` is timed instead of --shape's. */
  checkpoint?: string;
  layer?: string;
  /** fused/unfused/ep: the shared expert on (the default) or off. */
  shared?: boolean;
  seed: number;
  /** fused/unfused/step: the routed experts' format, "fp8" or "fp4" (a config override of --shape). */
  experts?: string;
  /** Also time CUDA-graph replays (unfused; default true). */
  graph?: boolean;
  /** Fused: also time every block M forced, and say how far the heuristic's pick is from the best. */
  configs?: boolean;
  /** step: MoE blocks in the decode step. */
  layers?: number;
  /** ep: virtual ranks, each a sweep of its own (default EP_RANKS). */
  ranks?: number[];
  /** ep: rank r on GPU r instead of every rank on GPU 0. */
  gpus?: boolean;
  tokens?: number[];
  /** quant: hidden sizes (default 4096, 7168). */
  hidden?: number[];
  /** quant: activation scale format, "fp32" (default) or "ue8m0". */
  format?: string;
  /** grouped-gemm: what the operands hold (GemmBenchCodes; default "quantized"). */
  codes?: string;
  /** grouped-gemm: untimed GPU time before each case's timed runs (TimeKernelOptions.warmupMs). */
  warmupMs?: number;
  iters?: number;
  /** fused/unfused: interleaved rounds (benchmarkLayer's `rounds`). */
  rounds?: number;
  fp8Tflops?: number;
  peer?: string;
  plot?: string;
  out?: string;
  /** Overwrite existing --out and --plot files. */
  force?: boolean;
  json?: boolean;
  /** Say in full why there is no GPU (every folder searched). */
  verbose?: boolean;
}

export const BENCH_IMPLS = [
  "fused",
  "unfused",
  "fused,unfused",
  "step",
  "quant",
  "grouped-gemm",
  "ep",
] as const;

/** --shape when not given: one rank of an 8-way flash deployment (--impl ep: the whole flash layer, split R ways). */
export const DEFAULT_BENCH_SHAPE = "flash-ep8";

/** The shape an --impl benchmarks when --shape is not given. */
export function benchShape(opts: Pick<BenchOptions, "impl" | "shape">): string {
  return opts.shape ?? (opts.impl === "ep" ? EP_SHAPE : DEFAULT_BENCH_SHAPE);
}

/** 1, 2, 4, …, 8192. */
export const LAYER_TOKENS = Array.from({ length: 14 }, (_, i) => 2 ** i);
const QUANT_TOKENS = [1, 7, 129, 1024, 4096, 8192];
const QUANT_HIDDEN = [4096, 7168];
/** Rows per expert of the grouped-GEMM cases: decode-like, mid, prefill-like. */
export const GROUPED_GEMM_M = [64, 512, 4096];
/** Groups of the grouped-GEMM cases: one rank's experts in an 8-way expert-parallel flash layer. */
export const GROUPED_GEMM_GROUPS = 32;

/** "1,2,4": positive integers in decimal digits ("0x10", "1e3" and empty items are refused). */
export function parseList(value: string): number[] {
  const items = value.split(",").map((v) => v.trim());
  if (items.some((v) => !/^\d+$/.test(v) || !(Number(v) >= 1 && Number(v) <= Number.MAX_SAFE_INTEGER))) {
    throw new UsageError(`expected a comma-separated list of positive integers, got "${value}"`);
  }
  return items.map(Number);
}

function percentCell(frac: number): string {
  const pct = `${(100 * frac).toFixed(0)}%`;
  return frac >= 0.8 ? pc.green(pct) : frac >= 0.5 ? pc.yellow(pct) : pc.red(pct);
}

/** A peer row's series: rows with a `series` field (e.g. the torch peer's "blockwise") are a second
 * alternative, compared in columns of their own; the rest form the peer's main series (""). */
function peerSeries(p: ResultRow): string {
  return typeof p.series === "string" ? p.series : "";
}

/**
 * The results table: time, floor, how close to it, the achieved rates, and with a peer's rows the
 * peer's time for the same case (same config, tokens, shared expert and timing mode) and peer/ours,
 * one pair of columns per series of the peer's rows.
 */
export function resultsTable(rows: readonly ResultRow[], peer: readonly ResultRow[] = []): string {
  const withMode = rows.some((r) => typeof r.graph === "boolean");
  const peerName = peer[0]?.impl.replace(/-.*$/, "") ?? "peer";
  const series = [...new Set(peer.map(peerSeries))].sort();
  const seriesRows = series.map((s) => peer.filter((p) => peerSeries(p) === s));
  const seriesNames = series.map((s) => (s === "" ? peerName : `${peerName} ${s}`));
  const head = [
    "config",
    "T",
    "impl",
    ...(withMode ? ["mode"] : []),
    "µs median",
    "floor µs",
    "floor/time",
    "TFLOP/s",
    "TB/s",
    ...seriesNames.flatMap((name) => [`${name} µs`, `${name}/ours`]),
  ];
  const table = new Table({
    head: head.map((h) => pc.bold(h)),
    style: { head: [], border: [] },
    colAligns: head.map((h, i) => (i === 0 || h === "impl" || h === "mode" ? "left" : "right")),
  });
  for (const r of rows) {
    const cells = [
      String(r.config),
      String(r.tokens),
      r.impl,
      ...(withMode ? [r.graph === true ? "graph" : "eager"] : []),
      r.us_median.toFixed(1),
      r.floor_us.toFixed(1),
      percentCell(r.floor_us / r.us_median),
      r.tflops.toFixed(1),
      r.tbps.toFixed(2),
    ];
    for (const candidates of seriesRows) {
      const p = matchPeerRow(candidates, r);
      if (p === undefined) cells.push(pc.dim("—"), pc.dim("—"));
      else {
        const ratio = p.us_median / r.us_median;
        const text = `${ratio.toFixed(2)}×`;
        cells.push(p.us_median.toFixed(1), ratio >= 1 ? pc.green(text) : pc.red(text));
      }
    }
    table.push(cells);
  }
  return table.toString();
}

/**
 * With --configs: per token count, the fused kernel's time with the heuristic's block M against the
 * best forced configuration. Where the best is the heuristic's own tile, the gap is between two runs of
 * one kernel (the clock's drift), and the line says so.
 */
export function configLines(rows: readonly ResultRow[]): string[] {
  const lines: string[] = [];
  for (const tokens of [...new Set(rows.map((r) => r.tokens))]) {
    const forced = rows.filter((r) => r.tokens === tokens && /^fused-m\d+x?$/.test(String(r.impl)));
    const picked = rows.find((r) => r.tokens === tokens && r.impl === "fused-kernel");
    if (forced.length === 0 || picked === undefined) continue;
    const best = forced.reduce((a, b) => (b.us_median < a.us_median ? b : a));
    const off = (100 * (picked.us_median - best.us_median)) / best.us_median;
    const sameTile =
      best.block_m === picked.block_m && (best.fp4_expand === true) === (picked.fp4_expand === true);
    const verdict =
      off <= 0
        ? "the best"
        : sameTile
          ? `the same tile, run again: ${off.toFixed(1)}% apart`
          : `+${off.toFixed(1)}%`;
    lines.push(
      `T=${tokens}: heuristic BLOCK_M ${picked.block_m}${picked.fp4_expand === true ? " expand" : ""} ` +
        `${picked.us_median.toFixed(1)} µs, best ${best.impl} ${best.us_median.toFixed(1)} µs (${verdict})`,
    );
  }
  return lines;
}

/**
 * The decode-step table: per token count, both paths' step time, time and launches per MoE block, and
 * what skipping the quantization pass saves per block.
 */
export function stepTable(rows: readonly ResultRow[]): string {
  const head = [
    "config",
    "T",
    "blocks",
    "impl",
    "µs / step",
    "µs / block",
    "launches / block",
    "saved / block",
  ];
  const table = new Table({
    head: head.map((h) => pc.bold(h)),
    style: { head: [], border: [] },
    colAligns: head.map((h, i) => (i === 0 || h === "impl" ? "left" : "right")),
  });
  for (const r of rows) {
    const prequant = rows.find((p) => p.tokens === r.tokens && p.impl === "step-prequant");
    const saved =
      r.impl === "step-fused" && prequant !== undefined
        ? `${(Number(prequant.us_per_layer) - Number(r.us_per_layer)).toFixed(1)} µs`
        : "";
    table.push([
      String(r.config),
      String(r.tokens),
      String(r.layers),
      r.impl,
      r.us_median.toFixed(1),
      Number(r.us_per_layer).toFixed(1),
      Number(r.launches_per_layer).toFixed(1),
      saved,
    ]);
  }
  return table.toString();
}

/** The layer pipelines an --impl names, or null for a kernel benchmark (quant, grouped-gemm). */
function layerImpls(impl: string): LayerImpl[] | null {
  if (impl === "fused" || impl === "unfused") return [impl];
  if (impl === "fused,unfused") return ["fused", "unfused"];
  return null;
}

/** Checks everything that can be checked without a GPU, so a typo fails before minutes of setup. */
/** Whether the shared expert runs: on unless `--shared 0` (left unset so that validate can refuse it). */
function sharedOn(opts: BenchOptions): boolean {
  return opts.shared ?? true;
}

function validate(opts: BenchOptions): void {
  if (!(BENCH_IMPLS as readonly string[]).includes(opts.impl)) {
    throw new UsageError(`--impl must be one of ${BENCH_IMPLS.join(", ")}, got "${opts.impl}"`);
  }
  if (opts.format !== undefined && opts.format !== "fp32" && opts.format !== "ue8m0") {
    throw new UsageError(`--format must be fp32 or ue8m0, got "${opts.format}"`);
  }
  // An option of another --impl would be ignored without a word: refuse it instead.
  for (const [flag, value, impls, which] of [
    ["--codes", opts.codes, ["grouped-gemm"], "grouped-gemm"],
    ["--warmup-ms", opts.warmupMs, ["grouped-gemm"], "grouped-gemm"],
    ["--hidden", opts.hidden, ["quant"], "quant"],
    ["--format", opts.format, ["quant"], "quant"],
    ["--layers", opts.layers, ["step"], "step"],
    ["--ranks", opts.ranks, ["ep"], "ep"],
    ["--gpus", opts.gpus, ["ep"], "ep"],
    ["--configs", opts.configs, ["fused", "fused,unfused"], "fused or fused,unfused"],
    [
      "--shared",
      opts.shared,
      ["fused", "unfused", "fused,unfused", "ep"],
      "fused, unfused, fused,unfused or ep",
    ],
    ["--graph / --no-graph", opts.graph, ["unfused", "fused,unfused"], "unfused or fused,unfused"],
    [
      "--fp8-tflops",
      opts.fp8Tflops,
      ["fused", "unfused", "fused,unfused", "ep"],
      "fused, unfused, fused,unfused or ep",
    ],
    [
      "--experts",
      opts.experts,
      ["fused", "unfused", "fused,unfused", "step", "ep"],
      "fused, unfused, fused,unfused, step or ep",
    ],
  ] as const) {
    if (value !== undefined && !(impls as readonly string[]).includes(opts.impl)) {
      throw new UsageError(`${flag} applies to --impl ${which}, not ${opts.impl}`);
    }
  }
  for (const h of opts.hidden ?? []) {
    if (h % QUANT_BLOCK !== 0) throw new UsageError(`--hidden ${h}: must be a multiple of ${QUANT_BLOCK}`);
  }
  if (opts.tokens !== undefined && (layerImpls(opts.impl) !== null || ["step", "ep"].includes(opts.impl))) {
    const over = opts.tokens.find((t) => t > MAX_TOKENS_LIMIT);
    if (over !== undefined) {
      throw new UsageError(`--tokens ${over}: the layer takes at most ${MAX_TOKENS_LIMIT} tokens`);
    }
  }
  // Two flags naming one file first: that says more than "the file exists".
  checkDistinctFiles(opts);
  if (opts.force === true && opts.out === undefined && opts.plot === undefined)
    throw new UsageError("--force applies to --out and --plot: give the file to overwrite");
  if (opts.out !== undefined) checkOutputFile("--out", opts.out, opts.force);
  if (opts.plot !== undefined) checkOutputFile("--plot", opts.plot, opts.force);
  if (opts.peer !== undefined) checkInputFile("--peer", opts.peer);
  if (opts.codes !== undefined && !(GEMM_BENCH_CODES as readonly string[]).includes(opts.codes)) {
    throw new UsageError(`--codes must be one of ${GEMM_BENCH_CODES.join(", ")}, got "${opts.codes}"`);
  }
  if (opts.checkpoint !== undefined && layerImpls(opts.impl) === null) {
    throw new Error(
      "--checkpoint times a checkpoint's layer: use it with --impl fused, unfused or fused,unfused",
    );
  }
  if (opts.layer !== undefined && opts.checkpoint === undefined)
    throw new Error("--layer needs --checkpoint");
  // --shape has no default here: given, it is the user's, and the checkpoint's layer would replace it.
  checkShapeWithCheckpoint({ ...opts, shapeGiven: opts.shape !== undefined });
  const experts = expertsFormat(opts.experts);
  // Throws naming an unknown shape.
  const config =
    opts.impl === "quant"
      ? undefined
      : resolveConfig(benchShape(opts), experts === undefined ? {} : { expertFormat: experts });
  if (opts.impl === "ep") validateEp(opts, config!.numExperts);
  if (opts.plot !== undefined && layerImpls(opts.impl) === null) {
    throw new UsageError(
      "--plot draws the layer's time against tokens: use it with --impl fused, unfused or fused,unfused",
    );
  }
  if (opts.fp8Tflops !== undefined && !(opts.fp8Tflops > 0)) {
    throw new UsageError(`--fp8-tflops must be a positive number, got ${opts.fp8Tflops}`);
  }
  if (opts.iters !== undefined && opts.iters < 20) {
    throw new UsageError(`--iters must be at least 20 (medians of fewer runs are noise), got ${opts.iters}`);
  }
  if (opts.rounds !== undefined) {
    if (layerImpls(opts.impl) === null && opts.impl !== "ep") {
      throw new UsageError(
        `--rounds applies to --impl fused, unfused, fused,unfused or ep, not ${opts.impl}`,
      );
    }
    const iters = opts.iters ?? DEFAULT_LAYER_ITERS;
    if (opts.rounds > iters)
      throw new UsageError(`--rounds (${opts.rounds}) must not exceed --iters (${iters})`);
  }
}

/**
 * --out and --plot are written, --peer read: two of them naming one file would overwrite the peer's
 * results (or one output the other) at the end of a long run.
 */
function checkDistinctFiles(opts: BenchOptions): void {
  const named: [string, string][] = [];
  if (opts.peer !== undefined) named.push(["--peer", opts.peer]);
  if (opts.out !== undefined) named.push(["--out", opts.out]);
  if (opts.plot !== undefined) named.push(["--plot", opts.plot]);
  for (const [i, [flag, file]] of named.entries()) {
    const other = named.slice(0, i).find(([, f]) => sameFile(f, file));
    if (other !== undefined) {
      throw new UsageError(`${flag} ${file}: the same file as ${other[0]}; give each its own file`);
    }
  }
}

/** --impl ep's checks: every --ranks a split of the shape's experts, every --tokens within a rank's reach. */
function validateEp(opts: BenchOptions, numExperts: number): void {
  if (opts.peer !== undefined) {
    throw new UsageError(
      "--peer applies to the layer and kernel benchmarks, not ep (no peer times its paths)",
    );
  }
  const ranks = opts.ranks ?? EP_RANKS;
  for (const r of ranks) {
    const problem = epRanksProblem(r, numExperts, benchShape(opts));
    if (problem !== null) throw new UsageError(`--ranks ${r}: ${problem}`);
  }
  const tokens = Math.max(...(opts.tokens ?? EP_TOKENS));
  for (const r of ranks) {
    const problem = epTokensProblem(r, tokens);
    if (problem !== null) throw new UsageError(`--tokens ${tokens}: ${problem}`);
  }
}

/** The FP8 rate for the floor: --fp8-tflops, else the peer's measurement, else the default. */
export function chooseFp8Rate(
  explicit: number | undefined,
  peer: PeerResults | undefined,
): { tflops: number; source: string } {
  if (explicit !== undefined) return { tflops: explicit, source: "--fp8-tflops" };
  if (peer?.fp8Tflops !== undefined) {
    return { tflops: peer.fp8Tflops, source: `measured by the peer (${path.basename(peer.file)})` };
  }
  return { tflops: DEFAULT_FP8_TFLOPS, source: "default" };
}

/**
 * How the layer's floor was computed, printed under the table: every byte (weights, activations in and
 * out) at the read-stream rate measured by `probe_read`, or the FLOPs at the FP8 rate, whichever is longer.
 */
export function unfusedFloorLine(readTbps: number, rate: { tflops: number; source: string }): string {
  return `floor = max(bytes / ${readTbps.toFixed(2)} TB/s read stream (probe_read), FLOPs / ${rate.tflops.toFixed(0)} TFLOP/s FP8 (${rate.source}))`;
}

/** The grouped GEMM's floor line: the fixed model of src/bench/grouped-gemm.ts. */
export function groupedGemmFloorLine(): string {
  return `floor = max(bytes / ${(READ_BYTES_PER_S / 1e12).toFixed(2)} TB/s read stream, FLOPs / ${(FP8_PEAK_FLOPS / 1e12).toFixed(0)} TFLOP/s FP8) (the kernel's own model)`;
}

/** The grouped-GEMM cases: the shape's L1 (N = 2·IH, K = H) and L2 (N = H, K = IH), 32 groups. */
export function groupedGemmCases(shape: string, mPerGroup: readonly number[]): GroupedGemmBenchCase[] {
  const c = resolveConfig(shape);
  const family = c.name.replace(/-ep\d+$/, "");
  const gemms = [
    { name: `${family}-L1`, n: 2 * c.intermediate, k: c.hidden },
    { name: `${family}-L2`, n: c.hidden, k: c.intermediate },
  ];
  return gemms.flatMap((g) =>
    mPerGroup.map((m) => ({
      config: g.name,
      groups: GROUPED_GEMM_GROUPS,
      mPerGroup: m,
      n: g.n,
      k: g.k,
      tokens: GROUPED_GEMM_GROUPS * m,
    })),
  );
}

/** The ceilings measured before a sweep: the read stream (the layer's floor), the copy (the quant's). */
interface MeasuredCeilings {
  readTbps: number;
  copyTbps: number;
}

function runCases(
  device: Device,
  opts: BenchOptions,
  ceilings: MeasuredCeilings,
  fp8Tflops: number,
  source: MoEWeightSource | undefined,
  bar: Progress,
): ResultRow[] {
  if (opts.impl === "ep") {
    return benchmarkExpertParallel(device, {
      shape: benchShape(opts),
      ranks: opts.ranks ?? EP_RANKS,
      gpus: opts.gpus === true,
      expertFormat: expertsFormat(opts.experts),
      tokens: opts.tokens ?? EP_TOKENS,
      shared: sharedOn(opts),
      seed: opts.seed,
      readTbps: ceilings.readTbps,
      fp8Tflops,
      iters: opts.iters,
      rounds: opts.rounds,
      onProgress: (d, t) => bar.update(d, t),
    });
  }
  if (opts.impl === "step") {
    return benchmarkDecodeStep(device, {
      shape: benchShape(opts),
      layers: opts.layers ?? DEFAULT_STEP_LAYERS,
      tokens: opts.tokens ?? STEP_TOKENS,
      seed: opts.seed,
      expertFormat: opts.experts as ExpertFormat | undefined,
      iters: opts.iters,
      onProgress: (d, t) => bar.update(d, t),
    });
  }
  const impls = layerImpls(opts.impl);
  if (impls !== null) {
    return benchmarkLayer(device, {
      impls,
      shape: benchShape(opts),
      expertFormat: opts.experts as ExpertFormat | undefined,
      source,
      tokens: opts.tokens ?? LAYER_TOKENS,
      shared: sharedOn(opts),
      seed: opts.seed,
      readTbps: ceilings.readTbps,
      fp8Tflops,
      iters: opts.iters,
      rounds: opts.rounds,
      graph: opts.graph ?? true,
      configs: opts.configs ?? false,
      onProgress: (d, t) => bar.update(d, t),
    });
  }
  const rows: ResultRow[] = [];
  if (opts.impl === "grouped-gemm") {
    const codes = opts.codes as GemmBenchCodes | undefined;
    const cases = groupedGemmCases(benchShape(opts), opts.tokens ?? GROUPED_GEMM_M);
    cases.forEach((c, i) => {
      rows.push(
        ...benchmarkGroupedGemm(device, [{ ...c, codes }], {
          iters: opts.iters ?? 20,
          warmupMs: opts.warmupMs,
        }),
      );
      bar.update(i + 1, cases.length);
    });
    return rows;
  }
  const tokens = opts.tokens ?? QUANT_TOKENS;
  const shapes = (opts.hidden ?? QUANT_HIDDEN).flatMap((hidden) =>
    tokens.map((t) => ({ tokens: t, hidden })),
  );
  const format = (opts.format ?? "fp32") as "fp32" | "ue8m0";
  shapes.forEach((shape, i) => {
    rows.push(...benchmarkQuant(device, [shape], { format, copyTbps: ceilings.copyTbps }));
    bar.update(i + 1, shapes.length);
  });
  return rows;
}

export async function runBench(opts: BenchOptions): Promise<void> {
  validate(opts);
  const peer = opts.peer === undefined ? undefined : readPeerResults(opts.peer);
  // The checkpoint's problems come before the GPU's: reading it needs none.
  const source =
    opts.checkpoint === undefined
      ? undefined
      : checkpointLayer(opts.checkpoint, opts.layer, Math.max(...(opts.tokens ?? LAYER_TOKENS)));
  if (source !== undefined) checkCheckpointExperts(opts.experts, source.config);
  const cuda = cudaAvailability();
  if (!cuda.ok) {
    const why = cudaReasonText(cuda.reason, opts.verbose, "--verbose lists where it looked");
    if (opts.impl === "ep") {
      throw new Error(`bench --impl ep needs a CUDA GPU (its ranks are virtual ranks on GPU 0): ${why}`);
    }
    throw new Error(`bench needs a CUDA GPU: ${why}`);
  }
  const rate = chooseFp8Rate(opts.fp8Tflops, peer);
  const device = openDevice(0);
  const ceilings = { readTbps: measureReadCeiling(device).tbps, copyTbps: measureCopyCeiling(device).tbps };
  const bar = progressBar(`bench ${opts.impl}`);
  let rows: ResultRow[];
  try {
    rows = runCases(device, opts, ceilings, rate.tflops, source, bar);
  } finally {
    bar.stop();
  }
  const peerRows = (peer?.rows ?? []).filter((p) => rows.some((r) => matchPeerRow([p], r) !== undefined));
  const deviceInfo = {
    ...deviceSummary(device),
    read_tbps: ceilings.readTbps,
    copy_tbps: ceilings.copyTbps,
    fp8_tflops: rate.tflops,
  };
  if (opts.out !== undefined) {
    writeResults(
      opts.out,
      {
        device: { ...deviceInfo, fp8_tflops_source: rate.source },
        command: `megamoe ${process.argv.slice(2).join(" ")}`,
        rows: [...rows, ...peerRows.map((p) => ({ ...p, source: path.basename(peer!.file) }))],
      },
      { overwrite: opts.force === true },
    );
  }
  if (opts.plot !== undefined) {
    const plotted = [
      ...rows,
      ...(peer?.rows ?? []).filter((p) => p.config === rows[0]?.config && p.shared === sharedOn(opts)),
    ];
    writePlot(
      opts.plot,
      renderTimePlot(plotted, { title: plotTitle(benchShape(opts), sharedOn(opts), device.name) }),
      { overwrite: opts.force === true },
    );
  }
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(rows)}\n`);
    return;
  }
  process.stdout.write(
    `${pc.bold(`megamoe bench ${opts.impl}`)} on ${device.name}, read stream ${ceilings.readTbps.toFixed(2)} TB/s, copy ${ceilings.copyTbps.toFixed(2)} TB/s (read + write)\n`,
  );
  const table =
    opts.impl === "step"
      ? stepTable(rows)
      : opts.impl === "ep"
        ? epTable(rows)
        : resultsTable(rows, peerRows);
  process.stdout.write(`${table}\n`);
  if (opts.impl === "ep") {
    for (const line of epNotes(rows, ceilings.readTbps, rate.tflops)) process.stdout.write(`  ${line}\n`);
    // A failed in-kernel forward ends the sweep; its row says why, and the exit code says it failed.
    if (rows.some((r) => typeof r.error === "string")) process.exitCode = 1;
  } else if (layerImpls(opts.impl) !== null) {
    process.stdout.write(`  ${unfusedFloorLine(ceilings.readTbps, rate)}\n`);
    for (const line of configLines(rows)) process.stdout.write(`  ${line}\n`);
    const failed = rows.find((r) => typeof r.graph_error === "string");
    if (failed)
      process.stdout.write(`  ${pc.yellow("no CUDA-graph timing:")} ${String(failed.graph_error)}\n`);
  } else if (opts.impl === "grouped-gemm") {
    process.stdout.write(`  ${groupedGemmFloorLine()}\n`);
  } else {
    for (const r of rows) {
      if (typeof r.fraction_of_copy === "number" && r.tokens * Number(r.hidden) >= 8192 * 4096) {
        process.stdout.write(
          `  T=${r.tokens} H=${r.hidden}: ${(100 * r.fraction_of_copy).toFixed(1)}% of copy bandwidth\n`,
        );
      }
    }
  }
  if (peer !== undefined && peerRows.length === 0) {
    process.stdout.write(`  ${pc.yellow("the peer file has no row for these cases:")} ${peer.file}\n`);
  }
  if (opts.out !== undefined) process.stdout.write(`results written to ${opts.out}\n`);
  if (opts.plot !== undefined) process.stdout.write(`plot written to ${opts.plot}\n`);
}
