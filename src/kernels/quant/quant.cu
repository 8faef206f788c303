// Pre-dispatch activation quantization: bf16 [T, H] -> FP8 e4m3 [T, H] + FP32 scales [T, H/128],
// one scale per token and 128-channel group (rule in megamoe/quant.cuh).
//
// Layout. Since H is a multiple of 128, group g = t·(H/128) + c is the contiguous run of input
// elements [128g, 128g + 128), its codes are output bytes [128g, 128g + 128) and its scale is
// scales[g]: the problem is a flat array of T·H/128 groups. A half-warp owns a group (16 lanes × 16
// bytes = 128 bf16), so one warp-wide load reads 512 contiguous bytes (two groups) and one warp-wide
// store writes 256. A warp takes kGroupsPerStep consecutive groups per step (kUnroll loads in
// flight per lane before any is used), and warps stride over steps across the whole grid.
//
// Compile-time parameters (the JIT passes them with -D; the defaults let nvcc build the file alone):
//   HIDDEN       channels per token (multiple of 128)
//   SCALE_UE8M0  1: scales rounded up to powers of two; 0: plain FP32 scales
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

constexpr int kLanesPerGroup = 16;                   // 16 lanes × 8 bf16 = one 128-channel group
constexpr int kUnroll = 4;                           // independent 16-byte loads per lane per step
constexpr int kGroupsPerStep = 2 * kUnroll;          // groups one warp handles per step
constexpr int kGroupsPerToken = HIDDEN / megamoe::kQuantGroup;
constexpr int kMaxThreads = 256;

// The launcher's block size is at most kMaxThreads and a multiple of 32; 4 resident blocks of 256
// threads (64 registers each at most) keep ~64 KB of loads in flight per SM, well above what the
// memory latency × bandwidth product needs.
static_assert(kLanesPerGroup * 8 == megamoe::kQuantGroup, "a half-warp must cover one group");

}  // namespace

extern "C" __global__ void __launch_bounds__(kMaxThreads, 4)
    megamoe_quantize_act(const void* __restrict__ x, void* __restrict__ q, float* __restrict__ scales,
                         unsigned int tokens) {
  // The fused kernel after this one may launch now (its prologue needs nothing from here): safe this
  // early since it waits for this grid's end before it reads the rows.
  megamoe::allow_next_grid_launch();
  const unsigned int groups = tokens * static_cast<unsigned int>(kGroupsPerToken);
  const unsigned int steps = (groups + kGroupsPerStep - 1) / kGroupsPerStep;
  const unsigned int lane = threadIdx.x & 31u;
  const unsigned int half = lane >> 4;                  // which group of the pair this lane serves
  const unsigned int slot = lane & (kLanesPerGroup - 1);  // which 8 channels of the group
  const unsigned int warps_in_grid = (gridDim.x * blockDim.x) >> 5;

  const unsigned char* x_bytes = static_cast<const unsigned char*>(x);
  unsigned char* q_bytes = static_cast<unsigned char*>(q);

  // `step` is warp-uniform, so every lane reaches the shuffles below together.
  for (unsigned int step = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; step < steps; step += warps_in_grid) {
    const unsigned int first = step * kGroupsPerStep;

    megamoe::u32x4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const unsigned int g = first + 2u * u + half;
      const unsigned long long offset = static_cast<unsigned long long>(g) * 256u + slot * 16u;
      v[u] = g < groups ? megamoe::ld_nc_v4(x_bytes + offset) : megamoe::u32x4{0u, 0u, 0u, 0u};
    }

    float scale[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const unsigned int g = first + 2u * u + half;
      const unsigned int words[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
      float f[8];
      float amax = 0.0f;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        f[2 * k] = megamoe::bf16x2_low_to_float(words[k]);
        f[2 * k + 1] = megamoe::bf16x2_high_to_float(words[k]);
        amax = fmaxf(amax, fmaxf(fabsf(f[2 * k]), fabsf(f[2 * k + 1])));
      }
      // Exact and order-free. Under -ftz a subnormal amax may read as 0: both lie below the 1e-10
      // floor, so the scale is the same.
      amax = megamoe::half_warp_max(amax);
      const megamoe::GroupScale s = megamoe::activation_scale<SCALE_UE8M0 != 0>(amax);
      scale[u] = s.scale;

      unsigned int lo, hi;
      megamoe::quantize8(f, s.inv, lo, hi);
      if (g < groups) {
        megamoe::st_v2(q_bytes + static_cast<unsigned long long>(g) * 128u + slot * 8u, lo, hi);
      }
    }

    // The step's kGroupsPerStep scales are contiguous: lanes 0-3 write groups 0, 2, 4, 6 and lanes
    // 16-19 write 1, 3, 5, 7, so one store instruction covers one 32-byte sector.
    if (slot < kUnroll) {
      float mine = scale[0];
#pragma unroll
      for (int u = 1; u < kUnroll; ++u) {
        if (slot == static_cast<unsigned int>(u)) mine = scale[u];
      }
      const unsigned int g = first + 2u * slot + half;
      if (g < groups) megamoe::st_f32(scales + g, mine);
    }
  }
}
