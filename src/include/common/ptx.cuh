// Thin wrappers over PTX instructions that the megamoe kernels share.
//
// Everything here is inline PTX on purpose: the rounding and cache behaviour is then fixed by the
// instruction itself, not by nvcc/NVRTC flags (--use_fast_math, -ftz, --fmad) or by what the
// compiler chooses to fuse. No CUDA headers are included, so NVRTC needs no include path.
#pragma once

namespace megamoe {

// ---- Programmatic dependent launch (sm_90) ----

// Lets the next kernel on the stream, if launched with programmatic stream serialization, start once
// every block of this one has passed here (its launch and prologue then overlap this kernel's rest);
// what it reads of this kernel's writes still waits for wait_for_previous_grid.
__device__ __forceinline__ void allow_next_grid_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Waits until the kernel this one may overlap has completed and its writes are visible; a no-op for a
// plain launch.
__device__ __forceinline__ void wait_for_previous_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// A kernel of a chain launched with programmatic stream serialization (the norm, the gate): waits for
// the previous kernel, then lets the next one launch, so each launch overlaps one kernel's body.
__device__ __forceinline__ void chain_after_previous_grid() {
  wait_for_previous_grid();
  allow_next_grid_launch();
}

// ---- IEEE-rounded fp32 arithmetic (no .ftz, never contracted into an FMA) ----

// x * y rounded to nearest even: what Math.fround(x * y) gives on the CPU.
__device__ __forceinline__ float mul_rn(float x, float y) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}

// x * y + z rounded once to nearest even: what fmaF32(x, y, z) gives on the CPU (src/numerics/fp32.ts).
// An asm statement like its neighbours, so that ptxas schedules the promotions that use it as it does
// theirs (with fmaf it hoisted a promotion's scale loads and spilled in the FP4 GEMM's pipelined tile).
__device__ __forceinline__ float fma_rn(float x, float y, float z) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(x), "f"(y), "f"(z));
  return r;
}

// x / y correctly rounded (the division the CPU reference does), never the fast approximation.
__device__ __forceinline__ float div_rn(float x, float y) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}

// x + y rounded to nearest even: what Math.fround(x + y) gives on the CPU (never fused with a multiply).
__device__ __forceinline__ float add_rn(float x, float y) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}

// 1 / x correctly rounded; equal to div_rn(1, x) for every x.
__device__ __forceinline__ float rcp_rn(float x) {
  float r;
  asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 1 / x by the hardware's approximation (MUFU.RCP, at most 1 ulp off; subnormal results flush to 0):
// one instruction where rcp_rn and div_rn take a Newton refinement and a branch to a slow path.
__device__ __forceinline__ float rcp_approx_ftz(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// ---- Global memory ----

struct u32x4 {
  unsigned int x, y, z, w;
};

// 16-byte read of data this kernel reads once and never writes: the non-coherent path, without
// allocating in L1 (streaming input would only evict useful lines there).
__device__ __forceinline__ u32x4 ld_nc_v4(const void* ptr) {
  u32x4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// 16-byte read of data another CTA wrote earlier in the same launch: cached in L2 only, so a stale L1
// line can never be returned.
__device__ __forceinline__ u32x4 ld_cg_v4(const void* ptr) {
  u32x4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

// 8-byte store; plain st.global so the result stays in L2 for the kernel that consumes it next.
__device__ __forceinline__ void st_v2(void* ptr, unsigned int lo, unsigned int hi) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(ptr), "r"(lo), "r"(hi) : "memory");
}

// 16-byte store, plain st.global like st_v2.
__device__ __forceinline__ void st_v4(void* ptr, u32x4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_f32(float* ptr, float v) {
  asm volatile("st.global.f32 [%0], %1;" ::"l"(ptr), "f"(v) : "memory");
}

// ---- Warp ----

// Max over the 16 lanes of this lane's half-warp (xor offsets below 16 never cross halves).
// Every lane of the half gets the same value: max is exact, so the order cannot matter.
__device__ __forceinline__ float half_warp_max(float v) {
#pragma unroll
  for (int offset = 8; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

}  // namespace megamoe
