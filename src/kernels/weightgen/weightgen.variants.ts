/**
 * Specializations of weightgen.cu: none. Every size (rows, cols, tokens, hidden) is a runtime argument,
 * so one image serves every preset; the CI check compiles it once and forbids spills.
 */
import type { KernelVariant } from "../variants.js";

export const variants: readonly KernelVariant[] = [{ defines: {}, noSpill: true }];
