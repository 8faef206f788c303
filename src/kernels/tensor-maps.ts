/**
 * The TMA descriptor shapes the wgmma kernels read (the grouped GEMM and the fused layer): FP8
 * operand rows, K-major, in 128-wide boxes with the 128-byte swizzle that wgmma's shared-memory
 * descriptors expect; per-128 scales stored transposed ([K/128, rows]), read one scale column at a
 * time in boxes of a tile's rows; and FP4 (MXFP4) weights, packed rows and their UE8M0 words.
 */

import { QUANT_BLOCK } from "../config/config.js";
import {
  encodeTensorMapTiled,
  TensorMapDataType,
  TensorMapL2Promotion,
  TensorMapSwizzle,
  type TensorMapTiledDesc,
} from "../cuda/index.js";

/**
 * A tensor map without its global address: what the kernels' launchers encode once the buffer is
 * allocated, and what an export writes beside the buffer's name (src/export/).
 */
export type TensorMapShape = Omit<TensorMapTiledDesc, "globalAddress">;

/** Bytes of K per box of FP8 operand rows: one 128-byte swizzle row, the kernels' K block. */
const OPERAND_BOX_K = 128;

/** FP8 rows [rows, width] at `address`, boxes of OPERAND_BOX_K × `boxRows`. */
export function fp8RowsMap(width: number, rows: number, boxRows: number): TensorMapShape {
  return {
    dataType: TensorMapDataType.UINT8,
    globalDims: [width, rows],
    globalStridesBytes: [width],
    boxDims: [OPERAND_BOX_K, boxRows],
    swizzle: TensorMapSwizzle.B128,
    l2Promotion: TensorMapL2Promotion.B256,
  };
}

/** Encodes fp8RowsMap's map of the tensor at `address` into `map`. */
export function encodeFp8RowsMap(
  map: Uint8Array,
  address: bigint,
  width: number,
  rows: number,
  boxRows: number,
): void {
  encodeTensorMapTiled(map, { ...fp8RowsMap(width, rows, boxRows), globalAddress: address });
}

/**
 * Transposed fp32 scales [width/128, paddedRows] at `address`, boxes of `boxRows` rows of one scale
 * column. The kernels start a box at the tile's first row rounded down to 4 (a box's inner start must
 * be 16-byte aligned), so `boxRows` is a tile's rows + 4.
 */
export function scaleColumnsMap(width: number, paddedRows: number, boxRows: number): TensorMapShape {
  return {
    dataType: TensorMapDataType.FLOAT32,
    globalDims: [paddedRows, width / QUANT_BLOCK],
    globalStridesBytes: [paddedRows * 4],
    boxDims: [boxRows, 1],
  };
}

/** Encodes scaleColumnsMap's map of the tensor at `address` into `map`. */
export function encodeScaleColumnsMap(
  map: Uint8Array,
  address: bigint,
  width: number,
  paddedRows: number,
  boxRows: number,
): void {
  encodeTensorMapTiled(map, { ...scaleColumnsMap(width, paddedRows, boxRows), globalAddress: address });
}

/**
 * Packed FP4 rows uint8 [rows, K/2] at `address`, row-major, boxes of one 128-deep K block (64 bytes) ×
 * `boxRows`, in the 64-byte swizzle the kernels' shared-memory reads assume (it spreads the register
 * path's 16-byte and the converters' 8-byte loads over the banks). The kernels' weights are in the device
 * layout instead (encodeFp4LayoutMap); the weight-stream probe streams this form beside it.
 */
export function fp4RowsMap(k: number, rows: number, boxRows: number): TensorMapShape {
  return {
    dataType: TensorMapDataType.UINT8,
    globalDims: [k / 2, rows],
    globalStridesBytes: [k / 2],
    boxDims: [QUANT_BLOCK / 2, boxRows],
    swizzle: TensorMapSwizzle.B64,
    l2Promotion: TensorMapL2Promotion.B256,
  };
}

/** Encodes fp4RowsMap's map of the tensor at `address` into `map`. */
export function encodeFp4RowsMap(
  map: Uint8Array,
  address: bigint,
  k: number,
  rows: number,
  boxRows: number,
): void {
  encodeTensorMapTiled(map, { ...fp4RowsMap(k, rows, boxRows), globalAddress: address });
}

/**
 * Packed FP4 rows in the device layout (common/fp4.cuh: [K/128, rows, 64 bytes], K-block-major, each
 * block's quarters stored swizzled) at `address`: a 3-D map of two rows per TMA row, {128 bytes, rows / 2,
 * K/128}, unswizzled, boxes of one K block × `boxRows` rows (one contiguous run that lands as the
 * 64-byte swizzle would have put it); the kernels load (0, row / 2, kb).
 */
export function fp4LayoutMap(k: number, rows: number, boxRows: number): TensorMapShape {
  const pair = QUANT_BLOCK; // two rows' 64-byte blocks
  return {
    dataType: TensorMapDataType.UINT8,
    globalDims: [pair, rows / 2, k / QUANT_BLOCK],
    globalStridesBytes: [pair, (pair * rows) / 2],
    boxDims: [pair, boxRows / 2, 1],
    swizzle: TensorMapSwizzle.NONE,
    l2Promotion: TensorMapL2Promotion.B256,
  };
}

/** Encodes fp4LayoutMap's map of the tensor at `address` into `map`. */
export function encodeFp4LayoutMap(
  map: Uint8Array,
  address: bigint,
  k: number,
  rows: number,
  boxRows: number,
): void {
  encodeTensorMapTiled(map, { ...fp4LayoutMap(k, rows, boxRows), globalAddress: address });
}

/**
 * The UE8M0 words u32 [K/128, rows] at `address` (row n's four scale bytes of K block b at (b, n): the
 * load-time transform fp4GemmScaleWords), boxes of one K block's words of `boxRows` rows.
 */
export function fp4ScaleWordsMap(k: number, rows: number, boxRows: number): TensorMapShape {
  return {
    dataType: TensorMapDataType.UINT32,
    globalDims: [rows, k / QUANT_BLOCK],
    globalStridesBytes: [rows * 4],
    boxDims: [boxRows, 1],
    swizzle: TensorMapSwizzle.NONE,
  };
}

/** Encodes fp4ScaleWordsMap's map of the tensor at `address` into `map`. */
export function encodeFp4ScaleWordsMap(
  map: Uint8Array,
  address: bigint,
  k: number,
  rows: number,
  boxRows: number,
): void {
  encodeTensorMapTiled(map, { ...fp4ScaleWordsMap(k, rows, boxRows), globalAddress: address });
}
