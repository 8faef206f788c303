// MegaMoE: the MoE layer after the gate as one persistent kernel launch (sm_90a).
//
// In: the token rows in FP8 (xq [T, H] e4m3, x_scales [T, H/128] fp32) and the routing (ids, weights
// [T, k]). Out: bf16 [T, H] = Σ_slots w · L2(SwiGLU(L1(x))) in slot order + the shared expert, with every
// rounding of docs/numerics.md, bit-identical to the unfused pipeline (src/pipeline/unfused.ts).
//
// Phases, all inside one launch of one CTA per SM. Every piece of work is *claimed* from a global
// counter, and a CTA claims the next phase's work only once the previous phase's counter is exhausted;
// so every wait is on work already claimed by a running CTA that needs nothing from a later phase, and
// the kernel cannot deadlock even when fewer CTAs than the grid are resident.
//   1. count    chunks of the routing -> per-expert row counts (global atomics)
//   2. offsets  every CTA scans the counts: expert e's rows in the pool are [offset[e], offset[e + 1]),
//               cut into 128-row blocks; the shared expert is one more group over all T tokens, last
//   3. place    chunks of tokens: each routed (token, slot) takes a row of its expert (global atomics),
//               its FP8 row and scales are copied into the pool (scales transposed for TMA), and the
//               row's block counts its arrival (release); slot_row[token, slot] = pool row or −1
//   4. tiles    a producer thread claims tasks: all L1 tiles (pool block × 128 channels of gate and up),
//               then all L2 tiles (pool block × 256 output columns); it hands each task to the math
//               warpgroups through a 2-slot shared-memory ring and streams the tile's A, A scales and B
//               through the stage ring (TMA, mbarriers). Before an L1 tile's rows it waits for their
//               arrival; before an L2 tile's rows it waits until every L1 tile of the block is done. The
//               B tiles (weights) of the first stages are requested before that wait, so weight
//               streaming overlaps it.
//               L1 epilogue: gate and up of the same channels sit in one tile, so SwiGLU, the per-128
//               amax and the FP8 re-quantization happen in registers; the h rows and scales go to the
//               intermediate pool and the block's L1 counter is bumped (release).
//               L2 epilogue: bf16 rows to y [rows, H].
//   5. combine  once every L2 tile is done: per token, Σ_slots w · y[slot_row] in slot order, + the shared
//               expert's y row, rounded once to bf16.
//   The last CTA to finish zeroes the workspace for the next launch.
//
// Every wait is bounded (kWatchdogNs): a wait that outlasts it records what it waited for in `status`
// and traps, so a bug ends the launch with an error instead of hanging the GPU (report() says why a
// trap and not an exit).
//
// Compile-time parameters (-D, from megamoe.variants.ts): HIDDEN, INTER (routed experts' intermediate),
// SHARED_INTER (the shared expert's, 0: none), NUM_EXPERTS, TOP_K, BLOCK_M (128, 64, or 32 and 16 for the
// swap-AB tiles of decode), NUM_STAGES, SCALE_UE8M0,
// and SHARED_BYTES (the launcher's figure for the layout below, checked against it). Diagnosis only:
// MEGAMOE_DIAG_SKIP_MMA 1 issues no wgmma (every stage is still waited for, promoted and released; the
// results are wrong), to time the kernel without its tensor work.
#include "megamoe/bf16.cuh"
#include "megamoe/moe_rules.cuh"
#include "megamoe/ptx.cuh"
#include "megamoe/quant.cuh"
#include "megamoe/sm90.cuh"

#ifndef HIDDEN
#define HIDDEN 4096
#endif
#ifndef INTER
#define INTER 2048
#endif
#ifndef SHARED_INTER
#define SHARED_INTER 2048
#endif
#ifndef NUM_EXPERTS
#define NUM_EXPERTS 32
#endif
#ifndef TOP_K
#define TOP_K 6
#endif
#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef NUM_STAGES
#define NUM_STAGES 4
#endif
#ifndef SCALE_UE8M0
#define SCALE_UE8M0 0
#endif
#ifndef MEGAMOE_WATCHDOG_NS
#define MEGAMOE_WATCHDOG_NS 2000000000ull
#endif
#ifndef MEGAMOE_DIAG_SKIP_MMA
#define MEGAMOE_DIAG_SKIP_MMA 0
#endif

namespace {

using megamoe::u32x4;
using namespace megamoe::sm90;

// ---------------------------------------------------------------------------------------------------
// Configuration

constexpr int kHidden = HIDDEN;
constexpr int kInter = INTER;
constexpr int kSharedInter = SHARED_INTER;
constexpr int kExperts = NUM_EXPERTS;
constexpr int kTopK = TOP_K;
constexpr int kStages = NUM_STAGES;
constexpr bool kUe8m0 = SCALE_UE8M0 != 0;
constexpr unsigned long long kWatchdogNs = MEGAMOE_WATCHDOG_NS;

constexpr int kQuant = 128;      // channels per activation scale; edge of a weight-scale block
constexpr int kBlockM = BLOCK_M;  // pool rows per tile (Split / SwapSplit say how the warpgroups share it)
// BLOCK_M 16 or 32: swap-AB, the decode shape. The weights ride on the wgmma's M side and the tile's
// few rows on its N side, so a tile costs the tensor cores kBlockM / 64 of a 64-row tile's work.
constexpr bool kSwapAB = kBlockM < 64;
constexpr int kBlockN = 256;     // L1: 128 gate + 128 up channels; L2: 256 output columns
constexpr int kBlockK = 128;
constexpr int kMathThreads = 256;
constexpr int kThreads = kMathThreads + 128;  // + the producer warpgroup
constexpr int kMathWarps = kMathThreads / 32;
constexpr int kAccum = 64;                   // fp32 accumulators per thread of one m64 × n128 chunk
constexpr int kGroups = kExperts + 1;        // group kExperts: the shared expert
constexpr int kMaxInter = kInter > kSharedInter ? kInter : kSharedInter;
constexpr int kHiddenBlocks = kHidden / kQuant;
constexpr int kL2TilesPerBlock = kHidden / kBlockN;
constexpr int kMaxKBlocks = kHiddenBlocks > kMaxInter / kQuant ? kHiddenBlocks : kMaxInter / kQuant;

static_assert(kBlockM == 16 || kBlockM == 32 || kBlockM == 64 || kBlockM == 128, "BLOCK_M must be 16, 32, 64 or 128");
static_assert(kHidden % kBlockN == 0, "HIDDEN must be a multiple of 256");
static_assert(kInter > 0 && kInter % kQuant == 0, "INTER must be a positive multiple of 128");
static_assert(kSharedInter % kQuant == 0, "SHARED_INTER must be a multiple of 128");
static_assert(kExperts >= 1 && kExperts <= 1024, "NUM_EXPERTS must be in 1..1024");
static_assert(kTopK >= 1 && kTopK <= 32, "TOP_K must be in 1..32");
static_assert(kStages >= 2 && kStages <= 8, "NUM_STAGES must be in 2..8");

// Work chunks of the dispatch phases.
constexpr int kCountChunkSlots = 4096;
constexpr int kMaxPlaceChunkTokens = 64;  // about T / CTAs: every CTA takes a share, in few claims
constexpr int kRowVectorsPerLane = (kHidden / 16 + 31) / 32;  // 16-byte pieces of a row per lane
constexpr int kRowScalesPerLane = (kHiddenBlocks + 31) / 32;  // its scale blocks per lane
constexpr int kPlaceRowsInFlight = kRowVectorsPerLane <= 8 ? 3 : 2;  // what 168 registers hold

// Registers: the producer warpgroup gives its share to the two math warpgroups. The three warpgroups
// hold 384 · 168 = 64512 registers from the launch and setmaxnreg only moves them (a sum above that leaves
// setmaxnreg.inc waiting forever): 2·128·224 + 128·56 = 64512 (the math code needs more than 208, the
// producer more than 40).
constexpr int kProducerRegisters = 56;
// With BLOCK_M 128 each math warpgroup owns its 64 rows of a tile outright and publishes them itself, so
// the two drift apart by up to the stage ring instead of meeting at the end of every tile; at 64 they
// exchange the L1 rows' amax and publish together. A tile adds this many to its done counter.
constexpr bool kWarpgroupPublish = kBlockM == 128;
constexpr int kPublishesPerTile = kWarpgroupPublish ? 2 : 1;
constexpr int kMathRegisters = 224;
static_assert(2 * 128 * kMathRegisters + 128 * kProducerRegisters <= kThreads * 168, "setmaxnreg moves, never adds");

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

constexpr unsigned kOffA = 0;
constexpr unsigned kOffB = kOffA + kStages * kATileBytes;
constexpr unsigned kOffSa = kOffB + kStages * kBTileBytes;
// Task slots: the Task (32 bytes) and the tile's two weight-scale rows of up to kMaxKBlocks floats.
constexpr unsigned kTaskSlotBytes = align_up(32 + 2 * kMaxKBlocks * 4, 16);
constexpr unsigned kOffTasks = kOffSa + kStages * kSaStride;
constexpr unsigned kOffBars = align_up(kOffTasks + 2 * kTaskSlotBytes, 8);
constexpr unsigned kBarCount = 2 * kStages + 4;  // full[S], empty[S], task_full[2], task_empty[2]
// Row amax exchange of the L1 epilogue: float[2][64] (BLOCK_M 64: per warpgroup and row) or, swap-AB,
// float[kMathWarps][kBlockM] (per warp and row).
constexpr unsigned kAmaxFloats = kSwapAB ? kMathWarps * kBlockM : 0;
constexpr unsigned kAmaxBytes = (kAmaxFloats > 2 * 64 ? kAmaxFloats : 2 * 64) * 4;  // fusedSharedBytes: the same max
constexpr unsigned kOffAmax = kOffBars + 8 * kBarCount;
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
static_assert(kDynamicSmemBytes <= 232448, "shared memory above the 227 KB opt-in limit");
#ifdef SHARED_BYTES
// The launcher's mirror of this layout (megamoe.variants.ts: fusedSharedBytes) passes its figure: a
// mismatch fails the build (CI compiles every variant) instead of a launch.
static_assert(kDynamicSmemBytes == SHARED_BYTES, "megamoe.variants.ts fusedSharedBytes disagrees with this layout");
#endif

// Workspace words (int32, zero between launches). Then counts[kGroups], cursor[kGroups],
// arrived[max_blocks], l1_done[max_blocks].
enum Counter : int {
  kCountClaim = 0,
  kCountDone,
  kPlaceClaim,
  kPlaceDone,
  kTaskClaim,
  kL2Done,
  kExitCount,
  kCounterWords = 8,  // megamoe.variants.ts FUSED_COUNTER_WORDS (one spare)
};

// status[0] codes (status[1]: block, status[2..3]: what was awaited).
enum StatusCode : int {
  kStatusCountWait = 1,
  kStatusArrivalWait = 2,
  kStatusL1Wait = 3,
  kStatusStageEmptyWait = 4,
  kStatusStageFullWait = 5,
  kStatusTaskWait = 6,
  kStatusCombineWait = 7,
  kStatusSharedMemoryTooSmall = 8,
};

// Per-CTA timeline words written when op.trace is set (globaltimer ns; *Ns: summed wait times).
enum Trace : int {
  kTraceEntry = 0,
  kTraceCountsReady,
  kTracePlaced,
  kTraceFirstTask,
  kTraceProducerDone,
  kTraceMathDone,
  kTraceCombineStart,
  kTraceEnd,
  kTraceDependencyWaitNs,
  kTraceStageEmptyWaitNs,
  kTraceStageFullWaitNs,
  kTraceEpilogueNs,
  kTraceL1Tiles,
  kTraceL2Tiles,
  kTraceTaskWaitNs,
  kTracePlaceClaimNs,   // thread 0's runs: the pool-row claims,
  kTracePlaceCopyNs,    // the row copies,
  kTracePlaceSignalNs,  // the fence and the arrival signals
  kTraceL2EpilogueNs,   // thread 0: the part of kTraceEpilogueNs spent in L2 tiles,
  kTracePublishNs,      // and in the fence, barrier and release that publish a tile
  kTraceL1EndLast,      // thread 0: the end of this CTA's last L1 tile,
  kTraceL2EndFirst,     // and of its first L2 tile
  kTraceL2ClaimFirst,   // the producer: its first L2 task claimed,
  kTraceL2ReadyFirst,   // and that task's rows ready (every L1 tile of the block done)
  kTraceWords = 24,
};

enum TaskKind : int { kTaskNone = 0, kTaskL1 = 1, kTaskL2 = 2 };

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
static_assert(__builtin_offsetof(Operands, trace) == 17 * 8, "megamoe.ts: 18 pointers first");
static_assert(__builtin_offsetof(Operands, tokens) == 18 * 8, "megamoe.ts: OFF_TOKENS");
static_assert(__builtin_offsetof(Operands, clamp) == 18 * 8 + 20, "megamoe.ts: OFF_CLAMP");
#endif
static_assert(sizeof(Operands) == 18 * 8 + 24, "megamoe.ts: OPERANDS_BYTES");

// ---------------------------------------------------------------------------------------------------
// Cross-CTA synchronization

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Data another CTA wrote in this launch: read at L2, never from a possibly stale L1 line.
__device__ __forceinline__ int load_cg(const int* p) { return __ldcg(p); }

// Records a wait that never completed and traps. A trap, not an exit: an exited thread never reaches
// the named barriers its warpgroup waits at, so an exit could hang the GPU; a trap ends the launch with
// an error (and the CUDA context with it: the status word is for a debugger, the host sees the error).
// Not inlined: the cold path then costs the hot loops no registers (inlined, it made ptxas spill).
__device__ __noinline__ void report(int* status, int code, int a, int b) {
  if (atomicCAS(status, 0, code) == 0) {
    status[1] = static_cast<int>(blockIdx.x);
    status[2] = a;
    status[3] = b;
    __threadfence();
  }
  __trap();
}

__device__ __forceinline__ void trace_time(unsigned long long* trace, int word) {
  if (trace != nullptr) trace[blockIdx.x * kTraceWords + word] = global_timer_ns();
}

// The first time only (the word is zeroed before a traced launch): no flag kept in registers.
__device__ __forceinline__ void trace_time_once(unsigned long long* trace, int word) {
  if (trace != nullptr && trace[blockIdx.x * kTraceWords + word] == 0ull) trace_time(trace, word);
}

__device__ __forceinline__ void trace_add(unsigned long long* trace, int word, unsigned long long v) {
  if (trace != nullptr) trace[blockIdx.x * kTraceWords + word] += v;
}

// Now, when tracing (0 otherwise: the timer read costs nothing then).
__device__ __forceinline__ unsigned long long trace_clock(const unsigned long long* trace) {
  return trace != nullptr ? global_timer_ns() : 0ull;
}

// Spins until *p >= target (acquire). On timeout: report and exit the thread.
__device__ __forceinline__ void wait_at_least(const int* p, int target, int* status, int code, int detail) {
  if (load_acquire(p) >= target) return;
  const unsigned long long start = global_timer_ns();
  while (load_acquire(p) < target) {
    if (global_timer_ns() - start > kWatchdogNs) report(status, code, detail, load_acquire(p));
    __nanosleep(64);
  }
}

__device__ __forceinline__ void wait_barrier(unsigned bar, unsigned parity, int* status, int code, int detail) {
  mbar_wait_bounded(bar, parity, kWatchdogNs, [&] { report(status, code, detail, static_cast<int>(parity)); });
}

// One thread claims the next item of a CTA-wide work loop; every thread of the CTA gets it.
__device__ __forceinline__ int cta_claim(int* counter, int* broadcast) {
  __syncthreads();  // everyone is done with the previous item (and its broadcast)
  if (threadIdx.x == 0) *broadcast = atomicAdd(counter, 1);
  __syncthreads();
  return *broadcast;
}

// ---------------------------------------------------------------------------------------------------
// Pool geometry

__device__ __forceinline__ int group_inter(int group) { return group == kExperts ? kSharedInter : kInter; }

// The group of a global block: the last g with blocks[g] <= block (blocks is non-decreasing).
__device__ __forceinline__ int group_of_block(const int* blocks, int block) {
  int lo = 0;
  int hi = kGroups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (blocks[mid] <= block) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Row offsets and first blocks of every group from the counts, by one warp (a run of groups per lane,
// then a warp scan of the runs). counts[g] for g < kExperts from the workspace, the shared expert's T.
__device__ __forceinline__ void build_groups(const int* counts, int shared_rows, int* offsets, int* blocks) {
  constexpr int kPerLane = (kGroups + 31) / 32;
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int first = lane * kPerLane;
  const int last = first + kPerLane < kGroups ? first + kPerLane : kGroups;
  int rows = 0;
  int nblocks = 0;
  for (int g = first; g < last; ++g) {
    const int c = g == kExperts ? shared_rows : load_cg(counts + g);
    offsets[g] = c;  // the count, for now
    rows += c;
    nblocks += (c + kBlockM - 1) / kBlockM;
  }
  int rows_incl = rows;
  int blocks_incl = nblocks;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int r = __shfl_up_sync(0xffffffffu, rows_incl, d);
    const int b = __shfl_up_sync(0xffffffffu, blocks_incl, d);
    if (lane >= d) {
      rows_incl += r;
      blocks_incl += b;
    }
  }
  int row = rows_incl - rows;
  int block = blocks_incl - nblocks;
  for (int g = first; g < last; ++g) {
    const int c = offsets[g];
    offsets[g] = row;
    blocks[g] = block;
    row += c;
    block += (c + kBlockM - 1) / kBlockM;
  }
  if (lane == 31) {
    offsets[kGroups] = rows_incl;
    blocks[kGroups] = blocks_incl;
  }
}

// The first of a tile's two weight-scale rows (the second is task_weight_scale_stride floats later). L1: W1 scales [E, 2I/128, H/128], rows n (gate) and I/128 + n (up);
// L2: W2 scales [E, H/128, I/128], rows 2n and 2n + 1.
__device__ __forceinline__ const float* weight_scale_rows(const Operands& op, const Task& task) {
  const bool shared = task.group == kExperts;
  const int inter = group_inter(task.group);
  if (task.kind == kTaskL1) {
    const float* expert = shared ? op.w1s_scales
                                 : op.w1_scales + static_cast<long long>(task.group) * (2 * inter / kQuant) * kHiddenBlocks;
    return expert + static_cast<long long>(task.n) * kHiddenBlocks;
  }
  const float* expert = shared ? op.w2s_scales
                               : op.w2_scales + static_cast<long long>(task.group) * kHiddenBlocks * (inter / kQuant);
  return expert + static_cast<long long>(2 * task.n) * (inter / kQuant);
}

// Floats from the first weight-scale row to the second: L1 skips I/128 rows of H/128, L2 takes the next row.
__device__ __forceinline__ int task_weight_scale_stride(const Task& task) {
  return task.kind == kTaskL1 ? (group_inter(task.group) / kQuant) * kHiddenBlocks : task.k_blocks;
}

// ---------------------------------------------------------------------------------------------------
// The math warpgroups' tile: K in 128-wide blocks, each block's wgmma product promoted into fp32 with
// its two scales (as fp8_grouped_gemm.cu does). B holds 256 weight rows: L1 gate rows then up rows of
// the same 128 channels, L2 256 output columns.

// How the two math warpgroups split a tile.
//   BLOCK_M 128: warpgroup w owns rows 64w .. 64w + 63 and all 256 B rows as two n128 chunks (L1: gate,
//                up); the weight-scale row of chunk c is c.
//   BLOCK_M 64:  both own rows 0 .. 63 (half the A bytes per stage: the decode shape). L1: warpgroup w
//                owns channels 64w .. 64w + 63 of gate and of up (two n64 chunks, scale rows 0 and 1);
//                L2: columns 128w .. 128w + 127 (one n128 chunk, scale row w).
// The first tile row a math warpgroup's A operand starts at (swap-AB tiles have no A rows of their own).
__device__ __forceinline__ int warpgroup_row_offset(int w) { return kBlockM == 128 ? 64 * w : 0; }

template <bool kL1>
struct Split {
  static constexpr bool kWide = kBlockM == 128;
  static constexpr int kChunks = kWide || kL1 ? 2 : 1;
  static constexpr int kN = kWide || !kL1 ? 128 : 64;
  static constexpr int kAcc = kN / 2;
  __device__ static int row_offset(int w) { return warpgroup_row_offset(w); }
  __device__ static int b_row(int c, int w) { return kWide ? c * 128 : (kL1 ? c * 128 + 64 * w : 128 * w); }
  __device__ static int sw_row(int c, int w) { return kWide || kL1 ? c : w; }
  // First column of chunk c: L1 a channel of the 128-channel block, L2 a column of the 256.
  __device__ static int column(int c, int w) { return kWide ? (kL1 ? 0 : 128 * c) : (kL1 ? 64 * w : 128 * w); }
};

struct MathContext {
  unsigned a_smem;   // stage 0's A tile at this warpgroup's first row
  unsigned b_smem;   // stage 0's B tile
  unsigned sa_smem;  // stage 0's A scales, at this thread's fragment row (swap-AB: at row 0)
  unsigned full_bar;
  unsigned empty_bar;
  unsigned amax_smem;  // the L1 epilogue's row amax exchange (see kAmaxBytes)
  unsigned staging;    // this warp's staging area
  unsigned staging_all;  // the first math warp's (swap-AB epilogues stage a tile across warps' areas)
  int warpgroup;
  int lane;
  int* status;
  unsigned long long* trace;
};

// The mainloops' shared steps. A K block's product into `partial`: a waited wgmma block, or zeros under
// MEGAMOE_DIAG_SKIP_MMA.
template <int kCount>
__device__ __forceinline__ void block_product(float (&partial)[kCount], unsigned a, unsigned b) {
  if constexpr (MEGAMOE_DIAG_SKIP_MMA != 0) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) partial[i] = 0.0f;
  } else {
    wgmma_block_k128(partial, a, b);
  }
}

// Waits until the stage's operands have landed (the wait summed into the trace).
__device__ __forceinline__ void wait_stage_full(const MathContext& m, int stage, unsigned phase) {
  const unsigned long long t0 = trace_clock(m.trace);
  wait_barrier(m.full_bar + 8 * stage, phase, m.status, kStatusStageFullWait, stage);
  if (threadIdx.x == 0) trace_add(m.trace, kTraceStageFullWaitNs, trace_clock(m.trace) - t0);
}

// Hands the stage back to the producer (one arrive per math warp, its wgmmas done) and moves to the next.
__device__ __forceinline__ void release_stage(const MathContext& m, int& stage, unsigned& phase) {
  if (m.lane == 0) mbar_arrive(m.empty_bar + 8 * stage);
  if (++stage == kStages) {
    stage = 0;
    phase ^= 1u;
  }
}

template <bool kL1>
__device__ __forceinline__ void tile_mainloop(const MathContext& m, const Task& task, unsigned sw_rows,
                                              int& stage, unsigned& phase, float (&acc)[2][kAccum]) {
  using S = Split<kL1>;
  float partial[S::kAcc];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int i = 0; i < kAccum; ++i) acc[c][i] = 0.0f;
  const bool active = task.row0 + S::row_offset(m.warpgroup) < task.row_end;
  for (int kb = 0; kb < task.k_blocks; ++kb) {
    float sw[S::kChunks];
#pragma unroll
    for (int c = 0; c < S::kChunks; ++c) {
      sw[c] = load_shared_f32(sw_rows + (S::sw_row(c, m.warpgroup) * kMaxKBlocks + kb) * 4);
    }
    wait_stage_full(m, stage, phase);
    if (active) {
      const unsigned sa = m.sa_smem + stage * kSaStride + (task.row0 & 3) * 4;
      const float sa_lo = load_shared_f32(sa);
      const float sa_hi = load_shared_f32(sa + 8 * 4);
      const unsigned a_stage = m.a_smem + stage * kATileBytes;
      const unsigned b_stage = m.b_smem + stage * kBTileBytes;
#pragma unroll
      for (int c = 0; c < S::kChunks; ++c) {
        block_product(partial, a_stage, b_stage + S::b_row(c, m.warpgroup) * kBlockK);
        promote_block(acc[c], partial, sa_lo * sw[c], sa_hi * sw[c]);
      }
    }
    release_stage(m, stage, phase);
  }
}

// L1 epilogue: chunk 0 holds gate, chunk 1 up of the same channels. Thread rows: frag_row and + 8,
// columns 8i + frag_col + {0, 1} of its chunk; the 4 lanes of a quad share a row, so the row's amax is a
// max over the thread's values and two shuffles, and with BLOCK_M 64 (each warpgroup holds 64 of the
// 128 channels) a max with the other warpgroup's, through shared memory.
__device__ __forceinline__ void l1_epilogue(const Operands& op, const MathContext& m, const Task& task,
                                            float (&acc)[2][kAccum], int frag_row, int frag_col) {
  using S = Split<true>;
  static_assert(S::kChunks == 2, "an L1 tile's chunks are its gate and up channels");
  const int row_lo = task.row0 + S::row_offset(m.warpgroup) + frag_row;
  const bool clamp_on = op.has_clamp != 0;
  float amax_lo = 0.0f;
  float amax_hi = 0.0f;
#pragma unroll
  for (int i = 0; i < S::kAcc; ++i) {
    acc[0][i] = megamoe::swiglu(acc[0][i], acc[1][i], clamp_on, op.clamp);
    if ((i & 2) == 0) amax_lo = fmaxf(amax_lo, fabsf(acc[0][i]));
    else amax_hi = fmaxf(amax_hi, fabsf(acc[0][i]));
  }
#pragma unroll
  for (int d = 1; d <= 2; d <<= 1) {
    amax_lo = fmaxf(amax_lo, __shfl_xor_sync(0xffffffffu, amax_lo, d));
    amax_hi = fmaxf(amax_hi, __shfl_xor_sync(0xffffffffu, amax_hi, d));
  }
  if constexpr (!S::kWide) {
    const unsigned mine = m.amax_smem + static_cast<unsigned>(m.warpgroup * 64 + frag_row) * 4;
    const unsigned other = m.amax_smem + static_cast<unsigned>((1 - m.warpgroup) * 64 + frag_row) * 4;
    if ((m.lane & 3) == 0) {
      store_shared_f32(mine, amax_lo);
      store_shared_f32(mine + 8 * 4, amax_hi);
    }
    named_barrier_sync(2, kMathThreads);
    amax_lo = fmaxf(amax_lo, load_shared_f32(other));
    amax_hi = fmaxf(amax_hi, load_shared_f32(other + 8 * 4));
  }
  const megamoe::GroupScale s_lo = megamoe::activation_scale<kUe8m0>(amax_lo);
  const megamoe::GroupScale s_hi = megamoe::activation_scale<kUe8m0>(amax_hi);
  // The codes of the warp's 16 rows go through its staging area; the scales straight to the pool.
  const int staged_row = frag_row & 15;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row_lo + 8 * half;
    if (row >= task.row_end) continue;  // never copied out
    const megamoe::GroupScale s = half == 0 ? s_lo : s_hi;
    const unsigned dst = m.staging + static_cast<unsigned>(staged_row + 8 * half) * kStagingPitch + frag_col;
#pragma unroll
    for (int i = 0; i < S::kAcc / 4; ++i) {
      const float x0 = megamoe::mul_rn(acc[0][4 * i + 2 * half], s.inv);
      const float x1 = megamoe::mul_rn(acc[0][4 * i + 2 * half + 1], s.inv);
      store_shared_u16(dst + 8 * i, megamoe::e4m3x2_from_floats(x0, x1));  // columns 8i + frag_col, + 1
    }
    if (frag_col == 0 && (S::kWide || m.warpgroup == 0)) {
      megamoe::st_f32(op.pool_h_scales + static_cast<long long>(task.n) * op.r_pad + row, s.scale);
    }
  }
  const int warp_row0 = task.row0 + S::row_offset(m.warpgroup) + (frag_row & ~15);  // the warp's first row
  copy_out_staged_rows<S::kAcc * 2, kStagingPitch>(m.staging,
                             op.pool_h + static_cast<long long>(warp_row0) * kMaxInter + task.n * kQuant +
                                 S::column(0, m.warpgroup),
                             kMaxInter, task.row_end - warp_row0, m.lane);
}

// L2 epilogue: this warpgroup's output columns as bf16, through the warp's staging area 64 columns
// (128 bytes of a row) at a time.
__device__ __forceinline__ void l2_epilogue(const Operands& op, const MathContext& m, const Task& task,
                                            const float (&acc)[2][kAccum], int frag_row, int frag_col) {
  using S = Split<false>;
  static_assert(S::kAcc == 64, "an L2 chunk is 128 columns: two rounds of 64");
  const int warp_row0 = task.row0 + S::row_offset(m.warpgroup) + (frag_row & ~15);  // the warp's first row
  const unsigned staged = m.staging + static_cast<unsigned>(frag_row & 15) * kStagingPitch + 2 * frag_col;
  const int rows_valid = task.row_end - warp_row0;  // of the warp's 16; the others are never copied out
  unsigned char* const y_rows =
      reinterpret_cast<unsigned char*>(op.y + static_cast<long long>(warp_row0) * kHidden + task.n * kBlockN);
#pragma unroll
  for (int c = 0; c < S::kChunks; ++c) {
#pragma unroll
    for (int round = 0; round < 2; ++round) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if ((frag_row & 15) + 8 * half >= rows_valid) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int i = 8 * round + j;  // columns 8i + frag_col, + 1 of the chunk
          store_shared_u32(staged + 8 * half * kStagingPitch + 16 * j,
                           megamoe::bf16x2_from_floats(acc[c][4 * i + 2 * half], acc[c][4 * i + 2 * half + 1]));
        }
      }
      copy_out_staged_rows<kStagedRowBytes, kStagingPitch>(m.staging,
                                                            y_rows + 2 * (S::column(c, m.warpgroup) + 64 * round),
                                                            2 * kHidden, rows_valid, m.lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Swap-AB tiles (BLOCK_M 16 or 32). The wgmma's A operand is 64 rows of the stage's B (weight) tile and
// its B operand the stage's kBlockM pool rows, so D[64 weight rows × kBlockM rows]: a thread holds
// weight rows frag_row and + 8 and pool rows (columns) 8j + frag_col + {0, 1}. Warpgroup w takes two
// m64 waves: L1 the gate rows and the up rows of channels 64w .. 64w + 63 (B rows 64w and 128 + 64w: a
// thread holds gate and up of the same channel and row), L2 output columns 128w .. 128w + 127 (B rows
// 128w and 128w + 64). The promotion multiplies the same two scales as the other tiles (the row's times
// the weight block's), so the sums are theirs.
constexpr int kSwapAcc = kSwapAB ? kBlockM / 2 : 8;  // fp32 accumulators per thread of one m64 × n(kBlockM) wave
constexpr int kSwapColGroups = kSwapAcc / 4;         // groups of 8 pool rows (columns) per wave

template <bool kL1>
struct SwapSplit {
  __device__ static int b_row(int wave, int w) { return kL1 ? 128 * wave + 64 * w : 128 * w + 64 * wave; }
  __device__ static int sw_row(int wave, int w) { return kL1 ? wave : w; }
};

template <bool kL1>
__device__ __forceinline__ void swap_mainloop(const MathContext& m, const Task& task, unsigned sw_rows,
                                              int& stage, unsigned& phase, float (&acc)[2][kAccum],
                                              int frag_col) {
  using S = SwapSplit<kL1>;
  float partial[kSwapAcc];
#pragma unroll
  for (int wave = 0; wave < 2; ++wave)
#pragma unroll
    for (int i = 0; i < kSwapAcc; ++i) acc[wave][i] = 0.0f;
  for (int kb = 0; kb < task.k_blocks; ++kb) {
    float sw[2];
#pragma unroll
    for (int wave = 0; wave < 2; ++wave) {
      sw[wave] = load_shared_f32(sw_rows + (S::sw_row(wave, m.warpgroup) * kMaxKBlocks + kb) * 4);
    }
    wait_stage_full(m, stage, phase);
    const unsigned sa = m.sa_smem + stage * kSaStride + ((task.row0 & 3) + frag_col) * 4;
    float sa_col[kSwapColGroups][2];
#pragma unroll
    for (int j = 0; j < kSwapColGroups; ++j) {
      sa_col[j][0] = load_shared_f32(sa + 8 * j * 4);
      sa_col[j][1] = load_shared_f32(sa + (8 * j + 1) * 4);
    }
    const unsigned a_stage = m.a_smem + stage * kATileBytes;
    const unsigned b_stage = m.b_smem + stage * kBTileBytes;
#pragma unroll
    for (int wave = 0; wave < 2; ++wave) {
      block_product(partial, b_stage + S::b_row(wave, m.warpgroup) * kBlockK, a_stage);
#pragma unroll
      for (int j = 0; j < kSwapColGroups; ++j)
#pragma unroll
        for (int i = 4 * j; i < 4 * j + 4; ++i) {
          acc[wave][i] = fmaf(partial[i], sa_col[j][i & 1] * sw[wave], acc[wave][i]);
        }
    }
    release_stage(m, stage, phase);
  }
}

// Swap-AB L1 epilogue: SwiGLU of each (channel, row) in registers, the row's amax over the 128 channels
// (the 8 lanes of a column, then the 8 warps through shared memory), FP8 codes staged as the tile's
// [row][128 channels] bytes across the math warps' areas and copied out by all 256 threads.
constexpr unsigned kSwapL1Pitch = kStagedRowBytes + 16;
constexpr unsigned kSwapL2Pitch = 2 * kStagedRowBytes + 16;  // a warpgroup's 128 bf16 columns of a row
static_assert(!kSwapAB || kBlockM * kSwapL1Pitch <= kMathWarps * kStagingWarpBytes, "L1 swap staging");
static_assert(!kSwapAB || kBlockM * kSwapL2Pitch <= 4 * kStagingWarpBytes, "L2 swap staging");

__device__ __forceinline__ void l1_epilogue_swap(const Operands& op, const MathContext& m, const Task& task,
                                                 float (&acc)[2][kAccum], int frag_row, int frag_col) {
  const bool clamp_on = op.has_clamp != 0;
  const int warp = static_cast<int>(threadIdx.x / 32);
  float amax[kSwapColGroups][2];
#pragma unroll
  for (int j = 0; j < kSwapColGroups; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float a = 0.0f;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = 4 * j + 2 * half + e;
        acc[0][i] = megamoe::swiglu(acc[0][i], acc[1][i], clamp_on, op.clamp);
        a = fmaxf(a, fabsf(acc[0][i]));
      }
#pragma unroll
      for (int d = 4; d <= 16; d <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, d));
      amax[j][e] = a;
    }
  }
  if (m.lane < 4) {
#pragma unroll
    for (int j = 0; j < kSwapColGroups; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        store_shared_f32(m.amax_smem + static_cast<unsigned>(warp * kBlockM + 8 * j + frag_col + e) * 4, amax[j][e]);
      }
  }
  named_barrier_sync(2, kMathThreads);
  const int channel0 = 64 * m.warpgroup + frag_row;  // of the tile's 128; and + 8
#pragma unroll
  for (int j = 0; j < kSwapColGroups; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + frag_col + e;
      float a = 0.0f;
#pragma unroll
      for (int w = 0; w < kMathWarps; ++w) a = fmaxf(a, load_shared_f32(m.amax_smem + static_cast<unsigned>(w * kBlockM + col) * 4));
      const megamoe::GroupScale s = megamoe::activation_scale<kUe8m0>(a);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float x = megamoe::mul_rn(acc[0][4 * j + 2 * half + e], s.inv);
        store_shared_u8(m.staging_all + static_cast<unsigned>(col) * kSwapL1Pitch + channel0 + 8 * half,
                        megamoe::e4m3_from_float(x));
      }
      if (threadIdx.x < 4 && task.row0 + col < task.row_end) {
        megamoe::st_f32(op.pool_h_scales + static_cast<long long>(task.n) * op.r_pad + task.row0 + col, s.scale);
      }
    }
  }
  named_barrier_sync(2, kMathThreads);
  copy_out_staged_tile<kQuant, kSwapL1Pitch>(m.staging_all,
                                             op.pool_h + static_cast<long long>(task.row0) * kMaxInter + task.n * kQuant,
                                             kMaxInter, min(kBlockM, task.row_end - task.row0),
                                             static_cast<int>(threadIdx.x), kMathThreads);
}

// Swap-AB L2 epilogue: each warpgroup stages its 128 output columns of the tile's rows as bf16
// ([row][128 columns] across its warps' areas) and copies them out.
__device__ __forceinline__ void l2_epilogue_swap(const Operands& op, const MathContext& m, const Task& task,
                                                 const float (&acc)[2][kAccum], int frag_row, int frag_col) {
  const unsigned staging = m.staging_all + static_cast<unsigned>(m.warpgroup) * 4 * kStagingWarpBytes;
#pragma unroll
  for (int wave = 0; wave < 2; ++wave)
#pragma unroll
    for (int j = 0; j < kSwapColGroups; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + frag_col + e;
          const int column = 64 * wave + frag_row + 8 * half;  // of the warpgroup's 128
          const unsigned bits = megamoe::bf16x2_from_floats(acc[wave][4 * j + 2 * half + e], 0.0f);
          store_shared_u16(staging + static_cast<unsigned>(col) * kSwapL2Pitch + 2 * column,
                           static_cast<unsigned short>(bits & 0xffffu));
        }
  named_barrier_sync(3 + m.warpgroup, 128);
  unsigned char* const y_rows = reinterpret_cast<unsigned char*>(
      op.y + static_cast<long long>(task.row0) * kHidden + task.n * kBlockN + 128 * m.warpgroup);
  copy_out_staged_tile<2 * kStagedRowBytes, kSwapL2Pitch>(staging, y_rows, 2 * kHidden,
                                                          min(kBlockM, task.row_end - task.row0),
                                                          static_cast<int>(threadIdx.x % 128), 128);
}

// One FP8 row and its scales in a warp's registers: lane l holds 16-byte pieces l, l + 32, … and scale
// blocks l, l + 32, …
struct RowPieces {
  u32x4 piece[kRowVectorsPerLane];
  float scale[kRowScalesPerLane];
};

__device__ __forceinline__ void load_token_row(const Operands& op, int t, int lane, RowPieces& r) {
  const unsigned char* src = op.xq + static_cast<long long>(t) * kHidden;
#pragma unroll
  for (int j = 0; j < kRowVectorsPerLane; ++j) {
    const int v = lane + 32 * j;
    if (v < kHidden / 16) r.piece[j] = megamoe::ld_nc_v4(src + 16 * v);
  }
#pragma unroll
  for (int j = 0; j < kRowScalesPerLane; ++j) {
    const int b = lane + 32 * j;
    if (b < kHiddenBlocks) r.scale[j] = op.x_scales[static_cast<long long>(t) * kHiddenBlocks + b];
  }
}

__device__ __forceinline__ void store_pool_row(const Operands& op, int row, int lane, const RowPieces& r) {
  unsigned char* dst = op.pool_x + static_cast<long long>(row) * kHidden;
#pragma unroll
  for (int j = 0; j < kRowVectorsPerLane; ++j) {
    const int v = lane + 32 * j;
    if (v < kHidden / 16) megamoe::st_v4(dst + 16 * v, r.piece[j]);
  }
#pragma unroll
  for (int j = 0; j < kRowScalesPerLane; ++j) {
    const int b = lane + 32 * j;
    if (b < kHiddenBlocks) megamoe::st_f32(op.pool_x_scales + static_cast<long long>(b) * op.r_pad + row, r.scale[j]);
  }
}

// The combine's unit of work: 256 channels of a token (8 per lane). A token's rows are its kTopK slots
// and the shared expert's; the loads of kCombineUnroll chunks of every row are issued before the first
// add (as many as the math warps' registers hold), so a token costs a few memory latencies, not one per
// chunk.
constexpr int kCombineChunks = kHidden / 256;
constexpr int kCombineRows = kTopK + 1;
constexpr int kCombineUnroll = kCombineRows <= 7 ? 4 : (kCombineRows <= 14 ? 2 : 1);

// Combine of chunks [chunk_begin, chunk_end) of one token by one warp, with the unfused moe_combine's
// rule and order: slots ascending, then the shared expert (weight 1: w·y is then y exactly, as that
// rule's unweighted add). Lane s reads slot s's row and weight once.
__device__ __forceinline__ void combine_token(const Operands& op, int shared_row0, int t, int chunk_begin,
                                              int chunk_end, int lane) {
  int lane_row = -1;
  float lane_weight = 0.f;
  if (lane < kTopK) {
    lane_row = load_cg(op.slot_row + t * kTopK + lane);
    lane_weight = op.weights[t * kTopK + lane];
  }
  int rows[kCombineRows];
  float weights[kCombineRows];
#pragma unroll
  for (int s = 0; s < kTopK; ++s) {
    rows[s] = __shfl_sync(0xffffffffu, lane_row, s);
    weights[s] = __shfl_sync(0xffffffffu, lane_weight, s);
  }
  rows[kTopK] = shared_row0 >= 0 ? shared_row0 + t : -1;
  weights[kTopK] = 1.f;
  for (int i0 = chunk_begin; i0 < chunk_end; i0 += kCombineUnroll) {
    u32x4 piece[kCombineUnroll][kCombineRows];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int c = ((i0 + u) * 32 + lane) * 8;
#pragma unroll
      for (int s = 0; s < kCombineRows; ++s) {
        if (i0 + u < chunk_end && rows[s] >= 0) {
          piece[u][s] = megamoe::ld_cg_v4(op.y + static_cast<long long>(rows[s]) * kHidden + c);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      if (i0 + u >= chunk_end) break;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < kCombineRows; ++s) {
        if (rows[s] >= 0) megamoe::add_weighted_bf16x8(acc, piece[u][s], weights[s]);
      }
      const int c = ((i0 + u) * 32 + lane) * 8;
      megamoe::st_v4(op.out + static_cast<long long>(t) * kHidden + c, megamoe::pack_bf16x8(acc));
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// The kernel. Launch: grid = SM count (or fewer), block = kThreads, dynamic shared memory =
// kDynamicSmemBytes (megamoe.variants.ts: megamoeSharedBytes).

extern "C" __global__ void __launch_bounds__(kThreads, 1)
    megamoe_fused(const __grid_constant__ TensorMap map_pool_x, const __grid_constant__ TensorMap map_pool_x_scales,
                  const __grid_constant__ TensorMap map_w1, const __grid_constant__ TensorMap map_w1s,
                  const __grid_constant__ TensorMap map_pool_h, const __grid_constant__ TensorMap map_pool_h_scales,
                  const __grid_constant__ TensorMap map_w2, const __grid_constant__ TensorMap map_w2s,
                  const Operands op) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned base = (raw + kSmemAlign - 1) & ~(kSmemAlign - 1);
  unsigned char* const smem = smem_raw + (base - raw);
  int* const offsets = reinterpret_cast<int*>(smem + kOffOffsets);
  int* const blocks = reinterpret_cast<int*>(smem + kOffBlocks);
  int* const hist = reinterpret_cast<int*>(smem + kOffHist);
  int* const broadcast = reinterpret_cast<int*>(smem + kOffBroadcast);
  const unsigned full_bar = base + kOffBars;
  const unsigned empty_bar = full_bar + 8 * kStages;
  const unsigned task_full_bar = empty_bar + 8 * kStages;
  const unsigned task_empty_bar = task_full_bar + 16;

  int* const ws = op.workspace;
  int* const counts = ws + kCounterWords;
  int* const cursor = counts + kGroups;
  int* const arrived = cursor + kGroups;
  int* const l1_done = arrived + op.max_blocks;
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int slots = op.tokens * kTopK;

  unsigned dynamic_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_bytes));
  if (dynamic_bytes < kDynamicSmemBytes) {  // launched with another build's layout
    if (tid == 0) report(op.status, kStatusSharedMemoryTooSmall, static_cast<int>(dynamic_bytes), kDynamicSmemBytes);
    return;
  }
  if (tid == 0) trace_time(op.trace, kTraceEntry);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_bar + 8 * s, 1);
      mbar_init(empty_bar + 8 * s, kMathWarps);
    }
    for (int s = 0; s < 2; ++s) {
      mbar_init(task_full_bar + 8 * s, 1);
      mbar_init(task_empty_bar + 8 * s, kMathThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (tid == kMathThreads) {
    prefetch_tensor_map(&map_pool_x);
    prefetch_tensor_map(&map_pool_x_scales);
    prefetch_tensor_map(&map_w1);
    prefetch_tensor_map(&map_pool_h);
    prefetch_tensor_map(&map_pool_h_scales);
    prefetch_tensor_map(&map_w2);
  }

  // ---- 1. count
  const int count_chunks = (slots + kCountChunkSlots - 1) / kCountChunkSlots;
  for (;;) {
    const int chunk = cta_claim(ws + kCountClaim, broadcast);
    if (chunk >= count_chunks) break;
    for (int g = tid; g < kGroups; g += kThreads) hist[g] = 0;
    __syncthreads();
    const int end = min(slots, (chunk + 1) * kCountChunkSlots);
    for (int i = chunk * kCountChunkSlots + tid; i < end; i += kThreads) {
      const int e = op.ids[i];
      if (e >= 0 && e < kExperts) atomicAdd(hist + e, 1);
    }
    __syncthreads();
    for (int g = tid; g < kExperts; g += kThreads) {
      if (hist[g] != 0) atomicAdd(counts + g, hist[g]);
    }
    __syncthreads();
    if (tid == 0) add_release(ws + kCountDone, 1);
  }

  // ---- 2. offsets (every CTA, from the finished counts)
  if (tid == 0) {
    wait_at_least(ws + kCountDone, count_chunks, op.status, kStatusCountWait, count_chunks);
    trace_time(op.trace, kTraceCountsReady);
  }
  __syncthreads();
  const int shared_rows = op.use_shared != 0 && kSharedInter > 0 ? op.tokens : 0;
  if (warp == 0) build_groups(counts, shared_rows, offsets, blocks);
  __syncthreads();

  // ---- 3. place
  const int place_tokens =
      max(1, min(kMaxPlaceChunkTokens, (op.tokens + static_cast<int>(gridDim.x) - 1) / static_cast<int>(gridDim.x)));
  const int place_chunks = (op.tokens + place_tokens - 1) / place_tokens;
  for (;;) {
    const int chunk = cta_claim(ws + kPlaceClaim, broadcast);
    if (chunk >= place_chunks) break;
    const int t0 = chunk * place_tokens;
    const int items = (min(op.tokens, t0 + place_tokens) - t0) * (kTopK + 1);
    // Each warp takes a run of up to 32 items (token, slot); the slot kTopK is the shared expert's row.
    // Lane j claims item j's pool row (one atomic round trip for the run), the warp copies each token's
    // row to its claimed pool rows, and lane j signals item j's arrival after the copies.
    constexpr int kWarps = kThreads / 32;
    const int run = min(32, (items + kWarps - 1) / kWarps);
    for (int r0 = warp * run; r0 < items; r0 += kWarps * run) {
      const unsigned long long t_claim = trace_clock(op.trace);
      const int n = min(run, items - r0);
      const int item = r0 + lane;
      const int t = t0 + item / (kTopK + 1);
      int row = -1;
      int arrival_block = -1;
      if (lane < n) {
        const int s = item % (kTopK + 1);
        if (s < kTopK) {
          const int e = op.ids[t * kTopK + s];
          if (e >= 0 && e < kExperts) {
            row = offsets[e] + atomicAdd(cursor + e, 1);
            arrival_block = blocks[e] + (row - offsets[e]) / kBlockM;
          }
          op.slot_row[t * kTopK + s] = row;
        } else if (shared_rows > 0) {
          row = offsets[kExperts] + t;
          arrival_block = blocks[kExperts] + t / kBlockM;
        }
      }
      unsigned pending = __ballot_sync(0xffffffffu, row >= 0);  // the run's claimed rows, in lane order
      const unsigned long long t_copy = trace_clock(op.trace);
      if (tid == 0) trace_add(op.trace, kTracePlaceClaimNs, t_copy - t_claim);
      // A token's items are consecutive lanes: its row is loaded once and stored to each of its claimed
      // pool rows (up to kTopK + 1), kPlaceRowsInFlight tokens' loads issued together.
      const int lane_token = (r0 + lane) / (kTopK + 1);
      while (pending != 0) {
        unsigned targets[kPlaceRowsInFlight];
        RowPieces pieces[kPlaceRowsInFlight];
#pragma unroll
        for (int q = 0; q < kPlaceRowsInFlight; ++q) {
          const int first = pending != 0 ? __ffs(pending) - 1 : 0;
          const int token = __shfl_sync(0xffffffffu, lane_token, first);
          targets[q] = pending != 0 ? __ballot_sync(0xffffffffu, lane_token == token) & pending : 0u;
          pending &= ~targets[q];
          if (targets[q] != 0) load_token_row(op, t0 + token, lane, pieces[q]);
        }
#pragma unroll
        for (int q = 0; q < kPlaceRowsInFlight; ++q) {
          for (unsigned left = targets[q]; left != 0; left &= left - 1) {
            store_pool_row(op, __shfl_sync(0xffffffffu, row, __ffs(left) - 1), lane, pieces[q]);
          }
        }
      }
      const unsigned long long t_signal = trace_clock(op.trace);
      if (tid == 0) trace_add(op.trace, kTracePlaceCopyNs, t_signal - t_copy);
      fence_proxy_async_global();  // the rows are read by TMA (async proxy) in another CTA
      __syncwarp();
      if (arrival_block >= 0) add_release(arrived + arrival_block, 1);
      if (tid == 0) trace_add(op.trace, kTracePlaceSignalNs, trace_clock(op.trace) - t_signal);
    }
    __syncthreads();
    if (tid == 0) add_release(ws + kPlaceDone, 1);
  }

  if (tid == 0) trace_time(op.trace, kTracePlaced);

  // ---- 4. tiles
  const int total_blocks = blocks[kGroups];
  const int routed_blocks = blocks[kExperts];
  const int routed_l1 = routed_blocks * (kInter / kQuant);
  const int total_l1 = routed_l1 + (total_blocks - routed_blocks) * (kSharedInter / kQuant);
  const int total_l2 = total_blocks * kL2TilesPerBlock;
  const int total_tasks = total_l1 + total_l2;

  if (warp >= kMathWarps) {
    // ---------------- Producer: one thread claims tasks and streams their operands.
    registers_decrease<kProducerRegisters>();
    if (tid != kMathThreads) return;
    int stage = 0;
    unsigned phase = 0;
    int slot = 0;
    unsigned slot_phase = 0;
    bool first = true;
    for (;;) {
      const int claimed = atomicAdd(ws + kTaskClaim, 1);
      if (first) trace_time(op.trace, kTraceFirstTask);
      first = false;
      wait_barrier(task_empty_bar + 8 * slot, slot_phase ^ 1u, op.status, kStatusTaskWait, slot);
      Task task{};
      if (claimed < total_tasks) {
        int local;
        int per_block;
        if (claimed < total_l1) {
          task.kind = kTaskL1;
          const bool shared = claimed >= routed_l1;
          per_block = (shared ? kSharedInter : kInter) / kQuant;
          local = shared ? claimed - routed_l1 : claimed;
          task.block = (shared ? routed_blocks : 0) + local / per_block;
        } else {
          task.kind = kTaskL2;
          per_block = kL2TilesPerBlock;
          local = claimed - total_l1;
          task.block = local / per_block;
        }
        task.n = local % per_block;
        task.group = group_of_block(blocks, task.block);
        task.row0 = offsets[task.group] + (task.block - blocks[task.group]) * kBlockM;
        task.row_end = offsets[task.group + 1];
        task.k_blocks = task.kind == kTaskL1 ? kHiddenBlocks : group_inter(task.group) / kQuant;
      }
      *reinterpret_cast<Task*>(smem + kOffTasks + slot * kTaskSlotBytes) = task;
      if (task.kind != kTaskNone) {
        // The tile's two weight-scale rows, so the math warpgroups start the tile without a global load.
        float* sw = reinterpret_cast<float*>(smem + kOffTasks + slot * kTaskSlotBytes + 32);
        const float* rows = weight_scale_rows(op, task);
        const int stride = task_weight_scale_stride(task);
#pragma unroll 8
        for (int kb = 0; kb < task.k_blocks; ++kb) {
          sw[kb] = load_scale(rows + kb);
          sw[kMaxKBlocks + kb] = load_scale(rows + stride + kb);
        }
      }
      mbar_arrive(task_full_bar + 8 * slot);
      if (++slot == 2) {
        slot = 0;
        slot_phase ^= 1u;
      }
      if (task.kind == kTaskNone) {
        trace_time(op.trace, kTraceProducerDone);
        break;
      }

      const bool l1 = task.kind == kTaskL1;
      const bool shared = task.group == kExperts;
      const int inter = group_inter(task.group);
      if (!l1) trace_time_once(op.trace, kTraceL2ClaimFirst);
      const TensorMap* map_a = l1 ? &map_pool_x : &map_pool_h;
      const TensorMap* map_sa = l1 ? &map_pool_x_scales : &map_pool_h_scales;
      const TensorMap* map_b = l1 ? (shared ? &map_w1s : &map_w1) : (shared ? &map_w2s : &map_w2);
      const int expert = shared ? 0 : task.group;
      // The two 128-row B boxes: L1 gate rows n·128 and up rows I + n·128 of the expert's [2I, H];
      // L2 rows n·256 and n·256 + 128 of its [H, I].
      const int b_row0 = l1 ? expert * 2 * inter + task.n * kQuant : expert * kHidden + task.n * kBlockN;
      const int b_row1 = l1 ? b_row0 + inter : b_row0 + kQuant;
      const int early = task.k_blocks < kStages ? task.k_blocks : kStages;
      const int first_stage = stage;
      for (int kb = 0; kb < task.k_blocks; ++kb) {
        const unsigned long long t_empty = trace_clock(op.trace);
        wait_barrier(empty_bar + 8 * stage, phase ^ 1u, op.status, kStatusStageEmptyWait, stage);
        trace_add(op.trace, kTraceStageEmptyWaitNs, trace_clock(op.trace) - t_empty);
        const unsigned bar = full_bar + 8 * stage;
        if (kb < early) {
          // Weights first: they do not depend on other CTAs.
          mbar_arrive_expect_tx(bar, kStageTxBytes);
          tma_load_2d(base + kOffB + stage * kBTileBytes, map_b, bar, kb * kBlockK, b_row0);
          tma_load_2d(base + kOffB + stage * kBTileBytes + kBHalfBytes, map_b, bar, kb * kBlockK, b_row1);
        }
        if (kb == early - 1) {
          // Then the rows: arrived (L1) or produced by every L1 tile of the block (L2).
          const unsigned long long t_dep = trace_clock(op.trace);
          if (l1) {
            const int rows = min(kBlockM, task.row_end - task.row0);
            wait_at_least(arrived + task.block, rows, op.status, kStatusArrivalWait, task.block);
          } else {
            wait_at_least(l1_done + task.block, inter / kQuant * kPublishesPerTile, op.status, kStatusL1Wait,
                          task.block);
          }
          trace_add(op.trace, kTraceDependencyWaitNs, trace_clock(op.trace) - t_dep);
          if (!l1) trace_time_once(op.trace, kTraceL2ReadyFirst);
          fence_proxy_async_global();
          int s = first_stage;
          for (int k = 0; k < early; ++k) {
            const unsigned b = full_bar + 8 * s;
            tma_load_2d(base + kOffA + s * kATileBytes, map_a, b, k * kBlockK, task.row0);
            tma_load_2d(base + kOffSa + s * kSaStride, map_sa, b, task.row0 & ~3, k);
            if (++s == kStages) s = 0;
          }
        }
        if (kb >= early) {
          mbar_arrive_expect_tx(bar, kStageTxBytes);
          tma_load_2d(base + kOffA + stage * kATileBytes, map_a, bar, kb * kBlockK, task.row0);
          tma_load_2d(base + kOffSa + stage * kSaStride, map_sa, bar, task.row0 & ~3, kb);
          tma_load_2d(base + kOffB + stage * kBTileBytes, map_b, bar, kb * kBlockK, b_row0);
          tma_load_2d(base + kOffB + stage * kBTileBytes + kBHalfBytes, map_b, bar, kb * kBlockK, b_row1);
        }
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    return;
  }

  // ---------------- Math warpgroups.
  registers_increase<kMathRegisters>();
  const int warpgroup = tid / 128;
  const int frag_row = ((tid / 32) & 3) * 16 + lane / 4;
  const int frag_col = 2 * (lane & 3);
  const int row_offset = warpgroup_row_offset(warpgroup);  // the same for both kinds
  const MathContext m{base + kOffA + static_cast<unsigned>(row_offset) * kBlockK,
                      base + kOffB,
                      base + kOffSa + (kSwapAB ? 0u : static_cast<unsigned>(row_offset + frag_row) * 4),
                      full_bar,
                      empty_bar,
                      base + kOffAmax,
                      base + kOffStaging + static_cast<unsigned>(warp) * kStagingWarpBytes,
                      base + kOffStaging,
                      warpgroup,
                      lane,
                      op.status,
                      op.trace};
  int stage = 0;
  unsigned phase = 0;
  int slot = 0;
  unsigned slot_phase = 0;
  float acc[2][kAccum];
  for (;;) {
    const unsigned long long t_task = trace_clock(op.trace);
    wait_barrier(task_full_bar + 8 * slot, slot_phase, op.status, kStatusTaskWait, slot);
    if (tid == 0) trace_add(op.trace, kTraceTaskWaitNs, trace_clock(op.trace) - t_task);
    const Task task = *reinterpret_cast<const Task*>(smem + kOffTasks + slot * kTaskSlotBytes);
    const unsigned sw_rows = base + kOffTasks + slot * kTaskSlotBytes + 32;
    const unsigned task_empty = task_empty_bar + 8 * slot;
    if (++slot == 2) {
      slot = 0;
      slot_phase ^= 1u;
    }
    if (task.kind == kTaskNone) break;
    const bool l1 = task.kind == kTaskL1;

    if constexpr (kSwapAB) {
      if (l1) swap_mainloop<true>(m, task, sw_rows, stage, phase, acc, frag_col);
      else swap_mainloop<false>(m, task, sw_rows, stage, phase, acc, frag_col);
    } else {
      if (l1) tile_mainloop<true>(m, task, sw_rows, stage, phase, acc);
      else tile_mainloop<false>(m, task, sw_rows, stage, phase, acc);
    }
    // The slot (task and weight scales) is read: the producer may reuse it. Every reader arrives (an
    // arrive releases only its own thread's reads), once per tile.
    mbar_arrive(task_empty);
    const unsigned long long t_epilogue = trace_clock(op.trace);
    if constexpr (kSwapAB) {
      if (l1) l1_epilogue_swap(op, m, task, acc, frag_row, frag_col);
      else l2_epilogue_swap(op, m, task, acc, frag_row, frag_col);
    } else {
      if (l1) l1_epilogue(op, m, task, acc, frag_row, frag_col);
      else l2_epilogue(op, m, task, acc, frag_row, frag_col);
    }
    const unsigned long long t_publish = trace_clock(op.trace);
    // L1's h rows are read by TMA (the async proxy) in other CTAs; L2's y rows only by plain loads.
    if (l1) fence_proxy_async_global();
    if constexpr (kWarpgroupPublish) named_barrier_sync(3 + warpgroup, 128);
    else named_barrier_sync(1, kMathThreads);
    if (tid % (kWarpgroupPublish ? 128 : kMathThreads) == 0) add_release(l1 ? l1_done + task.block : ws + kL2Done, 1);
    if (tid == 0) {
      const unsigned long long t_end = trace_clock(op.trace);
      trace_add(op.trace, kTraceEpilogueNs, t_end - t_epilogue);
      trace_add(op.trace, kTracePublishNs, t_end - t_publish);
      if (!l1) trace_add(op.trace, kTraceL2EpilogueNs, t_end - t_epilogue);
      trace_add(op.trace, l1 ? kTraceL1Tiles : kTraceL2Tiles, 1);
      if (l1) trace_time(op.trace, kTraceL1EndLast);
      else trace_time_once(op.trace, kTraceL2EndFirst);
    }
  }
  if (tid == 0) trace_time(op.trace, kTraceMathDone);

  // ---- 5. combine
  if (tid == 0) {
    wait_at_least(ws + kPlaceDone, place_chunks, op.status, kStatusCombineWait, 0);
    wait_at_least(ws + kL2Done, total_l2 * kPublishesPerTile, op.status, kStatusCombineWait, 1);
    trace_time(op.trace, kTraceCombineStart);
  }
  named_barrier_sync(1, kMathThreads);  // thread 0's waits cover the CTA
  const int shared_row0 = shared_rows > 0 ? offsets[kExperts] : -1;
  // Every CTA reaches this point within a microsecond of the others (the last L2 tiles end together),
  // so the work is dealt to the grid's math warps in turn rather than claimed. With fewer tokens than
  // warps a token's channels are split into segments, so that small batches use the whole grid too.
  const int grid_warps = static_cast<int>(gridDim.x) * kMathWarps;
  const int segments = max(1, min(kCombineChunks, grid_warps / op.tokens));
  for (int unit = static_cast<int>(blockIdx.x) * kMathWarps + warp; unit < op.tokens * segments;
       unit += grid_warps) {
    const int segment = unit % segments;
    combine_token(op, shared_row0, unit / segments, segment * kCombineChunks / segments,
                  (segment + 1) * kCombineChunks / segments, lane);
  }

  // ---- The last CTA out zeroes the workspace for the next launch.
  if (tid == 0) {
    __threadfence();
    broadcast[2] = atomicAdd(ws + kExitCount, 1) == static_cast<int>(gridDim.x) - 1 ? 1 : 0;
  }
  named_barrier_sync(1, kMathThreads);
  if (tid == 0) trace_time(op.trace, kTraceEnd);
  if (broadcast[2] == 1) {
    __threadfence();
    for (int i = tid; i < kCounterWords + 2 * kGroups; i += kMathThreads) ws[i] = 0;
    for (int i = tid; i < total_blocks; i += kMathThreads) {
      arrived[i] = 0;
      l1_done[i] = 0;
    }
  }
}
