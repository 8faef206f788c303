/**
 * CPU references for the GPU layer checks at sizes the CPU cannot run whole: for each case, the FP8
 * reference and the FP64 ideal of a sample of tokens (tokens are independent, so a sample of the
 * batch is checked exactly). The GPU side regenerates the same weights, inputs and routing from the
 * seeds (counter-based generators), runs the whole batch, and compares the sampled rows.
 *
 *   node --import tsx scripts/make-layer-fixtures.ts --out .fixtures --seed 123 \
 *     --case flash:1,7,64,129,1024,4096 --case pro:1,7 --sample 6
 */
import fs from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { resolveConfig } from "../src/config/config.js";
import { idealMoE, referenceMoE } from "../src/reference/moe.js";
import { randomRouting } from "../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../src/weights/generate.js";

export interface LayerFixture {
  shape: string;
  tokens: number;
  seed: number;
  shared: boolean;
  /** The sampled token indices, ascending. */
  sample: number[];
  /** bf16 bits [sample, H] of the FP8 reference. */
  reference: number[];
  /** FP64 ideal [sample, H]. */
  ideal: number[];
}

/** Seeds of one case: weights, activations and routing each get their own stream. */
export function caseSeeds(seed: number) {
  return { weights: seed, input: seed + 1, routing: seed + 2 };
}

function sampleTokens(tokens: number, count: number, seed: number): number[] {
  if (tokens <= count) return Array.from({ length: tokens }, (_, t) => t);
  const picked = new Set<number>([0, tokens - 1]);
  let s = seed >>> 0;
  while (picked.size < count) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    picked.add(s % tokens);
  }
  return [...picked].sort((a, b) => a - b);
}

function main() {
  const { values } = parseArgs({
    options: {
      out: { type: "string", default: ".fixtures" },
      seed: { type: "string", default: String(Date.now() % 2 ** 31) },
      case: { type: "string", multiple: true, default: ["tiny:1,7,64"] },
      sample: { type: "string", default: "6" },
      shared: { type: "string", default: "1" },
    },
  });
  const seed = Number(values.seed);
  const shared = values.shared === "1";
  const sampleCount = Number(values.sample);
  fs.mkdirSync(values.out, { recursive: true });
  console.log(`fixtures: seed ${seed}, shared ${shared}, sample ${sampleCount}, into ${values.out}`);
  for (const spec of values.case) {
    const [shape, list] = spec.split(":");
    for (const tokens of list.split(",").map(Number)) {
      const config = resolveConfig(shape, { maxTokens: Math.max(8192, tokens) });
      const seeds = caseSeeds(seed);
      const weights = new GeneratedWeights(config, seeds.weights, { cachedExperts: 2 });
      const x = generateActivations(seeds.input, tokens, config.hidden);
      const routing = randomRouting(seeds.routing, tokens, config);
      const sample = sampleTokens(tokens, sampleCount, seed + tokens);
      const H = config.hidden;
      const k = config.topK;
      const xs = new Uint16Array(sample.length * H);
      const ids = new Int32Array(sample.length * k);
      const ws = new Float32Array(sample.length * k);
      sample.forEach((t, i) => {
        xs.set(x.subarray(t * H, (t + 1) * H), i * H);
        ids.set(routing.ids.subarray(t * k, (t + 1) * k), i * k);
        ws.set(routing.weights.subarray(t * k, (t + 1) * k), i * k);
      });
      const t0 = performance.now();
      const sub = { ids, weights: ws };
      const reference = referenceMoE(xs, sample.length, sub, weights, { shared });
      const ideal = idealMoE(xs, sample.length, sub, weights, { shared });
      const fixture: LayerFixture = {
        shape,
        tokens,
        seed,
        shared,
        sample,
        reference: Array.from(reference),
        ideal: Array.from(ideal),
      };
      const file = path.join(values.out, `${shape}-T${tokens}-shared${shared ? 1 : 0}.json`);
      fs.writeFileSync(file, JSON.stringify(fixture));
      console.log(
        `${file}: ${sample.length} tokens sampled, ${((performance.now() - t0) / 1000).toFixed(1)} s`,
      );
    }
  }
}

if (process.argv[1] && path.resolve(process.argv[1]).endsWith("make-layer-fixtures.ts")) main();
