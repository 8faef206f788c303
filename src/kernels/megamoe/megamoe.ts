/**
 * The fused MoE kernel (megamoe.cu): one persistent launch from the FP8 rows and the routing to the
 * bf16 output. `FusedMoEKernel` owns what the kernel needs besides the layer's weights: the row pools
 * (FP8 rows and scales, the intermediate, the L2 rows), the slot → row map, the workspace of counters
 * (zero between launches: the kernel's last CTA re-zeroes it) and the watchdog status word, all sized
 * for `maxTokens` once; its tensor maps are encoded once too. A launch is then one `cuLaunchKernel`
 * with no host work but the operand checks, so it can be captured in a CUDA graph.
 */
import {
  checkOptionFields,
  expertFormatOf,
  type MoEConfig,
  QUANT_BLOCK,
  sharedIntermediate,
} from "../../config/config.js";
import {
  compileKernel,
  type Device,
  DeviceTensor,
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
import { aScalesRows } from "../gemm/grouped_gemm.js";
import {
  encodeFp4LayoutMap,
  encodeFp4ScaleWordsMap,
  encodeFp8RowsMap,
  encodeScaleColumnsMap,
} from "../tensor-maps.js";
import {
  FUSED_BLOCK_MS,
  FUSED_BLOCK_N,
  FUSED_COUNTER_WORDS,
  type FusedBlockM,
  fusedEpDefines,
  fusedExpandImageBytes,
} from "./megamoe.variants.js";
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

/** megamoe.cu's `Operands` struct: 19 pointers (in this order), then 5 int32 and 1 float. */
const OPERAND_POINTERS = [
  "xq",
  "x_scales",
  "ids",
  "weights",
  "w1_scales",
  "w2_scales",
  "w1s_scales",
  "w2s_scales",
  "pool_x",
  "pool_x_scales",
  "pool_h",
  "pool_h_scales",
  "y",
  "slot_row",
  "out",
  "workspace",
  "status",
  "trace",
  "images",
] as const;
type OperandPointer = (typeof OPERAND_POINTERS)[number];
const pointerOffset = (name: OperandPointer) => 8 * OPERAND_POINTERS.indexOf(name);
const SCALARS = 8 * OPERAND_POINTERS.length;
const OFF_TOKENS = SCALARS;
const OFF_R_PAD = SCALARS + 4;
const OFF_MAX_BLOCKS = SCALARS + 8;
const OFF_USE_SHARED = SCALARS + 12;
const OFF_HAS_CLAMP = SCALARS + 16;
const OFF_CLAMP = SCALARS + 20;
const OPERANDS_BYTES = SCALARS + 24;
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
/** Tensor maps before the operands: 8, and 2 more (the routed experts' UE8M0 words) with FP4 experts. */
const mapCount = (c: MoEConfig) => (expertFormatOf(c) === "fp4" ? 10 : 8);
const WEIGHT_BOX_ROWS = FUSED_BLOCK_N / 2;

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

/** The row pools the kernel's tensor maps point into. */
interface FusedPools {
  poolX: DeviceTensor;
  poolXScales: DeviceTensor;
  poolH: DeviceTensor;
  poolHScales: DeviceTensor;
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
  private readonly pools: FusedPools;
  private readonly weights: DeviceMoEWeights;
  private readonly operands = new Uint8Array(OPERANDS_BYTES);
  private readonly operandsView = new DataView(this.operands.buffer);
  private readonly owned: DeviceTensor[] = [];
  private readonly workspace: DeviceTensor;
  private readonly status: DeviceTensor;
  private readonly maxBlocks: number;
  private readonly rPad: number;
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
    // The experts this kernel holds: the rank's E / R with EP (the one-rank path as it was).
    const E = ep === undefined ? c.numExperts : ep.layout.localExperts;
    const maxInter = Math.max(c.intermediate, sharedIntermediate(c));
    this.poolRows =
      ep === undefined ? maxTokens * c.topK + (this.hasShared ? maxTokens : 0) : ep.layout.poolRows;
    this.rPad = aScalesRows(this.poolRows);
    this.maxBlocks = Math.ceil(this.poolRows / Math.min(...FUSED_BLOCK_MS)) + E + 1;
    if (this.poolRows * Math.max(H, maxInter) >= 2 ** 31 * 16) {
      throw new RangeError(`maxTokens ${maxTokens} is too large for the fused kernel's row pool`);
    }
    this.ctas = device.smCount;
    this.weights = weights;

    const alloc = <D extends "fp8_e4m3" | "fp32" | "bf16" | "int32">(dtype: D, shape: number[]) => {
      const t = DeviceTensor.empty(device, dtype, shape);
      this.owned.push(t);
      return t;
    };
    try {
      const poolX = alloc("fp8_e4m3", [this.poolRows, H]);
      const poolXScales = alloc("fp32", [H / QUANT_BLOCK, this.rPad]);
      const poolH = alloc("fp8_e4m3", [this.poolRows, maxInter]);
      const poolHScales = alloc("fp32", [maxInter / QUANT_BLOCK, this.rPad]);
      const y = alloc("bf16", [this.poolRows, H]);
      const slotRow = alloc("int32", [maxTokens * c.topK]);
      // Counters, counts and cursors per group, arrivals and L1 publications per block, expanded chunks
      // per expert and matrix (megamoe_layout.cuh).
      this.workspace = alloc("int32", [FUSED_COUNTER_WORDS + 2 * (E + 1) + 2 * this.maxBlocks + 2 * E]);
      this.status = alloc("int32", [4]);
      this.workspace.fill(0);
      this.status.fill(0);
      this.pools = { poolX, poolXScales, poolH, poolHScales };
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

      // The tiles promote with each 128 × 128 block's fp32 scale: FP8 experts' own, FP4 experts' block
      // scales (their converters read the reference words through tensor maps).
      const fp4 = weights.routedFp4;
      const routedScales =
        fp4 === null ? weights.routed : { w1Scales: fp4.w1BlockScales, w2Scales: fp4.w2BlockScales };
      const shared = weights.shared ?? routedScales; // never read when the layer has no shared expert
      const v = this.operandsView;
      const fixed: [OperandPointer, bigint][] = [
        ["w1_scales", routedScales?.w1Scales.ptr ?? 0n],
        ["w2_scales", routedScales?.w2Scales.ptr ?? 0n],
        ["w1s_scales", shared?.w1Scales.ptr ?? 0n],
        ["w2s_scales", shared?.w2Scales.ptr ?? 0n],
        ["pool_x", poolX.ptr],
        ["pool_x_scales", poolXScales.ptr],
        ["pool_h", poolH.ptr],
        ["pool_h_scales", poolHScales.ptr],
        ["y", y.ptr],
        ["slot_row", slotRow.ptr],
        ["workspace", this.workspace.ptr],
        ["status", this.status.ptr],
      ];
      for (const [name, ptr] of fixed) v.setBigUint64(pointerOffset(name), ptr, true);
      v.setInt32(OFF_R_PAD, this.rPad, true);
      v.setInt32(OFF_MAX_BLOCKS, this.maxBlocks, true);
      v.setInt32(OFF_HAS_CLAMP, c.swigluClamp === null ? 0 : 1, true);
      v.setFloat32(OFF_CLAMP, c.swigluClamp ?? 0, true);
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
    const maps = mapCount(c);
    // The EP build takes its operands as a second struct after Operands (megamoe.cu's signature).
    const args = new KernelArgs(maps + (ep === null ? 1 : 2), {
      tensorMaps: Array.from({ length: maps }, (_, i) => i),
      structs:
        ep === null ? { [maps]: OPERANDS_BYTES } : { [maps]: OPERANDS_BYTES, [maps + 1]: ep.operands.length },
    });
    if (ep !== null) args.struct(maps + 1, ep.operands);
    const H = c.hidden;
    const E = this.ep === null ? c.numExperts : this.ep.layout.localExperts;
    const I = c.intermediate;
    const maxInter = Math.max(c.intermediate, sharedIntermediate(c));
    const { poolX, poolXScales, poolH, poolHScales } = this.pools;
    const fp4 = this.weights.routedFp4;
    // Never read when the layer has no shared expert: any weights of the right size stand in.
    const shared = this.weights.shared ?? (fp4 === null ? this.weights.routed : null);
    const sharedInter = this.hasShared ? sharedIntermediate(c) : c.intermediate;
    const sharedExperts = this.hasShared ? 1 : E;
    // The row pools' boxes hold one tile's rows (BLOCK_M): a taller box would overrun the stage.
    // A weight box is one of a tile's two B boxes; an A box a tile's rows.
    encodeFp8RowsMap(args.tensorMap(0), poolX.ptr, H, poolX.shape[0]!, blockM);
    encodeScaleColumnsMap(args.tensorMap(1), poolXScales.ptr, H, this.rPad, blockM + 4);
    encodeFp8RowsMap(args.tensorMap(4), poolH.ptr, maxInter, poolH.shape[0]!, blockM);
    encodeScaleColumnsMap(args.tensorMap(5), poolHScales.ptr, maxInter, this.rPad, blockM + 4);
    if (fp4 === null) {
      const routed = this.weights.routed;
      encodeFp8RowsMap(args.tensorMap(2), routed.w1.ptr, H, E * 2 * I, WEIGHT_BOX_ROWS);
      encodeFp8RowsMap(args.tensorMap(6), routed.w2.ptr, I, E * H, WEIGHT_BOX_ROWS);
    } else {
      // MXFP4 routed experts: packed rows (device layout) in maps 2 and 6, their UE8M0 words in 8 and 9.
      encodeFp4LayoutMap(args.tensorMap(2), fp4.w1.ptr, H, E * 2 * I, WEIGHT_BOX_ROWS);
      encodeFp4LayoutMap(args.tensorMap(6), fp4.w2.ptr, I, E * H, WEIGHT_BOX_ROWS);
      encodeFp4ScaleWordsMap(args.tensorMap(8), fp4.w1Scales.ptr, H, E * 2 * I, WEIGHT_BOX_ROWS);
      encodeFp4ScaleWordsMap(args.tensorMap(9), fp4.w2Scales.ptr, I, E * H, WEIGHT_BOX_ROWS);
    }
    if (shared !== null) {
      encodeFp8RowsMap(args.tensorMap(3), shared.w1.ptr, H, sharedExperts * 2 * sharedInter, WEIGHT_BOX_ROWS);
      encodeFp8RowsMap(args.tensorMap(7), shared.w2.ptr, sharedInter, sharedExperts * H, WEIGHT_BOX_ROWS);
    } else {
      // No shared expert and FP4 routed experts: maps 3 and 7 are never read; pool_x stands in.
      encodeFp8RowsMap(args.tensorMap(3), poolX.ptr, H, poolX.shape[0]!, WEIGHT_BOX_ROWS);
      encodeFp8RowsMap(args.tensorMap(7), poolX.ptr, H, poolX.shape[0]!, WEIGHT_BOX_ROWS);
    }
    const spec = { plan, kernel, args };
    this.specializations.set(key, spec);
    return spec;
  }

  /** The expand variant's stage images (once; launches of other specializations never read them). */
  private allocateImages(): void {
    if (this.images !== null) return;
    const bytes = fusedExpandImageBytes(this.config);
    checkDeviceMemory(this.device, bytes, `the fused kernel's FP4 expansion (layer ${this.config.name})`);
    this.images = DeviceTensor.empty(this.device, "uint8", [bytes]);
    this.owned.push(this.images);
    this.operandsView.setBigUint64(pointerOffset("images"), this.images.ptr, true);
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
    v.setInt32(OFF_TOKENS, tokens, true);
    v.setInt32(OFF_USE_SHARED, f.shared && this.hasShared ? 1 : 0, true);
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
    spec.args.struct(mapCount(this.config), this.operands);
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
    v.setInt32(OFF_TOKENS, tokens, true);
    v.setInt32(OFF_USE_SHARED, f.shared && this.hasShared ? 1 : 0, true);
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
