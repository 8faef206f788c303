/**
 * Launcher of adopt.cu: the passes that take an engine's tensors into the forms the kernels read (UE8M0
 * block scales to fp32, an MXFP4 matrix's scale bytes to the GEMM's word layout, int64 expert ids to
 * int32). The export (src/export/) writes the same launches into its steps; the grid rule is
 * `adoptGrid` for both.
 */
import {
  compileKernel,
  type Device,
  type DeviceTensor,
  expectOnDevice,
  KernelArgs,
  loadKernel,
  type Stream,
} from "../../cuda/index.js";

/** The kernel source, relative to src/kernels. */
export const ADOPT_SOURCE = "adopt/adopt.cu";
export const UE8M0_TO_F32_KERNEL = "megamoe_ue8m0_to_f32";
export const TRANSPOSE_U32_KERNEL = "megamoe_transpose_u32";
export const IDS_I64_TO_I32_KERNEL = "megamoe_ids_i64_to_i32";
/** Threads per block of both kernels (their __launch_bounds__). */
export const ADOPT_THREADS = 256;

/** Blocks for one thread per element. */
export function adoptGrid(elements: number): number {
  return Math.max(1, Math.ceil(elements / ADOPT_THREADS));
}

function kernel(device: Device, name: string) {
  return loadKernel(device, compileKernel({ source: ADOPT_SOURCE }), name);
}

/** `dst` fp32 receives 2^(s − 127) of each UE8M0 byte of `src` (same element count), on `stream`. */
export function ue8m0ToF32OnDevice(
  device: Device,
  src: DeviceTensor,
  dst: DeviceTensor,
  stream: Stream | null,
): void {
  const where = "ue8m0ToF32OnDevice";
  expectOnDevice(where, "src", src, device);
  expectOnDevice(where, "dst", dst, device);
  if (src.dtype !== "uint8" || dst.dtype !== "fp32" || src.numel !== dst.numel) {
    throw new TypeError(
      `${where}: src must be uint8 and dst fp32 of as many elements, got ${src.dtype} × ${src.numel} and ${dst.dtype} × ${dst.numel}`,
    );
  }
  if (src.numel === 0) return;
  const args = new KernelArgs(3).ptr(0, src.ptr).ptr(1, dst.ptr).u32(2, src.numel);
  kernel(device, UE8M0_TO_F32_KERNEL).launch(adoptGrid(src.numel), ADOPT_THREADS, 0, stream, args);
}

/**
 * An MXFP4 matrix's UE8M0 bytes, uint8 [rows, K/32] (rows may be [G, N] stacked), into the GEMM's scale
 * words uint8 [K/128, totalRows·4] at rows firstRow .. firstRow + rows (fp4GemmScaleWords' layout, before
 * the reference-word pass), on `stream`.
 */
export function scaleBytesToWordsOnDevice(
  device: Device,
  src: DeviceTensor,
  dst: DeviceTensor,
  firstRow: number,
  stream: Stream | null,
): void {
  const where = "scaleBytesToWordsOnDevice";
  expectOnDevice(where, "src", src, device);
  expectOnDevice(where, "dst", dst, device);
  const width = src.shape[src.shape.length - 1] ?? 0;
  const [kBlocks, dstWidth] = dst.shape;
  if (
    src.dtype !== "uint8" ||
    dst.dtype !== "uint8" ||
    width % 4 !== 0 ||
    dst.shape.length !== 2 ||
    kBlocks !== width / 4 ||
    dstWidth === undefined ||
    dstWidth % 4 !== 0
  ) {
    throw new RangeError(
      `${where}: src must be uint8 [rows, K/32] and dst uint8 [K/128, R·4], got ${src.dtype} [${src.shape.join(", ")}] and ${dst.dtype} [${dst.shape.join(", ")}]`,
    );
  }
  const rows = width === 0 ? 0 : src.numel / width;
  if (!Number.isInteger(firstRow) || firstRow < 0 || firstRow + rows > dstWidth / 4) {
    throw new RangeError(
      `${where}: rows ${firstRow} .. ${firstRow + rows} are not within dst's ${dstWidth / 4}`,
    );
  }
  if (rows === 0) return;
  const args = new KernelArgs(6)
    .ptr(0, src.ptr)
    .ptr(1, dst.ptr)
    .u32(2, rows)
    .u32(3, kBlocks)
    .u32(4, dstWidth / 4)
    .u32(5, firstRow);
  kernel(device, TRANSPOSE_U32_KERNEL).launch(adoptGrid(rows * kBlocks), ADOPT_THREADS, 0, stream, args);
}
