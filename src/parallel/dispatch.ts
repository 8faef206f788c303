/**
 * Expert parallelism's bookkeeping: which token rows travel from which rank to which, and how their
 * results come back. Pure (no CUDA), shared by every backend.
 *
 * The routed experts are split into `ranks` contiguous blocks of E / ranks: global expert e lives on rank
 * ⌊e / (E / ranks)⌋ as its local expert e mod (E / ranks). A token goes to each rank that holds at least
 * one of its experts, once (not once per slot, as DeepEP does), carrying the slots of that rank's experts
 * with their ids made local, in their original order, in min(k, E / ranks) slots (the rest masked: −1,
 * weight 0). Rank d receives its rows in a fixed order: by source rank, then by token, so both ends know
 * where each row sits without a handshake.
 */
import { describeValue } from "../config/config.js";

/** One rank's routing as it enters the layer: global expert ids (−1: unused slot) and their weights. */
export interface RankRouting {
  /** int32 [tokens, topK], global expert ids in [−1, E). */
  ids: Int32Array;
  /** fp32 [tokens, topK]. */
  weights: Float32Array;
  tokens: number;
}

/** The rows one rank receives, in order of source rank, then token. */
export interface ReceivedRows {
  count: number;
  /** The source rank of each row. */
  sourceRank: Int32Array;
  /** The row's token index on its source rank. */
  sourceToken: Int32Array;
  /** int32 [ranks + 1]: the rows from source rank s are [sourceStart[s], sourceStart[s + 1]). */
  sourceStart: Int32Array;
  /** int32 [count, localTopK]: the row's slots on this rank, local ids in their original order, −1 after. */
  ids: Int32Array;
  /** fp32 [count, localTopK]: those slots' weights, 0 where masked. */
  weights: Float32Array;
}

export interface DispatchPlan {
  ranks: number;
  localExperts: number;
  topK: number;
  /** Slots of a received row: min(topK, localExperts), all a token can use on one rank. */
  localTopK: number;
  /** received[d]: what rank d receives. */
  received: ReceivedRows[];
  /**
   * slot[s][d]: int32 [tokens of rank s]: the row of received[d] holding that token, or −1 when the
   * token has no expert on rank d. The combine reads rank d's result for token t of rank s there.
   */
  slot: Int32Array[][];
}

export class DispatchError extends Error {
  override name = "DispatchError";
}

/** Throws DispatchError unless rank s's routing has the RankRouting fields, of their kinds. */
function checkRankRouting(r: unknown, s: number): void {
  if (typeof r !== "object" || r === null) {
    throw new DispatchError(
      `planDispatch: routing[${s}] must be { ids, weights, tokens }, got ${describeValue(r)}`,
    );
  }
  const { ids, weights, tokens } = r as Partial<RankRouting>;
  if (!(ids instanceof Int32Array)) {
    throw new DispatchError(
      `planDispatch: routing[${s}].ids must be an Int32Array, got ${describeValue(ids)}`,
    );
  }
  if (!(weights instanceof Float32Array)) {
    throw new DispatchError(
      `planDispatch: routing[${s}].weights must be a Float32Array, got ${describeValue(weights)}`,
    );
  }
  if (typeof tokens !== "number" || !Number.isInteger(tokens) || tokens < 0) {
    throw new DispatchError(
      `planDispatch: routing[${s}].tokens must be a non-negative integer, got ${describeValue(tokens)}`,
    );
  }
}

/**
 * Plans one forward's dispatch for `routing[s]`, the routing of rank s's tokens. Throws DispatchError
 * naming the argument on one of the wrong kind (a routing without weights, a config where numExperts
 * goes), on an id outside [−1, numExperts) or a rank count that does not divide the experts.
 */
export function planDispatch(
  routing: readonly RankRouting[],
  numExperts: number,
  topK: number,
): DispatchPlan {
  if (!Array.isArray(routing)) {
    throw new DispatchError(
      `planDispatch: routing must be an array of one routing per rank, got ${describeValue(routing)}`,
    );
  }
  const ranks = routing.length;
  if (ranks < 1) throw new DispatchError("expert parallelism needs at least one rank");
  if (typeof numExperts !== "number" || !Number.isInteger(numExperts) || numExperts < 1) {
    throw new DispatchError(
      `planDispatch: numExperts must be a positive integer, got ${describeValue(numExperts)}`,
    );
  }
  if (typeof topK !== "number" || !Number.isInteger(topK) || topK < 1) {
    throw new DispatchError(`planDispatch: topK must be a positive integer, got ${describeValue(topK)}`);
  }
  if (numExperts < ranks || numExperts % ranks !== 0) {
    throw new DispatchError(`${numExperts} experts cannot be split evenly among ${ranks} ranks`);
  }
  routing.forEach(checkRankRouting);
  const localExperts = numExperts / ranks;
  const localTopK = Math.min(topK, localExperts);
  // First pass: which ranks each token visits, and how many rows each rank receives from each source.
  const fromSource = Array.from({ length: ranks }, () => new Int32Array(ranks));
  const visits: Uint8Array[] = routing.map((r, s) => {
    if (r.ids.length !== r.tokens * topK || r.weights.length !== r.tokens * topK) {
      throw new DispatchError(
        `rank ${s}: ids and weights must hold tokens × topK = ${r.tokens} × ${topK} values, got ${r.ids.length} and ${r.weights.length}`,
      );
    }
    const v = new Uint8Array(r.tokens * ranks);
    for (let t = 0; t < r.tokens; t++) {
      for (let j = 0; j < topK; j++) {
        const e = r.ids[t * topK + j]!;
        if (e === -1) continue;
        if (e < -1 || e >= numExperts) {
          throw new DispatchError(
            `rank ${s} token ${t} slot ${j}: expert id ${e} is outside [-1, ${numExperts})`,
          );
        }
        const d = Math.floor(e / localExperts);
        if (v[t * ranks + d] === 0) {
          v[t * ranks + d] = 1;
          fromSource[d]![s]! += 1;
        }
      }
    }
    return v;
  });
  const received: ReceivedRows[] = fromSource.map((bySource) => {
    const sourceStart = new Int32Array(ranks + 1);
    for (let src = 0; src < ranks; src++) sourceStart[src + 1] = sourceStart[src]! + bySource[src]!;
    const count = sourceStart[ranks]!;
    return {
      count,
      sourceRank: new Int32Array(count),
      sourceToken: new Int32Array(count),
      sourceStart,
      ids: new Int32Array(count * localTopK).fill(-1),
      weights: new Float32Array(count * localTopK),
    };
  });
  const slot = routing.map((r) => Array.from({ length: ranks }, () => new Int32Array(r.tokens).fill(-1)));
  const next = new Array<number>(ranks).fill(0);
  routing.forEach((r, s) => {
    const v = visits[s]!;
    for (let t = 0; t < r.tokens; t++) {
      for (let d = 0; d < ranks; d++) {
        if (v[t * ranks + d] === 0) continue;
        const row = next[d]!++;
        const into = received[d]!;
        into.sourceRank[row] = s;
        into.sourceToken[row] = t;
        slot[s]![d]![t] = row;
        let used = 0;
        for (let j = 0; j < topK; j++) {
          const e = r.ids[t * topK + j]!;
          if (e === -1 || Math.floor(e / localExperts) !== d) continue;
          into.ids[row * localTopK + used] = e - d * localExperts;
          into.weights[row * localTopK + used] = r.weights[t * topK + j]!;
          used++;
        }
      }
    }
  });
  return { ranks, localExperts, topK, localTopK, received, slot };
}

/** A run of one source's rows on one receiver: `rows` rows from row `firstRow` of received[rank]. */
export interface SentRun {
  rank: number;
  firstRow: number;
  rows: number;
  /** Where the run's tokens start in `SentRows.tokens`. */
  at: number;
}

/** What source rank s sends: its token indices receiver by receiver (each run in token order), and the runs. */
export interface SentRows {
  tokens: Int32Array;
  runs: SentRun[];
}

/**
 * The rows source rank `s` sends, read off the plan: on receiver d they are the consecutive rows
 * [sourceStart[s], sourceStart[s + 1]), holding the tokens sourceToken lists there. Its own rows
 * (d = s) are a run like any other.
 */
export function sentRows(plan: DispatchPlan, s: number): SentRows {
  if (typeof plan !== "object" || plan === null || !Array.isArray(plan.received)) {
    throw new DispatchError(`sentRows: plan must be a planDispatch result, got ${describeValue(plan)}`);
  }
  if (!Number.isInteger(s) || s < 0 || s >= plan.received.length) {
    throw new DispatchError(
      `sentRows: rank must be an integer in [0, ${plan.received.length}), got ${describeValue(s)}`,
    );
  }
  const runs: SentRun[] = [];
  let total = 0;
  plan.received.forEach((into, d) => {
    const firstRow = into.sourceStart[s]!;
    const rows = into.sourceStart[s + 1]! - firstRow;
    if (rows === 0) return;
    runs.push({ rank: d, firstRow, rows, at: total });
    total += rows;
  });
  const tokens = new Int32Array(total);
  for (const run of runs) {
    const from = plan.received[run.rank]!.sourceToken;
    tokens.set(from.subarray(run.firstRow, run.firstRow + run.rows), run.at);
  }
  return { tokens, runs };
}
