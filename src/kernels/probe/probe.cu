// Probes of the machine's ceilings: an empty kernel (launch overhead) and a streaming copy
// (device memory bandwidth, bytes read plus bytes written).


extern "C" __global__ void probe_empty() {}

// 16-byte vector copy, grid-stride, with streaming cache hints so the copy measures DRAM and not L2.
extern "C" __global__ void __launch_bounds__(512) probe_copy(const int4* __restrict__ src, int4* __restrict__ dst,
                                                             unsigned long long vectors) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors; i += stride) {
    __stcs(dst + i, __ldcs(src + i));
  }
}
