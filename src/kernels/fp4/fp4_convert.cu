// MXFP4 → e4m3 with one fp32 scale per row and 128-deep K block (docs/numerics.md, "FP4 experts"):
// the conversion of common/fp4.cuh over a whole [rows, K] matrix. The grouped GEMM converts its
// weight tiles in shared memory instead; this kernel is what test/gpu/fp4-convert.test.ts compares with
// the CPU rule (the fast path, and the exact path as a second entry point), and a way to materialize
// the FP8 form of FP4 weights on the device. A third entry point puts packed weights into the device
// layout the FP4 kernels read (fp4.cuh).
//
//   packed  uint8 [rows, K/2]     element 2j in the low nibble of byte j
//   scales  uint8 [rows, K/32]    UE8M0, none 0xFF (checked on the host)
//   q       uint8 [rows, K]       e4m3 codes
//   sw      fp32  [rows, K/128]   2^ref
//
// One thread per (row, K block): four 16-byte loads, eight 16-byte stores.
#include "common/fp4.cuh"

namespace {

__device__ __forceinline__ void convert(const unsigned char* __restrict__ packed,
                                        const unsigned int* __restrict__ scales4, unsigned char* __restrict__ q,
                                        float* __restrict__ sw, unsigned int blocks) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  const unsigned int s = scales4[i];  // the block's four bytes: scales [rows, K/32] is [blocks, 4]
  alignas(16) unsigned char in[64];
  alignas(16) unsigned char out[128];
  const uint4* src = reinterpret_cast<const uint4*>(packed + 64ull * i);
#pragma unroll
  for (int j = 0; j < 4; j++) reinterpret_cast<uint4*>(in)[j] = src[j];
  const int ref = megamoe::fp4_block_to_e4m3_fast(in, s, out);
  uint4* dst = reinterpret_cast<uint4*>(q + 128ull * i);
#pragma unroll
  for (int j = 0; j < 8; j++) dst[j] = reinterpret_cast<const uint4*>(out)[j];
  sw[i] = megamoe::fp32_from_bits(megamoe::fp32_pow2_bits(ref));
}

}  // namespace

extern "C" __global__ void __launch_bounds__(128) megamoe_fp4_to_e4m3(const unsigned char* __restrict__ packed,
                                                                      const unsigned int* __restrict__ scales4,
                                                                      unsigned char* __restrict__ q,
                                                                      float* __restrict__ sw, unsigned int blocks) {
  convert(packed, scales4, q, sw, blocks);
}

// The exact path one element at a time, straight from and to global memory (a test oracle: no local
// arrays, so no stack frame).
extern "C" __global__ void __launch_bounds__(128) megamoe_fp4_to_e4m3_exact(const unsigned char* __restrict__ packed,
                                                                            const unsigned int* __restrict__ scales4,
                                                                            unsigned char* __restrict__ q,
                                                                            float* __restrict__ sw,
                                                                            unsigned int blocks) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= blocks) return;
  const unsigned int s = scales4[i];
  const int ref = megamoe::fp4_block_ref(s);
  for (int k = 0; k < 128; k++) {
    const int d = static_cast<int>((s >> (8 * (k / megamoe::kFp4Group))) & 0xffu) - megamoe::kE8m0Bias - ref;
    q[128ull * i + k] = static_cast<unsigned char>(megamoe::e2m1_to_e4m3_exact(megamoe::fp4_stored_code(packed + 64ull * i, k), d));
  }
  sw[i] = megamoe::fp4_block_scale(s);
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

// The 128 × 128 blocks' references (docs/numerics.md, "FP4 → FP8 conversion"): for the scale words of
// `rows` stacked rows, [k_blocks][rows] u32 (a row's four UE8M0 bytes of one K block, as the kernels read
// them: fp4GemmScaleWords), the block of rows 128i .. 128i + 127 (the last one shorter) and K block b
// gets its largest byte where its bytes span at most 14, else kFp4OwnReference (each row keeps its own):
// refs uint8 [ceil(rows / 128)][k_blocks]. One thread per block; a load-time pass.
extern "C" __global__ void __launch_bounds__(128) megamoe_fp4_block_references(const unsigned int* __restrict__ words,
                                                                               unsigned char* __restrict__ refs,
                                                                               unsigned int rows,
                                                                               unsigned int k_blocks) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned int block_rows = (rows + 127u) / 128u;
  if (i >= block_rows * k_blocks) return;
  const unsigned int br = i / k_blocks;
  const unsigned int kb = i - br * k_blocks;
  const unsigned int end = rows < 128u * (br + 1u) ? rows : 128u * (br + 1u);
  int lo = 255;
  int hi = 0;
  for (unsigned int r = 128u * br; r < end; ++r) {
    const unsigned int w = words[static_cast<unsigned long long>(kb) * rows + r];
    lo = min(lo, megamoe::fp4_min_byte(w));
    hi = max(hi, megamoe::fp4_max_byte(w));
  }
  refs[i] = static_cast<unsigned char>(hi - lo <= 14 ? hi : static_cast<int>(megamoe::kFp4OwnReference));
}
