/**
 * `megamoe check`: the FP8 reference against the FP64 ideal (what FP8 costs) and, when a GPU is used,
 * the GPU layer against both (what the GPU's accumulation order costs on top). With `--ranks R`, also
 * the layer split across R expert-parallel ranks (the batch's tokens dealt out in contiguous runs)
 * against the one-device reference, on the CPU and, with a GPU, with every rank on it.
 *
 * Each comparison is judged by the bounds the GPU tests assert (src/reference/error-bounds.ts): pass or
 * FAIL per line, a verdict, and exit code 2 when a bound is broken. Without a GPU only the CPU side is
 * judged, and the output says so and why.
 */
import pc from "picocolors";
import { expertFormatOf } from "../config/config.js";
import { cudaAvailability } from "../cuda/index.js";
import { MoELayer } from "../layer.js";
import { bf16BitsToF32 } from "../numerics/bf16.js";
import { ExpertParallelMoE, joinRankOutputs, splitAmongRanks } from "../parallel/expert-parallel.js";
import {
  boundsFp8VsIdeal,
  boundsVsIdeal,
  boundsVsReference,
  compareOutputs,
  type ErrorBounds,
  type Verdict,
} from "../reference/error-bounds.js";
import { relativeError } from "../reference/metrics.js";
import { checkFiniteOutput, idealMoE, referenceMoE } from "../reference/moe.js";
import { routeTokens } from "../reference/router.js";
import { generateActivations } from "../weights/generate.js";
import { checkpointLayer, hashRouting } from "./checkpoint.js";
import { shortCudaReason } from "./gpu-reason.js";
import { progressBar } from "./progress.js";
import {
  checkCheckpointExperts,
  checkPipelineFor,
  checkShapeWithCheckpoint,
  chooseBackend,
  describeLayerWeights,
  expertsFormat,
  gpuPipeline,
  makeWeights,
  shapeConfig,
} from "./run.js";
import { UsageError } from "./usage.js";

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
  /** --shape was given, not defaulted (refused with --checkpoint). */
  shapeGiven?: boolean;
  json?: boolean;
  /** Without a GPU, say every folder searched for the CUDA driver. */
  verbose?: boolean;
}

/** A comparison with its bounds (the GPU tests' policy, src/reference/error-bounds.ts) and verdict. */
export interface Comparison extends Verdict {
  comparison: string;
}

function compare(name: string, a: ArrayLike<number>, b: ArrayLike<number>, bounds: ErrorBounds): Comparison {
  return { comparison: name, ...compareOutputs(a, b, bounds) };
}

/** The exit code of a check whose comparisons broke a bound (1 is a usage or run error). */
export const CHECK_FAILED_EXIT_CODE = 2;

/** Why no GPU comparison ran: the CPU was asked for, or CUDA is unavailable (the short reason). */
function noGpuReason(requested: string): string {
  if (requested === "cpu") return "--backend cpu";
  const cuda = cudaAvailability();
  if (cuda.ok) return "--backend cpu";
  const short = shortCudaReason(cuda.reason);
  return short === cuda.reason ? `no GPU: ${short}` : short;
}

/** `≤ 1.00e-2` for a bound, `–` where a figure is not bounded. */
function boundText(max: number | undefined): string {
  return max === undefined ? "–" : `≤ ${max.toExponential(2)}`;
}

export async function runCheck(opts: CheckOptions): Promise<void> {
  // Every value first, then the machine: a typo is reported before a "no GPU" note or any work.
  expertsFormat(opts.experts);
  if (opts.layer !== undefined && opts.checkpoint === undefined)
    throw new UsageError("--layer needs --checkpoint");
  checkShapeWithCheckpoint(opts);
  const shape =
    opts.checkpoint === undefined ? shapeConfig(opts.shape, opts.tokens, opts.experts) : undefined;
  gpuPipeline(opts.pipeline);
  const { backend, note } = chooseBackend(opts.backend, opts.verbose);
  const pipeline = checkPipelineFor(backend, opts.pipeline);
  if (note !== undefined) process.stderr.write(note);
  const weights =
    shape !== undefined
      ? makeWeights(shape, opts.seed)
      : checkpointLayer(opts.checkpoint as string, opts.layer, opts.tokens);
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
  // What FP8 costs: also the scale of the bounds on everything with the reference's numerics.
  const refRelIdeal = relativeError(refValues, ideal);
  const nearRef = boundsVsReference(opts.tokens, refRelIdeal);
  const comparisons = [compare("reference(fp8) vs ideal(fp64)", refValues, ideal, boundsFp8VsIdeal())];
  if (backend === "cuda") {
    const layer = new MoELayer(weights, { backend: "cuda", pipeline });
    try {
      const out = layer.forward(x, opts.tokens, { routing, shared: opts.shared }).out;
      checkFiniteOutput(out, config.hidden, "the cuda layer's output");
      const gpu = Float64Array.from(out, bf16BitsToF32);
      comparisons.push(
        compare("cuda vs reference(fp8)", gpu, refValues, nearRef),
        compare("cuda vs ideal(fp64)", gpu, ideal, boundsVsIdeal(refRelIdeal)),
      );
    } finally {
      layer.dispose();
    }
  }
  const ranks = opts.ranks ?? 1;
  if (ranks > 1) {
    const inputs = splitAmongRanks(x, opts.tokens, routing, config.hidden, config.topK, ranks);
    const joined = (outs: Uint16Array[], backend: string) => {
      const out = joinRankOutputs(outs);
      checkFiniteOutput(out, config.hidden, `the ${backend} layer's output (${ranks} ranks)`);
      return Float64Array.from(out, bf16BitsToF32);
    };
    const cpuEp = new ExpertParallelMoE(weights, { ranks });
    bar = progressBar(`${ranks} ranks (cpu)`);
    const cpuOut = joined(
      cpuEp.forward(inputs, { shared: opts.shared, onProgress: (d, t) => bar.update(d, t) }).out,
      "cpu",
    );
    bar.stop();
    comparisons.push(compare(`${ranks} ranks (cpu) vs reference(fp8)`, cpuOut, refValues, nearRef));
    if (backend === "cuda") {
      const gpuEp = new ExpertParallelMoE(weights, {
        ranks,
        backend: "cuda",
        pipeline,
      });
      try {
        const gpuOut = joined(gpuEp.forward(inputs, { shared: opts.shared }).out, "cuda");
        comparisons.push(
          compare(`${ranks} ranks (cuda) vs ${ranks} ranks (cpu)`, gpuOut, cpuOut, nearRef),
          compare(`${ranks} ranks (cuda) vs reference(fp8)`, gpuOut, refValues, nearRef),
        );
      } finally {
        gpuEp.dispose();
      }
    }
  }
  const failed = comparisons.filter((c) => !c.pass);
  const pass = failed.length === 0;
  // Without the GPU only the CPU side is judged: say so, so a pass is not read as the GPU's.
  const notChecked =
    backend === "cuda" ? undefined : `the GPU layer was not checked (${noGpuReason(opts.backend)})`;
  const result = {
    shape: config.name,
    tokens: opts.tokens,
    seed: opts.seed,
    shared: opts.shared,
    expertFormat: expertFormatOf(config),
    backend,
    ranks,
    comparisons,
    pass,
    ...(notChecked === undefined ? {} : { notChecked }),
  };
  if (!pass) process.exitCode = CHECK_FAILED_EXIT_CODE;
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(result)}\n`);
    return;
  }
  process.stdout.write(
    `${pc.bold("megamoe check")} ${config.name}, T=${opts.tokens}, seed ${opts.seed}, backend ${backend}${ranks > 1 ? `, ${ranks} expert-parallel ranks` : ""}\n`,
  );
  process.stdout.write(`  ${pc.dim("weights:")} ${describeLayerWeights(config)}\n`);
  const width = Math.max(...comparisons.map((c) => c.comparison.length));
  process.stdout.write(
    pc.dim(
      `  ${"".padEnd(width)}  ${"‖a − b‖/‖b‖".padEnd(11)} ${"bound".padEnd(10)}  ${"calc_diff".padEnd(10)}  ${"bound".padEnd(10)}\n`,
    ),
  );
  for (const c of comparisons) {
    process.stdout.write(
      `  ${c.comparison.padEnd(width)}  ${c.relError.toExponential(3).padEnd(11)} ${boundText(c.bounds.relError).padEnd(10)}  ${c.calcDiff.toExponential(3).padEnd(10)}  ${boundText(c.bounds.calcDiff).padEnd(10)}  ${c.pass ? pc.green("pass") : pc.red("FAIL")}\n`,
    );
  }
  for (const c of failed) {
    process.stdout.write(`  ${pc.red("FAIL")} ${c.comparison}: ${c.failures.join("; ")}\n`);
  }
  const verdict = pass
    ? pc.green(`pass: ${comparisons.length} of ${comparisons.length} comparisons within their bounds`)
    : pc.red(`FAIL: ${failed.length} of ${comparisons.length} comparisons outside their bounds`);
  process.stdout.write(`${verdict}\n`);
  if (notChecked !== undefined) process.stdout.write(`${pc.yellow("note:")} ${notChecked}\n`);
}
