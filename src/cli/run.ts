/**
 * `megamoe run`: one layer forward on seeded random data, with a summary a person or a script reads.
 * With `--ranks R` the layer is split across R expert-parallel ranks, the batch dealt out among them.
 */
import path from "node:path";
import pc from "picocolors";
import {
  EXPERT_FORMATS,
  type ExpertFormat,
  expertFormatOf,
  type MoEConfig,
  resolveConfigForTokens,
  type ValidatedConfig,
} from "../config/config.js";
import { cudaAvailability, makeDirectory } from "../cuda/index.js";
import { DeviceMoEWeights } from "../kernels/device-weights.js";
import { fusedExpandImageBytes } from "../kernels/megamoe/megamoe.variants.js";
import { fusedExpandFromTokens } from "../kernels/megamoe/plan.js";
import { type Backend, type GpuPipelineKind, MoELayer } from "../layer.js";
import { bf16BitsToF32 } from "../numerics/bf16.js";
import {
  ExpertParallelMoE,
  type ExpertParallelStats,
  joinRankOutputs,
  splitAmongRanks,
} from "../parallel/expert-parallel.js";
import { checksum, l2Norm } from "../reference/metrics.js";
import { checkFiniteOutput, type Routing } from "../reference/moe.js";
import { randomRouting, routeTokens } from "../reference/router.js";
import { GeneratedWeights, generateActivations } from "../weights/generate.js";
import { loadMoEWeights, saveMoEWeights } from "../weights/moe-file.js";
import type { Fp4Exactness, MoEWeightSource } from "../weights/types.js";
import { checkpointLayer, describeFp4Exactness, hashRouting } from "./checkpoint.js";
import { cudaReasonText, shortCudaReason } from "./gpu-reason.js";
import { progressBar } from "./progress.js";
import { checkInputFile, checkOutputFile, UsageError } from "./usage.js";

export interface RunOptions {
  shape: string;
  tokens: number;
  backend: string;
  /** GPU pipeline: "fused" or "unfused" (default: the layer's). */
  pipeline?: string;
  seed: number;
  shared: boolean;
  routing: string;
  weights?: string;
  saveWeights?: string;
  /** Overwrite an existing --save-weights file. */
  force?: boolean;
  /** A DeepSeek-V4 checkpoint directory (or one .safetensors file): its layer `layer` instead of --shape. */
  checkpoint?: string;
  /** With checkpoint: the layer ("3", "layers.3" or "mtp.0"). */
  layer?: string;
  /** Expert-parallel ranks (1: one layer). */
  ranks?: number;
  /** Routed experts' format, "fp8" or "fp4" (a config override; default the shape's or checkpoint's). */
  experts?: string;
  /** --shape was given, not defaulted (refused with --checkpoint, whose layer has its own shape). */
  shapeGiven?: boolean;
  json?: boolean;
  /** Without a GPU, say every folder searched for the CUDA driver. */
  verbose?: boolean;
}

/** --experts checked: undefined (the shape's or the checkpoint's own format), "fp8" or "fp4". */
export function expertsFormat(name: string | undefined): ExpertFormat | undefined {
  if (name === undefined || (EXPERT_FORMATS as readonly string[]).includes(name)) {
    return name as ExpertFormat | undefined;
  }
  throw new UsageError(`--experts ${name}: expected fp4 or fp8`);
}

/** The --shape preset sized for `tokens`, with --experts applied when given. */
export function shapeConfig(shape: string, tokens: number, experts: string | undefined): ValidatedConfig {
  const format = expertsFormat(experts);
  return resolveConfigForTokens(shape, tokens, format === undefined ? {} : { expertFormat: format });
}

/**
 * A checkpoint's layer keeps its experts' format: --experts, when given, must name it (converting a
 * checkpoint's experts is `mxfp4ToFp8Blocks`' job, not a flag's).
 */
export function checkCheckpointExperts(experts: string | undefined, config: MoEConfig): void {
  const format = expertsFormat(experts);
  if (format !== undefined && format !== expertFormatOf(config)) {
    throw new UsageError(
      `--experts ${format}: the checkpoint's layer holds ${expertFormatOf(config)} experts, and a checkpoint's experts keep their format (--experts applies to --shape)`,
    );
  }
}

/**
 * How a layer's weights are described: the routed experts' format and the device memory of one whole
 * layer (DeviceMoEWeights.bytesFor), e.g. "fp4 routed experts (MXFP4), shared fp8; 3.42 GB on a GPU";
 * with FP4 experts that the fused kernel expands at some T ≤ maxTokens, the images' bytes too.
 */
export function describeLayerWeights(config: MoEConfig): string {
  const format = expertFormatOf(config);
  const shared = config.numShared > 0 ? ", shared fp8" : "";
  const bytes = formatBytes(DeviceMoEWeights.bytesFor(config));
  const from = fusedExpandFromTokens(config, config.maxTokens);
  const expand =
    from === null ? "" : ` (+ ${formatBytes(fusedExpandImageBytes(config))} of e4m3 stages from T = ${from})`;
  return `${format} routed experts${format === "fp4" ? " (MXFP4)" : ""}${shared}; ${bytes} on a GPU${expand}`;
}

/** Decimal bytes for a person: "6.44 GB", "25.2 MB", "520 kB". */
export function formatBytes(bytes: number): string {
  if (bytes >= 1e9) return `${(bytes / 1e9).toFixed(2)} GB`;
  if (bytes >= 1e6) return `${(bytes / 1e6).toFixed(1)} MB`;
  return `${Math.round(bytes / 1e3)} kB`;
}

/** --shape and --checkpoint both given: refused, as the checkpoint's layer would run and --shape be ignored. */
export function checkShapeWithCheckpoint(opts: {
  shape?: string;
  checkpoint?: string;
  shapeGiven?: boolean;
}): void {
  if (opts.checkpoint !== undefined && opts.shapeGiven === true) {
    throw new UsageError(
      `--checkpoint takes the place of --shape (the layer's shape is the checkpoint's): give one, not --shape ${opts.shape}`,
    );
  }
}

/** --pipeline checked: undefined (the layer's default), "fused" or "unfused". */
export function gpuPipeline(name: string | undefined): GpuPipelineKind | undefined {
  if (name === undefined || name === "fused" || name === "unfused") return name;
  throw new UsageError(`--pipeline ${name}: expected fused or unfused`);
}

export function makeWeights(config: MoEConfig, seed: number, file?: string): MoEWeightSource {
  if (file === undefined) return new GeneratedWeights(config, seed);
  checkInputFile("--weights", file);
  return loadMoEWeights(file, config);
}

/** --routing checked: "gate" or "random". */
function routingKind(kind: string): "gate" | "random" {
  if (kind === "gate" || kind === "random") return kind;
  throw new UsageError(`--routing must be "gate" or "random", got "${kind}"`);
}

export function makeRouting(kind: string, seed: number, tokens: number, config: MoEConfig) {
  if (routingKind(kind) === "gate") return undefined;
  return randomRouting(seed, tokens, config) as Routing;
}

/**
 * The backend --backend names. "auto": the GPU when CUDA is usable, else the CPU reference, with `note`
 * saying why in one line (the folders searched only with `verbose`), for the caller to print once every
 * value is checked, so a usage error comes first; "cuda" without a usable GPU is an error saying why.
 */
export function chooseBackend(name: string, verbose?: boolean): { backend: Backend; note?: string } {
  if (name === "cpu") return { backend: name };
  if (name !== "auto" && name !== "cuda")
    throw new UsageError(`--backend ${name}: expected auto, cpu or cuda`);
  const cuda = cudaAvailability();
  if (cuda.ok) return { backend: "cuda" };
  const hint = "--verbose or megamoe info: where it looked";
  if (name === "cuda")
    throw new UsageError(`--backend cuda needs a CUDA GPU: ${cudaReasonText(cuda.reason, verbose, hint)}`);
  const short = shortCudaReason(cuda.reason);
  const note =
    verbose === true || short === cuda.reason
      ? `megamoe: no GPU: ${cuda.reason}; running on the CPU\n`
      : `megamoe: ${short}; running on the CPU (${hint})\n`;
  return { backend: "cpu", note };
}

/** --pipeline picks a GPU pipeline: refused when the layer runs on the CPU, where it would be ignored. */
export function checkPipelineFor(
  backend: Backend,
  pipeline: string | undefined,
): GpuPipelineKind | undefined {
  const kind = gpuPipeline(pipeline);
  if (kind !== undefined && backend !== "cuda") {
    throw new UsageError(
      `--pipeline ${kind}: the pipeline applies to the "cuda" backend, and this runs on the cpu`,
    );
  }
  return kind;
}

export async function runLayer(opts: RunOptions): Promise<void> {
  // Every value first, then the machine: a typo is reported before a "no GPU" note or any work.
  expertsFormat(opts.experts);
  if (opts.layer !== undefined && opts.checkpoint === undefined)
    throw new UsageError("--layer needs --checkpoint");
  if (opts.checkpoint !== undefined && (opts.weights !== undefined || opts.saveWeights !== undefined)) {
    throw new UsageError("--checkpoint takes the place of --weights and --save-weights: give one");
  }
  checkShapeWithCheckpoint(opts);
  const shape =
    opts.checkpoint === undefined ? shapeConfig(opts.shape, opts.tokens, opts.experts) : undefined;
  routingKind(opts.routing);
  gpuPipeline(opts.pipeline);
  if (opts.weights !== undefined) checkInputFile("--weights", opts.weights);
  if (opts.force === true && opts.saveWeights === undefined)
    throw new UsageError("--force applies to --save-weights: give the file to overwrite");
  if (opts.saveWeights !== undefined) checkOutputFile("--save-weights", opts.saveWeights, opts.force);
  const { backend, note } = chooseBackend(opts.backend, opts.verbose);
  const pipeline = checkPipelineFor(backend, opts.pipeline);
  if (note !== undefined) process.stderr.write(note);
  let weights =
    shape !== undefined
      ? makeWeights(shape, opts.seed, opts.weights)
      : checkpointLayer(opts.checkpoint as string, opts.layer, opts.tokens);
  const config = weights.config;
  if (opts.checkpoint !== undefined) checkCheckpointExperts(opts.experts, config);
  if (opts.saveWeights !== undefined) {
    // Folders are created, as for bench's --out and plot's --out.
    makeDirectory(path.dirname(path.resolve(opts.saveWeights)));
    const bar = progressBar("saving weights");
    try {
      saveMoEWeights(opts.saveWeights, weights, {
        onProgress: (d, t) => bar.update(d, t),
        overwrite: opts.force === true,
      });
    } finally {
      bar.stop();
    }
    weights = loadMoEWeights(opts.saveWeights, config);
  }
  const x = generateActivations(opts.seed, opts.tokens, config.hidden);
  // Hash-routed layers (V4's first layers) route the seed's token ids through their tid2eid table.
  const hashed = opts.routing === "gate" ? hashRouting(weights, x, opts.tokens, opts.seed) : undefined;
  const routing = hashed?.routing ?? makeRouting(opts.routing, opts.seed, opts.tokens, config);
  const ranks = opts.ranks ?? 1;
  let result: { out: Uint16Array; routing: Routing };
  let ms: number;
  let moved: ExpertParallelStats | null = null;
  let exactness: Fp4Exactness | null = null;
  if (ranks > 1) {
    // The ranks take the batch in contiguous runs, routed over every expert (by the gate on the CPU).
    const r = routing ?? routeTokens(x, opts.tokens, weights.gate(), config);
    const ep = new ExpertParallelMoE(weights, { ranks, backend, pipeline });
    const bar = progressBar(`${config.name} T=${opts.tokens} on ${ranks} ranks`);
    try {
      const start = performance.now();
      const step = ep.forward(splitAmongRanks(x, opts.tokens, r, config.hidden, config.topK, ranks), {
        shared: opts.shared,
        onProgress: (d, t) => bar.update(d, t),
      });
      ms = performance.now() - start;
      result = { out: joinRankOutputs(step.out), routing: { ids: r.ids, weights: r.weights } };
      moved = step.stats;
    } finally {
      bar.stop();
      ep.dispose();
    }
  } else {
    const layer = new MoELayer(weights, { backend, pipeline });
    const bar = progressBar(`${config.name} T=${opts.tokens} experts`);
    try {
      const start = performance.now();
      result = layer.forward(x, opts.tokens, {
        routing,
        shared: opts.shared,
        onProgress: (d, t) => bar.update(d, t),
      });
      ms = performance.now() - start; // on the GPU: the first call, JIT compile included
      exactness = layer.fp4Exactness;
    } finally {
      bar.stop();
      layer.dispose();
    }
  }

  // The GPU writes what fp32 gives: an overflow is an error here, never a norm of Infinity with exit 0.
  checkFiniteOutput(
    result.out,
    config.hidden,
    `the ${backend} layer's output${ranks > 1 ? ` (${ranks} ranks)` : ""}`,
  );
  const values = Float32Array.from(result.out, bf16BitsToF32);
  const experts = new Set(Array.from(result.routing.ids).filter((e) => e >= 0)).size;
  const summary = {
    shape: config.name,
    expertFormat: expertFormatOf(config),
    deviceWeightBytes: DeviceMoEWeights.bytesFor(config),
    ...(opts.checkpoint === undefined
      ? {}
      : {
          checkpoint: opts.checkpoint,
          layerRouting: config.router.hashRouted === true ? "hash" : "score",
        }),
    experts: config.numExperts,
    hidden: config.hidden,
    intermediate: config.intermediate,
    topK: config.topK,
    shared: opts.shared && config.numShared > 0,
    tokens: opts.tokens,
    backend,
    seed: opts.seed,
    routing: opts.routing,
    expertsTouched: experts,
    ranks,
    ...(moved === null ? {} : { rowsReceived: moved.received, rowsSent: moved.sent }),
    ...(exactness === null ? {} : { fp4Elements: exactness.elements, fp4Inexact: exactness.inexact }),
    ms: Number(ms.toFixed(1)),
    checksum: checksum(result.out),
    norm: Number(l2Norm(values).toPrecision(8)),
  };
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(summary)}\n`);
    return;
  }
  const line = (k: string, v: string | number | boolean) => `  ${pc.dim(k.padEnd(12))} ${v}\n`;
  process.stdout.write(`${pc.bold("megamoe run")}\n`);
  process.stdout.write(
    line(
      "shape",
      `${config.name}: E=${config.numExperts} H=${config.hidden} IH=${config.intermediate} top-${config.topK}, shared ${summary.shared ? "on" : "off"}`,
    ),
  );
  if (opts.checkpoint !== undefined) {
    process.stdout.write(
      line(
        "checkpoint",
        `${opts.checkpoint}: ${summary.expertFormat} experts, ${summary.layerRouting}-routed`,
      ),
    );
  }
  process.stdout.write(line("weights", describeLayerWeights(config)));
  if (exactness !== null) {
    process.stdout.write(line("fp4 → e4m3", `${describeFp4Exactness(exactness)} (docs/numerics.md)`));
  }
  process.stdout.write(line("tokens", opts.tokens));
  process.stdout.write(line("backend", `${backend} (routing: ${opts.routing}, seed ${opts.seed})`));
  process.stdout.write(line("experts", `${experts} of ${config.numExperts} touched`));
  if (moved !== null) {
    process.stdout.write(
      line(
        "ranks",
        `${ranks}, ${config.numExperts / ranks} experts each; rows received ${moved.received.join(" ")}`,
      ),
    );
    process.stdout.write(line("", `rows sent to other ranks ${moved.sent.join(" ")}`));
  }
  process.stdout.write(line("time", `${summary.ms} ms`));
  process.stdout.write(line("checksum", summary.checksum));
  process.stdout.write(line("norm", summary.norm));
}
