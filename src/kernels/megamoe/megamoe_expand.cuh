// Expansion for FP4 builds at many rows per expert (FP4_EXPAND 1): warps 1..3 of the producer
// warpgroup, idle there otherwise, turn every routed stage's packed weights into the e4m3 tile the
// converter warps of the other builds would make from it, and store it as the stage's image, while the
// tiles run. An expert's stage is then converted once per forward instead of once per row tile, and a
// routed stage's weights are one linear copy of its image. The conversion is fp4_stage::convert_tile's,
// so the tiles are the converter builds' bits.
//
// Chunks (one stage each) in claim order: every expert's W1 (tile n, K block kb), then every expert's W2,
// the order the tiles need them in; the image of chunk c lies at images + c · kImageBytes. An expert with
// no rows is skipped. A CTA's workers hold one buffer (megamoe_layout.cuh): the next chunk's packed rows
// land while this one's image is stored. A chunk counts in expanded[W1: expert, W2: kExperts + expert]
// once its image is written; a routed task's producer waits for its expert's whole matrix before its
// first copy.

#pragma once

#include "megamoe_layout.cuh"
#include "megamoe_sync.cuh"

namespace {

constexpr int kExpandL1Chunks = (kInter / kQuant) * kHiddenBlocks;  // per expert: L1 tiles × K blocks
constexpr int kExpandL2Chunks = kL2TilesPerBlock * (kInter / kQuant);
constexpr int kExpandChunks = kExperts * (kExpandL1Chunks + kExpandL2Chunks);
constexpr unsigned kImageBytes = kBTileBytes;  // the e4m3 tile

// The image index of a routed task's stage kb, from the task's first B row (L1: expert · 2I + n · 128,
// L2: expert · H + n · 256): chunk (expert · I/128 + n) · H/128 + kb of W1, or after all of W1 chunk
// (expert · H/256 + n) · I/128 + kb of W2.
__device__ __forceinline__ int expand_chunk_of_row(bool l1, int b_row0, int kb) {
  if (l1) {
    const int expert = b_row0 / (2 * kInter);
    return (b_row0 / kQuant - expert * (kInter / kQuant)) * kHiddenBlocks + kb;
  }
  return kExperts * kExpandL1Chunks + (b_row0 / kBlockN) * (kInter / kQuant) + kb;
}

// Chunks a routed task waits for: its expert's whole matrix.
__device__ __forceinline__ int expand_chunks_per_expert(bool l1) { return l1 ? kExpandL1Chunks : kExpandL2Chunks; }

// What a chunk is: its matrix, expert, tile n and K block (the inverse of expand_chunk_of_row's order).
struct ExpandChunk {
  bool l1;
  int expert;
  int n;
  int kb;
};

__device__ __forceinline__ ExpandChunk expand_chunk_of(int c) {
  const bool l1 = c < kExperts * kExpandL1Chunks;
  const int local = l1 ? c : c - kExperts * kExpandL1Chunks;
  const int per_expert = l1 ? kExpandL1Chunks : kExpandL2Chunks;
  const int k_blocks = l1 ? kHiddenBlocks : kInter / kQuant;
  const int r = local % per_expert;
  return {l1, local / per_expert, r / k_blocks, r % k_blocks};
}

// Named barriers: the three worker warps; the workers' exit, which the math warpgroups wait for before
// the workspace reset (a claim after it would leave the claim counter non-zero for the next launch).
constexpr unsigned kExpandBarrier = 5;
constexpr unsigned kExpandDoneBarrier = 6;
constexpr int kExpandThreads = 96;

// One worker thread (w: 0 .. 95, warps 1..3 of the producer warpgroup) until the claims run out and
// this CTA's images are written and counted. `slot`: a shared int the leader hands the chunk through.
__device__ __forceinline__ void expand_worker(const Operands& op, const Workspace& work, const SharedState& cta,
                                              const TensorMap* map_w1, const TensorMap* map_w2,
                                              const TensorMap* map_w1_words, const TensorMap* map_w2_words,
                                              unsigned bar, int w) {
  const bool leader = w == 0;
  const unsigned buf = cta.base + kOffPacked;
  volatile int* const slot = cta.broadcast + 1;
  // The leader: claims the next chunk of an expert with rows and starts its loads (packed rows and
  // words, as the converter builds' producer loads them).
  const auto claim = [&]() {
    int c;
    for (;;) {
      c = atomicAdd(work.counters + kExpandClaim, 1);
      if (c >= kExpandChunks) break;
      const int e = expand_chunk_of(c).expert;
      if (cta.offsets[e + 1] > cta.offsets[e]) break;
    }
    *slot = c;
    if (c >= kExpandChunks) return;
    const ExpandChunk k = expand_chunk_of(c);
    const int b_row0 = tile_b_row0(k.l1, k.expert, k.n, kInter);
    const int b_row1 = tile_b_row1(k.l1, b_row0, kInter);
    const TensorMap* map_b = k.l1 ? map_w1 : map_w2;
    const TensorMap* map_words = k.l1 ? map_w1_words : map_w2_words;
    mbar_arrive_expect_tx(bar, kExpandPackedBytes + kExpandWordsBytes);
    load_packed_stage(buf, buf + kExpandWordsOffset, map_b, map_words, bar, k.kb, b_row0, b_row1);
  };
  // The leader: counts a chunk whose image is written.
  const auto publish = [&](int c) {
    const ExpandChunk k = expand_chunk_of(c);
    fence_proxy_async_global();
    add_release(work.expanded + (k.l1 ? 0 : kExperts) + k.expert, 1);
  };

  if (leader) claim();
  unsigned phase = 0;
  int stored = -1;  // the leader: the chunk whose image store is the newest bulk group, or −1
  for (;;) {
    named_barrier_sync(kExpandBarrier, kExpandThreads);  // the slot is set; the tile is free
    const int c = *slot;
    if (c >= kExpandChunks) break;
    wait_barrier(bar, phase, op.status, kStatusExpandWait, c);
    phase ^= 1u;
    megamoe::fp4_stage::convert_tile<kBlockN, kExpandThreads, kConvertDepth>(
        buf, buf + kExpandWordsOffset, buf + kExpandTileOffset, w);
    // The TMA (async proxy) reads what these generic writes made.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    named_barrier_sync(kExpandBarrier, kExpandThreads);  // the tile is whole; the packed rows are free
    if (leader) {
      unsigned char* image = op.images + static_cast<size_t>(c) * kImageBytes;
      bulk_store(image, buf + kExpandTileOffset, kBTileBytes);
      bulk_commit();
      claim();  // the next chunk's packed rows land while this image is stored
      // The previous chunk's image is written once at most this newest group is pending.
      if (stored >= 0) {
        bulk_wait<1>();
        publish(stored);
      }
      stored = c;
      bulk_wait_read<0>();  // the tile may be converted into again
    }
  }
  if (leader && stored >= 0) {
    bulk_wait<0>();
    publish(stored);
  }
  named_barrier_arrive(kExpandDoneBarrier, kMathThreads + kExpandThreads);
}

}  // namespace
