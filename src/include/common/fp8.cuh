// FP8 e4m3fn encoding, bit-identical to cuda_fp8.h's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) on sm_89+.
//
// cuda_fp8.hpp implements that intrinsic on sm_89+ with exactly this instruction,
// `cvt.rn.satfinite.e4m3x2.f32` (the scalar form converts the pair (0, x) and keeps the low byte),
// so wrapping the instruction reproduces it without including the header (NVRTC needs no include
// path). Per the PTX ISA: round to nearest even; .satfinite turns a finite or infinite value whose
// magnitude exceeds 448 into ±448 (0x7E/0xFE); NaN becomes the e4m3 NaN. The host fallback in
// cuda_fp8.hpp agrees (canonical NaN 0x7F, inf -> ±448, values at or below 2^-10 -> signed zero);
// test/gpu/quant.test.ts checks the device against the CPU encoder, NaN and inf included.
#pragma once

namespace megamoe {

// Packs two values: `lo` goes to the low byte (the lower address in memory), `hi` to the high byte.
// PTX puts the first source operand in the upper half of the result, hence the operand order.
__device__ __forceinline__ unsigned short e4m3x2_from_floats(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ unsigned char e4m3_from_float(float x) {
  return static_cast<unsigned char>(e4m3x2_from_floats(x, 0.0f) & 0xffu);
}

// Four values into one 32-bit word, element 0 in the lowest byte.
__device__ __forceinline__ unsigned int e4m3x4_from_floats(float a, float b, float c, float d) {
  const unsigned int lo = e4m3x2_from_floats(a, b);
  const unsigned int hi = e4m3x2_from_floats(c, d);
  return lo | (hi << 16);
}

}  // namespace megamoe
