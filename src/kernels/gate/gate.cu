// MegaGate: the router on the GPU. bf16 x [T, H] · bf16 gate weight [E, H]ᵀ → fp32 logits → scores →
// (bias for selection) → group-limited top-k → weights, with the rules of the CPU reference
// (src/reference/router.ts, docs/numerics.md "The router").
//
// Two kernels, launched back to back by gate.ts: one of the two logits kernels, then a select kernel:
// megamoe_gate_select, or megamoe_gate_select_hash for hash-routed configs (DeepSeek-V4's first layers:
// experts by token id through tid2eid, weighted from the same scores; the reference's routeByHash).
//
// megamoe_gate_logits_exact (fp64 tensor cores, gate.ts's default for small batches). A warp owns a tile
// of 8 tokens × kExpertsPerWarp experts over one K split. Per 32-channel step lane (g, q) loads channels
// 8q … 8q+7 of token row g and of expert row g of each 8-expert column block (16 bytes each), and runs
// eight mma.sync.m8n8k4 f64 per column block, the j-th taking channel 8q + j into k slot q (A and B use
// the same map). bf16 values and their products are exact in double and the accumulator is double
// throughout, so a partial is the exact dot product up to a few double ulps: once rounded to fp32 the
// logit equals the reference's unless the exact sum lies within those ulps of an fp32 rounding boundary.
//
// megamoe_gate_logits (bf16 tensor cores: the default for large batches, which the fp64 path takes
// 1.2–1.5× as long over). A warp owns a tile of 16 tokens × kExpertsPerWarp experts over one K split
// (a range of 32-channel steps). Per step each lane does one 16-byte load of x for each of its
// two rows and one of W per 8-expert column block, then two mma.sync.m16n8k16 bf16 per column block.
// Every mma starts from a zero accumulator, and its fp32 result (an exact sum of 16 exact bf16
// products, up to the tensor core's internal alignment, see docs/numerics.md) is added to a double
// accumulator: the logit's error is then a few fp32 ulps of 16-product partial sums, not of the
// running sum over H. The warp writes its double partials to the workspace [S, T, E].
//
// K order inside an mma: lane q of a quad holds memory channels 8q … 8q+7 of the step; channels
// 8q+{0,1} and 8q+{4,5} go to the first mma's k slots {2q, 2q+1} and {2q+8, 2q+9}, channels 8q+{2,3}
// and 8q+{6,7} to the second's. A and B use the same map, so each mma sums 16 true products; every
// expert column goes through the same operations, so equal weight rows give equal logits.
//
// megamoe_gate_select. A warp owns a token: logit[e] = fp32(Σ_s partial[s][t][e]) (double, s in
// order, one rounding), then in the reference's order: scores in double rounded to fp32 (softmax: the
// row max, exponentials summed in increasing e by one lane), selection = add_rn(score, bias), group
// scores add_rn(top1, top2), topkGroup groups then topK experts by (value desc, index asc) through
// warp arg-max rounds, weights in double (Σ in slot order, w / (Σ + 1e-20) · scale), one rounding.
//
// Compile-time parameter: NUM_EXPERTS (a multiple of 8, at most 512). Everything else is an argument.
#include "common/ptx.cuh"

#ifndef NUM_EXPERTS
#define NUM_EXPERTS 384
#endif

static_assert(NUM_EXPERTS % 8 == 0 && NUM_EXPERTS > 0 && NUM_EXPERTS <= 512,
              "NUM_EXPERTS must be a positive multiple of 8, at most 512 (shared memory)");

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTokensPerTile = 16;      // megamoe_gate_logits
constexpr int kExactTokensPerTile = 8;  // megamoe_gate_logits_exact
constexpr int kExpertsPerWarp = NUM_EXPERTS < 32 ? NUM_EXPERTS : 32;
constexpr int kColumnBlocks = kExpertsPerWarp / 8;
constexpr int kExpertBlocks = (NUM_EXPERTS + kExpertsPerWarp - 1) / kExpertsPerWarp;
constexpr int kPerLane = (NUM_EXPERTS + 31) / 32;  // experts (or groups) per lane in the select kernel
constexpr int kMaxTopK = 64;
constexpr int kSplitsInFlight = kPerLane >= 32 ? 1 : 32 / kPerLane;  // ~32 partial loads in flight per lane
constexpr double kRenormalizeEpsilon = 1e-20;      // RENORMALIZE_EPSILON, a double as on the CPU
constexpr double kSoftplusThreshold = 20.0;

static_assert(NUM_EXPERTS % kExpertsPerWarp == 0, "expert blocks must tile NUM_EXPERTS");
static_assert(kPerLane <= 64, "the per-lane taken mask is 64 bits");

enum Scoring : unsigned int { kSigmoid = 0, kSoftmax = 1, kSqrtSoftplus = 2 };

struct u32x4 {
  unsigned int x, y, z, w;
};

__device__ __forceinline__ u32x4 ld_v4(const void* p) { return *static_cast<const u32x4*>(p); }

// D = A·B with a zero accumulator: fp32 sum of 16 products per element.
__device__ __forceinline__ void mma_bf16_zero(unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
                                              unsigned int b0, unsigned int b1, float (&d)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %10, %10, %10};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

// D += A·B in double: A one value per lane (row lane / 4, k slot lane % 4), B likewise (k slot lane % 4,
// column lane / 4), D two per lane (row lane / 4, columns 2 · (lane % 4) + {0, 1}).
__device__ __forceinline__ void mma_f64(double (&d)[2], double a, double b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+d"(d[0]), "+d"(d[1])
               : "d"(a), "d"(b));
}

// bf16 channel 2i + h (h = 0: low half) of a 32-bit word of bf16 pairs, exactly as a double.
template <int h>
__device__ __forceinline__ double bf16_half(unsigned int word) {
  return static_cast<double>(__uint_as_float(h != 0 ? word & 0xFFFF0000u : word << 16));
}

// The reference's candidate order: higher value first, then the lower index.
__device__ __forceinline__ bool ranks_before(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

// Warp arg-max of (value, index) under ranks_before, carrying `payload` along; every lane gets the winner.
__device__ __forceinline__ void warp_best(float& v, int& i, float& payload) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const int oi = __shfl_xor_sync(0xffffffffu, i, offset);
    const float op = __shfl_xor_sync(0xffffffffu, payload, offset);
    if (ranks_before(ov, oi, v, i)) {
      v = ov;
      i = oi;
      payload = op;
    }
  }
}

// Where lane (g, q) of a logits warp reads expert block eb's weights: expert eb · kExpertsPerWarp + 8c + g,
// channels 8q … 8q + 7 of each 32-channel step (both logits kernels' B fragment).
__device__ __forceinline__ void weight_rows(const unsigned char* (&wrow)[kColumnBlocks], const void* w, unsigned int eb,
                                            unsigned int g, unsigned int q, unsigned int hidden) {
  const unsigned char* wb = static_cast<const unsigned char*>(w);
#pragma unroll
  for (int c = 0; c < kColumnBlocks; ++c) {
    const unsigned int e = eb * kExpertsPerWarp + c * 8u + g;
    wrow[c] = wb + (static_cast<unsigned long long>(e) * hidden + q * 8u) * 2u;
  }
}

// A logits warp's share of the work, declared as locals of the kernel: warp u takes expert block
// eb = u % EB, token tile (u / EB) % TT and K split u / (EB · TT), the split being 32-channel steps
// [first, last); a warp past the last unit returns. A macro, not a function: as a function the same
// statements compiled to other machine code; as a macro both kernels' cubins are byte for byte the
// ones the GPU tests ran.
#define MEGAMOE_GATE_LOGITS_UNIT(kTileTokens)                                  \
  const unsigned int unit = blockIdx.x * kWarps + (threadIdx.x >> 5);          \
  const unsigned int tiles = (tokens + (kTileTokens) - 1) / (kTileTokens);     \
  if (unit >= kExpertBlocks * tiles * splits) return; /* warp-uniform */       \
  const unsigned int eb = unit % kExpertBlocks;                                \
  const unsigned int tile = (unit / kExpertBlocks) % tiles;                    \
  const unsigned int split = unit / (kExpertBlocks * tiles);                   \
  const unsigned int steps = hidden / 32u;                                     \
  const unsigned int first = split * steps_per_split;                          \
  const unsigned int last = min(steps, first + steps_per_split)

}  // namespace

// x bf16 [T, H], w bf16 [E, H], partial double [S, T, E]; `steps_per_split` 32-channel steps per split
// (the last split takes the rest); one warp per unit (MEGAMOE_GATE_LOGITS_UNIT).
extern "C" __global__ void __launch_bounds__(kThreads)
    megamoe_gate_logits(const void* __restrict__ x, const void* __restrict__ w, double* __restrict__ partial,
                        unsigned int tokens, unsigned int hidden, unsigned int splits,
                        unsigned int steps_per_split) {
  megamoe::chain_after_previous_grid();  // launched with programmatic stream serialization (gate.ts)
  const unsigned int lane = threadIdx.x & 31u;
  MEGAMOE_GATE_LOGITS_UNIT(kTokensPerTile);

  const unsigned int g = lane >> 2;  // row (token) within the tile, and column (expert) within a block
  const unsigned int q = lane & 3u;
  const unsigned int t0 = tile * kTokensPerTile + g;
  const unsigned int t1 = t0 + 8u;
  const unsigned char* xb = static_cast<const unsigned char*>(x);
  // Rows past T read row 0 (always valid) and are never written.
  const unsigned char* x0 = xb + (static_cast<unsigned long long>(t0 < tokens ? t0 : 0u) * hidden + q * 8u) * 2u;
  const unsigned char* x1 = xb + (static_cast<unsigned long long>(t1 < tokens ? t1 : 0u) * hidden + q * 8u) * 2u;
  const unsigned char* wrow[kColumnBlocks];
  weight_rows(wrow, w, eb, g, q, hidden);

  double acc[kColumnBlocks][4];
#pragma unroll
  for (int c = 0; c < kColumnBlocks; ++c) {
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[c][r] = 0.0;
  }

#pragma unroll 2
  for (unsigned int step = first; step < last; ++step) {
    const unsigned int byte = step * 64u;  // 32 bf16 channels
    const u32x4 a0 = ld_v4(x0 + byte);
    const u32x4 a1 = ld_v4(x1 + byte);
    u32x4 b[kColumnBlocks];
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) b[c] = ld_v4(wrow[c] + byte);
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) {
      float d[4];
      mma_bf16_zero(a0.x, a1.x, a0.z, a1.z, b[c].x, b[c].z, d);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[c][r] = __dadd_rn(acc[c][r], static_cast<double>(d[r]));
      mma_bf16_zero(a0.y, a1.y, a0.w, a1.w, b[c].y, b[c].w, d);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[c][r] = __dadd_rn(acc[c][r], static_cast<double>(d[r]));
    }
  }

  // C fragment: d0, d1 are row g, columns 2q, 2q+1; d2, d3 row g + 8.
#pragma unroll
  for (int c = 0; c < kColumnBlocks; ++c) {
    const unsigned int e = eb * kExpertsPerWarp + c * 8u + 2u * q;
    if (t0 < tokens) {
      double* p = partial + (static_cast<unsigned long long>(split) * tokens + t0) * NUM_EXPERTS + e;
      p[0] = acc[c][0];
      p[1] = acc[c][1];
    }
    if (t1 < tokens) {
      double* p = partial + (static_cast<unsigned long long>(split) * tokens + t1) * NUM_EXPERTS + e;
      p[0] = acc[c][2];
      p[1] = acc[c][3];
    }
  }
}

// Same arguments and partials as megamoe_gate_logits; tiles of kExactTokensPerTile tokens.
extern "C" __global__ void __launch_bounds__(kThreads)
    megamoe_gate_logits_exact(const void* __restrict__ x, const void* __restrict__ w, double* __restrict__ partial,
                              unsigned int tokens, unsigned int hidden, unsigned int splits,
                              unsigned int steps_per_split) {
  megamoe::chain_after_previous_grid();  // launched with programmatic stream serialization (gate.ts)
  const unsigned int lane = threadIdx.x & 31u;
  MEGAMOE_GATE_LOGITS_UNIT(kExactTokensPerTile);

  const unsigned int g = lane >> 2;  // token within the tile, and expert within a column block
  const unsigned int q = lane & 3u;
  const unsigned int t = tile * kExactTokensPerTile + g;
  // A row past T reads row 0 (always valid) and is never written.
  const unsigned char* xrow = static_cast<const unsigned char*>(x) +
                              (static_cast<unsigned long long>(t < tokens ? t : 0u) * hidden + q * 8u) * 2u;
  const unsigned char* wrow[kColumnBlocks];
  weight_rows(wrow, w, eb, g, q, hidden);

  double acc[kColumnBlocks][2];
#pragma unroll
  for (int c = 0; c < kColumnBlocks; ++c) acc[c][0] = acc[c][1] = 0.0;

#pragma unroll 2  // (not unrolled, ptxas keeps 56 registers and spills)
  for (unsigned int step = first; step < last; ++step) {
    const unsigned int byte = step * 64u;  // 32 bf16 channels
    const u32x4 a = ld_v4(xrow + byte);
    u32x4 b[kColumnBlocks];
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) b[c] = ld_v4(wrow[c] + byte);
    // Channel 8q + j: word j / 2 of the load, half j % 2.
#define MEGAMOE_GATE_EXACT_WORD(field)                                                                  \
  {                                                                                                     \
    const double lo = bf16_half<0>(a.field);                                                            \
    const double hi = bf16_half<1>(a.field);                                                            \
    _Pragma("unroll") for (int c = 0; c < kColumnBlocks; ++c) mma_f64(acc[c], lo, bf16_half<0>(b[c].field)); \
    _Pragma("unroll") for (int c = 0; c < kColumnBlocks; ++c) mma_f64(acc[c], hi, bf16_half<1>(b[c].field)); \
  }
    MEGAMOE_GATE_EXACT_WORD(x)
    MEGAMOE_GATE_EXACT_WORD(y)
    MEGAMOE_GATE_EXACT_WORD(z)
    MEGAMOE_GATE_EXACT_WORD(w)
#undef MEGAMOE_GATE_EXACT_WORD
  }

  if (t < tokens) {
#pragma unroll
    for (int c = 0; c < kColumnBlocks; ++c) {
      const unsigned int e = eb * kExpertsPerWarp + c * 8u + 2u * q;
      double* p = partial + (static_cast<unsigned long long>(split) * tokens + t) * NUM_EXPERTS + e;
      p[0] = acc[c][0];
      p[1] = acc[c][1];
    }
  }
}

namespace {

// Token t's logits and scores, lane holding experts i·32 + lane: logit[e] = fp32(Σ_s partial[s][t][e])
// (double, s in order, one rounding; written to `logits` when it is not null), then the score in double
// from the fp32 logit, rounded once. `exps` is the warp's shared row for the softmax numerators. Shared
// by both select kernels, so a hash-routed token is weighted from the very scores a score-routed one is.
__device__ __forceinline__ void token_scores(const double* __restrict__ partial, unsigned int splits,
                                             unsigned int tokens, unsigned int t, unsigned int lane,
                                             unsigned int scoring, float* __restrict__ logits, double* exps,
                                             float (&score)[kPerLane]) {
  // The loads of kSplitsInFlight splits are issued before their adds (at decode there are ~100 splits,
  // and one dependent load per split cost tens of µs); the adds keep the split order.
  double logit_sum[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) logit_sum[i] = 0.0;
  for (unsigned int s0 = 0; s0 < splits; s0 += kSplitsInFlight) {
    double v[kSplitsInFlight][kPerLane];
#pragma unroll
    for (int u = 0; u < kSplitsInFlight; ++u) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const unsigned int e = i * 32u + lane;
        v[u][i] = s0 + u < splits && e < NUM_EXPERTS
                      ? partial[(static_cast<unsigned long long>(s0 + u) * tokens + t) * NUM_EXPERTS + e]
                      : 0.0;
      }
    }
#pragma unroll
    for (int u = 0; u < kSplitsInFlight; ++u) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (s0 + u < splits) logit_sum[i] = __dadd_rn(logit_sum[i], v[u][i]);
      }
    }
  }
  float logit[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const unsigned int e = i * 32u + lane;
    logit[i] = __double2float_rn(logit_sum[i]);
    if (e < NUM_EXPERTS && logits != nullptr) logits[static_cast<unsigned long long>(t) * NUM_EXPERTS + e] = logit[i];
  }

  if (scoring == kSoftmax) {
    float m = -__int_as_float(0x7f800000);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (i * 32u + lane < NUM_EXPERTS) m = fmaxf(m, logit[i]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const unsigned int e = i * 32u + lane;
      if (e < NUM_EXPERTS) {
        exps[e] = exp(__dsub_rn(static_cast<double>(logit[i]), static_cast<double>(m)));
      }
    }
    __syncwarp();
    double total = 0.0;
    if (lane == 0) {
      for (int e = 0; e < NUM_EXPERTS; ++e) total = __dadd_rn(total, exps[e]);
    }
    total = __shfl_sync(0xffffffffu, total, 0);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const unsigned int e = i * 32u + lane;
      score[i] = e < NUM_EXPERTS ? __double2float_rn(__ddiv_rn(exps[e], total)) : 0.0f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const double l = static_cast<double>(logit[i]);
      if (scoring == kSigmoid) {
        score[i] = __double2float_rn(__ddiv_rn(1.0, __dadd_rn(1.0, exp(-l))));
      } else {
        const double sp = l > kSoftplusThreshold ? l : log1p(exp(l));
        score[i] = __double2float_rn(__dsqrt_rn(sp));
      }
    }
  }
}

// Token t's k slots from the warp's shared slot_id / slot_score rows (complete: the caller synced the
// warp): Σ of the slot scores in slot order (double), then w / (Σ + 1e-20) · scale or w · scale, one
// rounding, as the reference weights the experts it routes to (selectTopK and routeByHash alike).
__device__ __forceinline__ void write_slots(const int* slot_id, const float* slot_score, unsigned int t,
                                            unsigned int lane, unsigned int top_k, unsigned int renormalize,
                                            unsigned long long scale_bits, int* __restrict__ ids,
                                            float* __restrict__ weights) {
  double sum = 0.0;
  if (renormalize) {
    for (unsigned int slot = 0; slot < top_k; ++slot) {
      sum = __dadd_rn(sum, static_cast<double>(slot_score[slot]));
    }
  }
  const double scale = __longlong_as_double(static_cast<long long>(scale_bits));
  for (unsigned int slot = lane; slot < top_k; slot += 32u) {
    const double s = static_cast<double>(slot_score[slot]);
    const double w = renormalize ? __dmul_rn(__ddiv_rn(s, __dadd_rn(sum, kRenormalizeEpsilon)), scale)
                                 : __dmul_rn(s, scale);
    ids[static_cast<unsigned long long>(t) * top_k + slot] = slot_id[slot];
    weights[static_cast<unsigned long long>(t) * top_k + slot] = __double2float_rn(w);
  }
}

}  // namespace

// partial double [S, T, E] from either logits kernel; bias fp32 [E] or null; ids int32 [T, topK],
// weights fp32 [T, topK]; logits fp32 [T, E] or null. n_group ≥ 1 divides E; 1 ≤ topk_group ≤ n_group;
// 1 ≤ top_k ≤ 64; scale_bits: the bits of routedScalingFactor as a double.
// Asking for only one resident block per SM gives ptxas the registers to keep the partials' loads in
// flight (without it, it held E = 32 to 32 registers).
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    megamoe_gate_select(const double* __restrict__ partial, unsigned int splits, unsigned int tokens,
                        const float* __restrict__ bias, unsigned int scoring, unsigned int n_group,
                        unsigned int topk_group, unsigned int top_k, unsigned int renormalize,
                        unsigned long long scale_bits, int* __restrict__ ids, float* __restrict__ weights,
                        float* __restrict__ logits) {
  __shared__ double exps[kWarps][NUM_EXPERTS];       // softmax numerators, for the ordered sum
  __shared__ float selection[kWarps][NUM_EXPERTS];   // for the group scores
  __shared__ unsigned char kept[kWarps][NUM_EXPERTS];  // per group: among the topk_group best
  __shared__ float slot_score[kWarps][kMaxTopK];
  __shared__ int slot_id[kWarps][kMaxTopK];

  megamoe::chain_after_previous_grid();  // launched with programmatic stream serialization (gate.ts)
  const unsigned int lane = threadIdx.x & 31u;
  const unsigned int warp = threadIdx.x >> 5;
  const unsigned int t = blockIdx.x * kWarps + warp;
  if (t >= tokens) return;  // warp-uniform

  float score[kPerLane];
  token_scores(partial, splits, tokens, t, lane, scoring, logits, exps[warp], score);

  // Selection scores.
  float sel[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const unsigned int e = i * 32u + lane;
    sel[i] = score[i];
    if (bias != nullptr && e < NUM_EXPERTS) sel[i] = megamoe::add_rn(score[i], bias[e]);
  }

  // Groups: score = add_rn(top1, top2) of the group's selection scores (top1 alone for one expert);
  // the topk_group best groups are kept.
  const unsigned int group_size = NUM_EXPERTS / n_group;
  if (n_group > 1) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const unsigned int e = i * 32u + lane;
      if (e < NUM_EXPERTS) {
        selection[warp][e] = sel[i];
        kept[warp][e] = 0;
      }
    }
    __syncwarp();
    float gscore[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const unsigned int grp = i * 32u + lane;
      gscore[i] = 0.0f;
      if (grp < n_group) {
        float top1 = -__int_as_float(0x7f800000);
        float top2 = top1;
        for (unsigned int e = grp * group_size; e < (grp + 1) * group_size; ++e) {
          const float v = selection[warp][e];
          if (v > top1) {
            top2 = top1;
            top1 = v;
          } else if (v > top2) {
            top2 = v;
          }
        }
        gscore[i] = group_size == 1 ? top1 : megamoe::add_rn(top1, top2);
      }
    }
    unsigned long long taken = 0;
    for (unsigned int round = 0; round < topk_group; ++round) {
      float bv = -__int_as_float(0x7f800000);
      int bi = 0x7fffffff;
      float unused = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int grp = i * 32 + static_cast<int>(lane);
        if (grp < static_cast<int>(n_group) && !((taken >> i) & 1ull) && ranks_before(gscore[i], grp, bv, bi)) {
          bv = gscore[i];
          bi = grp;
        }
      }
      warp_best(bv, bi, unused);
      if (bi == 0x7fffffff) break;
      if ((bi & 31) == static_cast<int>(lane)) {
        taken |= 1ull << (bi >> 5);
        kept[warp][bi] = 1;
      }
    }
    __syncwarp();
  }

  // Top-k experts among the kept groups; the slot's unbiased score travels with the winner.
  unsigned long long taken = 0;
  bool allowed[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const unsigned int e = i * 32u + lane;
    allowed[i] = e < NUM_EXPERTS && (n_group == 1 || kept[warp][e / group_size] != 0);
  }
  for (unsigned int slot = 0; slot < top_k; ++slot) {
    float bv = -__int_as_float(0x7f800000);
    int bi = 0x7fffffff;
    float bs = 0.0f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = i * 32 + static_cast<int>(lane);
      if (allowed[i] && !((taken >> i) & 1ull) && ranks_before(sel[i], e, bv, bi)) {
        bv = sel[i];
        bi = e;
        bs = score[i];
      }
    }
    warp_best(bv, bi, bs);
    if ((bi & 31) == static_cast<int>(lane) && bi != 0x7fffffff) taken |= 1ull << (bi >> 5);
    if (lane == 0) {
      slot_id[warp][slot] = bi == 0x7fffffff ? -1 : bi;  // -1 only for non-finite selection scores
      slot_score[warp][slot] = bi == 0x7fffffff ? 0.0f : bs;
    }
  }
  __syncwarp();

  write_slots(slot_id[warp], slot_score[warp], t, lane, top_k, renormalize, scale_bits, ids, weights);
}

// Hash routing (DeepSeek-V4's first layers, the reference's routeByHash): token t's experts are
// tid2eid[token_ids[t]] in table order, weighted from the scores megamoe_gate_select would select by
// (same partials, same token_scores, same write_slots), so a hash-routed token gets the weights a
// score-routed token with those experts would. tid2eid int32 [vocab, top_k] (ids distinct within a row:
// the host checks), token_ids int32 [T]; other arguments as megamoe_gate_select's. The host checks
// token ids and the table too; here a token id outside [0, vocab) or an entry outside [0, E) only
// yields id −1 and weight 0 in its slots, so that a bad value cannot read out of bounds.
extern "C" __global__ void __launch_bounds__(kThreads, 1)
    megamoe_gate_select_hash(const double* __restrict__ partial, unsigned int splits, unsigned int tokens,
                             unsigned int scoring, const int* __restrict__ tid2eid,
                             const int* __restrict__ token_ids, unsigned int vocab, unsigned int top_k,
                             unsigned int renormalize, unsigned long long scale_bits, int* __restrict__ ids,
                             float* __restrict__ weights, float* __restrict__ logits) {
  __shared__ double exps[kWarps][NUM_EXPERTS];     // softmax numerators, for the ordered sum
  __shared__ float scores[kWarps][NUM_EXPERTS];    // a slot's expert may be any lane's
  __shared__ float slot_score[kWarps][kMaxTopK];
  __shared__ int slot_id[kWarps][kMaxTopK];

  megamoe::chain_after_previous_grid();  // launched with programmatic stream serialization (gate.ts)
  const unsigned int lane = threadIdx.x & 31u;
  const unsigned int warp = threadIdx.x >> 5;
  const unsigned int t = blockIdx.x * kWarps + warp;
  if (t >= tokens) return;  // warp-uniform

  float score[kPerLane];
  token_scores(partial, splits, tokens, t, lane, scoring, logits, exps[warp], score);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const unsigned int e = i * 32u + lane;
    if (e < NUM_EXPERTS) scores[warp][e] = score[i];
  }
  __syncwarp();

  const int token = token_ids[t];
  const bool known = token >= 0 && static_cast<unsigned int>(token) < vocab;
  for (unsigned int slot = lane; slot < top_k; slot += 32u) {
    int e = known ? tid2eid[static_cast<unsigned long long>(token) * top_k + slot] : -1;
    if (e < 0 || e >= NUM_EXPERTS) e = -1;
    slot_id[warp][slot] = e;
    slot_score[warp][slot] = e < 0 ? 0.0f : scores[warp][e];
  }
  __syncwarp();
  write_slots(slot_id[warp], slot_score[warp], t, lane, top_k, renormalize, scale_bits, ids, weights);
}
