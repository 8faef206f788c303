/**
 * The weight layouts every backend reads. See docs/weights.md for the layouts and checkpoint names.
 */
import { describeValue, type ValidatedConfig } from "../config/config.js";

/** An FP8 e4m3 matrix [rows, cols] (row-major) with one fp32 scale per 128×128 block. */
export interface BlockQuantized {
  q: Uint8Array;
  /** [rows/128, cols/128] row-major; value = e4m3(q) · scale of its block. */
  scales: Float32Array;
  rows: number;
  cols: number;
}

/** One expert MLP (routed, or the fused shared experts). */
export interface ExpertWeights {
  /** [2I, H]: gate rows 0..I−1, then up rows I..2I−1. */
  w1: BlockQuantized;
  /** [H, I]. */
  w2: BlockQuantized;
}

/** The router's weights. */
export interface GateWeights {
  /** bf16 bits [E, H]. */
  weight: Uint16Array;
  /** fp32 [E] correction bias (selection only), or null when the config has none. */
  bias: Float32Array | null;
}

/** Where a layer's weights come from: generated on demand, or read from a file. */
export interface MoEWeightSource {
  /** Validated (validateConfig); a layer's constructor validates a raw one once. */
  readonly config: ValidatedConfig;
  /** Routed expert e (0 ≤ e < numExperts). Sources may make or read it lazily and cache a few. */
  expert(e: number): ExpertWeights;
  /** The fused shared-expert MLP (intermediate · numShared), or null when numShared is 0. */
  shared(): ExpertWeights | null;
  gate(): GateWeights;
  /**
   * Set when the weights are the counter-based generator's (generate.ts) for `seed`, routed experts
   * numbered from `firstExpert` (0, or a rank's first expert): a GPU then makes them itself, bit for bit.
   */
  readonly generated?: { seed: number; firstExpert: number };
}

/**
 * Why `source` cannot be a weight source (not an object, no config object, expert/shared/gate not
 * functions), or null when its shape is right. Checks the shape only; the config is validated apart.
 */
export function weightSourceProblem(source: unknown): string | null {
  if (typeof source !== "object" || source === null) {
    return `the weight source must be an object with config, expert(), shared() and gate(), got ${describeValue(source)}`;
  }
  const s = source as Record<string, unknown>;
  if (typeof s.config !== "object" || s.config === null) {
    return `the weight source's config must be an object, got ${describeValue(s.config)}`;
  }
  for (const method of ["expert", "shared", "gate"]) {
    if (typeof s[method] !== "function") {
      return `the weight source's ${method} must be a function, got ${describeValue(s[method])}`;
    }
  }
  return null;
}
