// The fused kernel's dispatch, phases 1 to 3: count the routed rows per expert, lay the groups out in
// the row pool (first row and block of each), and copy each routed (token, slot) row and its scales to
// a pool row of its expert.

#pragma once

#include "megamoe_layout.cuh"
#include "megamoe_sync.cuh"
#include "megamoe_trace.cuh"

namespace {

// Work chunks of the dispatch phases.
constexpr int kCountChunkSlots = 4096;
constexpr int kMaxPlaceChunkTokens = 64;  // about T / CTAs: every CTA takes a share, in few claims
constexpr int kRowVectorsPerLane = (kHidden / 16 + 31) / 32;  // 16-byte pieces of a row per lane
constexpr int kRowScalesPerLane = (kHiddenBlocks + 31) / 32;  // its scale blocks per lane
// What the launch's registers per thread hold: 168 with two math warpgroups; at 96 (four, and 20 warps
// placing rather than 12) one row.
constexpr int kPlaceRowsInFlight = kLaunchRegisters >= 168 ? (kRowVectorsPerLane <= 8 ? 3 : 2) : 1;

__device__ __forceinline__ int group_inter(int group) { return group == kExperts ? kSharedInter : kInter; }

// The group of a global block: the last g with blocks[g] <= block (blocks is non-decreasing).
__device__ __forceinline__ int group_of_block(const int* blocks, int block) {
  int lo = 0;
  int hi = kGroups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (blocks[mid] <= block) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Routed slots [begin, end) counted per expert into the CTA's histogram, zeroed first (the caller
// synchronizes before reading it).
__device__ __forceinline__ void count_slots(const Operands& op, int* hist, int begin, int end) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int g = tid; g < kGroups; g += kThreads) hist[g] = 0;
  __syncthreads();
  for (int i = begin + tid; i < end; i += kThreads) {
    const int e = op.ids[i];
    if (e >= 0 && e < kExperts) atomicAdd(hist + e, 1);
  }
}

// Row offsets and first blocks of every group from the counts, by one warp (a run of groups per lane,
// then a warp scan of the runs). counts[g] for g < kExperts from the CTA's histogram (kLocal, shared
// memory) or the workspace, the shared expert's T.
template <bool kLocal>
__device__ __forceinline__ void build_groups(const int* counts, int shared_rows, int* offsets, int* blocks) {
  constexpr int kPerLane = (kGroups + 31) / 32;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int first = lane * kPerLane;
  const int last = first + kPerLane < kGroups ? first + kPerLane : kGroups;
  int rows = 0;
  int nblocks = 0;
  for (int g = first; g < last; ++g) {
    const int c = g == kExperts ? shared_rows : kLocal ? counts[g] : load_cg(counts + g);
    offsets[g] = c;  // the count, for now
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

// A warp moves a row in kPlaceRowParts parts (two where a row's 14 pieces per lane would not fit the
// launch's 96 registers: pro with four math warpgroups).
constexpr int kPlaceRowParts = kLaunchRegisters >= 168 || kRowVectorsPerLane <= 8 ? 1 : 2;
constexpr int kPartVectors = (kRowVectorsPerLane + kPlaceRowParts - 1) / kPlaceRowParts;

// Part `part` of one FP8 row in a warp's registers: lane l holds 16-byte pieces l, l + 32, … of it; the
// first part also the scale blocks l, l + 32, …
struct RowPieces {
  u32x4 piece[kPartVectors];
  float scale[kRowScalesPerLane];
};

// Part `part` of the FP8 row at `q` (and with the first part, its scales at `s`) into a warp's registers.
// kPeer: a rank's buffer other CTAs and ranks write, read through L2 (ld.cg); else this launch's input
// rows, read-only (ld.nc).
template <bool kPeer>
__device__ __forceinline__ void load_row_part(const unsigned char* q, const float* s, int lane, int part, RowPieces& r) {
#pragma unroll
  for (int j = 0; j < kPartVectors; ++j) {
    const int v = lane + 32 * (part * kPartVectors + j);
    if (v < kHidden / 16) r.piece[j] = kPeer ? megamoe::ld_cg_v4(q + 16 * v) : megamoe::ld_nc_v4(q + 16 * v);
  }
  if (part != 0) return;
#pragma unroll
  for (int j = 0; j < kRowScalesPerLane; ++j) {
    const int b = lane + 32 * j;
    if (b < kHiddenBlocks) r.scale[j] = kPeer ? __ldcg(s + b) : s[b];
  }
}

__device__ __forceinline__ void load_token_row(const Operands& op, int t, int lane, int part, RowPieces& r) {
  load_row_part<false>(op.xq + static_cast<long long>(t) * kHidden, op.x_scales + static_cast<long long>(t) * kHiddenBlocks,
                       lane, part, r);
}

__device__ __forceinline__ void store_pool_row(const Operands& op, int row, int lane, int part, const RowPieces& r) {
  unsigned char* dst = op.pool_x + static_cast<long long>(row) * kHidden;
#pragma unroll
  for (int j = 0; j < kPartVectors; ++j) {
    const int v = lane + 32 * (part * kPartVectors + j);
    if (v < kHidden / 16) megamoe::st_v4(dst + 16 * v, r.piece[j]);
  }
  if (part != 0) return;
#pragma unroll
  for (int j = 0; j < kRowScalesPerLane; ++j) {
    const int b = lane + 32 * j;
    if (b < kHiddenBlocks) megamoe::st_f32(op.pool_x_scales + static_cast<long long>(b) * op.r_pad + row, r.scale[j]);
  }
}


// Phase 3: every routed (token, slot), and each token for the shared expert, copied to its pool row, a
// chunk of tokens per claim. `claimed_first`: the CTA's first claim was made earlier, its chunk in
// cta.broadcast[1]. Returns the number of chunks.
__device__ __forceinline__ int place_rows(const Operands& op, const Workspace& work, const SharedState& cta,
                                          int shared_rows, bool claimed_first) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int place_tokens =
      max(1, min(kMaxPlaceChunkTokens, (op.tokens + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x)));
  const int place_chunks = (op.tokens + place_tokens - 1) / place_tokens;
  for (bool first = claimed_first;; first = false) {
    const int chunk = first ? cta.broadcast[1] : cta_claim(work.counters + kPlaceClaim, cta.broadcast);
    if (chunk >= place_chunks) break;
    const int t0 = chunk * place_tokens;
    const int items = (min(op.tokens, t0 + place_tokens) - t0) * (kTopK + 1);
    // Each warp takes a run of up to 32 items (token, slot); the slot kTopK is the shared expert's row.
    // Lane j claims item j's pool row (one atomic round trip for the run), the warp copies each token's
    // row to its claimed pool rows, and lane j signals item j's arrival after the copies.
    constexpr int kWarps = kThreads / 32;
    const int run = min(32, (items + kWarps - 1) / kWarps);
    for (int r0 = warp * run; r0 < items; r0 += kWarps * run) {
      const unsigned long long t_claim = trace_clock(op.trace);
      const int n = min(run, items - r0);
      const int item = r0 + lane;
      const int t = t0 + item / (kTopK + 1);
      int row = -1;
      int arrival_block = -1;
      if (lane < n) {
        const int slot = item % (kTopK + 1);
        if (slot < kTopK) {
          const int e = op.ids[t * kTopK + slot];
          if (e >= 0 && e < kExperts) {
            row = cta.offsets[e] + atomicAdd(work.cursor + e, 1);
            arrival_block = cta.blocks[e] + (row - cta.offsets[e]) / kBlockM;
          }
          op.slot_row[t * kTopK + slot] = row;
        } else if (shared_rows > 0) {
          row = cta.offsets[kExperts] + t;
          arrival_block = cta.blocks[kExperts] + t / kBlockM;
        }
      }
      unsigned pending = __ballot_sync(0xffffffffu, row >= 0);  // the run's claimed rows, in lane order
      const unsigned long long t_copy = trace_clock(op.trace);
      if (tid == 0) trace_add(op.trace, kTracePlaceClaimNs, t_copy - t_claim);
      // A token's items are consecutive lanes: its row is loaded once and stored to each of its claimed
      // pool rows (up to kTopK + 1), kPlaceRowsInFlight tokens' loads issued together.
      const int lane_token = (r0 + lane) / (kTopK + 1);
      while (pending != 0) {
        unsigned targets[kPlaceRowsInFlight];
        int tokens[kPlaceRowsInFlight];  // for the later parts
        RowPieces pieces[kPlaceRowsInFlight];
#pragma unroll
        for (int q = 0; q < kPlaceRowsInFlight; ++q) {
          const int first = pending != 0 ? __ffs(pending) - 1 : 0;
          const int token = __shfl_sync(0xffffffffu, lane_token, first);
          targets[q] = pending != 0 ? __ballot_sync(0xffffffffu, lane_token == token) & pending : 0u;
          pending &= ~targets[q];
          tokens[q] = t0 + token;
          if (targets[q] != 0) load_token_row(op, t0 + token, lane, 0, pieces[q]);
        }
#pragma unroll
        for (int part = 0; part < kPlaceRowParts; ++part) {
          if (part > 0) {
#pragma unroll
            for (int q = 0; q < kPlaceRowsInFlight; ++q) {
              if (targets[q] != 0) load_token_row(op, tokens[q], lane, part, pieces[q]);
            }
          }
#pragma unroll
          for (int q = 0; q < kPlaceRowsInFlight; ++q) {
            for (unsigned left = targets[q]; left != 0; left &= left - 1) {
              store_pool_row(op, __shfl_sync(0xffffffffu, row, __ffs(left) - 1), lane, part, pieces[q]);
            }
          }
        }
      }
      const unsigned long long t_signal = trace_clock(op.trace);
      if (tid == 0) trace_add(op.trace, kTracePlaceCopyNs, t_signal - t_copy);
      fence_proxy_async_global();  // the rows are read by TMA (async proxy) in another CTA
      __syncwarp();
      if (arrival_block >= 0) add_release(work.arrived + arrival_block, 1);
      if (tid == 0) trace_add(op.trace, kTracePlaceSignalNs, trace_clock(op.trace) - t_signal);
    }
    __syncthreads();
    if (tid == 0) add_release(work.counters + kPlaceDone, 1);
  }
  return place_chunks;
}

}  // namespace
