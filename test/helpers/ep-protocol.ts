/**
 * An executable CPU model of expert parallelism inside the fused kernel (docs/design.md, "The in-kernel
 * protocol"): the kernel is not built yet, and this is the protocol it must follow.
 *
 * R ranks, each with one symmetric buffer (an ArrayBuffer cut into the regions of `protocolLayout`, the
 * kernel's byte layout), run consecutive forwards. Each rank's launch is a set of CTAs written as
 * generators; a seeded scheduler steps one CTA of one rank at a time, picked at random with a per-rank
 * speed, so every `yield` is a point where any other CTA, of this rank or another, may act. A rank
 * starts its next launch as soon as its own launch ends (stream order, no host sync between forwards).
 * Atomics are whole steps; every wait is bounded, and a wait that expires (or waits on a rank that gave
 * up) traps its rank's launch after naming the rank to blame, as the kernel's watchdog is to do.
 *
 * What it checks is the protocol's logic: what each rank waits for before it reads, where each row and
 * result lands, the orders that make the results bit-identical to the host-planned ExpertParallelMoE,
 * the reset between forwards and the dead-peer errors. Not the memory model: a step is sequentially
 * consistent, so the fences design.md lists are for the GPU tests to exercise.
 *
 * Test code, not product code: nothing in the library runs it. Its users are the protocol tests and,
 * once the kernel exists, the kernel's GPU tests, which compare its counters and pool order with these.
 */
import { type MoEConfig, QUANT_BLOCK } from "../../src/config/config.js";
import { bf16BitsToF32, f32ToBf16Bits } from "../../src/numerics/bf16.js";
import { quantizeActivations } from "../../src/numerics/quant.js";
import type { RankInput } from "../../src/parallel/expert-parallel.js";
import { expertOnQuantizedRows } from "../../src/reference/moe.js";
import { randomRouting } from "../../src/reference/router.js";
import { generateActivations } from "../../src/weights/generate.js";
import type { MoEWeightSource } from "../../src/weights/types.js";
import { rng, rngU32 } from "./random.js";

/** What sizes a rank's symmetric buffer. */
export interface ProtocolShape {
  ranks: number;
  numExperts: number;
  topK: number;
  hidden: number;
  /** Tokens a rank may bring to one forward. */
  maxTokens: number;
  /** Rows of a pool block (a tile's rows). */
  blockM: number;
  /** Tokens of a count / describe chunk (the kernel: 4096 slots' worth). */
  chunkTokens: number;
}

const REGIONS = {
  // Written by the rank itself before its launch (quantization, router); read by peers.
  header: ["u32", "header"], // epoch, tokens
  xq: ["u8", "tokens × H"],
  xs: ["f32", "tokens × H/128"],
  ids: ["i32", "tokens × k"],
  weights: ["f32", "tokens × k"],
  // Written by peers.
  flag: ["u32", "R"],
  counts: ["u32", "2 × R × L"],
  inboxRows: ["u32", "2 × R"],
  inbox: ["i32", "2 × R × tokens × (1 + 2kd)"],
  arrived: ["u32", "R"],
  waitingOn: ["u32", "R"],
  gaveUp: ["u32", "R"],
  combine: ["u16", "tokens × k × H"],
  // The rank's own workspace (in the kernel it need not be symmetric).
  counters: ["u32", "counters"],
  chunkCount: ["u32", "chunks × E"],
  chunkRows: ["u32", "chunks × R"],
  expect: ["u32", "R"],
  blockArrived: ["u32", "blocks"],
  poolSource: ["i32", "pool × 2"],
  poolXq: ["u8", "pool × H"],
  poolXs: ["f32", "pool × H/128"],
  sharedY: ["u16", "tokens × H"],
  out: ["u16", "tokens × H"],
} as const;
type RegionName = keyof typeof REGIONS;

export interface ProtocolLayout {
  shape: ProtocolShape;
  /** Experts per rank, E / R. */
  localExperts: number;
  /** Slots a token can have on one rank, min(k, E / R). */
  localTopK: number;
  /** int32 words of one row descriptor: the token, then (slot | local expert << 8, index) per local slot. */
  descriptorWords: number;
  maxChunks: number;
  /** Pool rows: every rank's tokens with localTopK slots here, then the shared expert's rows. */
  poolRows: number;
  maxBlocks: number;
  /** Byte offset and length of each region, 16-byte aligned. */
  regions: Record<RegionName, { offset: number; bytes: number }>;
  bytes: number;
}

// Counter words of the rank's workspace.
const C = {
  countClaim: 0,
  countDone: 1,
  describeClaim: 2,
  describeDone: 3,
  publishClaim: 4,
  placeClaim: 5,
  tileClaim: 6,
  sharedDone: 7,
  combineClaim: 8,
  exit: 9,
  words: 10,
} as const;

/** The regions of one rank's symmetric buffer (every rank's is the same). */
export function protocolLayout(shape: ProtocolShape): ProtocolLayout {
  const { ranks: R, numExperts: E, topK: k, hidden: H, maxTokens: T, blockM } = shape;
  if (!Number.isInteger(E / R) || H % QUANT_BLOCK !== 0) {
    throw new RangeError(`protocolLayout: ${E} experts on ${R} ranks, hidden ${H}`);
  }
  const L = E / R;
  const kd = Math.min(k, L);
  const maxChunks = Math.ceil(T / shape.chunkTokens);
  const routed = R * T * kd;
  const poolRows = routed + T;
  const maxBlocks = Math.ceil(routed / blockM) + L + Math.ceil(T / blockM);
  const W = 1 + 2 * kd;
  const kb = H / QUANT_BLOCK;
  const count: Record<RegionName, number> = {
    header: 4,
    xq: T * H,
    xs: T * kb,
    ids: T * k,
    weights: T * k,
    flag: R,
    counts: 2 * R * L,
    inboxRows: 2 * R,
    inbox: 2 * R * T * W,
    arrived: R,
    waitingOn: R,
    gaveUp: R,
    combine: T * k * H,
    counters: C.words,
    chunkCount: maxChunks * E,
    chunkRows: maxChunks * R,
    expect: R,
    blockArrived: maxBlocks,
    poolSource: poolRows * 2,
    poolXq: poolRows * H,
    poolXs: poolRows * kb,
    sharedY: T * H,
    out: T * H,
  };
  const size = { u8: 1, u16: 2, u32: 4, i32: 4, f32: 4 } as const;
  let at = 0;
  const regions = {} as Record<RegionName, { offset: number; bytes: number }>;
  for (const name of Object.keys(REGIONS) as RegionName[]) {
    const bytes = count[name] * size[REGIONS[name][0]];
    regions[name] = { offset: at, bytes };
    at += Math.ceil(bytes / 16) * 16;
  }
  return {
    shape,
    localExperts: L,
    localTopK: kd,
    descriptorWords: W,
    maxChunks,
    poolRows,
    maxBlocks,
    regions,
    bytes: at,
  };
}

/** One rank's symmetric buffer as typed views of its regions. */
class SymmetricBuffer {
  readonly header: Uint32Array;
  readonly xq: Uint8Array;
  readonly xs: Float32Array;
  readonly ids: Int32Array;
  readonly weights: Float32Array;
  readonly flag: Uint32Array;
  readonly counts: Uint32Array;
  readonly inboxRows: Uint32Array;
  readonly inbox: Int32Array;
  readonly arrived: Uint32Array;
  readonly waitingOn: Uint32Array;
  readonly gaveUp: Uint32Array;
  readonly combine: Uint16Array;
  readonly counters: Uint32Array;
  readonly chunkCount: Uint32Array;
  readonly chunkRows: Uint32Array;
  readonly expect: Uint32Array;
  readonly blockArrived: Uint32Array;
  readonly poolSource: Int32Array;
  readonly poolXq: Uint8Array;
  readonly poolXs: Float32Array;
  readonly sharedY: Uint16Array;
  readonly out: Uint16Array;

  constructor(layout: ProtocolLayout) {
    const memory = new ArrayBuffer(layout.bytes); // zeroed, as SymmetricHeap.zero() leaves it
    const r = layout.regions;
    const view = <T>(make: new (b: ArrayBuffer, o: number, n: number) => T, name: RegionName, size: number) =>
      new make(memory, r[name].offset, r[name].bytes / size);
    this.header = view(Uint32Array, "header", 4);
    this.xq = view(Uint8Array, "xq", 1);
    this.xs = view(Float32Array, "xs", 4);
    this.ids = view(Int32Array, "ids", 4);
    this.weights = view(Float32Array, "weights", 4);
    this.flag = view(Uint32Array, "flag", 4);
    this.counts = view(Uint32Array, "counts", 4);
    this.inboxRows = view(Uint32Array, "inboxRows", 4);
    this.inbox = view(Int32Array, "inbox", 4);
    this.arrived = view(Uint32Array, "arrived", 4);
    this.waitingOn = view(Uint32Array, "waitingOn", 4);
    this.gaveUp = view(Uint32Array, "gaveUp", 4);
    this.combine = view(Uint16Array, "combine", 2);
    this.counters = view(Uint32Array, "counters", 4);
    this.chunkCount = view(Uint32Array, "chunkCount", 4);
    this.chunkRows = view(Uint32Array, "chunkRows", 4);
    this.expect = view(Uint32Array, "expect", 4);
    this.blockArrived = view(Uint32Array, "blockArrived", 4);
    this.poolSource = view(Int32Array, "poolSource", 4);
    this.poolXq = view(Uint8Array, "poolXq", 1);
    this.poolXs = view(Float32Array, "poolXs", 4);
    this.sharedY = view(Uint16Array, "sharedY", 2);
    this.out = view(Uint16Array, "out", 2);
  }
}

/**
 * Deliberate breaks, each what a plausible kernel might do, for showing that the tests catch them:
 * - "arrival-placement": pool rows claimed from a per-expert cursor as rows arrive (the one-GPU
 *   kernel's scheme) instead of at the offsets the counts fix: the pool order then varies run to run.
 * - "arrival-rank-combine": the ranks' partials added in the order their rows completed, not rank order.
 * - "single-publication-buffer": counts and descriptors in one buffer, not one per epoch parity, so a
 *   peer's next forward can write them before this rank has read the last ones.
 */
export type ProtocolMutation = "arrival-placement" | "arrival-rank-combine" | "single-publication-buffer";

export interface ProtocolOptions {
  /** The interleaving (and the CTA counts and rank speeds unless given). */
  seed: number;
  /** CTAs per rank (default: 1 to 3, from the seed). */
  ctas?: readonly number[];
  /** Run the shared expert (default: when the config has one). */
  shared?: boolean;
  blockM?: number;
  chunkTokens?: number;
  /** A rank that stops: before `forward` starts, or in it just after publishing its counts. */
  dead?: { rank: number; forward: number; after: "start" | "publish" };
  mutation?: ProtocolMutation;
  /** Scheduler steps a wait may last (the kernel's 2 s); an expired wait traps its rank's launch. */
  deadline?: number;
}

/**
 * A bounded wait that failed: it expired, or a rank it waited for had given up itself. `peers` are the
 * ranks to blame: those that never delivered, with a rank that gave up replaced by the one it blamed.
 */
export class PeerTimeoutError extends Error {
  override name = "PeerTimeoutError";
  constructor(
    readonly rank: number,
    readonly forward: number,
    readonly peers: readonly number[],
    what: string,
  ) {
    super(`rank ${rank}, forward ${forward}: ${what}`);
  }
}

/** One rank's forward: its output or its error, and the pool it built (for the order checks). */
export interface RankForward {
  out: Uint16Array | null;
  error: PeerTimeoutError | null;
  /** counts[s · L + e]: slots of source rank s on local expert e, as the offsets phase read them. */
  counts: Uint32Array | null;
  /** Per pool row: source rank and token · k + slot (routed rows), or −1 and the token (shared rows). */
  poolSource: Int32Array | null;
  /** First pool row of each local expert, then of the shared expert, then the end. */
  groupStart: Int32Array | null;
}

/** Bytes that crossed ranks in one forward, by kind (a rank's accesses to its own buffer excluded). */
export interface ProtocolTraffic {
  /** FP8 rows and their fp32 scales pulled by owners. */
  rows: number;
  /** bf16 expert results pushed into the token owners' combine areas. */
  results: number;
  /** Row descriptors and their row counts. */
  descriptors: number;
  /** Count reservations (atomic adds), flags and arrival counts. */
  control: number;
}

export interface ProtocolRun {
  /** forwards[f][rank]. */
  forwards: RankForward[][];
  traffic: ProtocolTraffic[];
  steps: number;
}

interface Wait {
  ready: () => boolean;
  /** The peer ranks that have not delivered yet (none: a wait on this rank's own CTAs). */
  missing: () => number[];
  /** What was waited for, given those ranks and the ranks to blame (see `blame`). */
  what: (missing: number[], blamed: number[]) => string;
}

type CtaBody = Generator<Wait | undefined, void, undefined>;

interface Cta {
  launch: Launch;
  body: CtaBody;
  waiting: Wait | null;
  since: number;
  /** Whether this wait has told the peers whom it waits on (past half the deadline). */
  reported: boolean;
}

/** One rank's launch for one forward. */
interface Launch {
  rank: number;
  forward: number;
  epoch: number;
  tokens: number;
  ctas: number;
  running: Cta[];
  result: RankForward;
  /** "arrival-placement": the per-expert cursors. */
  cursor: Int32Array;
  /** "arrival-rank-combine": ranks in the order their rows for this rank completed. */
  completed: number[];
}

/** The scheduler's clock and rng, and the ranks' buffers. */
class World {
  readonly layout: ProtocolLayout;
  readonly buffers: SymmetricBuffer[];
  readonly traffic: ProtocolTraffic[];
  readonly forwards: RankForward[][];
  readonly launches: (Launch | null)[];
  time = 0;

  constructor(
    readonly config: MoEConfig,
    readonly source: MoEWeightSource,
    readonly inputs: readonly (readonly RankInput[])[],
    readonly options: ProtocolOptions,
    readonly shared: boolean,
    shape: ProtocolShape,
  ) {
    this.layout = protocolLayout(shape);
    this.buffers = Array.from({ length: shape.ranks }, () => {
      const b = new SymmetricBuffer(this.layout);
      b.header[0] = 1; // epochs start at 1: a zeroed flag is never a publication
      return b;
    });
    this.traffic = inputs.map(() => ({ rows: 0, results: 0, descriptors: 0, control: 0 }));
    this.forwards = inputs.map(() =>
      Array.from({ length: shape.ranks }, () => ({
        out: null,
        error: null,
        counts: null,
        poolSource: null,
        groupStart: null,
      })),
    );
    this.launches = new Array(shape.ranks).fill(null);
  }

  /** Whether rank `peer` gave up, as rank `rank` sees it in its own buffer. */
  gaveUp(rank: number, peer: number): boolean {
    return this.buffers[rank]!.gaveUp[peer] !== 0;
  }

  /** Rank `rank` writes the mask of the ranks it waits on into every buffer (0: it waits on none). */
  postWaitingOn(rank: number, missing: readonly number[]): void {
    const mask = missing.reduce((m, p) => m | (1 << p), 0) >>> 0;
    for (const b of this.buffers) b.waitingOn[rank] = mask; // st.relaxed.sys
  }

  /**
   * The ranks to blame for `missing`, as rank `rank` sees the others' waitingOn words: follow each
   * missing rank to what it waits on, and blame the ranks reached that wait on nobody (dead, or stuck
   * outside the protocol). A cycle or nothing reached: the missing ranks themselves.
   */
  blame(rank: number, missing: readonly number[]): number[] {
    const waits = this.buffers[rank]!.waitingOn;
    const seen = new Set<number>([rank]);
    const todo = [...missing];
    const culprits = new Set<number>();
    while (todo.length > 0) {
      const p = todo.pop()!;
      if (seen.has(p)) continue;
      seen.add(p);
      if (waits[p] === 0) culprits.add(p);
      for (let q = 0; q < 32; q++) if ((waits[p]! >>> q) & 1) todo.push(q);
    }
    return (culprits.size > 0 ? [...culprits] : [...missing]).sort((a, b) => a - b);
  }

  /** Counts bytes that rank `from` moves to or from rank `to`'s buffer, when they differ. */
  cross(forward: number, from: number, to: number, kind: keyof ProtocolTraffic, bytes: number): void {
    if (from !== to) this.traffic[forward]![kind] += bytes;
  }
}

/** Wrap-safe "epoch a is at or after epoch b" for u32 epochs. */
function atOrAfter(a: number, b: number): boolean {
  return ((a - b) | 0) >= 0;
}

/**
 * Runs `inputs[f][rank]` (forward f of every rank) through the protocol on `source`'s weights in the
 * interleaving `options.seed` picks. Every rank's result is returned, errors included: nothing throws
 * for a dead peer.
 */
export function runProtocol(
  source: MoEWeightSource,
  inputs: readonly (readonly RankInput[])[],
  options: ProtocolOptions,
): ProtocolRun {
  const config = source.config;
  const ranks = inputs[0]!.length;
  const maxTokens = Math.max(1, ...inputs.flatMap((f) => f.map((i) => i.tokens)));
  const shape: ProtocolShape = {
    ranks,
    numExperts: config.numExperts,
    topK: config.topK,
    hidden: config.hidden,
    maxTokens,
    blockM: options.blockM ?? 2,
    chunkTokens: options.chunkTokens ?? 3,
  };
  if (ranks > 32) throw new RangeError("runProtocol: the waitingOn words are 32-bit masks: at most 32 ranks");
  const shared = (options.shared ?? true) && config.numShared > 0;
  const world = new World(config, source, inputs, options, shared, shape);
  const random = rng(options.seed);
  const ctas = options.ctas ?? Array.from({ length: ranks }, () => 1 + Math.floor(random() * 3));
  // Ranks run at different speeds, so one may run a forward ahead of a slow peer.
  const speed = Array.from({ length: ranks }, () => 1 + Math.floor(random() * 8));
  const deadline = options.deadline ?? 1_000_000;
  const dead = options.dead;
  const next = new Array<number>(ranks).fill(0); // the forward each rank starts next

  const start = (rank: number): void => {
    const f = next[rank]!;
    world.launches[rank] = null;
    if (f >= inputs.length || (dead?.rank === rank && dead.forward <= f && dead.after === "start")) return;
    next[rank] = f + 1;
    world.launches[rank] = beginLaunch(world, rank, f, ctas[rank]!);
  };
  for (let r = 0; r < ranks; r++) start(r);

  let steps = 0;
  for (;;) {
    const running = world.launches.flatMap((l) => l?.running ?? []);
    if (running.length === 0) break;
    const runnable = running.filter((c) => c.waiting === null || c.waiting.ready());
    if (runnable.length === 0) {
      // Every CTA waits on something no running CTA will deliver: time runs to the next report or deadline.
      world.time = Math.min(...running.map((c) => c.since + (c.reported ? deadline : deadline / 2)));
    } else {
      let pick = random() * runnable.reduce((n, c) => n + speed[c.launch.rank]!, 0);
      let cta = runnable[runnable.length - 1]!;
      for (const c of runnable) {
        pick -= speed[c.launch.rank]!;
        if (pick < 0) {
          cta = c;
          break;
        }
      }
      const reported = cta.reported;
      cta.waiting = null;
      cta.reported = false;
      if (reported) {
        // This wait is over: the rank now waits on what its other reported waits still miss.
        const still = cta.launch.running.filter((c) => c.reported).flatMap((c) => c.waiting!.missing());
        world.postWaitingOn(cta.launch.rank, still);
      }
      const r = cta.body.next();
      steps++;
      world.time++;
      const launch = cta.launch;
      if (r.done) {
        launch.running.splice(launch.running.indexOf(cta), 1);
        if (launch.running.length === 0 && launch.result.error === null) {
          const halted = dead?.rank === launch.rank && dead.forward === launch.forward;
          if (!halted) start(launch.rank);
          else world.launches[launch.rank] = null;
        }
      } else if (r.value !== undefined) {
        cta.waiting = r.value;
        cta.since = world.time;
      }
    }
    // The watchdog: a wait that expired, or that waits on a rank which gave up, traps its launch (a trap
    // ends the whole grid, and the rank's stream), after telling every peer whom it blames.
    for (const l of world.launches) {
      if (l === null) continue;
      for (const c of l.running) {
        if (c.waiting === null || c.reported || world.time - c.since < deadline / 2 || c.waiting.ready())
          continue;
        c.reported = true; // half the deadline gone: say whom it waits on, so that others can blame well
        world.postWaitingOn(l.rank, c.waiting.missing());
      }
      const failed = l.running.find((c) => {
        if (c.waiting === null || c.waiting.ready()) return false;
        return world.time - c.since >= deadline || c.waiting.missing().some((p) => world.gaveUp(l.rank, p));
      });
      if (failed === undefined) continue;
      const missing = failed.waiting!.missing();
      const peers = world.blame(l.rank, missing);
      l.result.error = new PeerTimeoutError(l.rank, l.forward, peers, failed.waiting!.what(missing, peers));
      for (const b of world.buffers) b.gaveUp[l.rank] = 1; // st.relaxed.sys, then trap
      l.running.length = 0;
      world.launches[l.rank] = null;
    }
  }
  return { forwards: world.forwards, traffic: world.traffic, steps };
}

/** The rank's pre-launch work (quantization and router into its own regions), then its CTAs. */
function beginLaunch(world: World, rank: number, forward: number, ctas: number): Launch {
  const { config } = world;
  const b = world.buffers[rank]!;
  const input = world.inputs[forward]![rank]!;
  const { hidden: H, topK: k } = config;
  const q = quantizeActivations(input.x, input.tokens, H, config.scaleFormat);
  b.xq.set(q.q);
  b.xs.set(q.scales);
  b.ids.set(input.ids);
  b.weights.set(input.weights);
  b.header[1] = input.tokens;
  if (input.ids.length !== input.tokens * k)
    throw new RangeError(`rank ${rank}: ids of ${input.tokens} × ${k}`);
  const launch: Launch = {
    rank,
    forward,
    epoch: b.header[0]!,
    tokens: input.tokens,
    ctas,
    running: [],
    result: world.forwards[forward]![rank]!,
    cursor: new Int32Array(world.layout.localExperts + 1),
    completed: [],
  };
  for (let i = 0; i < ctas; i++) {
    launch.running.push({ launch, body: ctaBody(world, launch), waiting: null, since: 0, reported: false });
  }
  return launch;
}

/** One CTA of rank `launch.rank`: every phase, claiming work from the rank's counters. */
function* ctaBody(world: World, launch: Launch): CtaBody {
  const { config, layout, buffers, options } = world;
  const { ranks: R, numExperts: E, topK: k, hidden: H, maxTokens: Tmax, blockM, chunkTokens } = layout.shape;
  const { localExperts: L, localTopK: kd, descriptorWords: W } = layout;
  const kb = H / QUANT_BLOCK;
  const s = launch.rank;
  const f = launch.forward;
  const me = buffers[s]!;
  const T = launch.tokens;
  const epoch = launch.epoch;
  const parity = options.mutation === "single-publication-buffer" ? 0 : epoch & 1;
  const nChunks = Math.ceil(T / chunkTokens);
  const owner = (e: number) => Math.floor(e / L);
  const claim = (word: number) => me.counters[word]++;
  const none = () => [];
  const ranks = (list: readonly number[]) => `rank${list.length > 1 ? "s" : ""} ${list.join(", ")}`;
  const culprits = (missing: number[], blamed: number[]) => {
    const gave = missing.filter((p) => world.gaveUp(s, p));
    const also = gave.length > 0 ? ` (${ranks(gave)} gave up waiting on it)` : "";
    return `${ranks(blamed)} dead or not in step${also}`;
  };

  // Count: per chunk of this rank's tokens, slots per global expert and tokens per destination rank;
  // the counts are reserved in the owners' buffers with remote atomic adds (their sums do not depend on
  // the order), into the half of the owners' count area that this epoch's parity names.
  for (let c = claim(C.countClaim); c < nChunks; c = claim(C.countClaim)) {
    yield;
    const hist = new Uint32Array(E);
    const rows = new Uint32Array(R);
    for (let t = c * chunkTokens; t < Math.min(T, (c + 1) * chunkTokens); t++) {
      const seen = new Uint8Array(R);
      for (let j = 0; j < k; j++) {
        const e = me.ids[t * k + j]!;
        if (e < 0) continue;
        hist[e]! += 1;
        if (seen[owner(e)] === 0) {
          seen[owner(e)] = 1;
          rows[owner(e)]! += 1;
        }
      }
    }
    me.chunkCount.set(hist, c * E);
    me.chunkRows.set(rows, c * R);
    yield;
    for (let e = 0; e < E; e++) {
      if (hist[e] === 0) continue;
      const d = owner(e);
      buffers[d]!.counts[(parity * R + s) * L + (e % L)]! += hist[e]!; // red.relaxed.sys.add
      world.cross(f, s, d, "control", 4);
      yield;
    }
    me.counters[C.countDone]! += 1; // red.release.gpu
    yield;
  }

  // Describe: each row (a token, once per destination rank) goes to the owner's inbox, in token order,
  // with each of its slots' index among this rank's slots on that expert: the owner's pool row then
  // needs only its per-(source, expert) base.
  yield {
    ready: () => me.counters[C.countDone] === nChunks,
    missing: none,
    what: () =>
      `waited past the deadline for its own count chunks (${me.counters[C.countDone]} of ${nChunks})`,
  };
  for (let c = claim(C.describeClaim); c < nChunks; c = claim(C.describeClaim)) {
    const index = new Uint32Array(E);
    const rowAt = new Uint32Array(R);
    for (let before = 0; before < c; before++) {
      for (let e = 0; e < E; e++) index[e]! += me.chunkCount[before * E + e]!;
      for (let d = 0; d < R; d++) rowAt[d]! += me.chunkRows[before * R + d]!;
    }
    yield;
    for (let t = c * chunkTokens; t < Math.min(T, (c + 1) * chunkTokens); t++) {
      for (let d = 0; d < R; d++) {
        const row = new Int32Array(W).fill(-1);
        row[0] = t;
        let u = 0;
        for (let j = 0; j < k; j++) {
          const e = me.ids[t * k + j]!;
          if (e < 0 || owner(e) !== d) continue;
          row[1 + 2 * u] = j | ((e % L) << 8);
          row[2 + 2 * u] = index[e]!++;
          u++;
        }
        if (u === 0) continue;
        buffers[d]!.inbox.set(row, ((parity * R + s) * Tmax + rowAt[d]!++) * W);
        world.cross(f, s, d, "descriptors", 4 * W);
        yield;
      }
    }
    me.counters[C.describeDone]! += 1;
    yield;
  }

  // Publish (one CTA): the row counts, then the flag, an epoch stamp, to every rank (itself included).
  if (claim(C.publishClaim) === 0) {
    yield {
      ready: () => me.counters[C.describeDone] === nChunks,
      missing: none,
      what: () => `waited past the deadline for its own describe chunks`,
    };
    me.expect.fill(0);
    for (let c = 0; c < nChunks; c++) {
      for (let e = 0; e < E; e++) me.expect[owner(e)]! += me.chunkCount[c * E + e]!;
    }
    for (let d = 0; d < R; d++) {
      let rows = 0;
      for (let c = 0; c < nChunks; c++) rows += me.chunkRows[c * R + d]!;
      buffers[d]!.inboxRows[parity * R + s] = rows;
      world.cross(f, s, d, "descriptors", 4);
    }
    yield;
    for (let d = 0; d < R; d++) {
      buffers[d]!.flag[s] = epoch; // fence.acq_rel.sys; st.release.sys
      world.cross(f, s, d, "control", 4);
      yield;
    }
  }
  const dead = options.dead;
  if (dead?.rank === s && dead.forward === f && dead.after === "publish") return;

  // Offsets (owner side): once every source has published this epoch, the pool layout, the same in
  // every CTA: experts' rows dense in expert order, each expert's rows by source rank, the shared
  // expert's T rows last.
  yield {
    ready: () => {
      for (let src = 0; src < R; src++) if (!atOrAfter(me.flag[src]!, epoch)) return false;
      return true;
    },
    missing: () =>
      Array.from({ length: R }, (_, src) => src).filter((src) => !atOrAfter(me.flag[src]!, epoch)),
    what: (missing, blamed) =>
      `gave up waiting for the counts and row descriptors of epoch ${epoch} from ${ranks(missing)}: ${culprits(missing, blamed)}`,
  };
  const groups = world.shared ? L + 1 : L;
  const groupStart = new Int32Array(L + 2);
  const groupBlock = new Int32Array(L + 2);
  const base = new Int32Array(R * L);
  for (let e = 0; e < L; e++) {
    let rows = 0;
    for (let src = 0; src < R; src++) {
      base[src * L + e] = rows;
      rows += me.counts[(parity * R + src) * L + e]!;
    }
    groupStart[e + 1] = groupStart[e]! + rows;
    groupBlock[e + 1] = groupBlock[e]! + Math.ceil(rows / blockM);
  }
  const sharedRows = world.shared ? T : 0;
  groupStart[L + 1] = groupStart[L]! + sharedRows;
  groupBlock[L + 1] = groupBlock[L]! + Math.ceil(sharedRows / blockM);
  const inboxStart = new Int32Array(R + 1);
  for (let src = 0; src < R; src++) inboxStart[src + 1] = inboxStart[src]! + me.inboxRows[parity * R + src]!;
  if (launch.result.counts === null) {
    launch.result.counts = me.counts.slice(parity * R * L, (parity + 1) * R * L);
    launch.result.groupStart = groupStart.slice();
  }
  yield;

  // Place (owner side): each inbox row pulls its token's FP8 row and scales from the source's buffer once
  // and stores them at every pool row its slots name; then the shared expert's rows from this rank.
  const routedRows = inboxStart[R]!;
  const blockOf = (g: number, row: number) => groupBlock[g]! + Math.floor((row - groupStart[g]!) / blockM);
  const store = (row: number, q: Uint8Array, sc: Float32Array, src: number, what: number, g: number) => {
    me.poolXq.set(q, row * H);
    me.poolXs.set(sc, row * kb);
    me.poolSource[2 * row] = src;
    me.poolSource[2 * row + 1] = what;
    me.blockArrived[blockOf(g, row)]! += 1; // red.release.gpu
  };
  for (let i = claim(C.placeClaim); i < routedRows + sharedRows; i = claim(C.placeClaim)) {
    if (i >= routedRows) {
      const t = i - routedRows;
      store(groupStart[L]! + t, me.xq.slice(t * H, (t + 1) * H), me.xs.slice(t * kb, (t + 1) * kb), -1, t, L);
      yield;
      continue;
    }
    let src = 0;
    while (inboxStart[src + 1]! <= i) src++;
    const at = ((parity * R + src) * Tmax + i - inboxStart[src]!) * W;
    const row = me.inbox.slice(at, at + W);
    const t = row[0]!;
    const peer = buffers[src]!;
    const q = peer.xq.slice(t * H, (t + 1) * H); // a bulk copy from the peer (fence.proxy.async first)
    const sc = peer.xs.slice(t * kb, (t + 1) * kb);
    world.cross(f, s, src, "rows", H + 4 * kb);
    yield;
    for (let u = 0; u < kd && row[1 + 2 * u]! >= 0; u++) {
      const j = row[1 + 2 * u]! & 0xff;
      const e = row[1 + 2 * u]! >> 8;
      const p =
        options.mutation === "arrival-placement"
          ? groupStart[e]! + launch.cursor[e]!++
          : groupStart[e]! + base[src * L + e]! + row[2 + 2 * u]!;
      store(p, q, sc, src, t * k + j, e);
      yield;
    }
  }

  // Tiles (owner side): a block once all its rows arrived; a routed row's bf16 result goes straight to
  // its token's slot in the token owner's combine area, and each run of one source's rows counts its
  // arrival there (release, system scope); the shared expert's rows stay here.
  const blocks = groupBlock[groups]!;
  for (let b = claim(C.tileClaim); b < blocks; b = claim(C.tileClaim)) {
    let g = 0;
    while (groupBlock[g + 1]! <= b) g++;
    const r0 = groupStart[g]! + (b - groupBlock[g]!) * blockM;
    const r1 = Math.min(groupStart[g + 1]!, r0 + blockM);
    yield {
      ready: () => me.blockArrived[b] === r1 - r0,
      missing: none,
      what: () =>
        `waited past the deadline for its own pool block ${b} (${me.blockArrived[b]} of ${r1 - r0} rows)`,
    };
    const weights = g < L ? world.source.expert(s * L + g) : world.source.shared()!;
    const y = expertOnQuantizedRows(
      config,
      weights,
      me.poolXq.subarray(r0 * H, r1 * H),
      me.poolXs.subarray(r0 * kb, r1 * kb),
      r1 - r0,
    );
    yield;
    if (g === L) {
      for (let r = r0; r < r1; r++)
        me.sharedY.set(y.subarray((r - r0) * H, (r - r0 + 1) * H), me.poolSource[2 * r + 1]! * H);
      me.counters[C.sharedDone]! += r1 - r0;
      yield;
      continue;
    }
    let r = r0;
    while (r < r1) {
      const src = me.poolSource[2 * r]!;
      let end = r;
      for (; end < r1 && me.poolSource[2 * end] === src; end++) {
        buffers[src]!.combine.set(
          y.subarray((end - r0) * H, (end - r0 + 1) * H),
          me.poolSource[2 * end + 1]! * H,
        );
        world.cross(f, s, src, "results", 2 * H);
        yield;
      }
      const to = buffers[src]!;
      to.arrived[s]! += end - r; // fence.acq_rel.sys; red.release.sys.add
      world.cross(f, s, src, "control", 4);
      const peerLaunch = world.launches[src];
      if (to.arrived[s] === to.expect[s] && peerLaunch !== null) peerLaunch.completed.push(s);
      r = end;
      yield;
    }
  }

  // Combine (token owner): once every owner's rows for this rank's tokens arrived, per token the host
  // plan's sum: the shared expert, then per owner rank in rank order that rank's slots in slot order,
  // rounded to bf16 as the rank's partial, all in fp32, one final bf16 rounding.
  yield {
    ready: () => {
      for (let d = 0; d < R; d++) if (me.arrived[d]! < me.expect[d]!) return false;
      return true;
    },
    missing: () => Array.from({ length: R }, (_, d) => d).filter((d) => me.arrived[d]! < me.expect[d]!),
    what: (missing, blamed) => {
      const detail = missing.map((d) => `${me.arrived[d]} of ${me.expect[d]} rows from rank ${d}`).join(", ");
      return `gave up waiting for its tokens' expert results (${detail}): ${culprits(missing, blamed)}`;
    },
  };
  yield {
    ready: () => me.counters[C.sharedDone] === sharedRows,
    missing: none,
    what: () => `waited past the deadline for its own shared expert rows`,
  };
  const acc = new Float32Array(H);
  const partial = new Float32Array(H);
  for (let t = claim(C.combineClaim); t < T; t = claim(C.combineClaim)) {
    if (world.shared) {
      // The host plan's S: the rank's layer with every routed slot masked, 0 + y_shared, rounded once.
      for (let h = 0; h < H; h++)
        acc[h] = bf16BitsToF32(f32ToBf16Bits(Math.fround(0 + bf16BitsToF32(me.sharedY[t * H + h]!))));
    } else acc.fill(0);
    const order =
      options.mutation === "arrival-rank-combine"
        ? [
            ...launch.completed,
            ...Array.from({ length: R }, (_, d) => d).filter((d) => !launch.completed.includes(d)),
          ]
        : Array.from({ length: R }, (_, d) => d);
    for (const d of order) {
      let any = false;
      partial.fill(0);
      for (let j = 0; j < k; j++) {
        const e = me.ids[t * k + j]!;
        if (e < 0 || owner(e) !== d) continue;
        any = true;
        const w = me.weights[t * k + j]!;
        const y = me.combine.subarray((t * k + j) * H, (t * k + j + 1) * H);
        for (let h = 0; h < H; h++)
          partial[h] = Math.fround(partial[h]! + Math.fround(w * bf16BitsToF32(y[h]!)));
      }
      if (!any) continue;
      for (let h = 0; h < H; h++) acc[h] = Math.fround(acc[h]! + bf16BitsToF32(f32ToBf16Bits(partial[h]!)));
    }
    for (let h = 0; h < H; h++) me.out[t * H + h] = f32ToBf16Bits(acc[h]!);
    yield;
  }

  // Exit: the last CTA out keeps the results, then clears what this rank's next launch must find zero:
  // its counters, its block arrivals, the arrival counts from owners and this parity's counts (peers
  // write the other parity until this rank publishes its next epoch). Flags are epoch stamps: never cleared.
  if (me.counters[C.exit]++ !== launch.ctas - 1) return;
  launch.result.out = me.out.slice(0, T * H);
  launch.result.poolSource = me.poolSource.slice(0, 2 * groupStart[L + 1]!);
  me.counters.fill(0);
  me.blockArrived.fill(0);
  me.arrived.fill(0);
  me.counts.fill(0, parity * R * L, (parity + 1) * R * L);
  me.header[0] = (epoch + 1) >>> 0;
}

/** One forward's inputs for `ranks` ranks, made from a seed base. */
export type EpCase = (ranks: number, base: number) => RankInput[];

/**
 * The routing edge cases of the expert-parallel tests (the CPU model's and the GPU kernel's), for a
 * config of 16 experts: uneven tokens and a rank without tokens, tokens routed only to remote experts,
 * a rank that receives nothing, masked slots and tokens, weights whose combine order shows, and a hot
 * expert with T = 1 on every other rank and `longest` tokens on the rest.
 */
export function epRoutingCases(config: MoEConfig, longest: number): Record<string, EpCase> {
  const { hidden: H, numExperts: E } = config;
  const input = (
    base: number,
    tokens: number,
    routing: { ids: Int32Array; weights: Float32Array },
  ): RankInput => ({
    x: generateActivations(base, tokens, H),
    tokens,
    ...routing,
  });
  const block = (ranks: number, d: number) =>
    Array.from({ length: E / ranks }, (_, i) => d * (E / ranks) + i);
  return {
    "random routing, uneven tokens per rank, a rank without tokens": (ranks, base) =>
      Array.from({ length: ranks }, (_, s) => {
        const t = ranks > 1 && s === ranks - 1 ? 0 : [5, 1, 9, 3, 7, 2, 11, 4][s]!;
        return input(
          base + s,
          t,
          randomRouting(base + 50 + s, t, config, { maskedTokens: t > 2 ? [1] : [] }),
        );
      }),
    "tokens routed only to remote experts": (ranks, base) =>
      Array.from({ length: ranks }, (_, s) => {
        const empty = ranks > 1 ? block(ranks, s) : [];
        return input(base + s, 4, randomRouting(base + 50 + s, 4, config, { emptyExperts: empty }));
      }),
    "empty experts: a rank that receives nothing": (ranks, base) =>
      Array.from({ length: ranks }, (_, s) => {
        const empty = ranks > 1 ? block(ranks, ranks - 1) : [3, 7, 11];
        return input(base + s, 3, randomRouting(base + 50 + s, 3, config, { emptyExperts: empty }));
      }),
    "masked slots and masked tokens": (ranks, base) =>
      Array.from({ length: ranks }, (_, s) => {
        const r = randomRouting(base + 50 + s, 6, config, { maskedTokens: [4] });
        const random = rngU32(base + 90 + s);
        for (let i = 0; i < r.ids.length; i++) if (random() % 3 === 0) r.ids[i] = -1;
        return input(base + s, 6, r);
      }),
    // The combine's order shows only where fp32 sums round and the rounding survives the final bf16:
    // partials of ±2^20 cancel where their bf16 values meet, and which ±1 partials survive then depends
    // on the order they were added in.
    "weights ±1 and ±2^20": (ranks, base) =>
      Array.from({ length: ranks }, (_, s) => {
        const r = randomRouting(base + 50 + s, 8, config);
        const random = rngU32(base + 90 + s);
        for (let i = 0; i < r.weights.length; i++) {
          r.weights[i] = (random() % 2 === 0 ? 1 : -1) * (random() % 2 === 0 ? 2 ** 20 : 1);
        }
        return input(base + s, 8, r);
      }),
    [`a hot expert, T = 1 and ${longest}`]: (ranks, base) =>
      Array.from({ length: ranks }, (_, s) => {
        const t = s % 2 === 0 ? 1 : longest;
        return input(base + s, t, randomRouting(base + 50 + s, t, config, { hotExpert: 6 }));
      }),
  };
}
