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
 * The ranks' layers are MoELayers, so each rank runs whichever backend and GPU pipeline it is given;
 * rows cross between ranks through the host here (the protocol, checkable on one GPU or none).
 */
import { MAX_TOKENS_LIMIT, type MoEConfig, validateConfig } from "../config/config.js";
import type { Device } from "../cuda/index.js";
import { type Backend, type GpuPipelineKind, InputError, MoELayer, validateInput } from "../layer.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../numerics/bf16.js";
import type { ExpertWeights, GateWeights, MoEWeightSource } from "../weights/types.js";
import { DispatchError, type DispatchPlan, planDispatch, type RankRouting } from "./dispatch.js";

/** One rank's share of a layer's weights: its block of routed experts, the shared expert, its gate rows. */
export class RankWeights implements MoEWeightSource {
  readonly config: MoEConfig;
  private readonly first: number;

  constructor(
    private readonly source: MoEWeightSource,
    readonly rank: number,
    readonly ranks: number,
    maxTokens: number,
  ) {
    const c = source.config;
    const local = c.numExperts / ranks;
    this.first = rank * local;
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

  expert(e: number): ExpertWeights {
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

/** What one forward moved and computed, per rank (for reports and tests). */
export interface ExpertParallelStats {
  /** Rows each rank received. */
  received: number[];
  /** Rows each rank sent to other ranks (its rows for itself stay). */
  sent: number[];
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
  readonly config: MoEConfig;
  readonly ranks: number;
  /** Each rank's layer: its experts and the shared expert, sized for every rank's tokens at once. */
  readonly layers: readonly MoELayer[];
  private disposed = false;

  constructor(source: MoEWeightSource, options: ExpertParallelOptions) {
    this.config = validateConfig(source.config);
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
        layers.push(
          options.backend === "cuda"
            ? new MoELayer(weights, { backend: "cuda", device: deviceOf(d), pipeline: options.pipeline })
            : new MoELayer(weights, { backend: options.backend, pipeline: options.pipeline }),
        );
      }
    } catch (e) {
      for (const l of layers) l.dispose();
      throw e;
    }
    this.layers = layers;
  }

  /** Frees every rank's device memory. Idempotent. */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    for (const l of this.layers) l.dispose();
  }

  /** The dispatch a forward would do for these inputs (checked as `forward` checks them). */
  plan(inputs: readonly RankInput[]): DispatchPlan {
    if (inputs.length !== this.ranks) {
      throw new InputError(`expected one input per rank (${this.ranks}), got ${inputs.length}`);
    }
    inputs.forEach((input, s) => {
      // A rank may have no tokens in a step; it still serves the others' rows.
      if (input.tokens === 0 && input.x instanceof Uint16Array && input.x.length === 0) return;
      try {
        validateInput(input.x, input.tokens, this.config);
      } catch (e) {
        throw new InputError(`rank ${s}: ${(e as Error).message}`);
      }
    });
    const routing: RankRouting[] = inputs.map((i) => ({ ids: i.ids, weights: i.weights, tokens: i.tokens }));
    try {
      const plan = planDispatch(routing, this.config.numExperts, this.config.topK);
      routing.forEach((r, s) => {
        for (let i = 0; i < r.weights.length; i++) {
          if (!Number.isFinite(r.weights[i]!)) {
            throw new DispatchError(
              `rank ${s} token ${Math.floor(i / this.config.topK)}: weight ${r.weights[i]} is not finite`,
            );
          }
        }
      });
      return plan;
    } catch (e) {
      if (e instanceof DispatchError) throw new InputError(e.message);
      throw e;
    }
  }

  /**
   * One forward over every rank's tokens: returns each rank's output, bf16 bits [tokens, hidden], and
   * what moved. `shared` false leaves the shared expert out (default: in, when the config has one).
   */
  forward(
    inputs: readonly RankInput[],
    options: { shared?: boolean } = {},
  ): { out: Uint16Array[]; stats: ExpertParallelStats } {
    if (this.disposed) throw new InputError("ExpertParallelMoE used after dispose()");
    const plan = this.plan(inputs);
    const { hidden } = this.config;
    // Dispatch: rank d gathers the rows it was sent, in the plan's order.
    const partials = plan.received.map((rows, d) => {
      if (rows.count === 0) return new Uint16Array(0);
      const x = new Uint16Array(rows.count * hidden);
      for (let r = 0; r < rows.count; r++) {
        const from = inputs[rows.sourceRank[r]!]!.x;
        const t = rows.sourceToken[r]!;
        x.set(from.subarray(t * hidden, (t + 1) * hidden), r * hidden);
      }
      const routing = { ids: rows.ids, weights: rows.weights };
      return this.layers[d]!.forward(x, rows.count, { routing, shared: false }).out;
    });
    // Combine: each rank adds its tokens' results from every rank to its own shared expert.
    const withShared = (options.shared ?? true) && this.config.numShared > 0;
    const out = inputs.map((input, s) => {
      let shared: Uint16Array | null = null;
      if (withShared && input.tokens > 0) {
        const k = this.layers[s]!.config.topK;
        const masked = {
          ids: new Int32Array(input.tokens * k).fill(-1),
          weights: new Float32Array(input.tokens * k),
        };
        shared = this.layers[s]!.forward(input.x, input.tokens, { routing: masked, shared: true }).out;
      }
      return combineRankOutputs(input.tokens, hidden, shared, partials, plan.slot[s]!);
    });
    const sent = inputs.map((_, s) =>
      plan.slot[s]!.reduce(
        (n, rows, d) => (d === s ? n : n + rows.reduce((k, r) => k + (r >= 0 ? 1 : 0), 0)),
        0,
      ),
    );
    return { out, stats: { received: plan.received.map((r) => r.count), sent } };
  }
}
