/**
 * MoE layer shapes: presets, custom shapes and their validation.
 *
 * Every backend reads the same `MoEConfig`; `validateConfig` is the one place that decides what the
 * project supports, so an unsupported value (or an unknown field) fails here with a message naming it,
 * never later as silent corruption. It returns a frozen `ValidatedConfig`, which nothing checks again.
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
/**
 * The most elements one typed array may hold (V8's limit on 64-bit hosts): a larger length is a raw
 * `RangeError: Invalid typed array length` when the reference or the weight generator allocates it, so
 * `validateConfig` bounds the largest of their arrays by it (see `allocationProblem`).
 */
export const MAX_ARRAY_ELEMENTS = 2 ** 32;

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

const PRESET_CONFIGS: Record<string, MoEConfig> = {
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

/**
 * The brand of a config `validateConfig` has checked. Type-only (no such class exists at run time); its
 * private field makes it nominal, so a spread copy of a validated config (`{ ...c, hidden: 384 }`) is
 * not one and must be validated again.
 */
// biome-ignore lint/correctness/noUnusedPrivateClassMembers: the private field is the brand; nothing reads it.
export declare abstract class ValidatedConfigBrand {
  #validated: true;
}

/**
 * A config `validateConfig` (or `resolveConfig`) has checked: frozen, so it stays valid. Functions that
 * take one do not check it again; constructors that take a config accept either kind and validate a
 * raw one once.
 */
export type ValidatedConfig = Readonly<Omit<MoEConfig, "router">> & {
  readonly router: Readonly<RouterConfig>;
} & ValidatedConfigBrand;

/** Every config `validateConfig` returned: the run-time counterpart of the brand. */
const validated = new WeakSet<object>();

/** Whether `c` is a config `validateConfig` returned (a membership test: nothing is checked again). */
export function isValidatedConfig(c: unknown): c is ValidatedConfig {
  return typeof c === "object" && c !== null && validated.has(c);
}

const CONFIG_FIELDS: readonly (keyof MoEConfig)[] = [
  "name",
  "numExperts",
  "hidden",
  "intermediate",
  "topK",
  "numShared",
  "ranks",
  "swigluClamp",
  "scaleFormat",
  "router",
  "expertFormat",
  "maxTokens",
];
const ROUTER_FIELDS: readonly (keyof RouterConfig)[] = [
  "scoring",
  "nGroup",
  "topkGroup",
  "correctionBias",
  "renormalize",
  "routedScalingFactor",
  "hashRouted",
];

/**
 * A short description of a value for an error message: a number as `number 5`; any other primitive by
 * its type and its value as written in source (`the string "1"`, `the bigint 1n`, `the boolean true`),
 * so "1" and 1n never read as the number 1; an object by its constructor's name.
 */
export function describeValue(v: unknown): string {
  if (v === null) return "null";
  // typeof and String() both give "undefined": say it once, not "got undefined undefined".
  if (v === undefined) return "undefined";
  if (Array.isArray(v)) return "Array";
  if (typeof v === "object") return (v as object).constructor?.name ?? "object";
  if (typeof v === "function") return "function";
  if (typeof v === "number") return `number ${String(v)}`;
  if (typeof v === "string") return `the string ${JSON.stringify(v)}`;
  if (typeof v === "bigint") return `the bigint ${String(v)}n`;
  return `the ${typeof v} ${String(v)}`;
}

function editDistance(a: string, b: string): number {
  const row = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    let diagonal = row[0]!;
    row[0] = i;
    for (let j = 1; j <= b.length; j++) {
      const above = row[j]!;
      row[j] = Math.min(above + 1, row[j - 1]! + 1, diagonal + (a[i - 1] === b[j - 1] ? 0 : 1));
      diagonal = above;
    }
  }
  return row[b.length]!;
}

/** The known name nearest to `name` (case-insensitive edit distance, or a prefix), if one is near. */
export function nearestName(name: string, known: readonly string[]): string | undefined {
  const lower = name.toLowerCase();
  let best: string | undefined;
  let bestDistance = Number.POSITIVE_INFINITY;
  for (const k of known) {
    const kl = k.toLowerCase();
    const d = lower.startsWith(kl) || kl.startsWith(lower) ? 1 : editDistance(lower, kl);
    if (d < bestDistance) {
      best = k;
      bestDistance = d;
    }
  }
  return bestDistance <= Math.max(2, Math.floor(name.length / 3)) ? best : undefined;
}

/**
 * "unknown <where> field k (did you mean …?); known: …" for the first key of `value` not in `known`,
 * or null: for options objects, where a misspelt field would otherwise be ignored without a word.
 */
export function unknownFieldProblem(where: string, value: object, known: readonly string[]): string | null {
  const key = Object.keys(value).find((k) => !known.includes(k));
  if (key === undefined) return null;
  const near = nearestName(key, known);
  return `unknown ${where} field ${key}${near === undefined ? "" : ` (did you mean ${near}?)`}; known: ${known.join(", ")}`;
}

/**
 * Throws `error(message)` unless `options` is undefined or an object whose fields are all in `known`:
 * the one rule of every options object of the API, as of configs, so that a misspelt field is an error
 * rather than a default taken without a word. `where` names the options ("RandomV4Weights options").
 */
export function checkOptionFields(
  where: string,
  options: unknown,
  known: readonly string[],
  error: (message: string) => Error,
): void {
  if (options === undefined) return;
  if (!isPlainObject(options)) throw error(`${where} must be an object, got ${describeValue(options)}`);
  const problem = unknownFieldProblem(where, options, known);
  if (problem !== null) throw error(problem);
}

function checkKnownFields(where: string, value: object, known: readonly string[]): void {
  for (const key of Object.keys(value)) {
    if (known.includes(key)) continue;
    const near = nearestName(key, known);
    throw new ConfigError(
      `unknown config field ${where}${key}${near === undefined ? "" : ` (did you mean ${where}${near}?)`}; known: ${known.join(", ")}`,
    );
  }
}

function isPlainObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function requireInteger(field: string, value: number, min: number, max = Number.MAX_SAFE_INTEGER): void {
  if (!Number.isInteger(value) || value < min || value > max) {
    throw new ConfigError(`${field} must be an integer in [${min}, ${max}], got ${describeValue(value)}`);
  }
}

function requireBoolean(field: string, value: unknown): void {
  if (typeof value !== "boolean") {
    throw new ConfigError(`${field} must be true or false, got ${describeValue(value)}`);
  }
}

/**
 * The largest arrays the CPU reference and the weight generators allocate for a config, each at most
 * MAX_ARRAY_ELEMENTS elements: one MLP's W1 (its e4m3 codes, and the generator's fp32 buffer) of
 * 2 · intermediate · hidden elements for a routed expert and 2 · intermediate · numShared · hidden for
 * the fused shared one, and the reference's per-slot expert outputs of maxTokens · topK · hidden. (x and
 * the output, maxTokens · hidden, and the gate, numExperts · hidden, fit by the fields' own bounds.)
 */
function allocationProblem(c: MoEConfig): string | null {
  const shared = Math.max(c.numShared, 1);
  const w1 = 2 * c.intermediate * shared * c.hidden;
  if (w1 > MAX_ARRAY_ELEMENTS) {
    const what =
      c.numShared > 1
        ? `2 · intermediate · numShared · hidden = 2 · ${c.intermediate} · ${c.numShared} · ${c.hidden}`
        : `2 · intermediate · hidden = 2 · ${c.intermediate} · ${c.hidden}`;
    return `${what} = ${w1} elements of one W1 exceed ${MAX_ARRAY_ELEMENTS} (2^32), the most one array can hold`;
  }
  const slots = c.maxTokens * c.topK * c.hidden;
  if (slots > MAX_ARRAY_ELEMENTS) {
    return `maxTokens · topK · hidden = ${c.maxTokens} · ${c.topK} · ${c.hidden} = ${slots} expert outputs exceed ${MAX_ARRAY_ELEMENTS} (2^32), the most one array can hold`;
  }
  return null;
}

/**
 * Checks every field (and that there are no others) and returns the config as a frozen
 * `ValidatedConfig` copy; a config this function returned comes back as it is, unchecked. Throws
 * ConfigError naming the first bad field. Fields in range can still size an array past
 * MAX_ARRAY_ELEMENTS (2^32): 2 · intermediate · max(numShared, 1) · hidden (one W1) and
 * maxTokens · topK · hidden (the reference's expert outputs) must each be at most 2^32, a ConfigError
 * naming the fields and the product otherwise.
 */
export function validateConfig(c: MoEConfig | ValidatedConfig): ValidatedConfig {
  if (isValidatedConfig(c)) return c;
  if (!isPlainObject(c)) throw new ConfigError(`a config must be an object, got ${describeValue(c)}`);
  checkKnownFields("", c, CONFIG_FIELDS);
  if (typeof c.name !== "string")
    throw new ConfigError(`name must be a string, got ${describeValue(c.name)}`);
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
  if (
    c.swigluClamp !== null &&
    !(typeof c.swigluClamp === "number" && Number.isFinite(c.swigluClamp) && c.swigluClamp > 0)
  ) {
    throw new ConfigError(
      `swigluClamp must be a positive finite number or null, got ${describeValue(c.swigluClamp)}`,
    );
  }
  if (!SCALE_FORMATS.includes(c.scaleFormat)) {
    throw new ConfigError(`scaleFormat must be "fp32" or "ue8m0", got ${describeValue(c.scaleFormat)}`);
  }
  if (c.expertFormat !== undefined && !EXPERT_FORMATS.includes(c.expertFormat)) {
    throw new ConfigError(`expertFormat must be "fp8" or "fp4", got ${describeValue(c.expertFormat)}`);
  }
  requireInteger("maxTokens", c.maxTokens, 1, MAX_TOKENS_LIMIT);
  const tooLarge = allocationProblem(c);
  if (tooLarge !== null) throw new ConfigError(tooLarge);
  const r = c.router;
  if (!isPlainObject(r)) throw new ConfigError(`router must be an object, got ${describeValue(r)}`);
  checkKnownFields("router.", r, ROUTER_FIELDS);
  if (!["sigmoid", "softmax", "sqrtsoftplus"].includes(r.scoring)) {
    throw new ConfigError(
      `router.scoring must be sigmoid, softmax or sqrtsoftplus, got ${describeValue(r.scoring)}`,
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
  requireBoolean("router.correctionBias", r.correctionBias);
  requireBoolean("router.renormalize", r.renormalize);
  if (
    !(
      typeof r.routedScalingFactor === "number" &&
      Number.isFinite(r.routedScalingFactor) &&
      r.routedScalingFactor > 0
    )
  ) {
    throw new ConfigError(
      `router.routedScalingFactor must be positive and finite, got ${describeValue(r.routedScalingFactor)}`,
    );
  }
  if (r.hashRouted !== undefined) requireBoolean("router.hashRouted", r.hashRouted);
  if (r.hashRouted === true && r.correctionBias) {
    throw new ConfigError(
      "router.hashRouted layers choose experts by token id: router.correctionBias must be false",
    );
  }
  const out = Object.freeze({ ...c, router: Object.freeze({ ...r }) }) as unknown as ValidatedConfig;
  validated.add(out);
  return out;
}

/** The presets, validated once when the module loads. */
export const PRESETS: Readonly<Record<string, ValidatedConfig>> = Object.freeze(
  Object.fromEntries(Object.entries(PRESET_CONFIGS).map(([k, v]) => [k, validateConfig(v)])),
);

/** Intermediate size of the fused shared-expert MLP. */
export function sharedIntermediate(c: MoEConfig | ValidatedConfig): number {
  return c.intermediate * c.numShared;
}

export function presetNames(): string[] {
  return Object.keys(PRESETS);
}

/** Overrides of a preset's fields; `router` may override some of the router's. */
export type ConfigOverrides = Partial<Omit<MoEConfig, "router">> & { router?: Partial<RouterConfig> };

/** A preset by name, with optional overrides; the result is validated (an unknown field is an error). */
export function resolveConfig(name: string, overrides: ConfigOverrides = {}): ValidatedConfig {
  if (typeof name !== "string" || !Object.hasOwn(PRESETS, name)) {
    throw new ConfigError(
      `unknown shape ${typeof name === "string" ? `"${name}"` : describeValue(name)}: expected one of ${presetNames().join(", ")} or a custom shape`,
    );
  }
  if (!isPlainObject(overrides)) {
    throw new ConfigError(`overrides must be an object, got ${describeValue(overrides)}`);
  }
  const base = PRESETS[name]!;
  const router = overrides.router ?? {};
  if (!isPlainObject(router)) {
    throw new ConfigError(`overrides.router must be an object, got ${describeValue(router)}`);
  }
  return validateConfig({ ...base, ...overrides, router: { ...base.router, ...router } } as MoEConfig);
}

/**
 * A preset by name with maxTokens raised to fit `tokens` (the config of a run or benchmark of that
 * many), and optional further overrides (e.g. `{ expertFormat: "fp4" }`).
 */
export function resolveConfigForTokens(
  name: string,
  tokens: number,
  overrides: ConfigOverrides = {},
): ValidatedConfig {
  const base = resolveConfig(name, overrides);
  return resolveConfig(name, { ...overrides, maxTokens: Math.max(base.maxTokens, tokens) });
}
