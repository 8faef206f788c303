// FP4 (MXFP4) weights → e4m3 codes for wgmma, exactly as docs/numerics.md "FP4 experts (MXFP4)" and
// src/numerics/fp4.ts mxfp4RowsToFp8 define it. Per weight row and 128-deep K block (four 32-element
// groups with UE8M0 bytes b0..b3, 64 packed bytes, element 2j in the low nibble of byte j), with M the
// largest byte of the row's 128 × 128 block (the reference word below carries it):
//
//   ref      = M − 127 − 6
//   d_g      = b_g − 127 − ref           (≤ 6)
//   q8[k]    = e4m3_RNE(e2m1(code[k]) · 2^d_g)
//   sw       = 2^ref                     (fp32, exact: ref ∈ [−133, 121], subnormal below −126)
//
// Two paths, equal on every input (test/numerics/fp4-header.test.ts runs both on the host against
// the TypeScript rule; test/gpu/fp4-convert.test.ts runs the device build of the fast one):
//   exact: integer arithmetic on one element at a time (the definition, readable).
//   fast:  the kernels' path. On the device the packed rows are kept in the device order (below), whose
//          32-bit words each hold the eight elements one lane needs for a wgmma k32 step; per group an
//          8-entry magnitude table (two 32-bit words), and per word two `prmt` lookups of four
//          magnitudes each, the signs already where the e4m3 bytes want them: 7 instructions per 8
//          elements.
// Everything is integer and bit manipulation and compiles as host code too (g++, nvcc host pass),
// with no CUDA header, so NVRTC needs no include path. Scale bytes must not be 0xFF (NaN): the host
// rejects those when it loads the weights (fp4.ts checkMxfp4Scales).
#pragma once

#if defined(__CUDACC__)
#define MEGAMOE_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_HD inline
#endif
// Loop unrolling on the device only: the host build (tests) keeps its loops.
#if defined(__CUDA_ARCH__)
#define MEGAMOE_UNROLL _Pragma("unroll")
#define MEGAMOE_NO_UNROLL _Pragma("unroll 1")
#else
#define MEGAMOE_UNROLL
#define MEGAMOE_NO_UNROLL
#endif

namespace megamoe {

constexpr int kFp4Group = 32;         // elements per UE8M0 byte (the MX block)
constexpr int kFp4GroupsPerBlock = 4;  // groups per 128-deep K block
constexpr int kFp4Top = 6;             // the block's largest group lands at 2^6: 6 · 64 = 384 ≤ 448
constexpr int kE8m0Bias = 127;

// ---- the block's reference exponent and scale ----

// Largest of the four scale bytes packed in `scales4` (group g in byte g).
MEGAMOE_HD int fp4_max_byte(unsigned int scales4) {
  int m = static_cast<int>(scales4 & 0xffu);
  for (int g = 1; g < kFp4GroupsPerBlock; g++) {
    const int b = static_cast<int>((scales4 >> (8 * g)) & 0xffu);
    m = b > m ? b : m;
  }
  return m;
}

// fp32 bit pattern of 2^e for e in [−149, 127] (subnormal below −126): exact, no float arithmetic.
MEGAMOE_HD unsigned int fp32_pow2_bits(int e) {
  return e >= -126 ? static_cast<unsigned int>(e + 127) << 23 : 1u << (e + 149);
}

MEGAMOE_HD float fp32_from_bits(unsigned int bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// ---- the reference word: a row's K-block scales as the kernels read them ----
//
// The reference byte R a row's K block converts relative to (docs/numerics.md, "FP4 → FP8 conversion")
// is its 128 × 128 block's largest byte, so every row of a 128-row block has one scale per K block, as
// FP8 weights do. The kernels never see the UE8M0 bytes themselves: the load-time transform
// (fp4GemmScaleWords, megamoe_fp4_reference_words) stores each row's K block as
//   bits 0..7        R
//   bits 8 + 5g ..   o_g = min(R − b_g, 31), g = 0..3: the group's offset under R (31 and more all give 0)
//   bit 30           some o_g is above 11: that group needs the exact tables (fp4_table_of_offset)
// so a converter needs no maximum. The converters take any R at least each of the row's bytes (o_g ≥ 0,
// so no group lands above 2^6): d_g = b_g − 127 − ref = 6 − o_g with ref = R − 127 − 6.
constexpr unsigned int kFp4ExactFlag = 0x40000000u;
constexpr unsigned int kFp4OffsetClamp = 31u;

MEGAMOE_HD unsigned int fp4_reference_word(unsigned int scales4, unsigned int ref) {
  unsigned int w = ref;
  for (int g = 0; g < kFp4GroupsPerBlock; g++) {
    const unsigned int o = ref - ((scales4 >> (8 * g)) & 0xffu);
    w |= (o < kFp4OffsetClamp ? o : kFp4OffsetClamp) << (8 + 5 * g);
    if (o > 11u) w |= kFp4ExactFlag;
  }
  return w;
}

MEGAMOE_HD unsigned int fp4_word_offset(unsigned int word, int g) { return (word >> (8 + 5 * g)) & 31u; }

// ref = R − 127 − 6, in [−133, 121] for R ≤ 0xFE.
MEGAMOE_HD int fp4_word_ref(unsigned int word) { return static_cast<int>(word & 0xffu) - kE8m0Bias - kFp4Top; }

// sw = 2^ref of a row's K block, as fp32 bits.
MEGAMOE_HD unsigned int fp4_word_scale_bits(unsigned int word) { return fp32_pow2_bits(fp4_word_ref(word)); }

// Whether a group lies more than 11 binades under R: the fast tables are then wrong for it.
MEGAMOE_HD bool fp4_word_needs_exact(unsigned int word) { return (word & kFp4ExactFlag) != 0u; }

// ---- exact path: one element ----

// e4m3 code of e2m1 `code` (0..15) times 2^d, d ≤ 6, rounded to nearest even (as cvt.rn.satfinite
// .e4m3x2.f32 of the exact value; d ≤ 6 never saturates). Works in units of 2^−9, e4m3's smallest
// subnormal: the e2m1 magnitude is M · 0.5 with M ∈ {0, 1, 2, 3, 4, 6, 8, 12}, so the value is
// V = M · 2^(d + 8) units.
MEGAMOE_HD constexpr unsigned int e2m1_to_e4m3_exact(unsigned int code, int d) {
  const unsigned int sign = (code & 8u) << 4;
  const unsigned int e = (code >> 1) & 3u;
  const unsigned int mant = code & 1u;
  // M = mantissa·... : code 1 is the subnormal 0.5 (M = 1); normal codes are (2 + mant) << (e − 1).
  const unsigned int M = e == 0 ? mant : (2u + mant) << (e - 1);
  const int shift = d + 8;
  unsigned int v = 0;
  if (shift >= 0) {
    v = M << shift;  // ≤ 12 · 2^14: fits
  } else {
    // Below e4m3's subnormal step: round M / 2^s to nearest even. M ≤ 12 < 16, so s ≥ 5 gives 0.
    const int s = -shift > 8 ? 8 : -shift;
    const unsigned int q = M >> s;
    const unsigned int rem = M & ((1u << s) - 1u);
    const unsigned int half = 1u << (s - 1);
    v = q + ((rem > half || (rem == half && (q & 1u) != 0u)) ? 1u : 0u);
  }
  if (v < 8u) return sign | v;  // subnormal (or zero): mantissa field = V
  // Normal: V = (8 + m) · 2^(E − 1) with at most two significant bits, so the shift drops only zeros.
  int p = 3;
  while ((v >> (p + 1)) != 0u) p++;
  const unsigned int E = static_cast<unsigned int>(p - 2);
  const unsigned int m = (v >> (p - 3)) & 7u;
  return sign | (E << 3) | m;
}

// Element e's 4-bit code in a row's K block of 64 bytes in the stored order (element 2j in the low
// nibble of byte j).
MEGAMOE_HD unsigned int fp4_stored_code(const unsigned char* block, int e) {
  const unsigned int byte = block[e >> 1];
  return (e & 1) != 0 ? byte >> 4 : byte & 0xfu;
}

// One row's 128-deep K block: `packed` 64 bytes (element 2j low nibble of byte j), `word` its reference
// word (fp4_reference_word), `out` 128 e4m3 codes. Returns ref (sw = 2^ref).
MEGAMOE_HD int fp4_block_to_e4m3_exact(const unsigned char* packed, unsigned int word, unsigned char* out) {
  for (int g = 0; g < kFp4GroupsPerBlock; g++) {
    const int d = kFp4Top - static_cast<int>(fp4_word_offset(word, g));
    for (int j = 0; j < kFp4Group; j++) {
      const int k = g * kFp4Group + j;
      out[k] = static_cast<unsigned char>(e2m1_to_e4m3_exact(fp4_stored_code(packed, k), d));
    }
  }
  return fp4_word_ref(word);
}

// ---- fast path: four elements per lookup ----

struct Fp4Table {
  unsigned int lo;  // e4m3 magnitude codes of e2m1 magnitudes 0..3 (byte m)
  unsigned int hi;  // … of magnitudes 4..7 (byte m − 4)
};

// The magnitude table of a group whose offset is d (= b − 127 − ref ≤ 6). From d ≥ −5 every nonzero
// magnitude is an e4m3 normal and the table is the e2m1 bits shifted into e4m3's exponent/mantissa
// fields plus the exponent offset (d + 6) << 3 (e2m1 exponent bias 1, e4m3's 7): fp4_table_fast of
// e = d + 6, one multiply-add per word (no carries between bytes: every byte stays below 0x80).
MEGAMOE_HD Fp4Table fp4_table_fast(unsigned int e) { return Fp4Table{e * 0x08080800u + 0x0c080000u, e * 0x08080808u + 0x1c181410u}; }

// Below d = −5 (rare: a group more than 11 binades under its block's largest), per entry: word `half`
// holds the codes of magnitudes 4·half … 4·half + 3.
MEGAMOE_HD constexpr unsigned int fp4_table_word(int d, int half) {
  unsigned int word = 0;
  for (int m = 4 * half; m < 4 * half + 4; m++) {
    if (m > 0) word |= e2m1_to_e4m3_exact(static_cast<unsigned int>(m), d) << (8 * (m - 4 * half));
  }
  return word;
}

// The table of a group o binades under its reference (o = R − b, d = 6 − o, o ≤ 31): from o = 19 every
// magnitude rounds to 0 (M · 2^(d + 8) is under half a subnormal step). The fast passes take
// fp4_table_fast(12 − o), right up to o = 11; the exact ones this: one constant-bank load per word on the
// device, with no branch or select (both cost the register-converting tiles registers they lack).
#define MEGAMOE_FP4_TABLE(o) fp4_table_word(kFp4Top - (o), 0), fp4_table_word(kFp4Top - (o), 1)
#if defined(__CUDA_ARCH__)
__constant__ alignas(8) unsigned int kFp4Tables[64] = {
#else
inline constexpr unsigned int kFp4Tables[64] = {
#endif
    MEGAMOE_FP4_TABLE(0),  MEGAMOE_FP4_TABLE(1),  MEGAMOE_FP4_TABLE(2),  MEGAMOE_FP4_TABLE(3),
    MEGAMOE_FP4_TABLE(4),  MEGAMOE_FP4_TABLE(5),  MEGAMOE_FP4_TABLE(6),  MEGAMOE_FP4_TABLE(7),
    MEGAMOE_FP4_TABLE(8),  MEGAMOE_FP4_TABLE(9),  MEGAMOE_FP4_TABLE(10), MEGAMOE_FP4_TABLE(11),
    MEGAMOE_FP4_TABLE(12), MEGAMOE_FP4_TABLE(13), MEGAMOE_FP4_TABLE(14), MEGAMOE_FP4_TABLE(15),
    MEGAMOE_FP4_TABLE(16), MEGAMOE_FP4_TABLE(17), MEGAMOE_FP4_TABLE(18), MEGAMOE_FP4_TABLE(19),
    MEGAMOE_FP4_TABLE(20), MEGAMOE_FP4_TABLE(21), MEGAMOE_FP4_TABLE(22), MEGAMOE_FP4_TABLE(23),
    MEGAMOE_FP4_TABLE(24), MEGAMOE_FP4_TABLE(25), MEGAMOE_FP4_TABLE(26), MEGAMOE_FP4_TABLE(27),
    MEGAMOE_FP4_TABLE(28), MEGAMOE_FP4_TABLE(29), MEGAMOE_FP4_TABLE(30), MEGAMOE_FP4_TABLE(31)};
#undef MEGAMOE_FP4_TABLE

// On the device one volatile 8-byte constant-bank load: ptxas may not hoist it out of the rare exact
// pass into the code around it, where its registers spilled the register-converting tiles.
MEGAMOE_HD Fp4Table fp4_table_of_offset(unsigned int o) {
#if defined(__CUDA_ARCH__)
  unsigned int lo;
  unsigned int hi;
  // The table's state-space address (the C++ pointer would be a generic one): its mangled name.
  asm volatile(
      "{\n.reg .u64 a;\nmov.u64 a, _ZN7megamoe10kFp4TablesE;\nmad.wide.u32 a, %2, 8, a;\n"
      "ld.const.v2.u32 {%0, %1}, [a];\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(o));
  return Fp4Table{lo, hi};
#else
  return Fp4Table{kFp4Tables[2u * o], kFp4Tables[2u * o + 1u]};
#endif
}

// PTX prmt.b32 (default mode): output byte i is byte (c >> 4i) & 7 of {b:a} (a = bytes 0..3), or that
// byte's sign replicated when bit 4i + 3 of c is set. The host emulation covers the mode used here.
MEGAMOE_HD unsigned int prmt(unsigned int a, unsigned int b, unsigned int c) {
#if defined(__CUDA_ARCH__)
  unsigned int r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
#else
  const unsigned long long ab = (static_cast<unsigned long long>(b) << 32) | a;
  unsigned int r = 0;
  for (int i = 0; i < 4; i++) {
    const unsigned int sel = (c >> (4 * i)) & 0xfu;
    unsigned int byte = static_cast<unsigned int>(ab >> (8 * (sel & 7u))) & 0xffu;
    if ((sel & 8u) != 0u) byte = (byte & 0x80u) != 0u ? 0xffu : 0u;
    r |= byte << (8 * i);
  }
  return r;
#endif
}

// ---- the device order of packed rows ----
//
// Per row and 128-deep K block the 64 packed bytes are 16 words; word (q, s) at byte 16q + 4s (q, s =
// 0..3) holds the elements L_v = 32s + 4q + v and H_v = 32s + 16 + 4q + v (v = 0..3): what lane quad q
// of a warpgroup holds of a weight row in k32 step s of wgmma's A fragment (bytes v of registers rh and
// 2 + rh), all of group s. Bits: |L_v| at 4v, |H_v| at 16 + 4v (three each), sign(L_v) at 8v + 7,
// sign(H_v) at 8v + 3. So one 16-byte load gives a lane a row's block, the low 16 bits are the
// magnitude selectors of L for `prmt` and the high 16 those of H, and the signs sit at bit 7 of each
// byte (L) or move there with one shift (H). docs/numerics.md states the order; src/numerics/fp4.ts
// mxfp4DeviceOrder is its host form.
//
// The device layout places those blocks K-block-major over a tensor's stacked rows (all experts' [rows,
// K/2] matrices, or a GEMM's G·N rows): [K/128][rows][64 bytes], so that a TMA box of one K block's
// consecutive rows is one contiguous run instead of 64-byte pieces a row apart, and stores each block's
// quarters already swizzled (fp4_layout_quarter). The kernels' packed maps are then 3-D and unswizzled
// with two rows per TMA row, {128 bytes, rows / 2, K blocks}, as wide as FP8's: a load names
// (0, row / 2, kb). mxfp4DeviceLayout is the host form, fp4_convert.cu's megamoe_fp4_device_layout puts
// weights in it.

// The 64-byte row of the device layout holding K block kb of row `row` of `rows` stacked rows.
MEGAMOE_HD int fp4_layout_row(int row, int rows, int kb) { return kb * rows + row; }

// Word (q, s) of the device order, from a K block in the stored order.
MEGAMOE_HD unsigned int fp4_order_word(const unsigned char* block, int q, int s) {
  unsigned int w = 0;
  MEGAMOE_UNROLL
  for (int v = 0; v < 4; v++) {
    const unsigned int l = fp4_stored_code(block, 32 * s + 4 * q + v);
    const unsigned int h = fp4_stored_code(block, 32 * s + 16 + 4 * q + v);
    w |= (l & 7u) << (4 * v) | (h & 7u) << (16 + 4 * v) | (l >> 3) << (8 * v + 7) | (h >> 3) << (8 * v + 3);
  }
  return w;
}

// Where the device layout keeps quarter q (16 bytes: lane quad q's words) of row `row`'s 64-byte block:
// where the 64-byte swizzle puts it in shared memory, so that a plain copy of a box of rows (its first
// row a multiple of 8, its base 512-byte aligned) lands the image the kernels read.
MEGAMOE_HD int fp4_layout_quarter(int row, int q) { return q ^ ((row >> 1) & 3); }

// Element e's 4-bit code in row `row`'s K block of 64 bytes in the device layout (quarters swizzled; the
// inverse of fp4_order_word with fp4_layout_quarter).
MEGAMOE_HD unsigned int fp4_layout_code(const unsigned char* block, int row, int e) {
  const int s = e / 32;
  const int high = (e % 32) / 16;
  const int q = (e % 16) / 4;
  const int v = e % 4;
  const unsigned char* p = block + 16 * fp4_layout_quarter(row, q) + 4 * s;
  const unsigned int w = p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<unsigned int>(p[3]) << 24);
  const unsigned int mag = (w >> (high != 0 ? 16 + 4 * v : 4 * v)) & 7u;
  const unsigned int sign = (w >> (high != 0 ? 8 * v + 3 : 8 * v + 7)) & 1u;
  return sign << 3 | mag;
}

// One device-order word of a group (table t) → e4m3 codes: L_0..L_3 in `lo` (L_v in byte v), H_0..H_3
// in `hi`. The selector's bit 3 of each nibble must be clear (set, prmt replicates a sign), hence the mask.
MEGAMOE_HD void fp4x8_to_e4m3(unsigned int w, Fp4Table t, unsigned int& lo, unsigned int& hi) {
  const unsigned int m = w & 0x77777777u;
  lo = prmt(t.lo, t.hi, m) | (w & 0x80808080u);
  hi = prmt(t.lo, t.hi, m >> 16) | ((w << 4) & 0x80808080u);
}

// Fast form of fp4_block_to_e4m3_exact (same arguments, stored order, same results).
MEGAMOE_HD int fp4_block_to_e4m3_fast(const unsigned char* packed, unsigned int word, unsigned char* out) {
  MEGAMOE_UNROLL
  for (int s = 0; s < kFp4GroupsPerBlock; s++) {
    const Fp4Table t = fp4_table_of_offset(fp4_word_offset(word, s));
    MEGAMOE_UNROLL
    for (int q = 0; q < 4; q++) {
      unsigned int lo;
      unsigned int hi;
      fp4x8_to_e4m3(fp4_order_word(packed, q, s), t, lo, hi);
      MEGAMOE_UNROLL
      for (int v = 0; v < 4; v++) {
        out[32 * s + 4 * q + v] = static_cast<unsigned char>(lo >> (8 * v));
        out[32 * s + 16 + 4 * q + v] = static_cast<unsigned char>(hi >> (8 * v));
      }
    }
  }
  return fp4_word_ref(word);
}

// ---- one converter thread's share of a weight stage ----

// A stage holds kRows weight rows of one 128-deep K block: `packed` kRows × 64 bytes in the device
// order as the TMA writes it with the 64-byte swizzle from a 512-aligned base (row r's chunk q, its
// words (q, 0..3), at 64r + 16·(q ^ ((r >> 1) & 3))), `ref_words` kRows reference words (fp4_reference_word),
// and receives `b_tile` kRows × 128 e4m3 bytes in the 128-byte swizzle the TMA gives an FP8 tile (row
// r's 16-byte chunk c at 128r + ((c ^ (r % 8)) << 4), b_tile 128-aligned); the block's scale 2^ref comes
// to the promotion with the task, as an FP8 block scale does. `Mem` reads and writes that memory: ld32(a),
// ld64(a, w[2]), st128(a, w[4]) on byte addresses (shared memory on the device, an array in the host test).
//
// Items are (row, half): groups 2·half and 2·half + 1 of a row, 64 elements; item i is row i / 2, half
// i % 2, and thread t converts items t + k·kThreads. As kThreads / 2 is a multiple of 8, a thread's half
// and row % 8 are the same in all its items, so every address is a per-thread base plus a constant.
// An item is words (q, 2·half) and (q, 2·half + 1) of the four chunks q, one 8-byte load each, and
// becomes tile chunks 4·half .. 4·half + 3 (chunk 2s holds L of words (0..3, s), chunk 2s + 1 their H).
// A thread's loads run kDepth items ahead of its conversions, so their latencies overlap the work, and
// the pass has no data-dependent branch (the rare exact tables come in a second pass over marked items),
// so the compiler can interleave a thread's items. Shared-memory banks: each 16-byte store
// of a quarter warp (four rows, both halves) meets eight distinct chunks of the swizzle; the 8-byte loads
// of a warp (16 rows, both halves, one q) meet every bank twice, thanks to the 64-byte swizzle.
template <int kRows, int kThreads, int kDepth, class Mem>
MEGAMOE_HD void fp4_stage_convert(Mem& mem, unsigned int packed, unsigned int ref_words, unsigned int b_tile,
                                  int thread) {
  static_assert(kThreads % 32 == 0, "converters come in whole warps");
  static_assert(kRows % 8 == 0, "the swizzle repeats every 8 rows");
  static_assert(kDepth >= 1, "at least one item in flight");
  constexpr int kItems = 2 * kRows;
  constexpr int kPerThread = (kItems + kThreads - 1) / kThreads;
  constexpr unsigned int kStepIn = 32u * kThreads;    // packed bytes between a thread's items
  constexpr unsigned int kStepRow = 2u * kThreads;    // word bytes between them (4 per row)
  constexpr unsigned int kStepOut = 64u * kThreads;   // tile bytes between them (128 per row)
  const unsigned int t = static_cast<unsigned int>(thread);
  const unsigned int half = t & 1u;
  // Row t / 2's words (c, 2·half), c = 0..3, at in0 ^ (c << 4): the 64-byte swizzle puts chunk c at
  // c ^ ((row >> 1) & 3), and packed + 64 · row keeps bits 4..5 clear for the XOR (as out0 below).
  const unsigned int in0 = packed + 64u * (t >> 1) + (((t >> 2) & 3u) << 4) + 8u * half;
  const unsigned int row_at = 2u * (t & ~1u);  // 4 · row of the first item
  // Chunk i (0..3) of the item is tile chunk 4·half + i, at ((4·half + i) ^ (row % 8)) << 4 =
  // out0 ^ (i << 4): b_tile + 128 · row keeps bits 4..6 clear for the XOR.
  const unsigned int out0 = b_tile + 64u * (t & ~1u) + (((4u * half) ^ ((t >> 1) & 7u)) << 4);
  const unsigned int shift0 = 8u + 10u * half;  // the offsets of groups 2·half and 2·half + 1
  // A rolling window: item k + kDepth is loaded right after item k is stored, into k's registers.
  unsigned int w4[kDepth];
  unsigned int in[kDepth][8];
  // Items k < kFull exist for every thread (known at compile time, so the unrolled loop has no branch there).
  constexpr int kFull = kItems / kThreads;
  const auto valid = [&](int k) { return k < kPerThread && (k < kFull || thread + k * kThreads < kItems); };
  const auto load = [&](int k) {
    if (valid(k)) {
      w4[k % kDepth] = mem.ld32(ref_words + row_at + k * kStepRow);
      for (unsigned int c = 0; c < 4u; ++c) mem.ld64((in0 ^ (c << 4)) + k * kStepIn, in[k % kDepth] + 2 * c);
    }
  };
  // The offsets of the item's two groups under its reference.
  const auto offset = [&](unsigned int word, unsigned int j) { return (word >> (shift0 + 5u * j)) & 31u; };
  // Item k's conversion and stores from its reference word and packed words w (w[2c + j]: word (c,
  // 2·half + j)).
  const auto convert = [&](int k, unsigned int word, const unsigned int* w, bool exact_tables) {
    const unsigned int o0 = offset(word, 0);
    const unsigned int o1 = offset(word, 1);
    const Fp4Table t0 = exact_tables ? fp4_table_of_offset(o0) : fp4_table_fast(12u - o0);
    const Fp4Table t1 = exact_tables ? fp4_table_of_offset(o1) : fp4_table_fast(12u - o1);
    unsigned int q[16];  // tile chunk 4·half + i in q[4i .. 4i + 3]
    for (int c = 0; c < 4; ++c) fp4x8_to_e4m3(w[2 * c], t0, q[c], q[4 + c]);
    for (int c = 0; c < 4; ++c) fp4x8_to_e4m3(w[2 * c + 1], t1, q[8 + c], q[12 + c]);
    for (unsigned int i = 0; i < 4; ++i) mem.st128((out0 ^ (i << 4)) + k * kStepOut, q + 4 * i);
  };
  MEGAMOE_UNROLL
  for (int k = 0; k < kDepth; ++k) load(k);
  // The main pass takes the fast tables without a branch, so the unrolled items can interleave; an item
  // with a group more than 11 binades under its reference (rare) is marked and converted again, with the
  // exact tables, after the pass: its stores land before the caller's arrive.
  static_assert(kPerThread <= 32, "one bit per item in the redo mask");
  unsigned int redo = 0;
  MEGAMOE_UNROLL
  for (int k = 0; k < kPerThread; ++k) {
    if (valid(k)) {
      const unsigned int word = w4[k % kDepth];
      const unsigned int o0 = offset(word, 0);
      const unsigned int o1 = offset(word, 1);
      if ((o0 > o1 ? o0 : o1) > 11u) redo |= 1u << k;
      convert(k, word, in[k % kDepth], false);
    }
    load(k + kDepth);
  }
  MEGAMOE_NO_UNROLL
  for (int k = 0; redo != 0u; ++k, redo >>= 1) {
    if ((redo & 1u) != 0u) {
      unsigned int w[8];
      for (unsigned int c = 0; c < 4u; ++c) mem.ld64((in0 ^ (c << 4)) + k * kStepIn, w + 2 * c);
      convert(k, mem.ld32(ref_words + row_at + k * kStepRow), w, true);
    }
  }
}

}  // namespace megamoe
