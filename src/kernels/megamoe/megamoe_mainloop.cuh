// The fused kernel's math mainloops: a tile's K blocks from the stage ring, each block's wgmma product
// promoted into fp32 with its two scales; the 64- and 128-row tiles, and the swap-AB tiles of 16 or 32.

#pragma once

#include "common/fp4_frag.cuh"
#include "megamoe_layout.cuh"
#include "megamoe_sync.cuh"
#include "megamoe_trace.cuh"

namespace {

// ---------------------------------------------------------------------------------------------------
// The math warpgroups' tile: K in 128-wide blocks, each block's wgmma product promoted into fp32 with
// its two scales (as fp8_grouped_gemm.cu does). B holds 256 weight rows: L1 gate rows then up rows of
// the same 128 channels, L2 256 output columns.

// How the two math warpgroups split a tile.
//   BLOCK_M 128: warpgroup w owns rows 64w .. 64w + 63 and all 256 B rows as two n128 chunks (L1: gate,
//                up); the weight-scale row of chunk c is c.
//   BLOCK_M 64:  both own rows 0 .. 63 (half the A bytes per stage: the decode shape). L1: warpgroup w
//                owns channels 64w .. 64w + 63 of gate and of up (two n64 chunks, scale rows 0 and 1);
//                L2: columns 128w .. 128w + 127 (one n128 chunk, scale row w).
// The first tile row a math warpgroup's A operand starts at (swap-AB tiles have no A rows of their own).
__device__ __forceinline__ int warpgroup_row_offset(int w) { return kBlockM == 128 ? 64 * w : 0; }

template <bool kL1>
struct Split {
  static constexpr bool kWide = kBlockM == 128;
  static constexpr int kChunks = kWide || kL1 ? 2 : 1;
  static constexpr int kN = kWide || !kL1 ? 128 : 64;
  static constexpr int kAcc = kN / 2;
  __device__ static int row_offset(int w) { return warpgroup_row_offset(w); }
  __device__ static int b_row(int c, int w) { return kWide ? c * 128 : (kL1 ? c * 128 + 64 * w : 128 * w); }
  __device__ static int sw_row(int c, int w) { return kWide || kL1 ? c : w; }
  // First column of chunk c: L1 a channel of the 128-channel block, L2 a column of the 256.
  __device__ static int column(int c, int w) { return kWide ? (kL1 ? 0 : 128 * c) : (kL1 ? 64 * w : 128 * w); }
};

struct MathContext {
  unsigned a_smem;   // stage 0's A tile at this warpgroup's first row
  unsigned b_smem;   // stage 0's B tile (kFp4Regs: its packed area)
  unsigned sa_smem;  // stage 0's A scales, at this thread's fragment row (swap-AB: at row 0)
  unsigned row_words;  // kFp4Regs: stage 0's reference word per B row
  unsigned full_bar;
  unsigned empty_bar;
  unsigned amax_smem;  // the L1 epilogue's row amax exchange (see kAmaxBytes)
  unsigned staging;    // this warp's staging area
  unsigned staging_all;  // the first math warp's (swap-AB epilogues stage a tile across warps' areas)
  int warpgroup;
  int lane;
  int* status;
  unsigned long long* trace;
};

// The mainloops' shared steps. Waits until the stage's operands have landed (the wait summed into the trace).
__device__ __forceinline__ void wait_stage_full(const MathContext& m, int stage, unsigned phase) {
  const unsigned long long t0 = trace_clock(m.trace);
  wait_barrier(m.full_bar + 8 * stage, phase, m.status, kStatusStageFullWait, stage);
  if (threadIdx.x == 0) trace_add(m.trace, kTraceStageFullWaitNs, trace_clock(m.trace) - t0);
}

// Hands the stage back to the producer (one arrive per math warp, its wgmmas done) and moves to the next.
// FP4 register builds: the lanes read the stage's packed rows and words with plain loads, so lane 0
// arrives after all of them.
__device__ __forceinline__ void release_stage(const MathContext& m, int& stage, unsigned& phase) {
  if constexpr (kFp4Regs) __syncwarp();
  if (m.lane == 0) mbar_arrive(m.empty_bar + 8 * stage);
  advance_stage(stage, phase);
}

// The EP build's FP4 128-row tiles (math warpgroups at 216 registers beside the converters' 72) issue each
// n128 chunk as two n64 wgmmas: an n128 partial beside the 128 accumulators spills there.
constexpr bool kHalfChunks = kEpConverters && kBlockM == 128;

template <bool kL1>
__device__ __forceinline__ void tile_mainloop(const MathContext& m, const Task& task, unsigned sw_rows,
                                              int& stage, unsigned& phase, float (&acc)[2][kAccum]) {
  using S = Split<kL1>;
  float partial[kHalfChunks ? S::kAcc / 2 : S::kAcc];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int i = 0; i < kAccum; ++i) acc[c][i] = 0.0f;
  const bool active = task.row0 + S::row_offset(m.warpgroup) < task.row_end;
  // FP8 and FP4 experts alike: each chunk's weight scale is its 128 × 128 block's, from the task slot.
  for (int kb = 0; kb < task.k_blocks; ++kb) {
    float sw[S::kChunks];
#pragma unroll
    for (int c = 0; c < S::kChunks; ++c) {
      sw[c] = load_shared_f32(sw_rows + (S::sw_row(c, m.warpgroup) * kMaxKBlocks + kb) * 4);
    }
    wait_stage_full(m, stage, phase);
    if (active) {
      const unsigned sa = m.sa_smem + stage * kSaStride + (task.row0 & 3) * 4;
      const float sa_lo = load_shared_f32(sa);
      const float sa_hi = load_shared_f32(sa + 8 * 4);
      const unsigned a_stage = m.a_smem + stage * kATileBytes;
      const unsigned b_stage = m.b_smem + stage * kBTileBytes;
#pragma unroll
      for (int c = 0; c < S::kChunks; ++c) {
        const int b_row = S::b_row(c, m.warpgroup);
        if constexpr (kHalfChunks) {
          wgmma_block_k128(partial, a_stage, b_stage + b_row * kBlockK);
          promote_block<0>(acc[c], partial, sa_lo * sw[c], sa_hi * sw[c]);
          wgmma_block_k128(partial, a_stage, b_stage + (b_row + 64) * kBlockK);
          promote_block<S::kAcc / 2>(acc[c], partial, sa_lo * sw[c], sa_hi * sw[c]);
        } else {
          wgmma_block_k128(partial, a_stage, b_stage + b_row * kBlockK);
          promote_block(acc[c], partial, sa_lo * sw[c], sa_hi * sw[c]);
        }
      }
    }
    release_stage(m, stage, phase);
  }
}

// ---------------------------------------------------------------------------------------------------
// Swap-AB tiles (BLOCK_M 16 or 32). The wgmma's A operand is 64 rows of the stage's B (weight) tile and
// its B operand the stage's kBlockM pool rows, so D[64 weight rows × kBlockM rows]: a thread holds
// weight rows frag_row and + 8 and pool rows (columns) 8j + frag_col + {0, 1}. With two math warpgroups,
// warpgroup w takes two m64 waves: L1 the gate rows and the up rows of channels 64w .. 64w + 63 (B rows
// 64w and 128 + 64w: a thread holds gate and up of the same channel and row), L2 output columns 128w ..
// 128w + 127 (B rows 128w and 128w + 64). With four (the FP4 register builds) warpgroup w takes one wave,
// B rows 64w .. 64w + 63: L1 warpgroups 0 and 1 the gate rows, 2 and 3 the up rows of the same channels
// (the L1 epilogue pairs them through shared memory), L2 output columns 64w .. 64w + 63. The promotion
// multiplies the same two scales as the other tiles (the row's times the weight block's), so the sums are
// theirs.
constexpr int kSwapAcc = kSwapAB ? kBlockM / 2 : 8;  // fp32 accumulators per thread of one m64 × n(kBlockM) wave
constexpr int kSwapColGroups = kSwapAcc / 4;         // groups of 8 pool rows (columns) per wave
constexpr int kSwapWaves = 4 / kMathWarpgroups;      // m64 waves per math warpgroup

template <bool kL1>
struct SwapSplit {
  __device__ static int b_row(int wave, int w) {
    if constexpr (kSwapWaves == 1) return 64 * w;
    return kL1 ? 128 * wave + 64 * w : 128 * w + 64 * wave;
  }
  // The weight-scale row (of the tile's two 128-row blocks) of a wave: b_row / 128.
  __device__ static int sw_row(int wave, int w) {
    if constexpr (kSwapWaves == 1) return w / 2;
    return kL1 ? wave : w;
  }
};

// Whether an L1 and an L2 tile split alike (Split, SwapSplit: 128-row tiles, or one m64 wave per
// warpgroup): the kernel then inlines one mainloop for both kinds.
constexpr bool kKindsSplitAlike = kSwapAB ? kSwapWaves == 1 : kBlockM == 128;

// kFp4Regs: swap_mainloop with each thread's A fragments converted from the stage's packed rows
// (common/fp4_frag.cuh) and wgmma taking A from registers. With one wave per warpgroup (four math
// warpgroups, BLOCK_M 16) a routed (FP4) tile is pipelined by one K block: block kb + 1 is converted into
// the other fragment buffer while the tensor cores run block kb, then kb is promoted and its stage
// released, then kb + 1 issued, so the conversion (ALU) and the wgmmas overlap instead of alternating.
// ptxas keeps a wgmma in flight only across straight-line code (a divergent path, such as a barrier's
// spin loop or the exact-table branch, makes it wait): so stage kb + 1 is waited for before kb is
// issued, and the rare exact-table pass of kb + 1 runs after kb is finished. The shared expert (FP8)
// takes two stages per K block, B box 0 (rows 0..127) with A, then box 1 (rows 128..255): one stage wait
// per loop step (a second wait site in the loop made ptxas spill).
using Fp4Frags = unsigned[4][4];  // a thread's A fragments of a K block

// The K block in stage s: its fast-table fragments (fp4_frag.cuh) and row scales; whether the warp
// must convert it again with the exact tables (fp4_regs_exact).
template <bool kL1>
__device__ __forceinline__ bool fp4_regs_convert(const MathContext& m, int s, Fp4Frags& frag, unsigned (&sw_bits)[2]) {
  const int b_row = SwapSplit<kL1>::b_row(0, m.warpgroup);
  const bool exact = megamoe::fp4_fragment_k128_fast(
      megamoe::fp4_stage::SharedMem{}, m.b_smem + s * kPackedStageBytes + b_row * megamoe::fp4_stage::kPackedRowBytes,
      m.row_words + s * kRowWordsStageBytes + b_row * 4, static_cast<int>(threadIdx.x % 128), frag, sw_bits);
  return !megamoe::fp4_warp_all(!exact);
}

// Swap-AB: the A (pool row) scales of this thread's accumulator columns in stage s, column group j's
// rows frag_col + 8j and + 1.
__device__ __forceinline__ void load_swap_a_scales(const MathContext& m, const Task& task, int s, int frag_col,
                                                   float (&sa_col)[kSwapColGroups][2]) {
  const unsigned sa = m.sa_smem + s * kSaStride + ((task.row0 & 3) + frag_col) * 4;
#pragma unroll
  for (int j = 0; j < kSwapColGroups; ++j) {
    sa_col[j][0] = load_shared_f32(sa + 8 * j * 4);
    sa_col[j][1] = load_shared_f32(sa + (8 * j + 1) * 4);
  }
}

// Swap-AB: one wave's K block into its accumulators, the CPU rule's fp32(acc + partial · fp32(sa · sw)):
// sa per accumulator column (sa_col), sw per accumulator row, frag_row (sw_lo) and + 8 (sw_hi). FP8
// weights pass their block's scale twice; FP4 each weight row's 2^ref.
__device__ __forceinline__ void promote_swap(float (&acc)[kAccum], const float (&partial)[kSwapAcc],
                                             const float (&sa_col)[kSwapColGroups][2], float sw_lo, float sw_hi) {
#pragma unroll
  for (int j = 0; j < kSwapColGroups; ++j)
#pragma unroll
    for (int i = 4 * j; i < 4 * j + 4; ++i) {
      acc[i] = fmaf(partial[i], sa_col[j][i & 1] * ((i & 2) != 0 ? sw_hi : sw_lo), acc[i]);
    }
}

// promote_swap with FP4 rows' scales as fp32 bits (fp4_frag.cuh's sw_bits).
__device__ __forceinline__ void promote_swap_fp4(float (&acc)[kAccum], const float (&partial)[kSwapAcc],
                                                 const float (&sa_col)[kSwapColGroups][2], const unsigned (&sw_bits)[2]) {
  promote_swap(acc, partial, sa_col, megamoe::fp32_from_bits(sw_bits[0]), megamoe::fp32_from_bits(sw_bits[1]));
}

template <bool kL1>
__device__ __forceinline__ void fp4_regs_exact(const MathContext& m, int s, Fp4Frags& frag) {
  const int b_row = SwapSplit<kL1>::b_row(0, m.warpgroup);
  megamoe::fp4_fragment_k128_exact(
      megamoe::fp4_stage::SharedMem{}, m.b_smem + s * kPackedStageBytes + b_row * megamoe::fp4_stage::kPackedRowBytes,
      m.row_words + s * kRowWordsStageBytes + b_row * 4, static_cast<int>(threadIdx.x % 128), frag);
}

// Issues the K block in stage s. The fragments are final before the fence (wgmma reads them behind the
// compiler); the partials are written, not read, by the first step.
__device__ __forceinline__ void fp4_regs_issue(const MathContext& m, int s, float (&partial)[kSwapAcc], Fp4Frags& frag) {
#pragma unroll
  for (int k = 0; k < 4; ++k) fence_operands(frag[k]);
  const unsigned a_stage = m.a_smem + s * kATileBytes;
  wgmma_fence();
  wgmma_e4m3_rs_first(partial, frag[0], smem_descriptor(a_stage));
#pragma unroll
  for (int k = 1; k < 4; ++k) wgmma_e4m3_rs(partial, frag[k], smem_descriptor(a_stage + k * 32), 1);
  wgmma_commit();
}

// The K block in stage s, issued from `frag`: waited for, promoted (promote_swap_fp4), its stage handed
// back.
__device__ __forceinline__ void fp4_regs_finish(const MathContext& m, const Task& task, int s, int frag_col,
                                                float (&partial)[kSwapAcc], Fp4Frags& frag,
                                                const unsigned (&sw_bits)[2], float (&acc)[2][kAccum]) {
  float sa_col[kSwapColGroups][2];
  load_swap_a_scales(m, task, s, frag_col, sa_col);
  wgmma_wait<0>();
  fence_registers(partial);
#pragma unroll
  for (int k = 0; k < 4; ++k) fence_operands(frag[k]);
  promote_swap_fp4(acc[0], partial, sa_col, sw_bits);
  __syncwarp();  // the lanes read the stage's words and A scales with plain loads
  if (m.lane == 0) mbar_arrive(m.empty_bar + 8 * s);
}

// A routed tile's K blocks, pipelined by one. One step: stage `next` waited for, block `cur` issued,
// `next` converted under it, `cur` finished, then `next`'s exact pass if any lane needs one. The
// fragment buffers alternate, so the loop takes K blocks in pairs (the indices stay compile-time).
template <bool kL1>
__device__ __forceinline__ void swap_mainloop_regs_fp4(const MathContext& m, const Task& task, int& stage,
                                                       unsigned& phase, float (&acc)[2][kAccum], int frag_col) {
  float partial[kSwapAcc];
  Fp4Frags frag0, frag1;
  unsigned sw0[2], sw1[2];
  int s0 = stage;
  wait_stage_full(m, s0, phase);
  if (fp4_regs_convert<kL1>(m, s0, frag0, sw0)) fp4_regs_exact<kL1>(m, s0, frag0);
  advance_stage(stage, phase);
  const auto step = [&](int cur, Fp4Frags& frag_cur, const unsigned (&sw_cur)[2], int next, Fp4Frags& frag_next,
                        unsigned (&sw_next)[2]) {
    wait_stage_full(m, next, phase);
    fp4_regs_issue(m, cur, partial, frag_cur);
    const bool exact = fp4_regs_convert<kL1>(m, next, frag_next, sw_next);
    fp4_regs_finish(m, task, cur, frag_col, partial, frag_cur, sw_cur, acc);
    if (exact) fp4_regs_exact<kL1>(m, next, frag_next);
    advance_stage(stage, phase);
  };
  int kb = 1;
  for (; kb + 1 < task.k_blocks; kb += 2) {
    const int s1 = stage;
    step(s0, frag0, sw0, s1, frag1, sw1);
    s0 = stage;
    step(s1, frag1, sw1, s0, frag0, sw0);
  }
  if (kb < task.k_blocks) {
    const int s1 = stage;
    step(s0, frag0, sw0, s1, frag1, sw1);
    fp4_regs_issue(m, s1, partial, frag1);
    fp4_regs_finish(m, task, s1, frag_col, partial, frag1, sw1, acc);
  } else {
    fp4_regs_issue(m, s0, partial, frag0);
    fp4_regs_finish(m, task, s0, frag_col, partial, frag0, sw0, acc);
  }
}

// One of the shared expert's FP8 K blocks in the register builds, once both of its stages are full (its
// 32 KB tile is one 128-row box per stage, both operands from shared memory): every wave of the
// warpgroup, then box 0's stage back to the producer (the caller's release_stage returns box 1's).
template <bool kL1>
__device__ __forceinline__ void swap_shared_block_regs(const MathContext& m, unsigned sw_rows, int kb, int first, int stage,
                                                       const float (&sa_col)[kSwapColGroups][2],
                                                       float (&partial)[kSwapAcc], float (&acc)[2][kAccum]) {
#pragma unroll
  for (int wave = 0; wave < kSwapWaves; ++wave) {
    const float sw = load_shared_f32(sw_rows + (SwapSplit<kL1>::sw_row(wave, m.warpgroup) * kMaxKBlocks + kb) * 4);
    const int b_row = SwapSplit<kL1>::b_row(wave, m.warpgroup);
    const unsigned box = m.b_smem + (b_row < 128 ? first : stage) * kPackedStageBytes + (b_row % 128) * kBlockK;
    wgmma_block_k128(partial, box, m.a_smem + first * kATileBytes);
    promote_swap(acc[wave], partial, sa_col, sw, sw);
  }
  __syncwarp();
  if (m.lane == 0) mbar_arrive(m.empty_bar + 8 * first);
}

// Two waves per warpgroup (BLOCK_M 32: the pipelined loop spilled there): convert both waves, issue
// them as two groups, promote wave 0 while wave 1 runs.
template <bool kL1>
__device__ __forceinline__ void swap_mainloop_regs_two_waves(const MathContext& m, const Task& task, unsigned sw_rows,
                                                   int& stage, unsigned& phase, float (&acc)[2][kAccum],
                                                   int frag_col) {
  using S = SwapSplit<kL1>;
  float partial[2][kSwapAcc];
#pragma unroll
  for (int wave = 0; wave < 2; ++wave)
#pragma unroll
    for (int i = 0; i < kSwapAcc; ++i) acc[wave][i] = 0.0f;
  const bool fp4 = task.group != kExperts;
  const int steps = fp4 ? task.k_blocks : 2 * task.k_blocks;
  const int thread = static_cast<int>(threadIdx.x % 128);
  const megamoe::fp4_stage::SharedMem mem;
  int first = stage;  // the stage with A (and the shared expert's box 0)
  for (int step = 0; step < steps; ++step) {
    wait_stage_full(m, stage, phase);
    if (!fp4 && (step & 1) == 0) {  // the shared expert's box 0: its K block waits for box 1
      first = stage;
      advance_stage(stage, phase);
      continue;
    }
    if (fp4) first = stage;
    float sa_col[kSwapColGroups][2];
    load_swap_a_scales(m, task, first, frag_col, sa_col);
    const unsigned a_stage = m.a_smem + first * kATileBytes;
    if (fp4) {
      unsigned frag[2][4][4];
      unsigned sw_bits[2][2];
#pragma unroll
      for (int wave = 0; wave < 2; ++wave) {
        const int b_row = S::b_row(wave, m.warpgroup);
        megamoe::fp4_fragment_k128(mem, m.b_smem + stage * kPackedStageBytes + b_row * megamoe::fp4_stage::kPackedRowBytes,
                                   m.row_words + stage * kRowWordsStageBytes + b_row * 4, thread, frag[wave],
                                   sw_bits[wave]);
      }
      // The fragments and the partials are final before the fence (wgmma reads both behind the compiler).
#pragma unroll
      for (int wave = 0; wave < 2; ++wave) {
#pragma unroll
        for (int k = 0; k < 4; ++k) fence_operands(frag[wave][k]);
        fence_registers(partial[wave]);
      }
      wgmma_fence();
#pragma unroll
      for (int wave = 0; wave < 2; ++wave) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          wgmma_e4m3_rs(partial[wave], frag[wave][k], smem_descriptor(a_stage + k * 32), k > 0 ? 1 : 0);
        }
        wgmma_commit();
      }
#pragma unroll
      for (int wave = 0; wave < 2; ++wave) {
        if (wave == 0) wgmma_wait<1>();
        else wgmma_wait<0>();
        fence_registers(partial[wave]);
#pragma unroll
        for (int k = 0; k < 4; ++k) fence_operands(frag[wave][k]);
        promote_swap_fp4(acc[wave], partial[wave], sa_col, sw_bits[wave]);
      }
    } else {
      swap_shared_block_regs<kL1>(m, sw_rows, step >> 1, first, stage, sa_col, partial[0], acc);
    }
    release_stage(m, stage, phase);
  }
}

template <bool kL1>
__device__ __forceinline__ void swap_mainloop_regs(const MathContext& m, const Task& task, unsigned sw_rows,
                                                   int& stage, unsigned& phase, float (&acc)[2][kAccum],
                                                   int frag_col) {
  if constexpr (kSwapWaves == 2) {
    swap_mainloop_regs_two_waves<kL1>(m, task, sw_rows, stage, phase, acc, frag_col);
    return;
  }
#pragma unroll
  for (int wave = 0; wave < kSwapWaves; ++wave)
#pragma unroll
    for (int i = 0; i < kSwapAcc; ++i) acc[wave][i] = 0.0f;
  if (task.group != kExperts) {
    swap_mainloop_regs_fp4<kL1>(m, task, stage, phase, acc, frag_col);
    return;
  }
  float partial[kSwapAcc];
  int first = stage;  // the stage with A and B box 0
  for (int step = 0; step < 2 * task.k_blocks; ++step) {
    wait_stage_full(m, stage, phase);
    if ((step & 1) == 0) {  // box 0: its K block waits for box 1
      first = stage;
      advance_stage(stage, phase);
      continue;
    }
    float sa_col[kSwapColGroups][2];
    load_swap_a_scales(m, task, first, frag_col, sa_col);
    swap_shared_block_regs<kL1>(m, sw_rows, step / 2, first, stage, sa_col, partial, acc);
    release_stage(m, stage, phase);
  }
}

// The FP8 swap-AB builds: both operands from shared memory (the FP4 ones take the register path).
template <bool kL1>
__device__ __forceinline__ void swap_mainloop_smem(const MathContext& m, const Task& task, unsigned sw_rows,
                                                   int& stage, unsigned& phase, float (&acc)[2][kAccum],
                                                   int frag_col) {
  static_assert(!kBFp4, "FP4 swap-AB tiles convert in registers (swap_mainloop_regs)");
  using S = SwapSplit<kL1>;
  float partial[kSwapAcc];
#pragma unroll
  for (int wave = 0; wave < 2; ++wave)
#pragma unroll
    for (int i = 0; i < kSwapAcc; ++i) acc[wave][i] = 0.0f;
  for (int kb = 0; kb < task.k_blocks; ++kb) {
    float sw[2];
#pragma unroll
    for (int wave = 0; wave < 2; ++wave) {
      sw[wave] = load_shared_f32(sw_rows + (S::sw_row(wave, m.warpgroup) * kMaxKBlocks + kb) * 4);
    }
    wait_stage_full(m, stage, phase);
    float sa_col[kSwapColGroups][2];
    load_swap_a_scales(m, task, stage, frag_col, sa_col);
    const unsigned a_stage = m.a_smem + stage * kATileBytes;
    const unsigned b_stage = m.b_smem + stage * kBTileBytes;
#pragma unroll
    for (int wave = 0; wave < 2; ++wave) {
      wgmma_block_k128(partial, b_stage + S::b_row(wave, m.warpgroup) * kBlockK, a_stage);
      promote_swap(acc[wave], partial, sa_col, sw[wave], sw[wave]);
    }
    release_stage(m, stage, phase);
  }
}

template <bool kL1>
__device__ __forceinline__ void swap_mainloop(const MathContext& m, const Task& task, unsigned sw_rows,
                                              int& stage, unsigned& phase, float (&acc)[2][kAccum],
                                              int frag_col) {
  if constexpr (kFp4Regs) swap_mainloop_regs<kL1>(m, task, sw_rows, stage, phase, acc, frag_col);
  else swap_mainloop_smem<kL1>(m, task, sw_rows, stage, phase, acc, frag_col);
}

}  // namespace
