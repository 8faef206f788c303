/**
 * A layer's fused forward as an export (docs/export.md): the kernels to compile, then the manifest
 * built from the same pieces the Node launchers use (the fused kernel's ABI and plan, the quantization
 * kernel's launch rule, the load-time passes), tabulated over T = 1 … maxTokens.
 */
import {
  checkOptionFields,
  describeValue,
  expertFormatOf,
  MAX_TOKENS_LIMIT,
  type MoEConfig,
  QUANT_BLOCK,
  type ScaleFormat,
  sharedIntermediate,
  validateConfig,
} from "../config/config.js";
import { DTYPE_BYTES, TensorMapDataType, TensorMapL2Promotion, TensorMapSwizzle } from "../cuda/index.js";
import {
  ADOPT_SOURCE,
  ADOPT_THREADS,
  adoptGrid,
  IDS_I64_TO_I32_KERNEL,
  TRANSPOSE_U32_KERNEL,
  UE8M0_TO_F32_KERNEL,
} from "../kernels/adopt/adopt.js";
import {
  FP4_CONVERT_SOURCE,
  FP4_CONVERT_THREADS,
  FP4_DEVICE_LAYOUT_KERNEL,
  FP4_REFERENCE_WORDS_KERNEL,
} from "../kernels/fp4/fp4_convert.js";
import {
  FUSED_OPERAND_POINTERS,
  FUSED_OPERANDS_BYTES,
  type FusedOperandSource,
  type FusedSizes,
  fusedBuffers,
  fusedOperandConstants,
  fusedOperandOffset,
  fusedOperandPointers,
  fusedSizes,
  fusedTensorMaps,
} from "../kernels/megamoe/abi.js";
import { FUSED_KERNEL, FUSED_KERNEL_SOURCE } from "../kernels/megamoe/megamoe.js";
import { type FusedBlockM, fusedExpandImageBytes } from "../kernels/megamoe/megamoe.variants.js";
import { fusedBlockM, fusedExpand, planFusedLaunch } from "../kernels/megamoe/plan.js";
import {
  GROUPS_PER_WARP_STEP,
  QUANT_KERNEL_NAME,
  QUANT_KERNEL_SOURCE,
  quantLaunchConfig,
  residentBlocksPerSm,
} from "../kernels/quant/quant.js";
import { quantDefines } from "../kernels/quant/quant.variants.js";
import type { TensorMapShape } from "../kernels/tensor-maps.js";
import type { KernelDefines } from "../kernels/variants.js";
import {
  ceilDiv,
  EXPORT_FORMAT,
  EXPORT_VERSION,
  type ExportArg,
  type ExportBuffer,
  type ExportField,
  type ExportLaunch,
  type ExportManifest,
  type ExportRange,
  type ExportStep,
  type ExportTensor,
  type ExportTensorMap,
  type Expr,
  max,
  min,
  mul,
} from "./manifest.js";

export interface LayerExportOptions {
  maxTokens: number;
  /** Add the shared expert (a layer without one exports none either way). */
  shared: boolean;
  /** SMs of the target device: the grids are planned for it (H100 SXM and H200: 132). */
  smCount: number;
  /** How the caller's FP8 matrices carry their 128 × 128 block scales. */
  weightScales: "fp32" | "ue8m0";
  arch: string;
  producer: string;
}

/** One kernel to compile: a source, its defines, the entry function. Ids name cubin files too. */
export interface ExportKernelJob {
  id: string;
  source: string;
  defines: KernelDefines;
  function: string;
  /** The cubin file (kernels sharing a source and defines share it). */
  cubin: string;
}

/** A bad export option or a layer the export cannot take: the option, the value and the bound. */
export class ExportError extends Error {
  override name = "ExportError";
}

const EXPORT_OPTION_FIELDS = [
  "maxTokens",
  "shared",
  "smCount",
  "weightScales",
  "arch",
  "producer",
  // exportLayer's (export.ts)
  "overwrite",
  "onProgress",
];

/** Throws an ExportError naming the first bad option. */
export function checkExportOptions(opts: LayerExportOptions): void {
  checkOptionFields("export options", opts, EXPORT_OPTION_FIELDS, (m) => new ExportError(m));
  const integer = (name: string, v: unknown, max: number) => {
    if (!Number.isInteger(v) || (v as number) < 1 || (v as number) > max) {
      throw new ExportError(
        `export options.${name} must be an integer in [1, ${max}], got ${describeValue(v)}`,
      );
    }
  };
  integer("maxTokens", opts.maxTokens, MAX_TOKENS_LIMIT);
  integer("smCount", opts.smCount, 1024);
  if (typeof opts.shared !== "boolean") {
    throw new ExportError(`export options.shared must be true or false, got ${describeValue(opts.shared)}`);
  }
  if (opts.weightScales !== "fp32" && opts.weightScales !== "ue8m0") {
    throw new ExportError(
      `export options.weightScales must be "fp32" or "ue8m0", got ${describeValue(opts.weightScales)}`,
    );
  }
  for (const name of ["arch", "producer"] as const) {
    if (typeof opts[name] !== "string" || opts[name] === "") {
      throw new ExportError(
        `export options.${name} must be a non-empty string, got ${describeValue(opts[name])}`,
      );
    }
  }
}

/** The layer as exported: without the shared expert unless asked for. */
export function exportConfig(config: MoEConfig, shared: boolean): MoEConfig {
  const c = validateConfig(config);
  if (c.ranks !== 1)
    throw new ExportError(`export: layer ${c.name} is one rank of ${c.ranks}; export one GPU's layer`);
  return shared || c.numShared === 0 ? c : { ...c, numShared: 0 };
}

interface RangeKey {
  blockM: FusedBlockM;
  expand: boolean;
  quantThreads: number;
}

const fusedId = (k: { blockM: FusedBlockM; expand: boolean }) => `fused_m${k.blockM}${k.expand ? "x" : ""}`;

/** The maximal runs of T = 1 … maxTokens that launch the same kernels with the same blocks. */
export function exportRanges(
  c: MoEConfig,
  maxTokens: number,
  smCount: number,
): { tokens: [number, number]; key: RangeKey }[] {
  const runs: { tokens: [number, number]; key: RangeKey }[] = [];
  for (let t = 1; t <= maxTokens; t++) {
    const blockM = fusedBlockM(c, t);
    // The quantization kernel's block size does not depend on its registers (quantLaunchConfig).
    const key = {
      blockM,
      expand: fusedExpand(c, t, blockM),
      quantThreads: quantLaunchConfig(t, c.hidden, smCount, 1).threads,
    };
    const last = runs[runs.length - 1];
    if (
      last &&
      last.key.blockM === key.blockM &&
      last.key.expand === key.expand &&
      last.key.quantThreads === key.quantThreads
    ) {
      last.tokens[1] = t;
    } else runs.push({ tokens: [t, t], key });
  }
  return runs;
}

/** Every kernel an export of the layer holds: the forward's for each range, and the load-time passes. */
export function exportKernelJobs(config: MoEConfig, opts: LayerExportOptions): ExportKernelJob[] {
  checkExportOptions(opts);
  const c = exportConfig(config, opts.shared);
  const jobs: ExportKernelJob[] = [
    {
      id: "quant",
      source: QUANT_KERNEL_SOURCE,
      defines: quantDefines(c.hidden, c.scaleFormat),
      function: QUANT_KERNEL_NAME,
      cubin: "kernels/quant.cubin",
    },
  ];
  const seen = new Set<string>();
  for (const r of exportRanges(c, opts.maxTokens, opts.smCount)) {
    const id = fusedId(r.key);
    if (seen.has(id)) continue;
    seen.add(id);
    const plan = planFusedLaunch(c, r.tokens[0], opts.smCount, r.key.blockM, r.key.expand);
    jobs.push({
      id,
      source: FUSED_KERNEL_SOURCE,
      defines: plan.defines,
      function: FUSED_KERNEL,
      cubin: `kernels/${id}.cubin`,
    });
  }
  jobs.push({
    id: "ids_i64_to_i32",
    source: ADOPT_SOURCE,
    defines: {},
    function: IDS_I64_TO_I32_KERNEL,
    cubin: "kernels/adopt.cubin",
  });
  const needsScaleExpansion =
    opts.weightScales === "ue8m0" && (expertFormatOf(c) === "fp8" || c.numShared > 0);
  if (needsScaleExpansion) {
    jobs.push({
      id: "ue8m0_to_f32",
      source: ADOPT_SOURCE,
      defines: {},
      function: UE8M0_TO_F32_KERNEL,
      cubin: "kernels/adopt.cubin",
    });
  }
  if (expertFormatOf(c) === "fp4") {
    jobs.push(
      {
        id: "transpose_u32",
        source: ADOPT_SOURCE,
        defines: {},
        function: TRANSPOSE_U32_KERNEL,
        cubin: "kernels/adopt.cubin",
      },
      {
        id: "fp4_layout",
        source: FP4_CONVERT_SOURCE,
        defines: {},
        function: FP4_DEVICE_LAYOUT_KERNEL,
        cubin: "kernels/fp4_convert.cubin",
      },
      {
        id: "fp4_reference_words",
        source: FP4_CONVERT_SOURCE,
        defines: {},
        function: FP4_REFERENCE_WORDS_KERNEL,
        cubin: "kernels/fp4_convert.cubin",
      },
    );
  }
  return jobs;
}

const DATA_TYPE_NAMES = Object.fromEntries(
  Object.entries(TensorMapDataType).map(([k, v]) => [v, k.toLowerCase()]),
);
const SWIZZLE_NAMES: Record<number, string> = {
  [TensorMapSwizzle.NONE]: "none",
  [TensorMapSwizzle.B32]: "32B",
  [TensorMapSwizzle.B64]: "64B",
  [TensorMapSwizzle.B128]: "128B",
};
const L2_NAMES: Record<number, string> = {
  [TensorMapL2Promotion.NONE]: "none",
  [TensorMapL2Promotion.B64]: "64B",
  [TensorMapL2Promotion.B128]: "128B",
  [TensorMapL2Promotion.B256]: "256B",
};

/** A tensor map's shape as the manifest writes it (names for the driver's enums). */
export function exportTensorMap(id: string, buffer: string, shape: TensorMapShape): ExportTensorMap {
  return {
    id,
    buffer,
    offset: 0,
    dataType: DATA_TYPE_NAMES[shape.dataType] ?? String(shape.dataType),
    dims: [...shape.globalDims],
    stridesBytes: [...shape.globalStridesBytes],
    box: [...shape.boxDims],
    elementStrides: [...(shape.elementStrides ?? shape.globalDims.map(() => 1))],
    interleave: "none",
    swizzle: SWIZZLE_NAMES[shape.swizzle ?? TensorMapSwizzle.NONE] ?? "none",
    l2Promotion: L2_NAMES[shape.l2Promotion ?? TensorMapL2Promotion.NONE] ?? "none",
    oobFill: "none",
  };
}

const ref = (buffer: string): { buffer: string; offset: Expr } => ({ buffer, offset: 0 });

/** The pipeline's FP8 rows and the per-call operands of the fused kernel, by the ABI's operand names. */
const OPERAND_REFS = {
  xq: "xq",
  x_scales: "x_scales",
  ids: "topk_ids",
  weights: "topk_weights",
  out: "out",
} as const;

function operandField(offset: number, source: FusedOperandSource): ExportField {
  if (source === null) return { offset, kind: "pointer", ref: null };
  return {
    offset,
    kind: "pointer",
    ref: ref("buffer" in source ? source.buffer : OPERAND_REFS[source.operand]),
  };
}

/** The fused kernel's launch for a range: its tensor maps, then `Operands` by value. */
function fusedLaunch(
  c: MoEConfig,
  s: FusedSizes,
  key: RangeKey,
  tokens: number,
  smCount: number,
): ExportLaunch {
  const plan = planFusedLaunch(c, tokens, smCount, key.blockM, key.expand);
  const id = fusedId(key);
  const maps = fusedTensorMaps(c, key.blockM, s).map(
    (_, i): ExportArg => ({ kind: "tensorMap", map: `${id}.${i}` }),
  );
  const pointers = fusedOperandPointers(s, key.expand);
  const fields: ExportField[] = FUSED_OPERAND_POINTERS.map((name) =>
    operandField(fusedOperandOffset(name), pointers[name]),
  );
  const constants = fusedOperandConstants(c, s);
  fields.push(
    { offset: fusedOperandOffset("tokens"), kind: "i32", value: "T" },
    { offset: fusedOperandOffset("r_pad"), kind: "i32", value: constants.r_pad },
    { offset: fusedOperandOffset("max_blocks"), kind: "i32", value: constants.max_blocks },
    { offset: fusedOperandOffset("use_shared"), kind: "i32", value: s.hasShared ? 1 : 0 },
    { offset: fusedOperandOffset("has_clamp"), kind: "i32", value: constants.has_clamp },
    { offset: fusedOperandOffset("clamp"), kind: "f32", value: constants.clamp },
  );
  return {
    kind: "launch",
    kernel: id,
    grid: [smCount, 1, 1],
    block: [plan.threads, 1, 1],
    sharedBytes: plan.sharedBytes,
    cluster: [1, 1, 1],
    // The fused kernel waits for the previous grid itself (Kernel.launchAfterPrevious).
    programmaticStreamSerialization: true,
    args: [...maps, { kind: "struct", bytes: FUSED_OPERANDS_BYTES, fields }],
  };
}

/**
 * The quantization kernel's launch for a range of one block size: quantLaunchConfig's blocks as an
 * expression of T (the tests check it against quantLaunchConfig at every T).
 */
export function quantLaunch(
  hidden: number,
  threads: number,
  registers: number,
  smCount: number,
): ExportLaunch {
  const steps = ceilDiv(mul("T", hidden / QUANT_BLOCK), GROUPS_PER_WARP_STEP);
  const resident = smCount * residentBlocksPerSm(threads, registers);
  return {
    kind: "launch",
    kernel: "quant",
    grid: [max(1, min(ceilDiv(steps, threads / 32), resident)), 1, 1],
    block: [threads, 1, 1],
    sharedBytes: 0,
    cluster: [1, 1, 1],
    programmaticStreamSerialization: false,
    args: [
      { kind: "pointer", ref: ref("x") },
      { kind: "pointer", ref: ref("xq") },
      { kind: "pointer", ref: ref("x_scales") },
      { kind: "u32", value: "T" },
    ],
  };
}

/** A load-time or conversion launch: `grid` blocks of `threads`, no shared memory, no attributes. */
function launch(kernel: string, grid: Expr, threads: number, args: ExportArg[]): ExportLaunch {
  return {
    kind: "launch",
    kernel,
    grid: [grid, 1, 1],
    block: [threads, 1, 1],
    sharedBytes: 0,
    cluster: [1, 1, 1],
    programmaticStreamSerialization: false,
    args,
  };
}
const ptr = (name: string): ExportArg => ({ kind: "pointer", ref: ref(name) });
const u32 = (value: number): ExportArg => ({ kind: "u32", value });

interface WeightPlan {
  weights: Record<string, ExportTensor>;
  buffers: ExportBuffer[];
  prepare: ExportStep[];
}

/**
 * An FP8 matrix pair handed over as `w13`/`w2` (each with its block scales) into the device buffers
 * `<prefix>_w1…`: the codes copied, the scales copied or expanded from UE8M0.
 */
function fp8Pair(
  p: WeightPlan,
  names: { w13: string; w2: string; prefix: "routed" | "shared_expert" },
  experts: number | null,
  hidden: number,
  inter: number,
  scales: "fp32" | "ue8m0",
): void {
  const lead = experts === null ? [] : [experts];
  const e = experts ?? 1;
  const b = QUANT_BLOCK;
  for (const [input, buffer, rows, cols] of [
    [names.w13, `${names.prefix}_w1`, 2 * inter, hidden],
    [names.w2, `${names.prefix}_w2`, hidden, inter],
  ] as const) {
    const blocks = e * (rows / b) * (cols / b);
    p.weights[input] = { dtype: "float8_e4m3fn", shape: [...lead, rows, cols] };
    p.weights[`${input}_scale`] = {
      dtype: scales === "fp32" ? "float32" : "uint8",
      shape: [...lead, rows / b, cols / b],
    };
    p.buffers.push(
      { name: buffer, bytes: e * rows * cols, lifetime: "weights", init: "none" },
      { name: `${buffer}_scales`, bytes: 4 * blocks, lifetime: "weights", init: "none" },
    );
    p.prepare.push({ kind: "copy", dst: ref(buffer), src: ref(input), bytes: e * rows * cols });
    p.prepare.push(
      scales === "fp32"
        ? { kind: "copy", dst: ref(`${buffer}_scales`), src: ref(`${input}_scale`), bytes: 4 * blocks }
        : launch("ue8m0_to_f32", adoptGrid(blocks), ADOPT_THREADS, [
            ptr(`${input}_scale`),
            ptr(`${buffer}_scales`),
            u32(blocks),
          ]),
    );
  }
}

/**
 * MXFP4 routed experts handed over as packed rows (uint8 [E, N, K/2], element 2j in the low nibble of
 * byte j) and UE8M0 bytes (uint8 [E, N, K/32]): into the device layout, the scale words and their
 * reference words with each 128 × 128 block's fp32 scale (DeviceMoEWeights' FP4 form).
 */
function fp4Routed(p: WeightPlan, experts: number, hidden: number, inter: number): void {
  for (const [input, buffer, rows, k] of [
    ["w13", "routed_w1", 2 * inter, hidden],
    ["w2", "routed_w2", hidden, inter],
  ] as const) {
    const total = experts * rows;
    const kBlocks = k / QUANT_BLOCK;
    const blockScales = experts * Math.ceil(rows / QUANT_BLOCK) * kBlocks;
    p.weights[input] = { dtype: "uint8", shape: [experts, rows, k / 2] };
    p.weights[`${input}_scale`] = { dtype: "uint8", shape: [experts, rows, k / 32] };
    p.buffers.push(
      { name: buffer, bytes: (total * k) / 2, lifetime: "weights", init: "none" },
      { name: `${buffer}_words`, bytes: kBlocks * total * 4, lifetime: "weights", init: "none" },
      { name: `${buffer}_scales`, bytes: 4 * blockScales, lifetime: "weights", init: "none" },
    );
    p.prepare.push(
      launch("fp4_layout", Math.ceil((total * kBlocks) / FP4_CONVERT_THREADS), FP4_CONVERT_THREADS, [
        ptr(input),
        ptr(buffer),
        u32(total),
        u32(kBlocks),
        u32(total),
        u32(0),
      ]),
      launch("transpose_u32", adoptGrid(total * kBlocks), ADOPT_THREADS, [
        ptr(`${input}_scale`),
        ptr(`${buffer}_words`),
        u32(total),
        u32(kBlocks),
        u32(total),
        u32(0),
      ]),
      launch("fp4_reference_words", Math.ceil(blockScales / FP4_CONVERT_THREADS), FP4_CONVERT_THREADS, [
        ptr(`${buffer}_words`),
        u32(total),
        u32(0),
        u32(total),
        u32(rows),
        u32(kBlocks),
        ptr(`${buffer}_scales`),
      ]),
    );
  }
}

const tensorBytes = (dtype: keyof typeof DTYPE_BYTES, shape: number[]) =>
  shape.reduce((a, b) => a * b, DTYPE_BYTES[dtype]);

/**
 * The manifest of a layer's export, for a quantization kernel of `quantRegisters` registers per thread
 * (its resident blocks bound its grid; `compileLayerExport` reads them from the cubin).
 */
export function buildManifest(
  config: MoEConfig,
  opts: LayerExportOptions,
  quantRegisters: number,
): ExportManifest {
  const c = exportConfig(config, opts.shared);
  const jobs = exportKernelJobs(c, opts);
  const H = c.hidden;
  const I = c.intermediate;
  const E = c.numExperts;
  const hasShared = c.numShared > 0;
  const s = fusedSizes(c, opts.maxTokens, hasShared);
  const runs = exportRanges(c, opts.maxTokens, opts.smCount);

  const plan: WeightPlan = { weights: {}, buffers: [], prepare: [] };
  if (expertFormatOf(c) === "fp4") fp4Routed(plan, E, H, I);
  else fp8Pair(plan, { w13: "w13", w2: "w2", prefix: "routed" }, E, H, I, opts.weightScales);
  if (hasShared)
    fp8Pair(
      plan,
      { w13: "shared_w13", w2: "shared_w2", prefix: "shared_expert" },
      null,
      H,
      sharedIntermediate(c),
      opts.weightScales,
    );

  const workspace: ExportBuffer[] = [
    { name: "xq", bytes: opts.maxTokens * H, lifetime: "workspace", init: "none" },
    { name: "x_scales", bytes: 4 * opts.maxTokens * (H / QUANT_BLOCK), lifetime: "workspace", init: "none" },
    { name: "topk_ids_i32", bytes: 4 * opts.maxTokens * c.topK, lifetime: "workspace", init: "none" },
    ...fusedBuffers(c, opts.maxTokens, s).map(
      (b): ExportBuffer => ({
        name: b.name,
        bytes: tensorBytes(b.dtype, b.shape),
        lifetime: "workspace",
        init: b.init,
      }),
    ),
  ];
  if (runs.some((r) => r.key.expand)) {
    workspace.push({ name: "images", bytes: fusedExpandImageBytes(c), lifetime: "workspace", init: "none" });
  }

  const tensorMaps: ExportTensorMap[] = [];
  const mapped = new Set<string>();
  const forward: ExportRange[] = runs.map((r) => {
    const id = fusedId(r.key);
    if (!mapped.has(id)) {
      mapped.add(id);
      for (const [i, m] of fusedTensorMaps(c, r.key.blockM, s).entries()) {
        tensorMaps.push(exportTensorMap(`${id}.${i}`, m.buffer, m.shape));
      }
    }
    return {
      tokens: r.tokens,
      steps: [
        quantLaunch(H, r.key.quantThreads, quantRegisters, opts.smCount),
        fusedLaunch(c, s, r.key, r.tokens[0], opts.smCount),
      ],
    };
  });

  const kernels = jobs.map((j) => {
    const launches = [...forward.flatMap((r) => r.steps), ...plan.prepare];
    const shared = Math.max(
      0,
      ...launches.map((l) => (l.kind === "launch" && l.kernel === j.id ? l.sharedBytes : 0)),
    );
    return {
      id: j.id,
      cubin: j.cubin,
      function: j.function,
      maxDynamicSharedBytes: shared,
      defines: { ...j.defines },
    };
  });
  const scaleFormat: ScaleFormat = c.scaleFormat;
  return {
    format: EXPORT_FORMAT,
    version: EXPORT_VERSION,
    producer: opts.producer,
    arch: opts.arch,
    smCount: opts.smCount,
    layer: {
      name: c.name,
      hidden: H,
      topK: c.topK,
      experts: E,
      intermediate: I,
      sharedIntermediate: hasShared ? sharedIntermediate(c) : 0,
      expertFormat: expertFormatOf(c),
      scaleFormat,
      maxTokens: opts.maxTokens,
    },
    kernels,
    buffers: [...plan.buffers, ...workspace],
    weights: plan.weights,
    inputs: {
      x: { dtype: "bfloat16", shape: ["T", H] },
      topk_ids: { dtype: "int32", shape: ["T", c.topK] },
      topk_weights: { dtype: "float32", shape: ["T", c.topK] },
      out: { dtype: "bfloat16", shape: ["T", H] },
    },
    inputConversions: {
      topk_ids: {
        dtype: "int64",
        buffer: "topk_ids_i32",
        steps: [
          launch("ids_i64_to_i32", ceilDiv(mul("T", c.topK), ADOPT_THREADS), ADOPT_THREADS, [
            ptr("topk_ids"),
            ptr("topk_ids_i32"),
            { kind: "u32", value: mul("T", c.topK) },
          ]),
        ],
      },
    },
    tensorMaps,
    prepare: plan.prepare,
    status: { buffer: "status", words: 4 },
    forward,
  };
}
