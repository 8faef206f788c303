/**
 * The public layer object: a config and its weights, checked inputs, and a backend that computes the
 * layer: "cpu" (the reference that defines the numerics) or "cuda" (the GPU pipeline), same API.
 */
import {
  checkOptionFields,
  describeValue,
  isValidatedConfig,
  type MoEConfig,
  type ValidatedConfig,
  validateConfig,
} from "./config/config.js";
import { cudaAvailability, Device, DeviceTensor, openDevice, type Stream } from "./cuda/index.js";
import { DeviceMoEWeights } from "./kernels/device-weights.js";
import { deviceGateProblem, routeOnDevice, tid2eidProblem, tokenIdsProblem } from "./kernels/gate/gate.js";
import { fusedLayerProblem } from "./kernels/megamoe/megamoe.js";
import { FusedPipeline } from "./pipeline/fused.js";
import { forwardProblem, type MoEPipeline, UnfusedPipeline } from "./pipeline/unfused.js";
import { type Routing, referenceMoE } from "./reference/moe.js";
import { routeByHash, routeTokens, validateRouting } from "./reference/router.js";
import { type Fp4Exactness, type MoEWeightSource, weightSourceProblem } from "./weights/types.js";

export type Backend = "cpu" | "cuda";
/** How the "cuda" backend computes the layer: one fused kernel, or the unfused launch sequence. */
export type GpuPipelineKind = "fused" | "unfused";
/**
 * The "cuda" backend's pipeline when none is asked for: the fused kernel (bit-identical to the unfused
 * pipeline in every GPU test on the H200, docs/decisions.md). Ask for { pipeline: "unfused" } for the
 * baseline; layers the fused kernel cannot run (hidden not a multiple of 256) take it anyway. Both
 * take FP8 and FP4 (MXFP4) routed experts.
 */
export const DEFAULT_GPU_PIPELINE: GpuPipelineKind = "fused";

export interface MoELayerOptions {
  /** "cpu" (default): the reference. "cuda": the GPU pipeline. */
  backend?: Backend;
  /** The GPU of a "cuda" layer: a Device or its ordinal (default 0). */
  device?: Device | number;
  /**
   * The GPU pipeline: "fused" (one persistent kernel after the quantization) or "unfused" (the
   * baseline: 11 launches); default DEFAULT_GPU_PIPELINE. A layer the fused kernel cannot run (hidden
   * not a multiple of 256) takes "unfused" by default and is an InputError when "fused" is asked for.
   */
  pipeline?: GpuPipelineKind;
}

/** Operands of `MoELayer.forwardDevice`, all on the layer's device. */
export interface DeviceForwardArgs {
  /** bf16 [tokens, hidden]. Not checked for non-finite values (that would cost a host copy). */
  x: DeviceTensor;
  /** int32 [tokens, topK]: expert ids, −1 for an unused slot (ids outside [0, E) count as −1). */
  ids: DeviceTensor;
  /** fp32 [tokens, topK]: routing weights. */
  weights: DeviceTensor;
  /** bf16 [tokens, hidden], written. */
  out: DeviceTensor;
  tokens: number;
  /** Include the shared expert (default: true when the config has one). */
  shared?: boolean;
}

/**
 * The layer's weights on the device: generated there from the seed when the source is the generator's
 * (`source.generated`: bit-identical, without making every expert on the CPU first), else uploaded.
 */
function deviceWeightsFor(device: Device, source: MoEWeightSource): DeviceMoEWeights {
  const g = source.generated;
  if (g !== undefined) return DeviceMoEWeights.generate(device, source.config, g.seed, null, g.firstExpert);
  return DeviceMoEWeights.upload(device, source);
}

/**
 * The GPU side of a layer: weights, the pipeline and host-facing I/O buffers, all sized for maxTokens;
 * for a hash-routed layer also its tid2eid table (uploaded once) and a token-id buffer, so that such a
 * layer routes on the GPU (the CPU's routeByHash would compute all T·E·H gate products in JavaScript
 * for the k scores per token it keeps).
 */
class CudaState {
  readonly device: Device;
  readonly weights: DeviceMoEWeights;
  readonly pipeline: MoEPipeline;
  private readonly owned: DeviceTensor[] = [];
  private readonly x: DeviceTensor;
  private readonly ids: DeviceTensor;
  private readonly routingWeights: DeviceTensor;
  private readonly out: DeviceTensor;
  private readonly stream: Stream;
  /** int32 [vocab, topK] and int32 [maxTokens] for a hash-routed layer, else null. */
  private readonly tid2eid: DeviceTensor | null = null;
  private readonly tokenIds: DeviceTensor | null = null;

  /** `tid2eid`: the hash-routed layer's table, already checked (tid2eidProblem), else null. */
  constructor(device: Device, source: MoEWeightSource, kind: GpuPipelineKind, tid2eid: Int32Array | null) {
    const c = source.config;
    this.device = device;
    this.weights = deviceWeightsFor(device, source);
    try {
      this.pipeline =
        kind === "fused"
          ? new FusedPipeline(device, this.weights, c.maxTokens)
          : new UnfusedPipeline(device, this.weights, c.maxTokens);
    } catch (e) {
      this.weights.dispose();
      throw e;
    }
    const alloc = (dtype: "bf16" | "int32" | "fp32", shape: number[]) => {
      const t = DeviceTensor.empty(device, dtype, shape);
      this.owned.push(t);
      return t;
    };
    try {
      this.x = alloc("bf16", [c.maxTokens, c.hidden]);
      this.ids = alloc("int32", [c.maxTokens, c.topK]);
      this.routingWeights = alloc("fp32", [c.maxTokens, c.topK]);
      this.out = alloc("bf16", [c.maxTokens, c.hidden]);
      if (tid2eid !== null) {
        this.tid2eid = alloc("int32", [tid2eid.length / c.topK, c.topK]);
        this.tid2eid.copyFromHost(tid2eid);
        this.tokenIds = alloc("int32", [c.maxTokens]);
      }
      this.stream = device.createStream();
    } catch (e) {
      this.release();
      throw e;
    }
  }

  /** Uploads x and the routing, runs the pipeline, downloads the bf16 output (waits for it). */
  forward(x: Uint16Array, tokens: number, routing: Routing, shared: boolean): Uint16Array {
    const c = this.weights.config;
    const xv = this.x.view([tokens, c.hidden]);
    const ids = this.ids.view([tokens, c.topK]);
    const weights = this.routingWeights.view([tokens, c.topK]);
    const out = this.out.view([tokens, c.hidden]);
    xv.copyFromHost(x, this.stream);
    ids.copyFromHost(routing.ids, this.stream);
    weights.copyFromHost(routing.weights, this.stream);
    this.pipeline.forward({ x: xv, ids, weights, out, tokens, shared }, this.stream);
    this.stream.synchronize();
    this.pipeline.checkStatus();
    return out.toHost() as Uint16Array;
  }

  /**
   * A hash-routed layer: uploads x and the (checked) token ids, routes on the GPU into the pipeline's
   * ids and weights (the gate's hash mode), runs the pipeline, downloads the output and the routing.
   */
  forwardHashed(x: Uint16Array, tokens: number, tokenIds: Int32Array, shared: boolean): ForwardResult {
    const c = this.weights.config;
    if (this.tid2eid === null || this.tokenIds === null) throw new Error("not a hash-routed layer");
    const xv = this.x.view([tokens, c.hidden]);
    const tv = this.tokenIds.view([tokens]);
    const ids = this.ids.view([tokens, c.topK]);
    const weights = this.routingWeights.view([tokens, c.topK]);
    const out = this.out.view([tokens, c.hidden]);
    xv.copyFromHost(x, this.stream);
    tv.copyFromHost(tokenIds, this.stream);
    const gate = { weight: this.weights.gateWeight, bias: this.weights.gateBias, tid2eid: this.tid2eid };
    routeOnDevice(this.device, xv, gate, c, { ids, weights }, this.stream, { tokenIds: tv });
    this.pipeline.forward({ x: xv, ids, weights, out, tokens, shared }, this.stream);
    this.stream.synchronize();
    this.pipeline.checkStatus();
    const routing = { ids: ids.toHost() as Int32Array, weights: weights.toHost() as Float32Array };
    return { out: out.toHost() as Uint16Array, routing };
  }

  dispose(): void {
    this.stream.destroy();
    this.release();
  }

  private release(): void {
    this.pipeline.dispose();
    this.weights.dispose();
    for (const t of this.owned) t.dispose();
  }
}

export class InputError extends Error {
  override name = "InputError";
}

export interface ForwardOptions {
  /**
   * Routing from the caller; when absent the layer's gate routes the tokens. ids: an Int32Array
   * [tokens, topK] of expert ids in [−1, E) (−1: an unused slot); weights: a Float32Array [tokens, topK]
   * of finite values. No other array kind is converted. Negative (and zero) weights are accepted: the
   * combine is linear in them (docs/numerics.md), though the layer's own router makes positive ones.
   */
  routing?: Routing;
  /** Include the shared expert (default: true when the config has one). */
  shared?: boolean;
  /**
   * int32 [tokens] token ids, each in [0, vocab) of the layer's tid2eid: required by hash-routed layers
   * (config.router.hashRouted) without routing; checked on the host (InputError) on both backends.
   * Gate-routed layers, and any layer given routing, do not read them, so that one loop over a model's
   * layers can pass the same ids to each.
   */
  tokenIds?: Int32Array;
  onProgress?: (done: number, total: number) => void;
}

export interface ForwardResult {
  /** bf16 bits [T, H]. */
  out: Uint16Array;
  routing: Routing;
}

/** Throws InputError unless tokens is a positive integer no larger than the layer's maxTokens. */
export function validateTokens(tokens: number, config: MoEConfig): void {
  if (!Number.isInteger(tokens) || tokens < 1) {
    throw new InputError(`tokens must be a positive integer, got ${describeValue(tokens)}`);
  }
  if (tokens > config.maxTokens) {
    throw new InputError(`too many tokens: ${tokens} > maxTokens ${config.maxTokens} of this layer`);
  }
}

/** Throws InputError unless x is bf16 bits [tokens, hidden] of finite values and tokens fits. */
export function validateInput(x: unknown, tokens: number, config: MoEConfig): asserts x is Uint16Array {
  if (!(x instanceof Uint16Array)) {
    throw new InputError(`x must be a Uint16Array of bf16 bits, got ${describeValue(x)}`);
  }
  validateTokens(tokens, config);
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

/** Throws InputError unless `options` is undefined or an object whose keys are all in `known`. */
export function checkOptions(where: string, options: unknown, known: readonly string[]): void {
  checkOptionFields(where, options, known, (message) => new InputError(message));
}

/** A source with its config validated: the source itself when it was, else a view carrying the validated copy. */
function withValidatedConfig(source: MoEWeightSource): MoEWeightSource {
  if (isValidatedConfig(source.config)) return source;
  const config: ValidatedConfig = validateConfig(source.config);
  return {
    config,
    expert: (e) => source.expert(e),
    shared: () => source.shared(),
    gate: () => source.gate(),
    ...(source.generated === undefined ? {} : { generated: source.generated }),
  };
}

const LAYER_OPTIONS = ["backend", "device", "pipeline"] as const;
const FORWARD_OPTIONS = ["routing", "shared", "tokenIds", "onProgress"] as const;

export class MoELayer {
  readonly config: ValidatedConfig;
  readonly backend: Backend;
  /** The GPU pipeline of a "cuda" layer (null on the CPU). */
  readonly pipeline: GpuPipelineKind | null = null;
  private readonly weights: MoEWeightSource;
  private readonly cuda: CudaState | null = null;
  private disposed = false;
  /** The hash-routed layer's tid2eid table hashTable last checked whole, else null. */
  private checkedTable: Int32Array | null = null;

  /**
   * backend "cuda" puts the weights on the device (generated there for the generator's weights, a
   * `GeneratedWeights` or an expert-parallel rank's share of one; uploaded otherwise) and sizes every
   * buffer for config.maxTokens; call `dispose()` to free them.
   */
  constructor(weights: MoEWeightSource, options: MoELayerOptions = {}) {
    const problem = weightSourceProblem(weights);
    if (problem !== null) throw new InputError(`MoELayer: ${problem}`);
    checkOptions("MoELayer options", options, LAYER_OPTIONS);
    this.weights = withValidatedConfig(weights);
    this.config = this.weights.config;
    this.backend = options.backend ?? "cpu";
    if (this.backend === "cuda") {
      const hashed = this.config.router.hashRouted === true;
      if (hashed) {
        // Routed on the GPU (the gate's hash mode): the gate kernel must fit the config.
        const unfitGate = deviceGateProblem(this.config);
        if (unfitGate !== null) {
          throw new InputError(`layer ${this.config.name} is hash-routed, routed on the GPU: ${unfitGate}`);
        }
      }
      // The pipeline first: pure checks of the config, so their errors do not depend on the machine.
      if (options.pipeline !== undefined && options.pipeline !== "fused" && options.pipeline !== "unfused") {
        throw new InputError(
          `unknown pipeline "${String(options.pipeline)}" (expected "fused" or "unfused")`,
        );
      }
      const unfit = fusedLayerProblem(this.config);
      if (options.pipeline === "fused" && unfit !== null) {
        throw new InputError(`the fused pipeline cannot run this layer: ${unfit}`);
      }
      this.pipeline = options.pipeline ?? (unfit === null ? DEFAULT_GPU_PIPELINE : "unfused");
      const device = options.device ?? 0;
      if (typeof device === "number" && !(Number.isInteger(device) && device >= 0)) {
        throw new InputError(
          `device must be a GPU ordinal (a non-negative integer) or a Device, got ${device}`,
        );
      }
      if (typeof device !== "number" && !(device instanceof Device)) {
        throw new InputError(
          `device must be a GPU ordinal (a non-negative integer) or a Device, got ${describeValue(device)}`,
        );
      }
      if (typeof device === "number") {
        const a = cudaAvailability();
        if (!a.ok) throw new InputError(`backend "cuda" needs a CUDA GPU: ${a.reason}`);
      }
      // The table is checked on the host before the device is opened: the kernel does not read it back.
      const tid2eid = hashed ? this.hashTable() : null;
      this.cuda = new CudaState(
        typeof device === "number" ? openDevice(device) : device,
        weights,
        this.pipeline,
        tid2eid,
      );
    } else if (this.backend === "cpu" && options.pipeline !== undefined) {
      throw new InputError(`the pipeline applies to the "cuda" backend; this layer runs on the "cpu"`);
    } else if (this.backend === "cpu" && options.device !== undefined) {
      throw new InputError(`the device applies to the "cuda" backend; this layer runs on the "cpu"`);
    } else if (this.backend !== "cpu") {
      throw new InputError(`unknown backend "${String(this.backend)}" (expected "cpu" or "cuda")`);
    }
  }

  /** The GPU of a "cuda" layer (null on the CPU). */
  get device(): Device | null {
    return this.cuda?.device ?? null;
  }

  /**
   * A "cuda" layer whose FP4 experts were read from a source (a checkpoint): how many of their elements
   * the kernels' e4m3 form does not hold exactly; null otherwise (DeviceMoEWeights.fp4Exactness).
   */
  get fp4Exactness(): Fp4Exactness | null {
    return this.cuda?.weights.fp4Exactness ?? null;
  }

  /** Frees the device memory of a "cuda" layer (a no-op on the CPU). Idempotent. */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    this.cuda?.dispose();
  }

  private checkUsable(): void {
    if (this.disposed) throw new InputError("MoELayer used after dispose()");
  }

  /**
   * A hash-routed layer's tid2eid, checked whole once (tid2eidProblem: k distinct experts a row) on
   * either backend, so both refuse a bad table with the same InputError.
   */
  private hashTable(): Int32Array {
    const table = this.weights.gate().tid2eid;
    if (table === this.checkedTable && table !== null) return table;
    if (table === undefined || table === null) {
      throw new InputError(
        `layer ${this.config.name} is hash-routed but its weights have no gate tid2eid table`,
      );
    }
    const problem = tid2eidProblem(table, this.config.numExperts, this.config.topK);
    if (problem !== null) throw new InputError(`layer ${this.config.name}: ${problem}`);
    this.checkedTable = table;
    return table;
  }

  /**
   * Routes (unless routing is given) and computes the layer for bf16 x [tokens, hidden]. On the "cpu"
   * backend an fp32 overflow from finite inputs throws NumericsError naming its cause; the "cuda"
   * backend returns the output as the kernels wrote it (∞ or NaN included): check it with
   * checkFiniteOutput (docs/numerics.md, "Overflow").
   */
  forward(x: Uint16Array, tokens: number, options: ForwardOptions = {}): ForwardResult {
    this.checkUsable();
    checkOptions("forward options", options, FORWARD_OPTIONS);
    validateInput(x, tokens, this.config);
    if (options.shared !== undefined && typeof options.shared !== "boolean") {
      throw new InputError(
        `forward options.shared must be true or false, got ${describeValue(options.shared)}`,
      );
    }
    if (options.onProgress !== undefined && typeof options.onProgress !== "function") {
      throw new InputError(
        `forward options.onProgress must be a function, got ${describeValue(options.onProgress)}`,
      );
    }
    let routing = options.routing;
    if (routing !== undefined && (typeof routing !== "object" || routing === null)) {
      throw new InputError(
        `forward options.routing must be { ids: Int32Array, weights: Float32Array } or absent, got ${describeValue(routing)}`,
      );
    }
    if (routing === undefined && this.config.router.hashRouted === true) {
      if (options.tokenIds === undefined) {
        throw new InputError(
          `layer ${this.config.name} is hash-routed: its experts are chosen by token id, so forward needs options.tokenIds (int32 [tokens]) or options.routing`,
        );
      }
      // Checked here for both backends, with the same InputError: the GPU does not read them back.
      const vocab = this.hashTable().length / this.config.topK;
      const problem = tokenIdsProblem(options.tokenIds, tokens, vocab);
      if (problem !== null) throw new InputError(`forward options.${problem}`);
      if (this.cuda !== null) {
        const shared = (options.shared ?? true) && this.config.numShared > 0;
        return this.cuda.forwardHashed(x, tokens, options.tokenIds, shared);
      }
      const { ids, weights } = routeByHash(x, tokens, options.tokenIds, this.weights.gate(), this.config);
      routing = { ids, weights };
    } else if (routing === undefined) {
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

  /**
   * Waits for the layer's device work and throws if a launch reported a failure of its own (the fused
   * kernel's watchdog: a wait that never completed). `forward` does this itself; call it after
   * `forwardDevice` launches before trusting their outputs.
   */
  checkStatus(): void {
    this.checkUsable();
    this.cuda?.pipeline.checkStatus();
  }

  /**
   * Queues the layer on device tensors (benchmarks, callers that keep activations on the GPU) on
   * `stream` (null: the legacy default stream) and returns without waiting. Routing must be given:
   * the gate runs on the CPU. Checks tokens, dtypes, shapes and the device (InputError); x and the
   * routing values stay on the device unchecked. "cuda" backend only.
   */
  forwardDevice(args: DeviceForwardArgs, stream: Stream | null = null): void {
    this.checkUsable();
    if (this.cuda === null)
      throw new InputError(`forwardDevice needs the "cuda" backend, not "${this.backend}"`);
    validateTokens(args.tokens, this.config);
    const shared = (args.shared ?? true) && this.config.numShared > 0;
    const f = { ...args, shared };
    const problem = forwardProblem(this.config, this.config.maxTokens, this.cuda.device, f);
    if (problem !== null) throw new InputError(problem);
    this.cuda.pipeline.forward(f, stream);
  }
}
