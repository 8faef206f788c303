// Cross-CTA synchronization of the fused kernel: acquire and release on workspace counters, CTA-wide
// work claims, and the watchdog that bounds every wait (an overdue wait records itself and traps).

#pragma once

#include "megamoe_config.cuh"

namespace {

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
  kStatusConvertWait = 9,  // FP4 converters: a stage's packed weights never landed
  kStatusExpandWait = 10,  // expand builds: a chunk's packed weights, or an expert's images, never came
};

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

// The next stage of a ring of kStages, the parity flipping at each wrap.
__device__ __forceinline__ void advance_stage(int& stage, unsigned& phase) {
  if (++stage == kStages) {
    stage = 0;
    phase ^= 1u;
  }
}

}  // namespace
