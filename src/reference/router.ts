/**
 * CPU reference of the gate (router): logits, scores, group-limited top-k and the routing weights.
 *
 * The rules (accumulation order, score formulas, tie breaking, epsilon) are written down in
 * docs/numerics.md ("The router (gate)"); this file implements exactly those rules so a GPU router can be checked against it.
 */

import {
  checkOptionFields,
  describeValue,
  type MoEConfig,
  type ScoringFunction,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { f32FromBf16Array, isBf16NonFinite } from "../numerics/bf16.js";
import { checkSeed } from "../numerics/counter-rng.js";

const fround = Math.fround;

/** Added to the sum of the chosen weights before renormalizing (DeepSeek-V3's constant); see docs/numerics.md, "The router (gate)". */
export const RENORMALIZE_EPSILON = 1e-20;
/** Above this logit softplus(l) is taken as l (PyTorch's softplus threshold). */
export const SOFTPLUS_THRESHOLD = 20;

export class RouterError extends Error {
  override name = "RouterError";
}

export interface Gate {
  /** bf16 bits, [numExperts, hidden] row-major. */
  weight: Uint16Array;
  /** Per-expert correction bias, used for selection only; null when the config has none. */
  bias: Float32Array | null;
}

export interface RouteOptions {
  /** [tokens]; 0 marks a masked (padding) token: its k ids are −1 and its weights 0. */
  tokenMask?: Uint8Array;
}

export interface Routing {
  /** [tokens, topK] expert ids in descending selection-score order; −1 for masked tokens. */
  ids: Int32Array;
  /** [tokens, topK] fp32 routing weights; 0 for masked tokens. */
  weights: Float32Array;
}

export interface RouteResult extends Routing {
  /** [tokens, numExperts] fp32 gate logits; rows of masked tokens are 0 (their x is never read). */
  logits: Float32Array;
}

function requireLength(name: string, array: ArrayLike<number>, expected: number, shape: string): void {
  if (array.length !== expected) {
    throw new RouterError(`${name} has ${array.length} elements, expected ${expected} (${shape})`);
  }
}

/** Throws RouterError unless `value` is an instance of `kind` (no other array kind is converted). */
function requireKind(name: string, value: unknown, kind: { new (n: number): object; name: string }): void {
  if (!(value instanceof kind)) {
    const article = kind.name.startsWith("Int") ? "an" : "a"; // "an Int32Array", "a Uint8Array"
    throw new RouterError(`${name} must be ${article} ${kind.name}, got ${describeValue(value)}`);
  }
}

function requireCount(name: string, value: number): void {
  if (!Number.isInteger(value) || value < 0) {
    throw new RouterError(`${name} must be a non-negative integer, got ${describeValue(value)}`);
  }
}

function hex16(bits: number): string {
  return `0x${bits.toString(16).padStart(4, "0")}`;
}

/**
 * `opts` when it is undefined or an object of `known` fields; else a RouterError (a null would fail in
 * destructuring, and a misspelt field would be ignored without a word).
 */
function checkedOptions<T extends object>(where: string, opts: T | undefined, known: readonly string[]): T {
  if (opts === undefined) return {} as T;
  checkOptionFields(where, opts, known, (message) => new RouterError(message));
  return opts;
}

function checkTokenMask(tokenMask: Uint8Array | undefined, tokens: number): void {
  if (tokenMask !== undefined) requireKind("tokenMask", tokenMask, Uint8Array);
  if (tokenMask !== undefined) requireLength("tokenMask", tokenMask, tokens, `[tokens=${tokens}]`);
}

function isActive(tokenMask: Uint8Array | undefined, t: number): boolean {
  return tokenMask === undefined || tokenMask[t] !== 0;
}

/**
 * logits[t, e] = Σ_h x[t, h] · w[e, h].
 *
 * Each bf16×bf16 product is exact (8-bit significands give a 16-bit product, which fits fp32 and
 * double); the products are summed in double in increasing h starting from 0, and the sum is rounded
 * once to fp32. Rows of masked tokens are not read (they may hold anything) and come out as 0.
 */
export function gateLogits(
  x: Uint16Array,
  weight: Uint16Array,
  tokens: number,
  hidden: number,
  numExperts: number,
  opts: RouteOptions = {},
): Float32Array {
  requireCount("tokens", tokens);
  requireCount("hidden", hidden);
  requireCount("numExperts", numExperts);
  requireKind("x", x, Uint16Array);
  requireKind("gate.weight", weight, Uint16Array);
  requireLength("x", x, tokens * hidden, `[tokens=${tokens}, hidden=${hidden}]`);
  requireLength("gate.weight", weight, numExperts * hidden, `[numExperts=${numExperts}, hidden=${hidden}]`);
  const { tokenMask } = checkedOptions("route options", opts, ["tokenMask"]);
  checkTokenMask(tokenMask, tokens);
  for (let i = 0; i < weight.length; i++) {
    if (isBf16NonFinite(weight[i])) {
      const e = Math.floor(i / hidden);
      throw new RouterError(
        `gate.weight[${e}, ${i - e * hidden}] is not finite (bf16 bits ${hex16(weight[i])})`,
      );
    }
  }
  for (let t = 0; t < tokens; t++) {
    if (!isActive(tokenMask, t)) continue;
    for (let h = 0; h < hidden; h++) {
      const bits = x[t * hidden + h];
      if (isBf16NonFinite(bits)) {
        throw new RouterError(`x[${t}, ${h}] is not finite (bf16 bits ${hex16(bits)})`);
      }
    }
  }
  const xf = f32FromBf16Array(x);
  const wf = f32FromBf16Array(weight);
  const logits = new Float32Array(tokens * numExperts);
  for (let t = 0; t < tokens; t++) {
    if (!isActive(tokenMask, t)) continue;
    const xRow = t * hidden;
    for (let e = 0; e < numExperts; e++) {
      const wRow = e * hidden;
      let sum = 0; // double: exact products, one rounding to fp32 at the end
      for (let h = 0; h < hidden; h++) sum += xf[xRow + h] * wf[wRow + h];
      logits[t * numExperts + e] = sum;
      if (!Number.isFinite(logits[t * numExperts + e])) throw logitOverflow(xf, wf, t, e, hidden, sum);
    }
  }
  return logits;
}

/**
 * The error of a logit past fp32's range (finite bf16 x and weights, e.g. x near bf16's largest value):
 * it names x's token and its largest element, which the scores would otherwise turn into NaN.
 */
function logitOverflow(
  xf: Float32Array,
  wf: Float32Array,
  t: number,
  e: number,
  hidden: number,
  sum: number,
): RouterError {
  let at = 0;
  for (let h = 1; h < hidden; h++) if (Math.abs(xf[t * hidden + h]) > Math.abs(xf[t * hidden + at])) at = h;
  let wMax = 0;
  for (let h = 0; h < hidden; h++) wMax = Math.max(wMax, Math.abs(wf[e * hidden + h]));
  return new RouterError(
    `x[${t}] is too large for the gate: its logit for expert ${e} is ${sum.toExponential(4)}, past fp32's range (x[${t}, ${at}] = ${xf[t * hidden + at]}, the largest of token ${t}; gate.weight[${e}] is at most ${wMax} in magnitude)`,
  );
}

/** sigmoid(l) = 1 / (1 + exp(−l)), in double. */
export function sigmoid(l: number): number {
  return 1 / (1 + Math.exp(-l));
}

/** softplus(l) = log1p(exp(l)), taken as l above SOFTPLUS_THRESHOLD so exp cannot overflow. */
export function softplus(l: number): number {
  return l > SOFTPLUS_THRESHOLD ? l : Math.log1p(Math.exp(l));
}

/** sqrtsoftplus(l) = sqrt(softplus(l)), in double. */
export function sqrtSoftplus(l: number): number {
  return Math.sqrt(softplus(l));
}

/**
 * Scores [tokens, numExperts] from fp32 logits, computed in double and rounded once to fp32.
 * Softmax subtracts the row maximum and sums the exponentials in increasing expert order.
 * Rows of masked tokens are 0.
 */
export function scoreLogits(
  logits: Float32Array,
  tokens: number,
  numExperts: number,
  scoring: ScoringFunction,
  opts: RouteOptions = {},
): Float32Array {
  requireCount("tokens", tokens);
  requireCount("numExperts", numExperts);
  requireKind("logits", logits, Float32Array);
  requireLength("logits", logits, tokens * numExperts, `[tokens=${tokens}, numExperts=${numExperts}]`);
  const { tokenMask } = checkedOptions("route options", opts, ["tokenMask"]);
  checkTokenMask(tokenMask, tokens);
  const scores = new Float32Array(tokens * numExperts);
  for (let t = 0; t < tokens; t++) {
    if (!isActive(tokenMask, t)) continue;
    const row = t * numExperts;
    for (let e = 0; e < numExperts; e++) {
      if (!Number.isFinite(logits[row + e])) {
        // An fp32 overflow of the gate GEMM: softmax would turn it into NaN, so refuse it here.
        throw new RouterError(`logits[${t}, ${e}] is not finite (${logits[row + e]})`);
      }
    }
    switch (scoring) {
      case "sigmoid":
        for (let e = 0; e < numExperts; e++) scores[row + e] = sigmoid(logits[row + e]);
        break;
      case "sqrtsoftplus":
        for (let e = 0; e < numExperts; e++) scores[row + e] = sqrtSoftplus(logits[row + e]);
        break;
      case "softmax": {
        let max = -Infinity;
        for (let e = 0; e < numExperts; e++) max = Math.max(max, logits[row + e]);
        let sum = 0;
        for (let e = 0; e < numExperts; e++) sum += Math.exp(logits[row + e] - max);
        for (let e = 0; e < numExperts; e++) scores[row + e] = Math.exp(logits[row + e] - max) / sum;
        break;
      }
      default:
        throw new RouterError(`unknown scoring function ${String(scoring)}`);
    }
  }
  return scores;
}

/** The fixed order of candidates: higher value first, then the lower index. */
function ranksBefore(valueA: number, indexA: number, valueB: number, indexB: number): boolean {
  return valueA > valueB || (valueA === valueB && indexA < indexB);
}

/**
 * Keeps the best `count` candidates of `values[0..n)` where `allowed(i)`, in rank order, writing their
 * indices to `out` (length ≥ count) and returning how many were kept. Insertion into a sorted prefix:
 * the order is total, so the result does not depend on the algorithm.
 */
function bestIndices(
  values: Float64Array,
  n: number,
  count: number,
  out: Int32Array,
  allowed: (i: number) => boolean,
): number {
  let kept = 0;
  for (let i = 0; i < n; i++) {
    if (!allowed(i)) continue;
    const v = values[i];
    if (kept === count && !ranksBefore(v, i, values[out[kept - 1]], out[kept - 1])) continue;
    let slot = kept < count ? kept++ : count - 1;
    while (slot > 0 && ranksBefore(v, i, values[out[slot - 1]], out[slot - 1])) {
      out[slot] = out[slot - 1];
      slot--;
    }
    out[slot] = i;
  }
  return kept;
}

/**
 * Chooses topK experts per token from fp32 scores [tokens, numExperts] and computes their weights.
 *
 * Selection score = fround(score + bias[e]) with a bias, else the score. With nGroup > 1 the experts
 * form nGroup contiguous groups; a group's score is fround(top1 + top2) of its selection scores (the
 * single score when groups hold one expert); the topkGroup best groups are kept and the experts of the
 * other groups cannot be chosen. Ties: higher value first, then the lower index (experts and groups).
 * Weights are the unbiased scores of the chosen experts, renormalized over the k (w / (Σw + 1e-20))
 * when config.router.renormalize, times routedScalingFactor, computed in double and rounded to fp32.
 */
export function selectTopK(
  scores: Float32Array,
  bias: Float32Array | null,
  tokens: number,
  config: MoEConfig | ValidatedConfig,
  opts: RouteOptions = {},
): Routing {
  config = validateConfig(config); // returns at once for a validated config
  const { numExperts, topK } = config;
  const { nGroup, topkGroup, renormalize, routedScalingFactor } = config.router;
  requireCount("tokens", tokens);
  requireKind("scores", scores, Float32Array);
  if (bias !== null) requireKind("gate.bias", bias, Float32Array);
  requireLength("scores", scores, tokens * numExperts, `[tokens=${tokens}, numExperts=${numExperts}]`);
  if (bias !== null) checkBias(bias, numExperts);
  const { tokenMask } = checkedOptions("route options", opts, ["tokenMask"]);
  checkTokenMask(tokenMask, tokens);

  const groupSize = numExperts / nGroup;
  const ids = new Int32Array(tokens * topK);
  const weights = new Float32Array(tokens * topK);
  const selection = new Float64Array(numExperts);
  const groupScores = new Float64Array(nGroup);
  const keptGroups = new Int32Array(topkGroup);
  const groupKept = new Uint8Array(nGroup);
  const chosen = new Int32Array(topK);
  const expertAllowed = (e: number): boolean => groupKept[Math.floor(e / groupSize)] === 1;
  const anyExpert = (_e: number): boolean => true;

  for (let t = 0; t < tokens; t++) {
    const out = t * topK;
    if (!isActive(tokenMask, t)) {
      ids.fill(-1, out, out + topK);
      continue;
    }
    const row = t * numExperts;
    for (let e = 0; e < numExperts; e++) {
      const s = scores[row + e];
      if (!Number.isFinite(s)) throw new RouterError(`scores[${t}, ${e}] is not finite (${s})`);
      selection[e] = bias === null ? s : fround(s + bias[e]);
    }

    let allowed = anyExpert;
    if (nGroup > 1) {
      for (let g = 0; g < nGroup; g++) {
        let top1 = -Infinity;
        let top2 = -Infinity;
        for (let e = g * groupSize; e < (g + 1) * groupSize; e++) {
          const v = selection[e];
          if (v > top1) {
            top2 = top1;
            top1 = v;
          } else if (v > top2) {
            top2 = v;
          }
        }
        groupScores[g] = groupSize === 1 ? top1 : fround(top1 + top2);
      }
      bestIndices(groupScores, nGroup, topkGroup, keptGroups, anyExpert);
      groupKept.fill(0);
      for (const g of keptGroups) groupKept[g] = 1;
      allowed = expertAllowed;
    }
    bestIndices(selection, numExperts, topK, chosen, allowed);

    let sum = 0;
    if (renormalize) for (let j = 0; j < topK; j++) sum += scores[row + chosen[j]];
    for (let j = 0; j < topK; j++) {
      const s = scores[row + chosen[j]];
      ids[out + j] = chosen[j];
      weights[out + j] = renormalize
        ? (s / (sum + RENORMALIZE_EPSILON)) * routedScalingFactor
        : s * routedScalingFactor;
    }
  }
  return { ids, weights };
}

function checkBias(bias: Float32Array, numExperts: number): void {
  requireLength("gate.bias", bias, numExperts, `[numExperts=${numExperts}]`);
  for (let e = 0; e < numExperts; e++) {
    if (!Number.isFinite(bias[e])) throw new RouterError(`gate.bias[${e}] is not finite (${bias[e]})`);
  }
}

/**
 * The whole router: x bf16 bits [tokens, hidden] → ids and weights [tokens, topK] and the logits.
 * The gate must carry a bias exactly when config.router.correctionBias is set.
 */
export function routeTokens(
  x: Uint16Array,
  tokens: number,
  gate: Gate,
  config: MoEConfig | ValidatedConfig,
  opts: RouteOptions = {},
): RouteResult {
  config = validateConfig(config); // returns at once for a validated config
  const { numExperts, hidden } = config;
  if (typeof gate !== "object" || gate === null) {
    throw new RouterError(`gate must be { weight, bias }, got ${describeValue(gate)}`);
  }
  requireKind("gate.weight", gate.weight, Uint16Array);
  if (gate.bias !== null) requireKind("gate.bias", gate.bias, Float32Array);
  if (config.router.correctionBias && gate.bias === null) {
    throw new RouterError("config.router.correctionBias is set but gate.bias is null");
  }
  if (!config.router.correctionBias && gate.bias !== null) {
    throw new RouterError("gate.bias is given but config.router.correctionBias is false");
  }
  if (gate.bias !== null) checkBias(gate.bias, numExperts);
  const logits = gateLogits(x, gate.weight, tokens, hidden, numExperts, opts);
  const scores = scoreLogits(logits, tokens, numExperts, config.router.scoring, opts);
  return { ...selectTopK(scores, gate.bias, tokens, config, opts), logits };
}

/**
 * Checks routing handed to the layer: ids an Int32Array and weights a Float32Array (no other kind is
 * converted: a fractional or NaN id has no meaning, and NaN would read as the −1 mask), lengths
 * [tokens, topK], ids in [−1, numExperts), no expert twice in a token's row (−1 may repeat), finite
 * weights. Weights may be negative or zero: the combine is linear in them (docs/numerics.md, "The
 * combine"); the router only ever makes positive ones. Throws RouterError naming token and slot.
 */
export function validateRouting(
  ids: Int32Array,
  weights: Float32Array,
  tokens: number,
  config: MoEConfig | ValidatedConfig,
): void {
  config = validateConfig(config); // returns at once for a validated config
  const { numExperts, topK } = config;
  requireCount("tokens", tokens);
  requireKind("routing ids", ids, Int32Array);
  requireKind("routing weights", weights, Float32Array);
  requireLength("ids", ids, tokens * topK, `[tokens=${tokens}, topK=${topK}]`);
  requireLength("weights", weights, tokens * topK, `[tokens=${tokens}, topK=${topK}]`);
  for (let t = 0; t < tokens; t++) {
    for (let j = 0; j < topK; j++) {
      const id = ids[t * topK + j];
      if (id < -1 || id >= numExperts) {
        throw new RouterError(`token ${t} slot ${j}: expert id ${id} is outside [-1, ${numExperts})`);
      }
      for (let i = 0; i < j && id !== -1; i++) {
        if (ids[t * topK + i] === id) {
          throw new RouterError(`token ${t} slot ${j}: expert ${id} already chosen in slot ${i}`);
        }
      }
      const w = weights[t * topK + j];
      if (!Number.isFinite(w)) throw new RouterError(`token ${t} slot ${j}: weight ${w} is not finite`);
    }
  }
}

/** mulberry32: a small seeded PRNG giving floats in [0, 1). */
function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let r = Math.imul(a ^ (a >>> 15), 1 | a);
    r = (r + Math.imul(r ^ (r >>> 7), 61 | r)) ^ r;
    return ((r ^ (r >>> 14)) >>> 0) / 4294967296;
  };
}

export interface RandomRoutingOptions {
  /** Every active token routes to this expert (in addition to k − 1 random others). */
  hotExpert?: number;
  /** Experts that no token routes to. */
  emptyExperts?: number[];
  /** Tokens whose ids are all −1 and weights 0. */
  maskedTokens?: number[];
}

function checkExpertId(name: string, id: number, numExperts: number): void {
  if (!Number.isInteger(id) || id < 0 || id >= numExperts) {
    throw new RouterError(`${name} ${id} is outside [0, ${numExperts})`);
  }
}

/**
 * Valid random routing for benchmarks and edge cases (it ignores group limits): per active token k
 * distinct ids, weights drawn in [0.5, 1.5), normalized to sum to routedScalingFactor (up to fp32
 * rounding), slots ordered by weight descending then id ascending like the router's output.
 */
export function randomRouting(
  seed: number,
  tokens: number,
  config: MoEConfig | ValidatedConfig,
  opts: RandomRoutingOptions = {},
): Routing {
  config = validateConfig(config); // returns at once for a validated config
  opts = checkedOptions("randomRouting options", opts, ["hotExpert", "emptyExperts", "maskedTokens"]);
  try {
    checkSeed(seed);
  } catch (e) {
    throw new RouterError((e as Error).message);
  }
  const { numExperts, topK } = config;
  const scale = config.router.routedScalingFactor;
  requireCount("tokens", tokens);
  const empty = new Set<number>();
  for (const e of opts.emptyExperts ?? []) {
    checkExpertId("emptyExperts entry", e, numExperts);
    empty.add(e);
  }
  const hot = opts.hotExpert;
  if (hot !== undefined) {
    checkExpertId("hotExpert", hot, numExperts);
    if (empty.has(hot)) throw new RouterError(`hotExpert ${hot} is also listed in emptyExperts`);
  }
  const masked = new Uint8Array(tokens);
  for (const t of opts.maskedTokens ?? []) {
    if (!Number.isInteger(t) || t < 0 || t >= tokens) {
      throw new RouterError(`maskedTokens entry ${t} is outside [0, ${tokens})`);
    }
    masked[t] = 1;
  }
  // The random draws come from `pool`; the hot expert, when given, is placed in slot 0 before drawing.
  const pool: number[] = [];
  for (let e = 0; e < numExperts; e++) if (!empty.has(e) && e !== hot) pool.push(e);
  const drawn = hot === undefined ? topK : topK - 1;
  if (pool.length < drawn) {
    throw new RouterError(
      `only ${pool.length + (hot === undefined ? 0 : 1)} experts can receive tokens, fewer than topK (${topK})`,
    );
  }

  const random = mulberry32(seed);
  const ids = new Int32Array(tokens * topK);
  const weights = new Float32Array(tokens * topK);
  const slotIds = new Array<number>(topK);
  const raw = new Array<number>(topK);
  const order = new Array<number>(topK);
  for (let t = 0; t < tokens; t++) {
    const out = t * topK;
    if (masked[t] === 1) {
      ids.fill(-1, out, out + topK);
      continue;
    }
    let slot = 0;
    if (hot !== undefined) slotIds[slot++] = hot;
    // Partial Fisher–Yates over the pool: uniform distinct draws from any starting arrangement.
    for (let i = 0; i < drawn; i++) {
      const j = i + Math.floor(random() * (pool.length - i));
      [pool[i], pool[j]] = [pool[j], pool[i]];
      slotIds[slot++] = pool[i];
    }
    let sum = 0;
    for (let j = 0; j < topK; j++) {
      raw[j] = 0.5 + random();
      sum += raw[j];
      order[j] = j;
    }
    order.sort((a, b) => raw[b] - raw[a] || slotIds[a] - slotIds[b]);
    for (let j = 0; j < topK; j++) {
      ids[out + j] = slotIds[order[j]];
      weights[out + j] = (raw[order[j]] / sum) * scale;
    }
  }
  return { ids, weights };
}

/**
 * DeepSeek-V4's hash routing (its first num_hash_layers layers): token t's experts are tid2eid[ids[t]]
 * in the table's order; their weights are the gate's unbiased scores of those experts, renormalized
 * over the k (w / (Σw + 1e-20)) when config.router.renormalize, times routedScalingFactor, as
 * selectTopK weights the experts it chooses. tid2eid is int32 [vocab, topK].
 */
export function routeByHash(
  x: Uint16Array,
  tokens: number,
  tokenIds: Int32Array,
  gate: Gate & { tid2eid?: Int32Array | null },
  config: MoEConfig,
): RouteResult {
  validateConfig(config);
  const { numExperts, hidden, topK } = config;
  const table = gate.tid2eid;
  if (table === undefined || table === null)
    throw new RouterError("hash routing needs the gate's tid2eid table");
  if (table.length === 0 || table.length % topK !== 0) {
    throw new RouterError(`tid2eid has ${table.length} elements, not a multiple of topK (${topK})`);
  }
  const vocab = table.length / topK;
  if (!(tokenIds instanceof Int32Array)) throw new RouterError("tokenIds must be an Int32Array");
  requireLength("tokenIds", tokenIds, tokens, `[tokens=${tokens}]`);
  const logits = gateLogits(x, gate.weight, tokens, hidden, numExperts);
  const scores = scoreLogits(logits, tokens, numExperts, config.router.scoring);
  const ids = new Int32Array(tokens * topK);
  const weights = new Float32Array(tokens * topK);
  const { renormalize, routedScalingFactor } = config.router;
  for (let t = 0; t < tokens; t++) {
    const id = tokenIds[t];
    if (id < 0 || id >= vocab)
      throw new RouterError(`tokenIds[${t}] = ${id} is outside the vocabulary [0, ${vocab})`);
    let sum = 0;
    for (let j = 0; j < topK; j++) {
      const e = table[id * topK + j];
      if (e < 0 || e >= numExperts) {
        throw new RouterError(`tid2eid[${id}, ${j}] = ${e} is outside [0, ${numExperts})`);
      }
      ids[t * topK + j] = e;
      sum += scores[t * numExperts + e];
    }
    for (let j = 0; j < topK; j++) {
      const s = scores[t * numExperts + ids[t * topK + j]];
      weights[t * topK + j] = renormalize
        ? (s / (sum + RENORMALIZE_EPSILON)) * routedScalingFactor
        : s * routedScalingFactor;
    }
  }
  validateRouting(ids, weights, tokens, config);
  return { ids, weights, logits };
}
