/**
 * SwiGLU with the optional clamp of DeepSeek-V4: silu(min(g, c)) · clamp(u, −c, c).
 *
 * Inputs are the fp32 L1 accumulators; the value is computed in double and rounded once to fp32.
 * A GPU computing it in fp32 (expf, division) lands within a few ulps; the re-quantization that
 * follows absorbs that, and comparisons of GPU paths use error metrics, not bit equality.
 */
export function swiglu(gate: number, up: number, clamp: number | null): number {
  return Math.fround(swigluExact(gate, up, clamp));
}

/** The same rule in double, unrounded (the FP64 ideal layer uses it). */
export function swigluExact(gate: number, up: number, clamp: number | null): number {
  let g = gate;
  let u = up;
  if (clamp !== null) {
    g = Math.min(g, clamp);
    u = Math.min(Math.max(u, -clamp), clamp);
  }
  return (g / (1 + Math.exp(-g))) * u;
}
