/**
 * Specializations of gate.cu: one per expert count (the select kernel keeps E/32 values per lane in
 * registers). Shared by the launcher and the CI compile check.
 */
import { PRESETS } from "../../config/config.js";
import type { KernelDefines, KernelVariant } from "../variants.js";

/** The largest expert count gate.cu compiles for (its shared-memory arrays). */
export const GATE_MAX_EXPERTS = 512;

/** The -D macros that specialize gate.cu for E experts. */
export function gateDefines(numExperts: number): KernelDefines {
  return { NUM_EXPERTS: numExperts };
}

/** Every preset's expert count. */
export const variants: readonly KernelVariant[] = [
  ...new Set(Object.values(PRESETS).map((p) => p.numExperts)),
]
  .sort((a, b) => a - b)
  .map((e) => ({ defines: gateDefines(e), noSpill: true }));
