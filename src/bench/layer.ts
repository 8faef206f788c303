/**
 * The layer benchmark: one MoE forward per token count, timed on the GPU, beside its physical floor.
 *
 * Floor = max(bytes / copy bandwidth, FLOPs / FP8 rate). Bytes: the FP8 weights and scales of every
 * expert the routing touches (each read at least once), the shared expert's when on, the bf16 input
 * and output. FLOPs: 2 per multiply-add of L1 (2·IH × H) and L2 (H × IH) for every routed row, and
 * of the shared expert for every token.
 */
import { type MoEConfig, QUANT_BLOCK, resolveConfig, sharedIntermediate } from "../config/config.js";
import { type Device, DeviceTensor, type ResultRow, timeKernel } from "../cuda/index.js";
import { UnfusedPipeline } from "../pipeline/unfused.js";
import { type Routing, randomRouting } from "../reference/router.js";
import { DeviceMoEWeights } from "../weights/device.js";
import { generateActivations } from "../weights/generate.js";

export const DEFAULT_FP8_TFLOPS = 1500;

export interface LayerFloor {
  bytes: number;
  flops: number;
  expertsTouched: number;
  floorUs: number;
}

/** Bytes of one expert MLP's FP8 weights and fp32 block scales at intermediate size `inter`. */
export function expertWeightBytes(hidden: number, inter: number): number {
  const elements = 3 * inter * hidden;
  return elements + (elements / QUANT_BLOCK ** 2) * 4;
}

export function layerFloor(
  config: MoEConfig,
  tokens: number,
  routing: Routing,
  shared: boolean,
  copyTbps: number,
  fp8Tflops = DEFAULT_FP8_TFLOPS,
): LayerFloor {
  const H = config.hidden;
  const touched = new Set<number>();
  let rows = 0;
  for (let i = 0; i < tokens * config.topK; i++) {
    const e = routing.ids[i];
    if (e >= 0) {
      touched.add(e);
      rows++;
    }
  }
  const useShared = shared && config.numShared > 0;
  const SI = sharedIntermediate(config);
  const bytes =
    touched.size * expertWeightBytes(H, config.intermediate) +
    (useShared ? expertWeightBytes(H, SI) : 0) +
    2 * tokens * H * 2;
  const flops = 2 * rows * 3 * config.intermediate * H + (useShared ? 2 * tokens * 3 * SI * H : 0);
  const floorUs = Math.max(bytes / (copyTbps * 1e12), flops / (fp8Tflops * 1e12)) * 1e6;
  return { bytes, flops, expertsTouched: touched.size, floorUs };
}

export interface LayerBenchOptions {
  shape: string;
  tokens: number[];
  shared: boolean;
  seed: number;
  copyTbps: number;
  fp8Tflops?: number;
  iters?: number;
  graph?: boolean;
  onProgress?: (done: number, total: number) => void;
}

/**
 * Keeps the GPU busy for a few hundred milliseconds before the first measurement: an idle H200 sits at
 * a low clock (345 MHz seen), and the first case of a sweep would otherwise pay for the ramp.
 */
function warmUp(
  device: Device,
  pipeline: UnfusedPipeline,
  config: MoEConfig,
  tokens: number,
  shared: boolean,
) {
  const routing = randomRouting(1, tokens, config);
  const x = DeviceTensor.empty(device, "bf16", [tokens, config.hidden]);
  const ids = DeviceTensor.fromHost(device, "int32", [tokens, config.topK], routing.ids);
  const w = DeviceTensor.fromHost(device, "fp32", [tokens, config.topK], routing.weights);
  const out = DeviceTensor.empty(device, "bf16", [tokens, config.hidden]);
  try {
    x.fill(0x3c); // bf16 0x3c3c ≈ 0.0115: finite and nonzero
    const start = performance.now();
    while (performance.now() - start < 300) {
      pipeline.forward({ x, ids, weights: w, out, tokens, shared }, null);
      device.synchronize();
    }
  } finally {
    for (const t of [x, ids, w, out]) t.dispose();
  }
}

/** Times the unfused pipeline at every token count (L2 flushed before each run). */
export function benchmarkUnfusedLayer(device: Device, o: LayerBenchOptions): ResultRow[] {
  const maxTokens = Math.max(...o.tokens);
  const config = resolveConfig(o.shape, { maxTokens: Math.max(maxTokens, resolveConfig(o.shape).maxTokens) });
  // Made on the device, bit for bit what GeneratedWeights would give (a flash layer is 6.4 GB of FP8).
  const weights = DeviceMoEWeights.generate(device, config, o.seed);
  const pipeline = new UnfusedPipeline(device, weights, maxTokens);
  const rows: ResultRow[] = [];
  try {
    warmUp(device, pipeline, config, maxTokens, o.shared);
    o.tokens.forEach((tokens, i) => {
      const routing = randomRouting(o.seed + tokens, tokens, config);
      const x = DeviceTensor.fromHost(
        device,
        "bf16",
        [tokens, config.hidden],
        generateActivations(o.seed, tokens, config.hidden),
      );
      const ids = DeviceTensor.fromHost(device, "int32", [tokens, config.topK], routing.ids);
      const w = DeviceTensor.fromHost(device, "fp32", [tokens, config.topK], routing.weights);
      const out = DeviceTensor.empty(device, "bf16", [tokens, config.hidden]);
      try {
        const run = (s: Parameters<Parameters<typeof timeKernel>[1]>[0]) =>
          pipeline.forward({ x, ids, weights: w, out, tokens, shared: o.shared }, s);
        const t = timeKernel(device, run, { warmup: 5, iters: o.iters ?? 30, graph: o.graph ?? false });
        const f = layerFloor(config, tokens, routing, o.shared, o.copyTbps, o.fp8Tflops);
        rows.push({
          config: config.name,
          tokens,
          shared: o.shared,
          impl: "unfused",
          us_median: t.usMedian,
          us_min: t.usMin,
          us_max: t.usMax,
          floor_us: f.floorUs,
          tflops: f.flops / (t.usMedian * 1e6),
          tbps: f.bytes / (t.usMedian * 1e6),
          experts_touched: f.expertsTouched,
          graph: o.graph ?? false,
        });
      } finally {
        for (const tensor of [x, ids, w, out]) tensor.dispose();
      }
      o.onProgress?.(i + 1, o.tokens.length);
    });
  } finally {
    pipeline.dispose();
    weights.dispose();
  }
  return rows;
}
