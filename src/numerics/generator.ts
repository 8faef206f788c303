/**
 * The test-weight generator's spec: the names, scales and shapes from which the CPU generator
 * (src/weights/generate.ts) and the device generator (src/kernels/weightgen) make the same bits.
 * It sits beside the counter-based hash it builds on, so kernels and weights both read it from here.
 * docs/weights.md states the recipe.
 */
import { type MoEConfig, sharedIntermediate } from "../config/config.js";
import { hash32, tensorKey } from "./counter-rng.js";

/**
 * Per-block magnitude factors 2^−1, 2^0, 2^1 are equally likely, so E[factor²] = (1/4 + 1 + 4)/3 = 7/4;
 * the base scale divides it out to keep the matrix std at 1/sqrt(fanIn). uniformSym has variance 1/3.
 */
const BLOCK_FACTOR_MEAN_SQUARE = 7 / 4;
/** Correction-bias magnitude: small against sigmoid-like scores in (0, 1), as trained biases are. */
export const GATE_BIAS_SCALE = 2 ** -4;

/** Hash-stream names of the generated tensors (they are the generator's keys, not checkpoint names). */
export const generatorNames = {
  expertW1: (e: number) => `experts.${e}.w1`,
  expertW2: (e: number) => `experts.${e}.w2`,
  sharedW1: "shared_experts.w1",
  sharedW2: "shared_experts.w2",
  gateWeight: "gate.weight",
  gateBias: "gate.bias",
  /** Stream of the per-block exponent of the named matrix. */
  blockExponent: (matrix: string) => `${matrix}.block_exp`,
  input: "input",
  inputTokenScale: "input.token_scale",
} as const;

/** fp32 base scale of a block-scaled matrix: sqrt(3 / (7/4 · fanIn)), computed in double, rounded once. */
export function matrixBaseScale(fanIn: number): number {
  return Math.fround(Math.sqrt(3 / (BLOCK_FACTOR_MEAN_SQUARE * fanIn)));
}

/** fp32 scale of the gate weight's uniformSym values: sqrt(3 / hidden) (std 1/sqrt(hidden)), rounded once. */
export function gateWeightScale(hidden: number): number {
  return Math.fround(Math.sqrt(3 / hidden));
}

/** Exponent in {−1, 0, 1} of the magnitude factor of block `blockIndex` (row-major over blocks). */
export function blockExponent(seed: number, matrixName: string, blockIndex: number): number {
  return (hash32(seed, tensorKey(generatorNames.blockExponent(matrixName)), blockIndex) % 3) - 1;
}

/** One block-quantized matrix to make: its generator name, shape and fan-in. */
export interface MatrixSpec {
  name: string;
  rows: number;
  cols: number;
  fanIn: number;
}

/** An MLP's matrices: W1 [2I, H] (fan-in H), W2 [H, I] (fan-in I); the CPU and device generators share them. */
function mlpSpecs(hidden: number, inter: number, w1: string, w2: string): { w1: MatrixSpec; w2: MatrixSpec } {
  return {
    w1: { name: w1, rows: 2 * inter, cols: hidden, fanIn: hidden },
    w2: { name: w2, rows: hidden, cols: inter, fanIn: inter },
  };
}

/** Routed expert e's matrices. */
export function expertMatrixSpecs(config: MoEConfig, e: number): { w1: MatrixSpec; w2: MatrixSpec } {
  return mlpSpecs(config.hidden, config.intermediate, generatorNames.expertW1(e), generatorNames.expertW2(e));
}

/** The fused shared experts' matrices (intermediate · numShared). */
export function sharedMatrixSpecs(config: MoEConfig): { w1: MatrixSpec; w2: MatrixSpec } {
  return mlpSpecs(
    config.hidden,
    sharedIntermediate(config),
    generatorNames.sharedW1,
    generatorNames.sharedW2,
  );
}

/** Token scale factors, chosen by the top two bits of the token's hash: per-token norm variety. */
export const TOKEN_SCALES = [0.25, 0.5, 1, 2] as const;
/** An element whose hash has low byte 0 (1 in 256) is an outlier, 8× larger. */
export const OUTLIER_FACTOR = 8;
/**
 * fp32 base of the activations: sqrt(3 / (E[ts²] · E[o²])) with E[ts²] = 85/64 and
 * E[o²] = 1 + 63/256 = 319/256, so the overall std is ≈ 1.
 */
export const ACTIVATION_BASE = Math.fround(Math.sqrt(3 / ((85 / 64) * (319 / 256))));
