/**
 * `megamoe check`: the FP8 reference against the FP64 ideal (what FP8 costs) and, when a GPU is used,
 * the GPU layer against both (what the GPU's accumulation order costs on top). With `--ranks R`, also
 * the layer split across R expert-parallel ranks (the batch's tokens dealt out in contiguous runs)
 * against the one-device reference, on the CPU and, with a GPU, with every rank on it.
 */
import pc from "picocolors";
import { expertFormatOf } from "../config/config.js";
import { MoELayer } from "../layer.js";
import { bf16BitsToF32 } from "../numerics/bf16.js";
import { ExpertParallelMoE, joinRankOutputs, splitAmongRanks } from "../parallel/expert-parallel.js";
import { calcDiff, relativeError } from "../reference/metrics.js";
import { idealMoE, referenceMoE } from "../reference/moe.js";
import { routeTokens } from "../reference/router.js";
import { generateActivations } from "../weights/generate.js";
import { checkpointLayer, hashRouting } from "./checkpoint.js";
import { progressBar } from "./progress.js";
import {
  checkCheckpointExperts,
  chooseBackend,
  describeLayerWeights,
  expertsFormat,
  gpuPipeline,
  makeWeights,
  shapeConfig,
} from "./run.js";

export interface CheckOptions {
  shape: string;
  tokens: number;
  seed: number;
  shared: boolean;
  backend: string;
  /** GPU pipeline: "fused" or "unfused" (default: the layer's). */
  pipeline?: string;
  /** A DeepSeek-V4 checkpoint (directory or file) whose layer `layer` is checked instead of --shape. */
  checkpoint?: string;
  layer?: string;
  /** Expert-parallel ranks to check as well (1: none). */
  ranks?: number;
  /** Routed experts' format, "fp8" or "fp4" (a config override; default the shape's or checkpoint's). */
  experts?: string;
  json?: boolean;
}

interface Comparison {
  comparison: string;
  relError: number;
  calcDiff: number;
}

function compare(name: string, a: ArrayLike<number>, b: ArrayLike<number>): Comparison {
  return { comparison: name, relError: relativeError(a, b), calcDiff: calcDiff(a, b) };
}

export async function runCheck(opts: CheckOptions): Promise<void> {
  const backend = chooseBackend(opts.backend);
  expertsFormat(opts.experts); // a bad --experts is named before any work
  if (opts.layer !== undefined && opts.checkpoint === undefined)
    throw new Error("--layer needs --checkpoint");
  const weights =
    opts.checkpoint === undefined
      ? makeWeights(shapeConfig(opts.shape, opts.tokens, opts.experts), opts.seed)
      : checkpointLayer(opts.checkpoint, opts.layer, opts.tokens);
  const config = weights.config;
  if (opts.checkpoint !== undefined) checkCheckpointExperts(opts.experts, config);
  const x = generateActivations(opts.seed, opts.tokens, config.hidden);
  const routing =
    hashRouting(weights, x, opts.tokens, opts.seed)?.routing ??
    (({ ids, weights: w }) => ({ ids, weights: w }))(routeTokens(x, opts.tokens, weights.gate(), config));

  let bar = progressBar("fp8 reference");
  const ref = referenceMoE(x, opts.tokens, routing, weights, {
    shared: opts.shared,
    onProgress: (d, t) => bar.update(d, t),
  });
  bar.stop();
  bar = progressBar("fp64 ideal");
  const ideal = idealMoE(x, opts.tokens, routing, weights, {
    shared: opts.shared,
    onProgress: (d, t) => bar.update(d, t),
  });
  bar.stop();

  const refValues = Float64Array.from(ref, bf16BitsToF32);
  const comparisons = [compare("reference(fp8) vs ideal(fp64)", refValues, ideal)];
  if (backend === "cuda") {
    const layer = new MoELayer(weights, { backend: "cuda", pipeline: gpuPipeline(opts.pipeline) });
    try {
      const gpu = Float64Array.from(
        layer.forward(x, opts.tokens, { routing, shared: opts.shared }).out,
        bf16BitsToF32,
      );
      comparisons.push(
        compare("cuda vs reference(fp8)", gpu, refValues),
        compare("cuda vs ideal(fp64)", gpu, ideal),
      );
    } finally {
      layer.dispose();
    }
  }
  const ranks = opts.ranks ?? 1;
  if (ranks > 1) {
    const inputs = splitAmongRanks(x, opts.tokens, routing, config.hidden, config.topK, ranks);
    const joined = (outs: Uint16Array[]) => Float64Array.from(joinRankOutputs(outs), bf16BitsToF32);
    const cpuEp = new ExpertParallelMoE(weights, { ranks });
    const cpuOut = joined(cpuEp.forward(inputs, { shared: opts.shared }).out);
    comparisons.push(compare(`${ranks} ranks (cpu) vs reference(fp8)`, cpuOut, refValues));
    if (backend === "cuda") {
      const gpuEp = new ExpertParallelMoE(weights, {
        ranks,
        backend: "cuda",
        pipeline: gpuPipeline(opts.pipeline),
      });
      try {
        const gpuOut = joined(gpuEp.forward(inputs, { shared: opts.shared }).out);
        comparisons.push(
          compare(`${ranks} ranks (cuda) vs ${ranks} ranks (cpu)`, gpuOut, cpuOut),
          compare(`${ranks} ranks (cuda) vs reference(fp8)`, gpuOut, refValues),
        );
      } finally {
        gpuEp.dispose();
      }
    }
  }
  const result = {
    shape: config.name,
    tokens: opts.tokens,
    seed: opts.seed,
    shared: opts.shared,
    expertFormat: expertFormatOf(config),
    backend,
    ranks,
    comparisons,
  };
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(result)}\n`);
    return;
  }
  process.stdout.write(
    `${pc.bold("megamoe check")} ${config.name}, T=${opts.tokens}, seed ${opts.seed}, backend ${backend}${ranks > 1 ? `, ${ranks} expert-parallel ranks` : ""}\n`,
  );
  process.stdout.write(`  ${pc.dim("weights".padEnd(36))} ${describeLayerWeights(config)}\n`);
  for (const c of comparisons) {
    process.stdout.write(
      `  ${c.comparison.padEnd(36)} ‖a − b‖/‖b‖ ${c.relError.toExponential(3)}   calc_diff ${c.calcDiff.toExponential(3)}\n`,
    );
  }
}
