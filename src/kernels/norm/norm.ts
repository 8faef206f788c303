/**
 * Launcher of the boundary kernel (norm.cu): RMSNorm of bf16 rows, optionally after the
 * hyper-connection pre-mix, writing bf16 rows and/or FP8 e4m3 rows with per-128 scales. Bit-exact with
 * `rmsNorm` / `premixRmsNorm` (src/reference/norm.ts), and its FP8 output bit-exact with running
 * `quantizeOnDevice` on its bf16 output.
 *
 * One warp per token, 4 tokens per block; up to one token per SM, a block per token instead
 * (megamoe_rmsnorm_wide: the row's loads spread over its warps, the same bits). Kernels specialized per
 * (hidden, scale format) and memoized per device like the quantization kernel's.
 */

import { QUANT_BLOCK, SCALE_FORMATS, type ScaleFormat } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  type DeviceTensor,
  describeTensor,
  expectOnDevice,
  expectOperand,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceMemo,
  type Stream,
} from "../../cuda/index.js";
import { normDefines } from "./norm.variants.js";

export const NORM_KERNEL_SOURCE = "norm/norm.cu";
export const NORM_KERNEL_NAME = "megamoe_rmsnorm";
export const NORM_WIDE_KERNEL_NAME = "megamoe_rmsnorm_wide";
/** Tokens per block (norm.cu's kThreads / 32). */
export const NORM_TOKENS_PER_BLOCK = 4;

/** The input: bf16 rows [T, H], or n residual streams [T, n, H] bf16 with mix weights [T, n] fp32. */
export type NormInput =
  | { x: DeviceTensor; streams?: undefined; mix?: undefined }
  | { x?: undefined; streams: DeviceTensor; mix: DeviceTensor };

export interface NormOutputs {
  /** bf16 [T, H], or null when only the FP8 rows are wanted. */
  y: DeviceTensor | null;
  /** e4m3 [T, H] and fp32 scales [T, H/128] (the quantization kernel's layout), or null. */
  fp8: { q: DeviceTensor; scales: DeviceTensor; format: ScaleFormat } | null;
}

interface NormKernel {
  kernel: Kernel;
  wide: Kernel;
  /** Threads of the wide kernel's block for this hidden size. */
  wideThreads: number;
  args: KernelArgs;
}

/** Warps of megamoe_rmsnorm_wide's block for `hidden` (norm.cu's kWideWarps): a warp step is 256 channels. */
export function normWideWarps(hidden: number): number {
  const steps = Math.ceil(hidden / 256);
  const perWarp = Math.ceil(steps / 8);
  return Math.ceil(steps / perWarp);
}

const normKernels = perDeviceMemo<string, NormKernel>();

function normKernelFor(device: Device, hidden: number, format: ScaleFormat): NormKernel {
  return normKernels(device, `${hidden}:${format}`, () => {
    const compiled = compileKernel({ source: NORM_KERNEL_SOURCE, defines: normDefines(hidden, format) });
    return {
      kernel: loadKernel(device, compiled, NORM_KERNEL_NAME),
      wide: loadKernel(device, compiled, NORM_WIDE_KERNEL_NAME),
      wideThreads: 32 * normWideWarps(hidden),
      args: new KernelArgs(10),
    };
  });
}

const WHERE = "rmsNormOnDevice";

/** Checks every operand; returns [tokens, n streams (0: no pre-mix), hidden]. */
function checkOperands(
  device: Device,
  input: NormInput,
  weight: DeviceTensor,
  eps: number,
  out: NormOutputs,
): [number, number, number] {
  let tokens: number;
  let n: number;
  let hidden: number;
  if (input.x !== undefined) {
    const x = input.x;
    if (x.dtype !== "bf16" || x.shape.length !== 2) {
      throw new Error(`${WHERE}: x must be bf16[tokens, hidden], got ${describeTensor(x.dtype, x.shape)}`);
    }
    [tokens, hidden] = x.shape as [number, number];
    n = 0;
    expectOnDevice(WHERE, "x", x, device);
  } else {
    const s = input.streams;
    if (s.dtype !== "bf16" || s.shape.length !== 3) {
      throw new Error(
        `${WHERE}: streams must be bf16[tokens, n, hidden], got ${describeTensor(s.dtype, s.shape)}`,
      );
    }
    [tokens, n, hidden] = s.shape as [number, number, number];
    if (n < 1) throw new Error(`${WHERE}: streams must hold at least one stream, got n = ${n}`);
    expectOnDevice(WHERE, "streams", s, device);
    expectOperand(WHERE, "mix", input.mix, "fp32", [tokens, n], device);
  }
  if (hidden < QUANT_BLOCK || hidden % QUANT_BLOCK !== 0) {
    throw new Error(`${WHERE}: hidden must be a positive multiple of ${QUANT_BLOCK}, got ${hidden}`);
  }
  if (tokens >= 2 ** 31 / 32) throw new Error(`${WHERE}: ${tokens} tokens exceed the kernel's grid`);
  expectOperand(WHERE, "weight", weight, "bf16", [hidden], device);
  const e = Math.fround(eps);
  if (!(Number.isFinite(e) && e > 0))
    throw new Error(`${WHERE}: eps must be positive and finite, got ${eps}`);
  if (out.y === null && out.fp8 === null)
    throw new Error(`${WHERE}: no output asked for (y and fp8 are null)`);
  if (out.y !== null) expectOperand(WHERE, "out.y", out.y, "bf16", [tokens, hidden], device);
  if (out.fp8 !== null) {
    if (!SCALE_FORMATS.includes(out.fp8.format)) {
      throw new Error(`${WHERE}: scale format must be "fp32" or "ue8m0", got ${String(out.fp8.format)}`);
    }
    expectOperand(WHERE, "out.fp8.q", out.fp8.q, "fp8_e4m3", [tokens, hidden], device);
    expectOperand(WHERE, "out.fp8.scales", out.fp8.scales, "fp32", [tokens, hidden / QUANT_BLOCK], device);
  }
  // 16-byte loads and stores, 8-byte code stores (views could break what allocations guarantee).
  const aligned = (t: DeviceTensor | null | undefined, a: bigint) => t == null || t.ptr % a === 0n;
  if (
    !aligned(input.x, 16n) ||
    !aligned(input.streams, 16n) ||
    !aligned(weight, 16n) ||
    !aligned(out.y, 16n) ||
    !aligned(out.fp8?.q, 8n) ||
    !aligned(out.fp8?.scales, 4n)
  ) {
    throw new Error(`${WHERE}: x, streams, weight and y must be 16-byte aligned, q 8-byte, scales 4-byte`);
  }
  return [tokens, n, hidden];
}

/**
 * Queues RMSNorm (weight bf16 [H], eps) of `input` on `stream` (null: the legacy default stream):
 * y = bf16((x · r) · weight), r = 1/sqrt(mean(x²) + eps), with x the bf16 rows or the fp32 pre-mix
 * Σ_j mix[t, j] · streams[t, j, :]. Writes out.y and/or out.fp8 (codes and scales of the bf16 rows).
 * T = 0 queues nothing.
 */
export function rmsNormOnDevice(
  device: Device,
  input: NormInput,
  weight: DeviceTensor,
  eps: number,
  out: NormOutputs,
  stream: Stream | null,
): void {
  const [tokens, n, hidden] = checkOperands(device, input, weight, eps, out);
  if (tokens === 0) return;
  const k = normKernelFor(device, hidden, out.fp8?.format ?? "fp32");
  k.args
    .ptr(0, input.x?.ptr ?? 0n)
    .ptr(1, input.streams?.ptr ?? 0n)
    .ptr(2, input.mix?.ptr ?? 0n)
    .u32(3, n)
    .ptr(4, weight.ptr)
    .f32(5, eps)
    .ptr(6, out.y?.ptr ?? 0n)
    .ptr(7, out.fp8?.q.ptr ?? 0n)
    .ptr(8, out.fp8?.scales.ptr ?? 0n)
    .u32(9, tokens);
  // Up to a token per SM a warp per token leaves the row's few round trips exposed; a block per token
  // takes them at once.
  if (tokens <= device.smCount) {
    k.wide.launchAfterPrevious(tokens, k.wideThreads, 0, stream, k.args);
  } else {
    k.kernel.launchAfterPrevious(
      Math.ceil(tokens / NORM_TOKENS_PER_BLOCK),
      32 * NORM_TOKENS_PER_BLOCK,
      0,
      stream,
      k.args,
    );
  }
}
