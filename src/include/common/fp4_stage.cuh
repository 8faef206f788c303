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

// One converter thread's share of a stage of kRows weight rows, 128 deep in K:
//   packed  kRows × 64 bytes, row r at packed + 64r (element 2j in the low nibble of byte j)
//   scales4 kRows u32, row r's four UE8M0 bytes (group g in byte g)
//   b_tile  kRows × 128 bytes of e4m3 in the 128-byte swizzle the TMA gives an FP8 tile (row r's 16-byte
//           chunk c at r·128 + ((c ^ (r % 8)) << 4)), as one box or several stacked 8-row-aligned boxes
//   sw      kRows fp32, row r's 2^ref
// Items are (row, group) pairs, consecutive items on consecutive threads, so the 16-byte reads of the
// packed rows and the 16-byte writes of the swizzled rows (two rows' eight chunks per quarter warp) meet
// no bank twice.
template <int kRows, int kThreads>
__device__ __forceinline__ void convert_tile(unsigned packed, unsigned scales4, unsigned b_tile, unsigned sw,
                                             int thread) {
  using namespace megamoe::sm90;
  for (int item = thread; item < kRows * 4; item += kThreads) {
    const int row = item >> 2;
    const int g = item & 3;
    unsigned s4;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(s4) : "r"(scales4 + 4 * row));
    const int ref = fp4_block_ref(s4);
    const Fp4Table t = fp4_table(static_cast<int>((s4 >> (8 * g)) & 0xffu) - kE8m0Bias - ref);
    const u32x4 in = load_shared_v4(packed + row * kPackedRowBytes + g * 16);
    unsigned o[8];
    fp4x8_to_e4m3(in.x, t, o[0], o[1]);
    fp4x8_to_e4m3(in.y, t, o[2], o[3]);
    fp4x8_to_e4m3(in.z, t, o[4], o[5]);
    fp4x8_to_e4m3(in.w, t, o[6], o[7]);
    // Row `row` of the tile, 16-byte chunks 2g and 2g + 1 (bytes 32g .. 32g + 31) at chunk ^ (row % 8).
    const unsigned row_at = b_tile + row * 128;
    const unsigned swz = static_cast<unsigned>(row & 7);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row_at + (((2u * g) ^ swz) << 4)), "r"(o[0]),
                 "r"(o[1]), "r"(o[2]), "r"(o[3])
                 : "memory");
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row_at + (((2u * g + 1u) ^ swz) << 4)), "r"(o[4]),
                 "r"(o[5]), "r"(o[6]), "r"(o[7])
                 : "memory");
    if (g == 0) store_shared_u32(sw + kRowWordBytes * row, fp32_pow2_bits(ref));
  }
}

// acc += partial · (sa · sw[column]) for an m64 × nN wgmma fragment whose weight rows are its columns,
// the three steps rounded separately as the CPU rule does. sw_cols is the shared address of the fp32
// scale of this thread's first column (frag_col of the chunk); element pair i covers columns
// 8i + frag_col + {0, 1}, on rows frag_row (sa_lo) and + 8 (sa_hi). kFirst as sm90::promote_block's.
template <int kFirst = 0, int kCount, int kAccCount>
__device__ __forceinline__ void promote_columns(float (&acc)[kAccCount], const float (&partial)[kCount], float sa_lo,
                                                float sa_hi, unsigned sw_cols) {
  static_assert(kFirst + kCount <= kAccCount, "the accumulators must hold the block");
#pragma unroll
  for (int i = 0; i < kCount / 4; ++i) {
    float w0, w1;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(w0), "=f"(w1) : "r"(sw_cols + 32 * i));
    float* const a = acc + kFirst + 4 * i;
    a[0] = add_rn(a[0], mul_rn(partial[4 * i + 0], mul_rn(sa_lo, w0)));
    a[1] = add_rn(a[1], mul_rn(partial[4 * i + 1], mul_rn(sa_lo, w1)));
    a[2] = add_rn(a[2], mul_rn(partial[4 * i + 2], mul_rn(sa_hi, w0)));
    a[3] = add_rn(a[3], mul_rn(partial[4 * i + 3], mul_rn(sa_hi, w1)));
  }
}

}  // namespace megamoe::fp4_stage
