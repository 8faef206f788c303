/**
 * The census of bad inputs to the public API (src/index.ts): each row is a call a new user might make,
 * with the error class and a fragment of the message it must raise, or "accepted" with the documented
 * reason and a check of what it then does. The describe titles carry the counts.
 */
import assert from "node:assert/strict";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, describe, it } from "node:test";
import {
  bf16BitsToF32,
  bf16FromF32Array,
  ConfigError,
  calcDiff,
  checksum,
  DeviceMoEWeights,
  DispatchError,
  decodeE4m3,
  dequantizeActivations,
  dequantizeWeightBlocks,
  ExpertParallelMoE,
  encodeE4m3,
  f32FromBf16Array,
  GeneratedWeights,
  generateActivations,
  groupByExpert,
  InputError,
  idealMoE,
  joinRankOutputs,
  l2Norm,
  loadMoEWeights,
  type MoEConfig,
  MoELayer,
  NumericsError,
  planDispatch,
  quantizeActivations,
  quantizeWeightBlocks,
  RankWeights,
  RouterError,
  randomRouting,
  referenceMoE,
  relativeError,
  resolveConfig,
  routeTokens,
  SafetensorsError,
  saveMoEWeights,
  sentRows,
  splitAmongRanks,
  validateConfig,
  validateRouting,
} from "../../src/index.js";
import { parseSeed } from "../../src/numerics/counter-rng.js";
import { readSafetensorsHeader } from "../../src/weights/safetensors.js";

type ErrorClass = new (...args: never[]) => Error;
type Row =
  | { call: string; run: () => unknown; error: ErrorClass; message: RegExp }
  | { call: string; run: () => unknown; accepted: string; check: (result: unknown) => void };

const tiny = resolveConfig("tiny");
const raw = (over: Record<string, unknown>): MoEConfig => ({ ...tiny, ...over }) as MoEConfig;
const T = 2;
const H = tiny.hidden;
const K = tiny.topK;
const weights = new GeneratedWeights(tiny, 1);
const layer = new MoELayer(weights);
const x = generateActivations(1, T, H);
const routing = randomRouting(1, T, tiny);
const disposed = new MoELayer(weights);
disposed.dispose();
const ep = new ExpertParallelMoE(weights, { ranks: 2 });
const rankInputs = () => splitAmongRanks(x, T, routing, H, K, 2);

const withRouting = (ids: unknown, w: unknown = routing.weights) =>
  layer.forward(x, T, { routing: { ids, weights: w } as never });
const badIds = (edit: (ids: Int32Array) => void) => {
  const ids = routing.ids.slice();
  edit(ids);
  return ids;
};
/** The tiny layer's weights with routed expert e (or the shared expert) replaced by what `edit` makes of it. */
const sourceWithExpert = (
  edit: (w: Record<string, unknown>) => unknown,
  which: "routed" | "shared" = "routed",
) => ({
  config: tiny,
  expert: (e: number) => (which === "routed" ? edit({ ...weights.expert(e) }) : weights.expert(e)),
  shared: () => (which === "shared" ? edit({ ...weights.shared()! }) : weights.shared()),
  gate: () => weights.gate(),
});
const forwardWith = (source: unknown) => new MoELayer(source as never).forward(x, T, { routing });
// The tiny layer with intermediate 256, and with FP4 experts: experts that do not fit the tiny layer.
const wide = new GeneratedWeights(resolveConfig("tiny", { intermediate: 256 }), 1);
const fp4Weights = new GeneratedWeights(resolveConfig("tiny", { expertFormat: "fp4" }), 1);
const sourceWith = (config: unknown) => ({
  config,
  expert: (e: number) => weights.expert(e),
  shared: () => weights.shared(),
  gate: () => weights.gate(),
});

// A checkpoint of the tiny layer with e4m3 NaN codes planted in expert 0's gate_proj and expert 1's up_proj.
const dir = fs.mkdtempSync(path.join(os.tmpdir(), "megamoe-bad-inputs-"));
after(() => fs.rmSync(dir, { recursive: true, force: true }));
const checkpoint = path.join(dir, "tiny.safetensors");
saveMoEWeights(checkpoint, weights);
const poisoned = path.join(dir, "poisoned.safetensors");
fs.copyFileSync(checkpoint, poisoned);
{
  const header = readSafetensorsHeader(poisoned);
  const fd = fs.openSync(poisoned, "r+");
  const plant = (name: string, index: number, code: number) => {
    const at = header.dataStart + header.tensors.get(name)!.begin + index;
    fs.writeSync(fd, new Uint8Array([code]), 0, 1, at);
  };
  plant("model.layers.0.mlp.experts.0.gate_proj.weight", 5, 0x7f);
  plant("model.layers.0.mlp.experts.1.up_proj.weight", 300, 0xff);
  fs.closeSync(fd);
}
const loaded = loadMoEWeights(poisoned, tiny);
const fp4File = path.join(dir, "tiny-fp4.safetensors");
saveMoEWeights(fp4File, fp4Weights);

const err = (call: string, run: () => unknown, error: ErrorClass, message: RegExp): Row => ({
  call,
  run,
  error,
  message,
});
const ok = (call: string, run: () => unknown, accepted: string, check: (r: unknown) => void): Row => ({
  call,
  run,
  accepted,
  check,
});

const rows: Row[] = [
  // Configs
  err(
    "validateConfig(null)",
    () => validateConfig(null as never),
    ConfigError,
    /must be an object, got null/,
  ),
  err(
    "validateConfig with hiddenSize",
    () => validateConfig(raw({ hiddenSize: 256 })),
    ConfigError,
    /unknown config field hiddenSize \(did you mean hidden\?\)/,
  ),
  err(
    'resolveConfig("tiny", { hiddenSize })',
    () => resolveConfig("tiny", { hiddenSize: 512 } as never),
    ConfigError,
    /unknown config field hiddenSize \(did you mean hidden\?\)/,
  ),
  err(
    "resolveConfig with router.scorng",
    () => resolveConfig("tiny", { router: { scorng: "softmax" } as never }),
    ConfigError,
    /unknown config field router\.scorng \(did you mean router\.scoring\?\)/,
  ),
  err('resolveConfig("toString")', () => resolveConfig("toString"), ConfigError, /unknown shape "toString"/),
  err(
    "resolveConfig(tiny, null)",
    () => resolveConfig("tiny", null as never),
    ConfigError,
    /overrides must be an object/,
  ),
  err(
    'router.correctionBias "yes"',
    () => validateConfig(raw({ router: { ...tiny.router, correctionBias: "yes" } })),
    ConfigError,
    /router\.correctionBias must be true or false, got the string "yes"/,
  ),
  err("name 5", () => validateConfig(raw({ name: 5 })), ConfigError, /name must be a string, got number 5/),
  err(
    'hidden "256"',
    () => validateConfig(raw({ hidden: "256" })),
    ConfigError,
    /hidden must be an integer .*got the string "256"/,
  ),
  err(
    "router null",
    () => validateConfig(raw({ router: null })),
    ConfigError,
    /router must be an object, got null/,
  ),
  err(
    "GeneratedWeights with hiddenSize",
    () => new GeneratedWeights(raw({ hiddenSize: 1 }), 1),
    ConfigError,
    /hiddenSize \(did you mean hidden\?\)/,
  ),
  err(
    "MoELayer on a source whose config has hiddenSize",
    () => new MoELayer(sourceWith(raw({ hiddenSize: 1 })) as never),
    ConfigError,
    /hiddenSize \(did you mean hidden\?\)/,
  ),
  err(
    "assigning to a validated config",
    () => {
      (tiny as { hidden: number }).hidden = 512;
    },
    TypeError,
    /read only property 'hidden'/,
  ),
  ok(
    "MoELayer on a source whose config is raw but valid",
    () => new MoELayer(sourceWith({ ...tiny }) as never).config,
    "constructors validate a raw config once",
    (c) => assert.deepEqual(c, tiny),
  ),

  // Seeds: one rule for the generators and the CLI
  err(
    "GeneratedWeights seed -1",
    () => new GeneratedWeights(tiny, -1),
    RangeError,
    /seed must be an integer in \[0, 4294967295\], got number -1/,
  ),
  err(
    "GeneratedWeights seed 2^32",
    () => new GeneratedWeights(tiny, 2 ** 32),
    RangeError,
    /seed must be an integer in/,
  ),
  err("GeneratedWeights seed 1.5", () => new GeneratedWeights(tiny, 1.5), RangeError, /got number 1\.5/),
  err(
    "generateActivations seed -1",
    () => generateActivations(-1, T, H),
    RangeError,
    /seed must be an integer in/,
  ),
  err("randomRouting seed -1", () => randomRouting(-1, T, tiny), RouterError, /seed must be an integer in/),
  err('CLI --seed "-1"', () => parseSeed("-1"), RangeError, /seed must be an integer in .*got "-1"/),
  err('CLI --seed "4294967296"', () => parseSeed("4294967296"), RangeError, /got number 4294967296/),
  err(
    "generateActivations tokens 2.5",
    () => generateActivations(1, 2.5, H),
    RangeError,
    /tokens and hidden/,
  ),
  err(
    "GeneratedWeights cachedExperts 0",
    () => new GeneratedWeights(tiny, 1, { cachedExperts: 0 }),
    RangeError,
    /cachedExperts/,
  ),
  err(
    "GeneratedWeights option cached",
    () => new GeneratedWeights(tiny, 1, { cached: 3 } as never),
    RangeError,
    /unknown GeneratedWeights options field cached \(did you mean cachedExperts\?\)/,
  ),
  err(
    "weights.expert(8)",
    () => weights.expert(8),
    RangeError,
    /expert index must be an integer in \[0, 8\), got number 8/,
  ),
  err("weights.expert(1.5)", () => weights.expert(1.5), RangeError, /got number 1\.5/),

  // MoELayer construction
  err(
    "new MoELayer(null)",
    () => new MoELayer(null as never),
    InputError,
    /weight source must be an object .*got null/,
  ),
  err(
    "new MoELayer({})",
    () => new MoELayer({} as never),
    InputError,
    /config must be an object, got undefined/,
  ),
  err(
    "MoELayer option backed",
    () => new MoELayer(weights, { backed: "cuda" } as never),
    InputError,
    /unknown MoELayer options field backed \(did you mean backend\?\)/,
  ),
  err(
    'backend "gpu"',
    () => new MoELayer(weights, { backend: "gpu" as never }),
    InputError,
    /unknown backend "gpu"/,
  ),
  err(
    "device on the cpu",
    () => new MoELayer(weights, { device: 1 }),
    InputError,
    /device applies to the "cuda" backend/,
  ),
  err(
    "pipeline on the cpu",
    () => new MoELayer(weights, { pipeline: "fused" }),
    InputError,
    /pipeline applies/,
  ),
  err(
    "cuda device -1",
    () => new MoELayer(weights, { backend: "cuda", device: -1 }),
    InputError,
    /GPU ordinal .*got -1/,
  ),
  err(
    'cuda device "0"',
    () => new MoELayer(weights, { backend: "cuda", device: "0" as never }),
    InputError,
    /got the string "0"/,
  ),
  err(
    "MoELayer options null",
    () => new MoELayer(weights, null as never),
    InputError,
    /options must be an object, got null/,
  ),

  // forward: routing
  err(
    "routing null",
    () => layer.forward(x, T, { routing: null as never }),
    InputError,
    /routing must be .*got null/,
  ),
  err(
    "routing {}",
    () => withRouting(undefined, undefined),
    RouterError,
    /routing ids must be an Int32Array, got undefined$/,
  ),
  err(
    "ids Float32Array holding 2.5",
    () => withRouting(Float32Array.from(routing.ids, (v, i) => (i === 0 ? 2.5 : v))),
    RouterError,
    /routing ids must be an Int32Array, got Float32Array/,
  ),
  err("ids Float64Array", () => withRouting(Float64Array.from(routing.ids)), RouterError, /got Float64Array/),
  err("ids Uint32Array", () => withRouting(Uint32Array.from(routing.ids)), RouterError, /got Uint32Array/),
  err("ids plain array with undefined", () => withRouting([undefined, 1, 2, 3]), RouterError, /got Array/),
  err("ids strings", () => withRouting(["0", "1", "2", "3"]), RouterError, /got Array/),
  err(
    "ids holding NaN (Float32Array)",
    () => withRouting(new Float32Array(T * K).fill(Number.NaN)),
    RouterError,
    /got Float32Array/,
  ),
  err(
    "weights Float64Array",
    () => withRouting(routing.ids, Float64Array.from(routing.weights)),
    RouterError,
    /routing weights must be a Float32Array, got Float64Array/,
  ),
  err(
    "weight NaN",
    () => withRouting(routing.ids, new Float32Array(T * K).fill(Number.NaN)),
    RouterError,
    /token 0 slot 0: weight NaN is not finite/,
  ),
  err(
    "weight Infinity",
    () => withRouting(routing.ids, new Float32Array(T * K).fill(Number.POSITIVE_INFINITY)),
    RouterError,
    /weight Infinity is not finite/,
  ),
  err(
    "id 8 of 8 experts",
    () =>
      withRouting(
        badIds((i) => {
          i[1] = 8;
        }),
      ),
    RouterError,
    /token 0 slot 1: expert id 8 is outside \[-1, 8\)/,
  ),
  err(
    "id -2",
    () =>
      withRouting(
        badIds((i) => {
          i[0] = -2;
        }),
      ),
    RouterError,
    /expert id -2 is outside/,
  ),
  err(
    "an expert twice in a row",
    () =>
      withRouting(
        badIds((i) => {
          i[1] = i[0]!;
        }),
      ),
    RouterError,
    /already chosen in slot 0/,
  ),
  err(
    "ids of the wrong length",
    () => withRouting(routing.ids.subarray(1)),
    RouterError,
    /ids has 3 elements, expected 4/,
  ),
  ok(
    "negative weights",
    () => {
      const neg = Float32Array.from(routing.weights, (w) => -w);
      const a = layer.forward(x, T, { routing, shared: false }).out;
      const b = layer.forward(x, T, { routing: { ids: routing.ids, weights: neg }, shared: false }).out;
      return { a, b };
    },
    "the combine is linear in the weights (docs/numerics.md); negating them negates the output",
    (r) => {
      const { a, b } = r as { a: Uint16Array; b: Uint16Array };
      assert.ok(a.some((v) => v !== 0));
      for (let i = 0; i < a.length; i++) assert.equal(bf16BitsToF32(b[i]!), -bf16BitsToF32(a[i]!));
    },
  ),
  ok(
    "a nonzero weight on a −1 slot",
    () => {
      const ids = badIds((i) => {
        i[1] = -1;
      });
      const zero = routing.weights.slice();
      zero[1] = 0;
      const a = layer.forward(x, T, { routing: { ids, weights: routing.weights } }).out;
      const b = layer.forward(x, T, { routing: { ids, weights: zero } }).out;
      return { a, b };
    },
    "a −1 slot is unused and its weight is never read",
    (r) => {
      const { a, b } = r as { a: Uint16Array; b: Uint16Array };
      assert.deepEqual(a, b);
    },
  ),

  // forward: x, tokens, options
  err("tokens 0", () => layer.forward(x, 0), InputError, /tokens must be a positive integer, got number 0/),
  err("tokens 2.5", () => layer.forward(x, 2.5), InputError, /got number 2\.5/),
  err(
    "tokens past maxTokens",
    () => layer.forward(x, 1025),
    InputError,
    /too many tokens: 1025 > maxTokens 1024/,
  ),
  err(
    "x Float32Array",
    () => layer.forward(new Float32Array(T * H) as never, T),
    InputError,
    /x must be a Uint16Array of bf16 bits, got Float32Array/,
  ),
  err("x of the wrong length", () => layer.forward(x.subarray(1), T), InputError, /x has 511 elements/),
  ok(
    "tokenIds on a gate-routed layer, beside its routing",
    () => layer.forward(x, T, { routing, tokenIds: new Int32Array(T) }).out,
    "one loop over a model's layers passes the same ids to each; a gate-routed layer does not read them",
    (out) => assert.deepEqual(out, layer.forward(x, T, { routing }).out),
  ),
  err(
    "x holding a bf16 NaN",
    () =>
      layer.forward(
        x.map((v, i) => (i === 3 ? 0x7fc0 : v)),
        T,
      ),
    InputError,
    /non-finite value at token 0, channel 3/,
  ),
  err(
    "forward options null",
    () => layer.forward(x, T, null as never),
    InputError,
    /forward options must be an object, got null/,
  ),
  err(
    "forward option rout",
    () => layer.forward(x, T, { rout: routing } as never),
    InputError,
    /unknown forward options field rout \(did you mean routing\?\)/,
  ),
  err(
    'shared "false"',
    () => layer.forward(x, T, { shared: "false" as never }),
    InputError,
    /shared must be true or false, got the string "false"/,
  ),
  err(
    "onProgress 5",
    () => layer.forward(x, T, { onProgress: 5 as never }),
    InputError,
    /onProgress must be a function/,
  ),
  err("forward after dispose", () => disposed.forward(x, T), InputError, /after dispose/),
  err(
    "forwardDevice on the cpu",
    () => layer.forwardDevice({} as never),
    InputError,
    /needs the "cuda" backend/,
  ),
  err(
    "x of finite values the L1 GEMM overflows",
    () => layer.forward(new Uint16Array(T * H).fill(0x7f7f), T, { routing }),
    NumericsError,
    /expert \d: x\[0\] \(largest \|value\| 3\.390e\+38\) times W1 overflows fp32: at intermediate channel \d+/,
  ),

  // forward: what a custom weight source returns, checked as the GPU upload checks it
  err(
    "a source whose expert() returns null",
    () => forwardWith(sourceWithExpert(() => null)),
    TypeError,
    /the weight source's expert \d must be an object with w1 and w2, got null/,
  ),
  err(
    "an expert of another intermediate size",
    () => forwardWith(sourceWithExpert((w) => ({ ...w, w1: wide.expert(0).w1 }))),
    TypeError,
    /expert \d W1 is \[512, 256\], expected \[256, 256\]/,
  ),
  err(
    "an expert's codes cut short",
    () =>
      forwardWith(sourceWithExpert((w) => ({ ...w, w2: { ...(w.w2 as object), q: new Uint8Array(10) } }))),
    TypeError,
    /expert \d W2\.q must be a Uint8Array of 32768 e4m3 codes, got Uint8Array of 10/,
  ),
  err(
    "an expert with a NaN scale",
    () =>
      forwardWith(
        sourceWithExpert((w) => ({
          ...w,
          w1: { ...(w.w1 as object), scales: new Float32Array(4).fill(Number.NaN) },
        })),
      ),
    TypeError,
    /expert \d W1\.scales\[0\] = NaN is not a positive finite scale/,
  ),
  err(
    "an FP4 expert in an FP8 layer",
    () => forwardWith(sourceWithExpert(() => fp4Weights.expert(0))),
    TypeError,
    /the weight source's expert \d is fp4, expected fp8/,
  ),
  err(
    "a shared expert of the wrong shape",
    () => forwardWith(sourceWithExpert((w) => ({ ...w, w1: wide.expert(0).w1 }), "shared")),
    TypeError,
    /the weight source's shared expert W1 is \[512, 256\], expected \[256, 256\]/,
  ),

  // Router functions
  err(
    "routeTokens gate null",
    () => routeTokens(x, T, null as never, tiny),
    RouterError,
    /gate must be \{ weight, bias \}, got null/,
  ),
  err(
    "routeTokens gate.weight Float32Array",
    () => routeTokens(x, T, { weight: new Float32Array(8 * H) as never, bias: weights.gate().bias }, tiny),
    RouterError,
    /gate\.weight must be a Uint16Array, got Float32Array/,
  ),
  err(
    "routeTokens with a misspelt config",
    () => routeTokens(x, T, weights.gate(), raw({ topk: 2 })),
    ConfigError,
    /topk \(did you mean topK\?\)/,
  ),
  err(
    "routeTokens tokenMask as an array",
    () => routeTokens(x, T, weights.gate(), tiny, { tokenMask: [1, 1] as never }),
    RouterError,
    /tokenMask must be a Uint8Array, got Array/,
  ),
  err(
    "validateRouting tokens -1",
    () => validateRouting(routing.ids, routing.weights, -1, tiny),
    RouterError,
    /tokens must be a non-negative integer, got number -1/,
  ),
  err(
    "randomRouting hotExpert 9",
    () => randomRouting(1, T, tiny, { hotExpert: 9 }),
    RouterError,
    /hotExpert 9 is outside \[0, 8\)/,
  ),
  err(
    "randomRouting option hot",
    () => randomRouting(1, T, tiny, { hot: 1 } as never),
    RouterError,
    /unknown randomRouting options field hot \(did you mean hotExpert\?\)/,
  ),
  err(
    "routeTokens options null",
    () => routeTokens(x, T, weights.gate(), tiny, null as never),
    RouterError,
    /route options must be an object, got null/,
  ),
  err(
    "routeTokens option mask",
    () => routeTokens(x, T, weights.gate(), tiny, { mask: new Uint8Array(T) } as never),
    RouterError,
    /unknown route options field mask/,
  ),

  // Expert parallelism
  err(
    "splitAmongRanks ranks 0",
    () => splitAmongRanks(x, T, routing, H, K, 0),
    InputError,
    /ranks must be an integer ≥ 1, got number 0/,
  ),
  err(
    "splitAmongRanks ranks 1.5",
    () => splitAmongRanks(x, T, routing, H, K, 1.5),
    InputError,
    /got number 1\.5/,
  ),
  err(
    "splitAmongRanks x too short",
    () => splitAmongRanks(x.subarray(1), T, routing, H, K, 2),
    InputError,
    /x must be a Uint16Array of tokens × hidden = 512 .*of 511/,
  ),
  err(
    "splitAmongRanks routing null",
    () => splitAmongRanks(x, T, null as never, H, K, 2),
    InputError,
    /routing must be \{ ids, weights \}, got null/,
  ),
  err(
    "splitAmongRanks ids Float32Array",
    () => splitAmongRanks(x, T, { ids: new Float32Array(T * K) as never, weights: routing.weights }, H, K, 2),
    InputError,
    /routing\.ids must be an Int32Array .*got Float32Array/,
  ),
  err(
    "ExpertParallelMoE ranks 3",
    () => new ExpertParallelMoE(weights, { ranks: 3 }),
    InputError,
    /8 experts cannot be split evenly among 3 ranks/,
  ),
  err(
    "ExpertParallelMoE without options",
    () => new ExpertParallelMoE(weights, undefined as never),
    InputError,
    /needs options with ranks/,
  ),
  err(
    "ExpertParallelMoE(null)",
    () => new ExpertParallelMoE(null as never, { ranks: 2 }),
    InputError,
    /weight source must be an object/,
  ),
  err(
    "ExpertParallelMoE option rank",
    () => new ExpertParallelMoE(weights, { ranks: 2, rank: 1 } as never),
    InputError,
    /unknown ExpertParallelMoE options field rank \(did you mean ranks\?\)/,
  ),
  err(
    "ep.forward one input for two ranks",
    () => ep.forward(rankInputs().slice(1)),
    InputError,
    /expected one input per rank \(2\), got 1/,
  ),
  err(
    "ep.forward not an array",
    () => ep.forward(null as never),
    InputError,
    /expected an array of one input per rank, got null/,
  ),
  err(
    "ep.forward [null, null]",
    () => ep.forward([null, null] as never),
    InputError,
    /rank 0: input must be/,
  ),
  err(
    "ep.forward ids Float32Array",
    () => ep.forward(rankInputs().map((r) => ({ ...r, ids: Float32Array.from(r.ids) as never }))),
    InputError,
    /rank 0: ids must be an Int32Array, got Float32Array/,
  ),
  err(
    "ep.forward id 8",
    () => ep.forward(rankInputs().map((r) => ({ ...r, ids: r.ids.map(() => 8) }))),
    InputError,
    /expert id 8 is outside \[-1, 8\)/,
  ),
  err(
    'ep.forward shared "false"',
    () => ep.forward(rankInputs(), { shared: "false" as never }),
    InputError,
    /ExpertParallelMoE forward options\.shared must be true or false, got the string "false"/,
  ),
  err(
    "ep.forward option share",
    () => ep.forward(rankInputs(), { share: false } as never),
    InputError,
    /unknown ExpertParallelMoE forward options field share \(did you mean shared\?\)/,
  ),
  err(
    "planDispatch(null)",
    () => planDispatch(null as never, 8, 2),
    DispatchError,
    /planDispatch: routing must be an array of one routing per rank, got null/,
  ),
  err(
    "sentRows(null, 0)",
    () => sentRows(null as never, 0),
    DispatchError,
    /sentRows: plan must be a planDispatch result, got null/,
  ),
  err(
    "sentRows of rank 2 of 2",
    () =>
      sentRows(
        planDispatch(
          [
            { ...routing, tokens: T },
            { ...routing, tokens: T },
          ],
          8,
          2,
        ),
        2,
      ),
    DispatchError,
    /sentRows: rank must be an integer in \[0, 2\), got number 2/,
  ),
  err(
    "joinRankOutputs(null)",
    () => joinRankOutputs(null as never),
    InputError,
    /expected an array of the ranks' outputs, got null/,
  ),
  err(
    "joinRankOutputs([out, null])",
    () => joinRankOutputs([new Uint16Array(H), null] as never),
    InputError,
    /rank 1's output must be a Uint16Array of bf16 bits, got null/,
  ),
  err(
    "RankWeights rank 2 of 2",
    () => new RankWeights(weights, 2, 2, 64),
    InputError,
    /rank must be an integer in \[0, 2\), got number 2/,
  ),
  err(
    "RankWeights of null",
    () => new RankWeights(null as never, 0, 2, 64),
    InputError,
    /RankWeights: the weight source must be an object/,
  ),

  // Checkpoints
  err(
    "loadMoEWeights of a missing file",
    () => loadMoEWeights(path.join(dir, "nope"), tiny),
    SafetensorsError,
    /cannot open/,
  ),
  err(
    "loadMoEWeights with hiddenSize",
    () => loadMoEWeights(checkpoint, raw({ hiddenSize: 1 })),
    ConfigError,
    /hiddenSize/,
  ),
  err(
    "loadMoEWeights prefix 5",
    () => loadMoEWeights(checkpoint, tiny, { prefix: 5 as never }),
    SafetensorsError,
    /prefix must be a string, got 5/,
  ),
  err(
    "loadMoEWeights for another shape",
    () => loadMoEWeights(checkpoint, resolveConfig("tiny", { hidden: 384 })),
    SafetensorsError,
    // The file's own metadata names the shape it holds (the checkpoint branch's check, before the tensors').
    /its metadata says it holds a "tiny" layer \(E=8 H=256 I=128 shared=1 fp8 experts\), not the "tiny" layer asked for \(E=8 H=384/,
  ),
  err(
    "loadMoEWeights of an FP4 file as FP8",
    () => loadMoEWeights(fp4File, tiny),
    SafetensorsError,
    /holds a "tiny" layer \(E=8 H=256 I=128 shared=1 fp4 experts\), not the "tiny" layer asked for \(E=8 H=256 I=128 shared=1 fp8 experts\)/,
  ),
  err(
    "loadMoEWeights option cache",
    () => loadMoEWeights(checkpoint, tiny, { cache: 2 } as never),
    SafetensorsError,
    /unknown load options field cache/,
  ),
  err(
    "saveMoEWeights option prefx",
    () => saveMoEWeights(path.join(dir, "y"), weights, { prefx: "a." } as never),
    SafetensorsError,
    /unknown save options field prefx \(did you mean prefix\?\)/,
  ),
  err(
    "an expert with the e4m3 NaN code 0x7F",
    () => loaded.expert(0),
    SafetensorsError,
    /tensor model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight\[5\] holds the FP8 e4m3 NaN code 0x7f/,
  ),
  err(
    "an expert with the e4m3 NaN code 0xFF",
    () => loaded.expert(1),
    SafetensorsError,
    /experts\.1\.up_proj\.weight\[300\] holds the FP8 e4m3 NaN code 0xff/,
  ),
  err(
    "saveMoEWeights of null",
    () => saveMoEWeights(path.join(dir, "x"), null as never),
    SafetensorsError,
    /weight source must be an object/,
  ),
  err(
    "saveMoEWeights to null",
    () => saveMoEWeights(null as never, weights),
    SafetensorsError,
    /path must be a string, got null/,
  ),

  // Device weights: what is checked before a device is touched
  err(
    "DeviceMoEWeights.generate(null device)",
    () => DeviceMoEWeights.generate(null as never, tiny, 1),
    TypeError,
    /device must be a Device, got null/,
  ),
  err(
    "DeviceMoEWeights.generate seed -1",
    () => DeviceMoEWeights.generate(null as never, tiny, -1),
    RangeError,
    /seed must be an integer in/,
  ),
  err(
    "DeviceMoEWeights.generate with hiddenSize",
    () => DeviceMoEWeights.generate(null as never, raw({ hiddenSize: 1 }), 1),
    ConfigError,
    /hiddenSize/,
  ),
  err(
    "DeviceMoEWeights.upload(null source)",
    () => DeviceMoEWeights.upload(null as never, null as never),
    TypeError,
    /weight source must be an object/,
  ),

  // Codecs
  err(
    "quantizeActivations of a Float32Array",
    () => quantizeActivations(new Float32Array(T * H) as never, T, H, "fp32"),
    TypeError,
    /x \(bf16 bits\) must be a Uint16Array, got Float32Array/,
  ),
  err(
    "quantizeActivations hidden 200",
    () => quantizeActivations(x, T, 200, "fp32"),
    RangeError,
    /hidden must be an integer ≥ 128|hidden must be a multiple of 128/,
  ),
  err(
    'quantizeActivations format "fp16"',
    () => quantizeActivations(x, T, H, "fp16" as never),
    RangeError,
    /scale format must be "fp32" or "ue8m0", got the string "fp16"/,
  ),
  err(
    "quantizeActivations tokens 1.5",
    () => quantizeActivations(x, 1.5, H, "fp32"),
    RangeError,
    /tokens must be an integer ≥ 0, got 1\.5/,
  ),
  err(
    "quantizeWeightBlocks of a Float64Array",
    () => quantizeWeightBlocks(new Float64Array(128 * 128) as never, 128, 128),
    TypeError,
    /w must be a Float32Array, got Float64Array/,
  ),
  err(
    "quantizeWeightBlocks with NaN",
    () => quantizeWeightBlocks(new Float32Array(128 * 128).fill(Number.NaN), 128, 128),
    RangeError,
    /non-finite value NaN at index 0/,
  ),
  err(
    "dequantizeActivations with a zero scale",
    () => dequantizeActivations(new Uint8Array(H), new Float32Array(2), 1, H),
    RangeError,
    /scales\[0\] = 0 is not a positive finite scale/,
  ),
  err(
    "dequantizeWeightBlocks with Float64Array scales",
    () => dequantizeWeightBlocks(new Uint8Array(128 * 128), new Float64Array(1) as never, 128, 128),
    TypeError,
    /scales must be a Float32Array, got Float64Array/,
  ),
  ok(
    "dequantizeActivations of the e4m3 NaN code",
    () => dequantizeActivations(new Uint8Array(H).fill(0x7f), new Float32Array(2).fill(1), 1, H)[0],
    "codes decode as they are (docs/numerics.md); quantization never makes 0x7F",
    (v) => assert.ok(Number.isNaN(v)),
  ),
  err(
    "decodeE4m3(256)",
    () => decodeE4m3(256),
    RangeError,
    /e4m3 code must be an integer in \[0, 255\], got number 256/,
  ),
  err("decodeE4m3(1.5)", () => decodeE4m3(1.5), RangeError, /got number 1\.5/),
  ok(
    "encodeE4m3(NaN)",
    () => encodeE4m3(Number.NaN),
    "CUDA's SATFINITE conversion keeps NaN: code 0x7F",
    (c) => assert.equal(c, 0x7f),
  ),
  ok(
    "encodeE4m3(1e6)",
    () => encodeE4m3(1e6),
    "saturates to 448 (0x7E), as CUDA's SATFINITE does",
    (c) => assert.equal(c, 0x7e),
  ),
  err(
    "bf16FromF32Array of a Float64Array",
    () => bf16FromF32Array(new Float64Array(4) as never),
    TypeError,
    /src must be a Float32Array, got Float64Array/,
  ),
  err(
    "f32FromBf16Array of a Float32Array",
    () => f32FromBf16Array(new Float32Array(4) as never),
    TypeError,
    /src must be a Uint16Array of bf16 bits, got Float32Array/,
  ),
  err(
    "bf16BitsToF32(70000)",
    () => bf16BitsToF32(70000),
    RangeError,
    /bf16 bits must be an integer in \[0, 0xFFFF\], got 70000/,
  ),

  // Metrics
  err(
    "calcDiff(null, b)",
    () => calcDiff(null as never, [1]),
    TypeError,
    /calcDiff: a must be an array or typed array of numbers, got null/,
  ),
  err(
    "calcDiff of strings",
    () => calcDiff("abc" as never, "abd" as never),
    TypeError,
    /got the string "abc"/,
  ),
  err(
    "calcDiff lengths 4 and 3",
    () => calcDiff([1, 2, 3, 4], [1, 2, 3]),
    RangeError,
    /length mismatch: 4 vs 3/,
  ),
  ok(
    "relativeError with NaN",
    () => relativeError([Number.NaN, 1], [1, 1]),
    "a metric reports what it sees: NaN in gives NaN out (JSDoc)",
    (v) => assert.ok(Number.isNaN(v)),
  ),
  err("checksum(null)", () => checksum(null as never), TypeError, /bytes must be a typed array, got null/),
  err("l2Norm(null)", () => l2Norm(null as never), TypeError, /l2Norm: a must be an array/),

  // The CPU reference called directly
  err(
    "referenceMoE with Float32Array ids",
    () =>
      referenceMoE(x, T, { ids: Float32Array.from(routing.ids) as never, weights: routing.weights }, weights),
    RouterError,
    /routing ids must be an Int32Array, got Float32Array/,
  ),
  err(
    "referenceMoE of a null source",
    () => referenceMoE(x, T, routing, null as never),
    TypeError,
    /weight source must be an object/,
  ),
  err(
    "groupByExpert with id 9",
    () =>
      groupByExpert(
        {
          ids: badIds((i) => {
            i[0] = 9;
          }),
          weights: routing.weights,
        },
        T,
        tiny,
      ),
    RouterError,
    /expert id 9 is outside \[-1, 8\)/,
  ),
  err(
    "referenceMoE option share",
    () => referenceMoE(x, T, routing, weights, { share: false } as never),
    TypeError,
    /unknown reference options field share \(did you mean shared\?\)/,
  ),
  err(
    'referenceMoE shared "no"',
    () => referenceMoE(x, T, routing, weights, { shared: "no" as never }),
    TypeError,
    /reference options\.shared must be true or false, got the string "no"/,
  ),
  err(
    "referenceMoE threads 0",
    () => referenceMoE(x, T, routing, weights, { threads: 0 }),
    RangeError,
    /reference options\.threads must be an integer in \[1, 64\], got number 0/,
  ),
  err(
    "idealMoE of x holding a bf16 NaN",
    () =>
      idealMoE(
        x.map((v, i) => (i === 3 ? 0x7fc0 : v)),
        T,
        routing,
        weights,
      ),
    RangeError,
    /idealMoE: x holds a non-finite value at token 0, channel 3/,
  ),
];

const clear = rows.filter((r) => "error" in r).length;
const accepted = rows.length - clear;

describe(`bad inputs to the public API: ${rows.length} tried, ${clear} clear errors, ${accepted} accepted as documented`, () => {
  for (const row of rows) {
    if ("error" in row) {
      it(`${row.call}: ${row.error.name}`, () => {
        assert.throws(row.run, (e: unknown) => {
          assert.ok(e instanceof row.error, `${row.call}: threw ${String(e)}, expected ${row.error.name}`);
          assert.match((e as Error).message, row.message);
          return true;
        });
      });
    } else {
      it(`${row.call}: accepted (${row.accepted})`, () => {
        row.check(row.run());
      });
    }
  }
});
