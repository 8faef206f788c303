/**
 * The routed experts a weight source keeps in memory (generated or read from a file on demand), least
 * recently used evicted first: both sources' `expert(e)` go through it.
 */
import { describeValue, type MoEConfig } from "../config/config.js";
import type { RoutedExpertWeights } from "./types.js";

/** Throws RangeError unless e is an expert index of `config`. */
export function checkExpertIndex(config: MoEConfig, e: number): void {
  if (!Number.isInteger(e) || e < 0 || e >= config.numExperts) {
    throw new RangeError(
      `expert index must be an integer in [0, ${config.numExperts}), got ${describeValue(e)}`,
    );
  }
}

export class ExpertCache {
  /** Insertion order is recency order: a hit is moved to the end, the first key is evicted. */
  private readonly experts = new Map<number, RoutedExpertWeights>();

  constructor(
    private readonly config: MoEConfig,
    private readonly limit: number,
  ) {
    if (!Number.isInteger(limit) || limit < 1) {
      throw new RangeError(`cachedExperts must be a positive integer, got ${describeValue(limit)}`);
    }
  }

  /** Expert e, made by `make` when it is not held. */
  get(e: number, make: () => RoutedExpertWeights): RoutedExpertWeights {
    checkExpertIndex(this.config, e);
    const hit = this.experts.get(e);
    if (hit !== undefined) {
      this.experts.delete(e);
      this.experts.set(e, hit);
      return hit;
    }
    const made = make();
    this.experts.set(e, made);
    if (this.experts.size > this.limit) {
      const oldest = this.experts.keys().next().value;
      if (oldest !== undefined) this.experts.delete(oldest);
    }
    return made;
  }
}
