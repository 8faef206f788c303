// The expand phase of FP4 builds at many rows per expert (FP4_EXPAND 1): before the tiles, the grid turns
// every routed stage's packed weights into the e4m3 tile and fp32 row scales the converter warps would
// make from it, and stores the pair as the stage's image. An expert's W1 stage is then converted once per
// forward instead of once per row tile, and a routed stage's weights are two linear copies of its image.
// The conversion is fp4_stage::convert_tile's, so the tiles are the converter builds' bits.
//
// Chunks (one stage each) in claim order: every expert's W1 (tile n, K block kb), then every expert's W2;
// the image of chunk c lies at images + c · kImageBytes. An expert with no rows is skipped. Each CTA runs
// two buffers: chunk i + 1's packed rows land while chunk i converts, and chunk i's image is stored while
// chunk i + 1 converts. A chunk counts in expanded[W1: expert, W2: kExperts + expert] once its image is
// written; a routed task's producer waits for its expert's whole matrix before its first copy.

#pragma once

#include "megamoe_layout.cuh"
#include "megamoe_sync.cuh"

namespace {

constexpr int kExpandL1Chunks = (kInter / kQuant) * kHiddenBlocks;  // per expert: L1 tiles × K blocks
constexpr int kExpandL2Chunks = kL2TilesPerBlock * (kInter / kQuant);
constexpr int kExpandChunks = kExperts * (kExpandL1Chunks + kExpandL2Chunks);
constexpr unsigned kImageBytes = kBTileBytes + kBlockN * 4;  // the e4m3 tile, then its row scales

// One expansion buffer: the packed rows (64-byte swizzle: 1024-aligned), the tile, the words, the scales.
constexpr unsigned kExpandPackedBytes = kBlockN * megamoe::fp4_stage::kPackedRowBytes;
constexpr unsigned kExpandWordsBytes = kBlockN * megamoe::fp4_stage::kRowWordBytes;
constexpr unsigned kExpandTileOffset = kExpandPackedBytes;
constexpr unsigned kExpandWordsOffset = kExpandTileOffset + kBTileBytes;
constexpr unsigned kExpandScalesOffset = kExpandWordsOffset + kExpandWordsBytes;
constexpr unsigned kExpandBufferBytes = align_up(kExpandScalesOffset + kBlockN * 4, 1024);
// The buffers borrow the stage ring, which no TMA writes before this CTA's first tile.
static_assert(!kExpand || 2 * kExpandBufferBytes <= kOffTasks, "two expansion buffers fit in the stage ring");

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

// Expands the chunks this CTA claims; returns once the claims run out and its images are written and
// counted. Every thread of the CTA calls it (before setmaxnreg: all 384 convert).
__device__ __forceinline__ void expand_fp4_weights(const Operands& op, const Workspace& work, const SharedState& cta,
                                                   const TensorMap* map_w1, const TensorMap* map_w2,
                                                   const TensorMap* map_w1_words, const TensorMap* map_w2_words,
                                                   unsigned loaded_bar) {
  const int tid = static_cast<int>(threadIdx.x);
  int* const claimed = cta.broadcast + 1;  // claimed[b]: the chunk in buffer b
  // A chunk of an expert without rows is skipped: no load, no image.
  const auto live = [&](int c) {
    if (c >= kExpandChunks) return false;
    const int e = expand_chunk_of(c).expert;
    return cta.offsets[e + 1] > cta.offsets[e];
  };
  // Thread 0: claims a chunk for `buffer` and starts its loads (packed rows and words, as the producer
  // of the converter builds loads them).
  const auto claim = [&](int buffer) {
    const int c = atomicAdd(work.counters + kExpandClaim, 1);
    claimed[buffer] = c;
    if (!live(c)) return;
    const ExpandChunk k = expand_chunk_of(c);
    const int b_row0 = k.l1 ? k.expert * 2 * kInter + k.n * kQuant : k.expert * kHidden + k.n * kBlockN;
    const int b_row1 = k.l1 ? b_row0 + kInter : b_row0 + kQuant;
    const TensorMap* map_b = k.l1 ? map_w1 : map_w2;
    const TensorMap* map_words = k.l1 ? map_w1_words : map_w2_words;
    const unsigned buf = cta.base + buffer * kExpandBufferBytes;
    const unsigned bar = loaded_bar + 8 * buffer;
    mbar_arrive_expect_tx(bar, kExpandPackedBytes + kExpandWordsBytes);
    tma_load_2d(buf, map_b, bar, k.kb * (kBlockK / 2), b_row0);
    tma_load_2d(buf + kExpandPackedBytes / 2, map_b, bar, k.kb * (kBlockK / 2), b_row1);
    tma_load_2d(buf + kExpandWordsOffset, map_words, bar, b_row0, k.kb);
    tma_load_2d(buf + kExpandWordsOffset + kExpandWordsBytes / 2, map_words, bar, b_row1, k.kb);
  };
  // Thread 0: counts a chunk whose image is written.
  const auto publish = [&](int c) {
    const ExpandChunk k = expand_chunk_of(c);
    fence_proxy_async_global();
    add_release(work.expanded + (k.l1 ? 0 : kExperts) + k.expert, 1);
  };

  if (tid == 0) claim(0);
  int buffer = 0;
  unsigned phases = 0;  // bit b: the parity of buffer b's next wait
  int stored = -1;      // thread 0: the chunk whose image store is the newest bulk group, or −1
  int stored_buffer = -1;  // thread 0: the buffer that store reads
  for (;;) {
    __syncthreads();  // claimed[buffer] is set; the other buffer's last conversion is done
    const int c = claimed[buffer];
    if (c >= kExpandChunks) break;
    if (tid == 0) claim(buffer ^ 1);
    if (live(c)) {
      const unsigned buf = cta.base + buffer * kExpandBufferBytes;
      wait_barrier(loaded_bar + 8 * buffer, (phases >> buffer) & 1u, op.status, kStatusExpandWait, c);
      phases ^= 1u << buffer;
      // The last store from this buffer must have read it: the newest group, or one before it.
      if (tid == 0) {
        if (stored_buffer == buffer) bulk_wait_read<0>();
        else bulk_wait_read<1>();
      }
      __syncthreads();
      megamoe::fp4_stage::convert_tile<kBlockN, kThreads, 2>(buf, buf + kExpandWordsOffset, buf + kExpandTileOffset,
                                                            buf + kExpandScalesOffset, tid);
      // The TMA (async proxy) reads what these generic writes made.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      if (tid == 0) {
        unsigned char* image = op.images + static_cast<size_t>(c) * kImageBytes;
        bulk_store(image, buf + kExpandTileOffset, kBTileBytes);
        bulk_store(image + kBTileBytes, buf + kExpandScalesOffset, kBlockN * 4);
        bulk_commit();
        // The previous chunk's image is written once at most this newest group is pending.
        if (stored >= 0) {
          bulk_wait<1>();
          publish(stored);
        }
        stored = c;
        stored_buffer = buffer;
      }
    }
    buffer ^= 1;
  }
  if (tid == 0 && stored >= 0) {
    bulk_wait<0>();
    publish(stored);
  }
  __syncthreads();  // the buffers (the stage ring) are free for the tiles
}

}  // namespace
