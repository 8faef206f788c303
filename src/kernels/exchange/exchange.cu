// Expert parallelism's data movement (src/parallel/expert-parallel.ts): the dispatch's row gather and the
// combine's sum over ranks. Both read or write other ranks' memory directly when the ranks sit on
// different GPUs (peer access over NVLink), so no staging copy runs between them; on one GPU the same
// kernels move rows within it.

#include "common/bf16.cuh"
#include "common/moe_rules.cuh"
#include "common/ptx.cuh"

// dst[r] = src[index[r]] for r < rows, rows of row_vecs 16-byte vectors. A thread per vector, grid-stride.
extern "C" __global__ void __launch_bounds__(256)
    megamoe_gather_rows(const megamoe::u32x4* __restrict__ src, const int* __restrict__ index,
                        megamoe::u32x4* __restrict__ dst, int rows, int row_vecs) {
  const long long total = static_cast<long long>(rows) * row_vecs;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long r = i / row_vecs;
    const long long v = i - r * row_vecs;
    megamoe::st_v4(dst + i, megamoe::ld_nc_v4(src + static_cast<long long>(index[r]) * row_vecs + v));
  }
}

// out[t, h] = bf16( f32(shared[t, h]) + Σ_{d < ranks, slot[d·tokens + t] ≥ 0} f32(partials[d][slot[d·tokens + t], h]) ),
// summed in fp32 in rank order (the CPU's combineRankOutputs). shared may be null (no shared expert).
// partials: `ranks` device pointers to bf16 [rows, hidden]. A thread per 8 channels (one 16-byte vector).
extern "C" __global__ void __launch_bounds__(256)
    megamoe_combine_ranks(const megamoe::u32x4* __restrict__ shared, const unsigned long long* __restrict__ partials,
                          const int* __restrict__ slot, megamoe::u32x4* __restrict__ out, int ranks, int tokens,
                          int hidden_vecs) {
  const long long total = static_cast<long long>(tokens) * hidden_vecs;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int t = static_cast<int>(i / hidden_vecs);
    const long long v = i - static_cast<long long>(t) * hidden_vecs;
    float acc[8];
    if (shared != nullptr) {
      const megamoe::u32x4 s = megamoe::ld_nc_v4(shared + i);
      const unsigned words[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        acc[2 * k] = megamoe::bf16x2_low_to_float(words[k]);
        acc[2 * k + 1] = megamoe::bf16x2_high_to_float(words[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
    }
    for (int d = 0; d < ranks; ++d) {
      const int row = slot[static_cast<long long>(d) * tokens + t];
      if (row < 0) continue;
      const megamoe::u32x4* p = reinterpret_cast<const megamoe::u32x4*>(partials[d]);
      megamoe::add_bf16x8(acc, megamoe::ld_nc_v4(p + static_cast<long long>(row) * hidden_vecs + v));
    }
    megamoe::st_v4(out + i, megamoe::pack_bf16x8(acc));
  }
}
