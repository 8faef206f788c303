// Kernels for tests/test_gpu.py: small stand-ins for megamoe's, exercising what the runtime must get
// right on a GPU (argument slots after 128-byte tensor maps, scalars of each kind, a struct by value,
// clusters, programmatic stream serialization, the status words). Built with nvcc -cubin -arch=sm_90a.
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

struct Extra {             // 48 bytes: status @0, t @8, neg @12, two @16, big @24, null @32
  int *status;
  unsigned t;
  int neg;
  float two;
  unsigned long long big;
  const void *null;
};

extern "C" __global__ void prep(const __grid_constant__ CUtensorMap src, const uint8_t *w13, uint8_t *dst,
                                unsigned n) {
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = w13[i] ^ 0x5A;
}

// out[t, h] = x[t, h] * (sum of the used slots' weights) + prepared[h] * half, rounded once per op.
extern "C" __global__ void fwd(const __grid_constant__ CUtensorMap map, const __nv_bfloat16 *x, unsigned T,
                               const __grid_constant__ CUtensorMap map2, const int *ids, const float *w,
                               __nv_bfloat16 *out, const uint8_t *prepared, int neg, float half,
                               unsigned long long big, unsigned want_cluster, Extra e) {
  unsigned ncta;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(ncta));
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    int bad = 0;
    if (e.t != T) bad |= 1;
    if (e.neg != -1) bad |= 2;
    if (e.two != 2.0f) bad |= 4;
    if (e.big != 12345ull) bad |= 8;
    if (e.null != nullptr) bad |= 16;
    if (neg != (int)T - 9) bad |= 32;
    if (half != 0.5f) bad |= 64;
    if (big != ((unsigned long long)T << 32)) bad |= 128;
    if (ncta != want_cluster) bad |= 256;
    if (bad) {
      e.status[0] = 1000 + bad;
      e.status[1] = blockIdx.x;
      e.status[2] = (int)T;
      e.status[3] = (int)ncta;
    }
  }
  const unsigned H = 256, K = 2;
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < T * H; i += gridDim.x * blockDim.x) {
    unsigned t = i / H, h = i % H;
    float s = 0.0f;
    for (unsigned k = 0; k < K; k++)
      if (ids[t * K + k] >= 0) s = __fadd_rn(s, w[t * K + k]);
    float v = __fadd_rn(__fmul_rn(__bfloat162float(x[i]), s), __fmul_rn((float)prepared[h], half));
    out[i] = __float2bfloat16_rn(v);
  }
}
