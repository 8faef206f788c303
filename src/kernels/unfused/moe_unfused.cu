// The unfused MoE pipeline's small kernels, around the grouped GEMM (gemm/fp8_grouped_gemm.cu):
//   moe_layout         routing ids -> per-expert row ranges, and the row <-> (token, slot) maps
//   moe_gather         FP8 token rows + scales -> expert-sorted rows, scales in the GEMM's [K/128, M_pad]
//                      layout (also the scales-only transpose of the unsorted rows for the shared expert)
//   moe_swiglu_quant   L1 fp32 [M, 2I] -> SwiGLU -> FP8 [M, I] + scales [I/128, M_pad]
//   moe_combine        per token: Σ_slots w · bf16(L2 row) in slot order, + shared, -> bf16
// The rules are docs/numerics.md's. Sizes are run-time arguments (the kernels are memory-bound and
// small); only the scale format is compiled in (-D SCALE_UE8M0=0|1, used by moe_swiglu_quant).
//
// Rows are sized by an upper bound (T·k) on the host so nothing waits for the device: the real row
// count is group_offsets[E], read by each kernel on the device, and rows past it are never touched.
#include "common/bf16.cuh"
#include "common/moe_rules.cuh"
#include "common/ptx.cuh"
#include "common/quant.cuh"

#ifndef SCALE_UE8M0
#define SCALE_UE8M0 0
#endif
static_assert(SCALE_UE8M0 == 0 || SCALE_UE8M0 == 1, "SCALE_UE8M0 must be 0 or 1");

namespace {

using megamoe::u32x4;

constexpr int kLayoutThreads = 1024;
constexpr int kMaxExperts = kLayoutThreads;  // one scan element per thread
constexpr int kGatherRows = 32;              // sorted rows per gather block
constexpr int kGatherThreads = 256;
constexpr int kGatherWarps = kGatherThreads / 32;
constexpr int kCopyUnroll = 4;               // 16-byte loads in flight per lane while copying a row
constexpr int kSwigluThreads = 256;
constexpr int kCombineThreads = 256;
constexpr int kSlotsInFlight = 4;            // L2 rows a combine thread loads before adding them

__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += other;
  }
  return v;
}

__device__ __forceinline__ int rows_in_use(const int* rows_ptr, int m_max) {
  if (rows_ptr == nullptr) return m_max;
  const int rows = *rows_ptr;
  return rows < m_max ? rows : m_max;
}

}  // namespace

// One CTA of 1024 threads (experts ≤ 1024, one per thread in the scan). Counts per expert, exclusive
// prefix -> group_offsets [E + 1] (group_offsets[E] = M, the routed row count), then each routed
// (token, slot) takes a row of its expert's range: row_source[row] = token·k + slot, slot_row[token·k +
// slot] = row, and slot_row = −1 for a slot whose id is outside [0, E) (−1: not routed). The order inside
// a range is whatever the shared-memory atomics give: rows are independent in every later step, so
// results do not depend on it. shared_offsets (may be null) gets {0, tokens}: the shared expert's one
// group, written here so that a forward never needs a host copy (CUDA-graph capturable).
extern "C" __global__ void __launch_bounds__(kLayoutThreads)
    moe_layout(const int* __restrict__ ids, int tokens, int top_k, int experts, int* __restrict__ group_offsets,
               int* __restrict__ row_source, int* __restrict__ slot_row, int* __restrict__ shared_offsets) {
  __shared__ int cursor[kMaxExperts];
  __shared__ int warp_totals[kLayoutThreads / 32];
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int slots = tokens * top_k;

  cursor[tid] = 0;
  __syncthreads();
  for (int i = tid; i < slots; i += kLayoutThreads) {
    const int e = ids[i];
    if (e >= 0 && e < experts) atomicAdd(&cursor[e], 1);
  }
  __syncthreads();

  // Exclusive prefix over the counts: warp scans, then a scan of the 32 warp totals.
  const int count = cursor[tid];  // 0 past the last expert
  const int inclusive = warp_inclusive_sum(count, lane);
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) warp_totals[lane] = warp_inclusive_sum(warp_totals[lane], lane);
  __syncthreads();
  const int begin = inclusive - count + (warp > 0 ? warp_totals[warp - 1] : 0);
  if (tid < experts) group_offsets[tid] = begin;
  if (tid == experts - 1) group_offsets[experts] = begin + count;
  if (tid == 0 && shared_offsets != nullptr) {
    shared_offsets[0] = 0;
    shared_offsets[1] = tokens;
  }
  cursor[tid] = begin;  // each thread rewrites only the entry it read: no hazard
  __syncthreads();

  // Same i -> thread mapping as the counting pass; ids are re-read (L2-hot) rather than kept.
  for (int i = tid; i < slots; i += kLayoutThreads) {
    const int e = ids[i];
    if (e >= 0 && e < experts) {
      const int row = atomicAdd(&cursor[e], 1);
      row_source[row] = i;
      slot_row[i] = row;
    } else {
      slot_row[i] = -1;
    }
  }
}

// One block per kGatherRows consecutive destination rows. Destination row r reads token
// row_source[r] / top_k (row_source null: token r). With aq non-null the token's FP8 row is copied
// (16-byte vectors); its H/128 scales always go to a_scales[b · m_pad + r], transposed through shared
// memory 32 columns at a time so that both the reads (one token's scales) and the writes (one scale
// block of 32 consecutive rows) are coalesced. Rows at or past *rows_ptr (null: m_max) are left alone.
extern "C" __global__ void __launch_bounds__(kGatherThreads)
    moe_gather(const unsigned char* __restrict__ xq, const float* __restrict__ x_scales,
               const int* __restrict__ row_source, const int* __restrict__ rows_ptr, int top_k, int hidden, int m_max,
               int m_pad, unsigned char* __restrict__ aq, float* __restrict__ a_scales) {
  __shared__ int token_of[kGatherRows];
  __shared__ float tile[kGatherRows][33];  // 33: a column walk hits 32 different banks
  const int rows = rows_in_use(rows_ptr, m_max);
  const int r0 = static_cast<int>(blockIdx.x) * kGatherRows;
  if (r0 >= rows) return;  // block-uniform
  const int n = rows - r0 < kGatherRows ? rows - r0 : kGatherRows;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  if (tid < n) token_of[tid] = row_source != nullptr ? row_source[r0 + tid] / top_k : r0 + tid;
  __syncthreads();

  if (aq != nullptr) {
    const int vectors = hidden / 16;
    for (int i = warp; i < n; i += kGatherWarps) {
      const unsigned char* src = xq + static_cast<long long>(token_of[i]) * hidden;
      unsigned char* dst = aq + static_cast<long long>(r0 + i) * hidden;
      for (int v0 = lane; v0 < vectors; v0 += 32 * kCopyUnroll) {
        u32x4 chunk[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int v = v0 + 32 * u;
          if (v < vectors) chunk[u] = megamoe::ld_nc_v4(src + 16 * v);
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int v = v0 + 32 * u;
          if (v < vectors) megamoe::st_v4(dst + 16 * v, chunk[u]);
        }
      }
    }
  }

  const int kb = hidden / megamoe::kQuantGroup;
  for (int b0 = 0; b0 < kb; b0 += 32) {
    for (int i = warp; i < n; i += kGatherWarps) {
      if (b0 + lane < kb) tile[i][lane] = x_scales[static_cast<long long>(token_of[i]) * kb + b0 + lane];
    }
    __syncthreads();
    for (int j = warp; j < 32 && b0 + j < kb; j += kGatherWarps) {
      if (lane < n) a_scales[static_cast<long long>(b0 + j) * m_pad + r0 + lane] = tile[lane][j];
    }
    __syncthreads();
  }
}

// One warp per (row, 128-channel group); lane j holds channels 4j .. 4j+3 of the group. Warps walk the
// rows fastest, so the scale stores of neighbouring warps land side by side in [I/128, m_pad].
// h = megamoe::swiglu (moe_rules.cuh), then the activation quantization rule of quant.cuh, bit for bit
// the CPU's for the same h. Rows at or past *rows_ptr (null: m_max) are skipped.
extern "C" __global__ void __launch_bounds__(kSwigluThreads)
    moe_swiglu_quant(const float* __restrict__ l1, const int* __restrict__ rows_ptr, int m_max, int inter,
                     int m_pad, int has_clamp, float clamp, unsigned char* __restrict__ hq,
                     float* __restrict__ h_scales) {
  const int rows = rows_in_use(rows_ptr, m_max);
  const int groups = inter / megamoe::kQuantGroup;
  const long long work = static_cast<long long>(rows) * groups;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const long long warps = static_cast<long long>(gridDim.x) * (blockDim.x / 32u);
  for (long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < work; w += warps) {
    const int b = static_cast<int>(w / rows);
    const int r = static_cast<int>(w - static_cast<long long>(b) * rows);
    const int c0 = b * megamoe::kQuantGroup + lane * 4;
    const float* row = l1 + static_cast<long long>(r) * 2 * inter;
    const u32x4 g4 = megamoe::ld_nc_v4(row + c0);
    const u32x4 u4 = megamoe::ld_nc_v4(row + inter + c0);
    const float g[4] = {__uint_as_float(g4.x), __uint_as_float(g4.y), __uint_as_float(g4.z), __uint_as_float(g4.w)};
    const float u[4] = {__uint_as_float(u4.x), __uint_as_float(u4.y), __uint_as_float(u4.z), __uint_as_float(u4.w)};
    float h[4];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      h[j] = megamoe::swiglu(g[j], u[j], has_clamp != 0, clamp);
      amax = fmaxf(amax, fabsf(h[j]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    const megamoe::GroupScale s = megamoe::activation_scale<SCALE_UE8M0 != 0>(amax);
    const unsigned int packed = megamoe::e4m3x4_from_floats(megamoe::mul_rn(h[0], s.inv), megamoe::mul_rn(h[1], s.inv),
                                                            megamoe::mul_rn(h[2], s.inv), megamoe::mul_rn(h[3], s.inv));
    *reinterpret_cast<unsigned int*>(hq + static_cast<long long>(r) * inter + c0) = packed;
    if (lane == 0) megamoe::st_f32(h_scales + static_cast<long long>(b) * m_pad + r, s.scale);
  }
}

// One thread per (token, 8 channels). acc = 0; for each slot in order whose row is not −1,
// acc = fp32(acc + fp32(w · y)) with y the bf16 L2 value; then acc = fp32(acc + shared y) when
// shared_out is non-null; out = bf16(acc), round to nearest even (docs/numerics.md, "The combine").
// kSlotsInFlight rows are loaded before any is added, so the loads overlap; the adds keep slot order.
extern "C" __global__ void __launch_bounds__(kCombineThreads)
    moe_combine(const unsigned short* __restrict__ l2, const int* __restrict__ slot_row,
                const float* __restrict__ weights, const unsigned short* __restrict__ shared_out, int tokens,
                int top_k, int hidden, unsigned short* __restrict__ out) {
  const int per_token = hidden / 8;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(tokens) * per_token) return;
  const int t = static_cast<int>(i / per_token);
  const int c = static_cast<int>(i - static_cast<long long>(t) * per_token) * 8;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int s0 = 0; s0 < top_k; s0 += kSlotsInFlight) {
    int row[kSlotsInFlight];
    float w[kSlotsInFlight];
    u32x4 y[kSlotsInFlight];
#pragma unroll
    for (int j = 0; j < kSlotsInFlight; ++j) {
      const int s = s0 + j;
      row[j] = s < top_k ? slot_row[t * top_k + s] : -1;
      w[j] = row[j] >= 0 ? weights[t * top_k + s] : 0.0f;
      y[j] = row[j] >= 0 ? megamoe::ld_nc_v4(l2 + static_cast<long long>(row[j]) * hidden + c) : u32x4{0u, 0u, 0u, 0u};
    }
#pragma unroll
    for (int j = 0; j < kSlotsInFlight; ++j) {
      if (row[j] >= 0) megamoe::add_weighted_bf16x8(acc, y[j], w[j]);
    }
  }
  if (shared_out != nullptr) {
    megamoe::add_bf16x8(acc, megamoe::ld_nc_v4(shared_out + static_cast<long long>(t) * hidden + c));
  }
  const u32x4 packed = megamoe::pack_bf16x8(acc);
  megamoe::st_v4(out + static_cast<long long>(t) * hidden + c, packed);
}
