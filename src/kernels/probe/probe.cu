// Probes of the machine's ceilings: an empty kernel (launch overhead), a streaming copy (device memory
// bandwidth, bytes read plus bytes written), a read stream (bytes read only: the ceiling of a kernel
// that streams weights), a TMA weight stream (the same bytes the way the layer's producer loads them) and
// the tensor cores' rate for the mainloops' wgmma shapes.

#include "common/sm90.cuh"

using namespace megamoe::sm90;

extern "C" __global__ void probe_empty() {}

// 16-byte vector copy, grid-stride, with streaming cache hints so the copy measures DRAM and not L2.
extern "C" __global__ void __launch_bounds__(512) probe_copy(const int4* __restrict__ src, int4* __restrict__ dst,
                                                             unsigned long long vectors) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    __stcs(dst + i, __ldcs(src + i));
  }
}

// 16-byte loads that bypass L1 (read-only path, no allocation): each byte is read once, so caching it
// only evicts something else. Volatile, so the compiler neither drops nor sinks a load whose value is
// used only behind the never-taken branch at the end of probe_read.
__device__ __forceinline__ int4 probe_load_stream(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Loads in flight per thread. 8 × 16 B × 1024 resident threads = 128 KiB per SM, several times what
// Little's law asks of one SM at ~4.3 TB/s and ~1 µs of DRAM latency (~33 KiB).
constexpr int kProbeReadUnroll = 8;

// Read-only stream over `vectors` 16-byte vectors, grid-stride. Each iteration a thread issues
// kProbeReadUnroll loads `threads` vectors apart (so every load of a warp is 512 contiguous bytes), then
// folds them into an XOR. The XOR reaches memory only when `write_sink` is nonzero (the host never sets
// it): the kernel writes nothing, yet no load is dead code. 512 threads, at most 64 registers, so two
// blocks stay resident per SM; launch 2 × SMs blocks.
extern "C" __global__ void __launch_bounds__(512, 2) probe_read(const int4* __restrict__ src, unsigned long long vectors,
                                                                unsigned int* __restrict__ sink, int write_sink) {
  const unsigned long long threads = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned int acc = 0;
  for (; i + (kProbeReadUnroll - 1) * threads < vectors; i += kProbeReadUnroll * threads) {
    int4 v[kProbeReadUnroll];
#pragma unroll
    for (int u = 0; u < kProbeReadUnroll; ++u) v[u] = probe_load_stream(src + i + u * threads);
#pragma unroll
    for (int u = 0; u < kProbeReadUnroll; ++u) acc ^= static_cast<unsigned int>(v[u].x ^ v[u].y ^ v[u].z ^ v[u].w);
  }
  for (; i < vectors; i += threads) {
    const int4 v = probe_load_stream(src + i);
    acc ^= static_cast<unsigned int>(v.x ^ v.y ^ v.z ^ v.w);
  }
  if (write_sink != 0) atomicXor(sink + blockIdx.x, acc);  // one word per block: the XOR of its threads
}

// Weight tiles streamed through a TMA stage ring with no math: how fast the fused kernel's producer could
// feed its math warps at decode, where each CTA streams one tile of weights (tile_rows rows × k_blocks
// K blocks of piece_bytes per row: 128 for FP8, 64 for packed FP4; box_rows rows per TMA box). The map's
// layout decides what a box covers: row-major [rows, K] (piece_bytes out of each of box_rows rows) or
// K-block-major [K blocks][rows][piece_bytes] (box_rows × piece_bytes contiguous bytes), with box
// coordinate (kb·piece_bytes, row) or (0, kb·total_rows + row); `layout` 2 copies the K-block-major
// boxes as plain bulk copies from `src` instead, and 3 through a map of rows twice as wide, unswizzled,
// coordinate (0, (kb·total_rows + row) / 2) (both what a layout stored already swizzled would load).
// Thread 0 loads, thread 32 frees each stage once it lands.
extern "C" __global__ void __launch_bounds__(64, 1) probe_tma_stream(const __grid_constant__ TensorMap map, int tile_rows,
                                                                     int box_rows, int total_rows, int k_blocks,
                                                                     int layout, int stages, int piece_bytes,
                                                                     int* stalled, const unsigned char* src) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned base = align_up(smem_u32(smem), 1024);
  const unsigned stage_bytes = static_cast<unsigned>(tile_rows * piece_bytes);
  const unsigned full_bar = base + stages * stage_bytes;
  const unsigned empty_bar = full_bar + 8 * stages;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full_bar + 8 * s, 1);
      mbar_init(empty_bar + 8 * s, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const auto on_stall = [&] { atomicAdd(stalled, 1); };
  const int row0 = blockIdx.x * tile_rows;
  if (tid == 0) {
    for (int kb = 0; kb < k_blocks; ++kb) {
      const int s = kb % stages;
      if (kb >= stages) mbar_wait_bounded(empty_bar + 8 * s, ((kb / stages) - 1) & 1, 1000000000ull, on_stall);
      mbar_arrive_expect_tx(full_bar + 8 * s, stage_bytes);
      for (int r = 0; r < tile_rows; r += box_rows) {
        const unsigned dst = base + s * stage_bytes + r * piece_bytes;
        if (layout == 2) {
          const long long row = static_cast<long long>(kb) * total_rows + row0 + r;
          bulk_load(dst, src + row * piece_bytes, static_cast<unsigned>(box_rows * piece_bytes), full_bar + 8 * s);
        } else if (layout == 1) {
          tma_load_2d(dst, &map, full_bar + 8 * s, 0, kb * total_rows + row0 + r);
        } else if (layout == 3) {
          tma_load_2d(dst, &map, full_bar + 8 * s, 0, (kb * total_rows + row0 + r) / 2);
        } else {
          tma_load_2d(dst, &map, full_bar + 8 * s, kb * piece_bytes, row0 + r);
        }
      }
    }
  } else if (tid == 32) {
    for (int kb = 0; kb < k_blocks; ++kb) {
      const int s = kb % stages;
      mbar_wait_bounded(full_bar + 8 * s, (kb / stages) & 1, 1000000000ull, on_stall);
      mbar_arrive(empty_bar + 8 * s);
    }
  }
}

// The tensor cores' rate for a mainloop's shape with no memory traffic: each of the CTA's warpgroups
// (blockDim / 128, up to 3) runs k_blocks K blocks of `chunks` chunks, a chunk being four m64 × n(kN) × k32
// wgmmas on fixed shared-memory tiles, waited for as the mainloops do, and with kPromote added into a
// second accumulator (the per-block promotion: kN / 2 FFMAs per thread). Without it only the last
// chunk's sums reach the sink, and ptxas may drop wgmmas whose results nothing reads: that rate is an
// upper bound, not a measurement.
template <int kN, bool kPromote>
__device__ __forceinline__ void wgmma_rate(int k_blocks, int chunks, float* sink) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned base = align_up(smem_u32(smem), 1024);
  // Random e4m3 bytes without NaNs (exponent bits 1110 at most): the tensor cores' power, and with it
  // their clock, depends on the data.
  for (unsigned i = threadIdx.x * 4; i < 56 * 1024; i += blockDim.x * 4) {
    unsigned h = (i + 0x9e3779b9u) * 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(base + i), "r"(h & 0xf7f7f7f7u) : "memory");
  }
  __syncthreads();
  const unsigned a = base + (threadIdx.x / 128) * 8192;  // this warpgroup's 64 rows (up to 3 warpgroups)
  const unsigned b = base + 3 * 8192;                     // 256 B rows: 32 KB
  float partial[kN / 2];
  float acc[kN / 2];
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) acc[i] = 0.0f;
  for (int kb = 0; kb < k_blocks; ++kb) {
    for (int c = 0; c < chunks; ++c) {
      wgmma_block_k128(partial, a, b + static_cast<unsigned>((c * kN) % 256) * 128);
      if constexpr (kPromote) promote_block(acc, partial, 1.0f, 1.0f);
    }
  }
  // Every promoted value feeds the sink (the host passes none), so no FFMA is dead code.
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) total += acc[i] + partial[i];
  if (sink != nullptr) sink[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

extern "C" __global__ void __launch_bounds__(384, 1) probe_wgmma_n128(int k_blocks, int chunks, int promote, float* sink) {
  if (promote != 0) wgmma_rate<128, true>(k_blocks, chunks, sink);
  else wgmma_rate<128, false>(k_blocks, chunks, sink);
}

extern "C" __global__ void __launch_bounds__(384, 1) probe_wgmma_n256(int k_blocks, int chunks, float* sink) {
  wgmma_rate<256, false>(k_blocks, chunks, sink);
}
