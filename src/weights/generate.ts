/**
 * Seeded random MoE weights and activations, made from the counter-based hash (counter-rng.ts).
 *
 * Every value depends only on (seed, tensor name, element index), so one expert made alone equals the
 * same expert made in a full run, and a CUDA kernel can make the same weights on the device. Experts are
 * made lazily and only a few are cached: a flash-shaped layer (6.4 GB of FP8) never exists in memory at
 * once. docs/weights.md gives the exact recipe.
 */
import {
  checkOptionFields,
  expertFormatOf,
  type MoEConfig,
  QUANT_BLOCK,
  sharedIntermediate,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { bf16FromF32Array } from "../numerics/bf16.js";
import { checkSeed, fillHash32, fillUniform, hash32, tensorKey } from "../numerics/counter-rng.js";
import { quantizeMxfp4 } from "../numerics/fp4.js";
import {
  ACTIVATION_BASE,
  expertMatrixSpecs,
  GATE_BIAS_SCALE,
  gateWeightScale,
  generatorNames,
  type MatrixSpec,
  matrixBaseScale,
  OUTLIER_FACTOR,
  sharedMatrixSpecs,
  TOKEN_SCALES,
} from "../numerics/generator.js";
import { quantizeWeightBlocks } from "../numerics/quant.js";
import { checkExpertIndex, ExpertCache } from "./expert-cache.js";
import type {
  BlockQuantized,
  ExpertWeights,
  GateWeights,
  MoEWeightSource,
  Mxfp4Matrix,
  RoutedExpertWeights,
} from "./types.js";

export { checkSeed } from "../numerics/counter-rng.js";

/**
 * The fp32 matrix [rows, cols] named `name` before quantization: element (r, c) is
 * fround(uniformSym(seed, key(name), r·cols + c) · blockScale(r/128, c/128)), where
 * blockScale = base · 2^blockExponent (exact). Written into `out` when given (it must hold rows·cols).
 */
export function generateMatrix(
  seed: number,
  name: string,
  rows: number,
  cols: number,
  fanIn: number,
  out?: Float32Array,
): Float32Array {
  checkSeed(seed);
  if (rows % QUANT_BLOCK !== 0 || cols % QUANT_BLOCK !== 0 || rows <= 0 || cols <= 0) {
    throw new RangeError(
      `${name}: rows and cols must be positive multiples of ${QUANT_BLOCK}, got ${rows}×${cols}`,
    );
  }
  if (rows * cols > 2 ** 32)
    throw new RangeError(`${name}: ${rows}×${cols} elements exceed 2^32 hash indices`);
  const w = out === undefined ? new Float32Array(rows * cols) : out.subarray(0, rows * cols);
  if (w.length !== rows * cols)
    throw new RangeError(`${name}: scratch holds ${w.length} < ${rows * cols} values`);
  const key = tensorKey(name);
  const expKey = tensorKey(generatorNames.blockExponent(name));
  const base = matrixBaseScale(fanIn);
  const blockCols = cols / QUANT_BLOCK;
  const rowScales = new Float32Array(blockCols);
  for (let r = 0; r < rows; r++) {
    if (r % QUANT_BLOCK === 0) {
      const br = r / QUANT_BLOCK;
      for (let bc = 0; bc < blockCols; bc++) {
        const exponent = (hash32(seed, expKey, br * blockCols + bc) % 3) - 1;
        rowScales[bc] = base * 2 ** exponent;
      }
    }
    const rowStart = r * cols;
    for (let bc = 0; bc < blockCols; bc++) {
      const at = rowStart + bc * QUANT_BLOCK;
      fillUniform(w, seed, key, at, rowScales[bc], at, QUANT_BLOCK);
    }
  }
  return w;
}

/** The named matrix, generated then block-quantized to FP8 with `quantizeWeightBlocks`. */
export function generateBlockQuantized(
  seed: number,
  name: string,
  rows: number,
  cols: number,
  fanIn: number,
  scratch?: Float32Array,
): BlockQuantized {
  const w = generateMatrix(seed, name, rows, cols, fanIn, scratch);
  const { q, scales } = quantizeWeightBlocks(w, rows, cols);
  return { q, scales, rows, cols };
}

/**
 * The named matrix, generated then quantized to MXFP4 with `quantizeMxfp4` (per 32-group along a row:
 * scale byte = the smallest power of two s with amax/s ≤ 6, codes = e2m1 RNE of x/s). The fp32 values
 * are the FP8 path's, so both formats of one seed hold the same underlying weights.
 */
export function generateMxfp4(
  seed: number,
  name: string,
  rows: number,
  cols: number,
  fanIn: number,
  scratch?: Float32Array,
): Mxfp4Matrix {
  const w = generateMatrix(seed, name, rows, cols, fanIn, scratch);
  return quantizeMxfp4(w, rows, cols);
}

function generateSpec(seed: number, m: MatrixSpec, scratch?: Float32Array): BlockQuantized {
  return generateBlockQuantized(seed, m.name, m.rows, m.cols, m.fanIn, scratch);
}

/** Routed expert e in the config's expertFormat: W1 [2I, H] (fan-in H), W2 [H, I] (fan-in I). */
export function generateExpert(
  config: MoEConfig,
  seed: number,
  e: number,
  scratch?: Float32Array,
): RoutedExpertWeights {
  checkExpertIndex(config, e);
  return generateNumberedExpert(config, seed, e, scratch);
}

/**
 * Expert e of the generator's numbering, not checked against config.numExperts: a rank's layer holds
 * experts firstExpert .. of the whole layer's (`MoEWeightSource.generated`).
 */
export function generateNumberedExpert(
  config: MoEConfig,
  seed: number,
  e: number,
  scratch?: Float32Array,
): RoutedExpertWeights {
  const m = expertMatrixSpecs(config, e);
  if (expertFormatOf(config) === "fp4") {
    const mx = (s: MatrixSpec) => generateMxfp4(seed, s.name, s.rows, s.cols, s.fanIn, scratch);
    return { format: "fp4", w1: mx(m.w1), w2: mx(m.w2) };
  }
  return { w1: generateSpec(seed, m.w1, scratch), w2: generateSpec(seed, m.w2, scratch) };
}

/** The fused shared experts (intermediate · numShared), or null when numShared is 0. */
export function generateSharedExpert(
  config: MoEConfig,
  seed: number,
  scratch?: Float32Array,
): ExpertWeights | null {
  if (config.numShared === 0) return null;
  const m = sharedMatrixSpecs(config);
  return { w1: generateSpec(seed, m.w1, scratch), w2: generateSpec(seed, m.w2, scratch) };
}

/**
 * Gate weight [E, H]: bf16(fround(uniformSym · sqrt(3/H))) (std 1/sqrt(H), no block factors: the gate is
 * not block-quantized); bias [E] = fround(uniformSym · 2^−4) when the config has a correction bias.
 */
export function generateGate(config: MoEConfig, seed: number): GateWeights {
  checkSeed(seed);
  const { numExperts: e, hidden: h } = config;
  const w = new Float32Array(e * h);
  fillUniform(w, seed, tensorKey(generatorNames.gateWeight), 0, gateWeightScale(h));
  let bias: Float32Array | null = null;
  if (config.router.correctionBias) {
    bias = new Float32Array(e);
    fillUniform(bias, seed, tensorKey(generatorNames.gateBias), 0, GATE_BIAS_SCALE);
  }
  return { weight: bf16FromF32Array(w), bias };
}

export interface GeneratedWeightsOptions {
  /** Routed experts kept in memory, least recently used evicted first (default 4). */
  cachedExperts?: number;
}

/** Seeded weights for a config, made on demand; see docs/weights.md. */
export class GeneratedWeights implements MoEWeightSource {
  readonly config: ValidatedConfig;
  readonly seed: number;
  readonly generated: { seed: number; firstExpert: number };
  private readonly experts: ExpertCache;
  private sharedWeights: ExpertWeights | null | undefined;
  private gateWeights: GateWeights | undefined;
  /** One fp32 buffer reused for every matrix before quantization, to spare the GC 100 MB per expert. */
  private scratch: Float32Array | undefined;

  /** `config` may be raw (validated here, once) or already validated. */
  constructor(config: MoEConfig | ValidatedConfig, seed: number, opts: GeneratedWeightsOptions = {}) {
    this.config = validateConfig(config);
    checkSeed(seed);
    checkOptionFields("GeneratedWeights options", opts, ["cachedExperts"], (m) => new RangeError(m));
    this.seed = seed;
    this.generated = { seed, firstExpert: 0 };
    this.experts = new ExpertCache(this.config, opts.cachedExperts ?? 4);
  }

  expert(e: number): RoutedExpertWeights {
    return this.experts.get(e, () =>
      generateExpert(this.config, this.seed, e, this.scratchFor(this.config.intermediate)),
    );
  }

  shared(): ExpertWeights | null {
    if (this.sharedWeights === undefined) {
      const si = sharedIntermediate(this.config);
      this.sharedWeights =
        si === 0 ? null : generateSharedExpert(this.config, this.seed, this.scratchFor(si));
    }
    return this.sharedWeights;
  }

  gate(): GateWeights {
    this.gateWeights ??= generateGate(this.config, this.seed);
    return this.gateWeights;
  }

  /** The scratch buffer, grown to hold W1 of an MLP with this intermediate size (W1 ≥ W2 in size). */
  private scratchFor(intermediate: number): Float32Array {
    const need = 2 * intermediate * this.config.hidden;
    if (this.scratch === undefined || this.scratch.length < need) this.scratch = new Float32Array(need);
    return this.scratch;
  }
}

/**
 * Activations x [tokens, hidden] as bf16 bits: std ≈ 1, a per-token scale in {1/4, 1/2, 1, 2} and about
 * one outlier (8×) per 256 channels, as real hidden states have. Element (t, c) with h = hash32(seed,
 * key("input"), t·hidden + c) is bf16(fround(((h >>> 8) − 2^23) · 2^−23 · s_t · (h & 0xFF ? 1 : 8))),
 * s_t = fround(ACTIVATION_BASE · TOKEN_SCALES[hash32(seed, key("input.token_scale"), t) >>> 30]).
 */
export function generateActivations(seed: number, tokens: number, hidden: number): Uint16Array {
  checkSeed(seed);
  if (!Number.isInteger(tokens) || tokens < 0 || !Number.isInteger(hidden) || hidden <= 0) {
    throw new RangeError(`tokens and hidden must be non-negative integers, got ${tokens} and ${hidden}`);
  }
  if (tokens * hidden > 2 ** 32)
    throw new RangeError(`tokens·hidden = ${tokens * hidden} exceeds 2^32 indices`);
  const key = tensorKey(generatorNames.input);
  const tokenKey = tensorKey(generatorNames.inputTokenScale);
  const hashes = new Uint32Array(hidden);
  const row = new Float32Array(hidden);
  const out = new Uint16Array(tokens * hidden);
  for (let t = 0; t < tokens; t++) {
    const s = ACTIVATION_BASE * TOKEN_SCALES[hash32(seed, tokenKey, t) >>> 30];
    // Both factors are exact powers of two times an fp32, so each step is exact (no extra rounding).
    const step = s * 2 ** -23;
    const outlierStep = step * OUTLIER_FACTOR;
    fillHash32(hashes, seed, key, t * hidden);
    for (let c = 0; c < hidden; c++) {
      const h = hashes[c];
      row[c] = ((h >>> 8) - 8388608) * ((h & 0xff) === 0 ? outlierStep : step);
    }
    out.set(bf16FromF32Array(row), t * hidden);
  }
  return out;
}
