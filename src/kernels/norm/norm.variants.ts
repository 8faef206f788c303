/**
 * Specializations of norm.cu: one per (hidden size, scale format), like quant.cu's. Shared by the
 * launcher and the CI compile check.
 */
import { PRESETS, type ScaleFormat } from "../../config/config.js";
import type { KernelDefines, KernelVariant } from "../variants.js";

export const NORM_SCALE_FORMATS: readonly ScaleFormat[] = ["fp32", "ue8m0"];

/** The -D macros that specialize norm.cu for one hidden size and scale format. */
export function normDefines(hidden: number, format: ScaleFormat): KernelDefines {
  return { HIDDEN: hidden, SCALE_UE8M0: format === "ue8m0" ? 1 : 0 };
}

/** Every hidden size of a preset × both formats. */
export const variants: readonly KernelVariant[] = [...new Set(Object.values(PRESETS).map((p) => p.hidden))]
  .sort((a, b) => a - b)
  .flatMap((hidden) =>
    NORM_SCALE_FORMATS.map((format) => ({ defines: normDefines(hidden, format), noSpill: true })),
  );
