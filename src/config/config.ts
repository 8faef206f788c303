/**
 * MoE layer shapes: presets, custom shapes and their validation.
 *
 * Every backend reads the same `MoEConfig`; `validateConfig` is the one place that decides what the
 * project supports, so an unsupported value fails here with a message naming it, never later as
 * silent corruption.
 */

/** Router scoring function applied to the gate logits. */
export type ScoringFunction = "sigmoid" | "softmax" | "sqrtsoftplus";

/** How activation scales are stored: plain FP32, or FP32 holding a power of two (UE8M0). */
export type ScaleFormat = "fp32" | "ue8m0";

export const SCALE_FORMATS: readonly ScaleFormat[] = ["fp32", "ue8m0"];

/**
 * How routed experts' W1/W2 are stored: FP8 e4m3 with one fp32 scale per 128×128 block, or MXFP4 (e2m1
 * with one UE8M0 scale per 32 elements along K), DeepSeek-V4's own checkpoint format. Shared experts are
 * FP8 either way, as in V4.
 */
export type ExpertFormat = "fp8" | "fp4";

export const EXPERT_FORMATS: readonly ExpertFormat[] = ["fp8", "fp4"];

/** The config's expert format; absent means "fp8", so configs written before FP4 keep their meaning. */
export function expertFormatOf(c: MoEConfig): ExpertFormat {
  return c.expertFormat ?? "fp8";
}

/** The -D macro by which every kernel that writes or reads FP8 scales is specialized for `format`. */
export function scaleFormatDefine(format: ScaleFormat): { SCALE_UE8M0: 0 | 1 } {
  return { SCALE_UE8M0: format === "ue8m0" ? 1 : 0 };
}

export interface RouterConfig {
  scoring: ScoringFunction;
  /** Experts are split into nGroup groups; 1 disables group-limited routing. */
  nGroup: number;
  /** With group-limited routing: how many groups a token may draw its experts from. */
  topkGroup: number;
  /** Whether the gate has a per-expert correction bias (used for selection only). */
  correctionBias: boolean;
  /** Renormalize the chosen k weights to sum to 1 before scaling. */
  renormalize: boolean;
  routedScalingFactor: number;
  /**
   * DeepSeek-V4's first layers: experts chosen by the token id (gate.tid2eid), weighted from the gate's
   * scores; such layers have no correction bias. Absent means false.
   */
  hashRouted?: boolean;
}

export interface MoEConfig {
  /** Preset name or "custom". */
  name: string;
  /** Routed experts held by this layer (on one rank: the rank's local experts). */
  numExperts: number;
  hidden: number;
  /** Intermediate size of one routed expert (W1 has 2·intermediate rows). */
  intermediate: number;
  topK: number;
  /** Shared experts; they are fused into one MLP of intermediate · numShared rows. */
  numShared: number;
  /** Expert-parallel ranks the routed experts are split among (numExperts % ranks == 0). */
  ranks: number;
  /** SwiGLU clamp c (silu(min(g, c)) · clamp(u, −c, c)); null for none. */
  swigluClamp: number | null;
  /** Activation scale format of the FP8 rows (input and intermediate). */
  scaleFormat: ScaleFormat;
  router: RouterConfig;
  /** Routed experts' weight format (default "fp8"); see ExpertFormat. */
  expertFormat?: ExpertFormat;
  /** Largest token count a layer instance accepts. */
  maxTokens: number;
}

/** Channels per activation scale and the edge of a weight-scale block. */
export const QUANT_BLOCK = 128;
export const MAX_TOKENS_LIMIT = 65536;

const DEEPSEEK_V4_ROUTER: RouterConfig = {
  scoring: "sqrtsoftplus",
  nGroup: 1,
  topkGroup: 1,
  correctionBias: true,
  renormalize: true,
  routedScalingFactor: 1.5,
};

const FLASH = {
  numExperts: 256,
  hidden: 4096,
  intermediate: 2048,
  topK: 6,
  numShared: 1,
  ranks: 1,
  swigluClamp: 10,
  scaleFormat: "fp32" as ScaleFormat,
  router: DEEPSEEK_V4_ROUTER,
  maxTokens: 8192,
};

export const PRESETS: Record<string, MoEConfig> = {
  tiny: {
    name: "tiny",
    numExperts: 8,
    hidden: 256,
    intermediate: 128,
    topK: 2,
    numShared: 1,
    ranks: 1,
    swigluClamp: 10,
    scaleFormat: "fp32",
    router: { ...DEEPSEEK_V4_ROUTER, scoring: "sigmoid", nGroup: 4, topkGroup: 2 },
    maxTokens: 1024,
  },
  flash: { name: "flash", ...FLASH },
  pro: {
    name: "pro",
    ...FLASH,
    numExperts: 384,
    hidden: 7168,
    intermediate: 3072,
    router: { ...DEEPSEEK_V4_ROUTER, routedScalingFactor: 2.5 },
  },
  /** One rank of an 8-GPU flash deployment: its 32 local experts, tokens routed among them. */
  "flash-ep8": { name: "flash-ep8", ...FLASH, numExperts: 32 },
};

export class ConfigError extends Error {
  override name = "ConfigError";
}

function requireInteger(field: string, value: number, min: number, max = Number.MAX_SAFE_INTEGER): void {
  if (!Number.isInteger(value) || value < min || value > max) {
    throw new ConfigError(`${field} must be an integer in [${min}, ${max}], got ${value}`);
  }
}

/** Checks every field and returns the config unchanged; throws ConfigError naming the first bad field. */
export function validateConfig(c: MoEConfig): MoEConfig {
  requireInteger("numExperts", c.numExperts, 1, 4096);
  requireInteger("hidden", c.hidden, QUANT_BLOCK, 65536);
  requireInteger("intermediate", c.intermediate, QUANT_BLOCK, 65536);
  if (c.hidden % QUANT_BLOCK !== 0) {
    throw new ConfigError(`hidden must be a multiple of ${QUANT_BLOCK}, got ${c.hidden}`);
  }
  if (c.intermediate % QUANT_BLOCK !== 0) {
    throw new ConfigError(`intermediate must be a multiple of ${QUANT_BLOCK}, got ${c.intermediate}`);
  }
  requireInteger("topK", c.topK, 1, 64);
  if (c.topK > c.numExperts) {
    throw new ConfigError(`topK (${c.topK}) must not exceed numExperts (${c.numExperts})`);
  }
  requireInteger("numShared", c.numShared, 0, 16);
  requireInteger("ranks", c.ranks, 1, 1024);
  if (c.numExperts % c.ranks !== 0) {
    throw new ConfigError(`numExperts (${c.numExperts}) must be a multiple of ranks (${c.ranks})`);
  }
  if (c.swigluClamp !== null && !(Number.isFinite(c.swigluClamp) && c.swigluClamp > 0)) {
    throw new ConfigError(`swigluClamp must be a positive finite number or null, got ${c.swigluClamp}`);
  }
  if (!SCALE_FORMATS.includes(c.scaleFormat)) {
    throw new ConfigError(`scaleFormat must be "fp32" or "ue8m0", got ${String(c.scaleFormat)}`);
  }
  if (c.expertFormat !== undefined && !EXPERT_FORMATS.includes(c.expertFormat)) {
    throw new ConfigError(`expertFormat must be "fp8" or "fp4", got ${String(c.expertFormat)}`);
  }
  requireInteger("maxTokens", c.maxTokens, 1, MAX_TOKENS_LIMIT);
  const r = c.router;
  if (!["sigmoid", "softmax", "sqrtsoftplus"].includes(r.scoring)) {
    throw new ConfigError(
      `router.scoring must be sigmoid, softmax or sqrtsoftplus, got ${String(r.scoring)}`,
    );
  }
  requireInteger("router.nGroup", r.nGroup, 1, c.numExperts);
  if (c.numExperts % r.nGroup !== 0) {
    throw new ConfigError(`numExperts (${c.numExperts}) must be a multiple of router.nGroup (${r.nGroup})`);
  }
  requireInteger("router.topkGroup", r.topkGroup, 1, r.nGroup);
  if (r.nGroup > 1 && (c.numExperts / r.nGroup) * r.topkGroup < c.topK) {
    throw new ConfigError(
      `router.topkGroup (${r.topkGroup}) groups of ${c.numExperts / r.nGroup} experts cannot hold topK (${c.topK})`,
    );
  }
  if (!(Number.isFinite(r.routedScalingFactor) && r.routedScalingFactor > 0)) {
    throw new ConfigError(
      `router.routedScalingFactor must be positive and finite, got ${r.routedScalingFactor}`,
    );
  }
  if (r.hashRouted === true && r.correctionBias) {
    throw new ConfigError(
      "router.hashRouted layers choose experts by token id: router.correctionBias must be false",
    );
  }
  return c;
}

/** Intermediate size of the fused shared-expert MLP. */
export function sharedIntermediate(c: MoEConfig): number {
  return c.intermediate * c.numShared;
}

export function presetNames(): string[] {
  return Object.keys(PRESETS);
}

/** A preset by name, with optional overrides; the result is validated. */
export function resolveConfig(name: string, overrides: Partial<MoEConfig> = {}): MoEConfig {
  const base = PRESETS[name];
  if (base === undefined) {
    throw new ConfigError(
      `unknown shape "${name}": expected one of ${presetNames().join(", ")} or a custom shape`,
    );
  }
  return validateConfig({ ...base, ...overrides, router: { ...base.router, ...(overrides.router ?? {}) } });
}

/** A preset by name with maxTokens raised to fit `tokens` (the config of a run or benchmark of that many). */
export function resolveConfigForTokens(name: string, tokens: number): MoEConfig {
  const base = resolveConfig(name);
  return resolveConfig(name, { maxTokens: Math.max(base.maxTokens, tokens) });
}
