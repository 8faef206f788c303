/**
 * lab/soak: many forwards over random layer shapes, token counts, routing skews and masks, through the
 * fused and the unfused GPU pipelines (or the CPU reference), checking what only a long run shows:
 *
 * - memory: the device's free memory (cuMemGetInfo) and the project's own allocation count are the same
 *   after the run as before it (no leak);
 * - repeat: every forward run twice gives the same bytes (the first run on NaN-poisoned scratch, the
 *   second on whatever the previous forward left);
 * - cross: the fused pipeline's output equals the unfused one's bit for bit (docs/design.md);
 * - finite: no NaN or Inf in an output (every input is finite, and outputs start NaN-poisoned, so an
 *   element never written fails too);
 * - watchdog: no fused-kernel watchdog trip (FusedMoEKernelError) and no grouped-GEMM stall.
 *
 * Every new shape costs a JIT compile, so a run draws a bounded number of shapes and many forwards per
 * shape. It runs in two passes: the first opens every shape and runs it once at each of its token counts
 * (compiling and loading every kernel module, which stay loaded for the process), the second is the soak;
 * memory is read between them and at the end, so module loads never read as a leak.
 * `lab/soak.sh --help` for the options.
 */
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";
import { parseArgs } from "node:util";
import { forwardOperands } from "../src/bench/layer.js";
import { type MoEConfig, PRESETS, type ScaleFormat, validateConfig } from "../src/config/config.js";
import { cudaAvailability, type Device, openDevice } from "../src/cuda/index.js";
import { DeviceMoEWeights } from "../src/kernels/device-weights.js";
import { takeGroupedGemmStatus } from "../src/kernels/gemm/grouped_gemm.js";
import { FusedMoEKernelError, fusedLayerProblem } from "../src/kernels/megamoe/megamoe.js";
import { FUSED_BLOCK_MS, type FusedBlockM, fusedStages } from "../src/kernels/megamoe/megamoe.variants.js";
import { fusedBlockMsUpTo } from "../src/kernels/megamoe/plan.js";
import { FusedPipeline } from "../src/pipeline/fused.js";
import { type MoEPipeline, UnfusedPipeline } from "../src/pipeline/unfused.js";
import { referenceMoE } from "../src/reference/moe.js";
import { type RandomRoutingOptions, type Routing, randomRouting } from "../src/reference/router.js";
import { GeneratedWeights, generateActivations } from "../src/weights/generate.js";

export type SoakBackend = "cuda" | "cpu";
export type Skew = "uniform" | "hot" | "empty" | "all-masked";

export interface SoakOptions {
  backend: SoakBackend;
  /** Forwards in all (each pipeline run counts as one; a case runs each pipeline twice). */
  forwards: number;
  /** Distinct layer shapes drawn (each one JIT compile on the GPU). */
  shapes: number;
  seed: number;
  /** Wall-clock seconds after which no new shape is opened and the soak stops at the next case. */
  budgetS: number;
  /** Largest maxTokens a shape may draw. */
  maxTokens: number;
  /** Force every block M on the fused kernel, not only those its heuristic picks up to maxTokens. */
  allBlockMs: boolean;
  /** Driver free-memory difference tolerated as no leak, in bytes (the allocation count must match exactly). */
  driverSlackBytes: number;
  /** Run only this shape (index) and optionally this case of it: replays a failure. */
  only: { shape: number; case: number | null } | null;
  onLine?: (line: string) => void;
}

export const DEFAULT_SOAK: Omit<SoakOptions, "seed"> = {
  backend: "cuda",
  forwards: 10_000,
  shapes: 32,
  budgetS: 330,
  maxTokens: 4096,
  allBlockMs: false,
  driverSlackBytes: 0,
  only: null,
};

/** One forward's inputs: the token count, routing and the fused kernel's knobs. */
export interface SoakCase {
  index: number;
  tokens: number;
  skew: Skew;
  /** Tokens whose every slot is −1 (on top of the skew). */
  maskedTokens: number;
  /** Single slots set to an id outside [0, E): −1, or on the GPU also E or −2 (same meaning). */
  maskedSlots: number;
  shared: boolean;
  /** The fused kernel's block M ("auto": its heuristic). */
  blockM: "auto" | FusedBlockM;
  /** The fused kernel's CTA count ("all": one per SM). */
  ctas: "all" | number;
  /** Seed of x and the routing. */
  seed: number;
}

export interface SoakShape {
  index: number;
  config: MoEConfig;
  /** Seed of the shape's weights. */
  seed: number;
  cases: SoakCase[];
}

/** mulberry32 floats in [0, 1). */
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let r = Math.imul(a ^ (a >>> 15), 1 | a);
    r = (r + Math.imul(r ^ (r >>> 7), 61 | r)) ^ r;
    return ((r ^ (r >>> 14)) >>> 0) / 4294967296;
  };
}

type Random = () => number;
const pick = <T>(r: Random, xs: readonly T[]): T => xs[Math.floor(r() * xs.length)]!;
const intIn = (r: Random, lo: number, hi: number) => lo + Math.floor(r() * (hi - lo + 1));

/** Bytes of a layer's FP8 weights (routed and shared), to keep drawn shapes quick to generate. */
function weightBytes(c: MoEConfig): number {
  return 3 * c.hidden * c.intermediate * (c.numExperts + c.numShared);
}

const GPU_DIMS = {
  experts: [1, 2, 3, 8, 12, 16, 32, 48, 64, 128, 256],
  // The fused kernel needs hidden % 256 (its L2 tile) and intermediate % 128 (the scale block).
  hidden: [256, 512, 768, 1024, 1536, 2048, 3072, 4096, 7168],
  intermediate: [128, 256, 384, 512, 768, 1024, 1536, 2048, 3072],
  maxTokens: [1, 8, 64, 256, 1024, 4096, 8192],
  maxWeightBytes: 2 * 2 ** 30,
};
// The CPU reference multiplies in JavaScript: small enough for a unit test.
const CPU_DIMS = {
  experts: [1, 2, 4, 6, 8],
  hidden: [256, 512],
  intermediate: [128, 256],
  maxTokens: [1, 3, 8],
  maxWeightBytes: 2 ** 22,
};

/** Why the soak cannot use this shape (both pipelines, every block M it may force), or null. */
export function soakShapeProblem(c: MoEConfig, backend: SoakBackend): string | null {
  try {
    validateConfig(c);
  } catch (e) {
    return (e as Error).message;
  }
  if (backend === "cpu") return null;
  const unfit = fusedLayerProblem(c);
  if (unfit !== null) return unfit;
  const blockM = FUSED_BLOCK_MS.find((m) => fusedStages(c, m) === 0);
  return blockM === undefined ? null : `block M ${blockM}'s shared memory does not fit`;
}

/** A random layer shape; half the time the previous shape's kernel dimensions (no new compile). */
function drawConfig(
  r: Random,
  backend: SoakBackend,
  maxTokensCap: number,
  prev: MoEConfig | null,
): MoEConfig {
  const dims = backend === "cuda" ? GPU_DIMS : CPU_DIMS;
  const tiny = PRESETS.tiny!;
  for (;;) {
    const reuse = prev !== null && r() < 0.5;
    const numExperts = reuse ? prev.numExperts : pick(r, dims.experts);
    const kMax = Math.min(numExperts, r() < 0.15 ? 16 : 8);
    const c: MoEConfig = {
      ...tiny,
      name: "custom",
      numExperts,
      hidden: reuse ? prev.hidden : pick(r, dims.hidden),
      intermediate: reuse ? prev.intermediate : pick(r, dims.intermediate),
      topK: reuse ? prev.topK : intIn(r, 1, kMax),
      numShared: reuse ? prev.numShared : pick(r, [0, 1, 1, 2]),
      scaleFormat: reuse ? prev.scaleFormat : pick(r, ["fp32", "ue8m0"] as ScaleFormat[]),
      // Runtime operands of both pipelines: no new compile when they change.
      swigluClamp: r() < 0.5 ? null : pick(r, [4, 10]),
      maxTokens: pick(
        r,
        dims.maxTokens.filter((t) => t <= maxTokensCap),
      ),
      router: { ...tiny.router, nGroup: 1, topkGroup: 1, routedScalingFactor: pick(r, [1, 1.5, 2.5]) },
    };
    if (weightBytes(c) > dims.maxWeightBytes) continue;
    if (soakShapeProblem(c, backend) === null) return c;
  }
}

function drawCase(
  r: Random,
  backend: SoakBackend,
  c: MoEConfig,
  index: number,
  allBlockMs: boolean,
): SoakCase {
  // The first two cases of a shape are its edges: one token and maxTokens.
  const u = r();
  const tokens =
    index === 0
      ? 1
      : index === 1
        ? c.maxTokens
        : u < 0.5
          ? intIn(r, 1, c.maxTokens)
          : u < 0.75
            ? intIn(r, 1, Math.min(16, c.maxTokens))
            : intIn(r, Math.max(1, c.maxTokens - 16), c.maxTokens);
  const s = r();
  let skew: Skew = s < 0.5 ? "uniform" : s < 0.72 ? "hot" : s < 0.95 ? "empty" : "all-masked";
  if (skew === "empty" && c.numExperts === c.topK) skew = "uniform";
  const blockMs = allBlockMs ? FUSED_BLOCK_MS : fusedBlockMsUpTo(c, c.maxTokens);
  // Few CTAs change the scheduling order; kept to small T so a forward stays short.
  const ctas =
    backend === "cuda" && tokens <= 256 && r() < 0.3 ? pick(r, [1, 3, 17, intIn(r, 2, 131)]) : "all";
  return {
    index,
    tokens,
    skew,
    maskedTokens: r() < 0.3 ? intIn(r, 1, tokens) : 0,
    maskedSlots: r() < 0.3 ? intIn(r, 1, tokens * c.topK) : 0,
    shared: c.numShared > 0 && r() < 0.8,
    blockM: backend === "cuda" && r() < 0.4 ? pick(r, blockMs) : "auto",
    ctas,
    seed: Math.floor(r() * 2 ** 31),
  };
}

/** Forwards one case costs: each pipeline twice. */
export function forwardsPerCase(backend: SoakBackend): number {
  return backend === "cuda" ? 4 : 2;
}

/** The whole run's shapes and cases, from the seed alone (so `only` replays a case exactly). */
export function drawPlan(o: SoakOptions): SoakShape[] {
  const r = rng(o.seed);
  const casesPerShape = Math.max(2, Math.ceil(o.forwards / o.shapes / forwardsPerCase(o.backend)));
  const shapes: SoakShape[] = [];
  let prev: MoEConfig | null = null;
  for (let i = 0; i < o.shapes; i++) {
    const config = drawConfig(r, o.backend, o.maxTokens, prev);
    prev = config;
    const seed = Math.floor(r() * 2 ** 31);
    const cases: SoakCase[] = [];
    for (let j = 0; j < casesPerShape; j++) cases.push(drawCase(r, o.backend, config, j, o.allBlockMs));
    shapes.push({ index: i, config, seed, cases });
  }
  return shapes;
}

/** A case's routing: the skew from randomRouting, then masked tokens and single masked slots. */
export function caseRouting(c: MoEConfig, k: SoakCase, backend: SoakBackend): Routing {
  const r = rng(k.seed ^ 0x5bd1e995);
  const E = c.numExperts;
  const opts: RandomRoutingOptions = {};
  if (k.skew === "hot") opts.hotExpert = intIn(r, 0, E - 1);
  if (k.skew === "empty") {
    const count = intIn(r, 1, E - c.topK);
    const order = Array.from({ length: E }, (_, e) => e);
    for (let i = 0; i < count; i++) {
      const j = intIn(r, i, E - 1);
      [order[i], order[j]] = [order[j]!, order[i]!];
    }
    opts.emptyExperts = order.slice(0, count);
  }
  const masked = new Set<number>();
  if (k.skew === "all-masked") for (let t = 0; t < k.tokens; t++) masked.add(t);
  for (let i = 0; i < k.maskedTokens; i++) masked.add(intIn(r, 0, k.tokens - 1));
  opts.maskedTokens = [...masked];
  const routing = randomRouting(k.seed, k.tokens, c, opts);
  // The GPU treats every id outside [0, E) as −1 (layer.ts); the CPU reference accepts −1 only.
  const outside = backend === "cuda" ? [-1, -1, E, -2] : [-1];
  for (let i = 0; i < k.maskedSlots; i++) routing.ids[intIn(r, 0, k.tokens * c.topK - 1)] = pick(r, outside);
  return routing;
}

// ---------------------------------------------------------------------------------------------------
// Engines: what runs a forward

export interface MemoryReading {
  /** cuMemGetInfo's free bytes (the whole device). */
  driverFreeBytes: number;
  /** Bytes allocated through Device.alloc and not freed. */
  allocatedBytes: number;
}

/** A forward that did not complete: a watchdog trip (the context is lost) or a grouped-GEMM stall. */
export class SoakTrip extends Error {
  constructor(
    readonly kind: "watchdog" | "gemm-stall",
    message: string,
  ) {
    super(message);
  }
}

/** One shape opened on an engine: its weights and pipelines. */
export interface ShapeRunner {
  /** Loads a case's inputs (x from its seed, the routing). */
  load(k: SoakCase, routing: Routing): void;
  /** Runs one pipeline on the loaded case; `poison` NaN-fills its scratch first. Returns bf16 bits. */
  run(impl: string, k: SoakCase, poison: boolean): Uint16Array;
  unload(): void;
  dispose(): void;
}

export interface SoakEngine {
  readonly impls: readonly string[];
  readonly description: string;
  /** Whether a failure leaves the engine unusable (a CUDA error can lose the context). */
  readonly fatalErrors: boolean;
  memory(): MemoryReading | null;
  open(shape: SoakShape): ShapeRunner;
}

/** The CPU reference (for the logic's test): one impl, no device memory. */
export class CpuEngine implements SoakEngine {
  readonly impls = ["reference"];
  readonly description = "CPU reference";
  readonly fatalErrors = false;
  memory(): null {
    return null;
  }
  open(shape: SoakShape): ShapeRunner {
    const weights = new GeneratedWeights(shape.config, shape.seed, {
      cachedExperts: shape.config.numExperts,
    });
    let input: { x: Uint16Array; routing: Routing } | null = null;
    return {
      load(k, routing) {
        input = { x: generateActivations(k.seed, k.tokens, shape.config.hidden), routing };
      },
      run(_impl, k) {
        if (input === null) throw new Error("no case loaded");
        return referenceMoE(input.x, k.tokens, input.routing, weights, { shared: k.shared });
      },
      unload() {
        input = null;
      },
      dispose() {},
    };
  }
}

/** Both GPU pipelines on one device, weights made there. */
export class CudaEngine implements SoakEngine {
  readonly impls = ["unfused", "fused"];
  readonly fatalErrors = true;
  readonly device: Device;
  constructor(ordinal = 0) {
    this.device = openDevice(ordinal);
  }
  get description(): string {
    return this.device.describe();
  }
  memory(): MemoryReading {
    this.device.synchronize();
    return {
      driverFreeBytes: this.device.memoryInfo().freeBytes,
      allocatedBytes: this.device.allocatedBytes,
    };
  }
  open(shape: SoakShape): ShapeRunner {
    const device = this.device;
    const c = shape.config;
    const weights = DeviceMoEWeights.generate(device, c, shape.seed);
    const pipelines = new Map<string, MoEPipeline>();
    try {
      pipelines.set("unfused", new UnfusedPipeline(device, weights, c.maxTokens));
      pipelines.set("fused", new FusedPipeline(device, weights, c.maxTokens));
    } catch (e) {
      for (const p of pipelines.values()) p.dispose();
      weights.dispose();
      throw e;
    }
    let operands: ReturnType<typeof forwardOperands> | null = null;
    const unload = () => {
      operands?.dispose();
      operands = null;
    };
    return {
      load(k, routing) {
        unload();
        operands = forwardOperands(device, c, k.tokens, routing, k.seed);
      },
      run(impl, k, poison) {
        const p = pipelines.get(impl);
        if (p === undefined) throw new Error(`unknown impl ${impl}`);
        if (operands === null) throw new Error("no case loaded");
        if (p instanceof FusedPipeline) {
          p.kernel.blockM = k.blockM;
          p.kernel.ctas = k.ctas === "all" ? device.smCount : Math.min(k.ctas, device.smCount);
        }
        const { x, ids, weights: w, out } = operands;
        out.fill(0xff);
        if (poison) p.fillScratch(0xff);
        try {
          p.forward({ x, ids, weights: w, out, tokens: k.tokens, shared: k.shared }, null);
          p.checkStatus();
        } catch (e) {
          if (e instanceof FusedMoEKernelError) throw new SoakTrip("watchdog", e.message);
          throw e;
        }
        const stall = takeGroupedGemmStatus(device);
        if (stall !== null)
          throw new SoakTrip("gemm-stall", `grouped GEMM stalled: ${JSON.stringify(stall)}`);
        return out.toHost() as Uint16Array;
      },
      unload,
      dispose() {
        unload();
        for (const p of pipelines.values()) p.dispose();
        weights.dispose();
      },
    };
  }
}

// ---------------------------------------------------------------------------------------------------
// The run

export interface CheckCount {
  checked: number;
  failed: number;
}

export interface SoakFailure {
  check: "repeat" | "cross" | "finite" | "watchdog" | "gemm-stall" | "error";
  shape: number;
  case: number | null;
  impl?: string;
  detail: string;
  /** `lab/soak.sh` arguments that replay it. */
  replay: string;
  config: string;
  input?: Omit<SoakCase, "index">;
}

export interface SoakSummary {
  ok: boolean;
  backend: SoakBackend;
  device: string;
  seed: number;
  options: Omit<SoakOptions, "onLine" | "seed">;
  durationS: number;
  prepareS: number;
  soakS: number;
  shapes: { planned: number; prepared: number; run: number };
  forwards: { planned: number; run: number };
  cases: number;
  checks: {
    repeat: CheckCount;
    cross: CheckCount;
    finite: CheckCount;
    watchdog: { trips: number };
    gemmStall: { trips: number };
    errors: { count: number };
    memory: {
      checked: boolean;
      ok: boolean | null;
      before: MemoryReading | null;
      after: MemoryReading | null;
      /** Bytes the run lost (before − after free; after − before allocated); 0 when nothing leaked. */
      driverLeakBytes: number | null;
      allocatedLeakBytes: number | null;
      atStart: MemoryReading | null;
    };
  };
  /** Why the run stopped before its plan, or null. */
  stoppedEarly: string | null;
  shapeStats: { index: number; config: string; cases: number; forwards: number; prepareS: number }[];
  failures: SoakFailure[];
  /** Failures beyond those listed (the list keeps the first MAX_FAILURES). */
  failuresLeftOut: number;
}

const MAX_FAILURES = 50;

export function describeConfig(c: MoEConfig): string {
  return (
    `E=${c.numExperts} H=${c.hidden} IH=${c.intermediate} k=${c.topK} shared=${c.numShared} ` +
    `clamp=${c.swigluClamp ?? "off"} ${c.scaleFormat} maxT=${c.maxTokens}`
  );
}

/** First index where two outputs differ, or −1. */
function firstDifference(a: Uint16Array, b: Uint16Array): number {
  if (a.length !== b.length) return Math.min(a.length, b.length);
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return i;
  return -1;
}

/** First non-finite bf16 (exponent all ones: Inf or NaN), or −1. */
function firstNonFinite(a: Uint16Array): number {
  for (let i = 0; i < a.length; i++) if ((a[i]! & 0x7f80) === 0x7f80) return i;
  return -1;
}

export function runSoak(o: SoakOptions, engine: SoakEngine): SoakSummary {
  const start = performance.now();
  const elapsedS = () => (performance.now() - start) / 1000;
  const say = o.onLine ?? (() => {});
  const plan = drawPlan(o).filter((s) => o.only === null || s.index === o.only.shape);
  const caseFilter = (k: SoakCase) => o.only?.case == null || k.index === o.only.case;
  const { onLine: _drop, seed: _seed, ...options } = o;
  const fpc = forwardsPerCase(o.backend);
  const s: SoakSummary = {
    ok: false,
    backend: o.backend,
    device: engine.description,
    seed: o.seed,
    options,
    durationS: 0,
    prepareS: 0,
    soakS: 0,
    shapes: { planned: plan.length, prepared: 0, run: 0 },
    forwards: { planned: plan.reduce((n, sh) => n + sh.cases.filter(caseFilter).length * fpc, 0), run: 0 },
    cases: 0,
    checks: {
      repeat: { checked: 0, failed: 0 },
      cross: { checked: 0, failed: 0 },
      finite: { checked: 0, failed: 0 },
      watchdog: { trips: 0 },
      gemmStall: { trips: 0 },
      errors: { count: 0 },
      memory: {
        checked: false,
        ok: null,
        before: null,
        after: null,
        driverLeakBytes: null,
        allocatedLeakBytes: null,
        atStart: null,
      },
    },
    stoppedEarly: null,
    shapeStats: [],
    failures: [],
    failuresLeftOut: 0,
  };
  const fail = (f: Omit<SoakFailure, "replay" | "config">, shape: SoakShape, k: SoakCase | null) => {
    if (s.failures.length >= MAX_FAILURES) {
      s.failuresLeftOut++;
      return;
    }
    const only = k === null ? `${shape.index}` : `${shape.index}:${k.index}`;
    const args = [
      `--backend ${o.backend}`,
      `--seed ${o.seed}`,
      `--shapes ${o.shapes}`,
      `--forwards ${o.forwards}`,
    ];
    if (o.maxTokens !== DEFAULT_SOAK.maxTokens) args.push(`--max-tokens ${o.maxTokens}`);
    if (o.allBlockMs) args.push("--all-block-ms");
    const input = k === null ? undefined : (({ index: _i, ...rest }) => rest)(k);
    s.failures.push({
      ...f,
      config: describeConfig(shape.config),
      replay: `${args.join(" ")} --only ${only}`,
      input,
    });
    say(`FAIL ${f.check} shape ${shape.index}${k ? ` case ${k.index}` : ""}: ${f.detail}`);
  };
  /** Records an exception; true when the run must stop (a trip, or any error on a fatal engine). */
  const caught = (e: unknown, shape: SoakShape, k: SoakCase | null, impl?: string): boolean => {
    if (e instanceof SoakTrip) {
      if (e.kind === "watchdog") s.checks.watchdog.trips++;
      else s.checks.gemmStall.trips++;
      fail({ check: e.kind, shape: shape.index, case: k?.index ?? null, impl, detail: e.message }, shape, k);
      return e.kind === "watchdog" || engine.fatalErrors;
    }
    s.checks.errors.count++;
    const detail = e instanceof Error ? `${e.name}: ${e.message}` : String(e);
    fail({ check: "error", shape: shape.index, case: k?.index ?? null, impl, detail }, shape, k);
    return engine.fatalErrors;
  };

  s.checks.memory.atStart = engine.memory();
  // Pass 1: open every shape and run it once per token count, loading every module it needs.
  const prepared: SoakShape[] = [];
  for (const shape of plan) {
    if (elapsedS() > o.budgetS * 0.6) {
      s.stoppedEarly = `budget: ${prepared.length} of ${plan.length} shapes opened within 60% of ${o.budgetS} s`;
      break;
    }
    const t0 = performance.now();
    let runner: ShapeRunner | null = null;
    try {
      runner = engine.open(shape);
      const cases = shape.cases.filter(caseFilter);
      const seen = new Set<string>();
      for (const k of cases) {
        // One forward per distinct token count and forced block M loads what the soak will use.
        const key = `${k.tokens}:${k.blockM}`;
        if (seen.has(key)) continue;
        seen.add(key);
        runner.load(k, caseRouting(shape.config, k, o.backend));
        for (const impl of engine.impls) runner.run(impl, k, false);
      }
      prepared.push(shape);
    } catch (e) {
      if (caught(e, shape, null)) {
        s.stoppedEarly = "a failure while opening a shape left the device unusable";
        break;
      }
    } finally {
      runner?.dispose();
    }
    const secs = (performance.now() - t0) / 1000;
    s.shapeStats.push({
      index: shape.index,
      config: describeConfig(shape.config),
      cases: 0,
      forwards: 0,
      prepareS: secs,
    });
    say(`opened shape ${shape.index} (${describeConfig(shape.config)}) in ${secs.toFixed(1)} s`);
  }
  s.shapes.prepared = prepared.length;
  s.prepareS = elapsedS();
  s.checks.memory.before = engine.memory();

  // Pass 2: the soak.
  const soakStart = performance.now();
  soak: for (const shape of s.stoppedEarly?.startsWith("a failure") ? [] : prepared) {
    const stat = s.shapeStats.find((x) => x.index === shape.index)!;
    let runner: ShapeRunner | null = null;
    try {
      runner = engine.open(shape);
    } catch (e) {
      if (caught(e, shape, null)) {
        s.stoppedEarly = "a failure while opening a shape left the device unusable";
        break;
      }
      continue;
    }
    s.shapes.run++;
    try {
      for (const k of shape.cases.filter(caseFilter)) {
        if (elapsedS() > o.budgetS) {
          s.stoppedEarly = `budget: ${o.budgetS} s reached in shape ${shape.index}`;
          break soak;
        }
        s.cases++;
        stat.cases++;
        const outs = new Map<string, Uint16Array[]>();
        let impl = "";
        try {
          runner.load(k, caseRouting(shape.config, k, o.backend));
          for (const repeat of [0, 1]) {
            for (impl of engine.impls) {
              const out = runner.run(impl, k, repeat === 0);
              s.forwards.run++;
              stat.forwards++;
              s.checks.finite.checked++;
              const bad = firstNonFinite(out);
              if (bad !== -1) {
                s.checks.finite.failed++;
                const detail = `${impl} run ${repeat + 1}: non-finite 0x${out[bad]!.toString(16)} at element ${bad}`;
                fail({ check: "finite", shape: shape.index, case: k.index, impl, detail }, shape, k);
              }
              outs.set(impl, [...(outs.get(impl) ?? []), out]);
            }
          }
        } catch (e) {
          if (caught(e, shape, k, impl)) {
            s.stoppedEarly = "a watchdog trip or device error left the device unusable";
            break soak;
          }
          continue;
        } finally {
          runner.unload();
        }
        for (const impl of engine.impls) {
          const [a, b] = outs.get(impl)!;
          s.checks.repeat.checked++;
          const at = firstDifference(a!, b!);
          if (at !== -1) {
            s.checks.repeat.failed++;
            const detail = `${impl}: run 2 differs from run 1 at element ${at} (0x${a![at]?.toString(16)} vs 0x${b![at]?.toString(16)})`;
            fail({ check: "repeat", shape: shape.index, case: k.index, impl, detail }, shape, k);
          }
        }
        const [first, ...others] = engine.impls;
        for (const impl of others) {
          const a = outs.get(first!)![0]!;
          const b = outs.get(impl)![0]!;
          s.checks.cross.checked++;
          const at = firstDifference(a, b);
          if (at !== -1) {
            s.checks.cross.failed++;
            const detail = `${impl} differs from ${first} at element ${at} (0x${b[at]?.toString(16)} vs 0x${a[at]?.toString(16)})`;
            fail({ check: "cross", shape: shape.index, case: k.index, impl, detail }, shape, k);
          }
        }
      }
    } finally {
      runner.dispose();
    }
    say(`shape ${shape.index}: ${stat.cases} cases, ${stat.forwards} forwards (${elapsedS().toFixed(0)} s)`);
  }
  s.soakS = (performance.now() - soakStart) / 1000;

  const mem = s.checks.memory;
  const fatal = s.checks.watchdog.trips > 0 || (engine.fatalErrors && s.checks.errors.count > 0);
  mem.after = fatal ? null : engine.memory();
  if (mem.before !== null && mem.after !== null) {
    mem.checked = true;
    mem.driverLeakBytes = mem.before.driverFreeBytes - mem.after.driverFreeBytes;
    mem.allocatedLeakBytes = mem.after.allocatedBytes - mem.before.allocatedBytes;
    mem.ok = Math.abs(mem.driverLeakBytes) <= o.driverSlackBytes && mem.allocatedLeakBytes === 0;
  }
  const c = s.checks;
  s.ok =
    c.repeat.failed === 0 &&
    c.cross.failed === 0 &&
    c.finite.failed === 0 &&
    c.watchdog.trips === 0 &&
    c.gemmStall.trips === 0 &&
    c.errors.count === 0 &&
    mem.ok !== false &&
    s.forwards.run > 0;
  s.durationS = elapsedS();
  return s;
}

const gib = (b: number) => `${(b / 2 ** 30).toFixed(3)} GiB`;

/** The one-screen summary. */
export function formatSummary(s: SoakSummary): string {
  const c = s.checks;
  const count = (x: CheckCount) =>
    `${x.checked - x.failed}/${x.checked} ${x.failed === 0 ? "ok" : `FAILED ${x.failed}`}`;
  const m = c.memory;
  const memory = !m.checked
    ? "not checked (no device)"
    : m.ok
      ? `ok: ${gib(m.after!.driverFreeBytes)} free before and after, ${m.after!.allocatedBytes} B allocated`
      : `LEAK: driver ${m.driverLeakBytes} B, allocations ${m.allocatedLeakBytes} B`;
  const lines = [
    `soak ${s.ok ? "PASSED" : "FAILED"}: ${s.backend} on ${s.device}, seed ${s.seed}`,
    `  shapes    ${s.shapes.run} run of ${s.shapes.planned} planned (${s.shapes.prepared} opened)`,
    `  forwards  ${s.forwards.run} of ${s.forwards.planned} planned, ${s.cases} cases`,
    `  time      ${s.durationS.toFixed(1)} s (opening ${s.prepareS.toFixed(1)} s, soak ${s.soakS.toFixed(1)} s)`,
    `  repeat    ${count(c.repeat)}`,
    `  cross     ${c.cross.checked === 0 ? "n/a (one implementation)" : count(c.cross)}`,
    `  finite    ${count(c.finite)}`,
    `  watchdog  ${c.watchdog.trips === 0 ? "ok" : `TRIPPED ${c.watchdog.trips}`}, grouped-GEMM stalls ${c.gemmStall.trips}`,
    `  errors    ${c.errors.count}`,
    `  memory    ${memory}`,
  ];
  if (m.atStart !== null && m.after !== null) {
    lines.push(
      `            (${gib(m.atStart.driverFreeBytes)} free at start: the difference is kernel modules)`,
    );
  }
  if (s.stoppedEarly !== null) lines.push(`  stopped   ${s.stoppedEarly}`);
  for (const f of s.failures.slice(0, 8)) {
    lines.push(`  ✖ ${f.check} shape ${f.shape}${f.case === null ? "" : ` case ${f.case}`}: ${f.detail}`);
    lines.push(`      ${f.config}; replay: lab/soak.sh ${f.replay}`);
  }
  if (s.failures.length + s.failuresLeftOut > 8) {
    lines.push(`  … ${s.failures.length + s.failuresLeftOut - 8} more failures in the JSON summary`);
  }
  return lines.join("\n");
}

// ---------------------------------------------------------------------------------------------------
// Command line

export const SOAK_HELP = `lab/soak.sh [options]: many forwards over random MoE layer shapes through the fused and the
unfused GPU pipelines (or the CPU reference), checking that memory does not leak, that every forward
repeats bit for bit, that fused equals unfused bit for bit, that no watchdog trips and that outputs are
finite.

Shapes: E, H (multiple of 256), IH (multiple of 128), top-k, shared experts 0-2, SwiGLU clamp on/off,
both scale formats, maxTokens up to --max-tokens. Cases: T = 1, maxTokens and random; routing uniform,
one hot expert, empty experts or all tokens masked; masked tokens and single masked slots (ids −1, and
on the GPU other ids outside [0, E)); shared expert on/off; the fused kernel's block M (auto or forced)
and CTA count (all or few).

Options:
  --backend cuda|cpu   the GPU pipelines (default) or the CPU reference (tiny shapes, for testing)
  --forwards N         pipeline runs in all, each case runs each pipeline twice (default ${DEFAULT_SOAK.forwards})
  --shapes N           distinct layer shapes, one JIT compile each (default ${DEFAULT_SOAK.shapes})
  --seed N             the draw's seed (default: from the clock, printed)
  --budget-s S         stop opening shapes after 60% of S seconds and stop soaking at S (default ${DEFAULT_SOAK.budgetS})
  --max-tokens N       the largest maxTokens a shape may draw (default ${DEFAULT_SOAK.maxTokens})
  --all-block-ms       force every fused block M, not only those the heuristic picks up to maxTokens
                       (one more compile per block M and shape)
  --driver-slack-mib N  tolerate N MiB of difference in the driver's free memory (default 0; the
                       project's own allocation count must always come back exactly)
  --only S[:C]         run shape S only (and case C of it): replays a failure (give the same --seed,
                       --shapes, --forwards)
  --out PATH           the JSON summary (default $OUT/soak.json, or ./soak.json); the text summary goes
                       beside it as .txt
  --quiet              no progress lines
  -h, --help           this text

Exit status: 0 when every check passed, 1 when one failed, 2 for a usage error.`;

export function parseSoakArgs(
  argv: string[],
): { options: SoakOptions; out: string; quiet: boolean } | "help" {
  const { values } = parseArgs({
    args: argv,
    options: {
      backend: { type: "string" },
      forwards: { type: "string" },
      shapes: { type: "string" },
      seed: { type: "string" },
      "budget-s": { type: "string" },
      "max-tokens": { type: "string" },
      "all-block-ms": { type: "boolean" },
      only: { type: "string" },
      "driver-slack-mib": { type: "string" },
      out: { type: "string" },
      quiet: { type: "boolean" },
      help: { type: "boolean", short: "h" },
    },
    strict: true,
    allowPositionals: false,
  });
  if (values.help) return "help";
  const int = (name: string, v: string | undefined, fallback: number, min: number): number => {
    if (v === undefined) return fallback;
    const n = Number(v);
    if (!Number.isSafeInteger(n) || n < min)
      throw new Error(`--${name} must be an integer ≥ ${min}, got "${v}"`);
    return n;
  };
  const backend = values.backend ?? DEFAULT_SOAK.backend;
  if (backend !== "cuda" && backend !== "cpu")
    throw new Error(`--backend must be cuda or cpu, got "${backend}"`);
  let only: SoakOptions["only"] = null;
  if (values.only !== undefined) {
    const m = /^(\d+)(?::(\d+))?$/.exec(values.only);
    if (m === null) throw new Error(`--only must be SHAPE or SHAPE:CASE, got "${values.only}"`);
    only = { shape: Number(m[1]), case: m[2] === undefined ? null : Number(m[2]) };
  }
  const budget = values["budget-s"] === undefined ? DEFAULT_SOAK.budgetS : Number(values["budget-s"]);
  if (!(budget > 0)) throw new Error(`--budget-s must be positive, got "${values["budget-s"]}"`);
  const options: SoakOptions = {
    backend,
    forwards: int("forwards", values.forwards, DEFAULT_SOAK.forwards, 1),
    shapes: int("shapes", values.shapes, DEFAULT_SOAK.shapes, 1),
    seed: int("seed", values.seed, Date.now() % 2 ** 31, 0),
    budgetS: budget,
    maxTokens: int("max-tokens", values["max-tokens"], DEFAULT_SOAK.maxTokens, 1),
    allBlockMs: values["all-block-ms"] ?? false,
    driverSlackBytes: int("driver-slack-mib", values["driver-slack-mib"], 0, 0) * 2 ** 20,
    only,
  };
  const out = values.out ?? path.join(process.env.OUT ?? ".", "soak.json");
  return { options, out, quiet: values.quiet ?? false };
}

function main(argv: string[]): number {
  let parsed: ReturnType<typeof parseSoakArgs>;
  try {
    parsed = parseSoakArgs(argv);
  } catch (e) {
    console.error(`lab/soak: ${(e as Error).message}\n(lab/soak.sh --help for the options)`);
    return 2;
  }
  if (parsed === "help") {
    console.log(SOAK_HELP);
    return 0;
  }
  const { options, out, quiet } = parsed;
  if (options.backend === "cuda") {
    const a = cudaAvailability();
    if (!a.ok) {
      console.error(`lab/soak: no usable GPU (${a.reason}); --backend cpu runs the CPU reference`);
      return 2;
    }
  }
  console.log(`lab/soak: seed ${options.seed} (--seed ${options.seed} replays this run)`);
  if (!quiet) options.onLine = (line) => console.log(line);
  const engine = options.backend === "cuda" ? new CudaEngine() : new CpuEngine();
  const summary = runSoak(options, engine);
  const text = formatSummary(summary);
  fs.mkdirSync(path.dirname(path.resolve(out)), { recursive: true });
  fs.writeFileSync(out, `${JSON.stringify(summary, null, 2)}\n`);
  fs.writeFileSync(`${out.replace(/\.json$/, "")}.txt`, `${text}\n`);
  console.log(text);
  console.log(`summary: ${out}`);
  return summary.ok ? 0 : 1;
}

if (process.argv[1] !== undefined && import.meta.url === pathToFileURL(process.argv[1]).href) {
  process.exitCode = main(process.argv.slice(2));
}
