/** `megamoe check`: the FP8 reference against the FP64 ideal; GPU backends join as they are built. */
import pc from "picocolors";
import { bf16BitsToF32 } from "../numerics/bf16.js";
import { calcDiff, relativeError } from "../reference/metrics.js";
import { idealMoE, referenceMoE } from "../reference/moe.js";
import { routeTokens } from "../reference/router.js";
import { generateActivations } from "../weights/generate.js";
import { progressBar } from "./progress.js";
import { makeWeights, runConfig } from "./run.js";

export interface CheckOptions {
  shape: string;
  tokens: number;
  seed: number;
  shared: boolean;
  json?: boolean;
}

export async function runCheck(opts: CheckOptions): Promise<void> {
  const config = runConfig(opts.shape, opts.tokens);
  const weights = makeWeights(config, opts.seed);
  const x = generateActivations(opts.seed, opts.tokens, config.hidden);
  const { ids, weights: w } = routeTokens(x, opts.tokens, weights.gate(), config);
  const routing = { ids, weights: w };

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
  const result = {
    shape: config.name,
    tokens: opts.tokens,
    seed: opts.seed,
    shared: opts.shared,
    comparison: "reference(fp8) vs ideal(fp64)",
    relError: relativeError(refValues, ideal),
    calcDiff: calcDiff(refValues, ideal),
  };
  if (opts.json) {
    process.stdout.write(`${JSON.stringify(result)}\n`);
    return;
  }
  process.stdout.write(`${pc.bold("megamoe check")} ${config.name}, T=${opts.tokens}, seed ${opts.seed}\n`);
  process.stdout.write(`  ${result.comparison}\n`);
  process.stdout.write(`  ‖ref − ideal‖/‖ideal‖  ${result.relError.toExponential(3)}\n`);
  process.stdout.write(`  calc_diff             ${result.calcDiff.toExponential(3)}\n`);
}
