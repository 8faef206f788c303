// The seeded test weights and activations made on the device, bit-identical to the CPU generator
// (src/weights/generate.ts, recipe in docs/weights.md), so GPU tests and benchmarks of flash/pro-sized
// layers never generate gigabytes on the CPU or upload them.
//
// Every value is f(seed, tensor, index) through the counter-based hash:
//   hash(stream, index) = fmix32(stream + index · 0x9E3779B9)          (uint32, mod 2^32)
//   value               = fp32((hash >> 8) − 2^23) · step               (one mul.rn)
// where `stream` = fmix32(fmix32(seed ^ 0x9E3779B9) ^ tensorKey(name)) is computed on the host by the
// same TypeScript as the CPU generator (no string hashing here) and `step` = scale · 2^-23 is exact, so
// the one rounded multiply equals the CPU's fround(uniformSym · scale). Quantization then follows
// megamoe/quant.cuh (the same rule as quantizeWeightBlocks for fp32 scales).
//
// Kernels (all sizes are runtime arguments, so one compiled image serves every shape):
//   megamoe_weightgen_matrix       block-quantized matrices, one CTA per 128×128 block
//   megamoe_weightgen_mxfp4        the same fp32 matrices quantized to MXFP4, one thread per 32-group
//   megamoe_weightgen_uniform      plain scaled uniform tensors (gate weight as bf16, bias as fp32)
//   megamoe_weightgen_activations  the bf16 activations with per-token scales and outliers
#include "common/bf16.cuh"
#include "common/ptx.cuh"
#include "common/quant.cuh"

namespace {

constexpr unsigned int kGolden = 0x9e3779b9u;  // the Weyl increment between consecutive indices
constexpr int kBlock = megamoe::kQuantGroup;   // edge of a weight-scale block

// Matrix kernel geometry: 8 threads cover a block row of 128 bytes with one 16-byte store each, 256
// threads cover 32 rows per pass, 4 passes the block. A thread keeps its 64 fp32 values in registers
// between the amax and the encode rather than hashing them twice.
constexpr int kMatrixThreads = 256;
constexpr int kColsPerThread = 16;
constexpr int kThreadsPerRow = kBlock / kColsPerThread;
constexpr int kRowsPerPass = kMatrixThreads / kThreadsPerRow;
constexpr int kPasses = kBlock / kRowsPerPass;
constexpr int kWarps = kMatrixThreads / 32;
static_assert(kPasses * kRowsPerPass == kBlock && kThreadsPerRow * kColsPerThread == kBlock, "tiling");

constexpr int kStreamThreads = 256;     // uniform and activation kernels
constexpr int kMxThreads = 256;         // MXFP4 kernel: one thread per 32-element group along a row
constexpr int kMxGroup = 32;            // elements per UE8M0 scale byte
constexpr int kMxGroupsPerBlock = kBlock / kMxGroup;  // the four bytes of one scale word
static_assert(kMxThreads % 32 == 0 && 32 % kMxGroupsPerBlock == 0, "a warp holds whole scale words");
constexpr int kActivationsPerThread = 8;  // one 16-byte store of bf16

// murmur3's 32-bit finalizer; unsigned arithmetic wraps mod 2^32 exactly as Math.imul does.
__device__ __forceinline__ unsigned int fmix32(unsigned int h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// (hash >> 8) − 2^23: the 24-bit signed count of 2^-23 steps of uniformSym, exact as an fp32.
__device__ __forceinline__ float centered24(unsigned int h) {
  return static_cast<float>(static_cast<int>(h >> 8) - 8388608);
}

// 2^e for e in the normal exponent range, built from the bits (exact, no library call).
__device__ __forceinline__ float pow2(int e) { return __uint_as_float(static_cast<unsigned int>(e + 127) << 23); }

// 16 bytes, one st.global.v4 (the destination is 16-byte aligned: rows and cols are multiples of 128).
struct alignas(16) Bytes16 {
  unsigned int w[4];
};
__device__ __forceinline__ void store16(void* ptr, unsigned int a, unsigned int b, unsigned int c, unsigned int d) {
  *static_cast<Bytes16*>(ptr) = Bytes16{{a, b, c, d}};
}

// e2m1 code (0..15) of an fp32 y with |y| ≤ 6, as fp4.ts encodeE2m1 (round to nearest, ties to even;
// |y| ≤ 0.25 is a zero of y's sign). Hopper has no cvt to e2m1, so the grid is walked by hand: its
// spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; 2y, y − 2, y − 4 and the halving are exact, so
// one rint (nearest even) per branch gives the code. Every operation is IEEE-exact, so flags cannot
// change it.
__device__ __forceinline__ unsigned int e2m1_code(float y) {
  const float a = fabsf(y);
  float m;
  if (a <= 0.25f) {
    m = 0.0f;  // 0.25 is the tie between 0 and 0.5: even is 0
  } else if (a < 2.0f) {
    m = rintf(2.0f * a);  // codes 1..4 are 0.5, 1, 1.5, 2
  } else if (a < 4.0f) {
    m = 4.0f + rintf(a - 2.0f);  // codes 4..6 are 2, 3, 4
  } else {
    m = 6.0f + rintf(fminf(a - 4.0f, 2.0f) * 0.5f);  // codes 6..7 are 4, 6 (5 ties to 4)
  }
  return static_cast<unsigned int>(m) | ((__float_as_uint(y) >> 28) & 0x8u);
}

// The UE8M0 byte of a 32-group with largest magnitude amax (fp4.ts mxfp4ScaleByte): the smallest power
// of two s with amax / s ≤ 6, i.e. the exponent field of fp32(max(amax, 6·2^-126) / 6), plus one when
// its mantissa is nonzero. The quotient is ≥ 2^-126 (normal); bytes land in [1, 253].
__device__ __forceinline__ unsigned int mxfp4_scale_byte(float amax) {
  const float q = megamoe::div_rn(fmaxf(amax, 6.0f * 1.1754943508222875e-38f), 6.0f);
  const unsigned int bits = __float_as_uint(q);
  return ((bits >> 23) & 0xffu) + ((bits & 0x7fffffu) != 0u ? 1u : 0u);
}

}  // namespace

// One CTA per 128×128 block of one matrix [rows, cols]; blockIdx.x is the block's row-major index over
// the [rows/128, cols/128] blocks, which is also where its scale goes. The host launches it once per
// matrix with q and scales pointing at that matrix's slice of the [E, rows, cols] layer tensors, and
// the matrix's two hash streams (values, block exponents) as arguments. base = fp32 sqrt(3 / (1.75·fanIn)).
extern "C" __global__ void __launch_bounds__(kMatrixThreads, 2)
    megamoe_weightgen_matrix(unsigned char* __restrict__ q, float* __restrict__ scales, unsigned int value_stream,
                             unsigned int exponent_stream, unsigned int rows, unsigned int cols, float base) {
  __shared__ float warp_amax[kWarps];

  const unsigned int block_cols = cols / kBlock;
  const unsigned int block = blockIdx.x;

  // Block magnitude 2^{-1,0,1}; folded with 2^-23 into the step (exact: powers of two on a normal base).
  const int exponent = static_cast<int>(fmix32(exponent_stream + block * kGolden) % 3u) - 1;
  const float step = megamoe::mul_rn(base, pow2(exponent - 23));

  const unsigned int row0 = (block / block_cols) * kBlock + threadIdx.x / kThreadsPerRow;
  const unsigned int col = (block % block_cols) * kBlock + (threadIdx.x % kThreadsPerRow) * kColsPerThread;

  // v[2p], v[2p + 1]: the thread's 16 columns in pass p, as the two eight-value halves quantize8 takes.
  float v[2 * kPasses][8];
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    // rows·cols ≤ 2^32, so the element index fits 32 bits; its Weyl term wraps like the CPU's.
    unsigned int weyl = value_stream + ((row0 + p * kRowsPerPass) * cols + col) * kGolden;
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      const float x = megamoe::mul_rn(centered24(fmix32(weyl)), step);
      v[2 * p + j / 8][j % 8] = x;
      amax = fmaxf(amax, fabsf(x));
      weyl += kGolden;
    }
  }

  // Block amax: max is exact, so the reduction order cannot matter.
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) amax = fmaxf(amax, warp_amax[w]);

  const megamoe::GroupScale s = megamoe::activation_scale<false>(amax);
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    unsigned int w0, w1, w2, w3;
    megamoe::quantize8(v[2 * p], s.inv, w0, w1);
    megamoe::quantize8(v[2 * p + 1], s.inv, w2, w3);
    const unsigned long long offset = static_cast<unsigned long long>(row0 + p * kRowsPerPass) * cols + col;
    store16(q + offset, w0, w1, w2, w3);
  }
  if (threadIdx.x == 0) megamoe::st_f32(scales + block, s.scale);
}

// out[i] = fp32(uniformSym(stream, i) · scale) for i < count, as bf16 (round to nearest even) when
// as_bf16 is set, else as fp32. Grid-stride; the gate weight and bias are small.
extern "C" __global__ void __launch_bounds__(kStreamThreads)
    megamoe_weightgen_uniform(void* __restrict__ out, unsigned int count, unsigned int stream, float scale,
                              int as_bf16) {
  const float step = megamoe::mul_rn(scale, pow2(-23));
  for (unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x) {
    const float x = megamoe::mul_rn(centered24(fmix32(stream + i * kGolden)), step);
    if (as_bf16) {
      static_cast<unsigned short*>(out)[i] = static_cast<unsigned short>(megamoe::bf16x2_from_floats(x, 0.0f));
    } else {
      static_cast<float*>(out)[i] = x;
    }
  }
}

// Activations x [tokens, hidden] as bf16. Token t has scale base · 2^{-2..1} (the top two bits of its
// token_stream hash); element (t, c) with h = hash(value_stream, t·hidden + c) is
// bf16(fp32(((h >> 8) − 2^23) · 2^-23 · s_t · (h & 0xFF ? 1 : 8))). Each thread makes 8 consecutive
// channels of one token (hidden is a multiple of 128) and stores them in one 16-byte store.
extern "C" __global__ void __launch_bounds__(kStreamThreads)
    megamoe_weightgen_activations(unsigned short* __restrict__ out, unsigned int tokens, unsigned int hidden,
                                  unsigned int value_stream, unsigned int token_stream, float base) {
  const unsigned int chunks_per_token = hidden / kActivationsPerThread;
  const unsigned int chunks = tokens * chunks_per_token;  // ≤ 2^29: the host keeps tokens·hidden < 2^32
  for (unsigned int g = blockIdx.x * blockDim.x + threadIdx.x; g < chunks; g += gridDim.x * blockDim.x) {
    const unsigned int t = g / chunks_per_token;
    const unsigned int first = g * kActivationsPerThread;  // = t·hidden + c
    // {0.25, 0.5, 1, 2}[top two bits] and 2^-23, folded into one exact power of two.
    const int token_exponent = static_cast<int>(fmix32(token_stream + t * kGolden) >> 30) - 2;
    const float step = megamoe::mul_rn(base, pow2(token_exponent - 23));
    const float outlier_step = megamoe::mul_rn(base, pow2(token_exponent - 20));  // 8× step
    unsigned int weyl = value_stream + first * kGolden;
    unsigned int words[kActivationsPerThread / 2];
#pragma unroll
    for (int k = 0; k < kActivationsPerThread / 2; ++k) {
      const unsigned int h0 = fmix32(weyl);
      const unsigned int h1 = fmix32(weyl + kGolden);
      weyl += 2 * kGolden;
      const float x0 = megamoe::mul_rn(centered24(h0), (h0 & 0xffu) == 0u ? outlier_step : step);
      const float x1 = megamoe::mul_rn(centered24(h1), (h1 & 0xffu) == 0u ? outlier_step : step);
      words[k] = megamoe::bf16x2_from_floats(x0, x1);
    }
    store16(out + first, words[0], words[1], words[2], words[3]);
  }
}

// The matrix of megamoe_weightgen_matrix (same values: hash, block exponent, base), quantized to MXFP4
// as fp4.ts quantizeMxfp4 does instead of to FP8. One thread per 32-element group of a row, threads
// numbered row-major over the [rows, cols/32] groups (rows·cols/32 is a multiple of 512, so every
// thread has a group): it makes its 32 values, takes the group's amax and UE8M0 byte b, encodes each
// value · 2^(127 − b) (exact: a power of two, the result ≤ 6) to e2m1 and stores the 16 packed bytes,
// element 2j in the low nibble of byte j. The four bytes of one 128-deep K block (four adjacent lanes)
// are gathered into one little-endian word, group 4kb + i in byte i, which lane 4m stores at word
//   scale_words[kb · kb_stride + row · row_stride]
// so one kernel writes either layout: the plain [rows, cols/32] bytes (kb_stride 1, row_stride
// cols/128) or the FP4 grouped GEMM's [K/128, G·N·4] (kb_stride G·N, row_stride 1, scale_words moved
// to the matrix's first row; fp4_grouped_gemm.ts fp4GemmScaleWords).
extern "C" __global__ void __launch_bounds__(kMxThreads)
    megamoe_weightgen_mxfp4(unsigned char* __restrict__ packed, unsigned int* __restrict__ scale_words,
                            unsigned int value_stream, unsigned int exponent_stream, unsigned int cols,
                            unsigned int kb_stride, unsigned int row_stride, float base) {
  const unsigned int groups_per_row = cols / kMxGroup;
  const unsigned int group = blockIdx.x * kMxThreads + threadIdx.x;  // < rows·cols/32 ≤ 2^27
  const unsigned int row = group / groups_per_row;
  const unsigned int g = group % groups_per_row;
  const unsigned int col = g * kMxGroup;
  const unsigned int kb = g / kMxGroupsPerBlock;

  // The 128×128 block's magnitude 2^{-1,0,1}, folded with 2^-23 into the step, as the FP8 kernel.
  const unsigned int block = (row / kBlock) * (cols / kBlock) + kb;
  const int exponent = static_cast<int>(fmix32(exponent_stream + block * kGolden) % 3u) - 1;
  const float step = megamoe::mul_rn(base, pow2(exponent - 23));

  float v[kMxGroup];
  float amax = 0.0f;
  unsigned int weyl = value_stream + (row * cols + col) * kGolden;  // the index wraps like the CPU's
#pragma unroll
  for (int j = 0; j < kMxGroup; ++j) {
    v[j] = megamoe::mul_rn(centered24(fmix32(weyl)), step);
    amax = fmaxf(amax, fabsf(v[j]));
    weyl += kGolden;
  }
  const unsigned int b = mxfp4_scale_byte(amax);
  const float inv = pow2(127 - static_cast<int>(b));  // 2^(127 − b), b ∈ [1, 253]: a normal fp32

  unsigned int w[kMxGroup / 8];
#pragma unroll
  for (int i = 0; i < kMxGroup / 8; ++i) {
    unsigned int word = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) word |= e2m1_code(megamoe::mul_rn(v[8 * i + k], inv)) << (4 * k);
    w[i] = word;
  }
  store16(packed + static_cast<unsigned long long>(group) * (kMxGroup / 2), w[0], w[1], w[2], w[3]);

  // Lanes 4m..4m+3 hold groups 4kb..4kb+3 of one row (cols/32 is a multiple of 4).
  const unsigned int lane = threadIdx.x % 32;
  const unsigned int first = lane & ~static_cast<unsigned int>(kMxGroupsPerBlock - 1);
  unsigned int word = 0;
#pragma unroll
  for (int i = 0; i < kMxGroupsPerBlock; ++i) word |= __shfl_sync(0xffffffffu, b, first + i) << (8 * i);
  if (lane == first) {
    scale_words[static_cast<unsigned long long>(kb) * kb_stride + static_cast<unsigned long long>(row) * row_stride] =
        word;
  }
}
