/**
 * The expert-parallel benchmark (issues 24, 25): R virtual ranks of one layer on one GPU (or, with
 * `gpus`, rank r on GPU r), rank d holding
 * routed experts [d·E/R, (d+1)·E/R) and the shared expert, each rank bringing T tokens. Two paths side by
 * side, same weights, inputs and routing:
 *
 *   fused-ep   FusedExpertParallel: each rank one launch of the fused kernel's EP build, the routing
 *              never leaving the GPU (counts, rows, results exchanged inside the kernels)
 *   host-ep    ExpertParallelMoE on "cuda": the dispatch planned on the host from the ids, gather
 *              kernels, each rank's layer, the combine kernels, the phases separated by synchronizing
 *
 * A forward is timed from the host, from an idle GPU with L2 flushed to the result being ready
 * (host-ep waits inside forwardDevice; fused-ep is queued on the ranks' streams, then synchronized): the
 * host plan is part of what the host-planned path costs, so no event pair on one stream can bracket it.
 * fused-ep also reports its GPU span: the longest rank's, from an event before its first work to its
 * end on its own stream (events of different GPUs cannot be compared).
 * Runs are split into rounds, each timing both paths in turn (rounds.ts).
 *
 * Beside the times: the floor of all R ranks' work on this one GPU (the layer floor of layer.ts over the
 * R·T tokens), the floor of one rank's expert work (its experts over the rows routed to them, its shared
 * expert over its own T tokens; the slowest rank: what R GPUs could reach at best), and the bytes that
 * cross ranks per forward: fusedEpTraffic for fused-ep (FP8 rows with their scales pulled, bf16 results
 * per remote slot pushed, row descriptors), one bf16 row out and one bf16 partial back per (token, other
 * rank) pair for host-ep. After timing, the two paths' outputs are compared value for value
 * (`mismatched`): the in-kernel path is meant to equal the host-planned one bit for bit.
 */
import Table from "cli-table3";
import pc from "picocolors";
import {
  type ExpertFormat,
  expertFormatOf,
  MAX_TOKENS_LIMIT,
  type MoEConfig,
  resolveConfigForTokens,
  sharedIntermediate,
} from "../config/config.js";
import {
  cudaAvailability,
  type Device,
  DeviceTensor,
  Event,
  flushL2,
  median,
  openDevice,
  type ResultRow,
  summarizeSamples,
} from "../cuda/index.js";
import { generateActivationsOnDevice } from "../kernels/device-weights.js";
import { FUSED_EP_MAX_RANKS } from "../kernels/megamoe/megamoe.variants.js";
import { ExpertParallelMoE, joinRankArrays, type RankDeviceInput } from "../parallel/expert-parallel.js";
import { type FusedEpTraffic, fusedEpLayout, fusedEpTraffic } from "../parallel/fused-ep.js";
import { FusedExpertParallel, type FusedRankDeviceInput } from "../parallel/fused-expert-parallel.js";
import { randomRouting } from "../reference/router.js";
import { GeneratedWeights } from "../weights/generate.js";
import {
  DEFAULT_FP8_TFLOPS,
  DEFAULT_LAYER_ITERS,
  DEFAULT_READ_TBPS,
  expertWeightBytes,
  layerFloor,
  routingFootprint,
} from "./layer.js";
import { type RoundsMeasurement, timeInRounds } from "./rounds.js";

/** The two paths, in the order they are timed in each round. */
export const EP_IMPLS = ["fused-ep", "host-ep"] as const;
export type EpImpl = (typeof EP_IMPLS)[number];
/** Virtual ranks when --ranks is not given. */
export const EP_RANKS = [2, 4, 8];
/** Tokens per rank when --tokens is not given. */
export const EP_TOKENS = [1, 8, 64, 512, 4096, 8192];
/** The shape when --shape is not given: the whole flash layer (E = 256), split R ways. */
export const EP_SHAPE = "flash";

/**
 * Why `ranks` virtual ranks cannot split a layer of `numExperts` experts (of preset `shape`), or null:
 * 2 … FUSED_EP_MAX_RANKS (the kernel's EP build), dividing the experts.
 */
export function epRanksProblem(ranks: number, numExperts: number, shape?: string): string | null {
  if (!Number.isInteger(ranks) || ranks < 2 || ranks > FUSED_EP_MAX_RANKS) {
    return `must be in 2 … ${FUSED_EP_MAX_RANKS} (the fused kernel's EP build; one rank is --impl fused)`;
  }
  if (numExperts % ranks !== 0) {
    return `must divide the ${numExperts} routed experts${shape === undefined ? "" : ` of ${shape}`}`;
  }
  return null;
}

/**
 * Why T tokens per rank cannot be benchmarked with R ranks, or null: a host-planned rank may receive
 * every rank's tokens, R·T rows, and a layer takes at most MAX_TOKENS_LIMIT.
 */
export function epTokensProblem(ranks: number, tokens: number): string | null {
  if (ranks * tokens > MAX_TOKENS_LIMIT) {
    return `with ${ranks} ranks a host-planned rank may receive ${ranks} × ${tokens} = ${ranks * tokens} rows, more than a layer's ${MAX_TOKENS_LIMIT}`;
  }
  return null;
}

/** Bytes that cross ranks in one host-planned forward (expert-parallel.ts, dispatch.ts). */
export interface HostEpTraffic {
  /** bf16 rows gathered into other ranks' buffers: one per (token, other rank holding one of its experts), 2H each. */
  gather: number;
  /** bf16 partial results the combine reads from other ranks: one per such pair, 2H each. */
  combine: number;
}

/**
 * The host-planned path's traffic from each rank's global ids [T_s, k]: a token travels once to every
 * other rank holding at least one of its experts (not once per slot), and its partial result comes back
 * once from each. Ids outside [0, E) are unused slots.
 */
export function hostEpTraffic(
  ids: readonly Int32Array[],
  numExperts: number,
  topK: number,
  hidden: number,
): HostEpTraffic {
  const R = ids.length;
  if (R < 1 || numExperts % R !== 0) {
    throw new RangeError(`hostEpTraffic: ${numExperts} experts cannot be split among ${R} ranks`);
  }
  const L = numExperts / R;
  let pairs = 0;
  ids.forEach((rank, s) => {
    if (rank.length % topK !== 0) throw new RangeError(`hostEpTraffic: rank ${s} holds ${rank.length} ids`);
    for (let t = 0; t * topK < rank.length; t++) {
      let on = 0; // destination ranks of token t other than s, a bit each
      for (let j = 0; j < topK; j++) {
        const e = rank[t * topK + j]!;
        if (e < 0 || e >= numExperts) continue;
        const d = Math.floor(e / L);
        if (d !== s) on |= 1 << d;
      }
      for (; on !== 0; on &= on - 1) pairs++;
    }
  });
  return { gather: pairs * 2 * hidden, combine: pairs * 2 * hidden };
}

/** The sum of a traffic record's parts. */
export function trafficBytes(t: FusedEpTraffic | HostEpTraffic): number {
  return Object.values(t).reduce((a: number, b: number) => a + b, 0);
}

/** The floor of one rank's expert work in a forward (see the module doc). */
export interface RankFloor {
  /** The slowest rank's floor, µs. */
  floorUs: number;
  /** That rank. */
  rank: number;
  bytes: number;
  flops: number;
  bound: "memory" | "compute";
}

/**
 * The floor of each rank's expert work, layer.ts's model applied to one rank: its experts that the
 * ranks' routing touches (weights read once) and the rows routed to them, plus its shared expert over
 * its own tokens and their bf16 in and out; the rank with the largest floor. `ids[s]`: rank s's global
 * ids [T_s, k]. Rates in TB/s and TFLOP/s.
 */
export function rankExpertFloor(
  config: MoEConfig,
  ids: readonly Int32Array[],
  shared: boolean,
  readTbps: number = DEFAULT_READ_TBPS,
  fp8Tflops: number = DEFAULT_FP8_TFLOPS,
): RankFloor {
  if (!(readTbps > 0) || !(fp8Tflops > 0)) {
    throw new RangeError(`rates must be positive, got read ${readTbps} TB/s, FP8 ${fp8Tflops} TFLOP/s`);
  }
  const R = ids.length;
  const { numExperts: E, topK: k, hidden: H, intermediate: IH } = config;
  if (R < 1 || E % R !== 0)
    throw new RangeError(`rankExpertFloor: ${E} experts cannot be split among ${R} ranks`);
  const L = E / R;
  const all = joinRankArrays(ids, Int32Array); // every rank's ids, rank after rank
  const local = new Int32Array(all.length);
  const rows = all.length / k;
  const useShared = shared && config.numShared > 0;
  const SIH = sharedIntermediate(config);
  let worst: RankFloor | undefined;
  for (let d = 0; d < R; d++) {
    for (let i = 0; i < all.length; i++) {
      const e = all[i]!;
      local[i] = e >= d * L && e < (d + 1) * L ? e - d * L : -1;
    }
    const { expertsTouched, routedRows } = routingFootprint({ ...config, numExperts: L }, rows, {
      ids: local,
    });
    const own = ids[d]!.length / k;
    const bytes =
      expertsTouched * expertWeightBytes(H, IH, expertFormatOf(config)) +
      (useShared ? expertWeightBytes(H, SIH) : 0) +
      2 * own * H * 2;
    const flops =
      2 * routedRows * (H * 2 * IH + IH * H) + (useShared ? 2 * own * (H * 2 * SIH + SIH * H) : 0);
    const memoryUs = (bytes / (readTbps * 1e12)) * 1e6;
    const computeUs = (flops / (fp8Tflops * 1e12)) * 1e6;
    const floorUs = Math.max(memoryUs, computeUs);
    if (worst === undefined || floorUs > worst.floorUs) {
      worst = { floorUs, rank: d, bytes, flops, bound: memoryUs >= computeUs ? "memory" : "compute" };
    }
  }
  return worst!;
}

/** What one case (R ranks, T tokens each) measured for one path. */
export interface EpMeasured {
  impl: EpImpl;
  /** Host µs per forward: median, min, max. */
  usMedian: number;
  usMin: number;
  usMax: number;
  /** fused-ep: the GPU span's median, µs. */
  gpuUsMedian?: number;
  /** fused-ep: values differing from host-ep's output (undefined: not compared). */
  mismatched?: number;
  /** bf16 values compared. */
  compared?: number;
}

/** The floors and traffic of one case, both paths' (pure: from the routing alone). */
export interface EpCaseModel {
  config: string;
  /** The routed experts' format. */
  experts: ExpertFormat;
  ranks: number;
  tokens: number;
  shared: boolean;
  /** All ranks' work on one GPU: layerFloor over R·T tokens. */
  floor: { floorUs: number; bytes: number; flops: number; bound: "memory" | "compute" };
  rankFloor: RankFloor;
  traffic: { "fused-ep": FusedEpTraffic; "host-ep": HostEpTraffic };
}

/**
 * The model of one case: `ids[s]` rank s's global ids [T, k] (the ranks' routing), the floors at the
 * given rates and the bytes across ranks of both paths.
 */
export function epCaseModel(
  config: MoEConfig,
  ids: readonly Int32Array[],
  shared: boolean,
  readTbps: number = DEFAULT_READ_TBPS,
  fp8Tflops: number = DEFAULT_FP8_TFLOPS,
): EpCaseModel {
  const R = ids.length;
  const { numExperts: E, topK: k, hidden: H } = config;
  const tokens = (ids[0]?.length ?? 0) / k;
  if (ids.some((a) => a.length !== tokens * k)) {
    throw new RangeError("epCaseModel: every rank must bring the same number of tokens");
  }
  const f = layerFloor(
    config,
    R * tokens,
    { ids: joinRankArrays(ids, Int32Array) },
    shared,
    readTbps,
    fp8Tflops,
  );
  const layout = fusedEpLayout({
    ranks: R,
    numExperts: E,
    topK: k,
    hidden: H,
    maxTokens: Math.max(1, tokens),
  });
  return {
    config: config.name ?? "custom",
    experts: expertFormatOf(config),
    ranks: R,
    tokens,
    shared,
    floor: { floorUs: f.floorUs, bytes: f.bytes, flops: f.flops, bound: f.bound },
    rankFloor: rankExpertFloor(config, ids, shared, readTbps, fp8Tflops),
    traffic: { "fused-ep": fusedEpTraffic(layout, ids), "host-ep": hostEpTraffic(ids, E, k, H) },
  };
}

/** One results row: a path's times beside the case's floors and its bytes across ranks. */
export function epRow(model: EpCaseModel, m: EpMeasured): ResultRow {
  const traffic = model.traffic[m.impl];
  const row: ResultRow = {
    config: model.config,
    experts: model.experts,
    tokens: model.tokens,
    shared: model.shared,
    impl: m.impl,
    ranks: model.ranks,
    tokens_total: model.ranks * model.tokens,
    us_median: m.usMedian,
    us_min: m.usMin,
    us_max: m.usMax,
    floor_us: model.floor.floorUs,
    rank_floor_us: model.rankFloor.floorUs,
    rank_floor_bound: model.rankFloor.bound,
    tflops: model.floor.flops / (m.usMedian * 1e6),
    tbps: model.floor.bytes / (m.usMedian * 1e6),
    bytes: model.floor.bytes,
    flops: model.floor.flops,
    bound: model.floor.bound,
    bytes_across: trafficBytes(traffic),
    traffic: { ...traffic },
  };
  if (m.gpuUsMedian !== undefined) row.gpu_us_median = m.gpuUsMedian;
  if (m.mismatched !== undefined) {
    row.mismatched = m.mismatched;
    row.compared = m.compared;
  }
  return row;
}

function percentCell(frac: number): string {
  if (!Number.isFinite(frac)) return pc.dim("—");
  const pct = `${(100 * frac).toFixed(0)}%`;
  return frac >= 0.8 ? pc.green(pct) : frac >= 0.5 ? pc.yellow(pct) : pc.red(pct);
}

const num = (v: unknown, digits: number) =>
  typeof v === "number" && Number.isFinite(v) ? v.toFixed(digits) : pc.dim("—");

/**
 * The table: per ranks, tokens and path, µs per forward (and fused-ep's GPU span), the one-GPU floor
 * and how close to it, one rank's floor, the MB across ranks, and on fused-ep rows host-ep / fused-ep.
 */
export function epTable(rows: readonly ResultRow[]): string {
  const head = [
    "config",
    "R",
    "T / rank",
    "impl",
    "µs median",
    "GPU µs",
    "floor µs",
    "floor/time",
    "rank floor µs",
    "MB across",
    "host/fused",
  ];
  const table = new Table({
    head: head.map((h) => pc.bold(h)),
    style: { head: [], border: [] },
    colAligns: head.map((h, i) => (i === 0 || h === "impl" ? "left" : "right")),
  });
  for (const r of rows) {
    let ratio = "";
    if (r.impl === "fused-ep") {
      const host = rows.find((h) => h.impl === "host-ep" && h.ranks === r.ranks && h.tokens === r.tokens);
      if (host !== undefined && Number.isFinite(r.us_median) && Number.isFinite(host.us_median)) {
        const x = host.us_median / r.us_median;
        ratio = x >= 1 ? pc.green(`${x.toFixed(2)}×`) : pc.red(`${x.toFixed(2)}×`);
      }
    }
    table.push([
      r.experts === "fp4" ? `${String(r.config)} fp4` : String(r.config),
      String(r.ranks),
      String(r.tokens),
      typeof r.error === "string" ? `${r.impl} ${pc.red("failed")}` : r.impl,
      num(r.us_median, 1),
      num(r.gpu_us_median, 1),
      num(r.floor_us, 1),
      // One rank per GPU: each GPU's floor is its rank's.
      percentCell(
        Number(typeof r.gpus === "number" && r.gpus > 1 ? r.rank_floor_us : r.floor_us) / r.us_median,
      ),
      num(r.rank_floor_us, 1),
      num(typeof r.bytes_across === "number" ? r.bytes_across / 1e6 : undefined, 3),
      ratio,
    ]);
  }
  return table.toString();
}

/** The lines under the table: what the floors are, then any output that differs and any failure. */
export function epNotes(rows: readonly ResultRow[], readTbps: number, fp8Tflops: number): string[] {
  const lines = [
    `µs: host time per forward, idle GPUs and cold L2 to the result (host-ep plans on the host); GPU µs: fused-ep's longest rank, first to last event on its stream`,
    `floor = all R ranks' work on one GPU (layer floor over R·T tokens); rank floor = the slowest rank's experts over the rows routed to them + its shared expert (what R GPUs could reach; floor/time uses it when the ranks are on R GPUs); max(bytes / ${readTbps.toFixed(2)} TB/s, FLOPs / ${fp8Tflops.toFixed(0)} TFLOP/s)`,
    `MB across: fused-ep FP8 rows + scales pulled, bf16 results per remote slot, descriptors; host-ep bf16 rows gathered + bf16 partials combined`,
  ];
  for (const r of rows) {
    if (typeof r.mismatched === "number" && r.mismatched > 0) {
      lines.push(
        pc.yellow(
          `R=${r.ranks} T=${r.tokens}: fused-ep differs from host-ep in ${r.mismatched} of ${String(r.compared)} bf16 values`,
        ),
      );
    }
    if (typeof r.error === "string")
      lines.push(pc.red(`R=${r.ranks} T=${r.tokens}: ${r.impl} failed: ${r.error}`));
  }
  return lines;
}

export interface EpBenchOptions {
  /** A preset whose routed experts the ranks split (default EP_SHAPE). */
  shape?: string;
  /** Virtual ranks, each 2 … FUSED_EP_MAX_RANKS dividing the experts (default EP_RANKS). */
  ranks?: readonly number[];
  /** Rank r on GPU r instead of every rank on `device` (each ranks count at most the GPU count). */
  gpus?: boolean;
  /** The routed experts' format (default the shape's). */
  expertFormat?: ExpertFormat;
  /** Tokens per rank (default EP_TOKENS). */
  tokens?: readonly number[];
  shared: boolean;
  seed: number;
  /** Read-stream ceiling measured in the same process (TB/s), the floors' bandwidth. */
  readTbps: number;
  fp8Tflops?: number;
  /** Timed forwards per path and case (default DEFAULT_LAYER_ITERS). */
  iters?: number;
  /** Interleaved rounds (default 3). */
  rounds?: number;
  onProgress?: (done: number, total: number) => void;
}

interface EpMeasurement extends RoundsMeasurement {
  impl: EpImpl;
  /** One forward, returned when its result is ready; the fused path's GPU span in µs. */
  run: () => number | undefined;
  gpu: number[];
}

/** Values that differ between two bf16 outputs. */
function countMismatched(a: Uint16Array, b: Uint16Array): number {
  let n = 0;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) n++;
  return n;
}

/**
 * Times both paths for every ranks count and tokens per rank (see the module doc). Weights are the
 * shape's generated ones (made on the device per rank, the same for both paths). A fused-ep forward that
 * fails ends the sweep (its CUDA context is lost): its row carries `error` and the rows before it stand.
 */
export function benchmarkExpertParallel(device: Device, o: EpBenchOptions): ResultRow[] {
  const ranksList = o.ranks ?? EP_RANKS;
  const tokensList = o.tokens ?? EP_TOKENS;
  if (ranksList.length === 0 || tokensList.length === 0) {
    throw new RangeError("benchmarkExpertParallel: no ranks or no token counts");
  }
  const maxTokens = Math.max(...tokensList);
  const config = resolveConfigForTokens(
    o.shape ?? EP_SHAPE,
    maxTokens,
    o.expertFormat === undefined ? {} : { expertFormat: o.expertFormat },
  );
  for (const R of ranksList) {
    const problem = epRanksProblem(R, config.numExperts) ?? epTokensProblem(R, maxTokens);
    if (problem !== null) throw new RangeError(`benchmarkExpertParallel: ${R} ranks: ${problem}`);
  }
  const { hidden: H, topK: k } = config;
  const iters = o.iters ?? DEFAULT_LAYER_ITERS;
  const rounds = o.rounds ?? Math.min(3, iters);
  const fp8Tflops = o.fp8Tflops ?? DEFAULT_FP8_TFLOPS;
  if (o.gpus === true) {
    const available = cudaAvailability();
    const count = available.ok ? available.deviceCount : 0;
    for (const R of ranksList) {
      if (R > count) {
        throw new RangeError(
          `benchmarkExpertParallel: ${R} ranks on one GPU each need ${R} GPUs; this machine has ${count}`,
        );
      }
    }
  }
  const source = new GeneratedWeights(config, o.seed);
  const rows: ResultRow[] = [];
  const total = ranksList.length * tokensList.length;
  let done = 0;
  for (const R of ranksList) {
    let host: ExpertParallelMoE | undefined;
    let fused: FusedExpertParallel | undefined;
    let failed = false;
    // Each rank's GPU, and the distinct ones: every input is made on each of them (ranks take views).
    const rankDevices: Device[] = Array.from({ length: R }, (_, r) =>
      o.gpus === true ? openDevice(r) : device,
    );
    const gpuList = [...new Set(rankDevices)];
    try {
      host = new ExpertParallelMoE(source, { ranks: R, backend: "cuda", devices: rankDevices });
      fused = new FusedExpertParallel(source, { ranks: R, devices: rankDevices, maxTokens });
      for (const T of tokensList) {
        const owned: DeviceTensor[] = [];
        const keep = <D extends DeviceTensor>(t: D) => {
          owned.push(t);
          return t;
        };
        const n = R * T;
        const routing = randomRouting(o.seed, n, config);
        const ids = Array.from({ length: R }, (_, s) => routing.ids.subarray(s * T * k, (s + 1) * T * k));
        const model = epCaseModel(config, ids, o.shared, o.readTbps, fp8Tflops);
        let stage = "setup";
        try {
          const on = new Map(
            gpuList.map((d) => {
              const t = {
                x: keep(generateActivationsOnDevice(d, o.seed, n, H)),
                ids: keep(DeviceTensor.fromHost(d, "int32", [n, k], routing.ids)),
                weights: keep(DeviceTensor.fromHost(d, "fp32", [n, k], routing.weights)),
                outFused: keep(DeviceTensor.empty(d, "bf16", [n, H])),
                outHost: keep(DeviceTensor.empty(d, "bf16", [n, H])),
              };
              // Poisoned apart: a value neither path writes counts as mismatched.
              t.outFused.fill(0xff);
              t.outHost.fill(0);
              return [d, t];
            }),
          );
          const fusedInputs: FusedRankDeviceInput[] = ids.map((_, s) => {
            const t = on.get(rankDevices[s]!)!;
            return {
              x: t.x.view([T, H], s * T * H),
              ids: t.ids.view([T, k], s * T * k),
              weights: t.weights.view([T, k], s * T * k),
              out: t.outFused.view([T, H], s * T * H),
              tokens: T,
            };
          });
          const hostInputs: RankDeviceInput[] = ids.map((rankIds, s) => {
            const t = on.get(rankDevices[s]!)!;
            return {
              x: t.x.view([T, H], s * T * H),
              out: t.outHost.view([T, H], s * T * H),
              tokens: T,
              ids: rankIds,
              weights: routing.weights.subarray(s * T * k, (s + 1) * T * k),
            };
          });
          for (const d of gpuList) d.synchronize();
          const streams = fused.streams;
          const starts = streams.map((_, r) => rankDevices[r]!.createEvent());
          const ends = streams.map((_, r) => rankDevices[r]!.createEvent());
          const f = fused;
          const h = host;
          const measurements: EpMeasurement[] = [
            {
              impl: "fused-ep",
              graph: false,
              warmup: 3,
              samples: [],
              gpu: [],
              run: () => {
                streams.forEach((s, r) => {
                  starts[r]!.record(s);
                });
                f.forwardDevice(fusedInputs, { shared: o.shared });
                streams.forEach((s, r) => {
                  ends[r]!.record(s);
                });
                f.synchronize();
                return Math.max(...ends.map((e, r) => Event.elapsedMs(starts[r]!, e))) * 1000;
              },
            },
            {
              impl: "host-ep",
              graph: false,
              warmup: 3,
              samples: [],
              gpu: [],
              run: () => {
                h.forwardDevice(hostInputs, { shared: o.shared });
                return undefined;
              },
            },
          ];
          try {
            if (T === tokensList[0]) {
              // Loads every kernel, then keeps the GPU busy a few hundred milliseconds: an idle H200
              // sits at a low clock, and the first case would pay for the ramp (layer.ts warmUpClock).
              const t0 = performance.now();
              do {
                for (const m of measurements) {
                  stage = m.impl;
                  m.run();
                }
              } while (performance.now() - t0 < 300);
            }
            stage = "timing";
            timeInRounds(measurements, rounds, iters, (m, warmup, runs) => {
              stage = m.impl;
              for (let i = 0; i < warmup; i++) m.run();
              const samples: number[] = [];
              for (let i = 0; i < runs; i++) {
                for (const d of gpuList) {
                  flushL2(d, null, i + 1);
                  d.synchronize();
                }
                const t0 = performance.now();
                const gpu = m.run();
                samples.push((performance.now() - t0) * 1000);
                if (gpu !== undefined) m.gpu.push(gpu);
              }
              return samples;
            });
          } finally {
            for (const e of [...starts, ...ends]) e.destroy();
          }
          stage = "comparison";
          let mismatched = 0;
          for (let s = 0; s < R; s++) {
            const a = fusedInputs[s]!.out.toHost() as Uint16Array;
            const b = hostInputs[s]!.out.toHost() as Uint16Array;
            mismatched += countMismatched(a, b);
          }
          for (const m of measurements) {
            const t = summarizeSamples(m.samples);
            rows.push({
              ...epRow(model, {
                impl: m.impl,
                usMedian: t.usMedian,
                usMin: t.usMin,
                usMax: t.usMax,
                ...(m.impl === "fused-ep" ? { gpuUsMedian: median(m.gpu), mismatched, compared: n * H } : {}),
              }),
              gpus: gpuList.length,
            });
          }
        } catch (e) {
          if (stage !== "fused-ep") throw e;
          // The in-kernel path failed (a watchdog gave up, a trap): the context is gone; keep what stands.
          failed = true;
          const message = (e instanceof Error ? e.message : String(e)).split("\n")[0] ?? "";
          rows.push({
            ...epRow(model, { impl: "fused-ep", usMedian: Number.NaN, usMin: Number.NaN, usMax: Number.NaN }),
            gpus: gpuList.length,
            error: message,
          });
          return rows;
        } finally {
          if (!failed) for (const t of owned) t.dispose();
        }
        o.onProgress?.(++done, total);
      }
    } finally {
      if (!failed) {
        fused?.dispose();
        host?.dispose();
      }
    }
  }
  return rows;
}
