// Test-only probe of megamoe/fp8.cuh: encodes arbitrary fp32 bit patterns to e4m3 on the device so
// test/gpu/quant.test.ts can compare the hardware conversion with the CPU encoder (src/numerics/fp8.ts)
// on values the quantizer never produces (NaN, ±inf, ties, subnormals). Each thread encodes one
// pair both ways: with the scalar helper and with the packed two-value helper, which also checks
// the byte order of the packed form.
#include "common/fp8.cuh"

extern "C" __global__ void megamoe_e4m3_probe(const float* __restrict__ x, unsigned char* __restrict__ scalar_codes,
                                              unsigned short* __restrict__ pair_codes, unsigned int pairs) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= pairs) return;
  const float a = x[2 * i];
  const float b = x[2 * i + 1];
  scalar_codes[2 * i] = megamoe::e4m3_from_float(a);
  scalar_codes[2 * i + 1] = megamoe::e4m3_from_float(b);
  pair_codes[i] = megamoe::e4m3x2_from_floats(a, b);
}
