/**
 * The decode-step benchmark: a stack of MoE blocks as a serving step runs them, captured as one CUDA
 * graph and replayed. Each block: the boundary RMSNorm of its input (src/kernels/norm) → the gate on the
 * normed bf16 rows (src/kernels/gate) → the fused MoE layer, whose output is the next block's input.
 * Two paths side by side, same weights and inputs:
 *
 *   step-fused     the norm also writes the FP8 rows and the gate the routing into the fused
 *                  pipeline's input buffer (prepareInput + the tag): no quantization pass
 *   step-prequant  the norm writes bf16 only, the gate into the caller's tensors, and the layer
 *                  quantizes (one more launch per block)
 *
 * Reported per step and per block: µs (median of graph replays, L2 flushed between them) and kernel
 * launches (counted, not assumed: `kernelLaunches()` over one eager step).
 */
import { type ExpertFormat, resolveConfigForTokens } from "../config/config.js";
import {
  type Device,
  DeviceTensor,
  kernelLaunches,
  type ResultRow,
  type Stream,
  timeKernel,
} from "../cuda/index.js";
import { DeviceMoEWeights, generateActivationsOnDevice } from "../kernels/device-weights.js";
import { routeOnDevice } from "../kernels/gate/gate.js";
import { rmsNormOnDevice } from "../kernels/norm/norm.js";
import { f32ToBf16Bits } from "../numerics/bf16.js";
import { tensorKey, uniformSym } from "../numerics/counter-rng.js";
import { FusedPipeline } from "../pipeline/fused.js";

export const DEFAULT_STEP_LAYERS = 8;
export const STEP_TOKENS = [8, 32, 128, 256];
const NORM_EPS = 1e-6;

export interface StepBenchOptions {
  shape: string;
  /** MoE blocks in the step (each with its own random weights). */
  layers: number;
  tokens: readonly number[];
  seed: number;
  /** The shape's routed experts in this format (default the preset's). */
  expertFormat?: ExpertFormat;
  /** Timed replays per case (default 30). */
  iters?: number;
  onProgress?: (done: number, total: number) => void;
}

interface Block {
  weights: DeviceMoEWeights;
  pipeline: FusedPipeline;
  norm: DeviceTensor;
}

/** RMSNorm weights near 1 (bf16 [H]), from the counter generator so every run has the same. */
function normWeights(device: Device, seed: number, hidden: number): DeviceTensor {
  const w = new Uint16Array(hidden);
  const key = tensorKey("bench.step.norm");
  for (let i = 0; i < hidden; i++) w[i] = f32ToBf16Bits(1 + 0.25 * uniformSym(seed, key, i));
  return DeviceTensor.fromHost(device, "bf16", [hidden], w);
}

/** Times both step paths for every token count; see the module doc. */
export function benchmarkDecodeStep(device: Device, o: StepBenchOptions): ResultRow[] {
  if (!Number.isInteger(o.layers) || o.layers < 1) {
    throw new RangeError(`layers must be a positive integer, got ${o.layers}`);
  }
  if (o.tokens.length === 0) throw new RangeError("benchmarkDecodeStep: no token counts");
  const maxTokens = Math.max(...o.tokens);
  const overrides = o.expertFormat === undefined ? {} : { expertFormat: o.expertFormat };
  const config = resolveConfigForTokens(o.shape, maxTokens, overrides);
  const H = config.hidden;
  const k = config.topK;
  const iters = o.iters ?? 30;
  const blocks: Block[] = [];
  const rows: ResultRow[] = [];
  try {
    for (let i = 0; i < o.layers; i++) {
      const weights = DeviceMoEWeights.generate(device, config, o.seed + i);
      try {
        blocks.push({
          weights,
          pipeline: new FusedPipeline(device, weights, maxTokens),
          norm: normWeights(device, o.seed + 1000 + i, H),
        });
      } catch (e) {
        weights.dispose();
        throw e;
      }
    }
    o.tokens.forEach((tokens, done) => {
      const owned: DeviceTensor[] = [];
      const alloc = (dtype: "bf16" | "int32" | "fp32", shape: number[]) => {
        const t = DeviceTensor.empty(device, dtype, shape);
        owned.push(t);
        return t;
      };
      try {
        const input = generateActivationsOnDevice(device, o.seed, tokens, H);
        owned.push(input);
        const outs = blocks.map(() => alloc("bf16", [tokens, H]));
        const y = alloc("bf16", [tokens, H]);
        const ids = alloc("int32", [tokens, k]);
        const routingWeights = alloc("fp32", [tokens, k]);
        const blockInput = (i: number) => (i === 0 ? input : outs[i - 1]!);

        const stepFused = (s: Stream) => {
          blocks.forEach((b, i) => {
            const p = b.pipeline.prepareInput(tokens);
            const fp8 = { q: p.xq, scales: p.xScales, format: config.scaleFormat };
            rmsNormOnDevice(device, { x: blockInput(i) }, b.norm, NORM_EPS, { y, fp8 }, s);
            b.pipeline.tag.markRows(p.ticket);
            routeOnDevice(device, y, gateOf(b), config, { ids: p.ids, weights: p.weights }, s);
            b.pipeline.tag.markRouting(p.ticket);
            const f = { x: y, ids: p.ids, weights: p.weights, out: outs[i]!, tokens, shared: true };
            if (b.pipeline.forward(f, s, p.ticket)) {
              throw new Error("step-fused: the prepared input was not used (the tag refused it)");
            }
          });
        };
        const stepPrequant = (s: Stream) => {
          blocks.forEach((b, i) => {
            rmsNormOnDevice(device, { x: blockInput(i) }, b.norm, NORM_EPS, { y, fp8: null }, s);
            routeOnDevice(device, y, gateOf(b), config, { ids, weights: routingWeights }, s);
            b.pipeline.forward(
              { x: y, ids, weights: routingWeights, out: outs[i]!, tokens, shared: true },
              s,
            );
          });
        };

        for (const [impl, step] of [
          ["step-fused", stepFused],
          ["step-prequant", stepPrequant],
        ] as const) {
          // One eager step: loads every kernel and sizes the gate's workspace (capture forbids both),
          // and counts the launches.
          const stream = device.createStream();
          let launches: number;
          try {
            const before = kernelLaunches();
            step(stream);
            launches = kernelLaunches() - before;
            stream.synchronize();
          } finally {
            stream.destroy();
          }
          for (const b of blocks) b.pipeline.checkStatus();
          const t = timeKernel(device, step, { warmup: 3, iters, graph: true });
          rows.push({
            config: config.name,
            tokens,
            shared: true,
            impl,
            layers: o.layers,
            us_median: t.usMedian,
            us_min: t.usMin,
            us_max: t.usMax,
            us_per_layer: t.usMedian / o.layers,
            launches_per_layer: launches / o.layers,
            floor_us: Number.NaN,
            tflops: Number.NaN,
            tbps: Number.NaN,
            graph: true,
          });
        }
      } finally {
        for (const t of owned) t.dispose();
      }
      o.onProgress?.(done + 1, o.tokens.length);
    });
  } finally {
    for (const b of blocks) {
      b.pipeline.dispose();
      b.weights.dispose();
      b.norm.dispose();
    }
  }
  return rows;
}

function gateOf(b: Block) {
  return { weight: b.weights.gateWeight, bias: b.weights.gateBias };
}
