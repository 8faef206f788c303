/**
 * A layer's weights on the GPU, in the layouts the kernels read (docs/numerics.md):
 * W1 fp8 [E, 2·IH, H] (gate rows, then up rows) with scales [E, 2IH/128, H/128], W2 fp8 [E, H, IH]
 * with scales [E, H/128, IH/128], and the shared expert's pair.
 */
import { type MoEConfig, QUANT_BLOCK, sharedIntermediate } from "../config/config.js";
import { type Device, DeviceTensor, type Stream } from "../cuda/index.js";
import type { BlockQuantized, MoEWeightSource } from "./types.js";

export interface DeviceExpertPair {
  w1: DeviceTensor<"fp8_e4m3">;
  w1Scales: DeviceTensor<"fp32">;
  w2: DeviceTensor<"fp8_e4m3">;
  w2Scales: DeviceTensor<"fp32">;
}

function allocPair(device: Device, experts: number, hidden: number, inter: number): DeviceExpertPair {
  const b = QUANT_BLOCK;
  return {
    w1: DeviceTensor.empty(device, "fp8_e4m3", [experts, 2 * inter, hidden]),
    w1Scales: DeviceTensor.empty(device, "fp32", [experts, (2 * inter) / b, hidden / b]),
    w2: DeviceTensor.empty(device, "fp8_e4m3", [experts, hidden, inter]),
    w2Scales: DeviceTensor.empty(device, "fp32", [experts, hidden / b, inter / b]),
  };
}

function disposePair(p: DeviceExpertPair | null): void {
  if (p === null) return;
  for (const t of [p.w1, p.w1Scales, p.w2, p.w2Scales]) t.dispose();
}

function checkMatrix(what: string, m: BlockQuantized, rows: number, cols: number): void {
  if (m.rows !== rows || m.cols !== cols) {
    throw new Error(`${what} is [${m.rows}, ${m.cols}], expected [${rows}, ${cols}]`);
  }
}

export class DeviceMoEWeights {
  readonly config: MoEConfig;
  readonly routed: DeviceExpertPair;
  readonly shared: DeviceExpertPair | null;

  private constructor(config: MoEConfig, routed: DeviceExpertPair, shared: DeviceExpertPair | null) {
    this.config = config;
    this.routed = routed;
    this.shared = shared;
  }

  /** Device bytes a layer of this config needs (weights and scales). */
  static bytesFor(config: MoEConfig): number {
    const pair = (experts: number, inter: number) =>
      experts * (3 * inter * config.hidden + (3 * inter * config.hidden * 4) / QUANT_BLOCK ** 2);
    return (
      pair(config.numExperts, config.intermediate) +
      (config.numShared > 0 ? pair(1, sharedIntermediate(config)) : 0)
    );
  }

  /**
   * Uploads every expert from a CPU source (generated, or read from safetensors), one expert at a
   * time, so host memory holds one expert's weights at once.
   */
  static upload(device: Device, source: MoEWeightSource, stream: Stream | null = null): DeviceMoEWeights {
    const c = source.config;
    const need = DeviceMoEWeights.bytesFor(c);
    if (need > device.totalMemoryBytes * 0.9) {
      throw new Error(
        `the ${c.name} layer needs ${(need / 2 ** 30).toFixed(1)} GiB of weights; ${device.name} has ${(device.totalMemoryBytes / 2 ** 30).toFixed(1)} GiB`,
      );
    }
    const H = c.hidden;
    const I = c.intermediate;
    const routed = allocPair(device, c.numExperts, H, I);
    let shared: DeviceExpertPair | null = null;
    try {
      const w1Bytes = 2 * I * H;
      const s1 = ((2 * I) / QUANT_BLOCK) * (H / QUANT_BLOCK);
      const s2 = (H / QUANT_BLOCK) * (I / QUANT_BLOCK);
      for (let e = 0; e < c.numExperts; e++) {
        const w = source.expert(e);
        checkMatrix(`expert ${e} W1`, w.w1, 2 * I, H);
        checkMatrix(`expert ${e} W2`, w.w2, H, I);
        device.copyHtoD(routed.w1.ptr + BigInt(e * w1Bytes), w.w1.q, w1Bytes, stream);
        device.copyHtoD(routed.w1Scales.ptr + BigInt(e * s1 * 4), w.w1.scales, s1 * 4, stream);
        device.copyHtoD(routed.w2.ptr + BigInt(e * w1Bytes) / 2n, w.w2.q, w1Bytes / 2, stream);
        device.copyHtoD(routed.w2Scales.ptr + BigInt(e * s2 * 4), w.w2.scales, s2 * 4, stream);
        // The copies above read host memory the source may reuse for the next expert.
        stream?.synchronize();
      }
      const sw = c.numShared > 0 ? source.shared() : null;
      if (c.numShared > 0) {
        if (sw === null) throw new Error("the config has a shared expert but the weight source has none");
        const SI = sharedIntermediate(c);
        checkMatrix("shared W1", sw.w1, 2 * SI, H);
        checkMatrix("shared W2", sw.w2, H, SI);
        shared = allocPair(device, 1, H, SI);
        shared.w1.copyFromHost(sw.w1.q);
        shared.w1Scales.copyFromHost(sw.w1.scales);
        shared.w2.copyFromHost(sw.w2.q);
        shared.w2Scales.copyFromHost(sw.w2.scales);
      }
    } catch (e) {
      disposePair(routed);
      disposePair(shared);
      throw e;
    }
    return new DeviceMoEWeights(c, routed, shared);
  }

  dispose(): void {
    disposePair(this.routed);
    disposePair(this.shared);
  }
}
