/** TMA tensor maps: validating and encoding tiled descriptors. */

import { check, cu, requireCuda } from "./driver-api.js";
import {
  TensorMapInterleave,
  TensorMapL2Promotion,
  TensorMapOobFill,
  TensorMapSwizzle,
} from "./driver-constants.js";
import { koffi } from "./ffi.js";

/** Element size in bytes of each tensor-map data type. */
const TENSOR_MAP_ELEMENT_BYTES: Record<number, number> = {
  0: 1,
  1: 2,
  2: 4,
  3: 4,
  4: 8,
  5: 8,
  6: 2,
  7: 4,
  8: 8,
  9: 2,
  10: 4,
  11: 4,
  12: 4,
};

/** Description of a tiled tensor map (dimension 0 is the innermost, contiguous one). */
export interface TensorMapTiledDesc {
  /** A {@link TensorMapDataType} value. */
  dataType: number;
  /** Device address of element (0, 0, ...); 16-byte aligned. */
  globalAddress: bigint;
  /** Size of each dimension in elements, innermost first (1 to 5 dims). */
  globalDims: readonly number[];
  /** Byte stride of dimensions 1..rank-1 (rank-1 values; multiples of 16). */
  globalStridesBytes: readonly number[];
  /** Box (tile) size in elements per dimension, each 1..256. */
  boxDims: readonly number[];
  /** Traversal step per dimension (default all 1). */
  elementStrides?: readonly number[];
  interleave?: number;
  swizzle?: number;
  l2Promotion?: number;
  oobFill?: number;
}

/**
 * Check a tensor-map description against the driver's documented rules; returns the list of problems
 * (empty when valid). Pure: usable without a GPU.
 */
export function tensorMapTiledProblems(desc: TensorMapTiledDesc): string[] {
  const problems: string[] = [];
  const rank = desc.globalDims.length;
  const elementBytes = TENSOR_MAP_ELEMENT_BYTES[desc.dataType];
  const interleave = desc.interleave ?? TensorMapInterleave.NONE;
  const swizzle = desc.swizzle ?? TensorMapSwizzle.NONE;
  if (elementBytes === undefined) problems.push(`unknown dataType ${desc.dataType}`);
  if (rank < 1 || rank > 5) problems.push(`rank ${rank} is not in 1..5`);
  if (interleave !== TensorMapInterleave.NONE && rank < 3) problems.push("interleaved maps need rank >= 3");
  const addressAlign = interleave === TensorMapInterleave.B32 ? 32n : 16n;
  if (desc.globalAddress % addressAlign !== 0n) {
    problems.push(`globalAddress 0x${desc.globalAddress.toString(16)} is not ${addressAlign}-byte aligned`);
  }
  desc.globalDims.forEach((d, i) => {
    if (!Number.isInteger(d) || d < 1 || d > 2 ** 32)
      problems.push(`globalDims[${i}] = ${d} is not in 1..2^32`);
  });
  if (desc.globalStridesBytes.length !== Math.max(rank - 1, 0)) {
    problems.push(
      `globalStridesBytes has ${desc.globalStridesBytes.length} entries, expected rank-1 = ${rank - 1}`,
    );
  }
  const strideAlign = interleave === TensorMapInterleave.B32 ? 32 : 16;
  desc.globalStridesBytes.forEach((s, i) => {
    if (!Number.isInteger(s) || s <= 0 || s % strideAlign !== 0 || s >= 2 ** 40) {
      problems.push(
        `globalStridesBytes[${i}] = ${s} is not a positive multiple of ${strideAlign} below 2^40`,
      );
    }
  });
  if (desc.boxDims.length !== rank)
    problems.push(`boxDims has ${desc.boxDims.length} entries, expected ${rank}`);
  desc.boxDims.forEach((b, i) => {
    if (!Number.isInteger(b) || b < 1 || b > 256) problems.push(`boxDims[${i}] = ${b} is not in 1..256`);
  });
  const elementStrides = desc.elementStrides ?? [];
  if (desc.elementStrides && elementStrides.length !== rank) {
    problems.push(`elementStrides has ${elementStrides.length} entries, expected ${rank}`);
  }
  elementStrides.forEach((e, i) => {
    if (!Number.isInteger(e) || e < 1 || e > 8) problems.push(`elementStrides[${i}] = ${e} is not in 1..8`);
  });
  if (elementBytes !== undefined && desc.boxDims.length > 0 && interleave === TensorMapInterleave.NONE) {
    const innerBytes = desc.boxDims[0]! * elementBytes;
    if (innerBytes % 16 !== 0) problems.push(`inner box ${innerBytes} bytes is not a multiple of 16`);
    const span =
      swizzle === TensorMapSwizzle.B32 ? 32 : swizzle === TensorMapSwizzle.B64 ? 64 : swizzle >= 3 ? 128 : 0;
    if (span > 0 && innerBytes > span)
      problems.push(`inner box ${innerBytes} bytes exceeds the ${span}-byte swizzle span`);
  }
  if (interleave === TensorMapInterleave.B32 && swizzle !== TensorMapSwizzle.B32) {
    problems.push("32-byte interleave requires 32-byte swizzle");
  }
  return problems;
}

/**
 * Encode a tiled TMA descriptor into `out` (128 bytes, 64-byte aligned at least: a `KernelArgs.tensorMap(i)` slot
 * or `allocTensorMapBytes()`). The description is validated first so mistakes read as sentences
 * rather than CUDA_ERROR_INVALID_VALUE.
 */
export function encodeTensorMapTiled(out: Uint8Array, desc: TensorMapTiledDesc): void {
  requireCuda();
  if (out.byteLength !== 128)
    throw new RangeError(`tensor map buffer must be 128 bytes, got ${out.byteLength}`);
  if (koffi().address(out) % 64n !== 0n) throw new RangeError("tensor map buffer must be 64-byte aligned");
  const problems = tensorMapTiledProblems(desc);
  if (problems.length > 0) throw new RangeError(`invalid tensor map: ${problems.join("; ")}`);
  const rank = desc.globalDims.length;
  const dims = BigUint64Array.from(desc.globalDims, (d) => BigInt(d));
  const strides = new BigUint64Array(Math.max(rank - 1, 1));
  desc.globalStridesBytes.forEach((s, i) => {
    strides[i] = BigInt(s);
  });
  const box = Uint32Array.from(desc.boxDims);
  const elementStrides = Uint32Array.from(desc.elementStrides ?? desc.boxDims.map(() => 1));
  check(
    "cuTensorMapEncodeTiled",
    cu.cuTensorMapEncodeTiled(
      out,
      desc.dataType,
      rank,
      desc.globalAddress,
      dims,
      strides,
      box,
      elementStrides,
      desc.interleave ?? TensorMapInterleave.NONE,
      desc.swizzle ?? TensorMapSwizzle.NONE,
      desc.l2Promotion ?? TensorMapL2Promotion.NONE,
      desc.oobFill ?? TensorMapOobFill.NONE,
    ),
    `dims [${desc.globalDims.join(", ")}], box [${desc.boxDims.join(", ")}]`,
  );
}
