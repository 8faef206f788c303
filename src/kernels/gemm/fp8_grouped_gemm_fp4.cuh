// The FP4 build of the grouped GEMM (B_FP4 1): the converters' share of a stage and the per-column
// promotion. Included by fp8_grouped_gemm.cu after its config; see that file's header for the roles.
#pragma once

#include "fp8_grouped_gemm_config.cuh"
#include "common/fp4.cuh"

namespace {

// FP4 promotion: acc += partial · (sa · sw[column]), the three steps rounded separately as the CPU rule
// does. sw_cols is the shared address of the fp32 scale of this thread's first column (frag_col of the
// chunk); element pair i covers columns 8i + frag_col + {0, 1}, on rows frag_row (sa_lo) and + 8 (sa_hi).
template <int kCount, int kAccCount>
__device__ __forceinline__ void promote_block_columns(float (&acc)[kAccCount], const float (&partial)[kCount],
                                                      float sa_lo, float sa_hi, unsigned sw_cols) {
  static_assert(kCount <= kAccCount, "the accumulators must hold the block");
  using megamoe::add_rn;
  using megamoe::mul_rn;
#pragma unroll
  for (int i = 0; i < kCount / 4; ++i) {
    float w0, w1;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(w0), "=f"(w1) : "r"(sw_cols + 32 * i));
    acc[4 * i + 0] = add_rn(acc[4 * i + 0], mul_rn(partial[4 * i + 0], mul_rn(sa_lo, w0)));
    acc[4 * i + 1] = add_rn(acc[4 * i + 1], mul_rn(partial[4 * i + 1], mul_rn(sa_lo, w1)));
    acc[4 * i + 2] = add_rn(acc[4 * i + 2], mul_rn(partial[4 * i + 2], mul_rn(sa_hi, w0)));
    acc[4 * i + 3] = add_rn(acc[4 * i + 3], mul_rn(partial[4 * i + 3], mul_rn(sa_hi, w1)));
  }
}

// One converter thread's share of a stage: (row, group) items of the B tile, consecutive items on
// consecutive threads, so the 16-byte reads of the packed rows and the 16-byte writes of the swizzled
// e4m3 rows (two rows' eight chunks per quarter warp) meet no bank twice.
__device__ __forceinline__ void convert_fp4_stage(unsigned packed, unsigned scales4, unsigned b_tile,
                                                  unsigned sw_cols, int thread) {
  for (int item = thread; item < kBlockN * 4; item += kConverterThreads) {
    const int row = item >> 2;
    const int g = item & 3;
    unsigned s4;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(s4) : "r"(scales4 + 4 * row));
    const int ref = megamoe::fp4_block_ref(s4);
    const megamoe::Fp4Table t =
        megamoe::fp4_table(static_cast<int>((s4 >> (8 * g)) & 0xffu) - megamoe::kE8m0Bias - ref);
    const megamoe::u32x4 in = load_shared_v4(packed + row * 64 + g * 16);
    unsigned o[8];
    megamoe::fp4x8_to_e4m3(in.x, t, o[0], o[1]);
    megamoe::fp4x8_to_e4m3(in.y, t, o[2], o[3]);
    megamoe::fp4x8_to_e4m3(in.z, t, o[4], o[5]);
    megamoe::fp4x8_to_e4m3(in.w, t, o[6], o[7]);
    // Row `row` of the tile, 16-byte chunks 2g and 2g + 1 (bytes 32g .. 32g + 31) at chunk ^ (row % 8).
    const unsigned row_at = b_tile + row * 128;
    const unsigned swz = static_cast<unsigned>(row & 7);
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row_at + (((2u * g) ^ swz) << 4)), "r"(o[0]),
                 "r"(o[1]), "r"(o[2]), "r"(o[3])
                 : "memory");
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row_at + (((2u * g + 1u) ^ swz) << 4)), "r"(o[4]),
                 "r"(o[5]), "r"(o[6]), "r"(o[7])
                 : "memory");
    if (g == 0) store_shared_u32(sw_cols + 4 * row, megamoe::fp32_pow2_bits(ref));
  }
}

}  // namespace
