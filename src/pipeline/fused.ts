/**
 * The MoE layer on the GPU as two launches: quantize x (bf16 → FP8 rows + per-128 scales), then the
 * fused kernel (megamoe.cu) for everything after the gate. Same operands and numerics as the unfused
 * pipeline, bit for bit; capturable in a CUDA graph once `warmup` has loaded both kernels.
 *
 * The input buffer. The pipeline owns the FP8 rows and scales the kernel reads, and a routing buffer.
 * A serving step can have them written by the kernels before the layer (the boundary RMSNorm emitting
 * FP8, the gate writing ids and weights: `prepareInput`), and then the forward skips the quantization
 * pass: one launch per layer instead of two. The buffer's tag (input-tag.ts) decides; every case it
 * does not vouch for takes the quantization pass.
 */
import type { MoEConfig } from "../config/config.js";
import { type Device, DeviceTensor, type Stream } from "../cuda/index.js";
import type { DeviceMoEWeights } from "../kernels/device-weights.js";
import type { FusedOwnBuffer, FusedWeightBuffer } from "../kernels/megamoe/abi.js";
import { FusedMoEKernel, fusedLayerProblem } from "../kernels/megamoe/megamoe.js";
import { quantizeOnDevice } from "../kernels/quant/quant.js";
import { type InputTicket, MoEInputTag } from "./input-tag.js";
import { forwardProblem, type MoEPipeline, type UnfusedForward, warmupPipeline } from "./unfused.js";

/** Views of the pipeline's input buffer for one batch, for the kernels that write it, and its ticket. */
export interface PreparedInput {
  ticket: InputTicket;
  /** e4m3 [rows, H] and fp32 [rows, H/128]: for the boundary kernel's FP8 output. */
  xq: DeviceTensor;
  xScales: DeviceTensor;
  /** int32 [rows, k] and fp32 [rows, k]: for the gate's output; pass them as the forward's routing. */
  ids: DeviceTensor;
  weights: DeviceTensor;
}

/**
 * Whether a forward may skip the quantization pass: the tag vouches for `ticket` at exactly `tokens`
 * rows, and the forward's routing is the buffer's own (routing given by the caller may differ from
 * what the gate wrote). Pure, for the tests.
 */
export function canSkipQuantization(
  tag: MoEInputTag,
  ticket: InputTicket | undefined,
  tokens: number,
  routing: { ids: { ptr: bigint }; weights: { ptr: bigint } },
  buffer: { ids: { ptr: bigint }; weights: { ptr: bigint } },
): boolean {
  return (
    ticket !== undefined &&
    tag.ready(ticket, tokens) &&
    routing.ids.ptr === buffer.ids.ptr &&
    routing.weights.ptr === buffer.weights.ptr
  );
}

export class FusedPipeline implements MoEPipeline {
  readonly kind = "fused";
  readonly device: Device;
  readonly config: MoEConfig;
  readonly maxTokens: number;
  readonly kernel: FusedMoEKernel;
  /** Which batch the input buffer holds (see the module doc). */
  readonly tag: MoEInputTag;
  private readonly xq: DeviceTensor;
  private readonly xScales: DeviceTensor;
  private readonly ids: DeviceTensor;
  private readonly routingWeights: DeviceTensor;
  /** Views of the FP8 rows and scales for the last token count (kept: a forward needs no allocation). */
  private rows: { tokens: number; xq: DeviceTensor; xScales: DeviceTensor } | null = null;
  private disposed = false;

  constructor(device: Device, weights: DeviceMoEWeights, maxTokens: number) {
    const problem = fusedLayerProblem(weights.config);
    if (problem !== null) throw new Error(`FusedPipeline: ${problem}`);
    this.device = device;
    this.config = weights.config;
    this.maxTokens = maxTokens;
    this.kernel = new FusedMoEKernel(device, weights, maxTokens);
    this.tag = new MoEInputTag(maxTokens);
    try {
      this.xq = DeviceTensor.empty(device, "fp8_e4m3", [maxTokens, this.config.hidden]);
      this.xScales = DeviceTensor.empty(device, "fp32", [maxTokens, this.config.hidden / 128]);
      this.ids = DeviceTensor.empty(device, "int32", [maxTokens, this.config.topK]);
      this.routingWeights = DeviceTensor.empty(device, "fp32", [maxTokens, this.config.topK]);
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  /**
   * Starts a batch of `rows` rows in the input buffer: views for the kernels that will write it and
   * the ticket to mark (`tag.markRows(ticket)` once the FP8 rows are queued, `tag.markRouting(ticket)`
   * once the routing is) and to pass to `forward`. Throws RangeError above the buffer's capacity.
   */
  prepareInput(rows: number): PreparedInput {
    const ticket = this.tag.begin(rows);
    const k = this.config.topK;
    return {
      ticket,
      ...this.rowViews(rows),
      ids: this.ids.view([rows, k]),
      weights: this.routingWeights.view([rows, k]),
    };
  }

  /**
   * Queues one layer forward on `stream`; checks the operands' dtypes and shapes, not their values.
   * With a `prepared` ticket the tag vouches for, the FP8 rows already in the buffer are used and x is
   * not read; otherwise x is quantized into the buffer (which kills every ticket). Returns whether the
   * quantization pass ran.
   */
  forward(f: UnfusedForward, stream: Stream | null, prepared?: InputTicket): boolean {
    if (this.disposed) throw new Error("FusedPipeline used after dispose()");
    const problem = forwardProblem(this.config, this.maxTokens, this.device, f);
    if (problem !== null) throw new RangeError(`FusedPipeline.forward: ${problem}`);
    const { tokens } = f;
    const { xq, xScales } = this.rowViews(tokens);
    const quantize = !canSkipQuantization(this.tag, prepared, tokens, f, {
      ids: this.ids,
      weights: this.routingWeights,
    });
    if (quantize) {
      this.tag.invalidate();
      quantizeOnDevice(this.device, f.x, { q: xq, scales: xScales }, this.config.scaleFormat, stream);
    }
    this.kernel.launch(
      { xq, xScales, ids: f.ids, weights: f.weights, out: f.out, tokens, shared: f.shared },
      stream,
    );
    return quantize;
  }

  /**
   * The fused kernel alone on the rows the last `forward` of `tokens` tokens quantized (benchmarks: the
   * kernel's own time, without the quantization pass).
   */
  launchKernelOnly(
    ids: DeviceTensor,
    weights: DeviceTensor,
    out: DeviceTensor,
    tokens: number,
    shared: boolean,
    stream: Stream | null,
  ): void {
    this.kernel.launch({ ...this.rowViews(tokens), ids, weights, out, tokens, shared }, stream);
  }

  /**
   * The device address of a buffer an export's manifest names (src/export/): the FP8 rows "xq" and
   * "x_scales", and the fused kernel's buffers and weights.
   */
  bufferAddress(name: "xq" | "x_scales" | FusedOwnBuffer | FusedWeightBuffer): bigint {
    if (name === "xq") return this.xq.ptr;
    if (name === "x_scales") return this.xScales.ptr;
    return this.kernel.bufferAddress(name);
  }

  private rowViews(tokens: number): { xq: DeviceTensor; xScales: DeviceTensor } {
    if (this.rows?.tokens !== tokens) {
      const H = this.config.hidden;
      this.rows = { tokens, xq: this.xq.view([tokens, H]), xScales: this.xScales.view([tokens, H / 128]) };
    }
    return this.rows;
  }

  warmup(tokens: number, stream: Stream | null = null): void {
    warmupPipeline(this, tokens, stream);
    this.kernel.checkStatus();
  }

  checkStatus(): void {
    this.kernel.checkStatus();
  }

  fillScratch(byte: number, stream: Stream | null = null): void {
    this.tag.invalidate();
    this.xq.fill(byte, stream);
    this.xScales.fill(byte, stream);
    this.kernel.fillScratch(byte, stream);
  }

  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    this.kernel.dispose();
    this.xq?.dispose();
    this.xScales?.dispose();
    this.ids?.dispose();
    this.routingWeights?.dispose();
  }
}
