/** Specializations of moe_unfused.cu: only the activation scale format is compiled in. */
import { SCALE_FORMATS } from "../quant/quant.variants.js";
import type { KernelDefines, KernelVariant } from "../variants.js";

export function moeUnfusedDefines(ue8m0: boolean): KernelDefines {
  return { SCALE_UE8M0: ue8m0 ? 1 : 0 };
}

export const variants: readonly KernelVariant[] = SCALE_FORMATS.map((f) => ({
  defines: moeUnfusedDefines(f === "ue8m0"),
  noSpill: true,
}));
