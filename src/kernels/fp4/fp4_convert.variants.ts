/**
 * fp4_convert.cu has no specializations: the CI check compiles it once, and neither entry point may
 * spill or use a stack frame.
 */
import type { KernelVariant } from "../variants.js";

export const variants: readonly KernelVariant[] = [{ defines: {}, noSpill: true }];
