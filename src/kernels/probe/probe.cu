// Probes of the machine's ceilings: an empty kernel (launch overhead) and a streaming copy
// (device memory bandwidth, bytes read plus bytes written).
#include <cstdint>

extern "C" __global__ void probe_empty() {}

// 16-byte vector copy, grid-stride, with streaming cache hints so the copy measures DRAM and not L2.
extern "C" __global__ void __launch_bounds__(512) probe_copy(const int4* __restrict__ src, int4* __restrict__ dst,
                                                             uint64_t vectors) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    __stcs(dst + i, __ldcs(src + i));
  }
}
