// Hopper (sm_90a) building blocks shared by the GEMM-shaped kernels: shared-memory addresses, mbarriers,
// TMA loads (tensor and plain bulk), named barriers, register hand-over between warpgroups, and wgmma on
// e4m3 operands in 128-byte-swizzled shared memory. Inline PTX only, so NVRTC needs no CUDA headers.
#pragma once

#include "ptx.cuh"

namespace megamoe::sm90 {

// A CUtensorMap (128 bytes, 64-byte aligned) passed by value as a __grid_constant__ kernel parameter.
struct alignas(64) TensorMap {
  unsigned long long words[16];
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Raises the bytes the current phase expects without arriving (a second copy into a stage whose
// arrive comes with another).
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Waits for the phase of parity `parity` of the mbarrier at `bar`. A wait longer than `timeout_ns` is a
// wedged pipeline (a bug): `on_stall()` records it, and the thread exits so the kernel ends and the host
// can report it instead of hanging the GPU.
template <typename OnStall>
__device__ __forceinline__ void mbar_wait_bounded(unsigned bar, unsigned parity, unsigned long long timeout_ns,
                                                  OnStall on_stall) {
  if (mbar_try_wait(bar, parity)) return;
  const unsigned long long start = global_timer_ns();
  while (!mbar_try_wait(bar, parity)) {
    if (global_timer_ns() - start > timeout_ns) {
      on_stall();
      asm volatile("exit;");
    }
  }
}

// The same wait with the warp's lanes spinning together: the loop's branches are warp votes, which the
// compiler knows to be uniform. Needed where a wgmma group is in flight across the wait: around a branch
// it cannot prove uniform, ptxas makes every wgmma of the kernel wait for the previous (warning C7518).
template <typename OnStall>
__device__ __forceinline__ void mbar_wait_bounded_warp(unsigned bar, unsigned parity, unsigned long long timeout_ns,
                                                       OnStall on_stall) {
  if (__all_sync(0xffffffffu, mbar_try_wait(bar, parity))) return;
  const unsigned long long start = global_timer_ns();
  while (!__all_sync(0xffffffffu, mbar_try_wait(bar, parity))) {
    if (__any_sync(0xffffffffu, global_timer_ns() - start > timeout_ns)) {
      on_stall();
      asm volatile("exit;");
    }
  }
}

__device__ __forceinline__ void tma_load_2d(unsigned dst, const TensorMap* map, unsigned bar, int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap* map, unsigned bar, int x, int y, int z) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::
          "r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
}

// A linear copy of `bytes` (a multiple of 16) from global to shared memory by the TMA unit, completing
// on the mbarrier at `bar` (no tensor map: the bytes land as they lie).
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// A linear copy of `bytes` (a multiple of 16) from shared to global memory by the TMA unit, in the
// thread's current bulk group (bulk_commit closes it; bulk_wait_read / bulk_wait wait for groups).
__device__ __forceinline__ void bulk_store(void* dst, unsigned src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Until at most kPending of this thread's bulk groups still read their shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until at most kPending of this thread's bulk groups are still incomplete (their writes not done).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}

// x, opaque to the compiler: a value computed from it is computed where it is used, not hoisted out of
// the loop around it into a register the loop cannot spare.
__device__ __forceinline__ int opaque_i32(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

__device__ __forceinline__ void named_barrier_sync(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Counts this thread's arrival at named barrier `id` without waiting (the waiting side calls
// named_barrier_sync with the same thread count).
__device__ __forceinline__ void named_barrier_arrive(unsigned id, unsigned threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }

// Pins accumulator registers at this point of the program: the compiler may not move their reads or
// writes across it (wgmma writes them asynchronously, behind the compiler's back).
template <int kCount>
__device__ __forceinline__ void fence_registers(float (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major e4m3 tile written by TMA with the 128-byte swizzle:
// rows of 128 bytes, 8-row core-matrix groups 1024 bytes apart (stride byte offset), the leading byte
// offset unused for swizzled K-major layouts, layout type 1 = 128B swizzle in bits 62-63.
constexpr unsigned long long kDescriptorHigh = (1024ull >> 4) | (1ull << 30);
__device__ __forceinline__ unsigned long long smem_descriptor(unsigned address) {
  return (kDescriptorHigh << 32) | ((address >> 4) & 0x3fffu);
}

// wgmma_e4m3 (overloaded on n = 2 · accumulator count: 16, 32, 64, 128, 256):
// D[64 × n] (+)= A[64 × 32] · B[n × 32]ᵀ, e4m3 operands from shared memory; accumulate = 0 overwrites D.
// Accumulator fragment (PTX ISA, wgmma .m64nNk32 D layout): thread t of the warpgroup holds, for each
// i < n/8, d[4i], d[4i+1] at row 16·(t/32) + (t%32)/4, columns 8i + 2·(t%4) + {0, 1}, and d[4i+2],
// d[4i+3] at the row 8 below.
__device__ __forceinline__ void wgmma_e4m3(float (&d)[8], unsigned long long desc_a, unsigned long long desc_b,
                                           int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_e4m3(float (&d)[16], unsigned long long desc_a,
                                                unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15 "
      "}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_e4m3(float (&d)[32], unsigned long long desc_a,
                                                unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31 "
      "}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_e4m3(float (&d)[64], unsigned long long desc_a,
                                                 unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63 "
      "}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_e4m3(float (&d)[128], unsigned long long desc_a,
                                                  unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, "
      "%40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, "
      "%72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, "
      "%88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, "
      "%104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, "
      "%120, %121, %122, %123, %124, %125, %126, %127 "
      "}, %128, %129, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// wgmma_e4m3_rs (n = 16, 32): the same product with A from registers, `a` the thread's four .b32 of the
// 8-bit A fragment (PTX ISA, wgmma .m64nNk32 A register fragment; common/fp4_frag.cuh spells it out).
// The tensor cores read `a` after the instruction issues: keep it unchanged until a wgmma_wait covers
// the group (fence_operands after the wait).
__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[8], const unsigned (&a)[4], unsigned long long desc_b,
                                              int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

__device__ __forceinline__ void wgmma_e4m3_rs(float (&d)[16], const unsigned (&a)[4], unsigned long long desc_b,
                                              int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15 "
      "}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}

// The first k32 step of a block (D = A·B, d not read): d's old values need not stay live up to it.
__device__ __forceinline__ void wgmma_e4m3_rs_first(float (&d)[8], const unsigned (&a)[4], unsigned long long desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

__device__ __forceinline__ void wgmma_e4m3_rs_first(float (&d)[16], const unsigned (&a)[4], unsigned long long desc_b) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "setp.ne.b32 p, 0, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, "
      "%8, %9, %10, %11, %12, %13, %14, %15 "
      "}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]),
        "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// Pins A-fragment registers (see wgmma_e4m3_rs) at this point: they stay live and unchanged up to it.
template <int kCount>
__device__ __forceinline__ void fence_operands(unsigned (&r)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Waits until at most kPending committed wgmma groups of this warpgroup are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// One 128-deep K block on the tensor cores, issued and not waited for: partial = A[64 × 128] · B[n × 128]ᵀ
// as four k32 wgmmas into a fresh accumulator (n = 2 · kCount), committed as one group. `a` and `b` are
// the shared-memory addresses of the first row of the 128-byte-swizzled K-major tiles. Until a
// wgmma_wait covers the group, `partial` belongs to the tensor cores: fence_registers(partial) after the
// wait, before reading it.
template <int kCount>
__device__ __forceinline__ void wgmma_issue_k128(float (&partial)[kCount], unsigned a, unsigned b) {
  fence_registers(partial);
  wgmma_fence();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    // Within a 128-byte swizzled row, the k-th 32-byte slice starts 32·k bytes further.
    wgmma_e4m3(partial, smem_descriptor(a + k * 32), smem_descriptor(b + k * 32), k > 0 ? 1 : 0);
  }
  wgmma_commit();
}

// The same K block, waited for.
template <int kCount>
__device__ __forceinline__ void wgmma_block_k128(float (&partial)[kCount], unsigned a, unsigned b) {
  wgmma_issue_k128(partial, a, b);
  wgmma_wait<0>();
  fence_registers(partial);
}

// acc += partial · scale, the promotion of one K block into the fp32 accumulators: in the wgmma D
// fragment, elements 4i, 4i+1 lie on the thread's upper row (scale_lo) and 4i+2, 4i+3 eight rows below
// (scale_hi). acc may be longer than partial (a kernel sizing it for its widest chunk); kFirst places
// the block's columns further along it (an n128 chunk promoted as two n64 halves: 0 and 32).
template <int kFirst = 0, int kCount, int kAccCount>
__device__ __forceinline__ void promote_block(float (&acc)[kAccCount], const float (&partial)[kCount],
                                              float scale_lo, float scale_hi) {
  static_assert(kFirst + kCount <= kAccCount, "the accumulators must hold the block");
#pragma unroll
  for (int i = 0; i < kCount / 4; ++i) {
    float* const a = acc + kFirst + 4 * i;
    a[0] = fmaf(partial[4 * i + 0], scale_lo, a[0]);
    a[1] = fmaf(partial[4 * i + 1], scale_lo, a[1]);
    a[2] = fmaf(partial[4 * i + 2], scale_hi, a[2]);
    a[3] = fmaf(partial[4 * i + 3], scale_hi, a[3]);
  }
}

// x rounded up to a multiple of a (shared-memory layouts).
__host__ __device__ constexpr unsigned align_up(unsigned x, unsigned a) { return (x + a - 1) / a * a; }

__device__ __forceinline__ float load_scale(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ float load_shared_f32(unsigned address) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(address));
  return v;
}

__device__ __forceinline__ unsigned load_shared_u32(unsigned address) {
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(address) : "memory");
  return v;
}

__device__ __forceinline__ void store_shared_f32(unsigned address, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(address), "f"(v) : "memory");
}
__device__ __forceinline__ void store_shared_u32(unsigned address, unsigned v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(address), "r"(v) : "memory");
}

__device__ __forceinline__ void store_shared_u8(unsigned address, unsigned char v) {
  asm volatile("st.shared.b8 [%0], %1;" ::"r"(address), "h"(static_cast<unsigned short>(v)) : "memory");
}

__device__ __forceinline__ void store_shared_u16(unsigned address, unsigned short v) {
  asm volatile("st.shared.b16 [%0], %1;" ::"r"(address), "h"(v) : "memory");
}

__device__ __forceinline__ megamoe::u32x4 load_shared_v4(unsigned address) {
  megamoe::u32x4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address)
               : "memory");
  return v;
}

__device__ __forceinline__ void store_shared_v2(unsigned address, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(address), "f"(x), "f"(y) : "memory");
}

// Epilogue staging. A warp's wgmma accumulator fragment covers 16 rows, and a thread's pieces of a row
// are 4–8 bytes with the quad's other lanes beside them: stored straight to global memory, one
// instruction touches 8 rows for 32–128 bytes. So the warp writes its fragment into a shared-memory
// area first (rows kPitch bytes apart, a pitch chosen so that one store instruction's 8 rows fall on
// different banks) and this copies the rows out in 16-byte pieces, kRowBytes / 16 lanes per row: the
// first kRowBytes of each of the 16 rows to dst + r·stride, for r < rows_valid. The warp syncs before
// (the staged bytes are other lanes') and after (the next staging overwrites the area).
// A warp's area holds kStagedRows rows of up to kStagedRowBytes, kPitch apart (kernels/variants.ts:
// stagingAreaBytes mirrors the size).
constexpr int kStagedRows = 16;
constexpr int kStagedRowBytes = 128;
__host__ __device__ constexpr unsigned staging_area_bytes(unsigned pitch) { return kStagedRows * pitch; }
// The two pitches (kernels/variants.ts mirrors them): rows staged by 4-byte stores (bf16 pairs, FP8
// quads) start 4 banks apart at 144 bytes, rows of 8-byte stores (fp32 pairs) 8 banks apart at 160; either
// way the 8 rows of one store instruction meet no bank twice.
constexpr unsigned kStagingPitchNarrow = kStagedRowBytes + 16;
constexpr unsigned kStagingPitchWide = kStagedRowBytes + 32;

// 16 bytes from shared memory to global memory, the store under a predicate and with no branch: for code
// that runs while a wgmma group is in flight, where a branch the compiler cannot prove warp-uniform makes
// ptxas serialize the kernel's wgmmas. One asm block, so the load's registers live only through it.
__device__ __forceinline__ void copy_piece_if(bool store, void* dst, unsigned src) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b32 x, y, z, w;\nsetp.ne.b32 p, %2, 0;\n"
      "ld.shared.v4.b32 {x, y, z, w}, [%1];\n@p st.global.v4.b32 [%0], {x, y, z, w};\n}" ::"l"(dst),
      "r"(src), "r"(static_cast<unsigned>(store))
      : "memory");
}

// kBranchFree: every lane reads its pieces and only the stores are predicated (copy_piece_if), for a
// copy-out that runs while a wgmma group is in flight.
template <int kRowBytes, int kPitch, bool kBranchFree = false>
__device__ __forceinline__ void copy_out_staged_rows(unsigned staging, unsigned char* dst, long long stride,
                                                     int rows_valid, int lane) {
  static_assert(kRowBytes % 16 == 0 && kRowBytes >= 16 && kRowBytes <= kStagedRowBytes,
                "a staged row is 16-byte pieces");
  static_assert(kPitch >= kRowBytes && kPitch % 16 == 0, "the pitch holds a row, 16-byte aligned");
  constexpr int kRows = kStagedRows;
  constexpr int kLanesPerRow = kRowBytes / 16;
  constexpr int kRowsPerPass = 32 / kLanesPerRow;
  const int piece = lane % kLanesPerRow;
  __syncwarp();
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int r = pass * kRowsPerPass + lane / kLanesPerRow;
    if constexpr (kBranchFree) {
      copy_piece_if(r < rows_valid, dst + r * stride + 16 * piece, staging + r * kPitch + 16 * piece);
    } else if (r < rows_valid) {
      megamoe::st_v4(dst + r * stride + 16 * piece, load_shared_v4(staging + r * kPitch + 16 * piece));
    }
  }
  __syncwarp();
}

// The same copy for a tile staged across several warps' areas (rows kPitch bytes apart from `staging`, any
// number of them, rows of any multiple of 16 bytes): `rows` rows to dst + r·stride in 16-byte pieces
// dealt to `threads` threads, this one being `index`. The caller synchronizes the threads around it.
template <int kRowBytes, int kPitch>
__device__ __forceinline__ void copy_out_staged_tile(unsigned staging, unsigned char* dst, long long stride, int rows,
                                                     int index, int threads) {
  static_assert(kRowBytes % 16 == 0 && kPitch >= kRowBytes && kPitch % 16 == 0, "16-byte pieces of staged rows");
  constexpr int kPieces = kRowBytes / 16;
  for (int p = index; p < rows * kPieces; p += threads) {
    const int r = p / kPieces;
    const int piece = p % kPieces;
    megamoe::st_v4(dst + r * stride + 16 * piece, load_shared_v4(staging + r * kPitch + 16 * piece));
  }
}

// Orders this thread's generic-proxy global writes before later async-proxy (TMA) reads of them, and
// the other way round: data written with st.global and read by another CTA's TMA needs it on both sides.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace megamoe::sm90
