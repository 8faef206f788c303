// The boundary kernel before the MoE: RMSNorm of bf16 rows [T, H], optionally preceded by the
// hyper-connection pre-mix of n residual streams [T, n, H] with per-token weights [T, n]; writes the
// bf16 rows (optional) and, optionally, their FP8 e4m3 codes [T, H] with per-128 scales [T, H/128]
// (the layout and the bits of quant.cu run on the bf16 rows).
//
// Numerics (docs/numerics.md, "RMSNorm and the pre-mix"; CPU: src/reference/norm.ts). One warp owns
// a token (megamoe_rmsnorm_wide, below, spreads a token's loads over a block and keeps this order).
// Lane l owns the 8-channel vectors v = l, l + 32, l + 64, … (one 16-byte bf16 load each), so a step
// of the warp covers 256 contiguous channels and each half-warp one 128-channel quantization group.
//   pre-mix   x = add_rn(… add_rn(add_rn(0, mul_rn(w0, s0)), mul_rn(w1, s1)) …)
//   squares   each lane sums mul_rn(x, x) over its channels in increasing order (add_rn), then an xor
//             butterfly over offsets 16, 8, 4, 2, 1 (commutative adds: every lane ends with the same sum)
//   r         div_rn(1, sqrt_rn(add_rn(div_rn(ss, H), eps)))
//   y         bf16(mul_rn(mul_rn(x, r), weight))
// The row is read twice (the second time from L1/L2): the first pass sums the squares, the second
// normalizes, each in batches of kBatch steps whose loads are in flight together. With the pre-mix the
// second pass recomputes x from the streams, bit-identically.
//
// Compile-time parameters:
//   HIDDEN       channels per token (multiple of 128)
//   SCALE_UE8M0  1: FP8 scales rounded up to powers of two; 0: plain FP32 scales
#include "common/bf16.cuh"
#include "common/ptx.cuh"
#include "common/quant.cuh"

#ifndef HIDDEN
#define HIDDEN 7168
#endif
#ifndef SCALE_UE8M0
#define SCALE_UE8M0 0
#endif

static_assert(HIDDEN > 0 && HIDDEN % megamoe::kQuantGroup == 0, "HIDDEN must be a positive multiple of 128");
static_assert(SCALE_UE8M0 == 0 || SCALE_UE8M0 == 1, "SCALE_UE8M0 must be 0 or 1");

namespace {

constexpr int kVector = 8;                             // bf16 channels per 16-byte load
constexpr int kVectors = HIDDEN / kVector;             // per row
constexpr int kSteps = (kVectors + 31) / 32;           // warp steps per row (the last may be half)
constexpr int kThreads = 128;                          // 4 tokens per block
constexpr int kBatch = kSteps < 8 ? kSteps : 8;        // steps whose loads are in flight together

__device__ __forceinline__ float sqrt_rn(float x) {
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ megamoe::u32x4 ld_v4(const void* p) {
  return *static_cast<const megamoe::u32x4*>(p);
}

__device__ __forceinline__ void unpack8(const megamoe::u32x4& v, float (&f)[8]) {
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = megamoe::bf16x2_low_to_float(w[k]);
    f[2 * k + 1] = megamoe::bf16x2_high_to_float(w[k]);
  }
}

// The fp32 input values of vector `v` of token `t` as the pre-mix of its n streams.
__device__ __forceinline__ void premix_x(const unsigned char* streams, const float* mix, unsigned int n,
                                         unsigned int t, unsigned int v, float (&f)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = 0.0f;
  for (unsigned int j = 0; j < n; ++j) {
    const float w = mix[static_cast<unsigned long long>(t) * n + j];
    float s[8];
    unpack8(ld_v4(streams + ((static_cast<unsigned long long>(t) * n + j) * HIDDEN + v * kVector) * 2u), s);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = megamoe::add_rn(f[k], megamoe::mul_rn(w, s[k]));
  }
}

// Lane `lane`'s vector of step i, and whether the row has it (the last step may be half).
__device__ __forceinline__ unsigned int step_vector(int i, unsigned int lane) { return i * 32u + lane; }
__device__ __forceinline__ bool in_row(int i, unsigned int lane) { return i < kSteps && step_vector(i, lane) < kVectors; }

// Steps i0 … i0 + kCount − 1 of token t's input (those within the row) into f: the bf16 row (n = 0), its
// loads issued together, or the pre-mix of the n streams.
template <int kCount>
__device__ __forceinline__ void load_batch(const unsigned char* x, const unsigned char* streams, const float* mix,
                                           unsigned int n, unsigned int t, unsigned int lane, int i0,
                                           float (&f)[kCount][8]) {
  if (n == 0) {
    megamoe::u32x4 raw[kCount];
#pragma unroll
    for (int b = 0; b < kCount; ++b) {
      if (in_row(i0 + b, lane)) {
        raw[b] = ld_v4(x + (static_cast<unsigned long long>(t) * HIDDEN + step_vector(i0 + b, lane) * kVector) * 2u);
      }
    }
#pragma unroll
    for (int b = 0; b < kCount; ++b) {
      if (in_row(i0 + b, lane)) unpack8(raw[b], f[b]);
    }
    return;
  }
#pragma unroll
  for (int b = 0; b < kCount; ++b) {
    if (in_row(i0 + b, lane)) premix_x(streams, mix, n, t, step_vector(i0 + b, lane), f[b]);
  }
}

// The weight's vectors of steps i0 … i0 + kCount − 1 that lane `lane` owns (those within the row).
template <int kCount>
__device__ __forceinline__ void load_weights(const unsigned char* weight, unsigned int lane, int i0,
                                             megamoe::u32x4 (&wv)[kCount]) {
#pragma unroll
  for (int b = 0; b < kCount; ++b) {
    if (in_row(i0 + b, lane)) wv[b] = ld_v4(weight + step_vector(i0 + b, lane) * kVector * 2u);
  }
}

// r = 1 / sqrt(mean(x²) + eps) from the lanes' partial sums of squares (xor butterfly: every lane gets
// the same sum).
__device__ __forceinline__ float inverse_rms(float partial, float eps) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    partial = megamoe::add_rn(partial, __shfl_xor_sync(0xffffffffu, partial, offset));
  }
  const float mean = megamoe::div_rn(partial, static_cast<float>(HIDDEN));
  return megamoe::div_rn(1.0f, sqrt_rn(megamoe::add_rn(mean, eps)));
}

// Step i of token t's output from its input values f and weights wv (lane `lane`'s vector): normalize,
// round to bf16, and quantize each half-warp's 128-channel group. Every lane of the warp calls it
// (the FP8 scale takes a half-warp max).
__device__ __forceinline__ void emit_step(const float (&f)[8], const megamoe::u32x4& wv, float r, unsigned int t,
                                          int i, unsigned int lane, unsigned char* yb, unsigned char* qb,
                                          float* scales) {
  const unsigned int v = step_vector(i, lane);
  const bool active = v < kVectors;  // half-warp-uniform: kVectors is a multiple of 16
  unsigned int packed[4] = {0u, 0u, 0u, 0u};
  float rounded[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  float amax = 0.0f;
  if (active) {
    float w[8];
    unpack8(wv, w);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      packed[k] = megamoe::bf16x2_from_floats(megamoe::mul_rn(megamoe::mul_rn(f[2 * k], r), w[2 * k]),
                                              megamoe::mul_rn(megamoe::mul_rn(f[2 * k + 1], r), w[2 * k + 1]));
      rounded[2 * k] = megamoe::bf16x2_low_to_float(packed[k]);
      rounded[2 * k + 1] = megamoe::bf16x2_high_to_float(packed[k]);
      amax = fmaxf(amax, fmaxf(fabsf(rounded[2 * k]), fabsf(rounded[2 * k + 1])));
    }
    const unsigned long long offset = static_cast<unsigned long long>(t) * HIDDEN + v * kVector;
    if (yb != nullptr) {
      megamoe::st_v4(yb + offset * 2u, megamoe::u32x4{packed[0], packed[1], packed[2], packed[3]});
    }
  }
  if (qb != nullptr) {  // uniform: every lane reaches the shuffles
    amax = megamoe::half_warp_max(amax);
    if (active) {
      const megamoe::GroupScale s = megamoe::activation_scale<SCALE_UE8M0 != 0>(amax);
      unsigned int lo, hi;
      megamoe::quantize8(rounded, s.inv, lo, hi);
      const unsigned long long offset = static_cast<unsigned long long>(t) * HIDDEN + v * kVector;
      megamoe::st_v2(qb + offset, lo, hi);
      if ((lane & 15u) == 0u) {
        megamoe::st_f32(scales + static_cast<unsigned long long>(t) * (HIDDEN / megamoe::kQuantGroup) + v / 16u,
                        s.scale);
      }
    }
  }
}

}  // namespace

// x: bf16 [T, H] (read when n == 0); streams: bf16 [T, n, H] and mix: fp32 [T, n] (read when n > 0);
// weight: bf16 [H]. Outputs may be null: y bf16 [T, H]; q e4m3 [T, H] with scales fp32 [T, H/128]
// (q and scales are both null or both given).
extern "C" __global__ void __launch_bounds__(kThreads)
    megamoe_rmsnorm(const void* __restrict__ x, const void* __restrict__ streams, const float* __restrict__ mix,
                    unsigned int n, const void* __restrict__ weight, float eps, void* __restrict__ y,
                    void* __restrict__ q, float* __restrict__ scales, unsigned int tokens) {
  // Launched with programmatic stream serialization (norm.ts): nothing is read or written before the
  // kernel that wrote x has finished.
  megamoe::chain_after_previous_grid();
  const unsigned int lane = threadIdx.x & 31u;
  const unsigned int t = (blockIdx.x * kThreads + threadIdx.x) >> 5;
  if (t >= tokens) return;  // warp-uniform
  const unsigned char* xb = static_cast<const unsigned char*>(x);
  const unsigned char* sb = static_cast<const unsigned char*>(streams);
  const unsigned char* wb = static_cast<const unsigned char*>(weight);

  // Pass 1: this lane's partial sum of squares, channels in increasing order. A batch of steps' loads
  // goes out before their sums, so a row costs a few memory round trips rather than one per step.
  float partial = 0.0f;
#pragma unroll 1
  for (int i0 = 0; i0 < kSteps; i0 += kBatch) {
    float f[kBatch][8];
    load_batch(xb, sb, mix, n, t, lane, i0, f);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (in_row(i0 + b, lane)) {
#pragma unroll
        for (int k = 0; k < 8; ++k) partial = megamoe::add_rn(partial, megamoe::mul_rn(f[b][k], f[b][k]));
      }
    }
  }
  const float r = inverse_rms(partial, eps);

  // Pass 2: normalize, round to bf16, and quantize each half-warp's 128-channel group; batched as pass 1.
  unsigned char* yb = static_cast<unsigned char*>(y);
  unsigned char* qb = static_cast<unsigned char*>(q);
#pragma unroll 1
  for (int i0 = 0; i0 < kSteps; i0 += kBatch) {
    megamoe::u32x4 wv[kBatch];
    load_weights(wb, lane, i0, wv);
    float f[kBatch][8];
    load_batch(xb, sb, mix, n, t, lane, i0, f);
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (i0 + b >= kSteps) break;  // warp-uniform
      emit_step(f[b], wv[b], r, t, i0 + b, lane, yb, qb, scales);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Few tokens (norm.ts picks it up to one token per SM): a block of kWideWarps warps per token, so the
// row's loads are one round trip instead of a warp's few. Warp w loads steps [w·kWideSteps, …) of the
// input and the weight and keeps them; the squares go through shared memory to warp 0, whose lanes add
// them in the one-warp kernel's order (lane l: its channels in increasing order), so r and every output
// bit are that kernel's. Same arguments; grid = T, block = 32 · kWideWarps.

constexpr int kWideSteps = (kSteps + 7) / 8;                        // steps per warp
constexpr int kWideWarps = (kSteps + kWideSteps - 1) / kWideSteps;  // at most 8
constexpr int kWideThreads = 32 * kWideWarps;

extern "C" __global__ void __launch_bounds__(kWideThreads)
    megamoe_rmsnorm_wide(const void* __restrict__ x, const void* __restrict__ streams, const float* __restrict__ mix,
                         unsigned int n, const void* __restrict__ weight, float eps, void* __restrict__ y,
                         void* __restrict__ q, float* __restrict__ scales, unsigned int tokens) {
  __shared__ float squares[kSteps * 8][32];  // [step · 8 + channel][lane]: conflict-free both ways
  __shared__ float broadcast_r;
  megamoe::chain_after_previous_grid();  // as megamoe_rmsnorm
  const unsigned int lane = threadIdx.x & 31u;
  const int warp = static_cast<int>(threadIdx.x >> 5);
  const unsigned int t = blockIdx.x;
  if (t >= tokens) return;  // block-uniform
  const int i0 = warp * kWideSteps;

  // Pass 1: this warp's steps of the input and the weight, and their squares into shared memory.
  megamoe::u32x4 wv[kWideSteps];
  load_weights(static_cast<const unsigned char*>(weight), lane, i0, wv);
  float f[kWideSteps][8];
  load_batch(static_cast<const unsigned char*>(x), static_cast<const unsigned char*>(streams), mix, n, t, lane,
             i0, f);
#pragma unroll
  for (int b = 0; b < kWideSteps; ++b) {
    if (in_row(i0 + b, lane)) {
#pragma unroll
      for (int k = 0; k < 8; ++k) squares[(i0 + b) * 8 + k][lane] = megamoe::mul_rn(f[b][k], f[b][k]);
    }
  }
  __syncthreads();
  if (warp == 0) {
    float partial = 0.0f;
    for (int i = 0; i < kSteps; ++i) {
      if (in_row(i, lane)) {
#pragma unroll
        for (int k = 0; k < 8; ++k) partial = megamoe::add_rn(partial, squares[i * 8 + k][lane]);
      }
    }
    const float r = inverse_rms(partial, eps);
    if (lane == 0) broadcast_r = r;
  }
  __syncthreads();
  const float r = broadcast_r;

  // Pass 2: this warp's steps from its registers.
#pragma unroll
  for (int b = 0; b < kWideSteps; ++b) {
    if (i0 + b >= kSteps) break;  // warp-uniform
    emit_step(f[b], wv[b], r, t, i0 + b, lane, static_cast<unsigned char*>(y), static_cast<unsigned char*>(q),
              scales);
  }
}
