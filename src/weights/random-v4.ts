/**
 * Seeded random weights in the forms a DeepSeek-V4 checkpoint can hold exactly: FP8 experts with
 * power-of-two (E8M0) block scales or MXFP4 experts, a bf16 gate, a bias or a tid2eid table. For tests,
 * scripts and small example checkpoints (saveCheckpoint); the generator of generate.ts has fp32 block
 * scales that the V4 layout cannot store.
 */
import {
  checkOptionFields,
  describeValue,
  type MoEConfig,
  QUANT_BLOCK,
  type ValidatedConfig,
  validateConfig,
} from "../config/config.js";
import { f32ToBf16Bits } from "../numerics/bf16.js";
import { checkSeed } from "../numerics/counter-rng.js";
import { E4M3_DECODE } from "../numerics/fp8.js";
import { ExpertCache } from "./expert-cache.js";
import {
  type BlockQuantized,
  type ExpertWeights,
  type GateWeights,
  type MoEWeightSource,
  MXFP4_GROUP,
  type Mxfp4Matrix,
  type RoutedExpertWeights,
} from "./types.js";

/** xorshift32 stream from a seed and a stream number (fast enough for gigabytes of bytes). */
function stream(seed: number, n: number): () => number {
  let s = (Math.imul(seed ^ 0x85ebca6b, 0x9e3779b1) ^ Math.imul(n + 1, 0xc2b2ae35)) >>> 0 || 1;
  return () => {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    return s >>> 0;
  };
}

/** Fills bytes with random values, four at a time. */
function fillBytes(out: Uint8Array, next: () => number): void {
  const words = Math.floor(out.length / 4);
  const u32 = new Uint32Array(out.buffer, out.byteOffset, words);
  for (let i = 0; i < words; i++) u32[i] = next();
  for (let i = words * 4; i < out.length; i++) out[i] = next() & 0xff;
}

/**
 * The largest vocab of a generated tid2eid: 2^24 token ids (V4's vocabulary is 129,280), so that the
 * table, vocab · topK int32, stays far below what one array can hold (MAX_ARRAY_ELEMENTS).
 */
export const MAX_VOCAB = 2 ** 24;

export interface RandomV4Options {
  /** Vocabulary of a hash-routed layer's tid2eid: an integer in [1, MAX_VOCAB] (default 64). */
  vocab?: number;
  /** Routed experts kept in memory (default 2). */
  cachedExperts?: number;
}

/**
 * Weights of `config` for `seed`: FP8 experts (codes uniform over the finite e4m3 codes of magnitude
 * ≤ 1, scales 2^−9…2^−6) or, with config.expertFormat "fp4", MXFP4 experts (uniform nibbles, E8M0 bytes
 * 118…121); the shared expert is FP8; the gate bf16 in ±1/√H; a bias in ±1/16 for score-routed layers, a
 * tid2eid of distinct experts for hash-routed ones.
 */
export class RandomV4Weights implements MoEWeightSource {
  readonly config: ValidatedConfig;
  private readonly cache: ExpertCache;
  private readonly vocab: number;
  private gateWeights: GateWeights | undefined;
  private sharedWeights: ExpertWeights | null | undefined;

  /**
   * `seed` under the one seed rule of every generator (`checkSeed`); `opts.vocab` in [1, MAX_VOCAB].
   * Throws RangeError naming the bad argument or option field.
   */
  constructor(
    config: MoEConfig,
    readonly seed: number,
    opts: RandomV4Options = {},
  ) {
    this.config = validateConfig(config);
    checkSeed(seed);
    checkOptionFields("RandomV4Weights options", opts, ["vocab", "cachedExperts"], (m) => new RangeError(m));
    this.cache = new ExpertCache(this.config, opts.cachedExperts ?? 2);
    this.vocab = opts.vocab ?? 64;
    if (!Number.isInteger(this.vocab) || this.vocab < 1 || this.vocab > MAX_VOCAB) {
      throw new RangeError(
        `RandomV4Weights options.vocab must be an integer in [1, ${MAX_VOCAB}], got ${describeValue(opts.vocab)}`,
      );
    }
  }

  expert(e: number): RoutedExpertWeights {
    return this.cache.get(e, () => {
      const c = this.config;
      if (c.expertFormat === "fp4") {
        return {
          format: "fp4",
          w1: this.fp4(2 * c.intermediate, c.hidden, 10 + 2 * e),
          w2: this.fp4(c.hidden, c.intermediate, 11 + 2 * e),
        };
      }
      return this.fp8Mlp(c.intermediate, 10 + 2 * e);
    });
  }

  shared(): ExpertWeights | null {
    if (this.sharedWeights === undefined) {
      const c = this.config;
      this.sharedWeights = c.numShared === 0 ? null : this.fp8Mlp(c.intermediate * c.numShared, 1);
    }
    return this.sharedWeights;
  }

  gate(): GateWeights {
    if (this.gateWeights === undefined) {
      const c = this.config;
      const next = stream(this.seed, 0);
      const unit = () => next() / 2 ** 31 - 1;
      const amp = 1 / Math.sqrt(c.hidden);
      const weight = new Uint16Array(c.numExperts * c.hidden);
      for (let i = 0; i < weight.length; i++) weight[i] = f32ToBf16Bits(Math.fround(unit() * amp));
      let bias: Float32Array | null = null;
      let tid2eid: Int32Array | null = null;
      if (c.router.hashRouted === true) {
        tid2eid = new Int32Array(this.vocab * c.topK);
        for (let t = 0; t < this.vocab; t++) {
          // k distinct experts: a random start and a stride coprime to nothing in particular, then probing.
          const used = new Set<number>();
          let id = next() % c.numExperts;
          for (let j = 0; j < c.topK; j++) {
            while (used.has(id)) id = (id + 1) % c.numExperts;
            used.add(id);
            tid2eid[t * c.topK + j] = id;
            id = next() % c.numExperts;
          }
        }
      } else if (c.router.correctionBias) {
        bias = Float32Array.from({ length: c.numExperts }, () => Math.fround(unit() / 16));
      }
      this.gateWeights = { weight, bias, tid2eid };
    }
    return this.gateWeights;
  }

  private fp8Mlp(inter: number, n: number): ExpertWeights {
    const h = this.config.hidden;
    return { w1: this.fp8(2 * inter, h, 1000 + 2 * n), w2: this.fp8(h, inter, 1001 + 2 * n) };
  }

  private fp8(rows: number, cols: number, n: number): BlockQuantized {
    const next = stream(this.seed, n);
    const q = new Uint8Array(rows * cols);
    fillBytes(q, next);
    // Keep codes of magnitude ≤ 1 (exponent field ≤ 7): no NaN codes, values of a usable range.
    for (let i = 0; i < q.length; i++) q[i] &= 0xbf;
    for (let i = 0; i < q.length; i++) if (Number.isNaN(E4M3_DECODE[q[i]])) q[i] = 0;
    const scales = new Float32Array((rows / QUANT_BLOCK) * (cols / QUANT_BLOCK));
    for (let i = 0; i < scales.length; i++) scales[i] = 2 ** -(6 + (next() % 4));
    return { q, scales, rows, cols };
  }

  private fp4(rows: number, cols: number, n: number): Mxfp4Matrix {
    const next = stream(this.seed, n);
    const packed = new Uint8Array((rows * cols) / 2);
    fillBytes(packed, next);
    const scales = new Uint8Array((rows * cols) / MXFP4_GROUP);
    for (let i = 0; i < scales.length; i++) scales[i] = 118 + (next() % 4);
    return { packed, scales, rows, cols };
  }
}
