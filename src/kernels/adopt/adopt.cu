// Load-time passes that take an engine's weight tensors, in the layouts engines hold after loading a
// DeepSeek-V4 checkpoint, into the layouts megamoe's kernels read (docs/export.md, "prepare"); the
// FP4 packed rows and reference words have their own passes in fp4/fp4_convert.cu.
//
//   megamoe_ue8m0_to_f32   UE8M0 block scales (uint8, one per 128 × 128 block) → fp32 2^(s − 127);
//                          the NaN code 0xFF becomes a NaN, which the kernels' scale checks reject
//   megamoe_transpose_u32  u32 [rows, cols] → u32 [cols, total_rows] at column first_row: an MXFP4
//                          matrix's UE8M0 bytes [rows, K/32], read as one word per row and K block,
//                          into the GEMM's scale-word layout [K/128, rows] (fp4GemmScaleWords)
//
// One thread per element; memory-bound, once per layer.
extern "C" __global__ void __launch_bounds__(256) megamoe_ue8m0_to_f32(const unsigned char* __restrict__ src,
                                                                      float* __restrict__ dst,
                                                                      unsigned int count) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const unsigned int s = src[i];
  // 0 is 2^-127, a subnormal fp32: its bits are 1 << 22; 0xFF is NaN.
  const unsigned int bits = s == 0xFFu ? 0x7FC00000u : (s == 0u ? 0x00400000u : s << 23);
  dst[i] = __uint_as_float(bits);
}

extern "C" __global__ void __launch_bounds__(256) megamoe_transpose_u32(const unsigned int* __restrict__ src,
                                                                       unsigned int* __restrict__ dst,
                                                                       unsigned int rows,
                                                                       unsigned int cols,
                                                                       unsigned int total_rows,
                                                                       unsigned int first_row) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  // Consecutive threads write consecutive rows of one column (the output's contiguous dimension).
  const unsigned int c = i / rows;
  const unsigned int r = i - c * rows;
  dst[static_cast<unsigned long long>(c) * total_rows + first_row + r] =
      src[static_cast<unsigned long long>(r) * cols + c];
}
