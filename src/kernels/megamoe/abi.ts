/**
 * The fused kernel's ABI as the host sees it: the `Operands` struct it takes by value (mirrors
 * megamoe_layout.cuh, whose static_asserts pin the offsets), the buffers a layer's kernel owns besides
 * its weights, and the tensor maps of one specialization, each named by the buffer it reads. The Node
 * launcher (megamoe.ts) and the export (src/export/) both build their launches from these, so a runtime
 * that executes an export launches exactly what Node launches. No CUDA here.
 */
import { expertFormatOf, type MoEConfig, QUANT_BLOCK, sharedIntermediate } from "../../config/config.js";
import { aScalesRows } from "../gemm/grouped_gemm.js";
import {
  fp4LayoutMap,
  fp4ScaleWordsMap,
  fp8RowsMap,
  scaleColumnsMap,
  type TensorMapShape,
} from "../tensor-maps.js";
import { FUSED_BLOCK_MS, FUSED_BLOCK_N, FUSED_COUNTER_WORDS, type FusedBlockM } from "./megamoe.variants.js";

/** megamoe_layout.cuh's `Operands`: 19 pointers (in this order), then 5 int32 and 1 float. */
export const FUSED_OPERAND_POINTERS = [
  "xq",
  "x_scales",
  "ids",
  "weights",
  "w1_scales",
  "w2_scales",
  "w1s_scales",
  "w2s_scales",
  "pool_x",
  "pool_x_scales",
  "pool_h",
  "pool_h_scales",
  "y",
  "slot_row",
  "out",
  "workspace",
  "status",
  "trace",
  "images",
] as const;
export type FusedOperandPointer = (typeof FUSED_OPERAND_POINTERS)[number];
export const FUSED_OPERAND_SCALARS = [
  { name: "tokens", kind: "i32" },
  { name: "r_pad", kind: "i32" },
  { name: "max_blocks", kind: "i32" },
  { name: "use_shared", kind: "i32" },
  { name: "has_clamp", kind: "i32" },
  { name: "clamp", kind: "f32" },
] as const;
export type FusedOperandScalar = (typeof FUSED_OPERAND_SCALARS)[number]["name"];

/** Byte offset of a field of `Operands`. */
export function fusedOperandOffset(name: FusedOperandPointer | FusedOperandScalar): number {
  const p = FUSED_OPERAND_POINTERS.indexOf(name as FusedOperandPointer);
  if (p >= 0) return 8 * p;
  const s = FUSED_OPERAND_SCALARS.findIndex((f) => f.name === name);
  return 8 * FUSED_OPERAND_POINTERS.length + 4 * s;
}
export const FUSED_OPERANDS_BYTES = 8 * FUSED_OPERAND_POINTERS.length + 4 * FUSED_OPERAND_SCALARS.length;

/** Tensor maps before the operands: 8, and 2 more (the routed experts' UE8M0 words) with FP4 experts. */
export function fusedMapCount(c: MoEConfig): number {
  return expertFormatOf(c) === "fp4" ? 10 : 8;
}

/**
 * The names of a layer's device weights as the fused kernel reads them (DeviceMoEWeights' tensors;
 * an export's weight buffers). FP8 routed experts: `routed_w1` e4m3 [E, 2I, H], `routed_w1_scales` fp32
 * [E, 2I/128, H/128], `routed_w2`, `routed_w2_scales`. FP4: `routed_w1` and `routed_w2` packed in the
 * device layout, `routed_w1_words` and `routed_w2_words` their reference words, `routed_w1_scales` and
 * `routed_w2_scales` each 128 × 128 block's fp32 scale. The shared expert: `shared_expert_w1`, … as FP8.
 */
export type FusedWeightBuffer =
  | "routed_w1"
  | "routed_w1_scales"
  | "routed_w1_words"
  | "routed_w2"
  | "routed_w2_scales"
  | "routed_w2_words"
  | "shared_expert_w1"
  | "shared_expert_w1_scales"
  | "shared_expert_w2"
  | "shared_expert_w2_scales";

/** The kernel's own buffers (besides the pipeline's FP8 rows and the weights). */
export type FusedOwnBuffer =
  | "pool_x"
  | "pool_x_scales"
  | "pool_h"
  | "pool_h_scales"
  | "y"
  | "slot_row"
  | "workspace"
  | "status"
  | "images";

export type FusedBufferDtype = "fp8_e4m3" | "fp32" | "bf16" | "int32";

export interface FusedBufferSpec {
  name: FusedOwnBuffer;
  dtype: FusedBufferDtype;
  shape: number[];
  /** The value every element holds before the first launch: the counters must be zero. */
  init: "none" | "zero";
}

/** What sizes a layer's fused kernel: the rows of its pools and the bound on its row blocks. */
export interface FusedSizes {
  /** Experts the kernel holds (an EP rank's E / R). */
  experts: number;
  /** Pool rows: T·k routed + T for the shared expert (EP: the layout's R·T·min(k, E/R) + T). */
  poolRows: number;
  /** The transposed scale columns' padded rows (aScalesRows of the pool's rows). */
  rPad: number;
  maxBlocks: number;
  hasShared: boolean;
}

/** The sizes of the one-rank kernel of `c` for up to `maxTokens` tokens. */
export function fusedSizes(c: MoEConfig, maxTokens: number, hasShared: boolean): FusedSizes {
  const poolRows = maxTokens * c.topK + (hasShared ? maxTokens : 0);
  return fusedSizesOf(c.numExperts, poolRows, hasShared);
}

/** The sizes from the experts and pool rows (the EP build's come from its layout). */
export function fusedSizesOf(experts: number, poolRows: number, hasShared: boolean): FusedSizes {
  return {
    experts,
    poolRows,
    rPad: aScalesRows(poolRows),
    maxBlocks: Math.ceil(poolRows / Math.min(...FUSED_BLOCK_MS)) + experts + 1,
    hasShared,
  };
}

/** The widest intermediate a pool row holds: the routed experts' or the shared expert's. */
function maxIntermediate(c: MoEConfig): number {
  return Math.max(c.intermediate, sharedIntermediate(c));
}

/**
 * The kernel's buffers for `maxTokens` tokens: the row pools, the slot map, the counters (zero: the
 * last CTA out re-zeroes them) and the watchdog's status words. The FP4 expand variant's stage images
 * are `fusedExpandImageBytes` more (megamoe.variants.ts), allocated with the first specialization that
 * expands.
 */
export function fusedBuffers(c: MoEConfig, maxTokens: number, s: FusedSizes): FusedBufferSpec[] {
  const H = c.hidden;
  const maxInter = maxIntermediate(c);
  const E = s.experts;
  return [
    { name: "pool_x", dtype: "fp8_e4m3", shape: [s.poolRows, H], init: "none" },
    { name: "pool_x_scales", dtype: "fp32", shape: [H / QUANT_BLOCK, s.rPad], init: "none" },
    { name: "pool_h", dtype: "fp8_e4m3", shape: [s.poolRows, maxInter], init: "none" },
    { name: "pool_h_scales", dtype: "fp32", shape: [maxInter / QUANT_BLOCK, s.rPad], init: "none" },
    { name: "y", dtype: "bf16", shape: [s.poolRows, H], init: "none" },
    { name: "slot_row", dtype: "int32", shape: [maxTokens * c.topK], init: "none" },
    // Counters, counts and cursors per group, arrivals and L1 publications per block, expanded chunks
    // per expert and matrix (megamoe_layout.cuh).
    {
      name: "workspace",
      dtype: "int32",
      shape: [FUSED_COUNTER_WORDS + 2 * (E + 1) + 2 * s.maxBlocks + 2 * E],
      init: "zero",
    },
    { name: "status", dtype: "int32", shape: [4], init: "zero" },
  ];
}

/** One tensor map argument: the buffer it reads (at its start) and the map's shape. */
export interface FusedTensorMap {
  buffer: FusedOwnBuffer | FusedWeightBuffer;
  shape: TensorMapShape;
}

const WEIGHT_BOX_ROWS = FUSED_BLOCK_N / 2;

/**
 * The tensor maps of the specialization with `blockM`-row tiles, in argument order. The row pools'
 * boxes hold one tile's rows (a taller box would overrun the stage); a weight box is one of a tile's two
 * B boxes. Without a shared expert maps 3 and 7 are never read: the routed FP8 weights stand in, and
 * with FP4 experts the pool of rows.
 */
export function fusedTensorMaps(c: MoEConfig, blockM: FusedBlockM, s: FusedSizes): FusedTensorMap[] {
  const H = c.hidden;
  const I = c.intermediate;
  const E = s.experts;
  const maxInter = maxIntermediate(c);
  const fp4 = expertFormatOf(c) === "fp4";
  const maps: FusedTensorMap[] = [
    { buffer: "pool_x", shape: fp8RowsMap(H, s.poolRows, blockM) },
    { buffer: "pool_x_scales", shape: scaleColumnsMap(H, s.rPad, blockM + 4) },
    fp4
      ? { buffer: "routed_w1", shape: fp4LayoutMap(H, E * 2 * I, WEIGHT_BOX_ROWS) }
      : { buffer: "routed_w1", shape: fp8RowsMap(H, E * 2 * I, WEIGHT_BOX_ROWS) },
    { buffer: "pool_x", shape: fp8RowsMap(H, s.poolRows, WEIGHT_BOX_ROWS) }, // the shared W1, below
    { buffer: "pool_h", shape: fp8RowsMap(maxInter, s.poolRows, blockM) },
    { buffer: "pool_h_scales", shape: scaleColumnsMap(maxInter, s.rPad, blockM + 4) },
    fp4
      ? { buffer: "routed_w2", shape: fp4LayoutMap(I, E * H, WEIGHT_BOX_ROWS) }
      : { buffer: "routed_w2", shape: fp8RowsMap(I, E * H, WEIGHT_BOX_ROWS) },
    { buffer: "pool_x", shape: fp8RowsMap(H, s.poolRows, WEIGHT_BOX_ROWS) }, // the shared W2, below
  ];
  if (s.hasShared) {
    const SI = sharedIntermediate(c);
    maps[3] = { buffer: "shared_expert_w1", shape: fp8RowsMap(H, 2 * SI, WEIGHT_BOX_ROWS) };
    maps[7] = { buffer: "shared_expert_w2", shape: fp8RowsMap(SI, H, WEIGHT_BOX_ROWS) };
  } else if (!fp4) {
    maps[3] = { buffer: "routed_w1", shape: fp8RowsMap(H, E * 2 * I, WEIGHT_BOX_ROWS) };
    maps[7] = { buffer: "routed_w2", shape: fp8RowsMap(I, E * H, WEIGHT_BOX_ROWS) };
  }
  if (fp4) {
    maps.push({ buffer: "routed_w1_words", shape: fp4ScaleWordsMap(H, E * 2 * I, WEIGHT_BOX_ROWS) });
    maps.push({ buffer: "routed_w2_words", shape: fp4ScaleWordsMap(I, E * H, WEIGHT_BOX_ROWS) });
  }
  return maps;
}

/** What an `Operands` pointer field holds: a buffer, a per-call operand, or nothing. */
export type FusedOperandSource =
  | { buffer: FusedOwnBuffer | FusedWeightBuffer }
  | { operand: "xq" | "x_scales" | "ids" | "weights" | "out" }
  | null;

/**
 * The source of each pointer field of `Operands` for a layer (the trace is off; `images` only in the
 * expand variant). The scales the tiles promote with are the routed experts' (FP4: the block scales);
 * without a shared expert its fields repeat the routed ones (never read).
 */
export function fusedOperandPointers(
  s: FusedSizes,
  expand: boolean,
): Record<FusedOperandPointer, FusedOperandSource> {
  return {
    xq: { operand: "xq" },
    x_scales: { operand: "x_scales" },
    ids: { operand: "ids" },
    weights: { operand: "weights" },
    w1_scales: { buffer: "routed_w1_scales" },
    w2_scales: { buffer: "routed_w2_scales" },
    w1s_scales: { buffer: s.hasShared ? "shared_expert_w1_scales" : "routed_w1_scales" },
    w2s_scales: { buffer: s.hasShared ? "shared_expert_w2_scales" : "routed_w2_scales" },
    pool_x: { buffer: "pool_x" },
    pool_x_scales: { buffer: "pool_x_scales" },
    pool_h: { buffer: "pool_h" },
    pool_h_scales: { buffer: "pool_h_scales" },
    y: { buffer: "y" },
    slot_row: { buffer: "slot_row" },
    out: { operand: "out" },
    workspace: { buffer: "workspace" },
    status: { buffer: "status" },
    trace: null,
    images: expand ? { buffer: "images" } : null,
  };
}

/** The scalars of `Operands` a layer fixes (tokens and use_shared are the launch's). */
export function fusedOperandConstants(
  c: MoEConfig,
  s: FusedSizes,
): Record<"r_pad" | "max_blocks" | "has_clamp" | "clamp", number> {
  return {
    r_pad: s.rPad,
    max_blocks: s.maxBlocks,
    has_clamp: c.swigluClamp === null ? 0 : 1,
    clamp: c.swigluClamp ?? 0,
  };
}
