/**
 * Specializations of moe_unfused.cu: only the activation scale format is compiled in (sizes are
 * run-time arguments). Shared by the launchers and the CI compile check.
 */
import { SCALE_FORMATS, type ScaleFormat, scaleFormatDefine } from "../../config/config.js";
import type { KernelDefines, KernelVariant } from "../variants.js";

/** The -D macros of moe_unfused.cu for one scale format. */
export function moeUnfusedDefines(format: ScaleFormat): KernelDefines {
  return scaleFormatDefine(format);
}

export const variants: readonly KernelVariant[] = SCALE_FORMATS.map((format) => ({
  defines: moeUnfusedDefines(format),
  noSpill: true,
}));
