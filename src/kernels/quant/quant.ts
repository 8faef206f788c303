/**
 * Launcher of the pre-dispatch activation quantization kernel (quant.cu): bf16 [T, H] → e4m3 [T, H]
 * plus fp32 scales [T, H/128], bit-exact with `quantizeActivations` in src/numerics/quant.ts.
 *
 * Kernels are specialized per (hidden, scale format) through the JIT and memoized per device, each with
 * its `KernelArgs` built once; a launch only rewrites the four argument slots. The kernel is
 * memory-bound, so the benchmark reports it against a measured device-copy ceiling.
 */

import { QUANT_BLOCK, SCALE_FORMATS, type ScaleFormat } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  DeviceTensor,
  describeTensor,
  expectOperand,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceMemo,
  type ResultRow,
  type Stream,
  timeKernel,
} from "../../cuda/index.js";
import { measureCopyCeiling } from "../probe/probe.js";
import { quantDefines } from "./quant.variants.js";

/** The kernel source, relative to src/kernels. */
export const QUANT_KERNEL_SOURCE = "quant/quant.cu";
export const QUANT_KERNEL_NAME = "megamoe_quantize_act";

// Mirrors of quant.cu's constants: a warp handles GROUPS_PER_WARP_STEP consecutive groups per step;
// blocks have at most 256 threads (its __launch_bounds__) and a whole number of warps.
export const GROUPS_PER_WARP_STEP = 8;
const BLOCK_SIZES = [256, 128, 64, 32] as const;

// Hopper (sm_90) per-SM limits used by the occupancy estimate.
const SM_REGISTERS = 65536;
const SM_MAX_THREADS = 2048;
const SM_MAX_BLOCKS = 32;
const REGISTER_ALLOC_UNIT = 256; // registers are handed to warps in chunks of 256

/** Quantized activations on the device: e4m3 codes [T, H] and fp32 scales [T, H/128]. */
export interface QuantOutputs {
  q: DeviceTensor;
  scales: DeviceTensor;
}

export interface QuantLaunchConfig {
  /** 128-channel groups, T·H/128. */
  groups: number;
  threads: number;
  blocks: number;
}

/**
 * Blocks of `threads` threads that fit on one SM at `registers` registers per thread (the limit that
 * binds for this kernel; it uses no shared memory).
 */
export function residentBlocksPerSm(threads: number, registers: number): number {
  const warps = Math.ceil(threads / 32);
  const registersPerWarp =
    Math.ceil((Math.max(registers, 1) * 32) / REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT;
  const byRegisters = Math.floor(Math.floor(SM_REGISTERS / registersPerWarp) / warps);
  const byThreads = Math.floor(SM_MAX_THREADS / (warps * 32));
  return Math.max(1, Math.min(byRegisters, byThreads, SM_MAX_BLOCKS));
}

/**
 * Block size and grid for T tokens of H channels. The largest block that still gives every SM at least
 * one block (small T spreads over more SMs rather than queueing on few), and a grid no larger than
 * what is resident at once: warps then stride over the remaining steps instead of waiting in waves.
 */
export function quantLaunchConfig(
  tokens: number,
  hidden: number,
  smCount: number,
  registers: number,
): QuantLaunchConfig {
  const groups = tokens * (hidden / QUANT_BLOCK);
  const steps = Math.ceil(groups / GROUPS_PER_WARP_STEP);
  const threads = BLOCK_SIZES.find((t) => Math.ceil(steps / (t / 32)) >= smCount) ?? 32;
  const needed = Math.ceil(steps / (threads / 32));
  const resident = smCount * residentBlocksPerSm(threads, registers);
  return { groups, threads, blocks: Math.max(1, Math.min(needed, resident)) };
}

/** Bytes the kernel must move: read 2·T·H (bf16), write T·H (e4m3) + 4·T·H/128 (scales). */
export function quantBytes(tokens: number, hidden: number): number {
  return 2 * tokens * hidden + tokens * hidden + 4 * tokens * (hidden / QUANT_BLOCK);
}

/** The memory floor: the bytes moved at the device's copy bandwidth `copyTbps` (TB/s, read + write). */
export function quantFloor(
  tokens: number,
  hidden: number,
  copyTbps: number,
): { bytes: number; floorUs: number } {
  if (!(copyTbps > 0))
    throw new RangeError(`quantFloor: copy bandwidth must be positive, got ${copyTbps} TB/s`);
  const bytes = quantBytes(tokens, hidden);
  return { bytes, floorUs: bytes / (copyTbps * 1e6) };
}

// ---------------------------------------------------------------------------------------------------
// Kernels, memoized

interface QuantKernel {
  kernel: Kernel;
  args: KernelArgs;
  registers: number;
}

const quantKernels = perDeviceMemo<string, QuantKernel>();

/** The kernel specialized for `hidden` and `format` on `device`, compiled (or read from the JIT cache) once. */
function quantKernelFor(device: Device, hidden: number, format: ScaleFormat): QuantKernel {
  return quantKernels(device, `${hidden}:${format}`, () => {
    const compiled = compileKernel({ source: QUANT_KERNEL_SOURCE, defines: quantDefines(hidden, format) });
    const kernel = loadKernel(device, compiled, QUANT_KERNEL_NAME);
    return { kernel, args: new KernelArgs(4), registers: kernel.numRegisters };
  });
}

// ---------------------------------------------------------------------------------------------------
// Checks

function checkInputs(
  device: Device,
  x: DeviceTensor,
  out: QuantOutputs,
  format: ScaleFormat,
): [number, number] {
  if (!SCALE_FORMATS.includes(format)) {
    throw new Error(`quantizeOnDevice: scale format must be "fp32" or "ue8m0", got ${String(format)}`);
  }
  if (x.dtype !== "bf16" || x.shape.length !== 2) {
    throw new Error(
      `quantizeOnDevice: x must be bf16[tokens, hidden], got ${describeTensor(x.dtype, x.shape)}`,
    );
  }
  const [tokens, hidden] = x.shape as [number, number];
  if (hidden < QUANT_BLOCK || hidden % QUANT_BLOCK !== 0) {
    throw new Error(`quantizeOnDevice: hidden must be a positive multiple of ${QUANT_BLOCK}, got ${hidden}`);
  }
  // The kernel counts groups in 32 bits.
  if (tokens * (hidden / QUANT_BLOCK) > 2 ** 31) {
    throw new Error(`quantizeOnDevice: ${tokens}·${hidden} activations exceed the kernel's 2^31 groups`);
  }
  expectOperand("quantizeOnDevice", "x", x, "bf16", [tokens, hidden], device);
  expectOperand("quantizeOnDevice", "out.q", out.q, "fp8_e4m3", [tokens, hidden], device);
  expectOperand("quantizeOnDevice", "out.scales", out.scales, "fp32", [tokens, hidden / QUANT_BLOCK], device);
  // 16-byte loads, 8-byte stores (device allocations are 256-byte aligned; this guards future views).
  if (tokens > 0 && (x.ptr % 16n !== 0n || out.q.ptr % 8n !== 0n || out.scales.ptr % 4n !== 0n)) {
    throw new Error("quantizeOnDevice: x must be 16-byte, out.q 8-byte and out.scales 4-byte aligned");
  }
  return [tokens, hidden];
}

// ---------------------------------------------------------------------------------------------------
// Launch

/** Allocates outputs for `tokens` × `hidden` activations (uninitialized). */
export function allocQuantOutputs(device: Device, tokens: number, hidden: number): QuantOutputs {
  const q = DeviceTensor.empty(device, "fp8_e4m3", [tokens, hidden]);
  try {
    return { q, scales: DeviceTensor.empty(device, "fp32", [tokens, hidden / QUANT_BLOCK]) };
  } catch (e) {
    q.dispose();
    throw e;
  }
}

/**
 * Queues the quantization of x (bf16 [T, H]) into out.q (e4m3 [T, H]) and out.scales (fp32 [T, H/128])
 * on `stream` (null: the legacy default stream). T = 0 queues nothing. The first call for a (device,
 * hidden, format) compiles the kernel (or reads it from the JIT cache).
 */
export function quantizeOnDevice(
  device: Device,
  x: DeviceTensor,
  out: QuantOutputs,
  format: ScaleFormat,
  stream: Stream | null,
): void {
  const [tokens, hidden] = checkInputs(device, x, out, format);
  if (tokens === 0) return;
  const k = quantKernelFor(device, hidden, format);
  const launch = quantLaunchConfig(tokens, hidden, device.smCount, k.registers);
  k.args.ptr(0, x.ptr).ptr(1, out.q.ptr).ptr(2, out.scales.ptr).u32(3, tokens);
  k.kernel.launch(launch.blocks, launch.threads, 0, stream, k.args);
}

/**
 * quantizeOnDevice into memory no DeviceTensor owns (an expert-parallel rank's rows in its symmetric
 * buffer, src/parallel/fused-expert-parallel.ts): e4m3 [T, H] at `q` (8-byte aligned) and fp32 [T, H/128]
 * at `scales` (4-byte aligned), both on x's device. The caller vouches for the sizes.
 */
export function quantizeIntoOnDevice(
  x: DeviceTensor,
  q: bigint,
  scales: bigint,
  format: ScaleFormat,
  stream: Stream | null,
): void {
  const device = x.device;
  if (x.dtype !== "bf16" || x.shape.length !== 2) {
    throw new Error(
      `quantizeIntoOnDevice: x must be bf16[tokens, hidden], got ${describeTensor(x.dtype, x.shape)}`,
    );
  }
  if (q % 8n !== 0n || scales % 4n !== 0n) {
    throw new Error("quantizeIntoOnDevice: q must be 8-byte and scales 4-byte aligned");
  }
  const [tokens, hidden] = x.shape as [number, number];
  if (tokens === 0) return;
  if (!SCALE_FORMATS.includes(format) || hidden % QUANT_BLOCK !== 0 || x.ptr % 16n !== 0n) {
    throw new Error(
      `quantizeIntoOnDevice: needs a scale format, hidden a multiple of ${QUANT_BLOCK} and x 16-byte aligned`,
    );
  }
  const k = quantKernelFor(device, hidden, format);
  const launch = quantLaunchConfig(tokens, hidden, device.smCount, k.registers);
  k.args.ptr(0, x.ptr).ptr(1, q).ptr(2, scales).u32(3, tokens);
  k.kernel.launch(launch.blocks, launch.threads, 0, stream, k.args);
}

// ---------------------------------------------------------------------------------------------------
// Benchmark

/** One benchmark shape. */
export interface QuantShape {
  tokens: number;
  hidden: number;
  /** Preset name for the results row (default "custom"). */
  config?: string;
}

export interface BenchmarkQuantOptions {
  format?: ScaleFormat;
  /** Copy ceiling in TB/s (read + written); measured with probe's `measureCopyCeiling` when absent. */
  copyTbps?: number;
  warmup?: number;
  iters?: number;
}

/** Finite bf16 activations of varied magnitude (a cheap LCG: the values do not change the timing). */
function benchmarkInput(count: number): Uint16Array {
  const x = new Uint16Array(count);
  let s = 0x2545f491;
  for (let i = 0; i < count; i++) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    // sign, exponent 2^-8 .. 2^7, any mantissa
    x[i] = ((s >>> 31) << 15) | ((0x77 + ((s >>> 20) & 0xf)) << 7) | ((s >>> 8) & 0x7f);
  }
  return x;
}

/**
 * Times the kernel (L2 flushed before each run) for every shape and returns one results row each:
 * `impl: "quant"`, the floor from the copy ceiling, achieved TB/s and `fraction_of_copy`
 * (floor / measured time, 1 = copy speed).
 */
export function benchmarkQuant(
  device: Device,
  shapes: readonly QuantShape[],
  options: BenchmarkQuantOptions = {},
): ResultRow[] {
  const format = options.format ?? "fp32";
  const copyTbps = options.copyTbps ?? measureCopyCeiling(device).tbps;
  const rows: ResultRow[] = [];
  for (const shape of shapes) {
    const { tokens, hidden } = shape;
    const x = DeviceTensor.fromHost(device, "bf16", [tokens, hidden], benchmarkInput(tokens * hidden));
    let out: QuantOutputs | undefined;
    try {
      out = allocQuantOutputs(device, tokens, hidden);
      const outputs = out;
      const timing = timeKernel(device, (s) => quantizeOnDevice(device, x, outputs, format, s), {
        warmup: options.warmup ?? 10,
        iters: options.iters ?? 50,
      });
      const { bytes, floorUs } = quantFloor(tokens, hidden, copyTbps);
      rows.push({
        config: shape.config ?? "custom",
        tokens,
        shared: false,
        impl: "quant",
        us_median: timing.usMedian,
        us_min: timing.usMin,
        us_max: timing.usMax,
        floor_us: floorUs,
        tflops: 0,
        tbps: bytes / (timing.usMedian * 1e6),
        fraction_of_copy: floorUs / timing.usMedian,
        hidden,
        format,
        bytes,
        copy_tbps: copyTbps,
      });
    } finally {
      x.dispose();
      out?.q.dispose();
      out?.scales.dispose();
    }
  }
  return rows;
}
