// The fused kernel's tile epilogues: L1 applies SwiGLU and re-quantizes the h rows to FP8 (per-128
// amax in registers, exchanged between warps where a row's channels are split), L2 writes bf16 y rows;
// each through the warps' staging areas, for both tile kinds.

#pragma once

#include "megamoe_mainloop.cuh"

namespace {

// L1 epilogue: chunk 0 holds gate, chunk 1 up of the same channels. Thread rows: frag_row and + 8,
// columns 8i + frag_col + {0, 1} of its chunk; the 4 lanes of a quad share a row, so the row's amax is a
// max over the thread's values and two shuffles, and with BLOCK_M 64 (each warpgroup holds 64 of the
// 128 channels) a max with the other warpgroup's, through shared memory.
__device__ __forceinline__ void l1_epilogue(const Operands& op, const MathContext& m, const Task& task,
                                            float (&acc)[2][kAccum], int frag_row, int frag_col) {
  using S = Split<true>;
  static_assert(S::kChunks == 2, "an L1 tile's chunks are its gate and up channels");
  const int row_lo = task.row0 + S::row_offset(m.warpgroup) + frag_row;
  const bool clamp_on = op.has_clamp != 0;
  float amax_lo = 0.0f;
  float amax_hi = 0.0f;
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) {
    acc[0][i] = megamoe::swiglu(acc[0][i], acc[1][i], clamp_on, op.clamp);
    if ((i & 2) == 0) amax_lo = fmaxf(amax_lo, fabsf(acc[0][i]));
    else amax_hi = fmaxf(amax_hi, fabsf(acc[0][i]));
  }
#pragma unroll
  for (int d = 1; d <= 2; d <<= 1) {
    amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, d));
    amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, d));
  }
  if constexpr (!S::kWide) {
    const unsigned mine = m.amax_smem + static_cast<unsigned>(m.warpgroup * 64 + frag_row) * 4;
    const unsigned other = m.amax_smem + static_cast<unsigned>((1 - m.warpgroup) * 64 + frag_row) * 4;
    if ((m.lane & 3) == 0) {
      store_shared_f32(mine, amax_lo);
      store_shared_f32(mine + 8 * 4, amax_hi);
    }
    named_barrier_sync(2, kMathThreads);
    amax_lo = fmaxf(amax_lo, load_shared_f32(other));
    amax_hi = fmaxf(amax_hi, load_shared_f32(other + 8 * 4));
  }
  const megamoe::GroupScale s_lo = megamoe::activation_scale<kUe8m0>(amax_lo);
  const megamoe::GroupScale s_hi = megamoe::activation_scale<kUe8m0>(amax_hi);
  // The codes of the warp's 16 rows go through its staging area; the scales straight to the pool.
  const int staged_row = frag_row & 15;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_lo + 8 * half;
    if (row >= task.row_end) continue;  // never copied out
    const megamoe::GroupScale s = half == 0 ? s_lo : s_hi;
    const unsigned dst = m.staging + static_cast<unsigned>(staged_row + 8 * half) * kStagingPitch + frag_col;
#pragma unroll
    for (int i = 0; i < S::kAcc / 4; ++i) {
      const float x0 = megamoe::mul_rn(acc[0][4 * i + 2 * half], s.inv);
      const float x1 = megamoe::mul_rn(acc[0][4 * i + 2 * half + 1], s.inv);
      store_shared_u16(dst + 8 * i, megamoe::e4m3x2_from_floats(x0, x1));  // columns 8i + frag_col, + 1
    }
    if (frag_col == 0 && (S::kWide || m.warpgroup == 0)) {
      megamoe::st_f32(op.pool_h_scales + static_cast<long long>(task.n) * op.r_pad + row, s.scale);
    }
  }
  const int warp_row0 = task.row0 + S::row_offset(m.warpgroup) + (frag_row & ~15);  // the warp's first row
  copy_out_staged_rows<S::kAcc * 2, kStagingPitch>(m.staging,
                             op.pool_h + static_cast<long long>(warp_row0) * kMaxInter + task.n * kQuant +
                                 S::column(0, m.warpgroup),
                             kMaxInter, task.row_end - warp_row0, m.lane);
}

// L2 epilogue: this warpgroup's output columns as bf16, through the warp's staging area 64 columns
// (128 bytes of a row) at a time.
__device__ __forceinline__ void l2_epilogue(const Operands& op, const MathContext& m, const Task& task,
                                            const float (&acc)[2][kAccum], int frag_row, int frag_col) {
  using S = Split<false>;
  static_assert(S::kAcc == 64, "an L2 chunk is 128 columns: two rounds of 64");
  const int warp_row0 = task.row0 + S::row_offset(m.warpgroup) + (frag_row & ~15);  // the warp's first row
  const unsigned staged = m.staging + static_cast<unsigned>(frag_row & 15) * kStagingPitch + 2 * frag_col;
  const int rows_valid = task.row_end - warp_row0;  // of the warp's 16; the others are never copied out
  unsigned char* const y_rows =
      reinterpret_cast<unsigned char*>(op.y + static_cast<long long>(warp_row0) * kHidden + task.n * kBlockN);
#pragma unroll
  for (int c = 0; c < S::kChunks; ++c) {
#pragma unroll
    for (int round = 0; round < 2; ++round) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if ((frag_row & 15) + 8 * half >= rows_valid) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int i = 8 * round + j;  // columns 8i + frag_col, + 1 of the chunk
          store_shared_u32(staged + 8 * half * kStagingPitch + 16 * j,
                           megamoe::bf16x2_from_floats(acc[c][4 * i + 2 * half], acc[c][4 * i + 2 * half + 1]));
        }
      }
      copy_out_staged_rows<kStagedRowBytes, kStagingPitch>(m.staging,
                                                            y_rows + 2 * (S::column(c, m.warpgroup) + 64 * round),
                                                            2 * kHidden, rows_valid, m.lane);
    }
  }
}

// Swap-AB L1 epilogue: SwiGLU of each (channel, row) in registers, the row's amax over the 128 channels
// (the 8 lanes of a column, then the gate warps through shared memory), FP8 codes staged as the tile's
// [row][128 channels] bytes across the math warps' areas and copied out by every math thread. The gate
// warps are warpgroups 0 and 1; with four math warpgroups the up sums of 2 and 3 first move to the gate
// thread at the same position, through the upper half of the staging areas, once both up warpgroups have
// copied out their last L2 tile from there (barrier 7; the stage ring lets one run ahead of the other).
constexpr unsigned kSwapL1Pitch = kStagedRowBytes + 16;
constexpr int kSwapWgColumns = 64 * kSwapWaves;  // L2 output columns per math warpgroup
constexpr unsigned kSwapL2Pitch = 2 * kSwapWgColumns + 16;  // a warpgroup's bf16 columns of a row
constexpr int kSwapGateWarps = 8;
constexpr unsigned kSwapUpExchange = kMathWarps / 2 * kStagingWarpBytes;  // offset in the staging areas
static_assert(!kSwapAB || kBlockM * kSwapL1Pitch <= kSwapUpExchange, "L1 swap staging");
static_assert(kSwapWaves == 2 || 256 * kSwapAcc * 4 <= kSwapUpExchange, "L1 swap up exchange");
static_assert(!kSwapAB || kBlockM * kSwapL2Pitch <= 4 * kStagingWarpBytes, "L2 swap staging");

__device__ __forceinline__ void l1_epilogue_swap(const Operands& op, const MathContext& m, const Task& task,
                                                 float (&acc)[2][kAccum], int frag_row, int frag_col) {
  const bool clamp_on = op.has_clamp != 0;
  const int warp = static_cast<int>(threadIdx.x / 32);
  const bool gate = kSwapWaves == 2 || m.warpgroup < 2;  // every warpgroup with two
  if constexpr (kSwapWaves == 1) {
    const unsigned exchange = m.staging_all + kSwapUpExchange + (threadIdx.x % 256) * 4;
    if (!gate) {
      named_barrier_sync(7, 256);
#pragma unroll
      for (int i = 0; i < kSwapAcc; ++i) store_shared_f32(exchange + i * 256 * 4, acc[0][i]);
    }
    named_barrier_sync(2, kMathThreads);
    if (gate) {
#pragma unroll
      for (int i = 0; i < kSwapAcc; ++i) acc[1][i] = load_shared_f32(exchange + i * 256 * 4);
    }
  }
  float amax[kSwapColGroups][2];
  if (gate) {
#pragma unroll
    for (int j = 0; j < kSwapColGroups; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float a = 0.0f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = 4 * j + 2 * half + e;
          acc[0][i] = megamoe::swiglu(acc[0][i], acc[1][i], clamp_on, op.clamp);
          a = fmaxf(a, fabsf(acc[0][i]));
        }
#pragma unroll
        for (int d = 4; d <= 16; d <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, d));
        amax[j][e] = a;
      }
    }
    if (m.lane < 4) {
#pragma unroll
      for (int j = 0; j < kSwapColGroups; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          store_shared_f32(m.amax_smem + static_cast<unsigned>(warp * kBlockM + 8 * j + frag_col + e) * 4, amax[j][e]);
        }
    }
  }
  named_barrier_sync(2, kMathThreads);
  if (gate) {
    const int channel0 = 64 * m.warpgroup + frag_row;  // of the tile's 128; and + 8
#pragma unroll
    for (int j = 0; j < kSwapColGroups; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + frag_col + e;
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < kSwapGateWarps; ++w) {
          a = fmaxf(a, load_shared_f32(m.amax_smem + static_cast<unsigned>(w * kBlockM + col) * 4));
        }
        const megamoe::GroupScale s = megamoe::activation_scale<kUe8m0>(a);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float x = megamoe::mul_rn(acc[0][4 * j + 2 * half + e], s.inv);
          store_shared_u8(m.staging_all + static_cast<unsigned>(col) * kSwapL1Pitch + channel0 + 8 * half,
                          megamoe::e4m3_from_float(x));
        }
        if (threadIdx.x < 4 && task.row0 + col < task.row_end) {
          megamoe::st_f32(op.pool_h_scales + static_cast<long long>(task.n) * op.r_pad + task.row0 + col, s.scale);
        }
      }
    }
  }
  named_barrier_sync(2, kMathThreads);
  copy_out_staged_tile<kQuant, kSwapL1Pitch>(m.staging_all,
                                             op.pool_h + static_cast<long long>(task.row0) * kMaxInter + task.n * kQuant,
                                             kMaxInter, min(kBlockM, task.row_end - task.row0),
                                             static_cast<int>(threadIdx.x), kMathThreads);
}

// Swap-AB L2 epilogue: each warpgroup stages its output columns of the tile's rows as bf16
// ([row][kSwapWgColumns] across its warps' areas) and copies them out.
__device__ __forceinline__ void l2_epilogue_swap(const Operands& op, const MathContext& m, const Task& task,
                                                 const float (&acc)[2][kAccum], int frag_row, int frag_col) {
  const unsigned staging = m.staging_all + static_cast<unsigned>(m.warpgroup) * 4 * kStagingWarpBytes;
#pragma unroll
  for (int wave = 0; wave < kSwapWaves; ++wave)
#pragma unroll
    for (int j = 0; j < kSwapColGroups; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + frag_col + e;
          const int column = 64 * wave + frag_row + 8 * half;  // of the warpgroup's
          const unsigned bits = megamoe::bf16x2_from_floats(acc[wave][4 * j + 2 * half + e], 0.0f);
          store_shared_u16(staging + static_cast<unsigned>(col) * kSwapL2Pitch + 2 * column,
                           static_cast<unsigned short>(bits & 0xffffu));
        }
  named_barrier_sync(3 + m.warpgroup, 128);
  unsigned char* const y_rows = reinterpret_cast<unsigned char*>(
      op.y + static_cast<long long>(task.row0) * kHidden + task.n * kBlockN + kSwapWgColumns * m.warpgroup);
  copy_out_staged_tile<2 * kSwapWgColumns, kSwapL2Pitch>(staging, y_rows, 2 * kHidden,
                                                          min(kBlockM, task.row_end - task.row0),
                                                          static_cast<int>(threadIdx.x % 128), 128);
}

}  // namespace
