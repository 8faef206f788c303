/**
 * Launcher of fp4_convert.cu: MXFP4 weights [rows, K] (packed nibbles and their reference words, the
 * scales' load-time form) → e4m3 codes [rows, K] and fp32 scales [rows, K/128] (2^ref per row and K
 * block), bit-exact with `mxfp4RowsToFp8` (src/numerics/fp4.ts); and the load-time passes: packed rows
 * into the device layout, UE8M0 scale words into reference words.
 */

import { QUANT_BLOCK } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  DeviceTensor,
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
/** Stored rows → rows of a tensor in the FP4 kernels' device layout. */
export const FP4_DEVICE_LAYOUT_KERNEL = "megamoe_fp4_device_layout";
/** UE8M0 scale words → reference words, in place. */
export const FP4_REFERENCE_WORDS_KERNEL = "megamoe_fp4_reference_words";
export const FP4_CONVERT_THREADS = 128;

export interface Fp4ConvertArgs {
  /** uint8 [rows, K/2]. */
  packed: DeviceTensor;
  /** uint8 [rows, K/32]: each row's K blocks' reference words (`mxfp4ReferenceWords`, little-endian). */
  words: DeviceTensor;
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
  expectOperand(where, "words", args.words, "uint8", [rows, k / 32], device);
  expectOperand(where, "q", args.q, args.q.dtype === "uint8" ? "uint8" : "fp8_e4m3", [rows, k], device);
  expectOperand(where, "sw", args.sw, "fp32", [rows, k / QUANT_BLOCK], device);
  const blocks = (rows * k) / QUANT_BLOCK;
  if (blocks === 0) return;
  const kernel = loadKernel(device, compileKernel({ source: FP4_CONVERT_SOURCE }), FP4_CONVERT_KERNELS[path]);
  const launchArgs = new KernelArgs(5)
    .ptr(0, args.packed.ptr)
    .ptr(1, args.words.ptr)
    .ptr(2, args.q.ptr)
    .ptr(3, args.sw.ptr)
    .u32(4, blocks);
  kernel.launch(Math.ceil(blocks / FP4_CONVERT_THREADS), FP4_CONVERT_THREADS, 0, stream, launchArgs);
}

/** Rows and bytes per row of a packed tensor [R, K/2] or [G, N, K/2] (R = G·N), K a multiple of 128. */
function packedRows(where: string, name: string, t: DeviceTensor, device: Device): [number, number] {
  if (t.dtype !== "uint8") throw new TypeError(`${where}: ${name} must be uint8, got ${t.dtype}`);
  expectOnDevice(where, name, t, device);
  const shape = t.shape;
  const width = shape[shape.length - 1] ?? 0;
  if ((shape.length !== 2 && shape.length !== 3) || width === 0 || width % (QUANT_BLOCK / 2) !== 0) {
    throw new RangeError(
      `${where}: ${name} must be [R, K/2] or [G, N, K/2] with K a positive multiple of 128, got [${shape.join(", ")}]`,
    );
  }
  return [t.numel / width, width];
}

/**
 * Writes `src`, packed MXFP4 rows as stored (uint8 [rows, K/2], element 2j in the low nibble of byte j),
 * as rows `firstRow` .. `firstRow + rows` of `dst`, a packed tensor in the device layout the FP4 kernels
 * read (docs/numerics.md "the device layout": [K/128, R, 64 bytes], each 64-byte block in the device
 * order; `mxfp4DeviceLayout` is the host form), queued on `stream`. `src` and `dst` must not overlap.
 */
export function writeFp4LayoutOnDevice(
  device: Device,
  dst: DeviceTensor,
  firstRow: number,
  src: DeviceTensor,
  stream: Stream | null,
): void {
  const where = "writeFp4LayoutOnDevice";
  const [dstRows, width] = packedRows(where, "dst", dst, device);
  const [rows, srcWidth] = packedRows(where, "src", src, device);
  if (srcWidth !== width) throw new RangeError(`${where}: src rows are ${srcWidth} bytes, dst rows ${width}`);
  if (!Number.isInteger(firstRow) || firstRow < 0 || firstRow + rows > dstRows) {
    throw new RangeError(`${where}: rows ${firstRow} .. ${firstRow + rows} are not within dst's ${dstRows}`);
  }
  const kBlocks = (2 * width) / QUANT_BLOCK;
  if (rows === 0) return;
  const kernel = loadKernel(device, compileKernel({ source: FP4_CONVERT_SOURCE }), FP4_DEVICE_LAYOUT_KERNEL);
  const args = new KernelArgs(6)
    .ptr(0, src.ptr)
    .ptr(1, dst.ptr)
    .u32(2, rows)
    .u32(3, kBlocks)
    .u32(4, dstRows)
    .u32(5, firstRow);
  kernel.launch(Math.ceil((rows * kBlocks) / FP4_CONVERT_THREADS), FP4_CONVERT_THREADS, 0, stream, args);
}

/**
 * Puts packed MXFP4 weights (uint8 [R, K/2] or [G, N, K/2], stored order) into the device layout in
 * place (`writeFp4LayoutOnDevice` from a scratch copy the size of the tensor), on `stream`; returns once
 * done, the scratch freed. Applying it twice scrambles the weights: it is the load-time step between
 * the stored bytes and the kernels.
 */
export function orderFp4PackedOnDevice(device: Device, packed: DeviceTensor, stream: Stream | null): void {
  const [rows, width] = packedRows("orderFp4PackedOnDevice", "packed", packed, device);
  if (rows === 0) return;
  const scratch = DeviceTensor.empty(device, "uint8", [rows, width]);
  try {
    device.copyDtoD(scratch.ptr, packed.ptr, rows * width, stream);
    writeFp4LayoutOnDevice(device, packed, 0, scratch, stream);
  } finally {
    (stream ?? device.nullStream).synchronize();
    scratch.dispose();
  }
}

/**
 * The load-time transform of FP4 scale words on the device, in place: `words` uint8 [K/128, R·4] holds,
 * for rows firstRow .. firstRow + rows of its R stacked rows, row n's four UE8M0 bytes of K block b at
 * (b, 4n) (the GPU generator's "gemm" layout), and receives their reference words, what
 * `fp4GemmScaleWords` gives on the host for each matrix of `matrixRows` rows (its 128-row blocks from its
 * first row). With `blockScales` (fp32 [rows/matrixRows, ⌈matrixRows/128⌉, K/128]) it also receives each
 * 128 × 128 block's fp32 scale 2^(R − 133), what `fp4BlockScales` gives on the host: the FP8 weights'
 * scale layout, which the fused kernel's tiles read. The bytes must hold no 0xFF (NaN). Queued on `stream`.
 */
export function fp4ReferenceWordsOnDevice(
  device: Device,
  words: DeviceTensor,
  firstRow: number,
  rows: number,
  matrixRows: number,
  stream: Stream | null,
  blockScales: DeviceTensor | null = null,
): void {
  const where = "fp4ReferenceWordsOnDevice";
  if (words.dtype !== "uint8") throw new TypeError(`${where}: words must be uint8, got ${words.dtype}`);
  expectOnDevice(where, "words", words, device);
  const [kBlocks, width] = words.shape;
  if (
    words.shape.length !== 2 ||
    kBlocks === undefined ||
    width === undefined ||
    kBlocks < 1 ||
    width % 4 !== 0
  ) {
    throw new RangeError(`${where}: words must be [K/128, R·4], got [${words.shape.join(", ")}]`);
  }
  const total = width / 4;
  const whole = (x: number) => Number.isInteger(x) && x >= 0;
  if (!(whole(firstRow) && whole(rows) && whole(matrixRows) && matrixRows > 0 && rows % matrixRows === 0)) {
    throw new RangeError(
      `${where}: rows ${rows} must be whole matrices of ${matrixRows} rows, from a row ≥ 0 (${firstRow})`,
    );
  }
  if (firstRow + rows > total) {
    throw new RangeError(
      `${where}: rows ${firstRow} .. ${firstRow + rows} are not within the ${total} of words`,
    );
  }
  const blocks = (rows / matrixRows) * Math.ceil(matrixRows / QUANT_BLOCK) * kBlocks;
  if (blockScales !== null) {
    if (blockScales.dtype !== "fp32")
      throw new TypeError(`${where}: blockScales must be fp32, got ${blockScales.dtype}`);
    expectOnDevice(where, "blockScales", blockScales, device);
    if (blockScales.numel !== blocks) {
      throw new RangeError(
        `${where}: blockScales holds ${blockScales.numel} values, not the ${blocks} of ${rows / matrixRows} matrices × ${Math.ceil(matrixRows / QUANT_BLOCK)} × ${kBlocks} blocks`,
      );
    }
  }
  if (rows === 0) return;
  const kernel = loadKernel(
    device,
    compileKernel({ source: FP4_CONVERT_SOURCE }),
    FP4_REFERENCE_WORDS_KERNEL,
  );
  const args = new KernelArgs(7)
    .ptr(0, words.ptr)
    .u32(1, total)
    .u32(2, firstRow)
    .u32(3, rows)
    .u32(4, matrixRows)
    .u32(5, kBlocks)
    .ptr(6, blockScales?.ptr ?? 0n);
  kernel.launch(Math.ceil(blocks / FP4_CONVERT_THREADS), FP4_CONVERT_THREADS, 0, stream, args);
}
