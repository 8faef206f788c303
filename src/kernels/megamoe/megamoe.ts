/**
 * The fused MoE kernel (megamoe.cu): one persistent launch from the FP8 rows and the routing to the
 * bf16 output. `FusedMoEKernel` owns what the kernel needs besides the layer's weights: the row pools
 * (FP8 rows and scales, the intermediate, the L2 rows), the slot → row map, the workspace of counters
 * (zero between launches: the kernel's last CTA re-zeroes it) and the watchdog status word, all sized
 * for `maxTokens` once; its tensor maps are encoded once too. A launch is then one `cuLaunchKernel`
 * with no host work but the operand checks, so it can be captured in a CUDA graph.
 */
import { checkOptionFields, type MoEConfig, QUANT_BLOCK, sharedIntermediate } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  DeviceTensor,
  encodeTensorMapTiled,
  expectOperand,
  type Kernel,
  KernelArgs,
  loadKernel,
  type Stream,
} from "../../cuda/index.js";
import {
  encodeFusedEpOperands,
  FUSED_EP_COUNTER_WORDS,
  type FusedEpLayout,
} from "../../parallel/fused-ep.js";
import { checkDeviceMemory, type DeviceMoEWeights } from "../device-weights.js";
import {
  FUSED_OPERANDS_BYTES,
  type FusedOperandPointer,
  type FusedOperandScalar,
  type FusedOwnBuffer,
  type FusedSizes,
  type FusedWeightBuffer,
  fusedBuffers,
  fusedMapCount,
  fusedOperandConstants,
  fusedOperandOffset,
  fusedOperandPointers,
  fusedSizes,
  fusedSizesOf,
  fusedTensorMaps,
} from "./abi.js";
import { type FusedBlockM, fusedEpDefines, fusedExpandImageBytes } from "./megamoe.variants.js";
import {
  type FusedPlan,
  fusedBlockM,
  fusedExpand,
  fusedLayerProblem,
  fusedTilesUpTo,
  planFusedLaunch,
} from "./plan.js";

export { fusedLayerProblem } from "./plan.js";

export const FUSED_KERNEL_SOURCE = "megamoe/megamoe.cu";
export const FUSED_KERNEL = "megamoe_fused";

const pointerOffset = fusedOperandOffset;
/** Per-CTA words of the kernel's trace (its `Trace` enum), in order. */
export const FUSED_TRACE_FIELDS = [
  "entry",
  "countsReady",
  "placed",
  "firstTask",
  "producerDone",
  "mathDone",
  "combineStart",
  "end",
  "dependencyWaitNs",
  "stageEmptyWaitNs",
  "stageFullWaitNs",
  "epilogueNs",
  "l1Tiles",
  "l2Tiles",
  "taskWaitNs",
  "placeClaimNs",
  "placeCopyNs",
  "placeSignalNs",
  "l2EpilogueNs",
  "publishNs",
  "l1EndLast",
  "l2EndFirst",
  "l2ClaimFirst",
  "l2ReadyFirst",
] as const;
/** Which trace fields are times (globaltimer ns; the rest are sums of waits or counts). */
const isTraceTime = (field: (typeof FUSED_TRACE_FIELDS)[number]): boolean => !/Ns$|Tiles$/.test(field);
/** Words per CTA of the trace buffer (the kernel's kTraceWords; at least the fields). */
export const FUSED_TRACE_WORDS = 24;
export type FusedTraceRow = Record<(typeof FUSED_TRACE_FIELDS)[number], number>;

/** One forward's operands on the kernel's device. */
export interface FusedLaunch {
  /** e4m3 [T, H] and fp32 [T, H/128]: the quantized token rows. */
  xq: DeviceTensor;
  xScales: DeviceTensor;
  /** int32 [T, k]; ids outside [0, E) are not routed. */
  ids: DeviceTensor;
  /** fp32 [T, k]. */
  weights: DeviceTensor;
  /** bf16 [T, H], written. */
  out: DeviceTensor;
  tokens: number;
  /** Add the shared expert (ignored when the layer has none). */
  shared: boolean;
}

/**
 * One rank of the EP build (megamoe_ep.cuh): the kernel's weights are the rank's E / R experts, and the
 * launch also takes the EP operands (the peers' symmetric buffers, this rank's EP arrays).
 */
export interface FusedEpKernelOptions {
  /** The symmetric buffer's layout; its shape's maxTokens is the kernel's. */
  layout: FusedEpLayout;
  rank: number;
  /** Every rank's symmetric buffer, by rank (SymmetricHeap.addressTable()). */
  peers: readonly bigint[];
  /** Device address of 8 int32 of mapped pinned host memory: the watchdog's record, readable after a trap. */
  hostStatus: bigint;
}

/** One EP forward's operands; the rank's FP8 rows and scales are already in its buffer's xq and xs. */
export interface FusedEpLaunch {
  /** int32 [T, k]: global expert ids (outside [0, E): not routed). */
  ids: DeviceTensor;
  /** fp32 [T, k]. */
  weights: DeviceTensor;
  /** bf16 [T, H], written. */
  out: DeviceTensor;
  /** 0 .. maxTokens: a rank with no tokens still serves its peers. */
  tokens: number;
  shared: boolean;
}

/** The rank's own EP arrays (megamoe_ep.cuh EpOperands), allocated with the kernel. */
interface FusedEpArrays {
  counters: DeviceTensor;
  chunkCount: DeviceTensor;
  chunkRows: DeviceTensor;
  expect: DeviceTensor;
  poolSource: DeviceTensor;
  operands: Uint8Array;
}

export class FusedMoEKernelError extends Error {
  override name = "FusedMoEKernelError";
}

/** One specialization's (block M, expand variant) plan, kernel and launch arguments. */
interface FusedSpecialization {
  plan: FusedPlan;
  kernel: Kernel;
  args: KernelArgs;
}

/** A layer's device weights under the names of the kernel's ABI (abi.ts: FusedWeightBuffer). */
export function fusedWeightTensors(w: DeviceMoEWeights): Partial<Record<FusedWeightBuffer, DeviceTensor>> {
  const fp4 = w.routedFp4;
  const routed: Partial<Record<FusedWeightBuffer, DeviceTensor>> =
    fp4 === null
      ? {
          routed_w1: w.routed.w1,
          routed_w1_scales: w.routed.w1Scales,
          routed_w2: w.routed.w2,
          routed_w2_scales: w.routed.w2Scales,
        }
      : {
          routed_w1: fp4.w1,
          routed_w1_words: fp4.w1Scales,
          routed_w1_scales: fp4.w1BlockScales,
          routed_w2: fp4.w2,
          routed_w2_words: fp4.w2Scales,
          routed_w2_scales: fp4.w2BlockScales,
        };
  const s = w.shared;
  if (s === null) return routed;
  return {
    ...routed,
    shared_expert_w1: s.w1,
    shared_expert_w1_scales: s.w1Scales,
    shared_expert_w2: s.w2,
    shared_expert_w2_scales: s.w2Scales,
  };
}

export class FusedMoEKernel {
  readonly device: Device;
  /** The launch's shape: with EP the whole layer's experts and top-k, `ranks` R (NUM_EXPERTS = E / R). */
  readonly config: MoEConfig;
  readonly maxTokens: number;
  /** Pool rows: T·k routed + T for the shared expert (EP: the layout's R·T·min(k, E/R) + T). */
  readonly poolRows: number;
  /** The EP build's rank, or null for the one-rank kernel. */
  readonly ep: FusedEpKernelOptions | null;
  /** CTAs per launch: the SM count (one per SM). Tests lower it to change the scheduling order. */
  ctas: number;
  /** Rows per tile: "auto" (fusedBlockM's choice from the token count) or forced (tests, benchmarks). */
  blockM: "auto" | FusedBlockM = "auto";
  /**
   * FP4 experts: expand them into e4m3 stage images in the forward (the expand variant): "auto"
   * (fusedExpand's choice from the token count), false, or true (every launch with 128-row tiles). The
   * images take fusedExpandImageBytes of device memory, allocated with the first specialization that
   * expands.
   */
  fp4Expand: "auto" | boolean = "auto";
  /**
   * The compiled kernel per block M and variant, with its stage count, shared memory and encoded
   * arguments: those the heuristics pick for some T ≤ maxTokens are made with the kernel (a launch then
   * only picks one, so a forward can be captured in a graph), the others on the first launch that forces
   * them.
   */
  private readonly specializations = new Map<string, FusedSpecialization>();
  /** Every buffer the tensor maps and operands name: the kernel's own and the layer's weights. */
  private readonly buffers = new Map<FusedOwnBuffer | FusedWeightBuffer, DeviceTensor>();
  private readonly sizes: FusedSizes;
  private readonly operands = new Uint8Array(FUSED_OPERANDS_BYTES);
  private readonly operandsView = new DataView(this.operands.buffer);
  private readonly owned: DeviceTensor[] = [];
  private readonly workspace: DeviceTensor;
  private readonly status: DeviceTensor;
  private readonly hasShared: boolean;
  private readonly epArrays: FusedEpArrays | null = null;
  private trace: DeviceTensor | null = null;
  /** The expand variant's stage images, once a specialization expands. */
  private images: DeviceTensor | null = null;
  private tracing = false;
  private disposed = false;

  /**
   * `ep`: build the rank `ep.rank` of the in-kernel expert-parallel layer; `weights` then hold that
   * rank's experts (RankWeights' config: E / R experts) and `maxTokens` is the layout's.
   */
  constructor(device: Device, weights: DeviceMoEWeights, maxTokens: number, ep?: FusedEpKernelOptions) {
    checkOptionFields(
      "FusedMoEKernel ep options",
      ep,
      ["layout", "rank", "peers", "hostStatus"],
      (m) => new FusedMoEKernelError(m),
    );
    const c = ep === undefined ? weights.config : epKernelConfig(weights.config, maxTokens, ep);
    const problem = fusedLayerProblem(c);
    if (problem !== null) throw new FusedMoEKernelError(`the fused kernel cannot run this layer: ${problem}`);
    if (!Number.isInteger(maxTokens) || maxTokens < 1) {
      throw new RangeError(`maxTokens must be a positive integer, got ${maxTokens}`);
    }
    this.device = device;
    this.config = c;
    this.maxTokens = maxTokens;
    this.ep = ep === undefined ? null : { ...ep, peers: [...ep.peers] };
    this.hasShared = weights.shared !== null;
    const H = c.hidden;
    const maxInter = Math.max(c.intermediate, sharedIntermediate(c));
    this.sizes =
      ep === undefined
        ? fusedSizes(c, maxTokens, this.hasShared)
        : fusedSizesOf(ep.layout.localExperts, ep.layout.poolRows, this.hasShared);
    this.poolRows = this.sizes.poolRows;
    if (this.poolRows * Math.max(H, maxInter) >= 2 ** 31 * 16) {
      throw new RangeError(`maxTokens ${maxTokens} is too large for the fused kernel's row pool`);
    }
    this.ctas = device.smCount;
    for (const [name, t] of Object.entries(fusedWeightTensors(weights)))
      this.buffers.set(name as FusedWeightBuffer, t);

    const alloc = <D extends "fp8_e4m3" | "fp32" | "bf16" | "int32">(dtype: D, shape: number[]) => {
      const t = DeviceTensor.empty(device, dtype, shape);
      this.owned.push(t);
      return t;
    };
    try {
      for (const b of fusedBuffers(c, maxTokens, this.sizes)) {
        const t = alloc(b.dtype, b.shape);
        if (b.init === "zero") t.fill(0);
        this.buffers.set(b.name, t);
      }
      this.workspace = this.buffer("workspace");
      this.status = this.buffer("status");
      if (ep !== undefined) {
        const w = ep.layout.workspace;
        const counters = alloc("int32", [FUSED_EP_COUNTER_WORDS]);
        const chunkCount = alloc("int32", [w.chunkCount]);
        const chunkRows = alloc("int32", [w.chunkRows]);
        const expect = alloc("int32", [w.expect]);
        const poolSource = alloc("int32", [w.poolSource]);
        // The counters must be zero before the first launch (the last CTA out re-zeroes them).
        for (const t of [counters, chunkCount, chunkRows, expect]) t.fill(0);
        poolSource.fill(0xff);
        const operands = encodeFusedEpOperands(ep.layout, ep.rank, {
          peers: ep.peers,
          counters: counters.ptr,
          chunkCount: chunkCount.ptr,
          chunkRows: chunkRows.ptr,
          expect: expect.ptr,
          poolSource: poolSource.ptr,
          hostStatus: ep.hostStatus,
        });
        this.epArrays = { counters, chunkCount, chunkRows, expect, poolSource, operands };
        // The rank's rows are read from its buffer's xq and xs regions (op.xq names them for clarity).
        const own = ep.peers[ep.rank]!;
        const ov = this.operandsView;
        ov.setBigUint64(pointerOffset("xq"), own + BigInt(ep.layout.regions.xq.offset), true);
        ov.setBigUint64(pointerOffset("x_scales"), own + BigInt(ep.layout.regions.xs.offset), true);
      }

      // The buffers' fields; the per-launch operands (and images, per specialization) come with a launch.
      const v = this.operandsView;
      for (const [field, source] of Object.entries(fusedOperandPointers(this.sizes, false))) {
        if (source !== null && "buffer" in source)
          v.setBigUint64(pointerOffset(field as FusedOperandPointer), this.buffer(source.buffer).ptr, true);
      }
      for (const [field, value] of Object.entries(fusedOperandConstants(c, this.sizes))) {
        const offset = pointerOffset(field as FusedOperandScalar);
        if (field === "clamp") v.setFloat32(offset, value, true);
        else v.setInt32(offset, value, true);
      }
      for (const tile of fusedTilesUpTo(c, this.heuristicTokens(maxTokens))) {
        this.specialization(tile.blockM, tile.expand);
      }
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  /** The kernel of one block M and variant, compiled, loaded and given its tensor maps on first use. */
  private specialization(blockM: FusedBlockM, expand: boolean): FusedSpecialization {
    const key = `${blockM}${expand ? "x" : ""}`;
    const made = this.specializations.get(key);
    if (made !== undefined) return made;
    const c = this.config;
    // The grid and token count are the launch's; a specialization holds what the block M fixes.
    const plan = planFusedLaunch(c, this.maxTokens, this.ctas, blockM, expand);
    if (plan.expand) this.allocateImages();
    const ep = this.epArrays;
    const defines = ep === null ? plan.defines : fusedEpDefines(c, c.ranks, blockM, plan.expand);
    const compiled = compileKernel({ source: FUSED_KERNEL_SOURCE, defines });
    const kernel = loadKernel(this.device, compiled, FUSED_KERNEL);
    kernel.setMaxDynamicSharedMemory(plan.sharedBytes);
    const maps = fusedTensorMaps(c, blockM, this.sizes);
    // The EP build takes its operands as a second struct after Operands (megamoe.cu's signature).
    const args = new KernelArgs(maps.length + (ep === null ? 1 : 2), {
      tensorMaps: maps.map((_, i) => i),
      structs:
        ep === null
          ? { [maps.length]: FUSED_OPERANDS_BYTES }
          : { [maps.length]: FUSED_OPERANDS_BYTES, [maps.length + 1]: ep.operands.length },
    });
    if (ep !== null) args.struct(maps.length + 1, ep.operands);
    maps.forEach((m, i) => {
      encodeTensorMapTiled(args.tensorMap(i), { ...m.shape, globalAddress: this.buffer(m.buffer).ptr });
    });
    const spec = { plan, kernel, args };
    this.specializations.set(key, spec);
    return spec;
  }

  /** The device address of a buffer the ABI names (an export's launches name the same buffers). */
  bufferAddress(name: FusedOwnBuffer | FusedWeightBuffer): bigint {
    return this.buffer(name).ptr;
  }

  /** A buffer the ABI names: the kernel's own or one of the layer's weights. */
  private buffer(name: FusedOwnBuffer | FusedWeightBuffer): DeviceTensor {
    const t = this.buffers.get(name);
    if (t === undefined) throw new FusedMoEKernelError(`the fused kernel has no buffer ${name}`);
    return t;
  }

  /** The expand variant's stage images (once; launches of other specializations never read them). */
  private allocateImages(): void {
    if (this.images !== null) return;
    const bytes = fusedExpandImageBytes(this.config);
    checkDeviceMemory(this.device, bytes, `the fused kernel's FP4 expansion (layer ${this.config.name})`);
    this.images = DeviceTensor.empty(this.device, "uint8", [bytes]);
    this.owned.push(this.images);
    this.buffers.set("images", this.images);
  }

  /**
   * The token count the block-M heuristic sees: with EP, every rank's T tokens spread over E experts
   * land on this rank's E / R, so its experts average R·T·k / E rows, as one layer's of R·T tokens.
   */
  private heuristicTokens(tokens: number): number {
    return tokens * this.config.ranks;
  }

  /** The plan of a launch of `tokens` rows with this kernel's block M, expansion and CTA settings. */
  plan(tokens: number): FusedPlan {
    const c = this.config;
    const t = this.heuristicTokens(tokens);
    const blockM = this.blockM === "auto" ? fusedBlockM(c, t) : this.blockM;
    const expand = this.fp4Expand === "auto" ? fusedExpand(c, t, blockM) : this.fp4Expand;
    return planFusedLaunch(c, tokens, this.ctas, blockM, expand);
  }

  /**
   * Compiles and loads, now, the specialization a launch of `tokens` would use, with the expand
   * variant's images: R ranks' launches on one device must not load a module between them (a load may
   * wait for the device, and a launched rank waits for the ranks not launched yet), and a forced block M
   * or variant must be prepared before a graph captures its launch (allocation fails under capture).
   */
  prepare(tokens: number): FusedPlan {
    const plan = this.plan(tokens);
    this.specialization(plan.blockM, plan.expand);
    return plan;
  }

  /** Checks the operands and queues one launch on `stream` (null: the legacy default stream). */
  launch(f: FusedLaunch, stream: Stream | null): void {
    if (this.disposed) throw new Error("FusedMoEKernel used after dispose()");
    if (this.ep !== null)
      throw new Error("FusedMoEKernel.launch: an EP rank's kernel launches with launchEp");
    const c = this.config;
    const { tokens } = f;
    if (!Number.isInteger(tokens) || tokens < 1 || tokens > this.maxTokens) {
      throw new RangeError(
        `FusedMoEKernel.launch: tokens must be an integer in [1, ${this.maxTokens}], got ${tokens}`,
      );
    }
    const where = "FusedMoEKernel.launch";
    const H = c.hidden;
    expectOperand(where, "xq", f.xq, "fp8_e4m3", [tokens, H], this.device);
    expectOperand(where, "xScales", f.xScales, "fp32", [tokens, H / QUANT_BLOCK], this.device);
    expectOperand(where, "ids", f.ids, "int32", [tokens, c.topK], this.device);
    expectOperand(where, "weights", f.weights, "fp32", [tokens, c.topK], this.device);
    expectOperand(where, "out", f.out, "bf16", [tokens, H], this.device);
    const v = this.operandsView;
    v.setBigUint64(pointerOffset("xq"), f.xq.ptr, true);
    v.setBigUint64(pointerOffset("x_scales"), f.xScales.ptr, true);
    v.setBigUint64(pointerOffset("ids"), f.ids.ptr, true);
    v.setBigUint64(pointerOffset("weights"), f.weights.ptr, true);
    v.setBigUint64(pointerOffset("out"), f.out.ptr, true);
    v.setBigUint64(pointerOffset("trace"), this.tracing ? (this.trace?.ptr ?? 0n) : 0n, true);
    v.setInt32(pointerOffset("tokens"), tokens, true);
    v.setInt32(pointerOffset("use_shared"), f.shared && this.hasShared ? 1 : 0, true);
    this.queue(tokens, stream);
  }

  /** The CTA check, the plan and the launch of the operands set in `operands`. */
  private queue(tokens: number, stream: Stream | null): void {
    if (!Number.isInteger(this.ctas) || this.ctas < 1 || this.ctas > this.device.smCount) {
      throw new RangeError(
        `FusedMoEKernel: ctas must be an integer in [1, ${this.device.smCount}], got ${this.ctas}`,
      );
    }
    const trace = this.tracing ? this.trace : null;
    const plan = this.plan(tokens);
    const spec = this.specialization(plan.blockM, plan.expand);
    trace?.fill(0, stream);
    // Only the expand variant reads the images (fusedOperandPointers).
    this.operandsView.setBigUint64(
      pointerOffset("images"),
      plan.expand ? this.buffer("images").ptr : 0n,
      true,
    );
    spec.args.struct(fusedMapCount(this.config), this.operands);
    spec.kernel.launchAfterPrevious(plan.ctas, plan.threads, plan.sharedBytes, stream, spec.args);
  }

  /**
   * One EP rank's launch on `stream`: the rank's FP8 rows and scales must be in its buffer's xq and xs
   * regions (queued before on the same stream), and every other rank must launch its part of the same
   * forward within the watchdog's 2 s, with all ranks' CTAs resident at once.
   */
  launchEp(f: FusedEpLaunch, stream: Stream | null): void {
    if (this.disposed) throw new Error("FusedMoEKernel used after dispose()");
    if (this.ep === null) throw new Error("FusedMoEKernel.launchEp: this kernel was built without EP");
    const c = this.config;
    const { tokens } = f;
    if (!Number.isInteger(tokens) || tokens < 0 || tokens > this.maxTokens) {
      throw new RangeError(
        `FusedMoEKernel.launchEp: tokens must be an integer in [0, ${this.maxTokens}], got ${tokens}`,
      );
    }
    const where = "FusedMoEKernel.launchEp";
    expectOperand(where, "ids", f.ids, "int32", [tokens, c.topK], this.device);
    expectOperand(where, "weights", f.weights, "fp32", [tokens, c.topK], this.device);
    expectOperand(where, "out", f.out, "bf16", [tokens, c.hidden], this.device);
    const v = this.operandsView;
    // A rank without tokens reads none of these; its views may have no address of their own.
    v.setBigUint64(pointerOffset("ids"), tokens > 0 ? f.ids.ptr : 0n, true);
    v.setBigUint64(pointerOffset("weights"), tokens > 0 ? f.weights.ptr : 0n, true);
    v.setBigUint64(pointerOffset("out"), tokens > 0 ? f.out.ptr : 0n, true);
    v.setBigUint64(pointerOffset("trace"), this.tracing ? (this.trace?.ptr ?? 0n) : 0n, true);
    v.setInt32(pointerOffset("tokens"), tokens, true);
    v.setInt32(pointerOffset("use_shared"), f.shared && this.hasShared ? 1 : 0, true);
    this.queue(tokens, stream);
  }

  /**
   * The last EP launch's bookkeeping, for tests against the CPU model: the rank's slots per global
   * expert (its count phase, summed over chunks, for `tokens` tokens) and the first `rows` pool rows'
   * sources (source rank, t·k + j; −1 and t for the shared expert's rows). Waits for the device.
   */
  readEpState(tokens: number, rows: number): { slotsPerExpert: Int32Array; poolSource: Int32Array } {
    const ep = this.epArrays;
    if (ep === null || this.ep === null) throw new Error("FusedMoEKernel.readEpState: not an EP kernel");
    const E = this.config.numExperts;
    const chunks = Math.ceil(tokens / this.ep.layout.chunkTokens);
    const all = ep.chunkCount.toHost() as Int32Array;
    const slotsPerExpert = new Int32Array(E);
    for (let ch = 0; ch < chunks; ch++) for (let e = 0; e < E; e++) slotsPerExpert[e]! += all[ch * E + e]!;
    const poolSource = (ep.poolSource.toHost() as Int32Array).slice(0, 2 * rows);
    return { slotsPerExpert, poolSource };
  }

  /**
   * Waits for the device. A launch whose wait never completed (the 2 s watchdog) trapped: that surfaces
   * here as a FusedMoEKernelError carrying the CUDA error (the CUDA context is unusable afterwards).
   */
  checkStatus(): void {
    try {
      this.device.synchronize();
    } catch (e) {
      throw new FusedMoEKernelError(
        `the fused MoE kernel failed (${(e as Error).message}); a wait inside it that never completes ` +
          "traps after 2 s: please report this with the layer's shape and token count",
      );
    }
  }

  /**
   * Diagnosis: from the next launch on, every CTA records its timeline (phase times, summed waits) into a
   * buffer that `readTrace` returns. Costs a few timer reads per wait; not for timing runs.
   */
  enableTrace(): void {
    if (this.trace === null)
      this.trace = DeviceTensor.empty(this.device, "int64", [this.device.smCount, FUSED_TRACE_WORDS]);
    this.tracing = true;
  }

  /** Launches stop recording (the buffer is kept for the next enableTrace). */
  disableTrace(): void {
    this.tracing = false;
  }

  /** The last traced launch's timeline, one row per CTA (times in ns since the earliest CTA's entry). */
  readTrace(): FusedTraceRow[] {
    if (this.trace === null) throw new Error("FusedMoEKernel.readTrace: enableTrace() first");
    this.device.synchronize();
    const words = this.trace.toHost() as BigInt64Array;
    const rows: FusedTraceRow[] = [];
    let t0 = Number.POSITIVE_INFINITY;
    for (let cta = 0; cta < this.ctas; cta++) t0 = Math.min(t0, Number(words[cta * FUSED_TRACE_WORDS]));
    for (let cta = 0; cta < this.ctas; cta++) {
      const row = {} as FusedTraceRow;
      FUSED_TRACE_FIELDS.forEach((field, i) => {
        const w = Number(words[cta * FUSED_TRACE_WORDS + i]);
        row[field] = isTraceTime(field) ? (w === 0 ? Number.NaN : w - t0) : w;
      });
      rows.push(row);
    }
    return rows;
  }

  /** For tests: every byte of the pools and the slot map set to `byte` (0xFF: NaN everywhere). */
  fillScratch(byte: number, stream: Stream | null = null): void {
    for (const t of this.owned) {
      if (t !== this.workspace && t !== this.status && !this.isEpCounter(t)) t.fill(byte, stream);
    }
  }

  private isEpCounter(t: DeviceTensor): boolean {
    const ep = this.epArrays;
    return ep !== null && (t === ep.counters || t === ep.chunkCount || t === ep.chunkRows || t === ep.expect);
  }

  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    for (const t of this.owned) t.dispose();
    this.trace?.dispose();
  }
}

/** The EP kernel's shape: the rank's weights' layer with the whole layer's experts and top-k, split R ways. */
function epKernelConfig(local: MoEConfig, maxTokens: number, ep: FusedEpKernelOptions): MoEConfig {
  const { shape, localExperts } = ep.layout;
  const why = (what: string) => new RangeError(`FusedMoEKernel (EP rank ${ep.rank}): ${what}`);
  if (local.numExperts !== localExperts) {
    throw why(`the weights hold ${local.numExperts} experts, the layout's rank ${localExperts}`);
  }
  if (local.hidden !== shape.hidden) throw why(`hidden ${local.hidden} ≠ the layout's ${shape.hidden}`);
  if (maxTokens !== shape.maxTokens) throw why(`maxTokens ${maxTokens} ≠ the layout's ${shape.maxTokens}`);
  if (ep.peers.length !== shape.ranks) throw why(`${ep.peers.length} peer buffers for ${shape.ranks} ranks`);
  return { ...local, numExperts: shape.numExperts, topK: shape.topK, ranks: shape.ranks };
}
