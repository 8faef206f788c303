/**
 * The MoE layer on the GPU as a sequence of launches (the unfused baseline):
 *
 *   quantize x → dispatch layout → gather → L1 grouped GEMM (fp32) → SwiGLU + re-quantization
 *   → L2 grouped GEMM (bf16) → shared expert (scale transpose, L1, SwiGLU, L2 as one group) → combine
 *
 * With FP4 (MXFP4) routed experts (config.expertFormat "fp4") the routed L1 and L2 are the FP4 grouped
 * GEMM (`groupedGemmFp4`: same A operand, groups and outputs; the weights converted to e4m3 on the fly,
 * docs/numerics.md "FP4 experts"); the shared expert stays FP8, and every other launch is unchanged.
 *
 * Every buffer is allocated once, sized for `maxTokens`; a forward uses views of them. Nothing waits on
 * the host: the expert-sorted buffers and the GEMMs are sized by the upper bound T·k rows, and the real
 * row count group_offsets[E] is read on the device (rows that belong to no expert are skipped). So a
 * forward can be captured in a CUDA graph, once `warmup(tokens)` (or an eager forward of that size) has
 * compiled and loaded every kernel it uses: compilation, module loading and the GEMM's one-time status
 * buffer are host work that capture forbids.
 */
import { type MoEConfig, QUANT_BLOCK, sharedIntermediate } from "../config/config.js";
import { type Device, DeviceTensor, expectOperand, type Stream } from "../cuda/index.js";
import type { DeviceExpertPair, DeviceFp4ExpertPair, DeviceMoEWeights } from "../kernels/device-weights.js";
import { groupedGemmFp4 } from "../kernels/gemm/fp4_grouped_gemm.js";
import { aScalesRows, groupedGemmFp8 } from "../kernels/gemm/grouped_gemm.js";
import { quantizeOnDevice } from "../kernels/quant/quant.js";
import {
  combineOnDevice,
  dispatchLayoutOnDevice,
  gatherRowsOnDevice,
  loadMoeKernels,
  MOE_MAX_EXPERTS,
  type RowCount,
  swigluQuantizeOnDevice,
} from "../kernels/unfused/moe.js";

/** One forward's operands, all on the pipeline's device. */
export interface UnfusedForward {
  /** bf16 [T, H]. */
  x: DeviceTensor;
  /** int32 [T, k]: expert ids; −1 (or any id outside [0, E)) = slot not routed. */
  ids: DeviceTensor;
  /** fp32 [T, k]: routing weights. */
  weights: DeviceTensor;
  /** bf16 [T, H], written. */
  out: DeviceTensor;
  tokens: number;
  /** Add the shared expert (ignored when the layer has none, as in the CPU reference). */
  shared: boolean;
}

/**
 * The first thing wrong with a forward's operands (dtype, shape, device), or null. Pure host checks, so
 * the layer can turn them into its own error type.
 */
export function forwardProblem(
  config: MoEConfig,
  maxTokens: number,
  device: Device,
  f: UnfusedForward,
): string | null {
  const { tokens } = f;
  if (!Number.isInteger(tokens) || tokens < 1 || tokens > maxTokens) {
    return `tokens must be an integer in [1, ${maxTokens}], got ${tokens}`;
  }
  const H = config.hidden;
  const k = config.topK;
  try {
    expectOperand("forward", "x", f.x, "bf16", [tokens, H], device);
    expectOperand("forward", "ids", f.ids, "int32", [tokens, k], device);
    expectOperand("forward", "weights", f.weights, "fp32", [tokens, k], device);
    expectOperand("forward", "out", f.out, "bf16", [tokens, H], device);
  } catch (e) {
    return (e as Error).message;
  }
  return null;
}

/** What the layer needs of a GPU pipeline (the unfused one here, the fused one in fused.ts). */
export interface MoEPipeline {
  readonly kind: "unfused" | "fused";
  readonly device: Device;
  readonly config: MoEConfig;
  readonly maxTokens: number;
  forward(f: UnfusedForward, stream: Stream | null): void;
  /** Runs one forward of `tokens` tokens and waits: every kernel it uses is then loaded (graph capture). */
  warmup(tokens: number, stream?: Stream | null): void;
  /** Waits for the device and throws if a launch reported a failure of its own (the fused kernel's watchdog). */
  checkStatus(): void;
  /** For tests: every byte of every intermediate buffer set to `byte` (0xFF: NaN in every format). */
  fillScratch(byte: number, stream?: Stream | null): void;
  dispose(): void;
}

/**
 * One forward of `tokens` tokens on scratch inputs (nothing routed, shared expert on), waited for:
 * every kernel such a forward uses is then compiled and loaded, so forwards of this size can be
 * captured in a CUDA graph. Allocates (and frees) its scratch inputs.
 */
export function warmupPipeline(p: MoEPipeline, tokens: number, stream: Stream | null): void {
  const c = p.config;
  const scratch: DeviceTensor[] = [];
  const make = (dtype: "bf16" | "int32" | "fp32", shape: number[], byte: number) => {
    const t = DeviceTensor.empty(p.device, dtype, shape);
    scratch.push(t);
    t.fill(byte, stream);
    return t;
  };
  try {
    const x = make("bf16", [tokens, c.hidden], 0x3f); // 0x3F3F: a finite bf16 (0.75)
    const ids = make("int32", [tokens, c.topK], 0xff); // −1: no slot routed
    const weights = make("fp32", [tokens, c.topK], 0);
    const out = make("bf16", [tokens, c.hidden], 0);
    p.forward({ x, ids, weights, out, tokens, shared: true }, stream);
    if (stream === null) p.device.synchronize();
    else stream.synchronize();
  } finally {
    for (const t of scratch) t.dispose();
  }
}

/** Buffers of one expert MLP over `rows` rows (the routed experts: T·k; the shared expert: T). */
interface MlpBuffers {
  /** fp32 [rows, 2I]. */
  l1: DeviceTensor;
  /** e4m3 [rows, I]. */
  hq: DeviceTensor;
  /** fp32 [I/128, M_pad]. */
  hScales: DeviceTensor;
  /** bf16 [rows, H]. */
  l2: DeviceTensor;
}

function allocMlp(
  device: Device,
  rows: number,
  hidden: number,
  inter: number,
  owned: DeviceTensor[],
): MlpBuffers {
  const alloc = (dtype: "fp32" | "fp8_e4m3" | "bf16", shape: number[]) => {
    const t = DeviceTensor.empty(device, dtype, shape);
    owned.push(t);
    return t;
  };
  return {
    l1: alloc("fp32", [rows, 2 * inter]),
    hq: alloc("fp8_e4m3", [rows, inter]),
    hScales: alloc("fp32", [(inter / QUANT_BLOCK) * aScalesRows(rows)]),
    l2: alloc("bf16", [rows, hidden]),
  };
}

/** Views of an MLP's buffers for `rows` rows, in the shapes the launchers check. */
function mlpViews(b: MlpBuffers, rows: number, hidden: number, inter: number): MlpBuffers {
  return {
    l1: b.l1.view([rows, 2 * inter]),
    hq: b.hq.view([rows, inter]),
    hScales: b.hScales.view([inter / QUANT_BLOCK, aScalesRows(rows)]),
    l2: b.l2.view([rows, hidden]),
  };
}

/** Every view one token count uses (made once per token count, kept for the next forward). */
interface BatchViews {
  tokens: number;
  xq: DeviceTensor;
  xScales: DeviceTensor;
  /** The gathered routed rows: e4m3 [T·k, H] and fp32 [H/128, pad(T·k)]. */
  aq: DeviceTensor;
  aScales: DeviceTensor;
  routed: MlpBuffers;
  /** fp32 [H/128, pad(T)]: x's scales transposed for the shared expert's GEMM. */
  sharedScales: DeviceTensor | null;
  shared: MlpBuffers | null;
}

/** One MLP's weights in the GEMM's layouts: FP8 (routed or shared) or FP4 (routed, expertFormat "fp4"). */
type MlpWeights = { format: "fp8"; pair: DeviceExpertPair } | { format: "fp4"; pair: DeviceFp4ExpertPair };

/** The routed experts' weights of `w`, in the config's expert format. */
export function routedMlpWeights(w: DeviceMoEWeights): MlpWeights {
  if (w.routedFp4 !== null) return { format: "fp4", pair: w.routedFp4 };
  return { format: "fp8", pair: w.routed };
}

/** One expert MLP's launch sequence: which weights, groups and rows, and where its data lives. */
interface MlpRun {
  weights: MlpWeights;
  groups: number;
  /** int32 [groups + 1]: the GEMMs' row ranges, read on the device. */
  offsets: DeviceTensor;
  /** The real row count for SwiGLU (null: all `rows`). */
  rowCount: RowCount | null;
  /** e4m3 [rows, H] and fp32 [H/128, pad(rows)]: the L1 input. */
  a: DeviceTensor;
  aScales: DeviceTensor;
  buffers: MlpBuffers;
  /** Upper bound of the rows: the GEMMs' mTotal and the buffers' layout. */
  rows: number;
}

export class UnfusedPipeline implements MoEPipeline {
  readonly kind = "unfused";
  readonly device: Device;
  readonly weights: DeviceMoEWeights;
  readonly config: MoEConfig;
  readonly maxTokens: number;
  /** The routed experts' GEMM operands (FP8 or FP4). */
  private readonly routedWeights: MlpWeights;
  private readonly owned: DeviceTensor[] = [];
  private readonly xq: DeviceTensor;
  private readonly xScales: DeviceTensor;
  private readonly groupOffsets: DeviceTensor;
  private readonly sharedOffsets: DeviceTensor;
  private readonly rowSource: DeviceTensor;
  private readonly slotRow: DeviceTensor;
  private readonly aq: DeviceTensor;
  private readonly aScales: DeviceTensor;
  private readonly routed: MlpBuffers;
  private readonly sharedScales: DeviceTensor | null;
  private readonly shared: MlpBuffers | null;
  private views: BatchViews | null = null;
  private disposed = false;

  /** Allocates every intermediate buffer for `maxTokens` tokens and loads the pipeline's own kernels. */
  constructor(device: Device, weights: DeviceMoEWeights, maxTokens: number) {
    const c = weights.config;
    if (!Number.isInteger(maxTokens) || maxTokens < 1) {
      throw new RangeError(`maxTokens must be a positive integer, got ${maxTokens}`);
    }
    if (c.numExperts > MOE_MAX_EXPERTS) {
      throw new RangeError(
        `the unfused pipeline supports up to ${MOE_MAX_EXPERTS} experts, got ${c.numExperts}`,
      );
    }
    this.device = device;
    this.weights = weights;
    this.config = c;
    this.maxTokens = maxTokens;
    this.routedWeights = routedMlpWeights(weights);
    loadMoeKernels(device, c.scaleFormat);
    const H = c.hidden;
    const kb = H / QUANT_BLOCK;
    const slots = maxTokens * c.topK;
    const alloc = (dtype: "fp32" | "fp8_e4m3" | "int32", shape: number[]) => {
      const t = DeviceTensor.empty(device, dtype, shape);
      this.owned.push(t);
      return t;
    };
    try {
      this.xq = alloc("fp8_e4m3", [maxTokens, H]);
      this.xScales = alloc("fp32", [maxTokens, kb]);
      this.groupOffsets = alloc("int32", [c.numExperts + 1]);
      this.sharedOffsets = alloc("int32", [2]);
      this.rowSource = alloc("int32", [slots]);
      this.slotRow = alloc("int32", [slots]);
      this.aq = alloc("fp8_e4m3", [slots, H]);
      this.aScales = alloc("fp32", [kb * aScalesRows(slots)]);
      this.routed = allocMlp(device, slots, H, c.intermediate, this.owned);
      const hasShared = weights.shared !== null;
      this.sharedScales = hasShared ? alloc("fp32", [kb * aScalesRows(maxTokens)]) : null;
      this.shared = hasShared ? allocMlp(device, maxTokens, H, sharedIntermediate(c), this.owned) : null;
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  /** Views of the buffers for `tokens` tokens (cached for the last token count). */
  private viewsFor(tokens: number): BatchViews {
    if (this.views?.tokens === tokens) return this.views;
    const c = this.config;
    const H = c.hidden;
    const kb = H / QUANT_BLOCK;
    const slots = tokens * c.topK;
    this.views = {
      tokens,
      xq: this.xq.view([tokens, H]),
      xScales: this.xScales.view([tokens, kb]),
      aq: this.aq.view([slots, H]),
      aScales: this.aScales.view([kb, aScalesRows(slots)]),
      routed: mlpViews(this.routed, slots, H, c.intermediate),
      sharedScales: this.sharedScales?.view([kb, aScalesRows(tokens)]) ?? null,
      shared: this.shared === null ? null : mlpViews(this.shared, tokens, H, sharedIntermediate(c)),
    };
    return this.views;
  }

  /**
   * Queues one layer forward on `stream` (null: the legacy default stream). Checks the operands'
   * dtypes and shapes; does not check the values (ids outside [0, E) count as not routed).
   */
  forward(f: UnfusedForward, stream: Stream | null): void {
    if (this.disposed) throw new Error("UnfusedPipeline used after dispose()");
    const problem = forwardProblem(this.config, this.maxTokens, this.device, f);
    if (problem !== null) throw new RangeError(`UnfusedPipeline.forward: ${problem}`);
    const c = this.config;
    const d = this.device;
    const { tokens } = f;
    const E = c.numExperts;
    const slots = tokens * c.topK;
    const v = this.viewsFor(tokens);

    quantizeOnDevice(d, f.x, { q: v.xq, scales: v.xScales }, c.scaleFormat, stream);
    dispatchLayoutOnDevice(
      d,
      f.ids,
      E,
      {
        groupOffsets: this.groupOffsets,
        rowSource: this.rowSource,
        slotRow: this.slotRow,
        sharedOffsets: this.sharedOffsets,
      },
      stream,
    );
    const routedRows: RowCount = { offsets: this.groupOffsets, index: E };
    gatherRowsOnDevice(
      d,
      {
        xq: v.xq,
        xScales: v.xScales,
        rowSource: this.rowSource,
        topK: c.topK,
        rows: slots,
        rowCount: routedRows,
        aq: v.aq,
        aScales: v.aScales,
      },
      stream,
    );
    this.expertMlp(
      {
        weights: this.routedWeights,
        groups: E,
        offsets: this.groupOffsets,
        rowCount: routedRows,
        a: v.aq,
        aScales: v.aScales,
        buffers: v.routed,
        rows: slots,
      },
      stream,
    );

    let sharedOut: DeviceTensor | null = null;
    const sharedWeights = this.weights.shared;
    if (f.shared && sharedWeights !== null && v.shared !== null && v.sharedScales !== null) {
      // The shared expert reads x's quantized rows in place: only their scales need the GEMM's layout.
      gatherRowsOnDevice(
        d,
        {
          xq: v.xq,
          xScales: v.xScales,
          rowSource: null,
          topK: c.topK,
          rows: tokens,
          rowCount: null,
          aq: null,
          aScales: v.sharedScales,
        },
        stream,
      );
      this.expertMlp(
        {
          weights: { format: "fp8", pair: sharedWeights },
          groups: 1,
          offsets: this.sharedOffsets,
          rowCount: null,
          a: v.xq,
          aScales: v.sharedScales,
          buffers: v.shared,
          rows: tokens,
        },
        stream,
      );
      sharedOut = v.shared.l2;
    }

    combineOnDevice(
      d,
      { l2: v.routed.l2, slotRow: this.slotRow, weights: f.weights, sharedOut, out: f.out },
      stream,
    );
  }

  /**
   * L1 GEMM → SwiGLU + quantization → L2 GEMM over `rows` rows (an upper bound: the groups say which);
   * the GEMMs are FP8 or FP4 as the weights are.
   */
  private expertMlp(run: MlpRun, stream: Stream | null): void {
    const { weights: w, groups, offsets, rowCount, a, aScales, buffers: m, rows } = run;
    const c = this.config;
    const H = c.hidden;
    const I = m.hq.shape[1]!;
    const l1 = { a, aScales, groupOffsets: offsets, out: m.l1, mTotal: rows, n: 2 * I, k: H, groups };
    if (w.format === "fp4") {
      groupedGemmFp4(this.device, { ...l1, b: w.pair.w1, bScales: w.pair.w1Scales }, stream);
    } else {
      groupedGemmFp8(this.device, { ...l1, b: w.pair.w1, bScales: w.pair.w1Scales }, stream);
    }
    swigluQuantizeOnDevice(
      this.device,
      {
        l1: m.l1,
        rows,
        rowCount,
        clamp: c.swigluClamp,
        format: c.scaleFormat,
        hq: m.hq,
        hScales: m.hScales,
      },
      stream,
    );
    const l2 = {
      a: m.hq,
      aScales: m.hScales,
      groupOffsets: offsets,
      out: m.l2,
      mTotal: rows,
      n: H,
      k: I,
      groups,
    };
    if (w.format === "fp4") {
      groupedGemmFp4(this.device, { ...l2, b: w.pair.w2, bScales: w.pair.w2Scales }, stream);
    } else {
      groupedGemmFp8(this.device, { ...l2, b: w.pair.w2, bScales: w.pair.w2Scales }, stream);
    }
  }

  warmup(tokens: number, stream: Stream | null = null): void {
    warmupPipeline(this, tokens, stream);
  }

  /** Nothing of its own to report (the grouped GEMM's watchdog is read by takeGroupedGemmStatus). */
  checkStatus(): void {
    this.device.synchronize();
  }

  /**
   * For tests: sets every byte of every intermediate buffer to `byte` (0xFF: NaN in every float and
   * FP8 format), so that a step reading something no earlier step of the forward wrote shows up.
   */
  fillScratch(byte: number, stream: Stream | null = null): void {
    if (this.disposed) throw new Error("UnfusedPipeline used after dispose()");
    for (const t of this.owned) t.fill(byte, stream);
  }

  /** Frees every buffer. Idempotent; the weights stay (their owner disposes them). */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    this.views = null;
    for (const t of this.owned) t.dispose();
  }
}
