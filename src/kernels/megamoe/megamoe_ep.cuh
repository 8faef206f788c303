// Expert parallelism inside the fused kernel (EP_RANKS > 1): docs/design.md "The in-kernel protocol".
// One launch is one rank r of R. Every rank has a symmetric buffer (src/parallel/symmetric.ts) laid out
// by src/parallel/fused-ep.ts (fusedEpLayout, EpRegion below), and the launch gets every rank's buffer
// address (the address table, in EpOperands by value: R <= 8 pointers need no global load).
//
// Phases of rank r in forward epoch n (parity p = n & 1), around the one-rank kernel's tiles:
//   count     chunks of r's tokens: slots per global expert, rows per destination rank; each nonzero
//             count added to its owner's counts[p][r][local e] (red.relaxed.sys)
//   describe  per chunk, after every count chunk: a descriptor per (token, destination rank) with each
//             slot's index among r's slots on that expert, written to the owner's inbox[p][r][row]
//   publish   one CTA: expect[d] = r's slots on d, d.inboxRows[p][r], then flag[r] = n everywhere
//             (fence.acq_rel.sys; st.release.sys)
//   offsets   every CTA waits for every rank's flag of epoch n (ld.acquire.sys; bounded, with blame);
//             pool groups from the counts: expert e's rows by source rank, then the shared expert's
//   place     a warp per inbox row pulls the token's FP8 row and scales from the source's buffer with
//             16-byte loads through the table and stores them at start_e + base[src][e] + index
//   tiles     as one rank (the L2 epilogue writes the local y pool)
//   push      once every local L2 tile is done: each routed pool row's y goes to the token owner's
//             combine[t·k + j]; then arrived[r] += 1 there (fence.acq_rel.sys; red.release.sys)
//   combine   waits arrived[d] >= expect[d] for every d; per token S, then per rank in rank order the
//             bf16 partial of its slots in slot order (combineRankOutputs' numerics)
//   exit      the last CTA also clears ep counters, arrived[.], counts[p] and adds 1 to the epoch
//
// Peer rows are read with generic 16-byte loads, not cp.async.bulk: each row goes through registers to
// up to k pool rows (and its scales transposed), so a shared-memory bounce would add a copy, an mbarrier
// and a proxy fence without saving a load. The results are pushed after the local L2 tiles rather than
// from the L2 epilogue, so the epilogue (shared with the one-rank build) stays as it is; the numerics
// do not depend on when a result lands.

#pragma once

#include "megamoe_combine.cuh"
#include "megamoe_dispatch.cuh"

#ifndef EP_RANKS
#define EP_RANKS 1
#endif

namespace {

constexpr int kEpRanks = EP_RANKS;
static_assert(kEpRanks >= 1 && kEpRanks <= 8, "EP_RANKS must be in 1..8");

#if EP_RANKS > 1

constexpr int kGlobalExperts = kExperts * kEpRanks;  // NUM_EXPERTS is the rank's local count L
constexpr int kLocalTopK = kTopK < kExperts ? kTopK : kExperts;
constexpr int kDescriptorWords = 1 + 2 * kLocalTopK;
constexpr int kEpChunkTokens = kCountChunkSlots / kTopK > 0 ? kCountChunkSlots / kTopK : 1;

// Regions of a rank's symmetric buffer (fused-ep.ts EP_REGIONS, same order): byte offsets in EpOperands.
enum EpRegion : int {
  kRegHeader = 0,  // u32 epoch, tokens
  kRegXq,          // e4m3 [T_max, H]: the rank's rows, pulled by owners
  kRegXs,          // fp32 [T_max, H/128]
  kRegFlag,        // u32 [R]: epoch stamps of the sources' publications
  kRegCounts,      // u32 [2][R][L]
  kRegInboxRows,   // u32 [2][R]
  kRegInbox,       // i32 [2][R][T_max][W]
  kRegArrived,     // u32 [R]: results received from each owner
  kRegWaitingOn,   // u32 [R]: rank masks (watchdog)
  kRegGaveUp,      // u32 [R]
  kRegCombine,     // bf16 [T_max·k][H]: results by slot
  kEpRegions,
};

// The rank's own counters (int32, zero between launches): fused-ep.ts EP_COUNTER_WORDS.
enum EpCounter : int {
  kEpCountClaim = 0,
  kEpCountDone,
  kEpDescribeClaim,
  kEpDescribeDone,
  kEpPublishClaim,
  kEpPlaceClaim,
  kEpPushClaim,
  kEpCounterWords = 8,
};

// Watchdog codes of the EP waits (host_status[0]); the one-rank codes stay in op.status.
constexpr int kStatusPeerPublishWait = 16;  // offsets: flags of this epoch missing
constexpr int kStatusPeerResultWait = 17;   // combine: results missing

struct EpOperands {
  unsigned char* peer[kEpRanks];           // every rank's symmetric buffer, by rank (this one's included)
  unsigned long long region[kEpRegions];   // byte offsets of the regions (the same in every buffer)
  int* counters;                           // int[kEpCounterWords]
  int* chunk_count;                        // int[chunks][E]: slots per global expert per count chunk
  int* chunk_rows;                         // int[chunks][R]: tokens per destination rank per chunk
  int* expect;                             // int[R]: this rank's slots on each rank
  int* pool_source;                        // int[pool][2]: (source rank, t·k + j), or (−1, t) shared
  int* host_status;                        // mapped pinned host memory: readable after a trap
  int rank;
  int max_tokens;
};
static_assert(sizeof(EpOperands) == 8 * (kEpRanks + kEpRegions + 6) + 8, "fused-ep.ts: EP_OPERANDS_BYTES");

// Scratch of the dispatch phases in the epilogue staging area (free until this CTA's first tile).
constexpr unsigned kEpScratchInts = kGlobalExperts + 2 * kEpRanks + 2 + kEpRanks * kExperts;
static_assert(kEpScratchInts * 4 <= kMathWarps * kStagingWarpBytes, "EP scratch above the staging area");

template <typename T>
__device__ __forceinline__ T* ep_at(const EpOperands& ep, int rank, EpRegion region, long long byte) {
  return reinterpret_cast<T*>(ep.peer[rank] + ep.region[region] + byte);
}

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_relaxed_sys(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys(unsigned* p, unsigned v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_relaxed_sys(unsigned* p, unsigned v) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_release_sys(unsigned* p, unsigned v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Gives up a wait on peers: the ranks to blame are those reached from the missing ones through the
// waitingOn words that wait on nobody (dead, or stuck outside the protocol); none reached: the missing
// ranks. Records it in the pinned host status (the host reads it after the trap), marks this rank as
// given up in every buffer, and traps. Not inlined: the cold path costs the callers no registers.
__device__ __noinline__ void ep_give_up(const EpOperands& ep, int code, unsigned missing, unsigned epoch) {
  unsigned seen = 1u << ep.rank;
  unsigned todo = missing;
  unsigned culprits = 0;
  while (todo != 0) {
    const int q = __ffs(todo) - 1;
    todo &= todo - 1;
    if (seen & (1u << q)) continue;
    seen |= 1u << q;
    const unsigned waits = ld_relaxed_sys(ep_at<unsigned>(ep, ep.rank, kRegWaitingOn, 4 * q));
    if (waits == 0) culprits |= 1u << q;
    todo |= waits & ~seen;
  }
  if (culprits == 0) culprits = missing;
  volatile int* hs = ep.host_status;
  if (atomicCAS(ep.host_status, 0, code) == 0) {
    hs[1] = static_cast<int>(blockIdx.x);
    hs[2] = static_cast<int>(culprits);
    hs[3] = static_cast<int>(missing);
    hs[4] = static_cast<int>(epoch);
    unsigned gave = 0;
    for (int x = 0; x < kEpRanks; ++x) gave |= ld_relaxed_sys(ep_at<unsigned>(ep, ep.rank, kRegGaveUp, 4 * x)) != 0 ? 1u << x : 0u;
    hs[5] = static_cast<int>(gave & missing);
  }
  for (int x = 0; x < kEpRanks; ++x) st_relaxed_sys(ep_at<unsigned>(ep, x, kRegGaveUp, 4 * ep.rank), 1u);
  __threadfence_system();
  __trap();
}

// The ranks a wait still misses: kind 0, flags below `epoch` (wrap-safe); kind 1, arrivals below expect.
__device__ __forceinline__ unsigned ep_missing(const EpOperands& ep, int kind, unsigned epoch) {
  unsigned missing = 0;
#pragma unroll
  for (int x = 0; x < kEpRanks; ++x) {
    bool ok;
    if (kind == 0) {
      ok = static_cast<int>(ld_acquire_sys(ep_at<unsigned>(ep, ep.rank, kRegFlag, 4 * x)) - epoch) >= 0;
    } else {
      ok = ld_acquire_sys(ep_at<unsigned>(ep, ep.rank, kRegArrived, 4 * x)) >=
           static_cast<unsigned>(load_cg(ep.expect + x));
    }
    if (!ok) missing |= 1u << x;
  }
  return missing;
}

// A bounded wait on peers, by one thread. Past half the deadline it posts whom it waits on into every
// buffer (so that others blame the right rank); it gives up at the deadline or as soon as a rank it
// waits on has given up itself.
__device__ __noinline__ void ep_wait_peers(const EpOperands& ep, int kind, unsigned epoch) {
  unsigned missing = ep_missing(ep, kind, epoch);
  if (missing == 0) return;
  const unsigned long long start = global_timer_ns();
  bool posted = false;
  while ((missing = ep_missing(ep, kind, epoch)) != 0) {
    const unsigned long long waited = global_timer_ns() - start;
    bool peer_gave_up = false;
    for (int x = 0; x < kEpRanks; ++x) {
      if ((missing >> x) & 1u) peer_gave_up |= ld_relaxed_sys(ep_at<unsigned>(ep, ep.rank, kRegGaveUp, 4 * x)) != 0;
    }
    if (waited > kWatchdogNs || peer_gave_up) {
      ep_give_up(ep, kind == 0 ? kStatusPeerPublishWait : kStatusPeerResultWait, missing, epoch);
    }
    if (!posted && waited > kWatchdogNs / 2) {
      for (int x = 0; x < kEpRanks; ++x) st_relaxed_sys(ep_at<unsigned>(ep, x, kRegWaitingOn, 4 * ep.rank), missing);
      posted = true;
    }
    __nanosleep(256);
  }
  if (posted) {
    for (int x = 0; x < kEpRanks; ++x) st_relaxed_sys(ep_at<unsigned>(ep, x, kRegWaitingOn, 4 * ep.rank), 0u);
  }
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// Count, describe and publish (the source's side), then the offsets wait. Returns the epoch.
__device__ __forceinline__ unsigned ep_publish(const Operands& op, const EpOperands& ep, const SharedState& cta) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  int* const scratch = reinterpret_cast<int*>(cta.smem + kOffStaging);
  int* const hist = scratch;                     // [kGlobalExperts]
  int* const rows = scratch + kGlobalExperts;    // [R]
  int* const seen = rows + kEpRanks;             // [R] (publish: rows per destination)
  const unsigned epoch = ld_relaxed_sys(ep_at<unsigned>(ep, ep.rank, kRegHeader, 0));
  const int parity = static_cast<int>(epoch & 1u);
  const int T = op.tokens;
  const int chunks = (T + kEpChunkTokens - 1) / kEpChunkTokens;
  // ---- count
  for (;;) {
    const int chunk = cta_claim(ep.counters + kEpCountClaim, cta.broadcast);
    if (chunk >= chunks) break;
    for (int i = tid; i < kGlobalExperts + kEpRanks; i += kThreads) scratch[i] = 0;
    __syncthreads();
    const int t_end = min(T, (chunk + 1) * kEpChunkTokens);
    for (int t = chunk * kEpChunkTokens + tid; t < t_end; t += kThreads) {
      unsigned mask = 0;
      for (int j = 0; j < kTopK; ++j) {
        const int e = op.ids[t * kTopK + j];
        if (e < 0 || e >= kGlobalExperts) continue;
        atomicAdd(hist + e, 1);
        mask |= 1u << (e / kExperts);
      }
      for (; mask != 0; mask &= mask - 1) atomicAdd(rows + __ffs(mask) - 1, 1);
    }
    __syncthreads();
    for (int e = tid; e < kGlobalExperts; e += kThreads) {
      const int c = hist[e];
      ep.chunk_count[chunk * kGlobalExperts + e] = c;
      if (c != 0) {
        const int d = e / kExperts;
        red_relaxed_sys(ep_at<unsigned>(ep, d, kRegCounts, 4ll * ((parity * kEpRanks + ep.rank) * kExperts + e % kExperts)),
                        static_cast<unsigned>(c));
      }
    }
    for (int d = tid; d < kEpRanks; d += kThreads) ep.chunk_rows[chunk * kEpRanks + d] = rows[d];
    __syncthreads();
    if (tid == 0) add_release(ep.counters + kEpCountDone, 1);
  }
  // ---- describe
  if (tid == 0) wait_at_least(ep.counters + kEpCountDone, chunks, op.status, kStatusCountWait, chunks);
  __syncthreads();
  for (;;) {
    const int chunk = cta_claim(ep.counters + kEpDescribeClaim, cta.broadcast);
    if (chunk >= chunks) break;
    // Running indices: the earlier chunks' counts (every count chunk is done, acquired above).
    for (int e = tid; e < kGlobalExperts + kEpRanks; e += kThreads) {
      const bool expert = e < kGlobalExperts;
      int sum = 0;
      for (int c = 0; c < chunk; ++c) {
        sum += load_cg(expert ? ep.chunk_count + c * kGlobalExperts + e : ep.chunk_rows + c * kEpRanks + e - kGlobalExperts);
      }
      scratch[e] = sum;
    }
    __syncthreads();
    if (tid < 32) {
      // One warp, a token at a time, lane j its slot j: the (token, slot) order of the indices.
      const int t_end = min(T, (chunk + 1) * kEpChunkTokens);
      for (int t = chunk * kEpChunkTokens; t < t_end; ++t) {
        int e = lane < kTopK ? op.ids[t * kTopK + lane] : -1;
        const bool valid = e >= 0 && e < kGlobalExperts;
        const int d = valid ? e / kExperts : -1;
        const unsigned same_e = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
        const unsigned same_d = __match_any_sync(0xffffffffu, valid ? d : -1 - lane);
        const int index = valid ? hist[e] + __popc(same_e & lanemask_lt()) : 0;
        const int row = valid ? rows[d] : 0;
        const int u = __popc(same_d & lanemask_lt());
        const int on_d = __popc(same_d);
        __syncwarp();
        if (valid && (same_e & lanemask_lt()) == 0) hist[e] += __popc(same_e);
        if (valid && u == 0) rows[d] += 1;
        __syncwarp();
        if (valid && u < kLocalTopK) {
          int* desc = ep_at<int>(ep, d, kRegInbox,
                                 4ll * ((static_cast<long long>(parity * kEpRanks + ep.rank) * ep.max_tokens + row) *
                                        kDescriptorWords));
          desc[1 + 2 * u] = lane | ((e % kExperts) << 8);
          desc[2 + 2 * u] = index;
          if (u == 0) {
            desc[0] = t;
            for (int q = on_d; q < kLocalTopK; ++q) desc[1 + 2 * q] = -1;
          }
        }
      }
    }
    __syncthreads();
    if (tid == 0) add_release(ep.counters + kEpDescribeDone, 1);
  }
  // ---- publish (the CTA that claims it)
  if (cta_claim(ep.counters + kEpPublishClaim, cta.broadcast) == 0) {
    if (tid == 0) wait_at_least(ep.counters + kEpDescribeDone, chunks, op.status, kStatusCountWait, chunks);
    for (int i = tid; i < 2 * kEpRanks; i += kThreads) rows[i] = 0;  // rows[] then seen[]: slots, rows
    __syncthreads();
    for (int e = tid; e < kGlobalExperts + kEpRanks; e += kThreads) {
      const bool expert = e < kGlobalExperts;
      int sum = 0;
      for (int c = 0; c < chunks; ++c) {
        sum += load_cg(expert ? ep.chunk_count + c * kGlobalExperts + e : ep.chunk_rows + c * kEpRanks + e - kGlobalExperts);
      }
      if (expert) atomicAdd(rows + e / kExperts, sum);
      else seen[e - kGlobalExperts] = sum;
    }
    __syncthreads();
    if (tid == 0) {
      for (int d = 0; d < kEpRanks; ++d) {
        ep.expect[d] = rows[d];
        st_relaxed_sys(ep_at<unsigned>(ep, d, kRegInboxRows, 4 * (parity * kEpRanks + ep.rank)), static_cast<unsigned>(seen[d]));
      }
      fence_acq_rel_sys();
      for (int d = 0; d < kEpRanks; ++d) st_release_sys(ep_at<unsigned>(ep, d, kRegFlag, 4 * ep.rank), epoch);
    }
  }
  // ---- offsets: every rank's publication of this epoch
  if (tid == 0) {
    ep_wait_peers(ep, 0, epoch);
    trace_time(op.trace, kTraceCountsReady);
  }
  __syncthreads();
  return epoch;
}

// build_groups (megamoe_dispatch.cuh) with each group's count from count_of(g). A copy rather than a
// template under build_groups: routing the one-rank build through a functor renumbered its registers.
template <typename CountOf>
__device__ __forceinline__ void ep_build_groups(CountOf count_of, int shared_rows, int* offsets, int* blocks) {
  constexpr int kPerLane = (kGroups + 31) / 32;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int first = lane * kPerLane;
  const int last = first + kPerLane < kGroups ? first + kPerLane : kGroups;
  int rows = 0;
  int nblocks = 0;
  for (int g = first; g < last; ++g) {
    const int c = g == kExperts ? shared_rows : count_of(g);
    offsets[g] = c;
    rows += c;
    nblocks += (c + kBlockM - 1) / kBlockM;
  }
  int rows_incl = rows;
  int blocks_incl = nblocks;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, rows_incl, d);
    const int b = __shfl_up_sync(0xffffffffu, blocks_incl, d);
    if (lane >= d) {
      rows_incl += r;
      blocks_incl += b;
    }
  }
  int row = rows_incl - rows;
  int block = blocks_incl - nblocks;
  for (int g = first; g < last; ++g) {
    const int c = offsets[g];
    offsets[g] = row;
    blocks[g] = block;
    row += c;
    block += (c + kBlockM - 1) / kBlockM;
  }
  if (lane == 31) {
    offsets[kGroups] = rows_incl;
    blocks[kGroups] = blocks_incl;
  }
}

// Slots of source x on local expert g in this epoch, from this rank's buffer (after the flag acquire).
__device__ __forceinline__ int ep_count(const EpOperands& ep, int parity, int x, int g) {
  return static_cast<int>(ld_relaxed_sys(ep_at<unsigned>(ep, ep.rank, kRegCounts, 4ll * ((parity * kEpRanks + x) * kExperts + g))));
}

// The pool groups, and in the scratch: base[x][e] (source x's first row within expert e's rows) and the
// inbox rows' prefix over sources.
__device__ __forceinline__ void ep_offsets(const EpOperands& ep, const SharedState& cta, unsigned epoch, int shared_rows) {
  const int tid = static_cast<int>(threadIdx.x);
  const int parity = static_cast<int>(epoch & 1u);
  int* const scratch = reinterpret_cast<int*>(cta.smem + kOffStaging);
  int* const inbox_start = scratch;          // [R + 1]
  int* const base = scratch + kEpRanks + 1;  // [R][L]
  if ((tid >> 5) == 0) {
    ep_build_groups(
        [&](int g) {
          int c = 0;
          for (int x = 0; x < kEpRanks; ++x) c += ep_count(ep, parity, x, g);
          return c;
        },
        shared_rows, cta.offsets, cta.blocks);
  }
  for (int e = tid; e < kExperts; e += kThreads) {
    int row = 0;
    for (int x = 0; x < kEpRanks; ++x) {
      base[x * kExperts + e] = row;
      row += ep_count(ep, parity, x, e);
    }
  }
  if (tid == kThreads - 1) {
    int row = 0;
    for (int x = 0; x < kEpRanks; ++x) {
      inbox_start[x] = row;
      row += static_cast<int>(ld_relaxed_sys(ep_at<unsigned>(ep, ep.rank, kRegInboxRows, 4 * (parity * kEpRanks + x))));
    }
    inbox_start[kEpRanks] = row;
  }
  __syncthreads();
}

// Part `part` of a token's FP8 row (and with the first, its scales) from a rank's buffer (this one's or
// a peer's) into a warp's registers, as load_token_row.
__device__ __forceinline__ void ep_load_row(const EpOperands& ep, int src, int t, int lane, int part, RowPieces& r) {
  load_row_part<true>(ep_at<unsigned char>(ep, src, kRegXq, static_cast<long long>(t) * kHidden),
                      ep_at<float>(ep, src, kRegXs, 4ll * t * kHiddenBlocks), lane, part, r);
}

// Place: a warp per claimed item, the inbox rows in (source, row) order, then this rank's tokens for
// the shared expert; each pool row's block counts its arrival as in the one-rank build.
__device__ __forceinline__ void ep_place(const Operands& op, const EpOperands& ep, const Workspace& work,
                                         const SharedState& cta, unsigned epoch, int shared_rows) {
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int parity = static_cast<int>(epoch & 1u);
  const int* const scratch = reinterpret_cast<const int*>(cta.smem + kOffStaging);
  const int* const inbox_start = scratch;
  const int* const base = scratch + kEpRanks + 1;
  const int routed = inbox_start[kEpRanks];
  for (;;) {
    int item = 0;
    if (lane == 0) item = atomicAdd(ep.counters + kEpPlaceClaim, 1);
    item = __shfl_sync(0xffffffffu, item, 0);
    if (item >= routed + shared_rows) break;
    int src;
    int t;
    int row = -1;  // lane u < kLocalTopK: slot u's pool row; lane 31: the shared row
    int tag = -1;
    if (item < routed) {
      src = 0;
      while (inbox_start[src + 1] <= item) ++src;
      const int* desc = ep_at<int>(ep, ep.rank, kRegInbox,
                                   4ll * ((static_cast<long long>(parity * kEpRanks + src) * ep.max_tokens + item -
                                           inbox_start[src]) *
                                          kDescriptorWords));
      t = __ldcg(desc);
      if (lane < kLocalTopK) {
        tag = __ldcg(desc + 1 + 2 * lane);
        if (tag >= 0) {
          const int e = tag >> 8;
          row = cta.offsets[e] + base[src * kExperts + e] + __ldcg(desc + 2 + 2 * lane);
          ep.pool_source[2 * row] = src;
          ep.pool_source[2 * row + 1] = t * kTopK + (tag & 0xff);
        }
      }
    } else {
      src = ep.rank;
      t = item - routed;
      if (lane == 0) {
        row = cta.offsets[kExperts] + t;
        tag = kExperts << 8;
        ep.pool_source[2 * row] = -1;
        ep.pool_source[2 * row + 1] = t;
      }
    }
#pragma unroll
    for (int part = 0; part < kPlaceRowParts; ++part) {
      RowPieces pieces;
      ep_load_row(ep, src, t, lane, part, pieces);
      for (unsigned left = __ballot_sync(0xffffffffu, row >= 0); left != 0; left &= left - 1) {
        store_pool_row(op, __shfl_sync(0xffffffffu, row, __ffs(left) - 1), lane, part, pieces);
      }
    }
    fence_proxy_async_global();  // the rows are read by TMA (async proxy) in another CTA
    __syncwarp();
    if (row >= 0) {
      const int g = tag >> 8;
      add_release(work.arrived + cta.blocks[g] + (row - cta.offsets[g]) / kBlockM, 1);
    }
  }
  __syncthreads();
}

// Push (math warps, after the math loop): every routed pool row's L2 result to its token owner's
// combine area, and one arrival there per row.
__device__ __forceinline__ void ep_push(const Operands& op, const EpOperands& ep, const SharedState& cta,
                                        int total_l2) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  if (tid == 0) wait_at_least(op.workspace + kL2Done, total_l2 * kPublishesPerTile, op.status, kStatusCombineWait, 1);
  named_barrier_sync(1, kMathThreads);
  const int routed_rows = cta.offsets[kExperts];
  for (;;) {
    int row = 0;
    if (lane == 0) row = atomicAdd(ep.counters + kEpPushClaim, 1);
    row = __shfl_sync(0xffffffffu, row, 0);
    if (row >= routed_rows) break;
    const int src = load_cg(ep.pool_source + 2 * row);
    const int slot = load_cg(ep.pool_source + 2 * row + 1);
    const unsigned short* y = op.y + static_cast<long long>(row) * kHidden;
    unsigned short* dst = ep_at<unsigned short>(ep, src, kRegCombine, 2ll * slot * kHidden);
    for (int v = lane; v < kHidden / 8; v += 32) megamoe::st_v4(dst + 8 * v, megamoe::ld_cg_v4(y + 8 * v));
    __syncwarp();
    if (lane == 0) {
      fence_acq_rel_sys();
      red_release_sys(ep_at<unsigned>(ep, src, kRegArrived, 4 * ep.rank), 1u);
    }
  }
}

// f32 -> bf16 -> f32 (round to nearest even), the rank partial's rounding.
__device__ __forceinline__ float ep_round_bf16(float x) { return megamoe::bf16x2_low_to_float(megamoe::bf16x2_from_floats(x, 0.0f)); }

// Channels [chunk_begin, chunk_end) × 256 of token t: 0 + S, then per rank in rank order the bf16 of its
// slots' sum in slot order (from 0), one final bf16 rounding.
__device__ __forceinline__ void ep_combine_token(const Operands& op, const EpOperands& ep, int shared_row0, int t,
                                                 int chunk_begin, int chunk_end, int lane) {
  int lane_e = -1;
  float lane_w = 0.f;
  if (lane < kTopK) {
    lane_e = op.ids[t * kTopK + lane];
    lane_w = op.weights[t * kTopK + lane];
  }
  const unsigned short* combine = ep_at<unsigned short>(ep, ep.rank, kRegCombine, 2ll * t * kTopK * kHidden);
#pragma unroll 1
  for (int chunk = chunk_begin; chunk < chunk_end; ++chunk) {
    const int c = (chunk * 32 + lane) * 8;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (shared_row0 >= 0) megamoe::add_bf16x8(acc, megamoe::ld_cg_v4(op.y + static_cast<long long>(shared_row0 + t) * kHidden + c));
#pragma unroll 1
    for (int d = 0; d < kEpRanks; ++d) {
      float partial[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      bool any = false;
#pragma unroll 1
      for (int j = 0; j < kTopK; ++j) {
        const int e = __shfl_sync(0xffffffffu, lane_e, j);
        const float w = __shfl_sync(0xffffffffu, lane_w, j);
        if (e < 0 || e >= kGlobalExperts || e / kExperts != d) continue;
        any = true;
        megamoe::add_weighted_bf16x8(partial, megamoe::ld_cg_v4(combine + static_cast<long long>(j) * kHidden + c), w);
      }
      if (!any) continue;
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = megamoe::add_rn(acc[q], ep_round_bf16(partial[q]));
    }
    megamoe::st_v4(op.out + static_cast<long long>(t) * kHidden + c, megamoe::pack_bf16x8(acc));
  }
}

// Combine: every owner's results for this rank's tokens, then the tokens dealt to the math warps.
__device__ __forceinline__ void ep_combine(const Operands& op, const EpOperands& ep, const SharedState& cta,
                                           unsigned epoch, int shared_rows) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (tid == 0) {
    ep_wait_peers(ep, 1, epoch);
    trace_time(op.trace, kTraceCombineStart);
  }
  named_barrier_sync(1, kMathThreads);
  const int shared_row0 = shared_rows > 0 ? cta.offsets[kExperts] : -1;
  const int grid_warps = static_cast<int>(gridDim.x) * kMathWarps;
  const int segments = op.tokens > 0 ? max(1, min(kCombineChunks, grid_warps / op.tokens)) : 1;
  for (int unit = static_cast<int>(blockIdx.x) * kMathWarps + warp; unit < op.tokens * segments; unit += grid_warps) {
    const int segment = unit % segments;
    ep_combine_token(op, ep, shared_row0, unit / segments, segment * kCombineChunks / segments,
                     (segment + 1) * kCombineChunks / segments, lane);
  }
}

// The last CTA out (zero_workspace_if_last decided it, cta.broadcast[2]) also clears what peers and this
// rank's next launch must find zero, and moves the epoch on (in memory: a graph replay needs no argument).
__device__ __forceinline__ void ep_reset_if_last(const EpOperands& ep, const SharedState& cta, unsigned epoch) {
  const int tid = static_cast<int>(threadIdx.x);
  if (cta.broadcast[2] != 1) return;
  const int parity = static_cast<int>(epoch & 1u);
  for (int i = tid; i < kEpCounterWords; i += kMathThreads) ep.counters[i] = 0;
  for (int i = tid; i < kEpRanks; i += kMathThreads) *ep_at<unsigned>(ep, ep.rank, kRegArrived, 4 * i) = 0;
  for (int i = tid; i < kEpRanks * kExperts; i += kMathThreads) {
    *ep_at<unsigned>(ep, ep.rank, kRegCounts, 4ll * (parity * kEpRanks * kExperts + i)) = 0;
  }
  named_barrier_sync(1, kMathThreads);
  if (tid == 0) {
    __threadfence();
    st_relaxed_sys(ep_at<unsigned>(ep, ep.rank, kRegHeader, 0), epoch + 1u);
  }
}

#endif  // EP_RANKS > 1

}  // namespace
