/**
 * Launchers of the unfused MoE pipeline's small kernels (moe_unfused.cu): dispatch layout, gather,
 * SwiGLU + re-quantization and combine. Each checks its tensors (dtype, shape, device: cheap host
 * work), sets its memoized `KernelArgs` and queues one launch; none waits on the host, so a sequence
 * of them can be captured in a CUDA graph once the kernels are loaded.
 *
 * Row counts. The expert-sorted buffers are sized by an upper bound on the host (T·k rows); the real
 * count M = group_offsets[E] is read by the kernels on the device (`RowCount`), and rows past it are
 * never read or written. The grouped GEMM does the same with its group offsets.
 */

import type { ScaleFormat } from "../../config/config.js";
import { QUANT_BLOCK } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  type DeviceTensor,
  type DType,
  describeTensor,
  expectOperand,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceMemo,
  type Stream,
} from "../../cuda/index.js";
import { moeUnfusedDefines } from "./moe_unfused.variants.js";

/** The kernel source, relative to src/kernels. */
export const MOE_KERNEL_SOURCE = "unfused/moe_unfused.cu";
/** Experts the layout kernel handles (one CTA, one expert per thread in its scan; the GEMM's limit too). */
export const MOE_MAX_EXPERTS = 1024;

// Mirrors of moe_unfused.cu's constants.
const LAYOUT_THREADS = 1024;
const GATHER_ROWS = 32;
const GATHER_THREADS = 256;
const SWIGLU_THREADS = 256;
const COMBINE_THREADS = 256;
/** Resident blocks per SM the grid-stride SwiGLU kernel is sized for (38 registers: 6 fit). */
const SWIGLU_BLOCKS_PER_SM = 6;

interface Launchable {
  kernel: Kernel;
  args: KernelArgs;
}

interface MoeKernels {
  layout: Launchable;
  gather: Launchable;
  swiglu: Launchable;
  combine: Launchable;
}

const moeKernelMemo = perDeviceMemo<ScaleFormat, MoeKernels>();

/**
 * The module built for `format` on `device`, compiled (or read from the JIT cache) and loaded once.
 * Only moe_swiglu_quant depends on the format; the other kernels are taken from the fp32 build.
 */
function moeKernels(device: Device, format: ScaleFormat): MoeKernels {
  return moeKernelMemo(device, format, () => {
    const compiled = compileKernel({ source: MOE_KERNEL_SOURCE, defines: moeUnfusedDefines(format) });
    const load = (name: string, count: number): Launchable => ({
      kernel: loadKernel(device, compiled, name),
      args: new KernelArgs(count),
    });
    return {
      layout: load("moe_layout", 8),
      gather: load("moe_gather", 10),
      swiglu: load("moe_swiglu_quant", 9),
      combine: load("moe_combine", 8),
    };
  });
}

/** Compiles and loads the kernels a layer of this scale format uses (so a later forward only launches). */
export function loadMoeKernels(device: Device, format: ScaleFormat): void {
  moeKernels(device, "fp32");
  moeKernels(device, format);
}

// ---------------------------------------------------------------------------------------------------
// Checks

function expectAtLeast(
  where: string,
  what: string,
  t: DeviceTensor,
  dtype: DType,
  count: number,
  device: Device,
): void {
  if (t.dtype !== dtype || t.numel < count) {
    throw new Error(
      `${where}: ${what} must be ${dtype} with at least ${count} elements, got ${describeTensor(t.dtype, t.shape)}`,
    );
  }
  expectOperand(where, what, t, dtype, t.shape, device);
}

function positiveMultipleOf128(where: string, what: string, n: number): void {
  if (!Number.isInteger(n) || n < QUANT_BLOCK || n % QUANT_BLOCK !== 0) {
    throw new Error(`${where}: ${what} must be a positive multiple of ${QUANT_BLOCK}, got ${n}`);
  }
}

/** The device-side row count: element `index` of `offsets` (group_offsets[E] = M). */
export interface RowCount {
  offsets: DeviceTensor;
  index: number;
}

function rowCountPtr(where: string, count: RowCount | null, device: Device): bigint {
  if (count === null) return 0n;
  const { offsets, index } = count;
  if (!Number.isInteger(index) || index < 0 || index >= offsets.numel) {
    throw new Error(
      `${where}: row count index ${index} is outside ${describeTensor(offsets.dtype, offsets.shape)}`,
    );
  }
  expectAtLeast(where, "row count offsets", offsets, "int32", index + 1, device);
  return offsets.ptr + BigInt(4 * index);
}

// ---------------------------------------------------------------------------------------------------
// Dispatch layout

export interface DispatchLayoutOutputs {
  /** int32 [E + 1]: expert e owns sorted rows [offsets[e], offsets[e+1]); offsets[E] = M. */
  groupOffsets: DeviceTensor;
  /** int32, at least T·k: row_source[r] = token·k + slot of sorted row r < M. */
  rowSource: DeviceTensor;
  /** int32, at least T·k: slot_row[token·k + slot] = its sorted row, −1 when not routed. */
  slotRow: DeviceTensor;
  /** int32 [2], set to {0, T} (the shared expert's single group), or null. */
  sharedOffsets: DeviceTensor | null;
}

/**
 * Queues the dispatch layout of routing ids int32 [T, k] among `experts` experts (ids outside [0, E),
 * −1 among them, are not routed). One CTA; the order of rows inside an expert's range is arbitrary.
 */
export function dispatchLayoutOnDevice(
  device: Device,
  ids: DeviceTensor,
  experts: number,
  out: DispatchLayoutOutputs,
  stream: Stream | null,
): void {
  const where = "dispatchLayoutOnDevice";
  if (ids.shape.length !== 2)
    throw new Error(`${where}: ids must be int32[tokens, k], got ${describeTensor(ids.dtype, ids.shape)}`);
  const [tokens, topK] = ids.shape as [number, number];
  if (!Number.isInteger(experts) || experts < 1 || experts > MOE_MAX_EXPERTS) {
    throw new Error(`${where}: experts must be an integer in [1, ${MOE_MAX_EXPERTS}], got ${experts}`);
  }
  expectOperand(where, "ids", ids, "int32", [tokens, topK], device);
  expectOperand(where, "groupOffsets", out.groupOffsets, "int32", [experts + 1], device);
  expectAtLeast(where, "rowSource", out.rowSource, "int32", tokens * topK, device);
  expectAtLeast(where, "slotRow", out.slotRow, "int32", tokens * topK, device);
  if (out.sharedOffsets !== null)
    expectOperand(where, "sharedOffsets", out.sharedOffsets, "int32", [2], device);
  const k = moeKernels(device, "fp32").layout;
  k.args
    .ptr(0, ids.ptr)
    .i32(1, tokens)
    .i32(2, topK)
    .i32(3, experts)
    .ptr(4, out.groupOffsets.ptr)
    .ptr(5, out.rowSource.ptr)
    .ptr(6, out.slotRow.ptr)
    .ptr(7, out.sharedOffsets?.ptr ?? 0n);
  k.kernel.launch(1, LAYOUT_THREADS, 0, stream, k.args);
}

// ---------------------------------------------------------------------------------------------------
// Gather

export interface GatherArgs {
  /** e4m3 [T, H] and fp32 [T, H/128]: the quantized token rows. */
  xq: DeviceTensor;
  xScales: DeviceTensor;
  /** int32 (≥ rows): token·k + slot of each destination row; null: destination row r is token r. */
  rowSource: DeviceTensor | null;
  topK: number;
  /** Destination rows on the host: the upper bound the buffers are laid out for. */
  rows: number;
  /** The real row count on the device (rows past it are left alone); null: all `rows`. */
  rowCount: RowCount | null;
  /** e4m3 [rows, H] to copy the rows into, or null for the scales alone. */
  aq: DeviceTensor | null;
  /** fp32 [H/128, aScalesRows(rows)]: the GEMM's transposed scale layout. */
  aScales: DeviceTensor;
}

/**
 * Queues the gather of quantized token rows into expert-sorted rows (copies of the FP8 row and its
 * scales, transposed for the GEMM). With rowSource null and aq null it is the scales-only transpose
 * of the unsorted rows that the shared expert's GEMM reads.
 */
export function gatherRowsOnDevice(device: Device, g: GatherArgs, stream: Stream | null): void {
  const where = "gatherRowsOnDevice";
  if (g.xq.shape.length !== 2)
    throw new Error(
      `${where}: xq must be fp8_e4m3[tokens, hidden], got ${describeTensor(g.xq.dtype, g.xq.shape)}`,
    );
  const [tokens, hidden] = g.xq.shape as [number, number];
  positiveMultipleOf128(where, "hidden", hidden);
  if (!Number.isInteger(g.rows) || g.rows < 0)
    throw new Error(`${where}: rows must be a non-negative integer, got ${g.rows}`);
  if (!Number.isInteger(g.topK) || g.topK < 1)
    throw new Error(`${where}: topK must be a positive integer, got ${g.topK}`);
  const kb = hidden / QUANT_BLOCK;
  const pad = aScalesPad(g.aScales, kb, where);
  expectOperand(where, "xq", g.xq, "fp8_e4m3", [tokens, hidden], device);
  expectOperand(where, "xScales", g.xScales, "fp32", [tokens, kb], device);
  if (g.rowSource !== null) expectAtLeast(where, "rowSource", g.rowSource, "int32", g.rows, device);
  else if (g.rows > tokens)
    throw new Error(`${where}: ${g.rows} rows without rowSource exceed the ${tokens} tokens`);
  if (g.aq !== null) expectOperand(where, "aq", g.aq, "fp8_e4m3", [g.rows, hidden], device);
  if (pad < g.rows) throw new Error(`${where}: aScales has ${pad} columns for ${g.rows} rows`);
  const rowsPtr = rowCountPtr(where, g.rowCount, device);
  if (g.rows === 0) return;
  const k = moeKernels(device, "fp32").gather;
  k.args
    .ptr(0, g.xq.ptr)
    .ptr(1, g.xScales.ptr)
    .ptr(2, g.rowSource?.ptr ?? 0n)
    .ptr(3, rowsPtr)
    .i32(4, g.topK)
    .i32(5, hidden)
    .i32(6, g.rows)
    .i32(7, pad)
    .ptr(8, g.aq?.ptr ?? 0n)
    .ptr(9, g.aScales.ptr);
  k.kernel.launch(Math.ceil(g.rows / GATHER_ROWS), GATHER_THREADS, 0, stream, k.args);
}

/** Columns of a [blocks, M_pad] scale tensor, checked. */
function aScalesPad(t: DeviceTensor, blocks: number, where: string): number {
  if (t.dtype !== "fp32" || t.shape.length !== 2 || t.shape[0] !== blocks || t.shape[1]! % 4 !== 0) {
    throw new Error(
      `${where}: scales must be fp32[${blocks}, M_pad] with M_pad a multiple of 4, got ${describeTensor(t.dtype, t.shape)}`,
    );
  }
  return t.shape[1]!;
}

// ---------------------------------------------------------------------------------------------------
// SwiGLU + re-quantization

export interface SwigluArgs {
  /** fp32 [rows, 2·I]: the L1 output, gate columns 0..I−1, up columns I..2I−1. */
  l1: DeviceTensor;
  /** Upper bound of the rows (the buffers' layout). */
  rows: number;
  /** The real row count on the device; null: all `rows`. */
  rowCount: RowCount | null;
  /** SwiGLU clamp c, or null for none. */
  clamp: number | null;
  format: ScaleFormat;
  /** e4m3 [rows, I] and fp32 [I/128, aScalesRows(rows)] (the GEMM's transposed scale layout). */
  hq: DeviceTensor;
  hScales: DeviceTensor;
}

/** Queues h = SwiGLU(L1) and its quantization to FP8 rows with per-128 scales (docs/numerics.md). */
export function swigluQuantizeOnDevice(device: Device, s: SwigluArgs, stream: Stream | null): void {
  const where = "swigluQuantizeOnDevice";
  if (s.l1.shape.length !== 2)
    throw new Error(`${where}: l1 must be fp32[rows, 2·I], got ${describeTensor(s.l1.dtype, s.l1.shape)}`);
  const inter = s.l1.shape[1]! / 2;
  positiveMultipleOf128(where, "I", inter);
  if (s.clamp !== null && !(Number.isFinite(s.clamp) && s.clamp > 0)) {
    throw new Error(`${where}: clamp must be a positive finite number or null, got ${s.clamp}`);
  }
  expectOperand(where, "l1", s.l1, "fp32", [s.rows, 2 * inter], device);
  expectOperand(where, "hq", s.hq, "fp8_e4m3", [s.rows, inter], device);
  const pad = aScalesPad(s.hScales, inter / QUANT_BLOCK, where);
  if (pad < s.rows) throw new Error(`${where}: hScales has ${pad} columns for ${s.rows} rows`);
  const rowsPtr = rowCountPtr(where, s.rowCount, device);
  if (s.rows === 0) return;
  const k = moeKernels(device, s.format).swiglu;
  k.args
    .ptr(0, s.l1.ptr)
    .ptr(1, rowsPtr)
    .i32(2, s.rows)
    .i32(3, inter)
    .i32(4, pad)
    .i32(5, s.clamp === null ? 0 : 1)
    .f32(6, s.clamp ?? 0)
    .ptr(7, s.hq.ptr)
    .ptr(8, s.hScales.ptr);
  // One warp per (row, group); a grid-stride loop over what is resident at once.
  const warps = s.rows * (inter / QUANT_BLOCK);
  const blocks = Math.min(Math.ceil(warps / (SWIGLU_THREADS / 32)), SWIGLU_BLOCKS_PER_SM * device.smCount);
  k.kernel.launch(Math.max(1, blocks), SWIGLU_THREADS, 0, stream, k.args);
}

// ---------------------------------------------------------------------------------------------------
// Combine

export interface CombineArgs {
  /** bf16 [rows, H]: the routed L2 output, in sorted-row order. */
  l2: DeviceTensor;
  /** int32 (≥ T·k): sorted row of each (token, slot), −1 when not routed. */
  slotRow: DeviceTensor;
  /** fp32 [T, k]: routing weights. */
  weights: DeviceTensor;
  /** bf16 [T, H]: the shared expert's L2 output, or null without it. */
  sharedOut: DeviceTensor | null;
  /** bf16 [T, H]. */
  out: DeviceTensor;
}

/** Queues out[t] = bf16(Σ_slots w · L2[row of slot] in slot order + shared[t]) (docs/numerics.md). */
export function combineOnDevice(device: Device, c: CombineArgs, stream: Stream | null): void {
  const where = "combineOnDevice";
  if (c.out.shape.length !== 2 || c.weights.shape.length !== 2) {
    throw new Error(`${where}: out must be bf16[tokens, hidden] and weights fp32[tokens, k]`);
  }
  const [tokens, hidden] = c.out.shape as [number, number];
  const topK = c.weights.shape[1]!;
  positiveMultipleOf128(where, "hidden", hidden);
  expectOperand(where, "out", c.out, "bf16", [tokens, hidden], device);
  expectOperand(where, "weights", c.weights, "fp32", [tokens, topK], device);
  expectAtLeast(where, "slotRow", c.slotRow, "int32", tokens * topK, device);
  if (c.l2.dtype !== "bf16" || c.l2.shape.length !== 2 || c.l2.shape[1] !== hidden) {
    throw new Error(
      `${where}: l2 must be bf16[rows, ${hidden}], got ${describeTensor(c.l2.dtype, c.l2.shape)}`,
    );
  }
  expectOperand(where, "l2", c.l2, "bf16", c.l2.shape, device);
  if (c.sharedOut !== null) expectOperand(where, "sharedOut", c.sharedOut, "bf16", [tokens, hidden], device);
  if (tokens === 0) return;
  const k = moeKernels(device, "fp32").combine;
  k.args
    .ptr(0, c.l2.ptr)
    .ptr(1, c.slotRow.ptr)
    .ptr(2, c.weights.ptr)
    .ptr(3, c.sharedOut?.ptr ?? 0n)
    .i32(4, tokens)
    .i32(5, topK)
    .i32(6, hidden)
    .ptr(7, c.out.ptr);
  k.kernel.launch(Math.ceil((tokens * (hidden / 8)) / COMBINE_THREADS), COMBINE_THREADS, 0, stream, k.args);
}
