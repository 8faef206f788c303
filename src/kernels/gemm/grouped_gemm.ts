/**
 * Launcher of the FP8 grouped GEMM (fp8_grouped_gemm.cu) with per-128 block scales:
 *
 *   out[r, n] = Σ_b (Σ_{k in block b} a[r, k] · w[g·N + n, k]) · sa[b, r] · sw[g, n/128, b]
 *
 * for every row r of group g (rows [off[g], off[g+1]) of A and out). The plan (plan.ts) picks a tile
 * shape and a pipeline depth from the expected rows per group, N, K and the SM count; kernels are
 * compiled through the JIT once per specialization and memoized per device with their argument block,
 * whose three TMA tensor maps are re-encoded only when a pointer or the row count changes. The
 * benchmark is src/bench/grouped-gemm.ts.
 *
 * Layouts (row-major): a e4m3 [M, K]; aScales fp32 [K/128, M_pad] (MN-major: a K block's scales of
 * consecutive rows are contiguous, which the kernel loads with TMA; M_pad = M rounded up to 4 so a row
 * of scales is a multiple of 16 bytes); b e4m3 [G·N, K] (or [G, N, K]); bScales fp32 [G, N/128, K/128]
 * (or [G·N/128, K/128]); groupOffsets int32 [G+1], non-decreasing, anywhere in [0, M] (rows outside
 * every group are left untouched); out fp32 or bf16 [M, N].
 */

import { QUANT_BLOCK } from "../../config/config.js";
import { SM90_SHARED_OPTIN_BYTES } from "../../cuda/hardware.js";
import {
  compileKernel,
  type Device,
  type DeviceTensor,
  type DType,
  expectOnDevice,
  expectTensor,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceMemo,
  perDeviceOnce,
  type Stream,
  type TensorLike,
} from "../../cuda/index.js";
import { encodeFp8RowsMap, encodeScaleColumnsMap } from "../tensor-maps.js";
import { describeDefines } from "../variants.js";
import { GEMM_TILE_NAMES, type GemmTileName, type GemmWeightFormat } from "./fp8_grouped_gemm.variants.js";
import { checkGroupedGemmProblem, type GemmOutDtype, type GroupedGemmPlan, planGroupedGemm } from "./plan.js";

export type { TensorLike };

/** The kernel source, relative to src/kernels. */
export const GROUPED_GEMM_SOURCE = "gemm/fp8_grouped_gemm.cu";
export const GROUPED_GEMM_KERNEL = "megamoe_fp8_grouped_gemm";
/** The CUDA-core version of the same formula in the same module (slow; for diagnosis). */
export const GROUPED_GEMM_REFERENCE_KERNEL = "megamoe_fp8_grouped_gemm_reference";

/** Rows of the A-scale layout: M rounded up to 4, so each K block's row of scales is 16-byte aligned. */
export function aScalesRows(mTotal: number): number {
  return Math.ceil(mTotal / 4) * 4;
}

// ---------------------------------------------------------------------------------------------------
// Argument checks

/** Operands and sizes of one grouped GEMM. */
export interface GroupedGemmArgs<T extends TensorLike = DeviceTensor> {
  a: T;
  aScales: T;
  b: T;
  bScales: T;
  groupOffsets: T;
  out: T;
  mTotal: number;
  n: number;
  k: number;
  groups: number;
  expectedRowsPerGroup?: number;
  /** Force a tile shape (benchmarks, diagnosis). */
  tile?: GemmTileName;
  /** Cap on the persistent grid (diagnosis: 1 makes one CTA walk every tile). */
  maxCtas?: number;
}

function expect(
  what: string,
  t: TensorLike,
  dtypes: readonly DType[],
  shapes: readonly (readonly number[])[],
) {
  expectTensor("groupedGemmFp8", what, t, dtypes, shapes);
}

/**
 * Checks dtypes and shapes against the sizes; returns the output dtype. Throws an Error naming the first
 * operand that does not fit (pure: usable without a GPU).
 */
export function validateGroupedGemmArgs(args: GroupedGemmArgs<TensorLike>): GemmOutDtype {
  const { mTotal, n, k, groups } = args;
  checkGroupedGemmProblem({ mTotal, n, k, groups, expectedRowsPerGroup: args.expectedRowsPerGroup });
  const kb = k / QUANT_BLOCK;
  expect("a", args.a, ["fp8_e4m3"], [[mTotal, k]]);
  expect("aScales", args.aScales, ["fp32"], [[kb, aScalesRows(mTotal)]]);
  expect(
    "b",
    args.b,
    ["fp8_e4m3"],
    [
      [groups * n, k],
      [groups, n, k],
    ],
  );
  expect(
    "bScales",
    args.bScales,
    ["fp32"],
    [
      [groups, n / QUANT_BLOCK, kb],
      [(groups * n) / QUANT_BLOCK, kb],
    ],
  );
  expect("groupOffsets", args.groupOffsets, ["int32"], [[groups + 1]]);
  expect("out", args.out, ["fp32", "bf16"], [[mTotal, n]]);
  if (args.maxCtas !== undefined && !(Number.isInteger(args.maxCtas) && args.maxCtas >= 1)) {
    throw new Error(`groupedGemmFp8: maxCtas must be a positive integer, got ${args.maxCtas}`);
  }
  if (args.tile !== undefined && !GEMM_TILE_NAMES.includes(args.tile)) {
    throw new Error(`groupedGemmFp8: unknown tile "${args.tile}" (${GEMM_TILE_NAMES.join(", ")})`);
  }
  return args.out.dtype === "bf16" ? "bf16" : "fp32";
}

/** Every operand of a grouped GEMM on `device` (`name`: the calling function, for the message). */
export function checkGemmOperandsOn(name: string, device: Device, args: GroupedGemmArgs): void {
  for (const what of ["a", "aScales", "b", "bScales", "groupOffsets", "out"] as const) {
    expectOnDevice(name, what, args[what], device);
  }
}

// ---------------------------------------------------------------------------------------------------
// Kernels, memoized per device and specialization

// Both weight formats: map_a, map_b, map_sa, the B scales (FP4: a map of the reference words), group_offsets,
// out, m_total, status, and for FP4 the reference words again as a pointer; the references a, b, a_scales,
// m_pad, b_scales (FP4: the words), group_offsets, out, m_total.
const ARG_COUNT = 8;
/** The FP4 build's extra kernel parameter, after the shared ones: the reference words (its block scales' source). */
export const FP4_WORDS_ARG = ARG_COUNT;
const REF_ARG_COUNT = 8;
const REFERENCE_BLOCK = 256;

/** A build's fast kernel and CUDA-core reference, with their argument blocks (reused per launch). */
export interface GemmKernel {
  kernel: Kernel;
  reference: Kernel;
  args: KernelArgs;
  refArgs: KernelArgs;
  /** Pointers and row count the tensor maps in `args` were encoded for. */
  mapsKey: string;
}

const gemmKernels = perDeviceMemo<string, GemmKernel>();

/**
 * The build of `plan` (once per device and specialization: FP8 and FP4 builds differ by B_FP4, so one
 * memo serves both), entry points `name` and `referenceName`; the fast kernel's first arguments are its
 * tensor maps, the FP4 build's B scales one more.
 */
export function loadGemmKernel(
  device: Device,
  plan: GroupedGemmPlan,
  name: string,
  referenceName: string,
): GemmKernel {
  return gemmKernels(device, describeDefines(plan.defines), () => {
    const compiled = compileKernel({ source: GROUPED_GEMM_SOURCE, defines: plan.defines });
    const kernel = loadKernel(device, compiled, name);
    if (plan.sharedBytes > 48 * 1024) kernel.setMaxDynamicSharedMemory(plan.sharedBytes);
    const fp4 = plan.defines.B_FP4 !== undefined;
    return {
      kernel,
      reference: loadKernel(device, compiled, referenceName),
      args: new KernelArgs(fp4 ? FP4_WORDS_ARG + 1 : ARG_COUNT, {
        tensorMaps: fp4 ? [0, 1, 2, 3] : [0, 1, 2],
      }),
      refArgs: new KernelArgs(REF_ARG_COUNT),
      mapsKey: "",
    };
  });
}

/** Queues a build's reference kernel over `args` (one thread per output element) on `stream`. */
export function launchGemmReference(entry: GemmKernel, args: GroupedGemmArgs, stream: Stream | null): void {
  entry.refArgs
    .ptr(0, args.a.ptr)
    .ptr(1, args.b.ptr)
    .ptr(2, args.aScales.ptr)
    .i32(3, aScalesRows(args.mTotal))
    .ptr(4, args.bScales.ptr)
    .ptr(5, args.groupOffsets.ptr)
    .ptr(6, args.out.ptr)
    .i32(7, args.mTotal);
  const blocks = Math.ceil((args.mTotal * args.n) / REFERENCE_BLOCK);
  entry.reference.launch(blocks, REFERENCE_BLOCK, 0, stream, entry.refArgs);
}

const statusBuffers = perDeviceOnce<bigint>();

/** The device's watchdog status word (int32[4], zeroed once; the kernels write it only on a stall; FP4 shares it). */
export function statusBuffer(device: Device): bigint {
  return statusBuffers(device, () => {
    const ptr = device.alloc(16);
    device.memsetD32(ptr, 0, 4);
    return ptr;
  });
}

function gemmKernelFor(device: Device, plan: GroupedGemmPlan): GemmKernel {
  return loadGemmKernel(device, plan, GROUPED_GEMM_KERNEL, GROUPED_GEMM_REFERENCE_KERNEL);
}

function encodeMaps(entry: GemmKernel, plan: GroupedGemmPlan, args: GroupedGemmArgs): void {
  const { mTotal, n, k, groups } = args;
  const mapsKey = `${args.a.ptr}:${args.b.ptr}:${args.aScales.ptr}:${mTotal}`;
  if (entry.mapsKey === mapsKey) return;
  entry.mapsKey = "";
  const { blockM, blockN } = plan.tile;
  encodeFp8RowsMap(entry.args.tensorMap(0), args.a.ptr, k, mTotal, blockM);
  encodeFp8RowsMap(entry.args.tensorMap(1), args.b.ptr, k, groups * n, blockN);
  encodeScaleColumnsMap(entry.args.tensorMap(2), args.aScales.ptr, k, aScalesRows(mTotal), blockM + 4);
  entry.mapsKey = mapsKey;
}

/** The plan of a launch on `device`: its SM count and shared-memory budget, the args' forced tile. */
export function planGroupedGemmOn(
  device: Device,
  args: GroupedGemmArgs,
  outDtype: GemmOutDtype,
  weightFormat: GemmWeightFormat = "fp8",
): GroupedGemmPlan {
  return planGroupedGemm(
    {
      mTotal: args.mTotal,
      n: args.n,
      k: args.k,
      groups: args.groups,
      expectedRowsPerGroup: args.expectedRowsPerGroup,
      outDtype,
      ...(weightFormat === "fp4" ? { weightFormat } : {}),
    },
    {
      smCount: device.smCount,
      sharedBudgetBytes: Math.min(device.maxSharedMemoryPerBlockOptin, SM90_SHARED_OPTIN_BYTES),
      tile: args.tile,
    },
  );
}

// ---------------------------------------------------------------------------------------------------
// Launch

/** CTAs a launch of `plan` runs: the plan's grid, under `maxCtas` when given. */
export function groupedGemmLaunchGrid(plan: GroupedGemmPlan, maxCtas: number | undefined): number {
  return Math.min(plan.grid, maxCtas ?? plan.grid);
}

/**
 * Queues out = grouped GEMM (see the module doc) on `stream` (null: the legacy default stream) and
 * returns the plan it used. mTotal = 0 queues nothing. The first call of a specialization compiles the
 * kernel (or reads it from the JIT cache).
 */
export function groupedGemmFp8(
  device: Device,
  args: GroupedGemmArgs,
  stream: Stream | null,
): GroupedGemmPlan {
  const outDtype = validateGroupedGemmArgs(args);
  checkGemmOperandsOn("groupedGemmFp8", device, args);
  const plan = planGroupedGemmOn(device, args, outDtype);
  if (args.mTotal === 0) return plan;
  const entry = gemmKernelFor(device, plan);
  encodeMaps(entry, plan, args);
  entry.args.ptr(3, args.bScales.ptr);
  launchGroupedGemm(device, entry.kernel, entry.args, plan, args, stream);
  return plan;
}

/**
 * Fills the arguments both builds (FP8 and FP4 B) share after their tensor maps and B scales (group
 * offsets, out, M, the status words: slots 4..7) and queues the launch on the plan's grid.
 */
export function launchGroupedGemm(
  device: Device,
  kernel: Kernel,
  kernelArgs: KernelArgs,
  plan: GroupedGemmPlan,
  args: GroupedGemmArgs<TensorLike & { ptr: bigint }>,
  stream: Stream | null,
): void {
  kernelArgs
    .ptr(4, args.groupOffsets.ptr)
    .ptr(5, args.out.ptr)
    .i32(6, args.mTotal)
    .ptr(7, statusBuffer(device));
  kernel.launch(
    groupedGemmLaunchGrid(plan, args.maxCtas),
    plan.threads,
    plan.sharedBytes,
    stream,
    kernelArgs,
  );
}

/**
 * The same product on CUDA cores (one thread per output element, plain loads, no TMA or wgmma), with
 * the same operands and the same tile specialization's module. Slow: for checking the fast kernel on
 * the GPU and for telling a data-plumbing fault from a fault of the fast path.
 */
export function groupedGemmFp8Reference(device: Device, args: GroupedGemmArgs, stream: Stream | null): void {
  const outDtype = validateGroupedGemmArgs(args);
  checkGemmOperandsOn("groupedGemmFp8", device, args);
  if (args.mTotal === 0) return;
  launchGemmReference(gemmKernelFor(device, planGroupedGemmOn(device, args, outDtype)), args, stream);
}

/** What the kernel's watchdog recorded: a barrier wait that never completed. */
export interface GroupedGemmStall {
  /** "producer" waited on an empty slot, "math" on a full one; "shared-memory" = launch smaller than the build's layout. */
  role: "producer" | "math" | "shared-memory" | "unknown";
  block: number;
  stage: number;
  iteration: number;
  raw: [number, number, number, number];
}

/**
 * Reads and clears the device's watchdog status (waits for queued work). Null when every launch so far
 * ran to completion; a stall leaves garbage in `out`, so a test should call this after its launches.
 */
export function takeGroupedGemmStatus(device: Device): GroupedGemmStall | null {
  const ptr = statusBuffer(device);
  device.synchronize();
  const words = new Int32Array(4);
  device.copyDtoH(words, ptr, 16);
  if (words[0] === 0) return null;
  device.memsetD32(ptr, 0, 4);
  const roles = { 1: "producer", 2: "math", 3: "shared-memory" } as const;
  const role = roles[words[0] as 1 | 2 | 3] ?? "unknown";
  return {
    role,
    block: words[1]!,
    stage: words[2]!,
    iteration: words[3]!,
    raw: [words[0]!, words[1]!, words[2]!, words[3]!],
  };
}
