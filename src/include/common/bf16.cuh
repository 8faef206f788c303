// bf16 held as raw 16-bit patterns (the CPU reference holds them in a Uint16Array).
#pragma once

namespace megamoe {

// bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits.
__device__ __forceinline__ float bf16_bits_to_float(unsigned short bits) {
  return __uint_as_float(static_cast<unsigned int>(bits) << 16);
}

// The two bf16 values packed in one 32-bit word; element 0 sits in the low half (little endian).
__device__ __forceinline__ float bf16x2_low_to_float(unsigned int word) { return __uint_as_float(word << 16); }
__device__ __forceinline__ float bf16x2_high_to_float(unsigned int word) {
  return __uint_as_float(word & 0xffff0000u);
}

// Two fp32 values to packed bf16, round to nearest even (NaN stays NaN), element `lo` in the low half.
__device__ __forceinline__ unsigned int bf16x2_from_floats(float lo, float hi) {
  unsigned int packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));  // first source -> high half
  return packed;
}

}  // namespace megamoe
