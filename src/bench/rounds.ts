/**
 * Interleaved timing: the runs of several measurements split into rounds, each round timing every
 * measurement in turn, so that a slow drift of the machine (clocks, heat, a neighbour) lands on all
 * of them alike instead of on whichever was timed last.
 */

/** What timeInRounds needs of one measurement; it appends to `samples` and may set `error`. */
export interface RoundsMeasurement {
  /** A failure of a graph measurement is recorded in `error` (and it is skipped from then on); any other is thrown. */
  graph: boolean;
  /** Warm-up runs before the first round's samples; later rounds take one. */
  warmup: number;
  /** Called around each round's runs (e.g. forcing a configuration), `leave` also after a failure. */
  enter?: () => void;
  leave?: () => void;
  samples: number[];
  error?: string;
}

/**
 * Times every measurement in `rounds` rounds of ceil(iters / rounds) runs. `time` runs one
 * measurement's warm-ups and runs and returns the runs' samples; `afterEach` is called after each
 * (e.g. a status check that throws).
 */
export function timeInRounds<M extends RoundsMeasurement>(
  measurements: readonly M[],
  rounds: number,
  iters: number,
  time: (m: M, warmup: number, iters: number) => readonly number[],
  afterEach?: (m: M) => void,
): void {
  if (!Number.isInteger(rounds) || rounds < 1 || rounds > iters) {
    throw new RangeError(`rounds must be an integer in [1, iters = ${iters}], got ${rounds}`);
  }
  const perRound = Math.ceil(iters / rounds);
  for (let r = 0; r < rounds; r++) {
    for (const m of measurements) {
      if (m.error !== undefined) continue;
      m.enter?.();
      try {
        m.samples.push(...time(m, r === 0 ? m.warmup : 1, perRound));
      } catch (e) {
        if (!m.graph) throw e;
        m.error = (e instanceof Error ? e.message : String(e)).split("\n")[0] ?? "";
      } finally {
        m.leave?.();
      }
      afterEach?.(m);
    }
  }
}
