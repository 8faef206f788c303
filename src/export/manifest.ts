/**
 * The export manifest (docs/export.md, version 1): the types a runtime outside Node reads, the
 * expression language of its call-dependent numbers, and the evaluation both sides share. No CUDA, no
 * MoE here.
 */

export const EXPORT_FORMAT = "megamoe-export";
export const EXPORT_VERSION = 1;

/** A number that may depend on the call's token count T. */
export type Expr = number | "T" | { op: ExprOp; args: Expr[] };
export type ExprOp = "add" | "sub" | "mul" | "ceil_div" | "min" | "max";

export const EXPR_OPS: readonly ExprOp[] = ["add", "sub", "mul", "ceil_div", "min", "max"];

/** The expression's value for T tokens (integers throughout; ceil_div of two non-negative integers). */
export function evaluateExpr(e: Expr, tokens: number): number {
  if (typeof e === "number") return e;
  if (e === "T") return tokens;
  const v = e.args.map((a) => evaluateExpr(a, tokens));
  switch (e.op) {
    case "add":
      return v.reduce((a, b) => a + b, 0);
    case "sub":
      return (v[0] ?? 0) - v.slice(1).reduce((a, b) => a + b, 0);
    case "mul":
      return v.reduce((a, b) => a * b, 1);
    case "ceil_div":
      return Math.ceil((v[0] ?? 0) / (v[1] ?? 1));
    case "min":
      return Math.min(...v);
    case "max":
      return Math.max(...v);
  }
}

export const ceilDiv = (a: Expr, b: Expr): Expr => ({ op: "ceil_div", args: [a, b] });
export const mul = (...args: Expr[]): Expr => ({ op: "mul", args });
export const min = (...args: Expr[]): Expr => ({ op: "min", args });
export const max = (...args: Expr[]): Expr => ({ op: "max", args });

/** The torch dtype names of the tensors a caller hands over. */
export type ExportDtype = "bfloat16" | "float32" | "int32" | "uint8" | "float8_e4m3fn";

export interface ExportTensor {
  dtype: ExportDtype;
  /** Sizes; "T" for the call's token count. */
  shape: (number | "T")[];
}

export interface ExportKernel {
  id: string;
  cubin: string;
  function: string;
  maxDynamicSharedBytes: number;
  defines: Record<string, number>;
}

export interface ExportBuffer {
  name: string;
  bytes: number;
  lifetime: "weights" | "workspace";
  init: "none" | "zero";
}

export interface ExportTensorMap {
  id: string;
  buffer: string;
  offset: number;
  dataType: string;
  dims: number[];
  stridesBytes: number[];
  box: number[];
  elementStrides: number[];
  interleave: string;
  swizzle: string;
  l2Promotion: string;
  oobFill: string;
}

export interface ExportRef {
  buffer: string;
  offset: Expr;
}

export type ScalarKind = "u32" | "i32" | "f32" | "u64";

export type ExportArg =
  | { kind: "tensorMap"; map: string }
  | { kind: "pointer"; ref: ExportRef | null }
  | { kind: ScalarKind; value: Expr }
  | { kind: "struct"; bytes: number; fields: ExportField[] };

export type ExportField =
  | { offset: number; kind: "pointer"; ref: ExportRef | null }
  | { offset: number; kind: ScalarKind; value: Expr };

export interface ExportLaunch {
  kind: "launch";
  kernel: string;
  grid: [Expr, Expr, Expr];
  block: [number, number, number];
  sharedBytes: number;
  cluster: [number, number, number];
  programmaticStreamSerialization: boolean;
  args: ExportArg[];
}

export type ExportStep =
  | ExportLaunch
  | { kind: "copy"; dst: ExportRef; src: ExportRef; bytes: Expr }
  | { kind: "memset"; dst: ExportRef; byte: number; bytes: Expr };

export interface ExportRange {
  tokens: [number, number];
  steps: ExportStep[];
}

export interface ExportLayerFacts {
  name: string;
  hidden: number;
  topK: number;
  experts: number;
  intermediate: number;
  sharedIntermediate: number;
  expertFormat: "fp8" | "fp4";
  scaleFormat: "fp32" | "ue8m0";
  maxTokens: number;
}

/**
 * An input the caller may hand over in another dtype: the steps that convert it, per call and before
 * the forward's, into `buffer`, which the forward then reads in the input's place.
 */
export interface ExportConversion {
  dtype: ExportDtype | "int64";
  buffer: string;
  steps: ExportStep[];
}

export interface ExportManifest {
  format: typeof EXPORT_FORMAT;
  version: typeof EXPORT_VERSION;
  producer: string;
  arch: string;
  smCount: number;
  layer: ExportLayerFacts;
  kernels: ExportKernel[];
  buffers: ExportBuffer[];
  weights: Record<string, ExportTensor>;
  inputs: Record<string, ExportTensor>;
  inputConversions: Record<string, ExportConversion>;
  tensorMaps: ExportTensorMap[];
  prepare: ExportStep[];
  status: { buffer: string; words: number };
  forward: ExportRange[];
}

/** Bytes of one kernel argument's value: a tensor map 128, a struct its own, a pointer or u64 8, else 4. */
export function argBytes(a: ExportArg): number {
  if (a.kind === "tensorMap") return 128;
  if (a.kind === "struct") return a.bytes;
  return a.kind === "pointer" || a.kind === "u64" ? 8 : 4;
}

/** The range of `forward` that serves T tokens, or undefined above the maximum. */
export function rangeFor(m: ExportManifest, tokens: number): ExportRange | undefined {
  return m.forward.find((r) => r.tokens[0] <= tokens && tokens <= r.tokens[1]);
}
