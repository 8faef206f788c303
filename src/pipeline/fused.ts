/**
 * The MoE layer on the GPU as two launches: quantize x (bf16 → FP8 rows + per-128 scales), then the
 * fused kernel (megamoe.cu) for everything after the gate. Same operands and numerics as the unfused
 * pipeline, bit for bit; capturable in a CUDA graph once `warmup` has loaded both kernels.
 */
import type { MoEConfig } from "../config/config.js";
import { type Device, DeviceTensor, type Stream } from "../cuda/index.js";
import { FusedMoEKernel } from "../kernels/megamoe/megamoe.js";
import { quantizeOnDevice } from "../kernels/quant/quant.js";
import type { DeviceMoEWeights } from "../weights/device.js";
import { forwardProblem, type MoEPipeline, type UnfusedForward, warmupPipeline } from "./unfused.js";

export class FusedPipeline implements MoEPipeline {
  readonly kind = "fused";
  readonly device: Device;
  readonly config: MoEConfig;
  readonly maxTokens: number;
  readonly kernel: FusedMoEKernel;
  private readonly xq: DeviceTensor;
  private readonly xScales: DeviceTensor;
  private disposed = false;

  constructor(device: Device, weights: DeviceMoEWeights, maxTokens: number) {
    this.device = device;
    this.config = weights.config;
    this.maxTokens = maxTokens;
    this.kernel = new FusedMoEKernel(device, weights, maxTokens);
    try {
      this.xq = DeviceTensor.empty(device, "fp8_e4m3", [maxTokens, this.config.hidden]);
      this.xScales = DeviceTensor.empty(device, "fp32", [maxTokens, this.config.hidden / 128]);
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  /** Queues one layer forward on `stream`; checks the operands' dtypes and shapes, not their values. */
  forward(f: UnfusedForward, stream: Stream | null): void {
    if (this.disposed) throw new Error("FusedPipeline used after dispose()");
    const problem = forwardProblem(this.config, this.maxTokens, this.device, f);
    if (problem !== null) throw new RangeError(`FusedPipeline.forward: ${problem}`);
    const { tokens } = f;
    const H = this.config.hidden;
    const xq = this.xq.view([tokens, H]);
    const xScales = this.xScales.view([tokens, H / 128]);
    quantizeOnDevice(this.device, f.x, { q: xq, scales: xScales }, this.config.scaleFormat, stream);
    this.kernel.launch(
      { xq, xScales, ids: f.ids, weights: f.weights, out: f.out, tokens, shared: f.shared },
      stream,
    );
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
    const H = this.config.hidden;
    const xq = this.xq.view([tokens, H]);
    const xScales = this.xScales.view([tokens, H / 128]);
    this.kernel.launch({ xq, xScales, ids, weights, out, tokens, shared }, stream);
  }

  warmup(tokens: number, stream: Stream | null = null): void {
    warmupPipeline(this, tokens, stream);
    this.kernel.checkStatus();
  }

  checkStatus(): void {
    this.kernel.checkStatus();
  }

  fillScratch(byte: number, stream: Stream | null = null): void {
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
  }
}
