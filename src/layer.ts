/**
 * The public layer object: a config and its weights, checked inputs, and a backend that computes the
 * layer. Today the backend is the CPU reference; GPU backends plug in behind the same `forward`.
 */
import { type MoEConfig, validateConfig } from "./config/config.js";
import { type Routing, referenceMoE } from "./reference/moe.js";
import { routeTokens, validateRouting } from "./reference/router.js";
import type { MoEWeightSource } from "./weights/types.js";

export type Backend = "cpu";

export class InputError extends Error {
  override name = "InputError";
}

export interface ForwardOptions {
  /** Routing from the caller; when absent the layer's gate routes the tokens. */
  routing?: Routing;
  /** Include the shared expert (default: true when the config has one). */
  shared?: boolean;
  onProgress?: (done: number, total: number) => void;
}

export interface ForwardResult {
  /** bf16 bits [T, H]. */
  out: Uint16Array;
  routing: Routing;
}

/** Throws InputError unless x is bf16 bits [tokens, hidden] of finite values and tokens fits. */
export function validateInput(x: unknown, tokens: number, config: MoEConfig): asserts x is Uint16Array {
  if (!(x instanceof Uint16Array)) {
    const kind = x === null || typeof x !== "object" ? typeof x : (x.constructor?.name ?? "object");
    throw new InputError(`x must be a Uint16Array of bf16 bits, got ${kind}`);
  }
  if (!Number.isInteger(tokens) || tokens < 1) {
    throw new InputError(`tokens must be a positive integer, got ${tokens}`);
  }
  if (tokens > config.maxTokens) {
    throw new InputError(`too many tokens: ${tokens} > maxTokens ${config.maxTokens} of this layer`);
  }
  if (x.length !== tokens * config.hidden) {
    throw new InputError(
      `x has ${x.length} elements; expected tokens × hidden = ${tokens} × ${config.hidden} = ${tokens * config.hidden}`,
    );
  }
  for (let i = 0; i < x.length; i++) {
    if ((x[i] & 0x7f80) === 0x7f80) {
      const t = Math.floor(i / config.hidden);
      throw new InputError(`x holds a non-finite value at token ${t}, channel ${i % config.hidden}`);
    }
  }
}

export class MoELayer {
  readonly config: MoEConfig;
  readonly backend: Backend;
  private readonly weights: MoEWeightSource;

  constructor(weights: MoEWeightSource, options: { backend?: Backend } = {}) {
    this.config = validateConfig(weights.config);
    this.weights = weights;
    this.backend = options.backend ?? "cpu";
    if (this.backend !== "cpu") throw new InputError(`unknown backend "${String(this.backend)}"`);
  }

  /** Routes (unless routing is given) and computes the layer for bf16 x [tokens, hidden]. */
  forward(x: Uint16Array, tokens: number, options: ForwardOptions = {}): ForwardResult {
    validateInput(x, tokens, this.config);
    let routing = options.routing;
    if (routing === undefined) {
      const { ids, weights } = routeTokens(x, tokens, this.weights.gate(), this.config);
      routing = { ids, weights };
    } else {
      validateRouting(routing.ids, routing.weights, tokens, this.config);
    }
    const out = referenceMoE(x, tokens, routing, this.weights, {
      shared: options.shared,
      onProgress: options.onProgress,
    });
    return { out, routing };
  }
}
