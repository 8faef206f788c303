// FP4 (MXFP4) weight tiles in shared memory, for the kernels whose B operand arrives packed: the
// converters' pass over a stage (packed nibbles and reference words → the e4m3 tile wgmma reads). The
// grouped GEMM (B_FP4 1) and the fused kernel (B_FP4 1) both use it, so their products are the same bits;
// both promote with each 128 × 128 block's scale 2^ref (the GEMM reads it from the block's first
// reference word, the fused kernel gets it with the task, as an FP8 block scale).
// docs/numerics.md "FP4 experts (MXFP4)" is the rule; fp4.cuh holds the element conversion.
#pragma once

#include "fp4.cuh"
#include "ptx.cuh"
#include "sm90.cuh"

namespace megamoe::fp4_stage {

// Bytes of one stage's packed rows and of its per-row reference words.
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
};

// One converter thread's share of a stage of kRows weight rows, 128 deep in K:
//   packed  kRows × 64 bytes in the device order (fp4.cuh), 64B-swizzled from a 512-aligned base
//   ref_words kRows u32, row r's reference word (fp4.cuh fp4_reference_word)
//   b_tile  kRows × 128 bytes of e4m3 in the 128-byte swizzle the TMA gives an FP8 tile (row r's 16-byte
//           chunk c at r·128 + ((c ^ (r % 8)) << 4)), as one box or several stacked 8-row-aligned boxes
// fp4.cuh fp4_stage_convert is the work (items, banks, the load window; the host test runs it too).
// kDepth items per thread are loaded ahead: two hold 18 registers, within the 56 the producer warpgroup
// keeps (three spill there).
template <int kRows, int kThreads, int kDepth = 2>
__device__ __forceinline__ void convert_tile(unsigned packed, unsigned ref_words, unsigned b_tile, int thread) {
  SharedMem mem;
  fp4_stage_convert<kRows, kThreads, kDepth>(mem, packed, ref_words, b_tile, thread);
}

}  // namespace megamoe::fp4_stage
