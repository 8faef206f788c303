/**
 * A layer's weights on the GPU, in the layouts the kernels read (docs/weights.md, all row-major):
 * W1 fp8 [E, 2·I, H] (gate rows, then up rows) with scales fp32 [E, 2I/128, H/128], W2 fp8 [E, H, I]
 * with scales [E, H/128, I/128], the fused shared expert's pair with a leading dimension of 1 (I → SI),
 * the gate weight bf16 [E, H] and its correction bias fp32 [E].
 *
 * `generate` makes the seeded weights on the device (src/kernels/weightgen), bit-identical to
 * `GeneratedWeights` on the CPU, so flash- and pro-sized layers (6–25 GB of FP8) need no host
 * generation or upload; `upload` copies any CPU source (e.g. a safetensors file) expert by expert.
 */
import {
  describeValue,
  expertFormatOf,
  type MoEConfig,
  QUANT_BLOCK,
  sharedIntermediate,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { Device, DeviceTensor, type Stream } from "../cuda/index.js";
import { checkSeed } from "../numerics/counter-rng.js";
import { expertMatrixSpecs, sharedMatrixSpecs } from "../numerics/generator.js";
import {
  type BlockQuantized,
  type MoEWeightSource,
  requireFp8Expert,
  weightSourceProblem,
} from "../weights/types.js";
import {
  generateActivationsInto,
  generateGateBiasOnDevice,
  generateGateWeightOnDevice,
  generateMatrixOnDevice,
} from "./weightgen/weightgen.js";

/** One MLP's weights for `experts` experts: W1 [experts, 2I, H], W2 [experts, H, I] and their scales. */
export interface DeviceExpertPair {
  w1: DeviceTensor<"fp8_e4m3">;
  w1Scales: DeviceTensor<"fp32">;
  w2: DeviceTensor<"fp8_e4m3">;
  w2Scales: DeviceTensor<"fp32">;
}

const GIB = 2 ** 30;
/** Kept free beyond the layer for the CUDA context, kernels' workspaces and other tensors. */
const MEMORY_RESERVE_BYTES = GIB;

/** Device bytes of one MLP pair (codes and scales) for `experts` experts. */
function pairBytes(experts: number, hidden: number, inter: number): number {
  const codes = 3 * inter * hidden;
  return experts * (codes + (4 * codes) / QUANT_BLOCK ** 2);
}

function allocPair(device: Device, experts: number, hidden: number, inter: number): DeviceExpertPair {
  const b = QUANT_BLOCK;
  const made: DeviceTensor[] = [];
  const keep = <T extends DeviceTensor>(t: T): T => {
    made.push(t);
    return t;
  };
  try {
    return {
      w1: keep(DeviceTensor.empty(device, "fp8_e4m3", [experts, 2 * inter, hidden])),
      w1Scales: keep(DeviceTensor.empty(device, "fp32", [experts, (2 * inter) / b, hidden / b])),
      w2: keep(DeviceTensor.empty(device, "fp8_e4m3", [experts, hidden, inter])),
      w2Scales: keep(DeviceTensor.empty(device, "fp32", [experts, hidden / b, inter / b])),
    };
  } catch (e) {
    for (const t of made) t.dispose();
    throw e;
  }
}

function disposePair(p: DeviceExpertPair | null): void {
  if (p === null) return;
  for (const t of [p.w1, p.w1Scales, p.w2, p.w2Scales]) t.dispose();
}

function checkMatrix(what: string, m: BlockQuantized, rows: number, cols: number): void {
  if (m.rows !== rows || m.cols !== cols) {
    throw new Error(`${what} is [${m.rows}, ${m.cols}], expected [${rows}, ${cols}]`);
  }
  if (m.q.length !== rows * cols || m.scales.length !== (rows / QUANT_BLOCK) * (cols / QUANT_BLOCK)) {
    throw new Error(
      `${what}: ${m.q.length} codes and ${m.scales.length} scales do not match [${rows}, ${cols}]`,
    );
  }
}

function gib(bytes: number): string {
  return `${(bytes / GIB).toFixed(2)} GiB`;
}

/**
 * Throws unless the device can hold `need` more bytes. The CUDA layer has no cuMemGetInfo, so "free" is
 * the device's total less what megamoe allocated on it and a reserve for the context and workspaces.
 */
function checkDeviceMemory(device: Device, need: number, what: string): void {
  const allocated = device.allocatedBytes;
  const available = device.totalMemoryBytes - allocated - MEMORY_RESERVE_BYTES;
  if (need > available) {
    throw new Error(
      `${what} needs ${gib(need)} on the device, but ${device.name} has ${gib(device.totalMemoryBytes)} ` +
        `of which megamoe already holds ${gib(allocated)} (and keeps ${gib(MEMORY_RESERVE_BYTES)} in reserve): ` +
        `about ${gib(Math.max(0, available))} free`,
    );
  }
}

export class DeviceMoEWeights {
  readonly config: ValidatedConfig;
  /** Routed experts: W1 [E, 2I, H], W2 [E, H, I] and scales. */
  readonly routed: DeviceExpertPair;
  /** The fused shared experts, [1, 2SI, H] and [1, H, SI] (one group for the grouped GEMM); null without. */
  readonly shared: DeviceExpertPair | null;
  /** bf16 [E, H]. */
  readonly gateWeight: DeviceTensor<"bf16">;
  /** fp32 [E], or null when the config has no correction bias. */
  readonly gateBias: DeviceTensor<"fp32"> | null;
  private disposed = false;

  private constructor(
    config: ValidatedConfig,
    routed: DeviceExpertPair,
    shared: DeviceExpertPair | null,
    gateWeight: DeviceTensor<"bf16">,
    gateBias: DeviceTensor<"fp32"> | null,
  ) {
    this.config = config;
    this.routed = routed;
    this.shared = shared;
    this.gateWeight = gateWeight;
    this.gateBias = gateBias;
  }

  /** Device bytes a layer of this config needs: expert weights and scales, gate weight and bias. */
  static bytesFor(config: MoEConfig): number {
    const { numExperts: e, hidden: h } = config;
    const shared = config.numShared > 0 ? pairBytes(1, h, sharedIntermediate(config)) : 0;
    const gate = 2 * e * h + (config.router.correctionBias ? 4 * e : 0);
    return pairBytes(e, h, config.intermediate) + shared + gate;
  }

  /** Allocates every tensor of the layer (uninitialized), after checking that the device can hold it. */
  private static allocate(device: Device, c: ValidatedConfig, what: string): DeviceMoEWeights {
    if (!(device instanceof Device))
      throw new TypeError(`device must be a Device, got ${describeValue(device)}`);
    // The kernels take FP8 experts only so far; FP4 has its CPU reference (numerics/fp4.ts) alone.
    if (expertFormatOf(c) !== "fp8") {
      throw new Error(
        `${what}: expertFormat "${expertFormatOf(c)}" is not supported on the GPU yet (fp8 only)`,
      );
    }
    checkDeviceMemory(device, DeviceMoEWeights.bytesFor(c), what);
    const H = c.hidden;
    let routed: DeviceExpertPair | null = null;
    let shared: DeviceExpertPair | null = null;
    let gateWeight: DeviceTensor<"bf16"> | null = null;
    try {
      routed = allocPair(device, c.numExperts, H, c.intermediate);
      if (c.numShared > 0) shared = allocPair(device, 1, H, sharedIntermediate(c));
      gateWeight = DeviceTensor.empty(device, "bf16", [c.numExperts, H]);
      const gateBias = c.router.correctionBias ? DeviceTensor.empty(device, "fp32", [c.numExperts]) : null;
      return new DeviceMoEWeights(c, routed, shared, gateWeight, gateBias);
    } catch (e) {
      disposePair(routed);
      disposePair(shared);
      gateWeight?.dispose();
      throw e;
    }
  }

  /**
   * The weights `new GeneratedWeights(config, seed)` holds, made on the device bit for bit: every
   * routed expert, the shared expert, the gate weight and bias. Returns when they are complete (about
   * 10 ms of GPU time for a flash layer on an H200, plus the first call's kernel compile). firstExpert:
   * routed experts and gate rows numbered from there (an expert-parallel rank's share, RankWeights).
   */
  static generate(
    device: Device,
    config: MoEConfig,
    seed: number,
    stream: Stream | null = null,
    firstExpert = 0,
  ): DeviceMoEWeights {
    checkSeed(seed);
    const c = validateConfig(config); // returns at once for a validated config
    const w = DeviceMoEWeights.allocate(device, c, `the generated ${c.name} layer`);
    try {
      w.regenerate(seed, stream, firstExpert);
      (stream ?? device.nullStream).synchronize();
    } catch (e) {
      w.dispose();
      throw e;
    }
    return w;
  }

  /**
   * Overwrites every tensor with the weights of `seed`, queued on `stream` (null: the legacy default
   * stream) without waiting: work on another stream must wait for `stream` before reading them.
   */
  regenerate(seed: number, stream: Stream | null = null, firstExpert = 0): void {
    checkSeed(seed);
    if (!Number.isInteger(firstExpert) || firstExpert < 0) {
      throw new RangeError(`firstExpert must be a non-negative integer, got ${firstExpert}`);
    }
    const device = this.gateWeight.device;
    const c = this.config;
    const H = c.hidden;
    const I = c.intermediate;
    const r = this.routed;
    const w1Size = 2 * I * H;
    const w1Blocks = w1Size / QUANT_BLOCK ** 2;
    for (let e = 0; e < c.numExperts; e++) {
      const { w1, w2 } = expertMatrixSpecs(c, firstExpert + e);
      generateMatrixOnDevice(device, seed, w1, r.w1, e * w1Size, r.w1Scales, e * w1Blocks, stream);
      generateMatrixOnDevice(
        device,
        seed,
        w2,
        r.w2,
        (e * w1Size) / 2,
        r.w2Scales,
        (e * w1Blocks) / 2,
        stream,
      );
    }
    const s = this.shared;
    if (s !== null) {
      const { w1, w2 } = sharedMatrixSpecs(c);
      generateMatrixOnDevice(device, seed, w1, s.w1, 0, s.w1Scales, 0, stream);
      generateMatrixOnDevice(device, seed, w2, s.w2, 0, s.w2Scales, 0, stream);
    }
    generateGateWeightOnDevice(device, seed, c.numExperts, H, this.gateWeight, stream, firstExpert);
    if (this.gateBias !== null) {
      generateGateBiasOnDevice(device, seed, c.numExperts, this.gateBias, stream, firstExpert);
    }
  }

  /**
   * Uploads every expert from a CPU source (generated, or read from safetensors), one expert at a
   * time, so host memory holds one expert's weights at once. Returns when the copies are complete.
   */
  static upload(device: Device, source: MoEWeightSource, stream: Stream | null = null): DeviceMoEWeights {
    const problem = weightSourceProblem(source);
    if (problem !== null) throw new TypeError(`DeviceMoEWeights.upload: ${problem}`);
    const c = validateConfig(source.config); // returns at once for a validated config
    const w = DeviceMoEWeights.allocate(device, c, `the ${c.name} layer`);
    try {
      w.uploadFrom(source, stream);
    } catch (e) {
      w.dispose();
      throw e;
    }
    return w;
  }

  private uploadFrom(source: MoEWeightSource, stream: Stream | null): void {
    const c = this.config;
    const device = this.gateWeight.device;
    const H = c.hidden;
    const I = c.intermediate;
    const r = this.routed;
    const w1Bytes = 2 * I * H;
    const w1ScaleBytes = (4 * w1Bytes) / QUANT_BLOCK ** 2;
    for (let e = 0; e < c.numExperts; e++) {
      const x = requireFp8Expert(source.expert(e), `device weights, expert ${e}`);
      checkMatrix(`expert ${e} W1`, x.w1, 2 * I, H);
      checkMatrix(`expert ${e} W2`, x.w2, H, I);
      device.copyHtoD(r.w1.ptr + BigInt(e * w1Bytes), x.w1.q, w1Bytes, stream);
      device.copyHtoD(r.w1Scales.ptr + BigInt(e * w1ScaleBytes), x.w1.scales, w1ScaleBytes, stream);
      device.copyHtoD(r.w2.ptr + BigInt((e * w1Bytes) / 2), x.w2.q, w1Bytes / 2, stream);
      device.copyHtoD(r.w2Scales.ptr + BigInt((e * w1ScaleBytes) / 2), x.w2.scales, w1ScaleBytes / 2, stream);
      // The copies read host memory the source may reuse or drop for the next expert.
      stream?.synchronize();
    }
    const s = this.shared;
    if (s !== null) {
      const sw = source.shared();
      if (sw === null) throw new Error("the config has a shared expert but the weight source has none");
      const SI = sharedIntermediate(c);
      checkMatrix("shared W1", sw.w1, 2 * SI, H);
      checkMatrix("shared W2", sw.w2, H, SI);
      s.w1.copyFromHost(sw.w1.q, stream);
      s.w1Scales.copyFromHost(sw.w1.scales, stream);
      s.w2.copyFromHost(sw.w2.q, stream);
      s.w2Scales.copyFromHost(sw.w2.scales, stream);
    }
    const gate = source.gate();
    this.gateWeight.copyFromHost(gate.weight, stream);
    if (this.gateBias !== null) {
      if (gate.bias === null)
        throw new Error("the config has a gate correction bias but the weight source has none");
      this.gateBias.copyFromHost(gate.bias, stream);
    }
    stream?.synchronize();
  }

  /** Frees every tensor. Idempotent. */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    disposePair(this.routed);
    disposePair(this.shared);
    this.gateWeight.dispose();
    this.gateBias?.dispose();
  }
}

/**
 * `generateActivations(seed, tokens, hidden)` made on the device: bf16 [tokens, hidden], queued on
 * `stream` (null: the legacy default stream). Written into `out` when given (bf16 with exactly
 * tokens·hidden elements, returned); otherwise into a new tensor the caller disposes.
 */
export function generateActivationsOnDevice(
  device: Device,
  seed: number,
  tokens: number,
  hidden: number,
  out?: DeviceTensor<"bf16">,
  stream: Stream | null = null,
): DeviceTensor<"bf16"> {
  if (out !== undefined && out.numel !== tokens * hidden) {
    throw new RangeError(
      `activations: out holds ${out.numel} elements, not tokens·hidden = ${tokens * hidden}`,
    );
  }
  const x = out ?? DeviceTensor.empty(device, "bf16", [tokens, hidden]);
  try {
    generateActivationsInto(device, seed, tokens, hidden, x, stream);
  } catch (e) {
    if (out === undefined) x.dispose();
    throw e;
  }
  return x;
}
