// Probes of the machine's ceilings: an empty kernel (launch overhead), a streaming copy (device memory
// bandwidth, bytes read plus bytes written) and a read stream (bytes read only: the ceiling of a
// kernel that streams weights).


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
