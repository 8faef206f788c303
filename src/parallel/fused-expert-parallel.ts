/**
 * Expert parallelism inside the fused kernel (docs/design.md "The in-kernel protocol"): R ranks, rank d
 * holding routed experts [d·E/R, (d+1)·E/R) and the shared expert, each rank one launch of the kernel's
 * EP build (megamoe_ep.cuh) that counts, exchanges, computes and combines with its peers through a
 * `SymmetricHeap`, the routing never leaving the GPUs. The numerics are ExpertParallelMoE's, bit for bit.
 *
 * Every rank in this process (`new`): one rank per GPU (`devices` distinct), or R virtual ranks on one
 * GPU. Or one rank per process (`FusedExpertParallel.join`, as serving engines run one process per
 * GPU): the processes meet at a Unix socket, share their buffers through `SymmetricHeap.join`, and each
 * forwards its own rank's tokens. Virtual ranks: each rank's launch gets
 * ⌊SMs / ranks on the device⌋ CTAs on its own stream, so that every rank's CTAs are resident at once
 * (a rank waits on the others' publications; one still queued behind a full-size launch would be
 * reported dead by the watchdog). A forward queues, per rank on its stream, the quantization of its
 * rows into its buffer's xq/xs regions and its launch; `synchronize` waits and, when a wait on a peer
 * gave up, throws naming the rank the kernel blamed (the record lives in pinned host memory, readable
 * after the trap that ends the context).
 */
import { describeValue, type ValidatedConfig, validateConfig } from "../config/config.js";
import {
  type Device,
  DeviceTensor,
  expectOperand,
  openDevice,
  type PinnedBuffer,
  type Stream,
} from "../cuda/index.js";
import { DeviceMoEWeights } from "../kernels/device-weights.js";
import { FusedMoEKernel } from "../kernels/megamoe/megamoe.js";
import { FUSED_BLOCK_MS, FUSED_EP_MAX_RANKS, type FusedBlockM } from "../kernels/megamoe/megamoe.variants.js";
import { quantizeIntoOnDevice } from "../kernels/quant/quant.js";
import { checkOptions, InputError, validateInput } from "../layer.js";
import { validateRouting } from "../reference/router.js";
import { type MoEWeightSource, weightSourceProblem } from "../weights/types.js";
import { type RankInput, RankWeights } from "./expert-parallel.js";
import {
  decodeFusedEpStatus,
  describeFusedEpGiveUp,
  type FusedEpGiveUp,
  type FusedEpLayout,
  fusedEpLayout,
} from "./fused-ep.js";
import { SymmetricHeap } from "./symmetric.js";

export interface FusedExpertParallelOptions {
  /** Ranks the routed experts are split among: 2 .. 8, dividing the experts. */
  ranks: number;
  /** Each rank's GPU, a Device or ordinal per rank, or one for all (default 0: R virtual ranks on GPU 0). */
  devices?: readonly (Device | number)[] | Device | number;
  /** Tokens a rank may bring to one forward (default: the config's maxTokens). */
  maxTokens?: number;
  /** Every rank's tile height (tests and tuning; default "auto": the heuristic's for R·T tokens). */
  blockM?: "auto" | FusedBlockM;
  /** FP4 experts: expand them into e4m3 stages in each forward (default "auto": from 384 rows per expert). */
  fp4Expand?: "auto" | boolean;
}

/** One rank per process: `FusedExpertParallel.join`. */
export interface FusedExpertParallelJoinOptions {
  /** This process's rank, 0 … ranks − 1 (rank 0 listens at `socketPath`). */
  rank: number;
  /** Ranks the routed experts are split among: 2 .. 8, dividing the experts; one process each. */
  ranks: number;
  /** This process's GPU, a Device or ordinal (default 0); its launch takes every SM. */
  device?: Device | number;
  /** A filesystem path for the group's Unix socket (under 108 bytes), the same in every process. */
  socketPath: string;
  /** Tokens a rank may bring to one forward (default: the config's maxTokens); the same in every process. */
  maxTokens?: number;
  /** This rank's tile height (default "auto"). */
  blockM?: "auto" | FusedBlockM;
  /** FP4 experts: expand them into e4m3 stages in each forward (default "auto"). */
  fp4Expand?: "auto" | boolean;
  /** How long to wait for the other processes at each step of joining (default 60 s). */
  timeoutMs?: number;
}

/** One rank's operands of `forwardDevice`, all on the rank's device. */
export interface FusedRankDeviceInput {
  /** bf16 [tokens, hidden]. */
  x: DeviceTensor;
  /** int32 [tokens, topK], global expert ids (−1: unused slot). */
  ids: DeviceTensor;
  /** fp32 [tokens, topK]. */
  weights: DeviceTensor;
  /** bf16 [tokens, hidden], written. */
  out: DeviceTensor;
  /** 0 .. maxTokens: a rank without tokens still serves its peers. */
  tokens: number;
}

export interface FusedForwardOptions {
  /** Add the shared expert (default: when the config has one). */
  shared?: boolean;
  /** Tests: leave this rank's work out of the forward, as a rank that died before starting would (a rank of this process). */
  skipRank?: number;
}

/** A forward that failed; `records` are the watchdog records of the ranks that gave up, by rank. */
export class FusedExpertParallelError extends Error {
  override name = "FusedExpertParallelError";
  constructor(
    message: string,
    readonly records: ReadonlyMap<number, FusedEpGiveUp>,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
}

/** Status words per rank (megamoe_ep.cuh ep_give_up writes 6 of them). */
const STATUS_WORDS = 8;

/** What one rank owns, released in reverse order of the fields. */
interface Rank {
  /** The rank's index among all ranks. */
  rank: number;
  device: Device;
  status: PinnedBuffer;
  weights: DeviceMoEWeights;
  kernel: FusedMoEKernel;
  stream: Stream;
  /** The host path's staging: x, ids, weights, out. */
  x: DeviceTensor;
  ids: DeviceTensor;
  routingWeights: DeviceTensor;
  out: DeviceTensor;
}

export class FusedExpertParallel {
  /** The whole layer's config (all experts). */
  readonly config: ValidatedConfig;
  readonly ranks: number;
  /** Tokens a rank may bring to one forward. */
  readonly maxTokens: number;
  /** Every rank's tile height ("auto": the heuristic's). */
  readonly blockM: "auto" | FusedBlockM;
  /** Whether every rank expands FP4 experts first ("auto": the heuristic's). */
  readonly fp4Expand: "auto" | boolean;
  readonly layout: FusedEpLayout;
  readonly heap: SymmetricHeap;
  /** This process's rank when each process drives one (`join`); undefined when every rank is here. */
  readonly rank: number | undefined;
  /** The ranks this process drives, in order: the order of `forward`'s inputs and outputs. */
  readonly localRanks: readonly number[];
  private readonly rankState: Rank[] = [];
  private disposed = false;

  /**
   * Every rank in this process. (`joined` is `join`'s: one rank of a group whose heap is already
   * joined.)
   */
  constructor(
    source: MoEWeightSource,
    options: FusedExpertParallelOptions,
    joined?: { heap: SymmetricHeap; rank: number; device: Device },
  ) {
    const problem = weightSourceProblem(source);
    if (problem !== null) throw new InputError(`FusedExpertParallel: ${problem}`);
    if (options === undefined) throw new InputError("FusedExpertParallel needs options with ranks");
    if (joined === undefined) {
      checkOptions("FusedExpertParallel options", options, [
        "ranks",
        "devices",
        "maxTokens",
        "blockM",
        "fp4Expand",
      ]);
    }
    this.config = validateConfig(source.config);
    const { ranks } = options;
    checkRanks(this.config, ranks);
    this.ranks = ranks;
    const maxTokens = checkMaxTokens(options.maxTokens ?? this.config.maxTokens);
    this.maxTokens = maxTokens;
    this.blockM = checkBlockM(options.blockM ?? "auto");
    this.fp4Expand = checkFp4Expand(options.fp4Expand ?? "auto");
    const c = this.config;
    this.layout = fusedEpLayout({
      ranks,
      numExperts: c.numExperts,
      topK: c.topK,
      hidden: c.hidden,
      maxTokens,
    });
    let devices: (Device | undefined)[];
    if (joined === undefined) {
      devices = resolveDevices(options.devices ?? 0, ranks);
      this.heap = SymmetricHeap.create(devices as Device[], this.layout.bytes);
      this.rank = undefined;
      this.localRanks = devices.map((_, r) => r);
    } else {
      devices = Array.from({ length: ranks }, (_, r) => (r === joined.rank ? joined.device : undefined));
      this.heap = joined.heap;
      this.rank = joined.rank;
      this.localRanks = [joined.rank];
    }
    try {
      // Each process zeroes the buffers it allocated; epochs start at 1 on a zeroed buffer, so a zero
      // flag is never a publication.
      this.heap.zero();
      for (const r of this.localRanks) devices[r]!.copyHtoD(this.heap.address(r), Uint32Array.of(1, 0, 0, 0));
      const peers = [...this.heap.addressTable()];
      for (const r of this.localRanks) {
        const device = devices[r]!;
        const sharing = devices.filter((d) => d === device).length;
        this.rankState.push(this.makeRank(source, r, device, sharing, peers));
      }
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  /**
   * One rank per process: resolves once every process of the group has joined, mapped every buffer
   * and set up its rank (so no rank publishes into a buffer its owner has yet to zero). Every process
   * passes the same weights' config, ranks, maxTokens and socketPath. A process that fails or does not
   * arrive within `timeoutMs` fails the others' joins.
   */
  static async join(
    source: MoEWeightSource,
    options: FusedExpertParallelJoinOptions,
  ): Promise<FusedExpertParallel> {
    if (typeof options !== "object" || options === null) {
      throw new InputError("FusedExpertParallel.join needs options with rank, ranks and socketPath");
    }
    checkOptions("FusedExpertParallel.join options", options, [
      "rank",
      "ranks",
      "device",
      "socketPath",
      "maxTokens",
      "blockM",
      "fp4Expand",
      "timeoutMs",
    ]);
    const { rank, ranks, socketPath } = options;
    if (!Number.isInteger(rank) || !Number.isInteger(ranks) || rank < 0 || rank >= ranks) {
      throw new InputError(
        `FusedExpertParallel.join: rank must be an integer in [0, ranks), got rank ${describeValue(rank)} of ${describeValue(ranks)}`,
      );
    }
    if (typeof socketPath !== "string" || socketPath.length === 0) {
      throw new InputError(
        `FusedExpertParallel.join: socketPath must be a path, got ${describeValue(socketPath)}`,
      );
    }
    const base = {
      ranks,
      maxTokens: options.maxTokens,
      blockM: options.blockM,
      fp4Expand: options.fp4Expand,
    };
    const problem = weightSourceProblem(source);
    if (problem !== null) throw new InputError(`FusedExpertParallel: ${problem}`);
    // The layout checks ranks, maxTokens and the config before any process waits on another.
    const config = validateConfig(source.config);
    checkRanks(config, ranks);
    checkBlockM(options.blockM ?? "auto");
    checkFp4Expand(options.fp4Expand ?? "auto");
    const layout = fusedEpLayout({
      ranks,
      numExperts: config.numExperts,
      topK: config.topK,
      hidden: config.hidden,
      maxTokens: checkMaxTokens(options.maxTokens ?? config.maxTokens),
    });
    const device =
      typeof options.device === "number" ? openDevice(options.device) : (options.device ?? openDevice(0));
    const timeoutMs = options.timeoutMs ?? 60_000;
    const heap = await SymmetricHeap.join({
      device,
      rank,
      ranks,
      bytes: layout.bytes,
      socketPath,
      timeoutMs,
    });
    let ep: FusedExpertParallel;
    try {
      ep = new FusedExpertParallel(source, base, { heap, rank, device });
    } catch (e) {
      heap.dispose();
      throw e;
    }
    try {
      await heap.barrier(timeoutMs);
    } catch (e) {
      ep.dispose();
      throw e;
    }
    return ep;
  }

  /** Rank r's weights, kernel, stream, status words and staging; what was made is released on failure. */
  private makeRank(
    source: MoEWeightSource,
    r: number,
    device: Device,
    sharing: number,
    peers: bigint[],
  ): Rank {
    const c = this.config;
    const T = this.maxTokens;
    const made: (() => void)[] = [];
    try {
      const status = device.allocPinned(4 * STATUS_WORDS);
      made.push(() => status.free());
      status.u8.fill(0);
      const local = new RankWeights(source, r, this.ranks, T);
      const g = local.generated;
      const weights =
        g === undefined
          ? DeviceMoEWeights.upload(device, local)
          : DeviceMoEWeights.generate(device, local.config, g.seed, null, g.firstExpert);
      made.push(() => weights.dispose());
      // Pinned memory is mapped for every device at the same address under unified addressing (every
      // sm_90 device): the kernel stores its record through status.ptr.
      const kernel = new FusedMoEKernel(device, weights, T, {
        layout: this.layout,
        rank: r,
        peers,
        hostStatus: status.ptr,
      });
      made.push(() => kernel.dispose());
      kernel.ctas = Math.floor(device.smCount / sharing);
      kernel.blockM = this.blockM;
      kernel.fp4Expand = this.fp4Expand;
      if (kernel.ctas < 1)
        throw new InputError(`${sharing} ranks on ${device.smCount} SMs: fewer than one CTA each`);
      const stream = device.createStream();
      made.push(() => stream.destroy());
      const tensor = <D extends "bf16" | "int32" | "fp32">(dtype: D, shape: number[]) => {
        const t = DeviceTensor.empty(device, dtype, shape);
        made.push(() => t.dispose());
        return t;
      };
      return {
        rank: r,
        device,
        status,
        weights,
        kernel,
        stream,
        x: tensor("bf16", [T, c.hidden]),
        ids: tensor("int32", [T, c.topK]),
        routingWeights: tensor("fp32", [T, c.topK]),
        out: tensor("bf16", [T, c.hidden]),
      };
    } catch (e) {
      for (const undo of made.reverse()) undo();
      throw e;
    }
  }

  /** The devices of this process's ranks, in `localRanks` order (every rank unless joined). */
  get devices(): Device[] {
    return this.rankState.map((r) => r.device);
  }

  /** Each local rank's kernel (tests: its plan, CTAs and EP state). */
  get kernels(): FusedMoEKernel[] {
    return this.rankState.map((r) => r.kernel);
  }

  /** Each local rank's stream: its quantization and launch are queued there. */
  get streams(): Stream[] {
    return this.rankState.map((r) => r.stream);
  }

  /** Rank r's watchdog words (a live view of pinned memory: code, cta, blamed, missing, epoch, gave up). */
  statusWords(r: number): Int32Array {
    this.live();
    const s = this.rankState.find((x) => x.rank === r);
    if (s === undefined) {
      throw new RangeError(
        `rank ${r} is not driven by this process (its ranks: ${this.localRanks.join(", ")})`,
      );
    }
    return new Int32Array(s.status.u8.buffer, s.status.u8.byteOffset, STATUS_WORDS);
  }

  /**
   * One forward from the host: each local rank's x and routing uploaded to its device, the forward,
   * each local rank's output back (bf16 bits [tokens, hidden]); one input per rank in `localRanks`
   * order (one, this process's, when joined). Throws FusedExpertParallelError when a rank fails.
   */
  forward(inputs: readonly RankInput[], options: FusedForwardOptions = {}): { out: Uint16Array[] } {
    this.live();
    this.checkHostInputs(inputs);
    const { hidden: H, topK: k } = this.config;
    const device = inputs.map((input, s) => {
      const r = this.rankState[s]!;
      const T = input.tokens;
      const on = {
        x: r.x.view([T, H]),
        ids: r.ids.view([T, k]),
        weights: r.routingWeights.view([T, k]),
        out: r.out.view([T, H]),
        tokens: T,
      };
      if (T > 0) {
        on.x.copyFromHost(input.x, r.stream);
        on.ids.copyFromHost(input.ids, r.stream);
        on.weights.copyFromHost(input.weights, r.stream);
      }
      return on;
    });
    this.forwardDevice(device, options);
    this.synchronize();
    return {
      out: device.map((d) => (d.tokens === 0 ? new Uint16Array(0) : (d.out.toHost() as Uint16Array))),
    };
  }

  /**
   * Queues one forward with every operand on the ranks' devices, without waiting: forwards may follow
   * back to back (the kernel's epochs keep them apart); `synchronize` waits for them. The ids must be
   * valid routing (in [−1, E), no expert twice in a token): the kernel does not check them.
   */
  forwardDevice(inputs: readonly FusedRankDeviceInput[], options: FusedForwardOptions = {}): void {
    this.live();
    checkOptions("forward options", options, ["shared", "skipRank"]);
    this.checkInputCount(inputs);
    const skipRank = options.skipRank;
    const skip = skipRank === undefined ? -1 : this.localRanks.indexOf(skipRank);
    if (skipRank !== undefined && skip < 0) {
      throw new InputError(
        `skipRank must be a rank of this process (${this.localRanks.join(", ")}), got ${describeValue(skipRank)}`,
      );
    }
    const { hidden: H, topK: k, scaleFormat } = this.config;
    inputs.forEach((input, s) => {
      const T = input.tokens;
      if (!Number.isInteger(T) || T < 0 || T > this.maxTokens) {
        throw new InputError(
          `rank ${this.localRanks[s]}: tokens must be an integer in [0, ${this.maxTokens}], got ${describeValue(T)}`,
        );
      }
      const device = this.rankState[s]!.device;
      try {
        expectOperand("forwardDevice", "x", input.x, "bf16", [T, H], device);
        expectOperand("forwardDevice", "ids", input.ids, "int32", [T, k], device);
        expectOperand("forwardDevice", "weights", input.weights, "fp32", [T, k], device);
        expectOperand("forwardDevice", "out", input.out, "bf16", [T, H], device);
      } catch (e) {
        throw new InputError(`rank ${this.localRanks[s]}: ${(e as Error).message}`);
      }
    });
    const shared = (options.shared ?? true) && this.config.numShared > 0;
    // Every specialization is loaded before the first launch: a module load between the ranks'
    // launches could wait for a launched rank, which waits for the ranks not launched yet.
    inputs.forEach((input, s) => {
      this.rankState[s]!.kernel.prepare(input.tokens);
    });
    const { xq, xs } = this.layout.regions;
    inputs.forEach((input, s) => {
      if (s === skip) return;
      const r = this.rankState[s]!;
      const own = this.heap.address(s);
      // The rank's rows go where its peers pull them: its buffer's xq and xs regions.
      quantizeIntoOnDevice(input.x, own + BigInt(xq.offset), own + BigInt(xs.offset), scaleFormat, r.stream);
      r.kernel.launchEp(
        { ids: input.ids, weights: input.weights, out: input.out, tokens: input.tokens, shared },
        r.stream,
      );
    });
  }

  /**
   * Waits for every rank's queued forwards. A failure reads every rank's watchdog record and throws a
   * FusedExpertParallelError naming, per rank that gave up, the ranks it blamed; the CUDA context of a
   * trapped launch is lost: dispose this object (recovery is a new one, in a new process for a real GPU).
   */
  synchronize(): void {
    this.live();
    const failures: string[] = [];
    let cause: unknown;
    for (const r of this.rankState) {
      try {
        r.stream.synchronize();
      } catch (e) {
        cause ??= e;
        failures.push(`rank ${r.rank}: ${(e as Error).message}`);
      }
    }
    if (failures.length === 0) return;
    const records = new Map<number, FusedEpGiveUp>();
    const lines: string[] = [];
    for (const { rank } of this.rankState) {
      const g = decodeFusedEpStatus(this.statusWords(rank));
      if (g === null) continue;
      records.set(rank, g);
      lines.push(describeFusedEpGiveUp(rank, g));
    }
    const why =
      lines.length > 0 ? lines.join("; ") : `no rank recorded a wait on its peers (${failures.join("; ")})`;
    throw new FusedExpertParallelError(`the in-kernel expert-parallel forward failed: ${why}`, records, {
      cause,
    });
  }

  /**
   * Frees everything, each rank's in reverse order of making (staging, stream, kernel, weights, status
   * words), then the heap; carries on past a failing step and reports them all. Idempotent.
   */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    const errors: unknown[] = [];
    const step = (f: () => void) => {
      try {
        f();
      } catch (e) {
        errors.push(e);
      }
    };
    for (const r of this.rankState) step(() => r.stream.synchronize());
    for (const r of this.rankState.reverse()) {
      for (const t of [r.out, r.routingWeights, r.ids, r.x]) step(() => t.dispose());
      step(() => r.stream.destroy());
      step(() => r.kernel.dispose());
      step(() => r.weights.dispose());
      step(() => r.status.free());
    }
    this.rankState.length = 0;
    step(() => this.heap.dispose());
    if (errors.length === 1) throw errors[0];
    if (errors.length > 1) {
      throw new AggregateError(
        errors,
        `disposing FusedExpertParallel: ${errors.map((e) => (e as Error).message).join("; ")}`,
      );
    }
  }

  private live(): void {
    if (this.disposed) throw new InputError("FusedExpertParallel used after dispose()");
  }

  private checkInputCount(inputs: readonly unknown[]): void {
    const n = this.localRanks.length;
    if (!Array.isArray(inputs) || inputs.length !== n) {
      const what =
        this.rank === undefined
          ? `one input per rank (${n})`
          : `one input (this process's rank ${this.rank})`;
      throw new InputError(`expected ${what}, got ${describeValue(inputs)}`);
    }
  }

  /** ExpertParallelMoE.plan's checks, with this object's tokens per rank. */
  private checkHostInputs(inputs: readonly RankInput[]): void {
    this.checkInputCount(inputs);
    const perRank = { ...this.config, maxTokens: this.maxTokens };
    inputs.forEach((input, s) => {
      if (typeof input !== "object" || input === null) {
        throw new InputError(
          `rank ${this.localRanks[s]}: input must be { x, tokens, ids, weights }, got ${describeValue(input)}`,
        );
      }
      try {
        if (!(input.tokens === 0 && input.x instanceof Uint16Array && input.x.length === 0)) {
          validateInput(input.x, input.tokens, perRank);
        }
        validateRouting(input.ids, input.weights, input.tokens, this.config);
      } catch (e) {
        throw new InputError(`rank ${this.localRanks[s]}: ${(e as Error).message}`);
      }
    });
  }
}

function checkRanks(config: ValidatedConfig, ranks: number): void {
  if (!Number.isInteger(ranks) || ranks < 2 || ranks > FUSED_EP_MAX_RANKS) {
    throw new InputError(
      `FusedExpertParallel: ranks must be an integer in [2, ${FUSED_EP_MAX_RANKS}], got ${describeValue(ranks)} (one rank: MoELayer)`,
    );
  }
  if (config.numExperts % ranks !== 0) {
    throw new InputError(`${config.numExperts} experts cannot be split evenly among ${ranks} ranks`);
  }
}

function checkMaxTokens(maxTokens: number): number {
  if (!Number.isInteger(maxTokens) || maxTokens < 1) {
    throw new InputError(`maxTokens must be a positive integer, got ${describeValue(maxTokens)}`);
  }
  return maxTokens;
}

function checkBlockM(blockM: "auto" | FusedBlockM): "auto" | FusedBlockM {
  if (blockM !== "auto" && !FUSED_BLOCK_MS.includes(blockM)) {
    throw new InputError(
      `FusedExpertParallel: blockM must be "auto" or one of ${FUSED_BLOCK_MS.join(", ")}, got ${describeValue(blockM)}`,
    );
  }
  return blockM;
}

function checkFp4Expand(expand: "auto" | boolean): "auto" | boolean {
  if (expand !== "auto" && typeof expand !== "boolean") {
    throw new InputError(
      `FusedExpertParallel: fp4Expand must be "auto", true or false, got ${describeValue(expand)}`,
    );
  }
  return expand;
}

/** A Device per rank from the options' devices (ordinals opened). */
function resolveDevices(devices: readonly (Device | number)[] | Device | number, ranks: number): Device[] {
  const open = (d: Device | number) => (typeof d === "number" ? openDevice(d) : d);
  if (!Array.isArray(devices)) return new Array<Device>(ranks).fill(open(devices as Device | number));
  if (devices.length !== ranks)
    throw new InputError(`devices lists ${devices.length} GPUs for ${ranks} ranks`);
  return devices.map(open);
}
