// The unfused MoE pipeline's small kernels, around the grouped GEMM (gemm/fp8_grouped_gemm.cu):
//   moe_layout          routing ids -> per-expert row ranges, and the row <-> (token, slot) maps
//   moe_gather          FP8 token rows and scales -> expert-sorted rows, scales in the GEMM's layout
//   moe_transpose_scales  [T, K/128] scales -> [K/128, T_pad] (the shared expert's GEMM input)
//   moe_swiglu_quant    L1 fp32 [M, 2I] -> SwiGLU -> FP8 [M, I] + scales [I/128, M_pad]
//   moe_combine         per token: Σ_slots w · bf16(L2 row) in slot order, + shared, -> bf16
// The rules are docs/numerics.md's; sizes are run-time arguments (these kernels are memory-bound and
// small), only the scale format is compiled in.
#include "megamoe/bf16.cuh"
#include "megamoe/ptx.cuh"
#include "megamoe/quant.cuh"

#ifndef SCALE_UE8M0
#define SCALE_UE8M0 0
#endif

using namespace megamoe;

constexpr int kLayoutThreads = 1024;
constexpr int kMaxExperts = 1024;

// One CTA. Counts per expert, exclusive prefix -> group_offsets [E + 1], then each (token, slot) takes
// a row of its expert's range. The order inside a range is whatever the atomics give: rows are
// independent in every later step, so results do not depend on it.
extern "C" __global__ void __launch_bounds__(kLayoutThreads) moe_layout(const int* __restrict__ ids, int slots,
                                                                        int experts, int* __restrict__ group_offsets,
                                                                        int* __restrict__ row_source,
                                                                        int* __restrict__ slot_row) {
  __shared__ int counts[kMaxExperts];
  __shared__ int scan[kMaxExperts];
  const int tid = static_cast<int>(threadIdx.x);
  for (int e = tid; e < kMaxExperts; e += kLayoutThreads) counts[e] = 0;
  __syncthreads();
  for (int i = tid; i < slots; i += kLayoutThreads) {
    const int e = ids[i];
    if (e >= 0 && e < experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  // Inclusive Hillis-Steele scan over the (at most 1024) experts, one per thread.
  int value = tid < experts ? counts[tid] : 0;
  scan[tid] = value;
  __syncthreads();
  for (int offset = 1; offset < kLayoutThreads; offset <<= 1) {
    const int other = tid >= offset ? scan[tid - offset] : 0;
    __syncthreads();
    value += other;
    scan[tid] = value;
    __syncthreads();
  }
  if (tid < experts) {
    const int begin = value - counts[tid];
    group_offsets[tid] = begin;
    counts[tid] = begin;  // becomes the expert's cursor
  }
  if (tid == experts - 1) group_offsets[experts] = value;
  __syncthreads();
  for (int i = tid; i < slots; i += kLayoutThreads) {
    const int e = ids[i];
    if (e >= 0 && e < experts) {
      const int row = atomicAdd(&counts[e], 1);
      row_source[row] = i;
      slot_row[i] = row;
    } else {
      slot_row[i] = -1;
    }
  }
}

// One warp per sorted row: the token's FP8 row (16-byte copies) and its scales, transposed to
// [H/128, m_pad]. Rows past group_offsets[experts] belong to no expert and are left alone.
extern "C" __global__ void __launch_bounds__(256) moe_gather(const unsigned char* __restrict__ xq,
                                                             const float* __restrict__ x_scales,
                                                             const int* __restrict__ row_source,
                                                             const int* __restrict__ group_offsets, int experts,
                                                             int top_k, int hidden, int m_max, int m_pad,
                                                             unsigned char* __restrict__ aq,
                                                             float* __restrict__ a_scales) {
  const int rows = group_offsets[experts];
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int warps = static_cast<int>(gridDim.x * blockDim.x / 32u);
  const int kb = hidden / kQuantGroup;
  for (int r = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32u); r < rows && r < m_max; r += warps) {
    const int token = row_source[r] / top_k;
    const int4* src = reinterpret_cast<const int4*>(xq + static_cast<long long>(token) * hidden);
    int4* dst = reinterpret_cast<int4*>(aq + static_cast<long long>(r) * hidden);
    for (int v = lane; v < hidden / 16; v += 32) dst[v] = src[v];
    for (int b = lane; b < kb; b += 32) a_scales[static_cast<long long>(b) * m_pad + r] = x_scales[token * kb + b];
  }
}

extern "C" __global__ void __launch_bounds__(256) moe_transpose_scales(const float* __restrict__ scales, int rows,
                                                                       int blocks, int rows_pad,
                                                                       float* __restrict__ out) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= rows * blocks) return;
  const int b = i / rows;
  const int r = i - b * rows;  // consecutive threads write consecutive rows of one block's line
  out[static_cast<long long>(b) * rows_pad + r] = scales[static_cast<long long>(r) * blocks + b];
}

// One warp per (row, 128-channel group): lane j holds channels 4j..4j+3 of the group.
// h = silu(min(g, c)) · clamp(u, −c, c) in fp32 (the CPU rounds the double value once: a few ulps
// apart), then the activation quantization rule, bit for bit the CPU's for the same h.
extern "C" __global__ void __launch_bounds__(256) moe_swiglu_quant(const float* __restrict__ l1, const int* __restrict__ rows_ptr,
                                                                   int rows_fixed, int inter, int m_pad, int has_clamp,
                                                                   float clamp, unsigned char* __restrict__ hq,
                                                                   float* __restrict__ h_scales) {
  const int rows = rows_ptr != nullptr ? *rows_ptr : rows_fixed;
  const int groups = inter / kQuantGroup;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int warps = static_cast<int>(gridDim.x * blockDim.x / 32u);
  for (int w = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / 32u); w < rows * groups; w += warps) {
    const int r = w / groups;
    const int b = w - r * groups;
    const int c0 = b * kQuantGroup + lane * 4;
    const float4 g4 = *reinterpret_cast<const float4*>(l1 + static_cast<long long>(r) * 2 * inter + c0);
    const float4 u4 = *reinterpret_cast<const float4*>(l1 + static_cast<long long>(r) * 2 * inter + inter + c0);
    const float g[4] = {g4.x, g4.y, g4.z, g4.w};
    const float u[4] = {u4.x, u4.y, u4.z, u4.w};
    float h[4];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float gj = g[j];
      float uj = u[j];
      if (has_clamp) {
        gj = fminf(gj, clamp);
        uj = fminf(fmaxf(uj, -clamp), clamp);
      }
      h[j] = mul_rn(div_rn(gj, add_rn(1.0f, expf(-gj))), uj);
      amax = fmaxf(amax, fabsf(h[j]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const GroupScale s = activation_scale<SCALE_UE8M0 != 0>(amax);
    const unsigned int packed =
        e4m3x4_from_floats(mul_rn(h[0], s.inv), mul_rn(h[1], s.inv), mul_rn(h[2], s.inv), mul_rn(h[3], s.inv));
    *reinterpret_cast<unsigned int*>(hq + static_cast<long long>(r) * inter + c0) = packed;
    if (lane == 0) h_scales[static_cast<long long>(b) * m_pad + r] = s.scale;
  }
}

// One thread per (token, 8 channels). acc = Σ_s fp32(w_s · y_s) in slot order with IEEE adds, then
// + the shared expert's bf16 row, rounded once to bf16 (docs/numerics.md, "The combine").
extern "C" __global__ void __launch_bounds__(256) moe_combine(const unsigned short* __restrict__ l2,
                                                              const int* __restrict__ slot_row,
                                                              const float* __restrict__ weights,
                                                              const unsigned short* __restrict__ shared_out,
                                                              int tokens, int top_k, int hidden,
                                                              unsigned short* __restrict__ out) {
  const int per_token = hidden / 8;
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= tokens * per_token) return;
  const int t = i / per_token;
  const int c = (i - t * per_token) * 8;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < top_k; ++s) {
    const int row = slot_row[t * top_k + s];
    if (row < 0) continue;
    const float w = weights[t * top_k + s];
    const uint4 y = *reinterpret_cast<const uint4*>(l2 + static_cast<long long>(row) * hidden + c);
    const unsigned int words[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[2 * j] = add_rn(acc[2 * j], mul_rn(w, bf16x2_low_to_float(words[j])));
      acc[2 * j + 1] = add_rn(acc[2 * j + 1], mul_rn(w, bf16x2_high_to_float(words[j])));
    }
  }
  if (shared_out != nullptr) {
    const uint4 y = *reinterpret_cast<const uint4*>(shared_out + static_cast<long long>(t) * hidden + c);
    const unsigned int words[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[2 * j] = add_rn(acc[2 * j], bf16x2_low_to_float(words[j]));
      acc[2 * j + 1] = add_rn(acc[2 * j + 1], bf16x2_high_to_float(words[j]));
    }
  }
  uint4 packed;
  packed.x = bf16x2_from_floats(acc[0], acc[1]);
  packed.y = bf16x2_from_floats(acc[2], acc[3]);
  packed.z = bf16x2_from_floats(acc[4], acc[5]);
  packed.w = bf16x2_from_floats(acc[6], acc[7]);
  *reinterpret_cast<uint4*>(out + static_cast<long long>(t) * hidden + c) = packed;
}
