// The MoE layer's elementwise rules, shared by the unfused kernels and the fused one so that both give
// the same bits (docs/numerics.md: "SwiGLU", "The combine").
#pragma once

#include "bf16.cuh"
#include "ptx.cuh"

namespace megamoe {

// h = silu(min(g, c)) · clamp(u, −c, c) in fp32 (the CPU rounds the double value once). expf is within
// 2 ulp and the sigmoid's reciprocal within 1: h is a few ulps from the CPU's, the same on every kernel.
// The reciprocal is the hardware's approximation, not a division: an IEEE division is a Newton step and
// a branch to a slow path per element, and the L1 epilogue does 64 of them per thread while the tensor
// cores wait. Branch-free (the clamp is a select) so that the unrolled loop stays one basic block.
__device__ __forceinline__ float swiglu(float g, float u, bool has_clamp, float clamp) {
  const float gc = has_clamp ? fminf(g, clamp) : g;
  const float uc = has_clamp ? fminf(fmaxf(u, -clamp), clamp) : u;
  const float sigmoid = rcp_approx_ftz(add_rn(1.0f, expf(-gc)));
  return mul_rn(mul_rn(gc, sigmoid), uc);
}

// acc[2q], acc[2q+1] += w · (the two bf16 values of words[q]), each product and sum IEEE-rounded, in
// channel order: one slot's contribution to eight output channels.
__device__ __forceinline__ void add_weighted_bf16x8(float (&acc)[8], const u32x4& y, float w) {
  const unsigned int words[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] = add_rn(acc[2 * q], mul_rn(w, bf16x2_low_to_float(words[q])));
    acc[2 * q + 1] = add_rn(acc[2 * q + 1], mul_rn(w, bf16x2_high_to_float(words[q])));
  }
}

// acc += the eight bf16 values (the shared expert's row: weight 1, no multiply).
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const u32x4& y) {
  const unsigned int words[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    acc[2 * q] = add_rn(acc[2 * q], bf16x2_low_to_float(words[q]));
    acc[2 * q + 1] = add_rn(acc[2 * q + 1], bf16x2_high_to_float(words[q]));
  }
}

__device__ __forceinline__ u32x4 pack_bf16x8(const float (&acc)[8]) {
  return u32x4{bf16x2_from_floats(acc[0], acc[1]), bf16x2_from_floats(acc[2], acc[3]),
               bf16x2_from_floats(acc[4], acc[5]), bf16x2_from_floats(acc[6], acc[7])};
}

}  // namespace megamoe
