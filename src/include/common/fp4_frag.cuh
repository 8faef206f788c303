// FP4 (MXFP4) weights converted straight into a register-sourced wgmma A operand: the swap-AB tiles
// of the fused kernel (B_FP4, BLOCK_M 16 and 32) give each math thread its own share of a stage's
// packed weight rows, so no e4m3 tile goes through shared memory. The codes and 2^ref are those of
// fp4.cuh's fast path (the converters' convert_tile), so the tensor cores see the same operands.
//
// The A fragment of wgmma .m64nNk32 with 8-bit A (PTX ISA, "Register fragments and shared memory
// matrix layouts", wgmma .m64nNk32 A; CUTLASS ALayout_64x32): thread t of the warpgroup (warp
// w = t / 32, lane l) holds four .b32 registers, byte v of register i being A[row][k] with
//   row = 16w + l/4 + 8·(i & 1),   k = 4·(l % 4) + v + 16·(i >> 1).
// The device order (fp4.cuh) keeps exactly that: of each of its two rows a thread needs, per k32 step
// s, word (l % 4, s), and the four words (l % 4, 0..3) are one 16-byte chunk. A stage's packed rows
// arrive by TMA with the 64-byte swizzle from a 512-byte-aligned base: row r's chunk q at 64r +
// 16·(q ^ ((r >> 1) & 3)), so a quarter warp's 16-byte loads (two rows, four chunks) cover 128
// contiguous bytes: two loads per 64-row slab and K block, no bank conflict.
//
// Host-compilable like fp4.cuh: test/fixtures/fp4_frag.cpp runs fp4_fragment_k128 for every thread
// and checks each register byte against the tile fp4_stage_convert writes.
#pragma once

#include "fp4.cuh"

namespace megamoe {

// The slab row of fragment row half `rh` (0: the upper row, registers 0 and 2; 1: 8 below, 1 and 3)
// of warpgroup thread `thread` (0..127).
MEGAMOE_HD unsigned fp4_frag_row(int thread, int rh) {
  return 16u * static_cast<unsigned>(thread / 32) + static_cast<unsigned>(thread % 32) / 4u + 8u * rh;
}

// True on every lane when `p` holds on all of the warp's lanes (the device), or `p` (the host runs one
// thread at a time; either way the tables below are the same).
MEGAMOE_HD bool fp4_warp_all(bool p) {
#if defined(__CUDA_ARCH__)
  unsigned r;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nvote.sync.all.pred q, p, 0xffffffff;\nselp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(static_cast<unsigned>(p)));
  return r != 0;
#else
  return p;
#endif
}

// The four e4m3 A registers of each k32 step of a 64-row slab and one K block, for warpgroup thread
// `thread`, with the fast tables and no branch: a[s][i] is register i of step s. `packed` is the slab's
// first packed row (device order, 64B-swizzled as above), `ref_words` its first row's reference word
// (fp4_reference_word, u32 per row). sw_bits[rh] receives the fp32 bits of 2^ref of row half rh
// (fp4_frag_row). `Mem` as fp4_stage_convert's (ld32 and ld128). Returns whether a group of the thread's
// rows lies more than 11 binades under its reference: the fast tables are then wrong for it, and the
// warp must convert again with fp4_fragment_k128_exact. One row at a time: the BLOCK_M 16 builds convert
// under another block's wgmmas with no register to spare.
template <class Mem>
MEGAMOE_HD bool fp4_fragment_k128_fast(const Mem& mem, unsigned packed, unsigned ref_words, int thread,
                                       unsigned (&a)[4][4], unsigned (&sw_bits)[2]) {
  const unsigned quad = static_cast<unsigned>(thread) & 3u;
  bool exact = false;
  MEGAMOE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const unsigned r = fp4_frag_row(thread, rh);
    const unsigned word = mem.ld32(ref_words + 4u * r);
    unsigned w[4];
    mem.ld128(packed + 64u * r + 16u * static_cast<unsigned>(fp4_layout_quarter(static_cast<int>(r), static_cast<int>(quad))), w);
    sw_bits[rh] = fp4_word_scale_bits(word);
    exact = exact || fp4_word_needs_exact(word);
    MEGAMOE_UNROLL
    for (int g = 0; g < 4; ++g) fp4x8_to_e4m3(w[g], fp4_table_fast(12u - fp4_word_offset(word, g)), a[g][rh], a[g][2 + rh]);
  }
  return exact;
}

// The same registers with the exact tables (fp4_table_of_offset, right for every offset), one row at a
// time: this rare pass runs beside the other buffer's fragments.
template <class Mem>
MEGAMOE_HD void fp4_fragment_k128_exact(const Mem& mem, unsigned packed, unsigned ref_words, int thread,
                                        unsigned (&a)[4][4]) {
  const unsigned quad = static_cast<unsigned>(thread) & 3u;
  MEGAMOE_UNROLL
  for (int rh = 0; rh < 2; ++rh) {
    const unsigned r = fp4_frag_row(thread, rh);
    const unsigned word = mem.ld32(ref_words + 4u * r);
    unsigned w[4];
    mem.ld128(packed + 64u * r + 16u * static_cast<unsigned>(fp4_layout_quarter(static_cast<int>(r), static_cast<int>(quad))), w);
    MEGAMOE_UNROLL
    for (int g = 0; g < 4; ++g) fp4x8_to_e4m3(w[g], fp4_table_of_offset(fp4_word_offset(word, g)), a[g][rh], a[g][2 + rh]);
  }
}

// Both: the fast pass, then the exact one when any lane of the warp needs it (so the branch never
// diverges). All 32 lanes of the warp must call it together.
template <class Mem>
MEGAMOE_HD void fp4_fragment_k128(const Mem& mem, unsigned packed, unsigned ref_words, int thread, unsigned (&a)[4][4],
                                  unsigned (&sw_bits)[2]) {
  const bool exact = fp4_fragment_k128_fast(mem, packed, ref_words, thread, a, sw_bits);
  if (!fp4_warp_all(!exact)) fp4_fragment_k128_exact(mem, packed, ref_words, thread, a);
}

}  // namespace megamoe
