/**
 * Specializations of quant.cu: one per (hidden size, scale format). Shared by the launcher (which
 * asks the JIT for exactly these defines) and the CI compile check (which builds every one the
 * presets can produce), so the two cannot drift apart.
 */
import { PRESETS, SCALE_FORMATS, type ScaleFormat, scaleFormatDefine } from "../../config/config.js";
import type { KernelDefines, KernelVariant } from "../variants.js";

/** The -D macros that specialize quant.cu for one hidden size and scale format. */
export function quantDefines(hidden: number, format: ScaleFormat): KernelDefines {
  return { HIDDEN: hidden, ...scaleFormatDefine(format) };
}

/** Every hidden size of a preset × both formats (a layer may run either format on any preset). */
export const variants: readonly KernelVariant[] = [...new Set(Object.values(PRESETS).map((p) => p.hidden))]
  .sort((a, b) => a - b)
  .flatMap((hidden) =>
    SCALE_FORMATS.map((format) => ({ defines: quantDefines(hidden, format), noSpill: true })),
  );
