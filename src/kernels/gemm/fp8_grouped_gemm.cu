// FP8 grouped GEMM with per-128 block scales for Hopper (sm_90a): the mainloop the MoE kernels reuse.
//
//   out[r, n] = Σ_b  P_b(r, n) · (sa[b, r] · sw[g, n / 128, b])      r in group g's rows, b over K / 128
//   P_b(r, n) = Σ_{k in block b} a[r, k] · w[g·N + n, k]              (tensor cores, fp32)
//
// P_b comes from wgmma into a fresh accumulator per 128-wide K block; the math threads then promote it
// into a separate fp32 accumulator, acc += P_b · (sa · sw), so the tensor cores' reduced-precision fp8
// accumulation never spans more than one block. The CPU spec is src/reference/moe.ts blockScaledGemm.
//
// Operands (all row-major, K contiguous):
//   A    e4m3 [M_total, K]        TMA map, box {128, BLOCK_M}, 128-byte swizzle
//   B    e4m3 [G·N, K]            TMA map, box {128, BLOCK_N}, 128-byte swizzle; group g's rows start at g·N
//   sa   fp32 [K/128, M_pad]      TMA map, box {BLOCK_M, 1}; M_pad = M_total rounded up to 4 (16-byte rows)
//   sw   fp32 [G, N/128, K/128]   plain loads
//   group_offsets int32 [G + 1]   rows [off[g], off[g+1]) of A and out belong to group g (any sizes, 0 too)
//   out  fp32 or bf16 [M_total, N]
//   status int32 [4]              written only when the pipeline watchdog fires (see kWatchdogNs)
//
// Structure. One CTA per SM walks tiles (group, n-block, m-block) round-robin over the grid. Warpgroups
// 0..NUM_MATH_WARPGROUPS-1 are math warpgroups (wgmma, promotion, epilogue); the last warpgroup is the
// producer, of which one thread issues the TMA loads into a NUM_STAGES-deep ring of shared-memory stages.
// Stage s has a `full` barrier (producer arrive + expect_tx, completed by the copies' bytes) and an
// `empty` barrier (one arrive per math warp once its wgmmas reading the stage have completed). Two math
// warpgroups take turns issuing their wgmmas (kTakeTurns) and otherwise never wait for each other; they
// write each tile's output during the next tile's first K block (kDeferredEpilogue).
// Tile order: within a group, n-block major and m-block minor, so the CTAs working at the same time on
// one group share each B tile through L2 and a group's A rows stay hot across its n-blocks.
//
// Compile-time parameters (-D from fp8_grouped_gemm.variants.ts: gemmDefines, captured as constants in
// fp8_grouped_gemm_config.cuh; the defaults build the file alone):
//   BLOCK_M 64|128, BLOCK_N 64|128|256, BLOCK_K 128, NUM_STAGES, NUM_MATH_WARPGROUPS 1|2,
//   N (output columns), K, NUM_GROUPS, OUT_BF16 0|1, B_FP4 0|1.
//
// FP4 weights (B_FP4 1, kernel megamoe_fp4_grouped_gemm; docs/numerics.md "FP4 experts (MXFP4)"):
//   B    uint8 [K/128, G·N, 64]  packed e2m1 in the device layout (common/fp4.cuh: K-block-major,
//                                 quarters pre-swizzled); 3-D TMA map {128, G·N/2, K/128}, box
//                                 {128, BLOCK_N/2, 1}, unswizzled: half the bytes of FP8 B, one
//                                 contiguous run per box
//   bs   u32 [K/128, G·N]         each row's K block as its reference word (common/fp4.cuh
//                                 fp4_reference_word): the host's load-time transform of [G·N, K/32]
//                                 (fp4GemmScaleWords); TMA map, box {BLOCK_N, 1}
//                                 and again as a plain pointer, the last parameter: each 128 × 128
//                                 block's scale 2^ref is read from its first row's word (every row of
//                                 a block carries its R), so no second array can disagree with them
// The TMA completes a stage's `loaded` barrier; warps 1..3 of the producer warpgroup then convert the
// packed rows into the B tile (common/fp4.cuh, fast path: e4m3 codes relative to each row's reference,
// written in the 128-byte swizzle the TMA gives FP8 B) and arrive on `full` (common/fp4_stage.cuh). The
// converters are the producer warpgroup's idle warps, so the math warpgroups keep every register and cycle
// for wgmma and promotion, and the conversion (about 1.8 SASS instructions per element, two items in flight
// per thread) overlaps the wgmmas of earlier stages. The promotion takes s = sa[r, kb] · sw[n, kb]
// (rounded), then acc = fmaf(partial, s, acc), the CPU rule, with one sw per chunk (the rows of a 128-row
// block share their reference): the FP8 tiles' code.

#include "fp8_grouped_gemm_config.cuh"
#include "common/fp4_stage.cuh"

namespace {

// ---------------------------------------------------------------------------------------------------
// Tile schedule

struct GroupRows {
  int begin;
  int end;
};

struct Tile {
  int group;
  int row0;     // first A/out row of the tile
  int row_end;  // end of the group's rows: rows at or past it are computed but never stored
  int n0;       // first output column
};

// Tiles are numbered group by group; prefix[g] is group g's first tile and prefix[kGroups] the total.
// `cursor` only moves forward, as every role visits its tiles in increasing order.
__device__ __forceinline__ Tile decode_tile(int tile, int& cursor, const int* prefix, const GroupRows* groups) {
  while (tile >= prefix[cursor + 1]) ++cursor;
  const int first = prefix[cursor];
  const int m_blocks = (prefix[cursor + 1] - first) / kNBlocks;
  const int local = tile - first;
  const int n_block = local / m_blocks;
  const int m_block = local - n_block * m_blocks;
  const GroupRows rows = groups[cursor];
  return Tile{cursor, rows.begin + m_block * kBlockM, rows.end, n_block * kBlockN};
}

// Group row ranges (clamped into [0, m_total] so bad offsets cannot write out of bounds) and the tile
// prefix, by one warp: each lane takes a run of consecutive groups, then a warp scan joins the runs.
__device__ __forceinline__ void build_schedule(const int* group_offsets, int m_total, GroupRows* groups,
                                               int* prefix) {
  constexpr int kPerLane = (kGroups + 31) / 32;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int first = lane * kPerLane;
  const int last = first + kPerLane < kGroups ? first + kPerLane : kGroups;
  int tiles = 0;
  for (int g = first; g < last; ++g) {
    const int lo = clamp_int(group_offsets[g], 0, m_total);
    const int hi = clamp_int(group_offsets[g + 1], lo, m_total);
    groups[g] = GroupRows{lo, hi};
    tiles += (hi - lo + kBlockM - 1) / kBlockM * kNBlocks;
  }
  int inclusive = tiles;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  int running = inclusive - tiles;
  for (int g = first; g < last; ++g) {
    prefix[g] = running;
    running += (groups[g].end - groups[g].begin + kBlockM - 1) / kBlockM * kNBlocks;
  }
  if (lane == 31) prefix[kGroups] = inclusive;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// The kernel. Launch: grid = number of SMs (or fewer), block = kThreads, dynamic shared memory =
// kDynamicSmemBytes (fp8_grouped_gemm.variants.ts: gemmSharedBytes).

#if B_FP4
// B and its reference words both arrive by TMA (map_b: packed nibbles, map_bs: the u32 words); the words
// come again last, as a pointer, for the math warpgroups' block scales.
#define GEMM_KERNEL_NAME megamoe_fp4_grouped_gemm
#define GEMM_B_SCALES_PARAM const __grid_constant__ TensorMap map_bs
#define GEMM_FP4_WORDS_PARAM , const unsigned* __restrict__ b_words
#else
#define GEMM_KERNEL_NAME megamoe_fp8_grouped_gemm
#define GEMM_B_SCALES_PARAM const float* __restrict__ b_scales
#define GEMM_FP4_WORDS_PARAM
#endif

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    GEMM_KERNEL_NAME(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b,
                     const __grid_constant__ TensorMap map_sa, GEMM_B_SCALES_PARAM,
                     const int* __restrict__ group_offsets, void* __restrict__ out, int m_total,
                     int* __restrict__ status GEMM_FP4_WORDS_PARAM) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned base = (raw + kSmemAlign - 1) & ~(kSmemAlign - 1);
  unsigned char* const smem = smem_raw + (base - raw);
  GroupRows* const groups = reinterpret_cast<GroupRows*>(smem + kOffGroups);
  int* const prefix = reinterpret_cast<int*>(smem + kOffPrefix);
  const unsigned full_bar = base + kOffFull;    // + 8 · stage
  const unsigned empty_bar = base + kOffEmpty;  // + 8 · stage
  // Where the TMA's bytes land: `full` itself for FP8 B; for FP4 `loaded`, and the converters fill `full`.
  const unsigned loaded_bar = kBFp4 ? base + kOffLoaded : full_bar;

  unsigned dynamic_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
  if (dynamic_bytes < kDynamicSmemBytes) {  // launched with a layout other than this build's
    if (threadIdx.x == 0 && status != nullptr && atomicCAS(status, 0, kStatusSharedMemoryTooSmall) == 0) {
      status[1] = static_cast<int>(dynamic_bytes);
      status[2] = static_cast<int>(kDynamicSmemBytes);
    }
    return;
  }

  // ---------------- Scheduler: one warp builds the group table and tile prefix, one thread the barriers.
  const int warpgroup = static_cast<int>(threadIdx.x / 128);
  if (threadIdx.x < 32) build_schedule(group_offsets, m_total, groups, prefix);
  if (threadIdx.x == kMathThreads) {
    prefetch_tensor_map(&map_a);
    prefetch_tensor_map(&map_b);
    prefetch_tensor_map(&map_sa);
#if B_FP4
    prefetch_tensor_map(&map_bs);
#endif
    for (int s = 0; s < kStages; ++s) {
      // FP8: the producer's arrive.expect_tx; FP4: one arrive per converter warp.
      mbar_init(full_bar + 8 * s, kBFp4 ? kConverterWarps : 1);
      mbar_init(empty_bar + 8 * s, kMathWarpgroups * 4);  // one arrive per math warp
      if constexpr (kBFp4) mbar_init(loaded_bar + 8 * s, 1);  // the producer's arrive.expect_tx
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const int total_tiles = prefix[kGroups];

  if (warpgroup == kMathWarpgroups) {
    // ---------------- Producer: one thread streams A, its scales and B through the stage ring.
    if constexpr (kReconfigureRegisters) registers_decrease<kProducerRegisters>();
    if constexpr (kBFp4) {
      // ---------------- FP4 converters (warps 1..3): each stage's packed rows into the B tile.
      const int converter = static_cast<int>(threadIdx.x) - kMathThreads - 32;
      if (converter >= 0) {
        int stage = 0;
        unsigned phase = 0;
        int iteration = 0;
        for (int tile = static_cast<int>(blockIdx.x); tile < total_tiles; tile += static_cast<int>(gridDim.x)) {
          for (int kb = 0; kb < kKBlocks; ++kb, ++iteration) {
            // `full` of this stage was last completed by this warp's previous pass, and the math warps
            // released the stage before the TMA (which waited for `empty`) refilled it: `loaded` orders both.
            mbar_wait(loaded_bar + 8 * stage, phase, status, kStatusProducerStalled, stage, iteration);
            megamoe::fp4_stage::convert_tile<kBlockN, kConverterThreads>(
                base + kOffPacked + stage * kPackedTileBytes, base + kOffBScales + stage * kBScaleBytes,
                base + kOffB + stage * kBTileBytes, converter);
            // The wgmmas read the tile through the async proxy: order these generic writes before them.
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncwarp();
            if ((converter & 31) == 0) mbar_arrive(full_bar + 8 * stage);
            if (++stage == kStages) {
              stage = 0;
              phase ^= 1u;
            }
          }
        }
        return;
      }
    }
    if (threadIdx.x != kMathThreads) return;
    const unsigned a_smem = base + kOffA;
    [[maybe_unused]] const unsigned b_smem = base + kOffB;  // FP8 B (FP4: the converters fill it)
    const unsigned sa_smem = base + kOffSa;
    int stage = 0;
    unsigned phase = 0;
    int cursor = 0;
    int iteration = 0;
    for (int tile = static_cast<int>(blockIdx.x); tile < total_tiles; tile += static_cast<int>(gridDim.x)) {
      const Tile t = decode_tile(tile, cursor, prefix, groups);
      const int b_row = t.group * kShapeN + t.n0;
      for (int kb = 0; kb < kKBlocks; ++kb, ++iteration) {
        // A fresh barrier counts as having completed the phase before its first, so the first pass
        // through the ring does not wait.
        mbar_wait(empty_bar + 8 * stage, phase ^ 1u, status, kStatusProducerStalled, stage, iteration);
        const unsigned bar = loaded_bar + 8 * stage;
        mbar_arrive_expect_tx(bar, kStageTxBytes);
        tma_load_2d(a_smem + stage * kATileBytes, &map_a, bar, kb * kBlockK, t.row0);
        tma_load_2d(sa_smem + stage * kSaStride, &map_sa, bar, t.row0 & ~3, kb);
#if B_FP4
        tma_load_3d(base + kOffPacked + stage * kPackedTileBytes, &map_b, bar, 0, b_row >> 1, kb);
        tma_load_2d(base + kOffBScales + stage * kBScaleBytes, &map_bs, bar, b_row, kb);
#else
        tma_load_2d(b_smem + stage * kBTileBytes, &map_b, bar, kb * kBlockK, b_row);
#endif
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    return;
  }

  // ---------------- Consumer: the math warpgroups. Their setup, then the epilogue's store step (defined
  // first: the mainloop writes a deferred tile with it), then per tile the mainloop and the epilogue.
  if constexpr (kReconfigureRegisters) registers_increase<kMathRegisters>();
  const int math_thread = static_cast<int>(threadIdx.x);  // 0 .. kMathThreads-1
  const int lane = math_thread & 31;
  const int warp_in_wg = (math_thread / 32) & 3;
  const int wg_row0 = (warpgroup % kWgAlongM) * kWgRows;  // this warpgroup's rows and columns in the tile
  const int wg_col0 = (warpgroup / kWgAlongM) * kWgCols;
  const int frag_row = warp_in_wg * 16 + lane / 4;  // accumulator fragment row (and row + 8)
  const int frag_col = 2 * (lane & 3);

  const unsigned a_smem = base + kOffA + wg_row0 * kBlockK;
  const unsigned b_smem = base + kOffB + wg_col0 * kBlockK;
  const unsigned sa_smem = base + kOffSa + (wg_row0 + frag_row) * 4;
  // The warpgroup's two buffers of kSwPerTile floats, alternating per tile.
  const unsigned sw_smem = base + kOffSw + warpgroup * 2 * kSwPerTile * 4;
  const int scale_thread = math_thread & 127;
  const unsigned staging = base + kOffStaging + static_cast<unsigned>(math_thread / 32) * kStagingWarpBytes;

  const auto release_stage = [&](int st) {
    if (lane == 0) mbar_arrive(empty_bar + 8 * st);
  };
  // Weight scales of the next tile travel through registers while the current tile runs.
  float sw_prefetch[kSwPerThread];
  auto load_weight_scales = [&](const Tile& t) {
#if B_FP4
    // Block row r of the tile, K block b: 2^ref of the word of the block's first weight row.
    const int first_row = t.group * kShapeN + t.n0 / kQuantBlock * kQuantBlock;
#pragma unroll
    for (int i = 0; i < kSwPerThread; ++i) {
      const int idx = scale_thread + i * 128;
      const int r = idx / kKBlocks;
      const int b = idx % kKBlocks;
      sw_prefetch[i] = idx < kSwPerTile ? megamoe::fp32_from_bits(megamoe::fp4_word_scale_bits(__ldg(
                                              b_words + static_cast<long long>(b) * kGroups * kShapeN + first_row +
                                              r * kQuantBlock)))
                                        : 0.0f;
    }
#else
    const float* src = b_scales + (static_cast<long long>(t.group) * kScaleRowsPerGroup + t.n0 / kQuantBlock) *
                                      kKBlocks;
#pragma unroll
    for (int i = 0; i < kSwPerThread; ++i) {
      const int idx = scale_thread + i * 128;
      // Rows are contiguous in sw ([G, N/128, K/128]), so the tile's kSwRows rows are one run.
      sw_prefetch[i] = idx < kSwPerTile ? load_scale(src + idx) : 0.0f;
    }
#endif
  };
  auto store_weight_scales = [&](int buffer) {
#pragma unroll
    for (int i = 0; i < kSwPerThread; ++i) {
      const int idx = scale_thread + i * 128;
      if (idx < kSwPerTile) store_shared_f32(sw_smem + (buffer * kSwPerTile + idx) * 4, sw_prefetch[i]);
    }
  };

  int stage = 0;
  unsigned phase = 0;
  int cursor = 0;
  int iteration = 0;
  int tile = static_cast<int>(blockIdx.x);
  Tile current{};
  if (tile < total_tiles) {
    current = decode_tile(tile, cursor, prefix, groups);
    load_weight_scales(current);
    store_weight_scales(0);
  }

  // Turns on the tensor cores (kTakeTurns): warpgroup w waits at barrier kBarrierTurn + w before issuing
  // a chunk and arrives at the other's after. Warpgroup 1 arrives once before its first turn (warpgroup
  // 0's first) and warpgroup 0 waits once after its last (for warpgroup 1's last arrive), so both
  // barriers end complete.
  static_assert(!kTakeTurns || (kWavesM == 1 && !kPipelined), "turns are taken per chunk of one wave");
  const auto begin_turn = [&] { named_barrier_sync(kBarrierTurn + warpgroup, kMathThreads); };
  const auto end_turn = [&] { named_barrier_arrive(kBarrierTurn + (warpgroup ^ 1), kMathThreads); };
  if constexpr (kTakeTurns) {
    if (warpgroup == 1) end_turn();
  }

  float promoted[kWavesM][kChunksN][kAccum];
  float partial[kAccum];
  float partial_next[kAccum];  // the odd K blocks' partial, when pipelined (unused otherwise)

  // Epilogue of chunk c of wave w of tile t: each warp stages its 16 rows (pairs of adjacent columns of
  // rows frag_row and frag_row + 8 per thread), kRoundCols columns at a time, and copies them out in
  // 16-byte pieces; stage_pair(at, i, half) stores the thread's pair i (columns 8i + frag_col, + 1) of row
  // frag_row + 8·half. Deferred, it runs while a wgmma group is in flight, so it has no branch the
  // compiler cannot prove warp-uniform: every row is staged and only the stores are predicated.
  constexpr int kOutBytes = kOutBf16 ? 2 : 4;
  constexpr int kRoundCols = kMmaN < kStagedRowBytes / kOutBytes ? kMmaN : kStagedRowBytes / kOutBytes;
  constexpr int kRounds = kMmaN / kRoundCols;
  const auto write_chunk = [&](const Tile& t, int w, int c, auto&& stage_pair) {
    const int warp_row0 = t.row0 + wg_row0 + w * 64 + warp_in_wg * 16;
    const unsigned staged = staging + static_cast<unsigned>(lane / 4) * kStagingPitch + frag_col * kOutBytes;
    const int rows_valid = t.row_end - warp_row0;  // of the warp's 16; the others are never copied out
#pragma unroll
    for (int round = 0; round < kRounds; ++round) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (!kDeferredEpilogue && lane / 4 + 8 * half >= rows_valid) continue;
#pragma unroll
        for (int j = 0; j < kRoundCols / 8; ++j) {
          stage_pair(staged + 8 * half * kStagingPitch + 8 * j * kOutBytes, round * (kRoundCols / 8) + j, half);
        }
      }
      const long long first =
          static_cast<long long>(warp_row0) * kShapeN + t.n0 + wg_col0 + c * kMmaN + round * kRoundCols;
      copy_out_staged_rows<kRoundCols * kOutBytes, kStagingPitch, kDeferredEpilogue>(
          staging, static_cast<unsigned char*>(out) + first * kOutBytes, static_cast<long long>(kShapeN) * kOutBytes,
          rows_valid, lane);
    }
  };
  // The tile whose epilogue is pending (kDeferredEpilogue): none before the first tile, so no rows. A bf16
  // tile is packed to pairs at its end (kPackPending), which frees the accumulators for the next tile; an
  // fp32 one stays in them, each chunk's zeroed once written.
  Tile pending{};
  unsigned packed[kChunksN][kAccum / 2];
  if constexpr (kDeferredEpilogue) {
#pragma unroll
    for (int c = 0; c < kChunksN; ++c)
#pragma unroll
      for (int i = 0; i < kAccum; ++i) promoted[0][c][i] = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunksN; ++c)
#pragma unroll
      for (int i = 0; i < kAccum / 2; ++i) packed[c][i] = 0u;
  }
  const auto write_pending_chunk = [&](int c) {
    if constexpr (kPackPending) {
      write_chunk(pending, 0, c, [&](unsigned at, int i, int half) { store_shared_u32(at, packed[c][2 * i + half]); });
    } else {
      write_chunk(pending, 0, c, [&](unsigned at, int i, int half) {
        store_shared_v2(at, promoted[0][c][4 * i + 2 * half], promoted[0][c][4 * i + 2 * half + 1]);
      });
#pragma unroll
      for (int i = 0; i < kAccum; ++i) promoted[0][c][i] = 0.0f;
    }
  };

  // ---------------- Consumer mainloop: per tile, every K block's wgmmas and promotions.
  for (int local_tile = 0; tile < total_tiles; ++local_tile) {
    // Makes this tile's weight scales visible, and guarantees every thread of the warpgroup is done
    // reading the buffer that the prefetch below will overwrite (it served the previous tile).
    named_barrier_sync(kBarrierWarpgroup + warpgroup, 128);
    const int next_tile = tile + static_cast<int>(gridDim.x);
    Tile next{};
    if (next_tile < total_tiles) {
      next = decode_tile(next_tile, cursor, prefix, groups);
      load_weight_scales(next);
    }
    const unsigned sw_tile = sw_smem + (local_tile & 1) * kSwPerTile * 4;

    bool wave_active[kWavesM];
#pragma unroll
    for (int w = 0; w < kWavesM; ++w) wave_active[w] = current.row0 + wg_row0 + w * 64 < current.row_end;
    // The weight-scale row of each chunk (a 256-wide tile spans two 128-column scale blocks).
    int sw_row[kChunksN];
#pragma unroll
    for (int c = 0; c < kChunksN; ++c) sw_row[c] = ((current.n0 % kQuantBlock) + wg_col0 + c * kMmaN) / kQuantBlock;

    // (An fp32 pending tile still sits in the accumulators: each chunk's are zeroed once written.)
    if constexpr (kPackPending || !kDeferredEpilogue) {
#pragma unroll
      for (int w = 0; w < kWavesM; ++w)
#pragma unroll
        for (int c = 0; c < kChunksN; ++c)
#pragma unroll
          for (int i = 0; i < kAccum; ++i) promoted[w][c][i] = 0.0f;
    }

    if constexpr (kPipelined) {
      // Block kb's wgmmas go into one partial while block kb - 1, in the other, is promoted and its stage
      // released. The k loop is unrolled by two so that each buffer is fixed at compile time, the stage
      // wait spins warp-wide, and the wgmmas are issued even by a warpgroup whose rows all lie past the
      // group (never stored): a branch the compiler cannot prove uniform while a wgmma group is in flight
      // makes ptxas serialize every wgmma.
      int held_stage = 0;  // the stage of the block in flight
      float held_lo = 0.0f, held_hi = 0.0f;
      const auto promote_held = [&](float (&ready)[kAccum]) {
        promote_block(promoted[0][0], ready, held_lo, held_hi);
      };
      const auto step = [&](int kb, float (&issue)[kAccum], float (&ready)[kAccum]) {
        // The block's weight scale folded into the row scales now.
        const float sw = load_shared_f32(sw_tile + (sw_row[0] * kKBlocks + kb) * 4);
        mbar_wait<true>(full_bar + 8 * stage, phase, status, kStatusMathStalled, stage, iteration);
        const unsigned sa_stage = sa_smem + stage * kSaStride + (current.row0 & 3) * 4;
        const float lo = load_shared_f32(sa_stage) * sw;
        const float hi = load_shared_f32(sa_stage + 8 * 4) * sw;
        wgmma_issue_k128(issue, a_smem + stage * kATileBytes, b_smem + stage * kBTileBytes);
        if (kb > 0) {
          wgmma_wait<1>();  // block kb - 1 is done
          fence_registers(ready);
          promote_held(ready);
          release_stage(held_stage);
        }
        held_stage = stage;
        held_lo = lo;
        held_hi = hi;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
        ++iteration;
      };
      for (int kb = 0; kb < kKBlocks; kb += 2) {
        step(kb, partial, partial_next);
        if (kb + 1 < kKBlocks) step(kb + 1, partial_next, partial);
      }
      float (&last)[kAccum] = (kKBlocks & 1) == 0 ? partial_next : partial;  // the last block's partial
      wgmma_wait<0>();
      fence_registers(last);
      promote_held(last);
      release_stage(held_stage);
    } else {
      // One K block; kFirst (the tile's first, deferred epilogue only) also writes the pending tile.
      const auto k_block = [&](int kb, auto first) {
        constexpr bool kFirst = decltype(first)::kValue;
        float sw[kChunksN];
#pragma unroll
        for (int c = 0; c < kChunksN; ++c) sw[c] = load_shared_f32(sw_tile + (sw_row[c] * kKBlocks + kb) * 4);

        mbar_wait(full_bar + 8 * stage, phase, status, kStatusMathStalled, stage, iteration);

        const unsigned sa_stage = sa_smem + stage * kSaStride + (current.row0 & 3) * 4;
        float sa_lo[kWavesM], sa_hi[kWavesM];
#pragma unroll
        for (int w = 0; w < kWavesM; ++w) {
          sa_lo[w] = load_shared_f32(sa_stage + w * 64 * 4);
          sa_hi[w] = load_shared_f32(sa_stage + (w * 64 + 8) * 4);
        }
        // One block scale per chunk.
        const auto promote = [&](float (&acc)[kAccum], int w, int c) {
          promote_block(acc, partial, sa_lo[w] * sw[c], sa_hi[w] * sw[c]);
        };

        const unsigned a_stage = a_smem + stage * kATileBytes;
        const unsigned b_stage = b_smem + stage * kBTileBytes;
        if constexpr (kTakeTurns) {
          // Turns are taken on every tile, so warpgroup 1 issues its wgmmas even where all its rows lie
          // past the group (never stored). Taking them only where both have rows, in a K loop of its
          // own, measured 2.5% slower: ptxas schedules the issue worse.
#pragma unroll
          for (int c = 0; c < kChunksN; ++c) {
            begin_turn();
            wgmma_issue_k128(partial, a_stage, b_stage + c * kMmaN * kBlockK);
            end_turn();
            if constexpr (kFirst) write_pending_chunk(c);
            wgmma_wait<0>();
            fence_registers(partial);
            promote(promoted[0][c], 0, c);
          }
        } else {
#pragma unroll
          for (int w = 0; w < kWavesM; ++w) {
            if (!wave_active[w]) continue;  // every row of this wave lies past the group: nothing to store
#pragma unroll
            for (int c = 0; c < kChunksN; ++c) {
              wgmma_block_k128(partial, a_stage + w * 64 * kBlockK, b_stage + c * kMmaN * kBlockK);
              promote(promoted[w][c], w, c);
            }
          }
        }
        // This warp's wgmmas have completed (wait_group 0), so its reads of the stage are done.
        release_stage(stage);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      };
      // The first K block is peeled off where it writes the pending tile: inside the loop, the packed
      // pending tile would stay live (64 registers) through every K block.
      int kb = 0;
      if constexpr (kDeferredEpilogue) {
        k_block(kb++, CompileTimeFlag<true>{});
        ++iteration;
      }
      for (; kb < kKBlocks; ++kb, ++iteration) k_block(kb, CompileTimeFlag<false>{});
    }

    if (next_tile < total_tiles) store_weight_scales((local_tile + 1) & 1);

    // ---------------- Epilogue: the tile's output, now or (deferred) during the next tile's first K block.

    if constexpr (kDeferredEpilogue) {
      pending = current;
      if constexpr (kPackPending) {
#pragma unroll
        for (int c = 0; c < kChunksN; ++c)
#pragma unroll
          for (int i = 0; i < kAccum / 2; ++i) {
            packed[c][i] = megamoe::bf16x2_from_floats(promoted[0][c][2 * i], promoted[0][c][2 * i + 1]);
          }
      }
    } else {
#pragma unroll
      for (int w = 0; w < kWavesM; ++w) {
        if (!wave_active[w]) continue;
#pragma unroll
        for (int c = 0; c < kChunksN; ++c) {
          write_chunk(current, w, c, [&](unsigned at, int i, int half) {
            const float x = promoted[w][c][4 * i + 2 * half];
            const float y = promoted[w][c][4 * i + 2 * half + 1];
            if constexpr (kOutBf16) {
              store_shared_u32(at, megamoe::bf16x2_from_floats(x, y));
            } else {
              store_shared_v2(at, x, y);
            }
          });
        }
      }
    }

    current = next;
    tile = next_tile;
  }
  if constexpr (kDeferredEpilogue) {
#pragma unroll
    for (int c = 0; c < kChunksN; ++c) write_pending_chunk(c);
  }
  if constexpr (kTakeTurns) {
    if (warpgroup == 0) begin_turn();
  }
}

// ---------------------------------------------------------------------------------------------------
// Reference kernel: the same formula on CUDA cores, one thread per output element, no TMA, no wgmma.
// Slow; for diagnosing the fast kernel on the GPU: the same operands through plain pointers (sa in the
// same [K/128, M_pad] layout), so a layout fault shows in both kernels and a fast-path fault in one.

#if !B_FP4
extern "C" __global__ void __launch_bounds__(256)
    megamoe_fp8_grouped_gemm_reference(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
                                       const float* __restrict__ a_scales, int m_pad,
                                       const float* __restrict__ b_scales, const int* __restrict__ group_offsets,
                                       void* __restrict__ out, int m_total) {
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<long long>(m_total) * kShapeN) return;
  const int row = static_cast<int>(index / kShapeN);
  const int col = static_cast<int>(index % kShapeN);
  int group = -1;
  for (int g = 0; g < kGroups; ++g) {
    if (row >= group_offsets[g] && row < group_offsets[g + 1]) {
      group = g;
      break;
    }
  }
  if (group < 0) return;  // a row of no group is left untouched, like the fast kernel does
  const unsigned char* a_row = a + static_cast<long long>(row) * kShapeK;
  const unsigned char* b_row = b + (static_cast<long long>(group) * kShapeN + col) * kShapeK;
  const float* sw = b_scales + (static_cast<long long>(group) * kScaleRowsPerGroup + col / kQuantBlock) * kKBlocks;
  float acc = 0.0f;
  for (int kb = 0; kb < kKBlocks; ++kb) {
    float block_sum = 0.0f;
    for (int k = kb * kBlockK; k < (kb + 1) * kBlockK; k += 2) {
      const unsigned short a2 = *reinterpret_cast<const unsigned short*>(a_row + k);
      const unsigned short b2 = *reinterpret_cast<const unsigned short*>(b_row + k);
      unsigned a_half2, b_half2;  // e4m3x2 → f16x2 is exact
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(a_half2) : "h"(a2));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(b_half2) : "h"(b2));
      float a0, a1, b0, b1;
      asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
          : "=f"(a0), "=f"(a1)
          : "r"(a_half2));
      asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
          : "=f"(b0), "=f"(b1)
          : "r"(b_half2));
      block_sum = fmaf(a0, b0, block_sum);
      block_sum = fmaf(a1, b1, block_sum);
    }
    const float scale = a_scales[static_cast<long long>(kb) * m_pad + row] * sw[kb];
    acc = fmaf(block_sum, scale, acc);
  }
  if constexpr (kOutBf16) {
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(acc));
    static_cast<unsigned short*>(out)[index] = bits;
  } else {
    static_cast<float*>(out)[index] = acc;
  }
}
#else

// FP4 reference: the CPU rule itself on CUDA cores, one thread per output element. Each weight element is
// converted by fp4.cuh's exact path, each block's 128 products are summed in double (exact: e4m3
// products have at most 8 significant bits within 2^-18 .. 2^17), rounded once to fp32, and promoted
// with the rule's fmaf: bit-identical to the CPU reference on any data. Operands as the fast
// kernel's, through plain pointers (bs: the u32 scale words [K/128, G·N]).
extern "C" __global__ void __launch_bounds__(256)
    megamoe_fp4_grouped_gemm_reference(const unsigned char* __restrict__ a, const unsigned char* __restrict__ b,
                                       const float* __restrict__ a_scales, int m_pad,
                                       const unsigned* __restrict__ b_scales4, const int* __restrict__ group_offsets,
                                       void* __restrict__ out, int m_total) {
  const long long index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<long long>(m_total) * kShapeN) return;
  const int row = static_cast<int>(index / kShapeN);
  const int col = static_cast<int>(index % kShapeN);
  int group = -1;
  for (int g = 0; g < kGroups; ++g) {
    if (row >= group_offsets[g] && row < group_offsets[g + 1]) {
      group = g;
      break;
    }
  }
  if (group < 0) return;
  const long long b_row_index = static_cast<long long>(group) * kShapeN + col;
  const unsigned char* a_row = a + static_cast<long long>(row) * kShapeK;
  float acc = 0.0f;
  for (int kb = 0; kb < kKBlocks; ++kb) {
    const unsigned word = b_scales4[static_cast<long long>(kb) * kGroups * kShapeN + b_row_index];
    // In the device layout (fp4.cuh): K block kb of B row b_row_index, its quarters swizzled.
    const int b_row = static_cast<int>(b_row_index);
    const unsigned char* block =
        b + static_cast<long long>(megamoe::fp4_layout_row(b_row, kGroups * kShapeN, kb)) * (kBlockK / 2);
    double block_sum = 0.0;
    for (int k = kb * kBlockK; k < (kb + 1) * kBlockK; k += 2) {
      const int d = megamoe::kFp4Top - static_cast<int>(megamoe::fp4_word_offset(word, (k % kBlockK) / megamoe::kFp4Group));
      const unsigned short w2 = static_cast<unsigned short>(
          megamoe::e2m1_to_e4m3_exact(megamoe::fp4_layout_code(block, b_row, k % kBlockK), d) |
          (megamoe::e2m1_to_e4m3_exact(megamoe::fp4_layout_code(block, b_row, k % kBlockK + 1), d) << 8));
      const unsigned short a2 = *reinterpret_cast<const unsigned short*>(a_row + k);
      unsigned a_half2, b_half2;  // e4m3x2 → f16x2 is exact
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(a_half2) : "h"(a2));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(b_half2) : "h"(w2));
      float a0, a1, b0, b1;
      asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
          : "=f"(a0), "=f"(a1)
          : "r"(a_half2));
      asm("{\n.reg .f16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}\n"
          : "=f"(b0), "=f"(b1)
          : "r"(b_half2));
      block_sum = __dadd_rn(block_sum, __dmul_rn(a0, b0));
      block_sum = __dadd_rn(block_sum, __dmul_rn(a1, b1));
    }
    const float partial = __double2float_rn(block_sum);
    const float scale = megamoe::mul_rn(a_scales[static_cast<long long>(kb) * m_pad + row],
                                        megamoe::fp32_from_bits(megamoe::fp4_word_scale_bits(word)));
    acc = megamoe::fma_rn(partial, scale, acc);
  }
  if constexpr (kOutBf16) {
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(acc));
    static_cast<unsigned short*>(out)[index] = bits;
  } else {
    static_cast<float*>(out)[index] = acc;
  }
}
#endif
