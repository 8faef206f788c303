/**
 * How far apart two outputs of the layer may be: the one policy the GPU tests assert and
 * `megamoe check` prints verdicts with. Three comparisons are judged:
 *
 *  - the FP8 reference against the FP64 ideal (what FP8 costs): a sanity bound;
 *  - an output with the reference's numerics (a GPU layer, the layer split across ranks) against the
 *    reference (or against another such output): near it;
 *  - such an output against the FP64 ideal: no further from it than the reference is.
 */
import { bf16BitsToF32 } from "../numerics/bf16.js";
import { calcDiff, relativeError } from "./metrics.js";

/**
 * Same numerics, different fp32 accumulation inside the tensor cores: FP8 roundings of the
 * intermediate may flip. With a handful of tokens one flip weighs more (a first H200 run saw up to
 * 8.6e-3 at T = 1, 2–5e-3 elsewhere; a second, tiny at T = 7 without the shared expert: 1.57e-2 and
 * calc_diff 1.22e-4, while its distance to the FP64 ideal equalled the CPU reference's), so below 8
 * tokens both bounds are wider. How many roundings flip also depends on the data: with
 * MEGAMOE_SEED=1044225427 the edge cases without the shared expert measure 1.03e-2 (T = 33, experts
 * 0, 3, 5 empty, fp32) and 1.23e-2 (T = 200 on one expert, ue8m0), identical with three SwiGLU
 * formulations, while both lie as far from the FP64 ideal as the reference (3.9e-2, 4.9e-2); with
 * MEGAMOE_SEED=1046455041, ue8m0, T = 17 with 3 masked tokens and no shared expert: 2.27e-2 and
 * calc_diff 2.55e-4, the GPU 4.92e-2 from the ideal and the reference 5.00e-2 (with power-of-two
 * scales one amax on the other side of a power of two re-scales a whole 128-channel group); the
 * expert-parallel test with MEGAMOE_SEED=1080714979, tiny, a rank of one token: 1.05e-2, calc_diff 5.5e-5
 * (against a flat 1e-2 it then had); with MEGAMOE_SEED=1244147830, tiny ue8m0, T = 129 with the shared
 * expert, the unfused pipeline on an H100: 2.57e-2 and calc_diff 3.33e-4, the GPU 4.79e-2 from the ideal
 * and the reference 4.80e-2 (against half of that, 2.40e-2, the bound it then had). So the relative bound
 * also admits three quarters of the reference's own distance to the ideal (what FP8 costs on that data:
 * two equally good quantizations that differ in a few whole groups lie about that far apart), and
 * calc_diff (about rel² / 2) the matching 0.75 · bound²; the distance-to-ideal check, the one that says
 * which side is more accurate, stays as it is.
 */
export const MAX_REL_VS_REFERENCE = 1e-2;
/** The share of the reference's distance to the FP64 ideal that an output may lie from the reference. */
export const REF_DISTANCE_SHARE = 0.75;
export const MAX_REL_VS_REFERENCE_FEW_TOKENS = 2e-2;
/** Below this many tokens the "few tokens" bounds apply. */
export const FEW_TOKENS = 8;
export const MAX_DIFF_VS_REFERENCE = 1e-4;
export const MAX_DIFF_VS_REFERENCE_FEW_TOKENS = 3e-4;
/** An output may be at most this many times as far from the FP64 ideal as the reference is (rounding noise). */
export const IDEAL_DISTANCE_SLACK = 1.25;

/**
 * E4M3 keeps 3 mantissa bits, so each quantized operand lies within 2^-4 of its value; the layer's
 * outputs average such roundings and measure 3.7–5.1e-2 from the ideal on the tiny shape (5.0e-2 in
 * the GPU tests' edge cases). Twice that, and calc_diff ≈ rel² / 2 of it, catches a broken reference
 * or ideal, not a drift of a percent.
 */
export const MAX_REL_FP8_VS_IDEAL = 0.1;
export const MAX_DIFF_FP8_VS_IDEAL = 5e-3;

/** Upper bounds on ‖a − b‖/‖b‖ and calc_diff (undefined: not bounded). */
export interface ErrorBounds {
  relError?: number;
  calcDiff?: number;
}

/**
 * The bounds of an output with the reference's numerics against the reference, for an output of
 * `tokens` tokens whose reference lies `refRelIdeal` from the FP64 ideal.
 */
export function boundsVsReference(tokens: number, refRelIdeal: number): Required<ErrorBounds> {
  const few = tokens < FEW_TOKENS;
  const relError = Math.max(
    few ? MAX_REL_VS_REFERENCE_FEW_TOKENS : MAX_REL_VS_REFERENCE,
    REF_DISTANCE_SHARE * refRelIdeal,
  );
  const calcDiff = Math.max(
    few ? MAX_DIFF_VS_REFERENCE_FEW_TOKENS : MAX_DIFF_VS_REFERENCE,
    0.75 * relError ** 2,
  );
  return { relError, calcDiff };
}

/** The bound of an output against the FP64 ideal: no further than the reference (`refRelIdeal`), with slack. */
export function boundsVsIdeal(refRelIdeal: number): ErrorBounds {
  return { relError: IDEAL_DISTANCE_SLACK * refRelIdeal };
}

/** The sanity bounds of the FP8 reference against the FP64 ideal. */
export function boundsFp8VsIdeal(): Required<ErrorBounds> {
  return { relError: MAX_REL_FP8_VS_IDEAL, calcDiff: MAX_DIFF_FP8_VS_IDEAL };
}

/** A comparison measured and judged: ‖a − b‖/‖b‖ and calc_diff, the bounds, and which were broken. */
export interface Verdict {
  relError: number;
  calcDiff: number;
  bounds: ErrorBounds;
  /** One line per broken bound (a non-finite figure breaks every bound); empty when it passes. */
  failures: string[];
  pass: boolean;
}

/**
 * Judge measured figures against `bounds`: a figure passes when finite and at most its bound
 * (≤: two all-zero outputs, e.g. a fully masked token without the shared expert, measure 0 and 0).
 */
export function judge(relError: number, calcDiff: number, bounds: ErrorBounds): Verdict {
  const failures: string[] = [];
  const figures = [
    ["‖a − b‖/‖b‖", relError, bounds.relError],
    ["calc_diff", calcDiff, bounds.calcDiff],
  ] as const;
  for (const [name, value, max] of figures) {
    if (!Number.isFinite(value)) failures.push(`${name} is ${value}`);
    else if (max !== undefined && !(value <= max)) failures.push(`${name} ${value} exceeds ${max}`);
  }
  return { relError, calcDiff, bounds, failures, pass: failures.length === 0 };
}

/** Judge `a` against `b` (b the reference side). */
export function compareOutputs(a: ArrayLike<number>, b: ArrayLike<number>, bounds: ErrorBounds): Verdict {
  return judge(relativeError(a, b), calcDiff(a, b), bounds);
}

/** The errors of a bf16 output against the reference's (bf16) and the FP64 ideal. */
export interface LayerErrors {
  relRef: number;
  diffRef: number;
  relIdeal: number;
  diffIdeal: number;
  /** The reference's own distance to the ideal (what FP8 costs), for scale. */
  refRelIdeal: number;
}

const toF64 = (bits: Uint16Array) => Float64Array.from(bits, bf16BitsToF32);

/** The errors of a bf16 output against the reference's (bf16) and the FP64 ideal. */
export function layerErrors(out: Uint16Array, ref: Uint16Array, ideal: Float64Array): LayerErrors {
  const g = toF64(out);
  const r = toF64(ref);
  return {
    relRef: relativeError(g, r),
    diffRef: calcDiff(g, r),
    relIdeal: relativeError(g, ideal),
    diffIdeal: calcDiff(g, ideal),
    refRelIdeal: relativeError(r, ideal),
  };
}

/**
 * The verdicts on a layer output of `tokens` tokens: near the reference, and no further from the
 * ideal than the reference is.
 */
export function judgeLayerErrors(e: LayerErrors, tokens: number): { vsReference: Verdict; vsIdeal: Verdict } {
  return {
    vsReference: judge(e.relRef, e.diffRef, boundsVsReference(tokens, e.refRelIdeal)),
    vsIdeal: judge(e.relIdeal, e.diffIdeal, boundsVsIdeal(e.refRelIdeal)),
  };
}
