/**
 * Launcher of MegaGate (gate.cu): the router on the GPU. bf16 x [T, H] and the gate weight bf16 [E, H]
 * (with the fp32 correction bias [E] when the config has one) → int32 ids [T, k] and fp32 weights [T, k]
 * in caller tensors, and optionally the fp32 logits [T, E].
 *
 * The logits come from tensor cores in one of two ways (`GateLogits`, docs/numerics.md "The router on
 * the GPU"): "exact" on the fp64 tensor cores, equal to the CPU reference's fp32 logits but for an
 * fp32 rounding the two double sums may take differently; "fast" on the bf16 tensor cores (every
 * 16-product sum added to a double accumulator), within a bound of the reference's. Everything after
 * the logits follows `scoreLogits` / `selectTopK` bit for bit. Two launches: the logits into a double
 * workspace [S, T, E] (K split S ways when tokens are too few to fill the GPU), then one warp per
 * token for scores, selection and weights.
 *
 * Hash-routed configs (config.router.hashRouted, DeepSeek-V4's first layers) run a second select
 * kernel: token t's experts are tid2eid[tokenIds[t]] in table order, weighted from the same scores by
 * the same rule (the reference's `routeByHash`); the ids and weights land in the same caller tensors.
 */

import type { MoEConfig } from "../../config/config.js";
import { checkOptionFields, describeValue, validateConfig } from "../../config/config.js";
import {
  compileKernel,
  type Device,
  DeviceTensor,
  describeTensor,
  expectOnDevice,
  expectOperand,
  type Kernel,
  KernelArgs,
  loadKernel,
  perDeviceMemo,
  type Stream,
} from "../../cuda/index.js";
import { GATE_MAX_EXPERTS, gateDefines } from "./gate.variants.js";

export const GATE_KERNEL_SOURCE = "gate/gate.cu";
export const GATE_LOGITS_KERNEL = "megamoe_gate_logits";
export const GATE_LOGITS_EXACT_KERNEL = "megamoe_gate_logits_exact";
export const GATE_SELECT_KERNEL = "megamoe_gate_select";
export const GATE_SELECT_HASH_KERNEL = "megamoe_gate_select_hash";

// Mirrors of gate.cu's constants.
const WARPS_PER_BLOCK = 4;
const TOKENS_PER_TILE = { fast: 16, exact: 8 } as const;
const STEP_CHANNELS = 32;
const MAX_TOP_K = 64;
/**
 * Warps of logits work per SM the split heuristic aims for: beyond a few, more splits only add partials
 * for the select kernel to sum (16 took the decode step at flash-ep8 T = 128 about 1% longer).
 */
const TARGET_WARPS_PER_SM = 4;
/**
 * Partial loads per select-kernel lane the split heuristic allows: the select kernel adds each logit's
 * partials in split order, one lane per logit and ⌈E/32⌉ logits per lane, so splits × ⌈E/32⌉ loads lie
 * on a lane's path, 32 in flight at a time (flash at T = 1 spent ~20 µs there with 128 splits, and
 * flash-ep8 doubled its time with splits capped at 16: its logits kernel then had too few warps).
 */
const MAX_SELECT_LOADS = 256;

const SCORING_CODES = { sigmoid: 0, softmax: 1, sqrtsoftplus: 2 } as const;

/**
 * How the logits GEMM sums: "exact" (fp64 tensor cores: the reference's logits, and so its weights, to
 * the last bit but for rare fp32 rounding ties) or "fast" (bf16 tensor cores, within 2^-18 · Σ|x·w|).
 * On the H200 the two take about the same time at decode sizes and "exact" 1.2–1.5× as long from
 * T = 1024 up (docs/decisions.md).
 */
export type GateLogits = "exact" | "fast";

/**
 * Multiply-adds T·E·H up to which routing defaults to "exact" (flash up to 256 tokens, pro up to 97):
 * 2^28 is ~8 µs at the H200's rated 67 TFLOP/s of fp64 tensor math.
 */
export const GATE_EXACT_MAX_MACS = 2 ** 28;

/**
 * The default way to sum the logits: "exact" for softmax scoring at any size (a softmax weight follows
 * the difference of two logits, and "fast" moved it by up to 2·10^-6) and for batches up to
 * GATE_EXACT_MAX_MACS; "fast" for larger sigmoid and sqrt-softplus batches (weights within ~2·10^-7).
 */
export function defaultGateLogits(
  tokens: number,
  hidden: number,
  numExperts: number,
  scoring?: MoEConfig["router"]["scoring"],
): GateLogits {
  if (scoring === "softmax") return "exact";
  return tokens * hidden * numExperts <= GATE_EXACT_MAX_MACS ? "exact" : "fast";
}

export interface GateOptions {
  /** How the logits are summed; default `defaultGateLogits`. */
  logits?: GateLogits;
  /**
   * int32 [T] on the device: the token ids a hash-routed config routes by (required there, refused
   * otherwise). Not read back: ids outside [0, vocab) give id −1 and weight 0 in all k slots, so check
   * them on the host first (`tokenIdsProblem`).
   */
  tokenIds?: DeviceTensor;
}

export interface GateOperands {
  /** bf16 [E, H]. */
  weight: DeviceTensor;
  /** fp32 [E] when config.router.correctionBias, else null. */
  bias: DeviceTensor | null;
  /**
   * int32 [vocab, topK] when config.router.hashRouted (DeepSeek-V4's gate.tid2eid), else null or absent.
   * Not read back: check it on the host before the upload (`tid2eidProblem`); an entry outside [0, E)
   * gives id −1 and weight 0 in its slot.
   */
  tid2eid?: DeviceTensor | null;
}

export interface GateOutputs {
  /** int32 [T, k], descending selection score (ties: lower id first). */
  ids: DeviceTensor;
  /** fp32 [T, k]. */
  weights: DeviceTensor;
  /** fp32 [T, E], or null/absent when not wanted. */
  logits?: DeviceTensor | null;
}

export interface GatePlan {
  /** Which logits kernel runs. */
  logits: GateLogits;
  /** K splits of the logits GEMM. */
  splits: number;
  /** 32-channel steps per split. */
  stepsPerSplit: number;
  /** Warps of the logits kernel (one per token tile × expert block × split) and its blocks. */
  logitsWarps: number;
  logitsBlocks: number;
  selectBlocks: number;
  /** Bytes of the double workspace, S · T · E · 8. */
  workspaceBytes: number;
}

/** Experts per warp of the logits kernel (gate.cu's kExpertsPerWarp). */
function expertsPerWarp(numExperts: number): number {
  return Math.min(32, numExperts);
}

/**
 * The launch plan for one logits path (the caller picks it: routeOnDevice takes options.logits or
 * defaultGateLogits with the router's scoring): K is split until the logits kernel has about
 * TARGET_WARPS_PER_SM warps per SM (small T), into at most MAX_SELECT_LOADS / ⌈E/32⌉ ranges of at least
 * one 32-channel step; large T runs unsplit.
 */
export function planGate(
  tokens: number,
  hidden: number,
  numExperts: number,
  smCount: number,
  logits: GateLogits,
): GatePlan {
  const tiles = Math.ceil(tokens / TOKENS_PER_TILE[logits]);
  const expertBlocks = numExperts / expertsPerWarp(numExperts);
  const steps = hidden / STEP_CHANNELS;
  const wanted = Math.ceil((TARGET_WARPS_PER_SM * smCount) / Math.max(1, tiles * expertBlocks));
  const maxSplits = Math.max(1, Math.floor(MAX_SELECT_LOADS / Math.ceil(numExperts / 32)));
  const stepsPerSplit = Math.ceil(steps / Math.max(1, Math.min(steps, wanted, maxSplits)));
  const splits = Math.ceil(steps / stepsPerSplit);
  const logitsWarps = tiles * expertBlocks * splits;
  return {
    logits,
    splits,
    stepsPerSplit,
    logitsWarps,
    logitsBlocks: Math.ceil(logitsWarps / WARPS_PER_BLOCK),
    selectBlocks: Math.ceil(tokens / WARPS_PER_BLOCK),
    workspaceBytes: splits * tokens * numExperts * 8,
  };
}

// ---------------------------------------------------------------------------------------------------
// Kernels and workspace, memoized per device

interface GateKernels {
  logits: Record<GateLogits, Kernel>;
  select: Kernel;
  selectHash: Kernel;
  logitsArgs: KernelArgs;
  selectArgs: KernelArgs;
  selectHashArgs: KernelArgs;
}

const gateKernels = perDeviceMemo<number, GateKernels>();
const workspaceByDevice = new WeakMap<Device, DeviceTensor>();

function gateKernelsFor(device: Device, numExperts: number): GateKernels {
  return gateKernels(device, numExperts, () => {
    const compiled = compileKernel({ source: GATE_KERNEL_SOURCE, defines: gateDefines(numExperts) });
    return {
      logits: {
        fast: loadKernel(device, compiled, GATE_LOGITS_KERNEL),
        exact: loadKernel(device, compiled, GATE_LOGITS_EXACT_KERNEL),
      },
      select: loadKernel(device, compiled, GATE_SELECT_KERNEL),
      selectHash: loadKernel(device, compiled, GATE_SELECT_HASH_KERNEL),
      logitsArgs: new KernelArgs(7),
      selectArgs: new KernelArgs(13),
      selectHashArgs: new KernelArgs(13),
    };
  });
}

/**
 * The device's gate workspace, grown to at least `bytes`. Growing synchronizes the device first (the
 * old buffer may still be read by a queued launch), so call `reserveGateWorkspace` with the largest T
 * before capturing a CUDA graph.
 */
export function reserveGateWorkspace(device: Device, bytes: number): DeviceTensor {
  const current = workspaceByDevice.get(device);
  if (current !== undefined && !current.isDisposed && current.shape[0]! >= bytes) return current;
  if (current !== undefined && !current.isDisposed) {
    device.synchronize();
    current.dispose();
  }
  const ws = DeviceTensor.empty(device, "uint8", [Math.max(256, Math.ceil(bytes / 256) * 256)]);
  workspaceByDevice.set(device, ws);
  return ws;
}

// ---------------------------------------------------------------------------------------------------
// Checks

const WHERE = "routeOnDevice";

/**
 * Config objects already validated: a decode step routes with the same config every launch, so each is
 * checked on its first use only (a config is not mutated once in use; a bad one is never added and
 * throws on every launch).
 */
const validatedConfigs = new WeakSet<MoEConfig>();

/**
 * Why the GPU gate cannot route a (valid) config, or null: gate.cu is compiled for expert counts that
 * are multiples of 8 up to GATE_MAX_EXPERTS and keeps at most 64 slots a token.
 */
export function deviceGateProblem(config: MoEConfig): string | null {
  const { numExperts: E, topK } = config;
  if (E % 8 !== 0 || E > GATE_MAX_EXPERTS) {
    return `the GPU gate needs numExperts a multiple of 8 up to ${GATE_MAX_EXPERTS}, got ${E}`;
  }
  if (topK > MAX_TOP_K) return `topK ${topK} exceeds ${MAX_TOP_K}`;
  return null;
}

/**
 * Why `table` cannot be a hash-routed gate's tid2eid for `numExperts` and `topK`, or null: it must be
 * an Int32Array [vocab, topK] with vocab ≥ 1 and every row k distinct expert ids in [0, numExperts)
 * (what the checkpoint reader and RandomV4Weights produce, and what routeByHash's validateRouting
 * demands of the rows it uses). Checked on the host once before the table goes to the device, where
 * the kernel does not read it back.
 */
export function tid2eidProblem(table: unknown, numExperts: number, topK: number): string | null {
  if (!(table instanceof Int32Array)) {
    return `tid2eid must be an Int32Array [vocab, topK=${topK}], got ${describeValue(table)}`;
  }
  if (table.length === 0 || table.length % topK !== 0) {
    return `tid2eid has ${table.length} elements, not a positive multiple of topK (${topK})`;
  }
  if (table.length >= 2 ** 31) return `tid2eid has ${table.length} elements, more than int32 indexes`;
  for (let row = 0; row < table.length / topK; row++) {
    for (let j = 0; j < topK; j++) {
      const e = table[row * topK + j]!;
      if (e < 0 || e >= numExperts) {
        return `tid2eid[${row}, ${j}] = ${e} is not an expert id in [0, ${numExperts})`;
      }
      for (let i = 0; i < j; i++) {
        if (table[row * topK + i] === e) return `tid2eid[${row}]: expert ${e} is in slots ${i} and ${j}`;
      }
    }
  }
  return null;
}

/**
 * Why `tokenIds` cannot be the token ids of a hash-routed batch of `tokens` over a vocabulary of
 * `vocab` (tid2eid's rows), or null: an Int32Array of `tokens` ids, each in [0, vocab). The message
 * names the first bad token. The GPU does not read the ids back, so callers check them here first.
 */
export function tokenIdsProblem(tokenIds: unknown, tokens: number, vocab: number): string | null {
  if (!(tokenIds instanceof Int32Array)) {
    return `tokenIds must be an Int32Array [tokens=${tokens}], got ${describeValue(tokenIds)}`;
  }
  if (tokenIds.length !== tokens) {
    return `tokenIds has ${tokenIds.length} elements, expected ${tokens} (one per token)`;
  }
  for (let t = 0; t < tokens; t++) {
    const id = tokenIds[t]!;
    if (id < 0 || id >= vocab) {
      return `tokenIds[${t}] = ${id}: token ${t}'s id is outside the vocabulary [0, ${vocab}) of tid2eid`;
    }
  }
  return null;
}

function checkOperands(
  device: Device,
  x: DeviceTensor,
  gate: GateOperands,
  config: MoEConfig,
  out: GateOutputs,
  tokenIds: DeviceTensor | undefined,
): number {
  if (!validatedConfigs.has(config)) {
    validateConfig(config);
    validatedConfigs.add(config);
  }
  const { numExperts: E, hidden: H, topK } = config;
  const unfit = deviceGateProblem(config);
  if (unfit !== null) throw new Error(`${WHERE}: ${unfit}`);
  if (x.dtype !== "bf16" || x.shape.length !== 2 || x.shape[1] !== H) {
    throw new Error(`${WHERE}: x must be bf16[tokens, ${H}], got ${describeTensor(x.dtype, x.shape)}`);
  }
  const tokens = x.shape[0]!;
  if (tokens * E * 8 >= 2 ** 40 || tokens >= 2 ** 31 / 32) {
    throw new Error(`${WHERE}: ${tokens} tokens are too many for one launch`);
  }
  expectOnDevice(WHERE, "x", x, device);
  expectOperand(WHERE, "gate.weight", gate.weight, "bf16", [E, H], device);
  if (config.router.correctionBias !== (gate.bias !== null)) {
    throw new Error(
      config.router.correctionBias
        ? `${WHERE}: config.router.correctionBias is set but gate.bias is null`
        : `${WHERE}: gate.bias is given but config.router.correctionBias is false`,
    );
  }
  if (gate.bias !== null) expectOperand(WHERE, "gate.bias", gate.bias, "fp32", [E], device);
  const tid2eid = gate.tid2eid ?? null;
  if (config.router.hashRouted === true) {
    if (tid2eid === null) {
      throw new Error(`${WHERE}: config.router.hashRouted is set but gate.tid2eid is absent`);
    }
    if (tid2eid.shape.length !== 2 || tid2eid.shape[0]! < 1 || tid2eid.shape[0]! * topK >= 2 ** 31) {
      throw new Error(
        `${WHERE}: gate.tid2eid must be int32[vocab, ${topK}] with 1 ≤ vocab < 2^31 / ${topK}, got ` +
          describeTensor(tid2eid.dtype, tid2eid.shape),
      );
    }
    expectOperand(WHERE, "gate.tid2eid", tid2eid, "int32", [tid2eid.shape[0]!, topK], device);
    if (tokenIds === undefined) {
      throw new Error(`${WHERE}: config.router.hashRouted is set but options.tokenIds is absent`);
    }
    expectOperand(WHERE, "options.tokenIds", tokenIds, "int32", [tokens], device);
  } else if (tid2eid !== null) {
    throw new Error(`${WHERE}: gate.tid2eid is given but config.router.hashRouted is not set`);
  } else if (tokenIds !== undefined) {
    throw new Error(`${WHERE}: options.tokenIds is given but config.router.hashRouted is not set`);
  }
  expectOperand(WHERE, "out.ids", out.ids, "int32", [tokens, topK], device);
  expectOperand(WHERE, "out.weights", out.weights, "fp32", [tokens, topK], device);
  if (out.logits != null) expectOperand(WHERE, "out.logits", out.logits, "fp32", [tokens, E], device);
  if (x.ptr % 16n !== 0n || gate.weight.ptr % 16n !== 0n) {
    throw new Error(`${WHERE}: x and gate.weight must be 16-byte aligned (16-byte loads)`);
  }
  return tokens;
}

const scaleBits = new DataView(new ArrayBuffer(8));

/** The bits of a double, for a kernel argument read with __longlong_as_double. */
function doubleBits(v: number): bigint {
  scaleBits.setFloat64(0, v, true);
  return scaleBits.getBigUint64(0, true);
}

// ---------------------------------------------------------------------------------------------------
// Launch

/**
 * Queues the router for x (bf16 [T, H]) on `stream` (null: the legacy default stream): writes out.ids,
 * out.weights and, when given, out.logits. T = 0 queues nothing. Inputs must be finite (the GPU cannot
 * throw as the CPU reference does; a non-finite selection score that leaves fewer than k candidates
 * gives id −1 and weight 0 in those slots). `options.logits` picks how the logits are summed. The
 * first call for a (device, E) compiles the kernels.
 *
 * A hash-routed config (config.router.hashRouted) needs gate.tid2eid and options.tokenIds and routes
 * as `routeByHash`: ids tid2eid[tokenIds[t]] in table order, weights from the same scores by the same
 * rule as score routing (so with the same logits, the reference's ids and weights).
 */
export function routeOnDevice(
  device: Device,
  x: DeviceTensor,
  gate: GateOperands,
  config: MoEConfig,
  out: GateOutputs,
  stream: Stream | null,
  options: GateOptions = {},
): void {
  checkOptionFields(`${WHERE} options`, options, ["logits", "tokenIds"], (m) => new RangeError(m));
  const tokens = checkOperands(device, x, gate, config, out, options.tokenIds);
  if (options.logits !== undefined && options.logits !== "exact" && options.logits !== "fast") {
    throw new Error(
      `${WHERE}: options.logits must be "exact" or "fast", got ${describeValue(options.logits)}`,
    );
  }
  if (tokens === 0) return;
  const { numExperts: E, hidden: H, topK } = config;
  const r = config.router;
  const plan = planGate(
    tokens,
    H,
    E,
    device.smCount,
    options.logits ?? defaultGateLogits(tokens, H, E, r.scoring),
  );
  const ws = reserveGateWorkspace(device, plan.workspaceBytes);
  const k = gateKernelsFor(device, E);
  k.logitsArgs
    .ptr(0, x.ptr)
    .ptr(1, gate.weight.ptr)
    .ptr(2, ws.ptr)
    .u32(3, tokens)
    .u32(4, H)
    .u32(5, plan.splits)
    .u32(6, plan.stepsPerSplit);
  k.logits[plan.logits].launchAfterPrevious(plan.logitsBlocks, 32 * WARPS_PER_BLOCK, 0, stream, k.logitsArgs);
  if (r.hashRouted === true) {
    const tid2eid = gate.tid2eid!; // checkOperands: present for a hash-routed config, as is tokenIds
    k.selectHashArgs
      .ptr(0, ws.ptr)
      .u32(1, plan.splits)
      .u32(2, tokens)
      .u32(3, SCORING_CODES[r.scoring])
      .ptr(4, tid2eid.ptr)
      .ptr(5, options.tokenIds!.ptr)
      .u32(6, tid2eid.shape[0]!)
      .u32(7, topK)
      .u32(8, r.renormalize ? 1 : 0)
      .u64(9, doubleBits(r.routedScalingFactor))
      .ptr(10, out.ids.ptr)
      .ptr(11, out.weights.ptr)
      .ptr(12, out.logits?.ptr ?? 0n);
    k.selectHash.launchAfterPrevious(plan.selectBlocks, 32 * WARPS_PER_BLOCK, 0, stream, k.selectHashArgs);
    return;
  }
  k.selectArgs
    .ptr(0, ws.ptr)
    .u32(1, plan.splits)
    .u32(2, tokens)
    .ptr(3, gate.bias?.ptr ?? 0n)
    .u32(4, SCORING_CODES[r.scoring])
    .u32(5, r.nGroup)
    .u32(6, r.topkGroup)
    .u32(7, topK)
    .u32(8, r.renormalize ? 1 : 0)
    .u64(9, doubleBits(r.routedScalingFactor))
    .ptr(10, out.ids.ptr)
    .ptr(11, out.weights.ptr)
    .ptr(12, out.logits?.ptr ?? 0n);
  k.select.launchAfterPrevious(plan.selectBlocks, 32 * WARPS_PER_BLOCK, 0, stream, k.selectArgs);
}
