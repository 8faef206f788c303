// Configuration of fp8_grouped_gemm.cu: the -D parameters captured as constants, the derived tile split,
// the shared-memory layout (src/kernels/gemm/fp8_grouped_gemm.variants.ts mirrors it), the status codes
// and the barrier wait that reports a stalled pipeline. Included by that file alone, once.

#pragma once

#include "common/bf16.cuh"
#include "common/sm90.cuh"

#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif
#ifndef BLOCK_K
#define BLOCK_K 128
#endif
#ifndef NUM_STAGES
#define NUM_STAGES 6
#endif
#ifndef NUM_MATH_WARPGROUPS
#define NUM_MATH_WARPGROUPS 2
#endif
#ifndef N
#define N 4096
#endif
#ifndef K
#define K 4096
#endif
#ifndef NUM_GROUPS
#define NUM_GROUPS 256
#endif
#ifndef OUT_BF16
#define OUT_BF16 0
#endif
// 1: B holds FP4 (MXFP4) weights, converted to e4m3 in shared memory (see fp8_grouped_gemm.cu).
#ifndef B_FP4
#define B_FP4 0
#endif

namespace gemm_shape {
constexpr int kN = N;
constexpr int kK = K;
}  // namespace gemm_shape
// Captured above: one-letter macros must not leak into anything below.
#undef N
#undef K

namespace {

using namespace megamoe::sm90;

// ---------------------------------------------------------------------------------------------------
// Configuration

constexpr int kBlockM = BLOCK_M;
constexpr int kBlockN = BLOCK_N;
constexpr int kBlockK = BLOCK_K;
constexpr int kStages = NUM_STAGES;
constexpr int kMathWarpgroups = NUM_MATH_WARPGROUPS;
constexpr int kShapeN = gemm_shape::kN;
constexpr int kShapeK = gemm_shape::kK;
constexpr int kGroups = NUM_GROUPS;
constexpr bool kOutBf16 = OUT_BF16 != 0;
constexpr bool kBFp4 = B_FP4 != 0;
// Nanoseconds a barrier wait may take before the kernel gives up and reports a stalled pipeline.
constexpr unsigned long long kWatchdogNs = 2000000000ull;

constexpr int kQuantBlock = 128;  // edge of a weight-scale block and width of an activation scale
constexpr int kMathThreads = 128 * kMathWarpgroups;
constexpr int kThreads = kMathThreads + 128;
constexpr int kKBlocks = kShapeK / kBlockK;
constexpr int kNBlocks = kShapeN / kBlockN;
constexpr int kScaleRowsPerGroup = kShapeN / kQuantBlock;  // sw rows (128 output columns each) per group

static_assert(kBlockK == 128, "BLOCK_K must be 128: one wgmma batch per activation/weight scale block");
static_assert(kBlockM == 64 || kBlockM == 128, "BLOCK_M must be 64 or 128");
static_assert(kBlockN == 64 || kBlockN == 128 || kBlockN == 256, "BLOCK_N must be 64, 128 or 256");
static_assert(kMathWarpgroups == 1 || kMathWarpgroups == 2, "NUM_MATH_WARPGROUPS must be 1 or 2");
static_assert(kStages >= 2 && kStages <= 16, "NUM_STAGES must be in 2..16");
static_assert(kShapeK > 0 && kShapeK % kBlockK == 0, "K must be a positive multiple of 128");
static_assert(kShapeN > 0 && kShapeN % kQuantBlock == 0, "N must be a positive multiple of 128");
static_assert(kShapeN % kBlockN == 0, "N must be a multiple of BLOCK_N (a B tile never crosses groups)");
static_assert(kGroups >= 1 && kGroups <= 1024, "NUM_GROUPS must be in 1..1024");
static_assert(kShapeK <= 65536, "K above 65536 would overflow the tile bookkeeping");

// How the math warpgroups split the BLOCK_M × BLOCK_N tile: along M first (64 rows each), then along N.
// A warpgroup owns kWgRows × kWgCols, computed as kWavesM × kChunksN wgmmas of m64 × n(kMmaN).
constexpr int kWgAlongM = (kBlockM / 64) < kMathWarpgroups ? (kBlockM / 64) : kMathWarpgroups;
constexpr int kWgAlongN = kMathWarpgroups / kWgAlongM;
constexpr int kWgRows = kBlockM / kWgAlongM;
constexpr int kWgCols = kBlockN / kWgAlongN;
constexpr int kWavesM = kWgRows / 64;
constexpr int kMmaN = kWgCols < 128 ? kWgCols : 128;
constexpr int kChunksN = kWgCols / kMmaN;
constexpr int kAccum = kMmaN / 2;  // fp32 accumulator registers per thread of one m64 × n(kMmaN) wgmma
static_assert(kWgAlongM * kWgAlongN == kMathWarpgroups, "math warpgroups must tile the block");
static_assert(kMmaN == 32 || kMmaN == 64 || kMmaN == 128, "unsupported wgmma N");
static_assert(kWavesM * kChunksN * kAccum <= 128, "promoted accumulators would not fit in registers");
// A single math warpgroup with one chunk (n128 or less) has the registers for a second partial
// accumulator: the tensor cores then work on block kb + 1 while it promotes block kb, instead of idling
// through every promotion (m64n128: 1.2–1.3× on the flash shapes). Two warpgroups already fill each
// other's promotions (no gain measured, and spills at pro's K), so they keep the plain loop. The
// promotions stay in K order: the sums are the same. Not with FP4 weights and fp32 output: it spilled
// there (28 bytes at 255 registers) with a scale per column, and has not been measured since.
constexpr bool kPipelined = kMathWarpgroups == 1 && kWavesM == 1 && kChunksN == 1 && (!kBFp4 || kOutBf16);

// Weight scales of one tile: kSwRows rows of kKBlocks values (a 256-wide tile spans two 128-row blocks).
constexpr int kSwRows = (kBlockN + kQuantBlock - 1) / kQuantBlock;
constexpr int kSwPerTile = kSwRows * kKBlocks;
// Two math warpgroups working on the same K block issue their chunks at once, finish them at once and
// promote at once, and the tensor cores idle meanwhile. Taking turns (a warpgroup issues a chunk only
// after the other issued its previous one) makes one's promotion overlap the other's wgmmas: 2% on
// m128n256 at M = 512 and 2048 per group, 4–7% on m128n128 (docs/decisions.md, turns).
// Each warpgroup stages its own copy of a tile's weight scales, so the two never meet at a barrier.
constexpr bool kTakeTurns = kMathWarpgroups == 2;
constexpr int kSwPerThread = (kSwPerTile + 127) / 128;  // one warpgroup stages a copy
// With turns, a tile's epilogue is written during the next tile's first K block: chunk c's output goes
// out right after the warpgroup issues the next tile's chunk c, so the stores drain while the tensor
// cores work, instead of both warpgroups writing at the tile's end while the tensor cores idle (3–5% at
// M ≥ 512 per group; docs/decisions.md, the deferred epilogue). Until then the tile waits packed to bf16
// pairs (kPackPending), or, in fp32, in the accumulators themselves; not with fp32 and two K blocks, where
// the straight-line code keeps it live beside both blocks' work and spills (test shapes only).
constexpr bool kDeferredEpilogue = kTakeTurns && (kOutBf16 || kKBlocks != 2);
constexpr bool kPackPending = kDeferredEpilogue && kOutBf16;
// Named barriers: 2 + w warpgroup w alone, 4 + w warpgroup w's turn to issue.
constexpr unsigned kBarrierWarpgroup = 2;
constexpr unsigned kBarrierTurn = 4;

// FP4 weights: warps 1..3 of the producer warpgroup convert each stage's packed nibbles into the e4m3
// B tile (warp 0's lane 0 keeps issuing the TMA loads, so the loads run a whole ring ahead of them).
constexpr int kConverterWarps = 3;
constexpr int kConverterThreads = 32 * kConverterWarps;

// Registers: with three warpgroups the entry cap is 65536 / 384 → 168; the producer gives most of its
// share to the math warpgroups (2 · 128 · 232 + 128 · 40 = 64512 ≤ 65536). Two warpgroups fit 255 each.
// The FP4 converters need more than the TMA thread alone (two items in flight, interleaved: 56 spilled
// at the 128-row tiles): 2 · 128 · 216 + 128 · 72 = 64512, the fused kernel's EP converter split.
constexpr bool kReconfigureRegisters = kMathWarpgroups == 2;
constexpr int kProducerRegisters = kBFp4 ? 72 : 40;
constexpr int kMathRegisters = kBFp4 ? 216 : 232;

// ---------------------------------------------------------------------------------------------------
// Shared memory layout (byte offsets from a 1024-aligned base; fp8_grouped_gemm.variants.ts: gemmSharedBytes
// mirrors this formula)

constexpr unsigned kATileBytes = kBlockM * kBlockK;  // e4m3
constexpr unsigned kBTileBytes = kBlockN * kBlockK;
// A scales arrive by TMA from row0 rounded down to a multiple of 4: a box's start in the inner
// dimension must be 16-byte aligned (an unaligned start is an illegal instruction), and groups start
// at any row. So the box holds 4 more rows, and readers skip row0 % 4 of them.
constexpr unsigned kSaBoxRows = kBlockM + 4;
constexpr unsigned kSaBytes = kSaBoxRows * 4;
constexpr unsigned kSaStride = align_up(kSaBytes, 128);
// FP4 B, per stage: the packed nibbles (TMA, BLOCK_N rows of 64 bytes in the device order, 64-byte
// swizzle) and each row's reference word (TMA of one u32 per row from the [K/128, G·N] layout the host
// prepares). The B tile then holds the converted e4m3 codes in the layout the TMA gives FP8 B; the
// promotion takes each 128 × 128 block's scale from the word of the block's first row (b_words).
constexpr unsigned kPackedTileBytes = kBlockN * kBlockK / 2;
constexpr unsigned kBScaleBytes = kBlockN * 4;
constexpr unsigned kStageTxBytes =
    kBFp4 ? kATileBytes + kPackedTileBytes + kSaBytes + kBScaleBytes : kATileBytes + kBTileBytes + kSaBytes;

constexpr unsigned kOffA = 0;
constexpr unsigned kOffB = kOffA + kStages * kATileBytes;
constexpr unsigned kOffSa = kOffB + kStages * kBTileBytes;
// FP4 only (0 bytes otherwise): 1024-aligned, for the packed rows' 64-byte swizzle.
constexpr unsigned kOffPacked = kBFp4 ? align_up(kOffSa + kStages * kSaStride, 1024) : kOffSa + kStages * kSaStride;
constexpr unsigned kOffBScales = kOffPacked + (kBFp4 ? kStages * kPackedTileBytes : 0u);  // u32 per row
constexpr unsigned kOffSw = kOffBScales + (kBFp4 ? kStages * kBScaleBytes : 0u);
// The tile's 128 × 128 weight scales, two buffers per warpgroup.
constexpr unsigned kSwBytes = 2 * kMathWarpgroups * kSwPerTile * 4;
constexpr unsigned kOffFull = align_up(kOffSw + kSwBytes, 8);
constexpr unsigned kOffEmpty = kOffFull + 8 * kStages;
constexpr unsigned kOffLoaded = kOffEmpty + 8 * kStages;  // FP4 only: the TMA's barriers, before conversion
constexpr unsigned kOffGroups = kOffLoaded + (kBFp4 ? 8 * kStages : 0u);  // GroupRows[kGroups]
constexpr unsigned kOffPrefix = kOffGroups + 8 * kGroups;  // int[kGroups + 1]: first tile of each group
// Epilogue staging (megamoe/sm90.cuh: copy_out_staged_rows), one area per math warp: 16 rows of up to
// 128 bytes, 144 bytes apart for the bf16 pairs' 4-byte stores and 160 for the fp32 pairs' 8-byte ones
// (either way the 8 rows of one store instruction fall on different banks).
constexpr int kMathWarps = kMathThreads / 32;
constexpr unsigned kStagingPitch = kOutBf16 ? kStagingPitchNarrow : kStagingPitchWide;
constexpr unsigned kStagingWarpBytes = staging_area_bytes(kStagingPitchWide);  // the variants size it for either
constexpr unsigned kOffStaging = align_up(kOffPrefix + 4 * (kGroups + 1), 16);
constexpr unsigned kSmemBytes = kOffStaging + kMathWarps * kStagingWarpBytes;
constexpr unsigned kSmemAlign = 1024;  // the 128-byte swizzle pattern repeats every 1024 bytes
constexpr unsigned kDynamicSmemBytes = kSmemBytes + kSmemAlign;  // + slack to align the base
static_assert(kATileBytes % 1024 == 0 && kBTileBytes % 1024 == 0, "tiles must keep 1024-byte alignment");
static_assert(kSaStride % 128 == 0 && kPackedTileBytes % 512 == 0, "FP4 packed stages must keep their swizzle's alignment");
static_assert(kDynamicSmemBytes <= 232448, "shared memory above the 227 KB opt-in limit");

// Status codes written to status[0] (status[1..3]: block, stage, k-block iteration).
constexpr int kStatusProducerStalled = 1;
constexpr int kStatusMathStalled = 2;
constexpr int kStatusSharedMemoryTooSmall = 3;

// ---------------------------------------------------------------------------------------------------
// Helpers (the PTX wrappers live in megamoe/sm90.cuh)

// Waits for the phase of parity `parity` to complete; a wait that outlasts kWatchdogNs records where
// in `status` (first thread to notice) and exits (sm90.cuh: mbar_wait_bounded).
// kWarp: every lane of the warp spins (sm90.cuh: mbar_wait_bounded_warp), for waits that a wgmma group
// in flight spans.
template <bool kWarp = false>
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity, int* status, int code, int stage,
                                          int iteration) {
  const auto on_stall = [&] {
    if (status != nullptr && atomicCAS(status, 0, code) == 0) {
      status[1] = static_cast<int>(blockIdx.x);
      status[2] = stage;
      status[3] = iteration;
      __threadfence();
    }
  };
  if constexpr (kWarp) mbar_wait_bounded_warp(bar, parity, kWatchdogNs, on_stall);
  else mbar_wait_bounded(bar, parity, kWatchdogNs, on_stall);
}

template <bool kFlag>
struct CompileTimeFlag {
  static constexpr bool kValue = kFlag;
};

__device__ __forceinline__ int clamp_int(int x, int lo, int hi) { return x < lo ? lo : (x > hi ? hi : x); }

}  // namespace
