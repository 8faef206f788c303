/**
 * How a kernel family tells `scripts/compile-kernels.ts` which specializations exist.
 *
 * Convention: `src/kernels/<family>/<name>.cu` may have `<name>.variants.ts` beside it whose export
 * `variants` lists every set of `-D` defines its launcher can ask the JIT for (on the presets). The CI
 * check compiles each one; a `.cu` without such a file compiles once with its built-in defaults.
 */

/** One specialization: the `-D NAME=value` macros the JIT passes. */
export type KernelDefines = Readonly<Record<string, number>>;

export interface KernelVariant {
  defines: KernelDefines;
  /** When true, any spill store/load or local stack frame fails the CI check. */
  noSpill: boolean;
}

/** A short label such as `HIDDEN=7168 SCALE_UE8M0=1` for reports and errors. */
export function describeDefines(defines: KernelDefines): string {
  const names = Object.keys(defines).sort();
  return names.length === 0 ? "(defaults)" : names.map((n) => `${n}=${defines[n]}`).join(" ");
}
