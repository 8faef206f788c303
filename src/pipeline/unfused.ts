/**
 * The MoE layer on the GPU as a sequence of launches: quantize → layout → gather → L1 grouped GEMM
 * → SwiGLU + re-quantization → L2 grouped GEMM → shared expert (the same three steps as one group)
 * → combine. Every buffer is sized once for `maxTokens`; `forward` allocates nothing and never waits
 * on the host (the GEMMs are sized by the upper bound T·k rows, and rows that belong to no expert are
 * skipped on the device), so a forward can be captured in a CUDA graph.
 */
import { QUANT_BLOCK, sharedIntermediate } from "../config/config.js";
import {
  compileKernel,
  type Device,
  DeviceTensor,
  type Kernel,
  KernelArgs,
  loadKernel,
  type Stream,
} from "../cuda/index.js";
import { aScalesRows, groupedGemmFp8 } from "../kernels/gemm/grouped_gemm.js";
import { moeUnfusedDefines } from "../kernels/moe/moe_unfused.variants.js";
import { quantizeOnDevice } from "../kernels/quant/quant.js";
import type { DeviceExpertPair, DeviceMoEWeights } from "../weights/device.js";

export interface UnfusedForward {
  /** bf16 [T, H]. */
  x: DeviceTensor;
  /** int32 [T, k], −1 = slot not routed. */
  ids: DeviceTensor;
  /** fp32 [T, k]. */
  weights: DeviceTensor;
  /** bf16 [T, H]. */
  out: DeviceTensor;
  tokens: number;
  shared: boolean;
}

const THREADS = 256;

interface MoeKernels {
  layout: Kernel;
  gather: Kernel;
  transpose: Kernel;
  swiglu: Kernel;
  combine: Kernel;
}

/** Intermediate buffers of one expert MLP, sized for `rows` rows. */
interface MlpBuffers {
  aq: DeviceTensor;
  aScales: DeviceTensor;
  l1: DeviceTensor;
  hq: DeviceTensor;
  hScales: DeviceTensor;
  l2: DeviceTensor;
}

function mlpBuffers(
  device: Device,
  rows: number,
  hidden: number,
  inter: number,
  withInput: boolean,
): MlpBuffers {
  const pad = aScalesRows(rows);
  return {
    aq: DeviceTensor.empty(device, "fp8_e4m3", [withInput ? rows : 1, hidden]),
    aScales: DeviceTensor.empty(device, "fp32", [hidden / QUANT_BLOCK, pad]),
    l1: DeviceTensor.empty(device, "fp32", [rows, 2 * inter]),
    hq: DeviceTensor.empty(device, "fp8_e4m3", [rows, inter]),
    hScales: DeviceTensor.empty(device, "fp32", [inter / QUANT_BLOCK, pad]),
    l2: DeviceTensor.empty(device, "bf16", [rows, hidden]),
  };
}

export class UnfusedPipeline {
  readonly device: Device;
  readonly weights: DeviceMoEWeights;
  readonly maxTokens: number;
  private readonly kernels: MoeKernels;
  private readonly xq: DeviceTensor;
  private readonly xScales: DeviceTensor;
  private readonly groupOffsets: DeviceTensor;
  private readonly sharedOffsets: DeviceTensor;
  private readonly rowSource: DeviceTensor;
  private readonly slotRow: DeviceTensor;
  private readonly routed: MlpBuffers;
  private readonly sharedBuffers: MlpBuffers | null;
  private readonly args = {
    layout: new KernelArgs(6),
    gather: new KernelArgs(11),
    transpose: new KernelArgs(5),
    swiglu: new KernelArgs(9),
    combine: new KernelArgs(8),
  };
  private disposed = false;

  constructor(device: Device, weights: DeviceMoEWeights, maxTokens: number) {
    const c = weights.config;
    if (!Number.isInteger(maxTokens) || maxTokens < 1)
      throw new RangeError(`maxTokens must be ≥ 1, got ${maxTokens}`);
    if (c.numExperts > 1024)
      throw new RangeError(`the unfused layout kernel supports up to 1024 experts, got ${c.numExperts}`);
    this.device = device;
    this.weights = weights;
    this.maxTokens = maxTokens;
    const compiled = compileKernel({
      source: "moe/moe_unfused.cu",
      defines: moeUnfusedDefines(c.scaleFormat === "ue8m0"),
    });
    this.kernels = {
      layout: loadKernel(device, compiled, "moe_layout"),
      gather: loadKernel(device, compiled, "moe_gather"),
      transpose: loadKernel(device, compiled, "moe_transpose_scales"),
      swiglu: loadKernel(device, compiled, "moe_swiglu_quant"),
      combine: loadKernel(device, compiled, "moe_combine"),
    };
    const H = c.hidden;
    const slots = maxTokens * c.topK;
    this.xq = DeviceTensor.empty(device, "fp8_e4m3", [maxTokens, H]);
    this.xScales = DeviceTensor.empty(device, "fp32", [maxTokens, H / QUANT_BLOCK]);
    this.groupOffsets = DeviceTensor.empty(device, "int32", [c.numExperts + 1]);
    this.sharedOffsets = DeviceTensor.empty(device, "int32", [2]);
    this.rowSource = DeviceTensor.empty(device, "int32", [slots]);
    this.slotRow = DeviceTensor.empty(device, "int32", [slots]);
    this.routed = mlpBuffers(device, slots, H, c.intermediate, true);
    this.sharedBuffers =
      c.numShared > 0 ? mlpBuffers(device, maxTokens, H, sharedIntermediate(c), false) : null;
  }

  /** Queues one layer forward on `stream`. Inputs are checked by the caller (MoELayer). */
  forward(f: UnfusedForward, stream: Stream | null): void {
    if (this.disposed) throw new Error("UnfusedPipeline used after dispose()");
    const c = this.weights.config;
    const { tokens } = f;
    if (tokens < 1 || tokens > this.maxTokens) {
      throw new RangeError(`tokens must be in [1, ${this.maxTokens}], got ${tokens}`);
    }
    const H = c.hidden;
    const k = c.topK;
    const slots = tokens * k;
    const xq = this.xq.view([tokens, H]);
    const xScales = this.xScales.view([tokens, H / QUANT_BLOCK]);
    quantizeOnDevice(this.device, f.x, { q: xq, scales: xScales }, c.scaleFormat, stream);

    const a = this.args;
    a.layout.ptr(0, f.ids.ptr).i32(1, slots).i32(2, c.numExperts).ptr(3, this.groupOffsets.ptr);
    a.layout.ptr(4, this.rowSource.ptr).ptr(5, this.slotRow.ptr);
    this.kernels.layout.launch(1, 1024, 0, stream, a.layout);

    const r = this.routed;
    const pad = aScalesRows(slots);
    const aq = r.aq.view([slots, H]);
    const aScales = r.aScales.view([H / QUANT_BLOCK, pad]);
    a.gather.ptr(0, xq.ptr).ptr(1, xScales.ptr).ptr(2, this.rowSource.ptr).ptr(3, this.groupOffsets.ptr);
    a.gather
      .i32(4, c.numExperts)
      .i32(5, k)
      .i32(6, H)
      .i32(7, slots)
      .i32(8, pad)
      .ptr(9, aq.ptr)
      .ptr(10, aScales.ptr);
    this.kernels.gather.launch(
      Math.min(Math.ceil(slots / (THREADS / 32)), 4 * this.device.smCount),
      THREADS,
      0,
      stream,
      a.gather,
    );
    this.expertMlp(this.weights.routed, r, aq, aScales, slots, c.numExperts, this.groupOffsets, true, stream);

    let sharedOut: DeviceTensor | null = null;
    if (f.shared && this.sharedBuffers !== null && this.weights.shared !== null) {
      const s = this.sharedBuffers;
      const sPad = aScalesRows(tokens);
      const sScales = s.aScales.view([H / QUANT_BLOCK, sPad]);
      a.transpose
        .ptr(0, xScales.ptr)
        .i32(1, tokens)
        .i32(2, H / QUANT_BLOCK)
        .i32(3, sPad)
        .ptr(4, sScales.ptr);
      this.kernels.transpose.launch(
        Math.ceil((tokens * (H / QUANT_BLOCK)) / THREADS),
        THREADS,
        0,
        stream,
        a.transpose,
      );
      this.setSharedOffsets(tokens, stream);
      this.expertMlp(this.weights.shared, s, xq, sScales, tokens, 1, this.sharedOffsets, false, stream);
      sharedOut = s.l2.view([tokens, H]);
    }

    a.combine
      .ptr(0, r.l2.ptr)
      .ptr(1, this.slotRow.ptr)
      .ptr(2, f.weights.ptr)
      .ptr(3, sharedOut?.ptr ?? 0n);
    a.combine.i32(4, tokens).i32(5, k).i32(6, H).ptr(7, f.out.ptr);
    this.kernels.combine.launch(Math.ceil((tokens * (H / 8)) / THREADS), THREADS, 0, stream, a.combine);
  }

  /** [0, tokens] as the shared expert's one group, written on the stream (graph-capturable). */
  private readonly sharedOffsetsHost = new Int32Array(2);
  private setSharedOffsets(tokens: number, stream: Stream | null): void {
    if (this.sharedOffsetsHost[1] === tokens) return;
    this.sharedOffsetsHost[1] = tokens;
    this.device.memsetD32(this.sharedOffsets.ptr + 4n, tokens, 1, stream);
    this.device.memsetD32(this.sharedOffsets.ptr, 0, 1, stream);
  }

  /** L1 GEMM → SwiGLU + quantization → L2 GEMM over `rows` rows (an upper bound: the groups say which). */
  private expertMlp(
    w: DeviceExpertPair,
    b: MlpBuffers,
    aq: DeviceTensor,
    aScales: DeviceTensor,
    rows: number,
    groups: number,
    offsets: DeviceTensor,
    rowsOnDevice: boolean,
    stream: Stream | null,
  ): void {
    const c = this.weights.config;
    const H = c.hidden;
    const I = w.w2.shape[2];
    const pad = aScalesRows(rows);
    const l1 = b.l1.view([rows, 2 * I]);
    groupedGemmFp8(
      this.device,
      {
        a: aq,
        aScales,
        b: w.w1,
        bScales: w.w1Scales,
        groupOffsets: offsets,
        out: l1,
        mTotal: rows,
        n: 2 * I,
        k: H,
        groups,
      },
      stream,
    );
    const hq = b.hq.view([rows, I]);
    const hScales = b.hScales.view([I / QUANT_BLOCK, pad]);
    const s = this.args.swiglu;
    // Routed rows: as many as group_offsets[E] says (read on the device); shared: all `rows`.
    s.ptr(0, l1.ptr)
      .ptr(1, rowsOnDevice ? offsets.ptr + BigInt(4 * groups) : 0n)
      .i32(2, rows)
      .i32(3, I)
      .i32(4, pad);
    s.i32(5, c.swigluClamp === null ? 0 : 1)
      .f32(6, c.swigluClamp ?? 0)
      .ptr(7, hq.ptr)
      .ptr(8, hScales.ptr);
    const warps = rows * (I / QUANT_BLOCK);
    this.kernels.swiglu.launch(
      Math.min(Math.ceil(warps / (THREADS / 32)), 8 * this.device.smCount),
      THREADS,
      0,
      stream,
      s,
    );
    const l2 = b.l2.view([rows, H]);
    groupedGemmFp8(
      this.device,
      {
        a: hq,
        aScales: hScales,
        b: w.w2,
        bScales: w.w2Scales,
        groupOffsets: offsets,
        out: l2,
        mTotal: rows,
        n: H,
        k: I,
        groups,
      },
      stream,
    );
  }

  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    const all = [this.xq, this.xScales, this.groupOffsets, this.sharedOffsets, this.rowSource, this.slotRow];
    for (const b of [this.routed, this.sharedBuffers]) if (b !== null) all.push(...Object.values(b));
    for (const t of all) t.dispose();
  }
}
