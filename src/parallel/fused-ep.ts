/**
 * Expert parallelism inside the fused kernel (megamoe_ep.cuh, docs/design.md "The in-kernel protocol"):
 * the byte layout of each rank's symmetric buffer and the per-rank EP operands the kernel's EP build
 * takes beside the one-rank operands. The launcher that owns the kernels, the heap and the streams is
 * not built yet (see the design's status line); these are what it and the kernel must agree on.
 */
import { QUANT_BLOCK } from "../config/config.js";
import { FUSED_EP_MAX_RANKS } from "../kernels/megamoe/megamoe.variants.js";

/** Slots of one count / describe chunk (megamoe_dispatch.cuh kCountChunkSlots). */
export const FUSED_EP_CHUNK_SLOTS = 4096;
/** Int32 words of the rank's EP counters (megamoe_ep.cuh kEpCounterWords). */
export const FUSED_EP_COUNTER_WORDS = 8;

/** Regions of a rank's symmetric buffer, in the kernel's EpRegion order. */
export const FUSED_EP_REGIONS = [
  "header",
  "xq",
  "xs",
  "flag",
  "counts",
  "inboxRows",
  "inbox",
  "arrived",
  "waitingOn",
  "gaveUp",
  "combine",
] as const;
export type FusedEpRegion = (typeof FUSED_EP_REGIONS)[number];

export interface FusedEpShape {
  ranks: number;
  /** All ranks' routed experts (E); a rank holds E / R. */
  numExperts: number;
  topK: number;
  hidden: number;
  /** Tokens a rank may bring to one forward. */
  maxTokens: number;
}

export interface FusedEpLayout {
  shape: FusedEpShape;
  localExperts: number;
  /** min(k, E / R): slots a token can have on one rank. */
  localTopK: number;
  /** Int32 words of a row descriptor: 1 + 2 · localTopK. */
  descriptorWords: number;
  /** Tokens of a count chunk: FUSED_EP_CHUNK_SLOTS / k. */
  chunkTokens: number;
  maxChunks: number;
  /** Pool rows the rank's kernel needs: every rank's tokens with localTopK slots here, then T shared. */
  poolRows: number;
  /** Byte offset and length of each region of the symmetric buffer (16-byte aligned). */
  regions: Record<FusedEpRegion, { offset: number; bytes: number }>;
  /** Bytes of one rank's symmetric buffer. */
  bytes: number;
  /** Int32 words of the rank's own (not symmetric) EP workspace arrays. */
  workspace: { chunkCount: number; chunkRows: number; expect: number; poolSource: number };
}

const count = (what: string, v: number, min: number, max = Number.MAX_SAFE_INTEGER) => {
  if (!Number.isInteger(v) || v < min || v > max) {
    throw new RangeError(`fusedEpLayout: ${what} must be an integer in [${min}, ${max}], got ${v}`);
  }
};

/** The symmetric buffer's regions (megamoe_ep.cuh EpRegion) and the rank's own EP arrays. */
export function fusedEpLayout(shape: FusedEpShape): FusedEpLayout {
  const { ranks: R, numExperts: E, topK: k, hidden: H, maxTokens: T } = shape;
  count("ranks", R, 2, FUSED_EP_MAX_RANKS);
  count("numExperts", E, R);
  count("topK", k, 1, 32);
  count("hidden", H, QUANT_BLOCK);
  count("maxTokens", T, 1);
  if (E % R !== 0) throw new RangeError(`fusedEpLayout: ${E} experts cannot be split among ${R} ranks`);
  if (H % 256 !== 0) throw new RangeError(`fusedEpLayout: hidden ${H} is not a multiple of 256`);
  const L = E / R;
  const kd = Math.min(k, L);
  const W = 1 + 2 * kd;
  const chunkTokens = Math.max(1, Math.floor(FUSED_EP_CHUNK_SLOTS / k));
  const maxChunks = Math.ceil(T / chunkTokens);
  const sizes: Record<FusedEpRegion, number> = {
    header: 16,
    xq: T * H,
    xs: 4 * T * (H / QUANT_BLOCK),
    flag: 4 * R,
    counts: 4 * 2 * R * L,
    inboxRows: 4 * 2 * R,
    inbox: 4 * 2 * R * T * W,
    arrived: 4 * R,
    waitingOn: 4 * R,
    gaveUp: 4 * R,
    combine: 2 * T * k * H,
  };
  let at = 0;
  const regions = {} as Record<FusedEpRegion, { offset: number; bytes: number }>;
  for (const name of FUSED_EP_REGIONS) {
    regions[name] = { offset: at, bytes: sizes[name] };
    at += Math.ceil(sizes[name] / 16) * 16;
  }
  const poolRows = R * T * kd + T;
  return {
    shape: { ...shape },
    localExperts: L,
    localTopK: kd,
    descriptorWords: W,
    chunkTokens,
    maxChunks,
    poolRows,
    regions,
    bytes: at,
    workspace: { chunkCount: maxChunks * E, chunkRows: maxChunks * R, expect: R, poolSource: 2 * poolRows },
  };
}

/** megamoe_ep.cuh EpOperands: R peer pointers, the region offsets, 6 pointers, rank and maxTokens. */
export function fusedEpOperandsBytes(ranks: number): number {
  return 8 * (ranks + FUSED_EP_REGIONS.length + 6) + 8;
}

/** Device (and mapped host) addresses of one rank's EP operands. */
export interface FusedEpPointers {
  /** Every rank's symmetric buffer, by rank (SymmetricHeap.addressTable()). */
  peers: readonly bigint[];
  counters: bigint;
  chunkCount: bigint;
  chunkRows: bigint;
  expect: bigint;
  poolSource: bigint;
  /** Pinned, device-mapped host words: the watchdog's record survives the trap that ends the context. */
  hostStatus: bigint;
}

/** The EP operand struct of rank `rank`, byte for byte the kernel's. */
export function encodeFusedEpOperands(layout: FusedEpLayout, rank: number, p: FusedEpPointers): Uint8Array {
  const R = layout.shape.ranks;
  if (p.peers.length !== R)
    throw new RangeError(`encodeFusedEpOperands: ${p.peers.length} peers for ${R} ranks`);
  if (!Number.isInteger(rank) || rank < 0 || rank >= R) {
    throw new RangeError(`encodeFusedEpOperands: rank must be in [0, ${R}), got ${rank}`);
  }
  const bytes = new Uint8Array(fusedEpOperandsBytes(R));
  const v = new DataView(bytes.buffer);
  let at = 0;
  const u64 = (x: bigint) => {
    v.setBigUint64(at, x, true);
    at += 8;
  };
  for (const peer of p.peers) u64(peer);
  for (const name of FUSED_EP_REGIONS) u64(BigInt(layout.regions[name].offset));
  for (const x of [p.counters, p.chunkCount, p.chunkRows, p.expect, p.poolSource, p.hostStatus]) u64(x);
  v.setInt32(at, rank, true);
  v.setInt32(at + 4, layout.shape.maxTokens, true);
  return bytes;
}

/** The watchdog's record of an EP wait that gave up (megamoe_ep.cuh ep_give_up), or null. */
export interface FusedEpGiveUp {
  what: "publication" | "results";
  cta: number;
  /** Ranks blamed: reached through the waitingOn words and waiting on nobody. */
  blamed: number[];
  /** Ranks the wait still missed. */
  missing: number[];
  epoch: number;
  /** Missing ranks that had given up themselves. */
  gaveUp: number[];
}

const maskRanks = (m: number) => Array.from({ length: 32 }, (_, i) => i).filter((i) => (m >>> i) & 1);

/** Decodes a rank's host status words (code, cta, blamed, missing, epoch, gave up). */
export function decodeFusedEpStatus(words: Int32Array): FusedEpGiveUp | null {
  const code = words[0]!;
  if (code === 0) return null;
  if (code !== 16 && code !== 17) throw new RangeError(`unknown EP watchdog code ${code}`);
  return {
    what: code === 16 ? "publication" : "results",
    cta: words[1]!,
    blamed: maskRanks(words[2]!),
    missing: maskRanks(words[3]!),
    epoch: words[4]! >>> 0,
    gaveUp: maskRanks(words[5]!),
  };
}

/** The error message of rank `rank`'s record, in the CPU model's words (test/helpers/ep-protocol.ts). */
export function describeFusedEpGiveUp(rank: number, g: FusedEpGiveUp): string {
  const list = (r: number[]) => `rank${r.length > 1 ? "s" : ""} ${r.join(", ")}`;
  const what =
    g.what === "publication"
      ? `the counts and row descriptors of epoch ${g.epoch}`
      : `its tokens' expert results of epoch ${g.epoch}`;
  const also = g.gaveUp.length > 0 ? ` (${list(g.gaveUp)} gave up waiting on it)` : "";
  return `rank ${rank}: gave up waiting for ${what} from ${list(g.missing)}: ${list(g.blamed)} dead or not in step${also}`;
}

/** Bytes that cross ranks in one forward of the in-kernel protocol (design.md "Bytes across ranks"). */
export interface FusedEpTraffic {
  /** FP8 rows and fp32 scales pulled by owners: Σ rows_xd · (H + 4H/128). */
  rows: number;
  /** bf16 results pushed to the token owners, one per remote slot: Σ slots_xd · 2H. */
  results: number;
  /** Row descriptors and the row counts: Σ rows_xd · 4W + 4R(R − 1). */
  descriptors: number;
}

/** The traffic of one forward, from each rank's global ids [T_s, k] (x ≠ d only: a rank's own are local). */
export function fusedEpTraffic(layout: FusedEpLayout, ids: readonly Int32Array[]): FusedEpTraffic {
  const { ranks: R, topK: k, hidden: H } = layout.shape;
  if (ids.length !== R) throw new RangeError(`fusedEpTraffic: ${ids.length} routings for ${R} ranks`);
  const L = layout.localExperts;
  let rows = 0;
  let slots = 0;
  ids.forEach((rank, x) => {
    for (let t = 0; t * k < rank.length; t++) {
      let on = 0; // destination ranks of token t, a bit each
      for (let j = 0; j < k; j++) {
        const e = rank[t * k + j]!;
        if (e < 0 || e >= layout.shape.numExperts || Math.floor(e / L) === x) continue;
        slots++;
        on |= 1 << Math.floor(e / L);
      }
      for (; on !== 0; on &= on - 1) rows++;
    }
  });
  return {
    rows: rows * (H + (4 * H) / QUANT_BLOCK),
    results: slots * 2 * H,
    descriptors: rows * 4 * layout.descriptorWords + 4 * R * (R - 1),
  };
}
