// The activation scale rule, shared by every kernel that quantizes a 128-channel group to FP8.
//
// It must agree bit for bit with the CPU reference (src/numerics/quant.ts):
//   a     = max(amax, 1e-10f)
//   scale = a / 448                       (IEEE division)
//   ue8m0: scale rounded UP to a power of two (nonzero mantissa -> exponent + 1, mantissa 0)
//   inv   = 1 / scale                     (IEEE division)
//   q     = e4m3(x * inv)                 (one IEEE multiply, then SATFINITE encode)
// Each step is one correctly rounded fp32 operation done by an explicit PTX instruction (ptx.cuh),
// so the result does not depend on --use_fast_math, -ftz or FMA contraction.
#pragma once

#include "fp8.cuh"
#include "ptx.cuh"

namespace megamoe {

constexpr int kQuantGroup = 128;            // channels per activation scale
constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-10f;        // keeps an all-zero group from dividing by zero

struct GroupScale {
  float scale;  // what is stored: x ≈ q · scale
  float inv;    // what the values are multiplied by before encoding
};

// Smallest power of two >= s, for positive finite s. The scale is at least 1e-10/448, a normal
// number, so the exponent field alone carries it. Inf and NaN (from inf/NaN inputs) pass through
// unchanged rather than being carried into the sign bit.
__device__ __forceinline__ float round_up_pow2(float s) {
  const unsigned int bits = __float_as_uint(s);
  const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
  if (finite && (bits & 0x007fffffu) != 0u) {
    return __uint_as_float((bits & 0xff800000u) + 0x00800000u);
  }
  return s;
}

template <bool kUe8m0>
__device__ __forceinline__ GroupScale activation_scale(float amax) {
  const float a = fmaxf(amax, kAmaxFloor);  // exact; ftz cannot matter as the floor is normal
  float scale = div_rn(a, kE4m3Max);
  if (kUe8m0) scale = round_up_pow2(scale);
  return GroupScale{scale, rcp_rn(scale)};
}

// Quantizes eight values (one 16-byte bf16 load) to eight e4m3 codes, element 0 in the lowest byte
// of `lo`.
__device__ __forceinline__ void quantize8(const float (&x)[8], float inv, unsigned int& lo,
                                          unsigned int& hi) {
  lo = e4m3x4_from_floats(mul_rn(x[0], inv), mul_rn(x[1], inv), mul_rn(x[2], inv), mul_rn(x[3], inv));
  hi = e4m3x4_from_floats(mul_rn(x[4], inv), mul_rn(x[5], inv), mul_rn(x[6], inv), mul_rn(x[7], inv));
}

}  // namespace megamoe
