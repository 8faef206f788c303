/**
 * The layer benchmark: one MoE forward per token count, timed on the GPU, beside its physical floor.
 *
 * Floor = max(bytes / read-stream bandwidth, FLOPs / FP8 rate). Bytes: the FP8 weights and fp32 block
 * scales (FP4 experts: their nibbles and UE8M0 bytes) of every expert the routing touches (each must be
 * read at least once), the shared expert's when on, the bf16 input and output. FLOPs: 2 per multiply-add
 * of L1 (2·IH × H) and L2 (H × IH) for every routed row, and of the shared expert's for every token, at the
 * FP8 rate for FP4 experts too (Hopper converts them to e4m3 for wgmma). The intermediate activations are
 * left out: a fused kernel keeps them on chip, so the floor is what the best kernel could reach, not what
 * this one must.
 *
 * All bytes go at the read-stream rate (`probe_read`; 4.3 TB/s on the H200), the written ones too: where
 * the floor is memory-bound the bytes are nearly all weight reads (on flash, flash-ep8 and pro the bf16
 * output is under 1% of them), so a separate write rate would move it by under 1%. The copy rate (3.96
 * TB/s, read + write) it replaced was no floor: the unfused layer beat it (flash, T=64: 5.01 GB in
 * 1193 µs = 4.20 TB/s, 106% of it).
 */
import {
  type ExpertFormat,
  expertFormatOf,
  type MoEConfig,
  QUANT_BLOCK,
  resolveConfigForTokens,
  sharedIntermediate,
} from "../config/config.js";
import { FP8_PEAK_FLOPS, READ_BYTES_PER_S } from "../cuda/hardware.js";
import {
  type Device,
  DeviceTensor,
  type ResultRow,
  type Stream,
  summarizeSamples,
  timeKernel,
} from "../cuda/index.js";
import { DeviceMoEWeights, generateActivationsOnDevice } from "../kernels/device-weights.js";
import { FUSED_BLOCK_MS, fusedExpandProblem } from "../kernels/megamoe/megamoe.variants.js";
import { FusedPipeline } from "../pipeline/fused.js";
import { type MoEPipeline, UnfusedPipeline } from "../pipeline/unfused.js";
import { type Routing, randomRouting } from "../reference/router.js";
import { type MoEWeightSource, MXFP4_GROUP } from "../weights/types.js";
import { type RoundsMeasurement, timeInRounds } from "./rounds.js";

/** FP8 tensor-core rate assumed for the floor when none is known: the grouped GEMM's, in TFLOP/s. */
export const DEFAULT_FP8_TFLOPS = FP8_PEAK_FLOPS / 1e12;
/** Read-stream bandwidth assumed for the floor when not measured: the grouped GEMM's, in TB/s. */
export const DEFAULT_READ_TBPS = READ_BYTES_PER_S / 1e12;

export interface LayerFloor {
  bytes: number;
  flops: number;
  /** Distinct routed experts that receive at least one row. */
  expertsTouched: number;
  /** Routed (token, slot) pairs: the rows the routed GEMMs multiply. */
  routedRows: number;
  floorUs: number;
  /** Which term of the max is larger. */
  bound: "memory" | "compute";
}

/**
 * Bytes of one expert MLP's weights (W1: 2·inter × hidden, W2: hidden × inter): FP8 codes and fp32
 * 128×128 block scales, or MXFP4 nibbles (half a byte each) and one UE8M0 byte per 32 elements.
 */
export function expertWeightBytes(hidden: number, inter: number, format: ExpertFormat = "fp8"): number {
  const elements = 3 * inter * hidden;
  if (format === "fp4") return elements / 2 + elements / MXFP4_GROUP;
  return elements + (elements / QUANT_BLOCK ** 2) * 4;
}

/** Distinct experts and routed rows in a routing of `tokens` tokens (ids outside [0, E) are not routed). */
export function routingFootprint(
  config: MoEConfig,
  tokens: number,
  routing: Pick<Routing, "ids">,
): { expertsTouched: number; routedRows: number } {
  const touched = new Uint8Array(config.numExperts);
  let expertsTouched = 0;
  let routedRows = 0;
  const slots = tokens * config.topK;
  if (routing.ids.length < slots) {
    throw new RangeError(`routing holds ${routing.ids.length} ids, fewer than tokens·k = ${slots}`);
  }
  for (let i = 0; i < slots; i++) {
    const e = routing.ids[i]!;
    if (e < 0 || e >= config.numExperts) continue;
    routedRows++;
    if (touched[e] === 0) {
      touched[e] = 1;
      expertsTouched++;
    }
  }
  return { expertsTouched, routedRows };
}

/**
 * The floor of one forward (see the module comment): max(bytes / `readTbps`, FLOPs / `fp8Tflops`).
 * Rates in TB/s (read stream) and TFLOP/s.
 */
export function layerFloor(
  config: MoEConfig,
  tokens: number,
  routing: Pick<Routing, "ids">,
  shared: boolean,
  readTbps: number = DEFAULT_READ_TBPS,
  fp8Tflops: number = DEFAULT_FP8_TFLOPS,
): LayerFloor {
  if (!(readTbps > 0) || !(fp8Tflops > 0)) {
    throw new RangeError(`rates must be positive, got read ${readTbps} TB/s, FP8 ${fp8Tflops} TFLOP/s`);
  }
  const H = config.hidden;
  const IH = config.intermediate;
  const { expertsTouched, routedRows } = routingFootprint(config, tokens, routing);
  const useShared = shared && config.numShared > 0;
  const SIH = sharedIntermediate(config);
  const bytes =
    expertsTouched * expertWeightBytes(H, IH, expertFormatOf(config)) +
    (useShared ? expertWeightBytes(H, SIH) : 0) +
    2 * tokens * H * 2; // bf16 in and out
  const flops =
    2 * routedRows * (H * 2 * IH + IH * H) + (useShared ? 2 * tokens * (H * 2 * SIH + SIH * H) : 0);
  const memoryUs = (bytes / (readTbps * 1e12)) * 1e6;
  const computeUs = (flops / (fp8Tflops * 1e12)) * 1e6;
  return {
    bytes,
    flops,
    expertsTouched,
    routedRows,
    floorUs: Math.max(memoryUs, computeUs),
    bound: memoryUs >= computeUs ? "memory" : "compute",
  };
}

/** The layer implementations `benchmarkLayer` times. */
export type LayerImpl = "fused" | "unfused";
export const LAYER_IMPLS: readonly LayerImpl[] = ["fused", "unfused"];

export interface LayerBenchOptions {
  /** Pipelines timed side by side, same weights and inputs (default: both). */
  impls?: readonly LayerImpl[];
  shape: string;
  /** The shape's routed experts in this format (default the preset's); not with `source`. */
  expertFormat?: ExpertFormat;
  /** Weights to upload (a checkpoint's layer) instead of the shape's generated ones. */
  source?: MoEWeightSource;
  tokens: readonly number[];
  shared: boolean;
  seed: number;
  /** Read-stream ceiling measured in the same process (TB/s), the floor's bandwidth. */
  readTbps: number;
  fp8Tflops?: number;
  /** Timed runs per case (default DEFAULT_LAYER_ITERS; at least 20 is what the project reports). */
  iters?: number;
  /** Also time CUDA-graph replays of the forward (default true). */
  graph?: boolean;
  /** Also time the fused kernel with every block M forced (rows `fused-m64`, `fused-m128`, graph). */
  configs?: boolean;
  /**
   * Interleaving (default 1): the runs of a token count are split into this many rounds, and each round
   * times every row in turn, so a slow drift (clocks, heat) lands on all of them alike instead of on
   * whichever was timed last.
   */
  rounds?: number;
  onProgress?: (done: number, total: number) => void;
}

/** Timed runs per row and token count when LayerBenchOptions.iters is not given. */
export const DEFAULT_LAYER_ITERS = 30;

/** One row's timing at one token count (a failed graph row is left out; its eager row says why). */
interface Measurement extends RoundsMeasurement {
  impl: string;
  pipeline: MoEPipeline;
  run: (s: Stream) => void;
  blockM?: number;
  /** FP4 experts: whether the fused kernel expanded them first (the expand variant). */
  expand?: boolean;
  eager?: Measurement;
}

/** One forward's device operands: x from the activation generator, the routing, an output buffer. */
export interface ForwardOperands {
  x: DeviceTensor;
  ids: DeviceTensor;
  weights: DeviceTensor;
  out: DeviceTensor;
  dispose(): void;
}

/** Allocates and fills a forward's operands for `tokens` tokens of `config` (x made on the device from `seed`). */
export function forwardOperands(
  device: Device,
  config: MoEConfig,
  tokens: number,
  routing: Routing,
  seed: number,
): ForwardOperands {
  const owned: DeviceTensor[] = [];
  const keep = (t: DeviceTensor) => {
    owned.push(t);
    return t;
  };
  const dispose = () => {
    for (const t of owned) t.dispose();
  };
  try {
    return {
      x: keep(generateActivationsOnDevice(device, seed, tokens, config.hidden)),
      ids: keep(DeviceTensor.fromHost(device, "int32", [tokens, config.topK], routing.ids)),
      weights: keep(DeviceTensor.fromHost(device, "fp32", [tokens, config.topK], routing.weights)),
      out: keep(DeviceTensor.empty(device, "bf16", [tokens, config.hidden])),
      dispose,
    };
  } catch (e) {
    dispose();
    throw e;
  }
}

/**
 * Keeps the GPU busy for a few hundred milliseconds before the first measurement: an idle H200 sits at
 * a low clock (345 MHz seen), and the first case of a sweep would otherwise pay for the ramp.
 */
function warmUpClock(device: Device, pipeline: MoEPipeline, config: MoEConfig, tokens: number): void {
  const f = forwardOperands(device, config, tokens, randomRouting(1, tokens, config), 1);
  try {
    const start = performance.now();
    while (performance.now() - start < 300) {
      pipeline.forward({ ...f, tokens, shared: true }, null);
      device.synchronize();
    }
  } finally {
    f.dispose();
  }
}

/**
 * Times the layer's GPU pipelines side by side at every token count (L2 flushed before each run, median
 * of `iters`), same weights and inputs. Per pipeline and token count: one row of eager launches
 * (`graph: false`) and, when the forward can be captured, one row of CUDA-graph replays (`graph: true`);
 * a failed capture is recorded as `graph_error` on the eager row. The fused pipeline adds a row
 * `fused-kernel`: its kernel alone on rows quantized beforehand, in a graph (launch hidden), the way
 * DeepGEMM's fp8_mega_moe is timed. Weights are generated once on the device for the largest count.
 * With `rounds` > 1 the rows of a token count are timed in interleaved rounds (see LayerBenchOptions).
 */
export function benchmarkLayer(device: Device, o: LayerBenchOptions): ResultRow[] {
  if (o.tokens.length === 0) throw new RangeError("benchmarkLayer: no token counts");
  const impls = o.impls ?? LAYER_IMPLS;
  const maxTokens = Math.max(...o.tokens);
  const overrides = o.expertFormat === undefined ? {} : { expertFormat: o.expertFormat };
  const config =
    o.source === undefined ? resolveConfigForTokens(o.shape, maxTokens, overrides) : o.source.config;
  if (config.maxTokens < maxTokens) {
    throw new RangeError(
      `benchmarkLayer: ${config.name} takes at most ${config.maxTokens} tokens, asked ${maxTokens}`,
    );
  }
  const fp4 = expertFormatOf(config) === "fp4";
  const iters = o.iters ?? DEFAULT_LAYER_ITERS;
  const withGraph = o.graph ?? true;
  const rounds = o.rounds ?? 1;
  // Made on the device, bit for bit what GeneratedWeights would give (a flash layer is 6.4 GB of FP8).
  const weights =
    o.source === undefined
      ? DeviceMoEWeights.generate(device, config, o.seed)
      : DeviceMoEWeights.upload(device, o.source);
  const rows: ResultRow[] = [];
  const pipelines: MoEPipeline[] = [];
  try {
    for (const impl of impls) {
      pipelines.push(
        impl === "fused"
          ? new FusedPipeline(device, weights, maxTokens)
          : new UnfusedPipeline(device, weights, maxTokens),
      );
    }
    for (const p of pipelines) warmUpClock(device, p, config, maxTokens);
    o.tokens.forEach((tokens, i) => {
      const routing = randomRouting(o.seed, tokens, config);
      const operands = forwardOperands(device, config, tokens, routing, o.seed);
      try {
        const { x, ids, weights: w, out } = operands;
        device.synchronize();
        const f = layerFloor(config, tokens, routing, o.shared, o.readTbps, o.fp8Tflops);
        const row = (
          impl: string,
          t: { usMedian: number; usMin: number; usMax: number },
          graph: boolean,
        ): ResultRow => ({
          config: config.name,
          tokens,
          shared: o.shared,
          impl,
          us_median: t.usMedian,
          us_min: t.usMin,
          us_max: t.usMax,
          floor_us: f.floorUs,
          tflops: f.flops / (t.usMedian * 1e6),
          tbps: f.bytes / (t.usMedian * 1e6),
          experts_touched: f.expertsTouched,
          bytes: f.bytes,
          flops: f.flops,
          bound: f.bound,
          graph,
        });
        const measurements: Measurement[] = [];
        const add = (m: Omit<Measurement, "samples">) => {
          const full = { ...m, samples: [] };
          measurements.push(full);
          return full;
        };
        for (const p of pipelines) {
          const run = (s: Stream) => p.forward({ x, ids, weights: w, out, tokens, shared: o.shared }, s);
          // Eager first: it also compiles and loads every kernel, which capture requires.
          const eager = add({ impl: p.kind, pipeline: p, graph: false, run, warmup: 5 });
          if (withGraph) add({ impl: p.kind, pipeline: p, graph: true, run, warmup: 3, eager });
          if (p instanceof FusedPipeline && withGraph) {
            const launch = (s: Stream) => p.launchKernelOnly(ids, w, out, tokens, o.shared, s);
            const picked = p.kernel.plan(tokens);
            add({
              impl: "fused-kernel",
              pipeline: p,
              graph: true,
              run: launch,
              warmup: 3,
              eager,
              blockM: picked.blockM,
              ...(fp4 ? { expand: picked.expand } : {}),
            });
            // --configs: every block M, and with FP4 experts at 64 and 128 rows both with and without the
            // expansion ("fused-m128x": expanded).
            const forced = (o.configs ? FUSED_BLOCK_MS : []).flatMap((blockM) =>
              (fp4 && fusedExpandProblem(config, blockM) === null ? [false, true] : [false]).map(
                (expand) => ({
                  blockM,
                  expand,
                }),
              ),
            );
            for (const { blockM, expand } of forced) {
              add({
                impl: `fused-m${blockM}${expand ? "x" : ""}`,
                pipeline: p,
                graph: true,
                run: launch,
                warmup: 3,
                eager,
                blockM,
                ...(fp4 ? { expand } : {}),
                enter: () => {
                  p.kernel.blockM = blockM;
                  p.kernel.fp4Expand = expand;
                  // Compiled and its buffers allocated before capture (an allocation fails under it).
                  p.kernel.prepare(tokens);
                },
                leave: () => {
                  p.kernel.blockM = "auto";
                  p.kernel.fp4Expand = "auto";
                },
              });
            }
          }
        }
        timeInRounds(
          measurements,
          rounds,
          iters,
          (m, warmup, runs) => timeKernel(device, m.run, { warmup, iters: runs, graph: m.graph }).samples,
          (m) => m.pipeline.checkStatus(),
        );
        const rowOf = new Map<Measurement, ResultRow>();
        for (const m of measurements) {
          if (m.error !== undefined) {
            // A failed capture or replay: its eager row says why (the first such failure of the pipeline).
            const eagerRow = m.eager && rowOf.get(m.eager);
            if (eagerRow && eagerRow.graph_error === undefined) eagerRow.graph_error = m.error;
            continue;
          }
          const r = row(m.impl, summarizeSamples(m.samples), m.graph);
          if (m.blockM !== undefined) r.block_m = m.blockM;
          if (m.expand !== undefined) r.fp4_expand = m.expand;
          rowOf.set(m, r);
          rows.push(r);
        }
      } finally {
        operands.dispose();
      }
      o.onProgress?.(i + 1, o.tokens.length);
    });
  } finally {
    for (const p of pipelines) p.dispose();
    weights.dispose();
  }
  return rows;
}
