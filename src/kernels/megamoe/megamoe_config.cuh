// The fused kernel's compile-time configuration: the -D parameters (megamoe.variants.ts passes them)
// as constants, the tile geometry derived from them and the register split between the warpgroups.

#pragma once

#include "common/bf16.cuh"
#include "common/moe_rules.cuh"
#include "common/ptx.cuh"
#include "common/quant.cuh"
#include "common/sm90.cuh"

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
#ifndef B_FP4
#define B_FP4 0
#endif
#ifndef FP4_EXPAND
#define FP4_EXPAND 0
#endif
#ifndef MEGAMOE_WATCHDOG_NS
#define MEGAMOE_WATCHDOG_NS 2000000000ull
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
// Stages of a tile's weights the producer requests before the tile's rows are ready. The grid's first
// requests (every CTA at once) delay the row placement's stores and release behind them: with the whole
// ring (8 FP4 stages) the rows of a decode batch reached the tiles 10-12 us after launch, with 2 by ~6.4.
constexpr int kEarlyStages = kStages < 4 ? kStages : 4;
constexpr bool kUe8m0 = SCALE_UE8M0 != 0;
// Routed experts' weights as MXFP4 (docs/numerics.md "FP4 experts"); the shared expert stays FP8.
constexpr bool kBFp4 = B_FP4 != 0;
constexpr unsigned long long kWatchdogNs = MEGAMOE_WATCHDOG_NS;

constexpr int kQuant = 128;      // channels per activation scale; edge of a weight-scale block
constexpr int kBlockM = BLOCK_M;  // pool rows per tile (Split / SwapSplit say how the warpgroups share it)
// BLOCK_M 16 or 32: swap-AB, the decode shape. The weights ride on the wgmma's M side and the tile's
// few rows on its N side, so a tile costs the tensor cores kBlockM / 64 of a 64-row tile's work.
constexpr bool kSwapAB = kBlockM < 64;
// FP4 builds with swap-AB tiles: the math threads convert their own A fragments from the packed stage
// (common/fp4_frag.cuh) and issue wgmma with A from registers; no converter warps, no e4m3 tile.
constexpr bool kFp4Regs = kBFp4 && kSwapAB;
// FP4 builds with 64- or 128-row tiles at many rows per expert: warps 1..3 of the producer warpgroup
// expand the routed experts' packed weights into the e4m3 tiles and row scales of every stage
// (megamoe_expand.cuh) while the tiles run, once per forward instead of once per row tile; a routed
// stage is then a copy of its image.
constexpr bool kExpand = FP4_EXPAND != 0;
constexpr int kBlockN = 256;     // L1: 128 gate + 128 up channels; L2: 256 output columns
constexpr int kBlockK = 128;
// Math warpgroups: two, or four in the FP4 register builds of BLOCK_M 16, where the conversion in the
// math threads sets the time and two warps per scheduler left it waiting on latencies; there each takes
// one m64 wave. (BLOCK_M 32's pipelined register path spills at the 104 registers four leave.)
constexpr int kMathWarpgroups = kFp4Regs && kBlockM == 16 ? 4 : 2;
constexpr int kMathThreads = 128 * kMathWarpgroups;
constexpr int kThreads = kMathThreads + 128;  // + the producer warpgroup
constexpr int kMathWarps = kMathThreads / 32;
// FP4, 64- and 128-row tiles: warps 1..3 of the producer warpgroup turn each routed stage's packed
// weights into the e4m3 tile.
constexpr int kConverterWarps = 3;
constexpr int kConverterThreads = 32 * kConverterWarps;
// Items each converter loads ahead (fp4_stage::convert_tile; converters run in the 64- and 128-row
// FP4 builds only): two made ptxas spill in pro's 128-row build, so every fused build takes one.
constexpr int kConvertDepth = 1;
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
static_assert(!kFp4Regs || kBlockM == 16 || kBlockM == 32, "the register path has n16 and n32 wgmmas");
static_assert(!kExpand || (kBFp4 && kBlockM == 128), "FP4_EXPAND: FP4 experts, 128-row tiles");


// Registers: the producer warpgroup gives its share to the math warpgroups. The CTA holds kThreads ·
// kLaunchRegisters from the launch and setmaxnreg only moves them (a sum above that leaves
// setmaxnreg.inc waiting forever). Each of the 4 schedulers has 16384 and holds every fourth warp, in
// steps of 8 registers per thread: 168 for 12 warps, 96 for 20. The math warpgroups take what their code
// needs and the producer the rest: two math warpgroups 224 (the math code needs more than 208), the
// producer 56 (it needs more than 40); the EP build's FP4 converter builds (BLOCK_M 64, 128) spill at 56
// producer registers: math 216 there, the producer 72. Four math warpgroups 104, the producer 64 (at 56
// it spilled in the smallest FP4 build).
constexpr int kLaunchRegisters = (16384 / (kThreads / 128) / 32) & ~7;
#if defined(EP_RANKS) && EP_RANKS > 1
constexpr bool kEpConverters = kBFp4 && !kFp4Regs && !kExpand;
#else
constexpr bool kEpConverters = false;
#endif
constexpr int kMathRegisters = kMathWarpgroups == 4 ? 104 : kEpConverters ? 216 : 224;
constexpr int kProducerRegisters = (kThreads * kLaunchRegisters - kMathThreads * kMathRegisters) / 128;
static_assert(kProducerRegisters % 8 == 0 && kProducerRegisters >= 56, "setmaxnreg's steps; the producer's need");
// With BLOCK_M 128 each math warpgroup owns its 64 rows of a tile outright and publishes them itself, so
// the two drift apart by up to the stage ring instead of meeting at the end of every tile; at 64 they
// exchange the L1 rows' amax and publish together. A tile adds this many to its done counter.
constexpr bool kWarpgroupPublish = kBlockM == 128;
constexpr int kPublishesPerTile = kWarpgroupPublish ? 2 : 1;

}  // namespace
