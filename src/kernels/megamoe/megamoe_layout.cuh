// Where the fused kernel keeps its state: the CTA's shared-memory layout (megamoe.variants.ts
// fusedSharedBytes mirrors it), the global workspace of counters, the task slots and the operands
// struct that megamoe.ts writes byte by byte.

#pragma once

#include "common/fp4_stage.cuh"
#include "megamoe_config.cuh"

namespace {

// ---------------------------------------------------------------------------------------------------
// Shared memory (byte offsets from a 1024-aligned base; megamoe.variants.ts mirrors the total)

constexpr unsigned kATileBytes = kBlockM * kBlockK;
constexpr unsigned kBTileBytes = kBlockN * kBlockK;
constexpr unsigned kBHalfBytes = kBTileBytes / 2;  // one 128-row TMA box
// A scales come by TMA from row0 rounded down to 4 (a box's inner start must be 16-byte aligned).
constexpr unsigned kSaBoxRows = kBlockM + 4;
constexpr unsigned kSaBytes = kSaBoxRows * 4;
constexpr unsigned kSaStride = align_up(kSaBytes, 128);
constexpr unsigned kStageTxBytes = kATileBytes + kBTileBytes + kSaBytes;
// FP4 stages (routed tasks of a B_FP4 build): the TMA brings the packed rows and their reference words
// to `loaded`, A and its scales to `full`; the converters write the B tile (the tiles promote with the
// block scales of the task slot, as FP8's). Expand builds: a stage of a routed task is the expanded tile,
// one copy.
constexpr bool kPackedStages = kBFp4 && !kExpand;
constexpr unsigned kPackedStageBytes = kPackedStages ? kBlockN * megamoe::fp4_stage::kPackedRowBytes : 0u;
constexpr unsigned kRowWordsStageBytes = kPackedStages ? kBlockN * megamoe::fp4_stage::kRowWordBytes : 0u;
constexpr unsigned kFp4LoadedTxBytes = kPackedStageBytes + kRowWordsStageBytes;
constexpr unsigned kFp4FullTxBytes = kATileBytes + kSaBytes;
// kFp4Regs (swap-AB FP4): no B tile and no fp32 scales (the math threads convert from the packed rows),
// everything to `full`. The shared expert's FP8 K block takes two stages, one 128-row box (16 KB, the
// size of a packed stage) in each stage's packed area; A and its scales ride with the first box.
constexpr unsigned kBStageBytes = kFp4Regs ? 0u : kBTileBytes;
constexpr unsigned kExpandedTxBytes = kBTileBytes;
constexpr unsigned kFp4RegsTxBytes = kFp4LoadedTxBytes + kFp4FullTxBytes;
static_assert(!kFp4Regs || kPackedStageBytes == kBHalfBytes, "a shared-expert box fills a packed stage");

// The two 128-row B boxes of a tile: L1 gate rows n·128 and up rows I + n·128 of the expert's [2I, H];
// L2 rows n·256 and n·256 + 128 of its [H, I].
__device__ __forceinline__ int tile_b_row0(bool l1, int expert, int n, int inter) {
  return l1 ? expert * 2 * inter + n * kQuant : expert * kHidden + n * kBlockN;
}
__device__ __forceinline__ int tile_b_row1(bool l1, int b_row0, int inter) {
  return l1 ? b_row0 + inter : b_row0 + kQuant;
}

// A routed FP4 stage by TMA: K block kb's packed nibbles of both 128-row B boxes at `packed` and their
// UE8M0 words at `words`, each box's half after the other's; one barrier for all four. The device layout
// (fp4.cuh) is K-block-major with each block's quarters pre-swizzled: a 3-D map of two 64-byte rows per
// 128-byte TMA row lands the same 64-byte-swizzled image (the halved rows are computed here: kept across
// the loop, they spilled the producer).
constexpr unsigned kPackedBoxBytes = (kBlockN / 2) * megamoe::fp4_stage::kPackedRowBytes;
constexpr unsigned kWordsBoxBytes = (kBlockN / 2) * megamoe::fp4_stage::kRowWordBytes;
__device__ __forceinline__ void load_packed_stage(unsigned packed, unsigned words, const TensorMap* map_b,
                                                  const TensorMap* map_words, unsigned bar, int kb, int b_row0,
                                                  int b_row1) {
  tma_load_3d(packed, map_b, bar, 0, opaque_i32(b_row0) >> 1, kb);
  tma_load_3d(packed + kPackedBoxBytes, map_b, bar, 0, opaque_i32(b_row1) >> 1, kb);
  tma_load_2d(words, map_words, bar, b_row0, kb);
  tma_load_2d(words + kWordsBoxBytes, map_words, bar, b_row1, kb);
}

constexpr unsigned kOffA = 0;
constexpr unsigned kOffB = kOffA + kStages * kATileBytes;
constexpr unsigned kOffSa = kOffB + kStages * kBStageBytes;
// FP4 only: 1024-aligned, for the 64-byte swizzle of the packed boxes (and, kFp4Regs, the 128-byte one of
// the shared expert's FP8 boxes).
constexpr unsigned kOffPacked = kBFp4 ? align_up(kOffSa + kStages * kSaStride, 1024) : kOffSa + kStages * kSaStride;
// Expand builds: the expansion workers' buffer (megamoe_expand.cuh) where the packed stages would be: a
// stage's packed rows (64-byte swizzle, so at the 1024-aligned start), the e4m3 tile and the words.
constexpr unsigned kExpandPackedBytes = kBlockN * megamoe::fp4_stage::kPackedRowBytes;
constexpr unsigned kExpandWordsBytes = kBlockN * megamoe::fp4_stage::kRowWordBytes;
constexpr unsigned kExpandTileOffset = kExpandPackedBytes;
constexpr unsigned kExpandWordsOffset = kExpandTileOffset + kBTileBytes;
constexpr unsigned kExpandBufferBytes = kExpand ? align_up(kExpandWordsOffset + kExpandWordsBytes, 1024) : 0u;
constexpr unsigned kOffRowWords = kOffPacked + kStages * kPackedStageBytes + kExpandBufferBytes;  // FP4: reference words
// Task slots: the Task (32 bytes) and the tile's two weight-scale rows of up to kMaxKBlocks floats.
constexpr unsigned kTaskSlotBytes = align_up(32 + 2 * kMaxKBlocks * 4, 16);
constexpr unsigned kOffTasks = kOffRowWords + kStages * kRowWordsStageBytes;
constexpr unsigned kOffBars = align_up(kOffTasks + 2 * kTaskSlotBytes, 8);
// full[S], empty[S], task_full[2], task_empty[2], and the converters' loaded[S] (the TMA's bytes, before
// conversion) or the expansion buffer's loaded.
constexpr bool kConverters = kBFp4 && !kFp4Regs && !kExpand;
// Expand builds: one `loaded` barrier there, for the expansion's buffer (megamoe_expand.cuh).
constexpr unsigned kBarCount = 2 * kStages + 4 + (kConverters ? kStages : 0) + (kExpand ? 1 : 0);
// Converters: what the producer put in each stage for them (StageKind), written before `loaded`.
constexpr unsigned kOffStageKinds = kOffBars + 8 * kBarCount;
constexpr unsigned kStageKindBytes = kConverters ? 4 * kStages : 0u;
// Row amax exchange of the L1 epilogue: float[2][64] (BLOCK_M 64: per warpgroup and row) or, swap-AB,
// float[kMathWarps][kBlockM] (per warp and row).
constexpr unsigned kAmaxFloats = kSwapAB ? kMathWarps * kBlockM : 0;
constexpr unsigned kAmaxBytes = (kAmaxFloats > 2 * 64 ? kAmaxFloats : 2 * 64) * 4;  // fusedSharedBytes: the same max
constexpr unsigned kOffAmax = kOffStageKinds + kStageKindBytes;
constexpr unsigned kOffOffsets = kOffAmax + kAmaxBytes;  // int[kGroups + 1]: first pool row per group
constexpr unsigned kOffBlocks = kOffOffsets + 4 * (kGroups + 1);  // int[kGroups + 1]: first block per group
constexpr unsigned kOffHist = kOffBlocks + 4 * (kGroups + 1);     // int[kGroups]: a chunk's counts
constexpr unsigned kOffBroadcast = kOffHist + 4 * kGroups;        // int[4]
// Epilogue staging, one area per math warp: the warp writes its 16 rows of a tile here in the wgmma
// fragment's scattered order, then copies them out in 16-byte pieces, so that a global store covers 4
// rows × 128 bytes instead of 8 rows × 8 (L1) or 16 (L2) bytes. Rows lie 144 bytes apart: the 8 rows of
// one fragment store then start 4 banks apart and never conflict.
constexpr unsigned kStagingPitch = kStagingPitchNarrow;
constexpr unsigned kStagingWarpBytes = staging_area_bytes(kStagingPitch);
constexpr unsigned kOffStaging = align_up(kOffBroadcast + 16, 16);
constexpr unsigned kSmemBytes = kOffStaging + kMathWarps * kStagingWarpBytes;
constexpr unsigned kSmemAlign = 1024;
constexpr unsigned kDynamicSmemBytes = kSmemBytes + kSmemAlign;
static_assert((!kBFp4 || (kOffPacked % 1024 == 0 && kPackedBoxBytes % 512 == 0)) && kOffRowWords % 16 == 0,
              "the packed boxes keep their 64-byte swizzle's alignment; TMA destinations need 16 bytes");
static_assert(kDynamicSmemBytes <= 232448, "shared memory above the 227 KB opt-in limit");
#ifdef SHARED_BYTES
// The launcher's mirror of this layout (megamoe.variants.ts: fusedSharedBytes) passes its figure: a
// mismatch fails the build (CI compiles every variant) instead of a launch.
static_assert(kDynamicSmemBytes == SHARED_BYTES, "megamoe.variants.ts fusedSharedBytes disagrees with this layout");
#endif

// Workspace words (int32, zero between launches). Then counts[kGroups], cursor[kGroups],
// arrived[max_blocks], l1_done[max_blocks] and expanded[2 · kExperts] (expand builds: chunks of each
// expert's W1, then W2, expanded so far).
enum Counter : int {
  kCountClaim = 0,
  kCountDone,
  kPlaceClaim,
  kPlaceDone,
  kTaskClaim,
  kL2Done,
  kExitCount,
  kExpandClaim,       // expand builds: the next weight chunk to expand
  kCounterWords = 8,  // megamoe.variants.ts FUSED_COUNTER_WORDS
};

enum TaskKind : int { kTaskNone = 0, kTaskL1 = 1, kTaskL2 = 2 };

// FP4 builds: a stage's packed FP4 weights to convert, FP8 weights already in place (the shared
// expert), or no stage: the producer is done and the converters leave.
enum StageKind : int { kStageFp4 = 0, kStageFp8 = 1, kStageStop = 2 };

// What the producer hands the math warpgroups (one 32-byte task slot).
struct Task {
  int kind;
  int group;
  int block;    // global pool block
  int row0;     // first pool row of the tile
  int row_end;  // end of the group's rows
  int n;        // L1: 128-channel block of the intermediate; L2: 256-column block of the output
  int k_blocks;
  int pad;
};

struct Operands {
  const unsigned char* xq;   // e4m3 [T, H]
  const float* x_scales;     // fp32 [T, H/128]
  const int* ids;            // int32 [T, k]
  const float* weights;      // fp32 [T, k]
  const float* w1_scales;    // fp32 [E, 2I/128, H/128]
  const float* w2_scales;    // fp32 [E, H/128, I/128]
  const float* w1s_scales;   // fp32 [2Is/128, H/128] (shared expert)
  const float* w2s_scales;   // fp32 [H/128, Is/128]
  unsigned char* pool_x;     // e4m3 [R, H]: routed rows by expert, then the shared expert's T rows
  float* pool_x_scales;      // fp32 [H/128, r_pad]
  unsigned char* pool_h;     // e4m3 [R, I_max]
  float* pool_h_scales;      // fp32 [I_max/128, r_pad]
  unsigned short* y;         // bf16 [R, H]: L2 rows
  int* slot_row;             // int32 [T, k]: pool row of each slot, −1 when not routed
  unsigned short* out;       // bf16 [T, H]
  int* workspace;
  int* status;
  unsigned long long* trace;  // null, or kTraceWords per CTA (see Trace)
  unsigned char* images;      // expand builds: the routed stages' images (megamoe_expand.cuh), else null
  int tokens;
  int r_pad;
  int max_blocks;
  int use_shared;
  int has_clamp;
  float clamp;
};

// megamoe.ts writes this struct byte by byte (OPERAND_POINTERS, OFF_*): the layout it assumes. NVRTC
// has no offsetof builtin; the nvcc build of CI's kernel check asserts the layout.
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(Operands, images) == 18 * 8, "megamoe.ts: 19 pointers first");
static_assert(__builtin_offsetof(Operands, tokens) == 19 * 8, "megamoe.ts: OFF_TOKENS");
static_assert(__builtin_offsetof(Operands, clamp) == 19 * 8 + 20, "megamoe.ts: OFF_CLAMP");
#endif
static_assert(sizeof(Operands) == 19 * 8 + 24, "megamoe.ts: OPERANDS_BYTES");

// The CTA's shared memory as the phases use it (the kernel fills it from its 1024-aligned base).
struct SharedState {
  unsigned char* smem;      // the base, as a generic pointer
  unsigned base;            // the base, as a shared-window address
  int* offsets;             // int[kGroups + 1]: first pool row per group
  int* blocks;              // int[kGroups + 1]: first pool block per group
  int* hist;                // int[kGroups]: a count chunk's histogram
  int* broadcast;           // int[4]: what one thread hands the CTA
  unsigned full_bar;        // [kStages]: a stage's operands landed
  unsigned empty_bar;       // [kStages]: a stage's operands consumed
  unsigned task_full_bar;   // [2]: a task slot written
  unsigned task_empty_bar;  // [2]: a task slot read
};

// The workspace: its Counter words, then the per-group and per-block arrays.
struct Workspace {
  int* counters;  // the Counter words
  int* counts;    // int[kGroups]: rows routed to each expert
  int* cursor;    // int[kGroups]: rows placed so far per expert
  int* arrived;   // int[max_blocks]: rows placed per pool block
  int* l1_done;   // int[max_blocks]: L1 tile publications per pool block
  int* expanded;  // int[2 · kExperts]: expand builds, chunks expanded per expert (W1, then W2)
};

}  // namespace
