/**
 * How a kernel family tells `scripts/compile-kernels.ts` which specializations exist.
 *
 * Convention: `src/kernels/<family>/<name>.cu` may have `<name>.variants.ts` beside it whose export
 * `variants` lists every set of `-D` defines its launcher can ask the JIT for (on the presets). The CI
 * check compiles each one (`--all`; by default a sample, scripts/kernel-sample.ts); a `.cu` without
 * such a file compiles once with its built-in defaults.
 */

/** One specialization: the `-D NAME=value` macros the JIT passes. */
export type KernelDefines = Readonly<Record<string, number>>;

export interface KernelVariant {
  defines: KernelDefines;
  /** When true, any spill store/load or local stack frame fails the CI check. */
  noSpill: boolean;
}

/** Dynamic shared memory a block may opt into on sm_90 (227 KB); the families' layouts import it here. */
export { SM90_SHARED_OPTIN_BYTES } from "../cuda/hardware.js";

/** `x` rounded up to a multiple of `to` (the shared-memory layout formulas' alignment). */
export function alignUp(x: number, to: number): number {
  return Math.ceil(x / to) * to;
}

/**
 * Shared-memory bytes per stage of a GEMM's activation scales: TMA loads a box of BLOCK_M + 4 fp32 rows
 * whose start is aligned down to 4 rows (16 bytes), and stages are 128-byte aligned. Both FP8 GEMM
 * kernels (grouped and fused) load their A scales this way.
 */
export function aScaleStageBytes(blockM: number): number {
  return alignUp((blockM + 4) * 4, 128);
}

/**
 * Shared memory of one math warp's epilogue staging area (megamoe/sm90.cuh: staging_area_bytes): 16
 * rows, `pitch` bytes apart. Both FP8 GEMM kernels stage their output tiles this way.
 */
export function stagingAreaBytes(pitch: number): number {
  return 16 * pitch;
}

/** Staging pitches (megamoe/sm90.cuh: kStagingPitchNarrow / Wide): 128-byte rows + 16 or + 32 bytes. */
export const STAGING_PITCH_NARROW = 144;
export const STAGING_PITCH_WIDE = 160;

/** A short label such as `HIDDEN=7168 SCALE_UE8M0=1` for reports and errors. */
export function describeDefines(defines: KernelDefines): string {
  const names = Object.keys(defines).sort();
  return names.length === 0 ? "(defaults)" : names.map((n) => `${n}=${defines[n]}`).join(" ");
}
