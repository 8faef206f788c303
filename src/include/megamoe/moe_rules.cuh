// The MoE layer's elementwise rules, shared by the unfused kernels and the fused one so that both give
// the same bits (docs/numerics.md: "SwiGLU", "The combine").
#pragma once

#include "bf16.cuh"
#include "ptx.cuh"

namespace megamoe {

// h = silu(min(g, c)) · clamp(u, −c, c) in fp32 with IEEE-rounded operations (the CPU rounds the double
// value once; expf is within 2 ulp, so h is a few ulps apart from the CPU's, the same on every kernel).
__device__ __forceinline__ float swiglu(float g, float u, bool has_clamp, float clamp) {
  if (has_clamp) {
    g = fminf(g, clamp);
    u = fminf(fmaxf(u, -clamp), clamp);
  }
  const float silu = div_rn(g, add_rn(1.0f, expf(-g)));
  return mul_rn(silu, u);
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
