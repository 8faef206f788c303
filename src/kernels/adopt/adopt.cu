// Passes that take an engine's tensors into the forms megamoe's kernels read: at load, its weight
// tensors in the layouts engines hold after loading a DeepSeek-V4 checkpoint (docs/export.md,
// "prepare"; the FP4 packed rows and reference words have their own passes in fp4/fp4_convert.cu); per
// call, int64 expert ids.
//
//   megamoe_ue8m0_to_f32   UE8M0 block scales (uint8, one per 128 × 128 block) → fp32 2^(s − 127);
//                          (0xFF, E8M0's NaN, becomes a NaN)
//   megamoe_transpose_u32  u32 [rows, cols] → u32 [cols, total_rows] at column first_row: an MXFP4
//                          matrix's UE8M0 bytes [rows, K/32], read as one word per row and K block,
//                          into the GEMM's scale-word layout [K/128, rows] (fp4GemmScaleWords)
//   megamoe_ids_i64_to_i32 int64 expert ids → int32, out-of-range ids → −1 (not routed)
//
// One thread per element.
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

// A caller's int64 expert ids [T, k] as the fused kernel's int32 ids, per call (docs/export.md,
// "inputConversions"): an id outside int32's range becomes −1, an unused slot, as −1 stays.
extern "C" __global__ void __launch_bounds__(256) megamoe_ids_i64_to_i32(const long long* __restrict__ src,
                                                                        int* __restrict__ dst,
                                                                        unsigned int count) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const long long id = src[i];
  dst[i] = (id < -2147483648LL || id > 2147483647LL) ? -1 : static_cast<int>(id);
}
