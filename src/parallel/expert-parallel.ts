/**
 * The MoE layer split across ranks by expert (expert parallelism): rank d holds routed experts
 * [d·E/R, (d+1)·E/R) and the shared expert, and takes its own tokens. One forward:
 *
 *   1. dispatch: each token's row goes to every rank that holds one of its experts (dispatch.ts);
 *   2. each rank runs its layer on the rows it received (its experts only, no shared expert), giving
 *      P_d, bf16 [rows received, H];
 *   3. combine: each rank gets its tokens' P_d back and adds them to its own shared expert S, bf16:
 *
 *        out[t] = bf16( f32(S[t]) + Σ_{d = 0 … R−1, t sent to d} f32(P_d[row of t on d]) )
 *
 *      summed in fp32 in that order (what travels back is bf16, as DeepEP's combine sends). This is
 *      the numerics of the expert-parallel layer on every backend; against the one-device layer it
 *      differs only by the rounding of the partial sums to bf16.
 *
 * The ranks' layers are MoELayers, so each rank runs whichever backend and GPU pipeline it is given.
 * On the "cpu" backend rows cross between ranks through the host. On "cuda" they never leave the GPUs
 * (`forwardDevice`): each source rank's gather kernel writes its rows straight into the receiving
 * ranks' buffers, and each rank's combine kernel reads the other ranks' results where they lie, over
 * peer access (NVLink) when the ranks sit on different GPUs. Phases (dispatch, experts, combine) are
 * separated by synchronizing the ranks' devices. The routing's ids are read on the host to plan the
 * dispatch. Several ranks may share one GPU: that runs the same protocol, which is how it is tested.
 */
import {
  describeValue,
  MAX_TOKENS_LIMIT,
  type MoEConfig,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { type Device, DeviceTensor, expectOperand } from "../cuda/index.js";
import { combineRanksOnDevice, gatherRowsOnDevice } from "../kernels/exchange/exchange.js";
import {
  type Backend,
  checkOptions,
  type GpuPipelineKind,
  InputError,
  MoELayer,
  validateInput,
} from "../layer.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../numerics/bf16.js";
import { validateRouting } from "../reference/router.js";
import {
  type ExpertWeights,
  type GateWeights,
  type MoEWeightSource,
  type RoutedExpertWeights,
  weightSourceProblem,
} from "../weights/types.js";
import {
  DispatchError,
  type DispatchPlan,
  planDispatch,
  type RankRouting,
  type ReceivedRows,
  sentRows,
} from "./dispatch.js";

/** One rank's share of a layer's weights: its block of routed experts, the shared expert, its gate rows. */
export class RankWeights implements MoEWeightSource {
  readonly config: ValidatedConfig;
  readonly generated?: { seed: number; firstExpert: number };
  private readonly first: number;

  constructor(
    private readonly source: MoEWeightSource,
    readonly rank: number,
    readonly ranks: number,
    maxTokens: number,
  ) {
    // Checked here: a bad rank or source would fail later as another expert's index or a TypeError.
    const problem = weightSourceProblem(source);
    if (problem !== null) throw new InputError(`RankWeights: ${problem}`);
    const c = source.config;
    if (!Number.isInteger(ranks) || ranks < 1 || c.numExperts % ranks !== 0) {
      throw new InputError(
        `RankWeights: ${c.numExperts} experts cannot be split evenly among ${describeValue(ranks)} ranks`,
      );
    }
    if (!Number.isInteger(rank) || rank < 0 || rank >= ranks) {
      throw new InputError(
        `RankWeights: rank must be an integer in [0, ${ranks}), got ${describeValue(rank)}`,
      );
    }
    const local = c.numExperts / ranks;
    this.first = rank * local;
    const g = source.generated;
    if (g !== undefined) this.generated = { seed: g.seed, firstExpert: g.firstExpert + this.first };
    // Rows arrive routed (the rank's layer never runs the gate, so its router is one group), with at
    // most min(k, local experts) slots of this rank's experts (dispatch.ts).
    this.config = validateConfig({
      ...c,
      name: `${c.name}/ep${ranks}.${rank}`,
      numExperts: local,
      topK: Math.min(c.topK, local),
      router: { ...c.router, nGroup: 1, topkGroup: 1 },
      maxTokens,
    });
  }

  expert(e: number): RoutedExpertWeights {
    if (!Number.isInteger(e) || e < 0 || e >= this.config.numExperts) {
      throw new RangeError(`rank ${this.rank} holds experts 0..${this.config.numExperts - 1}, not ${e}`);
    }
    return this.source.expert(this.first + e);
  }

  shared(): ExpertWeights | null {
    return this.source.shared();
  }

  gate(): GateWeights {
    const g = this.source.gate();
    const { hidden, numExperts } = this.config;
    return {
      weight: g.weight.subarray(this.first * hidden, (this.first + numExperts) * hidden),
      bias: g.bias === null ? null : g.bias.subarray(this.first, this.first + numExperts),
    };
  }
}

export interface ExpertParallelOptions {
  /** Ranks the routed experts are split among (the experts must divide evenly). */
  ranks: number;
  /** Every rank's backend (default "cpu"). */
  backend?: Backend;
  /** "cuda": each rank's GPU, a Device or ordinal per rank, or one for all (default 0: every rank on GPU 0). */
  devices?: readonly (Device | number)[] | Device | number;
  pipeline?: GpuPipelineKind;
}

/** One rank's input to a forward: bf16 bits x [tokens, hidden] and its routing over the global experts. */
export interface RankInput {
  x: Uint16Array;
  tokens: number;
  ids: Int32Array;
  weights: Float32Array;
}

/** One rank's operands of `forwardDevice`: x and out on the rank's GPU, the routing on the host. */
export interface RankDeviceInput {
  /** bf16 [tokens, hidden] on the rank's device. */
  x: DeviceTensor;
  /** bf16 [tokens, hidden] on the rank's device, written. */
  out: DeviceTensor;
  tokens: number;
  /** int32 [tokens, topK] global expert ids (−1: unused slot), host memory: the dispatch is planned there. */
  ids: Int32Array;
  /** fp32 [tokens, topK], host memory. */
  weights: Float32Array;
}

/** What one forward moved and computed, per rank (for reports and tests). */
export interface ExpertParallelStats {
  /** Rows each rank received. */
  received: number[];
  /** Rows each rank sent to other ranks (its rows for itself stay). */
  sent: number[];
}

/**
 * One batch dealt out to `ranks` ranks in contiguous runs (rank s takes tokens [⌊sT/R⌋, ⌊(s+1)T/R⌋)) with
 * their routing: views, nothing copied. For trying a split layer on a batch made for one.
 */
export function splitAmongRanks(
  x: Uint16Array,
  tokens: number,
  routing: { ids: Int32Array; weights: Float32Array },
  hidden: number,
  topK: number,
  ranks: number,
): RankInput[] {
  const count = (name: string, v: number, min: number) => {
    if (!Number.isInteger(v) || v < min) {
      throw new InputError(`splitAmongRanks: ${name} must be an integer ≥ ${min}, got ${describeValue(v)}`);
    }
  };
  count("tokens", tokens, 0);
  count("hidden", hidden, 1);
  count("topK", topK, 1);
  count("ranks", ranks, 1);
  if (!(x instanceof Uint16Array) || x.length !== tokens * hidden) {
    throw new InputError(
      `splitAmongRanks: x must be a Uint16Array of tokens × hidden = ${tokens * hidden} bf16 values, got ${describeValue(x)}${x instanceof Uint16Array ? ` of ${x.length}` : ""}`,
    );
  }
  if (typeof routing !== "object" || routing === null) {
    throw new InputError(`splitAmongRanks: routing must be { ids, weights }, got ${describeValue(routing)}`);
  }
  const { ids, weights } = routing;
  if (!(ids instanceof Int32Array) || ids.length !== tokens * topK) {
    throw new InputError(
      `splitAmongRanks: routing.ids must be an Int32Array of tokens × topK = ${tokens * topK} ids, got ${describeValue(ids)}${ids instanceof Int32Array ? ` of ${ids.length}` : ""}`,
    );
  }
  if (!(weights instanceof Float32Array) || weights.length !== tokens * topK) {
    throw new InputError(
      `splitAmongRanks: routing.weights must be a Float32Array of tokens × topK = ${tokens * topK} weights, got ${describeValue(weights)}${weights instanceof Float32Array ? ` of ${weights.length}` : ""}`,
    );
  }
  return Array.from({ length: ranks }, (_, s) => {
    const a = Math.floor((s * tokens) / ranks);
    const b = Math.floor(((s + 1) * tokens) / ranks);
    return {
      x: x.subarray(a * hidden, b * hidden),
      tokens: b - a,
      ids: routing.ids.subarray(a * topK, b * topK),
      weights: routing.weights.subarray(a * topK, b * topK),
    };
  });
}

/** The ranks' arrays one after another, in rank order, in a new array of type `Type`. */
export function joinRankArrays<T extends Uint16Array | Int32Array>(
  parts: readonly T[],
  Type: new (length: number) => T,
): T {
  const joined = new Type(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    joined.set(p, at);
    at += p.length;
  }
  return joined;
}

/** The ranks' outputs one after another: the batch `splitAmongRanks` dealt out, back in one piece. */
export function joinRankOutputs(outs: readonly Uint16Array[]): Uint16Array {
  // Checked here: joinRankArrays would fail inside reduce() with "Cannot read properties of null".
  if (!Array.isArray(outs)) {
    throw new InputError(
      `joinRankOutputs: expected an array of the ranks' outputs, got ${describeValue(outs)}`,
    );
  }
  const bad = outs.findIndex((o) => !(o instanceof Uint16Array));
  if (bad >= 0) {
    throw new InputError(
      `joinRankOutputs: rank ${bad}'s output must be a Uint16Array of bf16 bits, got ${describeValue(outs[bad])}`,
    );
  }
  return joinRankArrays(outs, Uint16Array);
}

/** forward's and forwardDevice's options: a misspelt or mistyped `shared` would be ignored without a word. */
function checkForwardOptions(options: unknown, known: readonly string[] = ["shared"]): void {
  checkOptions("ExpertParallelMoE forward options", options, known);
  const { shared, onProgress } = (options ?? {}) as { shared?: unknown; onProgress?: unknown };
  if (shared !== undefined && typeof shared !== "boolean") {
    throw new InputError(
      `ExpertParallelMoE forward options.shared must be true or false, got ${describeValue(shared)}`,
    );
  }
  if (onProgress !== undefined && typeof onProgress !== "function") {
    throw new InputError(
      `ExpertParallelMoE forward options.onProgress must be a function, got ${describeValue(onProgress)}`,
    );
  }
}

/** The rows a rank received, bf16 [rows.count, hidden], gathered from the sources' x on the host. */
export function gatherReceived(
  rows: ReceivedRows,
  inputs: readonly RankInput[],
  hidden: number,
): Uint16Array {
  const x = new Uint16Array(rows.count * hidden);
  for (let r = 0; r < rows.count; r++) {
    const t = rows.sourceToken[r]!;
    x.set(inputs[rows.sourceRank[r]!]!.x.subarray(t * hidden, (t + 1) * hidden), r * hidden);
  }
  return x;
}

/** A rank's tokens through its layer's shared expert alone (every routed slot masked), bf16 [tokens, hidden]. */
export function sharedExpertAlone(layer: MoELayer, input: RankInput): Uint16Array {
  const k = layer.config.topK;
  const routing = {
    ids: new Int32Array(input.tokens * k).fill(-1),
    weights: new Float32Array(input.tokens * k),
  };
  return layer.forward(input.x, input.tokens, { routing, shared: true }).out;
}

/**
 * out[t] = bf16(f32(S[t]) + Σ_d f32(P_d[slot_d[t]])), the sum in fp32 in rank order (see the module doc).
 * `shared` null: no shared expert. Pure: the combine every backend's result is checked against.
 */
export function combineRankOutputs(
  tokens: number,
  hidden: number,
  shared: Uint16Array | null,
  partials: readonly Uint16Array[],
  slot: readonly Int32Array[],
): Uint16Array {
  const out = new Uint16Array(tokens * hidden);
  const acc = new Float32Array(hidden);
  for (let t = 0; t < tokens; t++) {
    if (shared === null) acc.fill(0);
    else for (let h = 0; h < hidden; h++) acc[h] = bf16BitsToF32(shared[t * hidden + h]!);
    for (let d = 0; d < partials.length; d++) {
      const row = slot[d]![t]!;
      if (row < 0) continue;
      const p = partials[d]!;
      for (let h = 0; h < hidden; h++) acc[h] += bf16BitsToF32(p[row * hidden + h]!);
    }
    for (let h = 0; h < hidden; h++) out[t * hidden + h] = f32ToBf16Bits(acc[h]!);
  }
  return out;
}

export class ExpertParallelMoE {
  /** The whole layer's config (all experts). */
  readonly config: ValidatedConfig;
  readonly ranks: number;
  /** Each rank's layer: its experts and the shared expert, sized for every rank's tokens at once. */
  readonly layers: readonly MoELayer[];
  private readonly buffers: RankBuffers[] | null = null;
  private disposed = false;

  /** `source.config` may be raw (validated here, once) or already validated. */
  constructor(source: MoEWeightSource, options: ExpertParallelOptions) {
    const problem = weightSourceProblem(source);
    if (problem !== null) throw new InputError(`ExpertParallelMoE: ${problem}`);
    if (options === undefined) throw new InputError("ExpertParallelMoE needs options with ranks");
    checkOptions("ExpertParallelMoE options", options, ["ranks", "backend", "devices", "pipeline"]);
    this.config = validateConfig(source.config); // returns at once for a validated config
    const { ranks } = options;
    if (!Number.isInteger(ranks) || ranks < 1 || this.config.numExperts % ranks !== 0) {
      throw new InputError(`${this.config.numExperts} experts cannot be split evenly among ${ranks} ranks`);
    }
    this.ranks = ranks;
    const devices = options.devices ?? 0;
    const deviceOf = (d: number): Device | number => {
      if (!Array.isArray(devices)) return devices as Device | number;
      if (devices.length !== ranks) {
        throw new InputError(`devices lists ${devices.length} GPUs for ${ranks} ranks`);
      }
      return devices[d]!;
    };
    // A rank may receive every rank's tokens.
    const received = Math.min(MAX_TOKENS_LIMIT, ranks * this.config.maxTokens);
    const layers: MoELayer[] = [];
    try {
      for (let d = 0; d < ranks; d++) {
        const weights = new RankWeights(source, d, ranks, received);
        const device = options.backend === "cuda" ? deviceOf(d) : undefined;
        layers.push(new MoELayer(weights, { backend: options.backend, device, pipeline: options.pipeline }));
      }
    } catch (e) {
      for (const l of layers) l.dispose();
      throw e;
    }
    this.layers = layers;
    if (options.backend === "cuda") {
      try {
        this.buffers = makeRankBuffers(this.config, layers);
      } catch (e) {
        for (const l of layers) l.dispose();
        throw e;
      }
    }
  }

  /** Frees every rank's device memory. Idempotent. */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    for (const b of this.buffers ?? []) b.dispose();
    for (const l of this.layers) l.dispose();
  }

  /** The dispatch a forward would do for these inputs (checked as `forward` checks them). */
  plan(inputs: readonly RankInput[]): DispatchPlan {
    if (!Array.isArray(inputs)) {
      throw new InputError(`expected an array of one input per rank, got ${describeValue(inputs)}`);
    }
    if (inputs.length !== this.ranks) {
      throw new InputError(`expected one input per rank (${this.ranks}), got ${inputs.length}`);
    }
    inputs.forEach((input, s) => {
      checkRankRouting(input, s);
      // A rank may have no tokens in a step; it still serves the others' rows.
      if (input.tokens === 0 && input.x instanceof Uint16Array && input.x.length === 0) return;
      try {
        validateInput(input.x, input.tokens, this.config);
      } catch (e) {
        throw new InputError(`rank ${s}: ${(e as Error).message}`);
      }
    });
    return this.planRouting(inputs);
  }

  /**
   * One forward over every rank's tokens: returns each rank's output, bf16 bits [tokens, hidden], and
   * what moved. `shared` false leaves the shared expert out (default: in, when the config has one).
   * `onProgress(done, total)`: on the "cpu" backend, called after each rank's routed and shared pass
   * (a CPU forward of a large layer takes minutes); on "cuda", once at the end.
   */
  forward(
    inputs: readonly RankInput[],
    options: { shared?: boolean; onProgress?: (done: number, total: number) => void } = {},
  ): { out: Uint16Array[]; stats: ExpertParallelStats } {
    if (this.disposed) throw new InputError("ExpertParallelMoE used after dispose()");
    checkForwardOptions(options, ["shared", "onProgress"]);
    if (this.buffers !== null) {
      const result = this.forwardThroughDevices(inputs, options);
      options.onProgress?.(1, 1);
      return result;
    }
    const plan = this.plan(inputs);
    const { hidden } = this.config;
    const withShared = (options.shared ?? true) && this.config.numShared > 0;
    const passes =
      plan.received.filter((rows) => rows.count > 0).length +
      (withShared ? inputs.filter((input) => input.tokens > 0).length : 0);
    let done = 0;
    // Dispatch: rank d gathers the rows it was sent, in the plan's order.
    const partials = plan.received.map((rows, d) => {
      if (rows.count === 0) return new Uint16Array(0);
      const routing = { ids: rows.ids, weights: rows.weights };
      const x = gatherReceived(rows, inputs, hidden);
      const partial = this.layers[d]!.forward(x, rows.count, { routing, shared: false }).out;
      options.onProgress?.(++done, passes);
      return partial;
    });
    // Combine: each rank adds its tokens' results from every rank to its own shared expert.
    const out = inputs.map((input, s) => {
      let shared: Uint16Array | null = null;
      if (withShared && input.tokens > 0) {
        shared = sharedExpertAlone(this.layers[s]!, input);
        options.onProgress?.(++done, passes);
      }
      return combineRankOutputs(input.tokens, hidden, shared, partials, plan.slot[s]!);
    });
    return { out, stats: statsOf(plan) };
  }

  /** `forward` on the "cuda" backend: the inputs uploaded to each rank's GPU, `forwardDevice`, the outputs back. */
  private forwardThroughDevices(
    inputs: readonly RankInput[],
    options: { shared?: boolean },
  ): { out: Uint16Array[]; stats: ExpertParallelStats } {
    const plan = this.plan(inputs); // checks everything before anything is uploaded
    const buffers = this.buffers!;
    const { hidden } = this.config;
    const device = inputs.map((input, s) => {
      const b = buffers[s]!;
      const shape = [input.tokens, hidden];
      const x = b.ownX.view(shape);
      if (input.tokens > 0) x.copyFromHost(input.x);
      return { x, out: b.ownOut.view(shape), tokens: input.tokens, ids: input.ids, weights: input.weights };
    });
    const stats = this.runOnDevices(device, plan, options);
    const out = device.map((d) => (d.tokens === 0 ? new Uint16Array(0) : (d.out.toHost() as Uint16Array)));
    return { out, stats };
  }

  /**
   * One forward with every activation on the GPUs ("cuda" backend): rank s's x and out on rank s's
   * device, its routing on the host (see the module doc). Waits for the result.
   */
  forwardDevice(inputs: readonly RankDeviceInput[], options: { shared?: boolean } = {}): ExpertParallelStats {
    if (this.disposed) throw new InputError("ExpertParallelMoE used after dispose()");
    const buffers = this.buffers;
    if (buffers === null) throw new InputError(`forwardDevice needs the "cuda" backend`);
    checkForwardOptions(options);
    if (inputs.length !== this.ranks) {
      throw new InputError(`expected one input per rank (${this.ranks}), got ${inputs.length}`);
    }
    inputs.forEach((input, s) => {
      checkRankRouting(input, s);
      checkDeviceInput(input, s, buffers[s]!.device, this.config);
    });
    return this.runOnDevices(inputs, this.planRouting(inputs), options);
  }

  /** forwardDevice's work on checked inputs and their plan. */
  private runOnDevices(
    inputs: readonly RankDeviceInput[],
    plan: DispatchPlan,
    options: { shared?: boolean },
  ): ExpertParallelStats {
    const buffers = this.buffers!;
    const { hidden } = this.config;
    const k = plan.localTopK;
    const rowBytes = hidden * 2;
    // Dispatch: each receiver's routing, then each source's rows straight into the receivers' buffers.
    plan.received.forEach((rows, d) => {
      if (rows.count === 0) return;
      buffers[d]!.recvIds.view([rows.count, k]).copyFromHost(rows.ids);
      buffers[d]!.recvWeights.view([rows.count, k]).copyFromHost(rows.weights);
    });
    inputs.forEach((input, s) => {
      const b = buffers[s]!;
      const { tokens: index, runs } = sentRows(plan, s);
      if (index.length === 0) return;
      b.gatherIndex.view([index.length]).copyFromHost(index);
      for (const run of runs) {
        const into = buffers[run.rank]!.recvX.ptr + BigInt(run.firstRow * rowBytes);
        gatherRowsOnDevice(
          b.device,
          input.x.ptr,
          b.gatherIndex.ptr + BigInt(run.at * 4),
          into,
          run.rows,
          rowBytes,
          null,
        );
      }
    });
    synchronizeAll(buffers);
    // Experts: each rank's layer on the rows it received.
    plan.received.forEach((rows, d) => {
      if (rows.count === 0) return;
      const b = buffers[d]!;
      this.layers[d]!.forwardDevice({
        x: b.recvX.view([rows.count, hidden]),
        ids: b.recvIds.view([rows.count, k]),
        weights: b.recvWeights.view([rows.count, k]),
        out: b.partial.view([rows.count, hidden]),
        tokens: rows.count,
        shared: false,
      });
    });
    // Each rank's shared expert on its own tokens (every routed slot masked).
    const withShared = (options.shared ?? true) && this.config.numShared > 0;
    if (withShared) {
      inputs.forEach((input, s) => {
        if (input.tokens === 0) return;
        const b = buffers[s]!;
        this.layers[s]!.forwardDevice({
          x: input.x,
          ids: b.maskedIds.view([input.tokens, k]),
          weights: b.maskedWeights.view([input.tokens, k]),
          out: b.shared.view([input.tokens, hidden]),
          tokens: input.tokens,
          shared: true,
        });
      });
    }
    for (const l of this.layers) l.checkStatus(); // waits for each rank's device
    // Combine: each rank reads its tokens' results where the other ranks left them.
    inputs.forEach((input, s) => {
      if (input.tokens === 0) return;
      const b = buffers[s]!;
      const slots = new Int32Array(this.ranks * input.tokens);
      plan.slot[s]!.forEach((slot, d) => {
        slots.set(slot, d * input.tokens);
      });
      b.slot.view([slots.length]).copyFromHost(slots);
      combineRanksOnDevice(
        b.device,
        {
          out: input.out.ptr,
          shared: withShared ? b.shared.ptr : null,
          partials: b.partialPointers.ptr,
          slot: b.slot.ptr,
          ranks: this.ranks,
          tokens: input.tokens,
          hidden,
        },
        null,
      );
    });
    synchronizeAll(buffers);
    return statsOf(plan);
  }

  /** planDispatch with the routing checks of `plan` (InputError). */
  private planRouting(
    inputs: readonly { ids: Int32Array; weights: Float32Array; tokens: number }[],
  ): DispatchPlan {
    const routing: RankRouting[] = inputs.map((i) => ({ ids: i.ids, weights: i.weights, tokens: i.tokens }));
    try {
      const plan = planDispatch(routing, this.config.numExperts, this.config.topK);
      // The ids are in range (planDispatch); the rest of the one-device layer's routing checks.
      routing.forEach((r, s) => {
        try {
          validateRouting(r.ids, r.weights, r.tokens, this.config);
        } catch (e) {
          throw new DispatchError(`rank ${s}: ${(e as Error).message}`);
        }
      });
      plan.received.forEach((rows, d) => {
        // Only when ranks × maxTokens passes the layers' cap can a rank be sent more than it holds.
        const limit = this.layers[d]!.config.maxTokens;
        if (rows.count > limit) {
          throw new DispatchError(
            `rank ${d} would receive ${rows.count} rows, more than its layer's ${limit} (ranks × maxTokens is capped at ${MAX_TOKENS_LIMIT})`,
          );
        }
      });
      return plan;
    } catch (e) {
      if (e instanceof DispatchError) throw new InputError(e.message);
      throw e;
    }
  }
}

/** A rank's input is an object with an Int32Array of ids and a Float32Array of weights (the rest: validateRouting). */
function checkRankRouting(input: unknown, s: number): void {
  if (typeof input !== "object" || input === null) {
    throw new InputError(`rank ${s}: input must be { x, tokens, ids, weights }, got ${describeValue(input)}`);
  }
  const { ids, weights } = input as { ids: unknown; weights: unknown };
  if (!(ids instanceof Int32Array)) {
    throw new InputError(`rank ${s}: ids must be an Int32Array, got ${describeValue(ids)}`);
  }
  if (!(weights instanceof Float32Array)) {
    throw new InputError(`rank ${s}: weights must be a Float32Array, got ${describeValue(weights)}`);
  }
}

function checkDeviceInput(input: RankDeviceInput, s: number, device: Device, config: MoEConfig): void {
  const t = input.tokens;
  if (!Number.isInteger(t) || t < 0 || t > config.maxTokens) {
    throw new InputError(`rank ${s}: tokens must be an integer in [0, ${config.maxTokens}], got ${t}`);
  }
  try {
    expectOperand("forwardDevice", "x", input.x, "bf16", [t, config.hidden], device);
    expectOperand("forwardDevice", "out", input.out, "bf16", [t, config.hidden], device);
  } catch (e) {
    throw new InputError(`rank ${s}: ${(e as Error).message}`);
  }
}

function statsOf(plan: DispatchPlan): ExpertParallelStats {
  const sent = plan.slot.map((_, s) =>
    plan.received.reduce(
      (n, into, d) => (d === s ? n : n + into.sourceStart[s + 1]! - into.sourceStart[s]!),
      0,
    ),
  );
  return { received: plan.received.map((r) => r.count), sent };
}

/** One rank's device buffers, sized for the most it can receive and send in one forward. */
class RankBuffers {
  private readonly owned: DeviceTensor[] = [];
  readonly recvX: DeviceTensor;
  readonly recvIds: DeviceTensor;
  readonly recvWeights: DeviceTensor;
  readonly partial: DeviceTensor;
  readonly shared: DeviceTensor;
  readonly maskedIds: DeviceTensor;
  readonly maskedWeights: DeviceTensor;
  readonly gatherIndex: DeviceTensor;
  readonly slot: DeviceTensor;
  /** uint64 [ranks] as bytes: every rank's `partial` address, for the combine. */
  readonly partialPointers: DeviceTensor;
  /** The host path's staging of x and out. */
  readonly ownX: DeviceTensor;
  readonly ownOut: DeviceTensor;

  constructor(
    readonly device: Device,
    config: MoEConfig,
    ranks: number,
    received: number,
    localTopK: number,
  ) {
    const { hidden, maxTokens } = config;
    const make = (dtype: "bf16" | "int32" | "fp32" | "uint8", shape: number[]) => {
      const t = DeviceTensor.empty(device, dtype, shape);
      this.owned.push(t);
      return t;
    };
    try {
      this.recvX = make("bf16", [received, hidden]);
      this.recvIds = make("int32", [received, localTopK]);
      this.recvWeights = make("fp32", [received, localTopK]);
      this.partial = make("bf16", [received, hidden]);
      this.shared = make("bf16", [maxTokens, hidden]);
      this.maskedIds = make("int32", [maxTokens, localTopK]);
      this.maskedIds.fill(0xff); // −1 in every slot
      this.maskedWeights = make("fp32", [maxTokens, localTopK]);
      this.maskedWeights.fill(0);
      this.gatherIndex = make("int32", [ranks * maxTokens]);
      this.slot = make("int32", [ranks * maxTokens]);
      this.partialPointers = make("uint8", [ranks * 8]);
      this.ownX = make("bf16", [maxTokens, hidden]);
      this.ownOut = make("bf16", [maxTokens, hidden]);
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  dispose(): void {
    for (const t of this.owned) t.dispose();
    this.owned.length = 0;
  }
}

/** Every rank's buffers, each rank's GPU given peer access to every other rank's GPU. */
function makeRankBuffers(config: MoEConfig, layers: readonly MoELayer[]): RankBuffers[] {
  const devices = layers.map((l) => l.device!);
  for (const a of devices) {
    for (const b of devices) {
      if (a === b || a.handle === b.handle) continue;
      if (!a.canAccessPeer(b)) {
        throw new InputError(
          `GPU ${a.ordinal} cannot reach GPU ${b.ordinal}'s memory (no peer access): expert-parallel ranks need it`,
        );
      }
      a.enablePeerAccess(b);
    }
  }
  const buffers: RankBuffers[] = [];
  try {
    layers.forEach((l, d) => {
      buffers.push(new RankBuffers(devices[d]!, config, layers.length, l.config.maxTokens, l.config.topK));
    });
    const pointers = new BigUint64Array(buffers.map((b) => b.partial.ptr));
    for (const b of buffers) b.partialPointers.copyFromHost(new Uint8Array(pointers.buffer));
  } catch (e) {
    for (const b of buffers) b.dispose();
    throw e;
  }
  return buffers;
}

/** Waits for every rank's GPU (each distinct device once). */
function synchronizeAll(buffers: readonly RankBuffers[]): void {
  for (const device of new Set(buffers.map((b) => b.device))) device.synchronize();
}
