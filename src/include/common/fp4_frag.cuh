// FP4 (MXFP4) weights converted straight into a register-sourced wgmma A operand: the swap-AB tiles
// of the fused kernel (B_FP4, BLOCK_M 16 and 32) give each math thread its own share of a stage's
// packed weight rows, so no e4m3 tile goes through shared memory. The codes and 2^ref are those of
// fp4.cuh's fast path (the converters' convert_tile), so the tensor cores see the same operands.
//
// A stage's packed rows: 64 bytes per row (one 128-deep K block, element 2j in the low nibble of byte
// j), as the TMA writes a box of them with the 64-byte swizzle from a 512-byte-aligned base: row r's
// 16-byte chunk c at 64r + 16·(c ^ ((r >> 1) & 3)). The swizzle spreads the 8 rows that one load
// instruction of a warp touches over all 32 banks (unswizzled, rows r and r + 2 share banks).
//
// The A fragment of wgmma .m64nNk32 with 8-bit A (PTX ISA, "Register fragments and shared memory
// matrix layouts", wgmma .m64nNk32 A; CUTLASS ALayout_64x32): thread t of the warpgroup (warp
// w = t / 32, lane l) holds four .b32 registers, byte v of register i being A[row][k] with
//   row = 16w + l/4 + 8·(i & 1),   k = 4·(l % 4) + v + 16·(i >> 1).
// So in k32 step s (= MX group s of the block) a thread needs, of each of its two rows, elements
// 32s + 4(l%4) .. +3 and 32s + 16 + 4(l%4) .. +3: packed bytes 16s + 2(l%4) + {0, 1} and the same 8
// bytes on. Each comes with its neighbour's pair in one aligned u32 load, and a prmt keeps the
// thread's halves: 16 loads and 8 prmt per 64-row slab per K block.
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

// Byte offset from the slab's first row (a multiple of 8 rows from a 512-aligned base) of the aligned
// u32 that holds the thread's two packed bytes of piece j (0: elements 32s + 4(l%4).., 1: 16 further)
// of k32 step s, for row half rh. The thread's bytes are its half (l & 1) of that word.
MEGAMOE_HD unsigned fp4_frag_word(int thread, int rh, int s, int j) {
  const unsigned r = fp4_frag_row(thread, rh);
  const unsigned quad = static_cast<unsigned>(thread) & 3u;
  return 64u * r + ((16u * static_cast<unsigned>(s)) ^ (16u * ((r >> 1) & 3u))) + 8u * static_cast<unsigned>(j) +
         4u * (quad >> 1);
}

// prmt selector that joins the thread's halves of the two pieces' words: piece 0's bytes low, piece 1's high.
MEGAMOE_HD unsigned fp4_frag_select(int thread) { return (thread & 1) != 0 ? 0x7632u : 0x5410u; }

// The four e4m3 A registers of each k32 step of a 64-row slab and one K block, for warpgroup thread
// `thread`: a[s][i] is register i of step s. `packed` is the slab's first packed row (64B-swizzled as
// above), `words` its first row's UE8M0 word (u32 per row, group g in byte g). sw_bits[rh] receives the
// fp32 bits of 2^ref of row half rh (fp4_frag_row). `Mem` as fp4_stage_convert's (ld32 only).
template <class Mem>
MEGAMOE_HD void fp4_fragment_k128(const Mem& mem, unsigned packed, unsigned words, int thread, unsigned (&a)[4][4],
                                  unsigned (&sw_bits)[2]) {
  const unsigned sel = fp4_frag_select(thread);
  unsigned s4[2];
  unsigned w[2][4][2];
  // Every load first, so that their latencies overlap.
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int rh = 0; rh < 2; ++rh) {
    s4[rh] = mem.ld32(words + 4u * fp4_frag_row(thread, rh));
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int s = 0; s < 4; ++s) {
      w[rh][s][0] = mem.ld32(packed + fp4_frag_word(thread, rh, s, 0));
      w[rh][s][1] = mem.ld32(packed + fp4_frag_word(thread, rh, s, 1));
    }
  }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int rh = 0; rh < 2; ++rh) {
    const unsigned s = s4[rh];
    const unsigned max = static_cast<unsigned>(fp4_max_byte(s));
    unsigned b[4];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int g = 0; g < 4; ++g) b[g] = (s >> (8 * g)) & 0xffu;
    const unsigned lo01 = b[0] < b[1] ? b[0] : b[1];
    const unsigned lo23 = b[2] < b[3] ? b[2] : b[3];
    Fp4Table t[4];
    if ((lo01 < lo23 ? lo01 : lo23) + 11u >= max) {  // every group within 11 binades of the largest
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int g = 0; g < 4; ++g) t[g] = fp4_table_fast(b[g] + 12u - max);
    } else {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
      for (int g = 0; g < 4; ++g) t[g] = fp4_table_of_byte(b[g], max);
    }
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int g = 0; g < 4; ++g) {
      // Bytes 0-1: elements 4(l%4).. (register rh), bytes 2-3: 16 further (register 2 + rh).
      fp4x8_to_e4m3(prmt(w[rh][g][0], w[rh][g][1], sel), t[g], a[g][rh], a[g][2 + rh]);
    }
    sw_bits[rh] = fp32_pow2_bits(static_cast<int>(max) - kE8m0Bias - kFp4Top);
  }
}

}  // namespace megamoe
