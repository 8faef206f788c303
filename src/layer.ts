/**
 * The public layer object: a config and its weights, checked inputs, and a backend that computes the
 * layer: "cpu" (the reference that defines the numerics) or "cuda" (the GPU pipeline), same API.
 */
import { type MoEConfig, validateConfig } from "./config/config.js";
import { cudaAvailability, type Device, DeviceTensor, openDevice, type Stream } from "./cuda/index.js";
import { UnfusedPipeline } from "./pipeline/unfused.js";
import { type Routing, referenceMoE } from "./reference/moe.js";
import { routeTokens, validateRouting } from "./reference/router.js";
import { DeviceMoEWeights } from "./weights/device.js";
import type { MoEWeightSource } from "./weights/types.js";

export type Backend = "cpu" | "cuda";

/** The GPU side of a layer: weights, the pipeline and I/O buffers, all sized for maxTokens. */
class CudaState {
  readonly weights: DeviceMoEWeights;
  readonly pipeline: UnfusedPipeline;
  readonly x: DeviceTensor;
  readonly ids: DeviceTensor;
  readonly routingWeights: DeviceTensor;
  readonly out: DeviceTensor;
  readonly stream: Stream;

  constructor(
    readonly device: Device,
    source: MoEWeightSource,
  ) {
    const c = source.config;
    this.weights = DeviceMoEWeights.upload(device, source);
    this.pipeline = new UnfusedPipeline(device, this.weights, c.maxTokens);
    this.x = DeviceTensor.empty(device, "bf16", [c.maxTokens, c.hidden]);
    this.ids = DeviceTensor.empty(device, "int32", [c.maxTokens, c.topK]);
    this.routingWeights = DeviceTensor.empty(device, "fp32", [c.maxTokens, c.topK]);
    this.out = DeviceTensor.empty(device, "bf16", [c.maxTokens, c.hidden]);
    this.stream = device.createStream();
  }

  forward(x: Uint16Array, tokens: number, routing: Routing, shared: boolean): Uint16Array {
    const c = this.weights.config;
    const xv = this.x.view([tokens, c.hidden]);
    const ids = this.ids.view([tokens, c.topK]);
    const w = this.routingWeights.view([tokens, c.topK]);
    const out = this.out.view([tokens, c.hidden]);
    xv.copyFromHost(x, this.stream);
    ids.copyFromHost(routing.ids, this.stream);
    w.copyFromHost(routing.weights, this.stream);
    this.pipeline.forward({ x: xv, ids, weights: w, out, tokens, shared }, this.stream);
    this.stream.synchronize();
    return out.toHost() as Uint16Array;
  }

  dispose(): void {
    this.pipeline.dispose();
    this.weights.dispose();
    for (const t of [this.x, this.ids, this.routingWeights, this.out]) t.dispose();
    this.stream.destroy();
  }
}

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

  private readonly cuda: CudaState | null = null;

  /**
   * backend "cuda" uploads the weights to the device (default ordinal 0) and sizes every buffer for
   * config.maxTokens; call `dispose()` to free them.
   */
  constructor(weights: MoEWeightSource, options: { backend?: Backend; device?: number } = {}) {
    this.config = validateConfig(weights.config);
    this.weights = weights;
    this.backend = options.backend ?? "cpu";
    if (this.backend === "cuda") {
      const a = cudaAvailability();
      if (!a.ok) throw new InputError(`backend "cuda" needs a CUDA GPU: ${a.reason}`);
      this.cuda = new CudaState(openDevice(options.device ?? 0), weights);
    } else if (this.backend !== "cpu") {
      throw new InputError(`unknown backend "${String(this.backend)}" (expected "cpu" or "cuda")`);
    }
  }

  /** Frees the device memory of a "cuda" layer (a no-op on the CPU). */
  dispose(): void {
    this.cuda?.dispose();
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
    if (this.cuda !== null) {
      const shared = (options.shared ?? true) && this.config.numShared > 0;
      return { out: this.cuda.forward(x, tokens, routing, shared), routing };
    }
    const out = referenceMoE(x, tokens, routing, this.weights, {
      shared: options.shared,
      onProgress: options.onProgress,
    });
    return { out, routing };
  }
}
