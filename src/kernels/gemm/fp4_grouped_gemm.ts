/**
 * Launcher of the grouped GEMM with FP4 (MXFP4) weights: the B_FP4 build of fp8_grouped_gemm.cu
 * (kernel megamoe_fp4_grouped_gemm). The rule is docs/numerics.md "FP4 experts (MXFP4)": each weight
 * row's 128-deep K block becomes e4m3 codes relative to its 128 × 128 block's reference ref = R − 133 (R
 * the block's largest UE8M0 byte) and
 *
 *   out[r, n] = acc over K blocks b of fmaf(fp32(P_b(r, n)), fp32(sa[b, r] · 2^ref[n / 128, b]), acc)
 *
 * for every row r of group g, P_b the block's sum of e4m3 products (tensor cores, fp32).
 *
 * Layouts (row-major): a e4m3 [M, K] and aScales fp32 [K/128, M_pad] as for FP8; b uint8 [G·N, K/2]
 * (or [G, N, K/2]) bytes holding the packed e2m1 codes in the device layout (the load-time transform of
 * the stored bytes, element 2j in the low nibble of byte j, into each group's [K/128, N, 64 bytes]:
 * `mxfp4DeviceLayout(b, N, K)` on the host or `orderFp4PackedOnDevice` of [G, N, K/2] in place;
 * docs/numerics.md); bScales
 * uint8 [K/128, G·N·4]: the load-time transform of the UE8M0 bytes [G·N, K/32] (`fp4GemmScaleWords`):
 * row n's four bytes of K block b, contiguous, at (b, 4n), so that a K block's scales of a tile's rows are
 * one TMA box (the promotion's block scale 2^ref comes from the word of the block's first row: every row
 * of a block carries its R); groupOffsets int32 [G+1]; out fp32 or bf16 [M, N].
 */

import { QUANT_BLOCK } from "../../config/config.js";
import {
  type Device,
  type DeviceTensor,
  expectTensor,
  type Stream,
  type TensorLike,
} from "../../cuda/index.js";
import { E8M0_NAN, fp4ReferenceScale, MXFP4_GROUP, mxfp4ReferenceWords } from "../../numerics/fp4.js";
import {
  encodeFp4LayoutMap,
  encodeFp4ScaleWordsMap,
  encodeFp8RowsMap,
  encodeScaleColumnsMap,
} from "../tensor-maps.js";
import { FP4_GEMM_TILE_NAMES } from "./fp8_grouped_gemm.variants.js";
import {
  aScalesRows,
  checkGemmOperandsOn,
  FP4_WORDS_ARG,
  type GemmKernel,
  type GroupedGemmArgs,
  launchGemmReference,
  launchGroupedGemm,
  loadGemmKernel,
  planGroupedGemmOn,
} from "./grouped_gemm.js";
import { checkGroupedGemmProblem, type GemmOutDtype, type GroupedGemmPlan } from "./plan.js";

export const FP4_GROUPED_GEMM_KERNEL = "megamoe_fp4_grouped_gemm";
/** The CPU rule on CUDA cores (exact conversion, block sums in double): bit-identical to the CPU reference. */
export const FP4_GROUPED_GEMM_REFERENCE_KERNEL = "megamoe_fp4_grouped_gemm_reference";

// ---------------------------------------------------------------------------------------------------
// The load-time transform of the scales

/**
 * UE8M0 bytes [rows, K/32] (row-major, as MXFP4 weights store them, one matrix: its 128-row blocks
 * from row 0) → the kernels' [K/128, rows·4]: row n's K block b as its reference word
 * (mxfp4ReferenceWords, docs/numerics.md) at (b, 4n .. 4n + 3), little-endian. Throws naming the row
 * and K group of a 0xFF (NaN) byte: the kernels assume none.
 */
export function fp4GemmScaleWords(scales: Uint8Array, rows: number, k: number): Uint8Array {
  if (!(Number.isInteger(rows) && rows >= 0 && Number.isInteger(k) && k > 0 && k % QUANT_BLOCK === 0)) {
    throw new RangeError(`fp4GemmScaleWords: rows ≥ 0 and k a positive multiple of 128, got ${rows}×${k}`);
  }
  const groups = k / MXFP4_GROUP;
  if (scales.length !== rows * groups) {
    throw new RangeError(`fp4GemmScaleWords: ${scales.length} scale bytes do not fit [${rows}, ${groups}]`);
  }
  const nan = scales.indexOf(E8M0_NAN);
  if (nan >= 0) {
    throw new RangeError(
      `fp4GemmScaleWords: UE8M0 scale byte 0xFF (NaN) at row ${Math.floor(nan / groups)}, K group ${nan % groups}`,
    );
  }
  const kBlocks = k / QUANT_BLOCK;
  const out = new Uint8Array(scales.length);
  if (rows === 0) return out;
  const words = mxfp4ReferenceWords(scales, rows, k);
  const view = new DataView(out.buffer);
  for (let n = 0; n < rows; n++) {
    for (let b = 0; b < kBlocks; b++) view.setUint32((b * rows + n) * 4, words[n * kBlocks + b], true);
  }
  return out;
}

/**
 * Each 128 × 128 block's fp32 scale 2^(R − 133), [⌈rows/128⌉, K/128] (what fp4BlockScales gives), read from
 * the reference words fp4GemmScaleWords made of one matrix: every row of a block carries the block's R in
 * its word's low byte, so a block's first row speaks for it.
 */
export function fp4GemmBlockScales(words: Uint8Array, rows: number, k: number): Float32Array {
  const kBlocks = k / QUANT_BLOCK;
  if (words.length !== rows * kBlocks * 4) {
    throw new RangeError(`fp4GemmBlockScales: ${words.length} word bytes do not fit [${kBlocks}, ${rows}·4]`);
  }
  const blocks = Math.ceil(rows / QUANT_BLOCK);
  const out = new Float32Array(blocks * kBlocks);
  for (let r = 0; r < blocks; r++) {
    for (let b = 0; b < kBlocks; b++) {
      out[r * kBlocks + b] = fp4ReferenceScale(words[(b * rows + r * QUANT_BLOCK) * 4]!);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
// Arguments

/**
 * The FP8 grouped GEMM's operands, with B as FP4: `b` uint8 [G·N, K/2] or [G, N, K/2] (packed e2m1 in
 * the device layout: mxfp4DeviceLayout / orderFp4PackedOnDevice) and `bScales` uint8 [K/128, G·N·4]
 * (fp4GemmScaleWords: what the converters read, and where the promotion's block scales come from);
 * `tile` one of FP4_GEMM_TILE_NAMES.
 */
export type GroupedGemmFp4Args<T extends TensorLike = DeviceTensor> = GroupedGemmArgs<T>;

/** Checks dtypes and shapes; returns the output dtype. Pure: usable without a GPU. */
export function validateGroupedGemmFp4Args(args: GroupedGemmFp4Args<TensorLike>): GemmOutDtype {
  const { mTotal, n, k, groups } = args;
  checkGroupedGemmProblem({ mTotal, n, k, groups, expectedRowsPerGroup: args.expectedRowsPerGroup });
  const kb = k / QUANT_BLOCK;
  const where = "groupedGemmFp4";
  expectTensor(where, "a", args.a, ["fp8_e4m3"], [[mTotal, k]]);
  expectTensor(where, "aScales", args.aScales, ["fp32"], [[kb, aScalesRows(mTotal)]]);
  expectTensor(
    where,
    "b",
    args.b,
    ["uint8"],
    [
      [groups * n, k / 2],
      [groups, n, k / 2],
    ],
  );
  expectTensor(where, "bScales", args.bScales, ["uint8"], [[kb, groups * n * 4]]);
  expectTensor(where, "groupOffsets", args.groupOffsets, ["int32"], [[groups + 1]]);
  expectTensor(where, "out", args.out, ["fp32", "bf16"], [[mTotal, n]]);
  if (args.maxCtas !== undefined && !(Number.isInteger(args.maxCtas) && args.maxCtas >= 1)) {
    throw new Error(`${where}: maxCtas must be a positive integer, got ${args.maxCtas}`);
  }
  if (args.tile !== undefined && !FP4_GEMM_TILE_NAMES.includes(args.tile)) {
    throw new Error(`${where}: tile "${args.tile}" has no FP4 build (${FP4_GEMM_TILE_NAMES.join(", ")})`);
  }
  return args.out.dtype === "bf16" ? "bf16" : "fp32";
}

// ---------------------------------------------------------------------------------------------------
// Kernels

function kernelFor(device: Device, plan: GroupedGemmPlan): GemmKernel {
  return loadGemmKernel(device, plan, FP4_GROUPED_GEMM_KERNEL, FP4_GROUPED_GEMM_REFERENCE_KERNEL);
}

function encodeMaps(entry: GemmKernel, plan: GroupedGemmPlan, args: GroupedGemmFp4Args): void {
  const { mTotal, n, k, groups } = args;
  const mapsKey = `${args.a.ptr}:${args.b.ptr}:${args.aScales.ptr}:${args.bScales.ptr}:${mTotal}`;
  if (entry.mapsKey === mapsKey) return;
  entry.mapsKey = "";
  const { blockM, blockN } = plan.tile;
  const rows = groups * n;
  encodeFp8RowsMap(entry.args.tensorMap(0), args.a.ptr, k, mTotal, blockM);
  encodeFp4LayoutMap(entry.args.tensorMap(1), args.b.ptr, k, rows, blockN);
  encodeScaleColumnsMap(entry.args.tensorMap(2), args.aScales.ptr, k, aScalesRows(mTotal), blockM + 4);
  encodeFp4ScaleWordsMap(entry.args.tensorMap(3), args.bScales.ptr, k, rows, blockN);
  entry.mapsKey = mapsKey;
}

// ---------------------------------------------------------------------------------------------------
// Launch

/**
 * Queues out = the FP4 grouped GEMM on `stream` (null: the legacy default stream); returns the plan.
 * mTotal = 0 queues nothing. A stalled pipeline shows in `takeGroupedGemmStatus` (shared with FP8).
 */
export function groupedGemmFp4(
  device: Device,
  args: GroupedGemmFp4Args,
  stream: Stream | null,
): GroupedGemmPlan {
  const outDtype = validateGroupedGemmFp4Args(args);
  checkGemmOperandsOn("groupedGemmFp4", device, args);
  const plan = planGroupedGemmOn(device, args, outDtype, "fp4");
  if (args.mTotal === 0) return plan;
  const entry = kernelFor(device, plan);
  encodeMaps(entry, plan, args);
  entry.args.ptr(FP4_WORDS_ARG, args.bScales.ptr);
  launchGroupedGemm(device, entry.kernel, entry.args, plan, args, stream);
  return plan;
}

/**
 * The CPU rule on CUDA cores with the same operands (slow; bit-identical to the CPU reference on any
 * data): the oracle for every row on large problems, and a way to tell an operand-layout fault (both
 * wrong) from a fault of the fast path (only it wrong).
 */
export function groupedGemmFp4Reference(
  device: Device,
  args: GroupedGemmFp4Args,
  stream: Stream | null,
): void {
  const outDtype = validateGroupedGemmFp4Args(args);
  checkGemmOperandsOn("groupedGemmFp4Reference", device, args);
  if (args.mTotal === 0) return;
  launchGemmReference(kernelFor(device, planGroupedGemmOn(device, args, outDtype, "fp4")), args, stream);
}
