// FP4 (MXFP4) weight tiles in shared memory, for the kernels whose B operand arrives packed: the
// converters' pass over a stage (packed nibbles and scale words → the e4m3 tile wgmma reads, plus each
// row's fp32 scale 2^ref) and the promotions that apply a scale per weight row. The grouped GEMM
// (B_FP4 1) and the fused kernel (B_FP4 1) both use these, so their products are the same bits.
// docs/numerics.md "FP4 experts (MXFP4)" is the rule; fp4.cuh holds the element conversion.
#pragma once

#include "fp4.cuh"
#include "ptx.cuh"
#include "sm90.cuh"

namespace megamoe::fp4_stage {

// Bytes of one stage's packed rows and of its per-row words (the scale words in, the fp32 scales out).
constexpr unsigned kPackedRowBytes = 64;  // 128 K elements, two per byte
constexpr unsigned kRowWordBytes = 4;

// Shared memory as fp4_stage_convert reads and writes it. The accesses are volatile asm and keep the
// order the converter gives them (its loads ahead of its stores).
struct SharedMem {
  __device__ __forceinline__ unsigned ld32(unsigned address) const {
    unsigned v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(address));
    return v;
  }
  __device__ __forceinline__ void ld64(unsigned address, unsigned* w) const {
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(address) : "memory");
  }
  __device__ __forceinline__ void ld128(unsigned address, unsigned* w) const {
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(address)
                 : "memory");
  }
  __device__ __forceinline__ void st128(unsigned address, const unsigned* w) const {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                 "r"(w[3])
                 : "memory");
  }
  __device__ __forceinline__ void st32(unsigned address, unsigned v) const { sm90::store_shared_u32(address, v); }
};

// One converter thread's share of a stage of kRows weight rows, 128 deep in K:
//   packed  kRows × 64 bytes in the device order (fp4.cuh), 64B-swizzled from a 512-aligned base
//   ref_words kRows u32, row r's reference word (fp4.cuh fp4_reference_word)
//   b_tile  kRows × 128 bytes of e4m3 in the 128-byte swizzle the TMA gives an FP8 tile (row r's 16-byte
//           chunk c at r·128 + ((c ^ (r % 8)) << 4)), as one box or several stacked 8-row-aligned boxes
//   sw      kRows fp32, row r's 2^ref, its sign bit set where the row's 128-row block has one scale
// fp4.cuh fp4_stage_convert is the work (items, banks, the load window; the host test runs it too).
// kDepth items per thread are loaded ahead: two hold 18 registers, within the 56 the producer warpgroup
// keeps (three spill there).
template <int kRows, int kThreads, int kDepth = 2>
__device__ __forceinline__ void convert_tile(unsigned packed, unsigned ref_words, unsigned b_tile, unsigned sw,
                                             int thread) {
  SharedMem mem;
  fp4_stage_convert<kRows, kThreads, kDepth>(mem, packed, ref_words, b_tile, sw, thread);
}

// acc += partial · (sa · sw[column]) for an m64 × nN wgmma fragment whose weight rows are its columns:
// the scale product rounded, then one fmaf, as the CPU rule does. sw_cols is the shared address of the fp32
// scale of this thread's first column (frag_col of the chunk); element pair i covers columns
// 8i + frag_col + {0, 1}, on rows frag_row (sa_lo) and + 8 (sa_hi). kFirst as sm90::promote_block's. The
// scales' sign bits (the converters' block flags) are dropped.
template <int kFirst = 0, int kCount, int kAccCount>
__device__ __forceinline__ void promote_columns(float (&acc)[kAccCount], const float (&partial)[kCount], float sa_lo,
                                                float sa_hi, unsigned sw_cols) {
  static_assert(kFirst + kCount <= kAccCount, "the accumulators must hold the block");
#pragma unroll
  for (int i = 0; i < kCount / 4; ++i) {
    float w0, w1;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(w0), "=f"(w1) : "r"(sw_cols + 32 * i));
    w0 = fabsf(w0);
    w1 = fabsf(w1);
    float* const a = acc + kFirst + 4 * i;
    a[0] = fma_rn(partial[4 * i + 0], mul_rn(sa_lo, w0), a[0]);
    a[1] = fma_rn(partial[4 * i + 1], mul_rn(sa_lo, w1), a[1]);
    a[2] = fma_rn(partial[4 * i + 2], mul_rn(sa_hi, w0), a[2]);
    a[3] = fma_rn(partial[4 * i + 3], mul_rn(sa_hi, w1), a[3]);
  }
}

// The scale a chunk's weight rows share, as fp32 bits, when the converters flagged them (a 128-row block
// of one reference, fp4.cuh's reference word): `sw_first` is the stage's fp32 scale of the chunk's first
// row; chunks of at most 128 rows aligned to their width lie in one block, so that row speaks for all.
// 0 (no scale of 2^ref is 0) when each row has its own.
__device__ __forceinline__ unsigned chunk_scale_bits(unsigned sw_first) {
  const unsigned bits = sm90::load_shared_u32(sw_first);
  return (bits & kFp4BlockFlag) != 0u ? bits & ~kFp4BlockFlag : 0u;
}

// A chunk's promotion: one scale per row when its weight rows share one (chunk_scale_bits' `bits`), the
// FP8 tiles' promotion; else promote_columns. Both are the CPU rule's fp32(acc + partial · fp32(sa · sw)).
template <int kFirst = 0, int kCount, int kAccCount>
__device__ __forceinline__ void promote_chunk(float (&acc)[kAccCount], const float (&partial)[kCount], float sa_lo,
                                              float sa_hi, unsigned bits, unsigned sw_cols) {
  static_assert(kCount <= 64, "a chunk of at most 128 weight rows");
  if (bits != 0u) {
    const float sw = fp32_from_bits(bits);
    sm90::promote_block<kFirst>(acc, partial, mul_rn(sa_lo, sw), mul_rn(sa_hi, sw));
  } else {
    promote_columns<kFirst>(acc, partial, sa_lo, sa_hi, sw_cols);
  }
}

}  // namespace megamoe::fp4_stage
