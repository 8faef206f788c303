// The fused kernel's last phase: once every L2 tile is published, each token's output is its slots'
// weighted y rows plus the shared expert's, rounded once to bf16; then the last CTA out zeroes the
// workspace for the next launch.

#pragma once

#include "megamoe_layout.cuh"
#include "megamoe_sync.cuh"
#include "megamoe_trace.cuh"

namespace {

// The combine's unit of work: 256 channels of a token (8 per lane). A token's rows are its kTopK slots
// and the shared expert's; the loads of kCombineUnroll chunks of every row are issued before the first
// add (as many as the math warps' registers hold), so a token costs a few memory latencies, not one per
// chunk.
constexpr int kCombineChunks = kHidden / 256;
constexpr int kCombineRows = kTopK + 1;
constexpr int kCombineUnrollWide = kCombineRows <= 7 ? 4 : (kCombineRows <= 14 ? 2 : 1);  // 216+ registers
constexpr int kCombineUnroll = kMathRegisters >= 216 ? kCombineUnrollWide : (kCombineUnrollWide + 1) / 2;

// Combine of chunks [chunk_begin, chunk_end) of one token by one warp, with the unfused moe_combine's
// rule and order: slots ascending, then the shared expert (weight 1: w·y is then y exactly, as that
// rule's unweighted add). Lane s reads slot s's row and weight once.
__device__ __forceinline__ void combine_token(const Operands& op, int shared_row0, int t, int chunk_begin,
                                              int chunk_end, int lane) {
  int lane_row = -1;
  float lane_weight = 0.f;
  if (lane < kTopK) {
    lane_row = load_cg(op.slot_row + t * kTopK + lane);
    lane_weight = op.weights[t * kTopK + lane];
  }
  int rows[kCombineRows];
  float weights[kCombineRows];
#pragma unroll
  for (int s = 0; s < kTopK; ++s) {
    rows[s] = __shfl_sync(0xffffffffu, lane_row, s);
    weights[s] = __shfl_sync(0xffffffffu, lane_weight, s);
  }
  rows[kTopK] = shared_row0 >= 0 ? shared_row0 + t : -1;
  weights[kTopK] = 1.f;
  for (int i0 = chunk_begin; i0 < chunk_end; i0 += kCombineUnroll) {
    u32x4 piece[kCombineUnroll][kCombineRows];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int c = ((i0 + u) * 32 + lane) * 8;
#pragma unroll
      for (int s = 0; s < kCombineRows; ++s) {
        if (i0 + u < chunk_end && rows[s] >= 0) {
          piece[u][s] = megamoe::ld_cg_v4(op.y + static_cast<long long>(rows[s]) * kHidden + c);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      if (i0 + u >= chunk_end) break;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < kCombineRows; ++s) {
        if (rows[s] >= 0) megamoe::add_weighted_bf16x8(acc, piece[u][s], weights[s]);
      }
      const int c = ((i0 + u) * 32 + lane) * 8;
      megamoe::st_v4(op.out + static_cast<long long>(t) * kHidden + c, megamoe::pack_bf16x8(acc));
    }
  }
}

// The last CTA out (by the exit count) zeroes the workspace for the next launch.
__device__ __forceinline__ void zero_workspace_if_last(const Operands& op, const Workspace& work,
                                                       const SharedState& cta, int total_blocks) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
    __threadfence();
    cta.broadcast[2] = atomicAdd(work.counters + kExitCount, 1) == static_cast<int>(gridDim.x) - 1 ? 1 : 0;
  }
  named_barrier_sync(1, kMathThreads);
  if (tid == 0) trace_time(op.trace, kTraceEnd);
  if (cta.broadcast[2] == 1) {
    __threadfence();
    for (int i = tid; i < kCounterWords + 2 * kGroups; i += kMathThreads) work.counters[i] = 0;
    for (int i = tid; i < total_blocks; i += kMathThreads) {
      work.arrived[i] = 0;
      work.l1_done[i] = 0;
    }
    if constexpr (kExpand) {
      for (int i = tid; i < 2 * kExperts; i += kMathThreads) work.expanded[i] = 0;
    }
  }
}

}  // namespace
