/**
 * Launcher of fp4_convert.cu: MXFP4 weights [rows, K] (packed nibbles and UE8M0 bytes) → e4m3 codes
 * [rows, K] and fp32 scales [rows, K/128] (2^ref per row and K block), bit-exact with
 * `mxfp4RowsToFp8` (src/numerics/fp4.ts). The scale bytes must hold no 0xFF (NaN): check them on the
 * host (`checkMxfp4Scales`) before they reach the device.
 */

import { QUANT_BLOCK } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  type DeviceTensor,
  expectOnDevice,
  expectOperand,
  KernelArgs,
  loadKernel,
  type Stream,
} from "../../cuda/index.js";

/** The kernel source, relative to src/kernels. */
export const FP4_CONVERT_SOURCE = "fp4/fp4_convert.cu";
/** The fast path (common/fp4.cuh's prmt lookups) and the exact one (element by element, a test oracle). */
export const FP4_CONVERT_KERNELS = {
  fast: "megamoe_fp4_to_e4m3",
  exact: "megamoe_fp4_to_e4m3_exact",
} as const;
/** Stored order → the FP4 kernels' device order, in place. */
export const FP4_DEVICE_ORDER_KERNEL = "megamoe_fp4_device_order";
const THREADS = 128;

export interface Fp4ConvertArgs {
  /** uint8 [rows, K/2]. */
  packed: DeviceTensor;
  /** uint8 [rows, K/32]. */
  scales: DeviceTensor;
  /** uint8 (or fp8_e4m3) [rows, K], written. */
  q: DeviceTensor;
  /** fp32 [rows, K/128], written. */
  sw: DeviceTensor;
  rows: number;
  k: number;
}

/** Converts on `stream` (null: the default stream); `path` picks the kernel (default fast). */
export function convertFp4ToFp8(
  device: Device,
  args: Fp4ConvertArgs,
  stream: Stream | null,
  path: keyof typeof FP4_CONVERT_KERNELS = "fast",
): void {
  const { rows, k } = args;
  const where = "convertFp4ToFp8";
  if (
    !Number.isInteger(rows) ||
    rows < 0 ||
    !Number.isInteger(k) ||
    k < QUANT_BLOCK ||
    k % QUANT_BLOCK !== 0
  ) {
    throw new RangeError(`${where}: rows must be ≥ 0 and k a positive multiple of 128, got ${rows}×${k}`);
  }
  expectOperand(where, "packed", args.packed, "uint8", [rows, k / 2], device);
  expectOperand(where, "scales", args.scales, "uint8", [rows, k / 32], device);
  expectOperand(where, "q", args.q, args.q.dtype === "uint8" ? "uint8" : "fp8_e4m3", [rows, k], device);
  expectOperand(where, "sw", args.sw, "fp32", [rows, k / QUANT_BLOCK], device);
  const blocks = (rows * k) / QUANT_BLOCK;
  if (blocks === 0) return;
  const kernel = loadKernel(device, compileKernel({ source: FP4_CONVERT_SOURCE }), FP4_CONVERT_KERNELS[path]);
  const launchArgs = new KernelArgs(5)
    .ptr(0, args.packed.ptr)
    .ptr(1, args.scales.ptr)
    .ptr(2, args.q.ptr)
    .ptr(3, args.sw.ptr)
    .u32(4, blocks);
  kernel.launch(Math.ceil(blocks / THREADS), THREADS, 0, stream, launchArgs);
}

/**
 * Puts packed MXFP4 weights (uint8, row-major, rows of whole 128-element K blocks, in the stored order:
 * element 2j in the low nibble of byte j) into the device order the FP4 kernels read (docs/numerics.md,
 * "the device order"; `mxfp4DeviceOrder` is the host form), in place on `stream`. `bytes` (default all
 * of `packed`) from byte `offset` (default 0), both multiples of 64. Applying it twice scrambles the
 * weights: it is the load-time step between the stored bytes and the kernels.
 */
export function orderFp4PackedOnDevice(
  device: Device,
  packed: DeviceTensor,
  stream: Stream | null,
  offset = 0,
  bytes = packed.numel - offset,
): void {
  const where = "orderFp4PackedOnDevice";
  if (packed.dtype !== "uint8") throw new TypeError(`${where}: packed must be uint8, got ${packed.dtype}`);
  expectOnDevice(where, "packed", packed, device);
  const block = QUANT_BLOCK / 2;
  if (
    !Number.isInteger(offset) ||
    !Number.isInteger(bytes) ||
    offset < 0 ||
    bytes < 0 ||
    offset % block !== 0 ||
    bytes % block !== 0 ||
    offset + bytes > packed.numel
  ) {
    throw new RangeError(
      `${where}: bytes ${bytes} from offset ${offset} must be whole 64-byte K blocks within the tensor's ${packed.numel}`,
    );
  }
  const blocks = bytes / block;
  if (blocks === 0) return;
  const kernel = loadKernel(device, compileKernel({ source: FP4_CONVERT_SOURCE }), FP4_DEVICE_ORDER_KERNEL);
  const args = new KernelArgs(2).ptr(0, packed.ptr + BigInt(offset)).u32(1, blocks);
  kernel.launch(Math.ceil(blocks / THREADS), THREADS, 0, stream, args);
}
