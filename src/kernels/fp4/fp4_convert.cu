// MXFP4 → e4m3 with one fp32 scale per row and 128-deep K block (docs/numerics.md, "FP4 experts"):
// the conversion of common/fp4.cuh over a whole [rows, K] matrix. The grouped GEMM converts its
// weight tiles in shared memory instead; this kernel is what test/gpu/fp4-convert.test.ts compares with
// the CPU rule (the fast path, and the exact path as a second entry point), and a way to materialize
// the FP8 form of FP4 weights on the device. A third entry point puts packed weights into the device
// layout the FP4 kernels read (fp4.cuh).
//
//   packed  uint8 [rows, K/2]     element 2j in the low nibble of byte j
//   words   u32 [rows, K/128]     each row's K block as its reference word (common/fp4.cuh
//                                 fp4_reference_word; the host's mxfp4ReferenceWords)
//   q       uint8 [rows, K]       e4m3 codes
//   sw      fp32  [rows, K/128]   2^ref
//
// One thread per (row, K block): four 16-byte loads, eight 16-byte stores.
#include "common/fp4.cuh"

namespace {

__device__ __forceinline__ void convert(const unsigned char* __restrict__ packed,
                                        const unsigned int* __restrict__ words, unsigned char* __restrict__ q,
                                        float* __restrict__ sw, unsigned int blocks) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  const unsigned int s = words[i];
  alignas(16) unsigned char in[64];
  alignas(16) unsigned char out[128];
  const uint4* src = reinterpret_cast<const uint4*>(packed + 64ull * i);
#pragma unroll
  for (int j = 0; j < 4; j++) reinterpret_cast<uint4*>(in)[j] = src[j];
  megamoe::fp4_block_to_e4m3_fast(in, s, out);
  uint4* dst = reinterpret_cast<uint4*>(q + 128ull * i);
#pragma unroll
  for (int j = 0; j < 8; j++) dst[j] = reinterpret_cast<const uint4*>(out)[j];
  sw[i] = megamoe::fp32_from_bits(megamoe::fp4_word_scale_bits(s));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128) megamoe_fp4_to_e4m3(const unsigned char* __restrict__ packed,
                                                                      const unsigned int* __restrict__ words,
                                                                      unsigned char* __restrict__ q,
                                                                      float* __restrict__ sw, unsigned int blocks) {
  convert(packed, words, q, sw, blocks);
}

// The exact path one element at a time, straight from and to global memory (a test oracle: no local
// arrays, so no stack frame).
extern "C" __global__ void __launch_bounds__(128) megamoe_fp4_to_e4m3_exact(const unsigned char* __restrict__ packed,
                                                                            const unsigned int* __restrict__ words,
                                                                            unsigned char* __restrict__ q,
                                                                            float* __restrict__ sw,
                                                                            unsigned int blocks) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  const unsigned int s = words[i];
  for (int k = 0; k < 128; k++) {
    const int d = megamoe::kFp4Top - static_cast<int>(megamoe::fp4_word_offset(s, k / megamoe::kFp4Group));
    q[128ull * i + k] = static_cast<unsigned char>(megamoe::e2m1_to_e4m3_exact(megamoe::fp4_stored_code(packed + 64ull * i, k), d));
  }
  sw[i] = megamoe::fp32_from_bits(megamoe::fp4_word_scale_bits(s));
}

// Stored rows → the device layout (fp4.cuh): `src` holds `rows` rows of K/2 bytes as stored (element 2j in
// the low nibble of byte j), written as rows first_row .. first_row + rows of `dst`, the [K/128][dst_rows]
// 64-byte blocks of a tensor in the device layout. One thread per written block, so a warp's stores are
// contiguous: four 16-byte loads of the source block, four 16-byte stores of its words (q, 0..3), each
// quarter where the layout keeps it.
extern "C" __global__ void __launch_bounds__(128) megamoe_fp4_device_layout(const unsigned char* __restrict__ src,
                                                                            unsigned char* __restrict__ dst,
                                                                            unsigned int rows,
                                                                            unsigned int k_blocks,
                                                                            unsigned int dst_rows,
                                                                            unsigned int first_row) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * k_blocks) return;
  const unsigned int kb = i / rows;
  const unsigned int n = i - kb * rows;
  alignas(16) unsigned char in[64];
  const uint4* from = reinterpret_cast<const uint4*>(src + 64ull * (static_cast<unsigned long long>(n) * k_blocks + kb));
#pragma unroll
  for (int j = 0; j < 4; j++) reinterpret_cast<uint4*>(in)[j] = from[j];
  const unsigned int row = first_row + n;
  uint4* to = reinterpret_cast<uint4*>(dst + 64ull * (static_cast<unsigned long long>(kb) * dst_rows + row));
#pragma unroll
  for (int q = 0; q < 4; q++) {
    to[megamoe::fp4_layout_quarter(static_cast<int>(row), q)] = make_uint4(megamoe::fp4_order_word(in, q, 0), megamoe::fp4_order_word(in, q, 1),
                       megamoe::fp4_order_word(in, q, 2), megamoe::fp4_order_word(in, q, 3));
  }
}

// The load-time transform of the scale words in place (docs/numerics.md, "FP4 → FP8 conversion";
// fp4GemmScaleWords is the host's): `words` u32 [k_blocks][total_rows] holds, for rows first_row ..
// first_row + rows (matrices of matrix_rows stacked rows each), a row's four UE8M0 bytes of a K block
// (group g in byte g), and receives each one's reference word (common/fp4.cuh fp4_reference_word) under
// its 128 × 128 block's largest byte R (rows 128i .. of its matrix, the last block shorter), and, unless
// null, `block_scales` fp32 [matrices, blocks per matrix, k_blocks] receives each block's 2^(R − 133) (the
// FP8 weights' scale layout). One thread per block; a load-time pass.
extern "C" __global__ void __launch_bounds__(128) megamoe_fp4_reference_words(unsigned int* __restrict__ words,
                                                                              unsigned int total_rows,
                                                                              unsigned int first_row,
                                                                              unsigned int rows,
                                                                              unsigned int matrix_rows,
                                                                              unsigned int k_blocks,
                                                                              float* __restrict__ block_scales) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned int per_matrix = (matrix_rows + 127u) / 128u;
  if (i >= rows / matrix_rows * per_matrix * k_blocks) return;
  const unsigned int kb = i % k_blocks;
  const unsigned int block = i / k_blocks;  // over all matrices
  const unsigned int matrix = block / per_matrix;
  const unsigned int r0 = first_row + matrix * matrix_rows + 128u * (block % per_matrix);
  const unsigned int r1 = min(r0 + 128u, first_row + (matrix + 1u) * matrix_rows);
  unsigned int* row = words + static_cast<unsigned long long>(kb) * total_rows;
  int hi = 0;
  for (unsigned int r = r0; r < r1; ++r) hi = max(hi, megamoe::fp4_max_byte(row[r]));
  for (unsigned int r = r0; r < r1; ++r) row[r] = megamoe::fp4_reference_word(row[r], static_cast<unsigned int>(hi));
  if (block_scales != nullptr) {
    block_scales[i] = megamoe::fp32_from_bits(megamoe::fp32_pow2_bits(hi - megamoe::kE8m0Bias - megamoe::kFp4Top));
  }
}
