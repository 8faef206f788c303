/**
 * A layer's weights on the GPU, in the layouts the kernels read (docs/weights.md, all row-major):
 * W1 fp8 [E, 2·I, H] (gate rows, then up rows) with scales fp32 [E, 2I/128, H/128], W2 fp8 [E, H, I]
 * with scales [E, H/128, I/128], the fused shared expert's pair with a leading dimension of 1 (I → SI),
 * the gate weight bf16 [E, H] and its correction bias fp32 [E].
 *
 * With FP4 (MXFP4) routed experts (config.expertFormat "fp4") the routed pair is `routedFp4` instead,
 * in the FP4 grouped GEMM's layout (src/kernels/gemm/fp4_grouped_gemm.ts): W1 uint8 [E, 2I, H/2] packed
 * e2m1 codes in the kernels' device layout (`orderFp4PackedOnDevice` of the stored bytes, element 2j in
 * the low nibble of byte j: K-block-major over all experts' rows, [H/128, E·2I, 64 bytes], each 64-byte
 * block in the device order with its quarters pre-swizzled; docs/numerics.md) with the scales as
 * reference words uint8 [H/128, E·2I·4] (`fp4GemmScaleWords` of each expert's [2I, H/32] UE8M0 bytes:
 * row n's K block b at (b, 4n)), W2 uint8 [E, H, I/2] with [I/128, E·H·4], and each 128 × 128 block's
 * fp32 scale in the FP8 scales' layout (w1BlockScales, w2BlockScales). The shared expert stays FP8. A
 * flash layer is 6.4 GB with FP8 experts and 3.4 GB with FP4 (`bytes`, `DeviceMoEWeights.bytesFor`).
 *
 * `generate` makes the seeded weights on the device (src/kernels/weightgen), bit-identical to
 * `GeneratedWeights` on the CPU, so flash- and pro-sized layers (6–25 GB of FP8) need no host
 * generation or upload; `upload` copies any CPU source (e.g. a safetensors file) expert by expert.
 */
import {
  describeValue,
  type ExpertFormat,
  expertFormatOf,
  type MoEConfig,
  QUANT_BLOCK,
  sharedIntermediate,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { Device, DeviceTensor, type Stream } from "../cuda/index.js";
import { checkSeed } from "../numerics/counter-rng.js";
import { checkMxfp4Scales, countFp4ToFp8Inexact, MXFP4_GROUP } from "../numerics/fp4.js";
import { expertMatrixSpecs, sharedMatrixSpecs } from "../numerics/generator.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  type Fp4Exactness,
  type Fp4ExpertWeights,
  type MoEWeightSource,
  type Mxfp4Matrix,
  type RoutedExpertWeights,
  weightSourceProblem,
} from "../weights/types.js";
import { fp4ReferenceWordsOnDevice, writeFp4LayoutOnDevice } from "./fp4/fp4_convert.js";
import { fp4GemmBlockScales, fp4GemmScaleWords } from "./gemm/fp4_grouped_gemm.js";
import {
  generateActivationsInto,
  generateGateBiasOnDevice,
  generateGateWeightOnDevice,
  generateMatrixOnDevice,
  generateMxfp4OnDevice,
} from "./weightgen/weightgen.js";

/** One MLP's weights for `experts` experts: W1 [experts, 2I, H], W2 [experts, H, I] and their scales. */
export interface DeviceExpertPair {
  w1: DeviceTensor<"fp8_e4m3">;
  w1Scales: DeviceTensor<"fp32">;
  w2: DeviceTensor<"fp8_e4m3">;
  w2Scales: DeviceTensor<"fp32">;
}

/**
 * FP4 routed experts for `experts` experts, in the FP4 grouped GEMM's layout: W1 packed [experts, 2I,
 * H/2] and its reference words [H/128, experts·2I·4], W2 packed [experts, H, I/2] and [I/128,
 * experts·H·4]; and each 128 × 128 block's fp32 scale in the FP8 experts' layout (w1BlockScales [experts,
 * 2I/128, H/128], w2BlockScales [experts, H/128, I/128]), which the fused kernel's tiles promote with.
 */
export interface DeviceFp4ExpertPair {
  w1: DeviceTensor<"uint8">;
  w1Scales: DeviceTensor<"uint8">;
  w2: DeviceTensor<"uint8">;
  w2Scales: DeviceTensor<"uint8">;
  w1BlockScales: DeviceTensor<"fp32">;
  w2BlockScales: DeviceTensor<"fp32">;
}

const GIB = 2 ** 30;
/** Kept free beyond the layer for the CUDA context, kernels' workspaces and other tensors. */
const MEMORY_RESERVE_BYTES = GIB;

/** Device bytes of one MLP pair (codes and scales) for `experts` experts in `format`. */
function pairBytes(experts: number, hidden: number, inter: number, format: ExpertFormat = "fp8"): number {
  const elements = 3 * inter * hidden;
  const blockScales = (4 * elements) / QUANT_BLOCK ** 2;
  if (format === "fp4") return experts * (elements / 2 + elements / MXFP4_GROUP + blockScales);
  return experts * (elements + blockScales);
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

/**
 * Scratch for one expert's packed W1 and W2 in the stored order: `write` puts them into expert e's rows of
 * a pair in the device layout (K-block-major over all experts' rows, `writeFp4LayoutOnDevice`);
 * `dispose` waits for `stream` before freeing it.
 */
function fp4ExpertScratch(device: Device, hidden: number, inter: number, stream: Stream | null) {
  const t = DeviceTensor.empty(device, "uint8", [(3 * inter * hidden) / 2]);
  const w1 = t.view([2 * inter, hidden / 2]);
  const w2 = t.view([hidden, inter / 2], inter * hidden);
  return {
    w1,
    w2,
    write: (pair: DeviceFp4ExpertPair, e: number) => {
      writeFp4LayoutOnDevice(device, pair.w1, e * 2 * inter, w1, stream);
      writeFp4LayoutOnDevice(device, pair.w2, e * hidden, w2, stream);
    },
    dispose: () => {
      (stream ?? device.nullStream).synchronize();
      t.dispose();
    },
  };
}

function allocFp4Pair(device: Device, experts: number, hidden: number, inter: number): DeviceFp4ExpertPair {
  const b = QUANT_BLOCK;
  const made: DeviceTensor[] = [];
  const keep = <T extends DeviceTensor>(t: T): T => {
    made.push(t);
    return t;
  };
  try {
    return {
      w1: keep(DeviceTensor.empty(device, "uint8", [experts, 2 * inter, hidden / 2])),
      w1Scales: keep(DeviceTensor.empty(device, "uint8", [hidden / b, experts * 2 * inter * 4])),
      w2: keep(DeviceTensor.empty(device, "uint8", [experts, hidden, inter / 2])),
      w2Scales: keep(DeviceTensor.empty(device, "uint8", [inter / b, experts * hidden * 4])),
      w1BlockScales: keep(DeviceTensor.empty(device, "fp32", [experts, (2 * inter) / b, hidden / b])),
      w2BlockScales: keep(DeviceTensor.empty(device, "fp32", [experts, hidden / b, inter / b])),
    };
  } catch (e) {
    for (const t of made) t.dispose();
    throw e;
  }
}

function disposePair(p: DeviceExpertPair | DeviceFp4ExpertPair | null): void {
  if (p === null) return;
  for (const t of [p.w1, p.w1Scales, p.w2, p.w2Scales]) t.dispose();
  if ("w1BlockScales" in p) for (const t of [p.w1BlockScales, p.w2BlockScales]) t.dispose();
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

function checkMxfp4Matrix(what: string, m: Mxfp4Matrix, rows: number, cols: number): void {
  if (m.rows !== rows || m.cols !== cols) {
    throw new Error(`${what} is [${m.rows}, ${m.cols}], expected [${rows}, ${cols}]`);
  }
  if (m.packed.length !== (rows * cols) / 2 || m.scales.length !== (rows * cols) / MXFP4_GROUP) {
    throw new Error(
      `${what}: ${m.packed.length} packed bytes and ${m.scales.length} scale bytes do not match [${rows}, ${cols}]`,
    );
  }
  checkMxfp4Scales(what, m);
}

/** The source's expert e in the config's format, or an error saying which format it has. */
function expertIn<F extends ExpertFormat>(
  w: RoutedExpertWeights,
  format: F,
  e: number,
): F extends "fp4" ? Fp4ExpertWeights : ExpertWeights {
  const got: ExpertFormat = w.format === "fp4" ? "fp4" : "fp8";
  if (got !== format) {
    throw new Error(
      `device weights, expert ${e}: the source gave an ${got} expert but the config's expertFormat is "${format}"`,
    );
  }
  return w as F extends "fp4" ? Fp4ExpertWeights : ExpertWeights;
}

/**
 * Copies stacked GEMM scale words: `words` holds `experts` experts' [kBlocks, experts·rows·4] (experts
 * firstExpert.. of the chunk) and goes to strips of `dst` [kBlocks, totalRows·4].
 */
function copyScaleStrips(
  dst: DeviceTensor<"uint8">,
  words: Uint8Array,
  kBlocks: number,
  chunkRows: number,
  firstRow: number,
  totalRows: number,
  stream: Stream | null,
): void {
  const device = dst.device;
  for (let kb = 0; kb < kBlocks; kb++) {
    const strip = words.subarray(kb * chunkRows * 4, (kb + 1) * chunkRows * 4);
    device.copyHtoD(dst.ptr + BigInt((kb * totalRows + firstRow) * 4), strip, strip.length, stream);
  }
}

/**
 * Puts one expert's scale words [kBlocks, rows·4] (fp4GemmScaleWords) into a chunk's staging
 * [kBlocks, experts·rows·4] as its expert `i` of `experts`.
 */
function scatterScaleWords(
  stage: Uint8Array,
  words: Uint8Array,
  i: number,
  experts: number,
  rows: number,
  kBlocks: number,
): void {
  for (let kb = 0; kb < kBlocks; kb++) {
    stage.set(words.subarray(kb * rows * 4, (kb + 1) * rows * 4), (kb * experts + i) * rows * 4);
  }
}

/** Experts whose scale words are staged on the host before one copy per K block (bounds the copies). */
const SCALE_CHUNK_EXPERTS = 32;

function gib(bytes: number): string {
  return `${(bytes / GIB).toFixed(2)} GiB`;
}

/**
 * Throws unless the device can hold `need` more bytes. The CUDA layer has no cuMemGetInfo, so "free" is
 * the device's total less what megamoe allocated on it and a reserve for the context and workspaces.
 */
export function checkDeviceMemory(device: Device, need: number, what: string): void {
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
  /** The routed experts' format: "fp8" (`routed`) or "fp4" (`routedFp4`). */
  readonly expertFormat: ExpertFormat;
  /** FP4 routed experts in the FP4 grouped GEMM's layout, or null with FP8 experts. */
  readonly routedFp4: DeviceFp4ExpertPair | null;
  /** The fused shared experts, [1, 2SI, H] and [1, H, SI] (one group for the grouped GEMM); null without. */
  readonly shared: DeviceExpertPair | null;
  /** bf16 [E, H]. */
  readonly gateWeight: DeviceTensor<"bf16">;
  /** fp32 [E], or null when the config has no correction bias. */
  readonly gateBias: DeviceTensor<"fp32"> | null;
  /** Device bytes the layer's tensors take (DeviceMoEWeights.bytesFor of its config). */
  readonly bytes: number;
  /**
   * FP4 experts uploaded from a source (a checkpoint): of the routed elements, how many the kernels'
   * e4m3 form does not hold exactly (countFp4ToFp8Inexact, docs/numerics.md). Null with FP8 experts and
   * for weights generated on the device (the generator's are exact by construction, docs/weights.md).
   */
  get fp4Exactness(): Fp4Exactness | null {
    return this.exactness;
  }
  private exactness: Fp4Exactness | null = null;
  private readonly routedFp8: DeviceExpertPair | null;
  private disposed = false;

  private constructor(
    config: ValidatedConfig,
    routed: DeviceExpertPair | DeviceFp4ExpertPair,
    shared: DeviceExpertPair | null,
    gateWeight: DeviceTensor<"bf16">,
    gateBias: DeviceTensor<"fp32"> | null,
  ) {
    this.config = config;
    this.expertFormat = expertFormatOf(config);
    this.routedFp8 = this.expertFormat === "fp8" ? (routed as DeviceExpertPair) : null;
    this.routedFp4 = this.expertFormat === "fp4" ? (routed as DeviceFp4ExpertPair) : null;
    this.shared = shared;
    this.gateWeight = gateWeight;
    this.gateBias = gateBias;
    this.bytes = DeviceMoEWeights.bytesFor(config);
  }

  /**
   * FP8 routed experts: W1 [E, 2I, H], W2 [E, H, I] and scales. Throws for a layer with FP4 experts
   * (read `routedFp4`): the kernels that read this take FP8 experts only.
   */
  get routed(): DeviceExpertPair {
    if (this.routedFp8 === null) {
      throw new Error(
        `layer ${this.config.name} has FP4 (MXFP4) routed experts: they need the FP4 kernels (routedFp4); this GPU path takes FP8 experts only`,
      );
    }
    return this.routedFp8;
  }

  /** Device bytes a layer of this config needs: expert weights and scales, gate weight and bias. */
  static bytesFor(config: MoEConfig): number {
    const { numExperts: e, hidden: h } = config;
    const shared = config.numShared > 0 ? pairBytes(1, h, sharedIntermediate(config)) : 0;
    const gate = 2 * e * h + (config.router.correctionBias ? 4 * e : 0);
    return pairBytes(e, h, config.intermediate, expertFormatOf(config)) + shared + gate;
  }

  /** Allocates every tensor of the layer (uninitialized), after checking that the device can hold it. */
  private static allocate(device: Device, c: ValidatedConfig, what: string): DeviceMoEWeights {
    if (!(device instanceof Device))
      throw new TypeError(`device must be a Device, got ${describeValue(device)}`);
    checkDeviceMemory(device, DeviceMoEWeights.bytesFor(c), what);
    const H = c.hidden;
    let routed: DeviceExpertPair | DeviceFp4ExpertPair | null = null;
    let shared: DeviceExpertPair | null = null;
    let gateWeight: DeviceTensor<"bf16"> | null = null;
    try {
      routed =
        expertFormatOf(c) === "fp4"
          ? allocFp4Pair(device, c.numExperts, H, c.intermediate)
          : allocPair(device, c.numExperts, H, c.intermediate);
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
   * routed expert (FP8, or MXFP4 with expertFormat "fp4"), the shared expert, the gate weight and bias.
   * Returns when they are complete (about 10 ms of GPU time for a flash layer on an H200, plus the
   * first call's kernel compile). firstExpert: routed experts and gate rows numbered from there (an
   * expert-parallel rank's share, RankWeights).
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
   * stream) without waiting (but for FP4 experts' layout step, which waits for the routed experts):
   * work on another stream must wait for `stream` before reading them.
   */
  regenerate(seed: number, stream: Stream | null = null, firstExpert = 0): void {
    checkSeed(seed);
    this.exactness = null;
    if (!Number.isInteger(firstExpert) || firstExpert < 0) {
      throw new RangeError(`firstExpert must be a non-negative integer, got ${firstExpert}`);
    }
    const device = this.gateWeight.device;
    const c = this.config;
    const H = c.hidden;
    const I = c.intermediate;
    const E = c.numExperts;
    const w1Size = 2 * I * H;
    const w1Blocks = w1Size / QUANT_BLOCK ** 2;
    const fp4 = this.routedFp4;
    const scratch = fp4 === null ? null : fp4ExpertScratch(device, H, I, stream);
    try {
      for (let e = 0; e < E; e++) {
        const { w1, w2 } = expertMatrixSpecs(c, firstExpert + e);
        if (fp4 !== null && scratch !== null) {
          // An expert's rows are e·N.. of the stacked E·N, for the scales and the packed codes alike; the
          // codes go through the scratch (stream order keeps each expert's writes after the last's reads).
          const l1 = { kind: "gemm", totalRows: E * 2 * I, firstRow: e * 2 * I } as const;
          const l2 = { kind: "gemm", totalRows: E * H, firstRow: e * H } as const;
          generateMxfp4OnDevice(device, seed, w1, scratch.w1, 0, fp4.w1Scales, l1, stream);
          generateMxfp4OnDevice(device, seed, w2, scratch.w2, 0, fp4.w2Scales, l2, stream);
          scratch.write(fp4, e);
          continue;
        }
        const r = this.routed;
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
    } finally {
      scratch?.dispose();
    }
    if (fp4 !== null) {
      // The generator writes UE8M0 bytes; the kernels read reference words and block scales (per
      // matrix's 128-row blocks).
      fp4ReferenceWordsOnDevice(device, fp4.w1Scales, 0, E * 2 * I, 2 * I, stream, fp4.w1BlockScales);
      fp4ReferenceWordsOnDevice(device, fp4.w2Scales, 0, E * H, H, stream, fp4.w2BlockScales);
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
   * time, so host memory holds one expert's weights at once (with FP4 experts, also up to 32 experts'
   * scale bytes, staged into the GEMM's layout). Returns when the copies are complete.
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
    if (this.routedFp4 !== null) {
      this.uploadFp4Experts(source, stream);
    } else {
      const r = this.routed;
      const w1Bytes = 2 * I * H;
      const w1ScaleBytes = (4 * w1Bytes) / QUANT_BLOCK ** 2;
      for (let e = 0; e < c.numExperts; e++) {
        const x = expertIn(source.expert(e), "fp8", e);
        checkMatrix(`expert ${e} W1`, x.w1, 2 * I, H);
        checkMatrix(`expert ${e} W2`, x.w2, H, I);
        device.copyHtoD(r.w1.ptr + BigInt(e * w1Bytes), x.w1.q, w1Bytes, stream);
        device.copyHtoD(r.w1Scales.ptr + BigInt(e * w1ScaleBytes), x.w1.scales, w1ScaleBytes, stream);
        device.copyHtoD(r.w2.ptr + BigInt((e * w1Bytes) / 2), x.w2.q, w1Bytes / 2, stream);
        device.copyHtoD(
          r.w2Scales.ptr + BigInt((e * w1ScaleBytes) / 2),
          x.w2.scales,
          w1ScaleBytes / 2,
          stream,
        );
        // The copies read host memory the source may reuse or drop for the next expert.
        stream?.synchronize();
      }
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

  /**
   * FP4 experts: the packed codes expert by expert, through a device scratch into the device layout; the
   * scale bytes through `fp4GemmScaleWords`, staged for up to SCALE_CHUNK_EXPERTS experts and copied as
   * one strip per K block (both layouts put an expert's rows of one K block together, K blocks a layer's
   * E·N rows apart); each expert's block scales read from those words (`fp4GemmBlockScales`).
   */
  private uploadFp4Experts(source: MoEWeightSource, stream: Stream | null): void {
    const r = this.routedFp4!;
    const c = this.config;
    const device = this.gateWeight.device;
    const H = c.hidden;
    const I = c.intermediate;
    const E = c.numExperts;
    const w1Packed = I * H; // bytes: 2I·H elements, two per byte
    const chunk = Math.min(E, SCALE_CHUNK_EXPERTS);
    const stage1 = new Uint8Array((chunk * 2 * I * H) / MXFP4_GROUP);
    const stage2 = new Uint8Array((chunk * H * I) / MXFP4_GROUP);
    let inexact = 0;
    const scratch = fp4ExpertScratch(device, H, I, stream);
    try {
      for (let first = 0; first < E; first += chunk) {
        const n = Math.min(chunk, E - first);
        const s1 = stage1.subarray(0, (n * 2 * I * H) / MXFP4_GROUP);
        const s2 = stage2.subarray(0, (n * H * I) / MXFP4_GROUP);
        for (let i = 0; i < n; i++) {
          const e = first + i;
          const x = expertIn(source.expert(e), "fp4", e);
          checkMxfp4Matrix(`expert ${e} W1`, x.w1, 2 * I, H);
          checkMxfp4Matrix(`expert ${e} W2`, x.w2, H, I);
          inexact += countFp4ToFp8Inexact(x.w1) + countFp4ToFp8Inexact(x.w2);
          const words1 = fp4GemmScaleWords(x.w1.scales, 2 * I, H);
          const words2 = fp4GemmScaleWords(x.w2.scales, H, I);
          const bs1 = fp4GemmBlockScales(words1, 2 * I, H);
          const bs2 = fp4GemmBlockScales(words2, H, I);
          device.copyHtoD(r.w1BlockScales.ptr + BigInt(e * bs1.byteLength), bs1, bs1.byteLength, stream);
          device.copyHtoD(r.w2BlockScales.ptr + BigInt(e * bs2.byteLength), bs2, bs2.byteLength, stream);
          device.copyHtoD(scratch.w1.ptr, x.w1.packed, w1Packed, stream);
          device.copyHtoD(scratch.w2.ptr, x.w2.packed, w1Packed / 2, stream);
          scratch.write(r, e);
          scatterScaleWords(s1, words1, i, n, 2 * I, H / QUANT_BLOCK);
          scatterScaleWords(s2, words2, i, n, H, I / QUANT_BLOCK);
          // The copies read host memory the source may reuse or drop for the next expert.
          stream?.synchronize();
        }
        copyScaleStrips(r.w1Scales, s1, H / QUANT_BLOCK, n * 2 * I, first * 2 * I, E * 2 * I, stream);
        copyScaleStrips(r.w2Scales, s2, I / QUANT_BLOCK, n * H, first * H, E * H, stream);
        // The staging buffers are refilled for the next chunk.
        stream?.synchronize();
      }
    } finally {
      scratch.dispose();
    }
    this.exactness = { elements: E * 3 * I * H, inexact };
  }

  /** Frees every tensor. Idempotent. */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    disposePair(this.routedFp8);
    disposePair(this.routedFp4);
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
