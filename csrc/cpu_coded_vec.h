// Integer/float vector primitives for the coded-state CPU kernel (csrc/cpu_adam_coded.cpp) and the
// ZeRO++ wire codec (csrc/cpu_quant.cpp): one
// struct `Q` per SIMD path (zk_scalar, zk_avx2, zk_avx512, inside the namespaces of cpu_vec.h), so
// the codecs of zero_kernels/codecs.py ([Note: state codecs]) are written once, generically, in
// csrc/cpu_adam_coded_simd.h. Every primitive is exact (integer ops, IEEE fp32 ops, bit casts), so
// the three paths give the same bits. Include after cpu_vec.h.
//
// Per path:  F (W floats), I (W uint32 lanes), M (a lane mask);
//   loads/stores of fp32, u8, u16 (zero-extended), i8, i16 (sign-extended), stores of the low 8/16 bits;
//   arithmetic; `v8_bits` / `v8_raise` (the 8-bit v log code's decode bits and zero / raise rule);
//   `lookup256` = table[code] (256 fp32 entries) and `q8_code` = number of the 255 midpoints strictly
//   below y by an 8-step binary search over per-level tables (ZkLevels), the wire codec's, the same
//   comparisons in every path (a NaN y compares false everywhere: code 0, fixed by the caller);
//   `maxu` / `hmaxu`: the unsigned running max and its reduction (a block scale of values known to be >= +0
//   or NaN, on their bits: no abs needed);
//   `kPair` paths (AVX-512 F+BW, AVX2) also have join2 / split2 / bf16x2 / bf16_2, two vectors in 16-bit
//   lanes, and st_u8x2 (the low bytes of two vectors, in order).
#pragma once

#include "cpu_vec.h"

namespace {
constexpr int ZK_QBLOCK = 256;            // codecs.BLOCK: elements per quantization block
constexpr int64_t ZK_GRAIN_BLOCKS = 128;  // 32K elements: below this, one thread

// Binary-search tables of one code book: level b (step 2^b, b = 7..0) reads
// mid[k * 2^(b+1) + 2^b - 1] for k = code >> (b+1) < 2^(7-b); lv[b] holds those entries in k order
// (zero-padded to 16). tab is the code book itself (decode), mid its 255 midpoints (+ one pad).
struct alignas(64) ZkLevels {
  float lv[8][128];
  float tab[256];
  float mid[256];
  // The last three levels by j = code >> 3 (AVX-512): mid[8j+1], mid[8j+5] (level 1) and
  // mid[8j+0], mid[8j+2], mid[8j+4], mid[8j+6] (level 0), 32 entries each.
  float tail[6][32];
};

// The tables of a code book: `tab` its 256 fp32 values (nullptr: an encoder's, left zero), `md` its
// 255 fp32 midpoints.
inline void zk_build_levels(const float* tab, const float* md, ZkLevels& out) {
  std::memset(&out, 0, sizeof out);
  if (tab != nullptr) std::memcpy(out.tab, tab, 256 * sizeof(float));
  std::memcpy(out.mid, md, 255 * sizeof(float));
  for (int b = 0; b < 8; ++b)
    for (int k = 0; k < (1 << (7 - b)); ++k) out.lv[b][k] = md[k * (2 << b) + (1 << b) - 1];
  for (int j = 0; j < 32; ++j) {
    const int base = 8 * j, offs[6] = {1, 5, 0, 2, 4, 6};
    for (int r = 0; r < 6; ++r) out.tail[r][j] = md[base + offs[r]];
  }
}
}  // namespace

// ============================================================================ portable scalar
namespace zk_scalar {
struct Q {
  using F = float;
  using I = uint32_t;
  using M = bool;
  static constexpr int W = 1;
  // No 16-bit-lane pair ops: cpu_adam_coded_simd.h uses zk_c_join1 / zk_c_split1 (these are never called).
  static constexpr bool kPair = false;
  static inline void join2(const uint16_t*, const int16_t*, F&, F&) {}
  static inline void split2(F, F, uint16_t*, int16_t*) {}
  static inline void bf16x2(F, F, uint16_t*, bool) {}
  static inline void bf16_2(const uint16_t*, F&, F&) {}
  static inline void st_u8x2(uint8_t*, I, I) {}
  static inline F bf(I x) { F f; std::memcpy(&f, &x, 4); return f; }
  static inline I bi(F x) { I u; std::memcpy(&u, &x, 4); return u; }
  static inline F ldf(const float* p) { return *p; }
  static inline void stf(float* p, F x) { *p = x; }
  static inline I ld_u8(const uint8_t* p) { return *p; }
  static inline I ld_i8(const uint8_t* p) { return static_cast<I>(static_cast<int32_t>(static_cast<int8_t>(*p))); }
  static inline I ld_u16(const uint16_t* p) { return *p; }
  static inline I ld_i16(const int16_t* p) { return static_cast<I>(static_cast<int32_t>(*p)); }
  static inline void st_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  static inline void st_u16(uint16_t* p, I x) { *p = static_cast<uint16_t>(x); }
  static inline F set1f(float x) { return x; }
  static inline I set1i(uint32_t x) { return x; }
  static inline I iota() { return 0; }
  static inline F add(F a, F b) { return a + b; }
  static inline F sub(F a, F b) { return a - b; }
  static inline F mul(F a, F b) { return a * b; }
  static inline F div(F a, F b) { return a / b; }
  static inline F sqrt(F a) { return std::sqrt(a); }
  static inline F i2f(I a) { return static_cast<float>(static_cast<int32_t>(a)); }
  static inline I addi(I a, I b) { return a + b; }
  static inline I subi(I a, I b) { return a - b; }
  static inline I muli(I a, I b) { return a * b; }
  static inline I andi(I a, I b) { return a & b; }
  static inline I ori(I a, I b) { return a | b; }
  static inline I xori(I a, I b) { return a ^ b; }
  template <int S> static inline I shr(I a) { return a >> S; }
  template <int S> static inline I shl(I a) { return a << S; }
  template <int S> static inline I srai(I a) { return static_cast<I>(static_cast<int32_t>(a) >> S); }
  static inline I mini(I a, I b) { return static_cast<int32_t>(a) < static_cast<int32_t>(b) ? a : b; }
  static inline I maxi(I a, I b) { return static_cast<int32_t>(a) > static_cast<int32_t>(b) ? a : b; }
  static inline M gti(I a, I b) { return static_cast<int32_t>(a) > static_cast<int32_t>(b); }  // signed
  static inline M eqi(I a, I b) { return a == b; }
  static inline M isnan(F a) { return a != a; }
  // x86 MINPS / MAXPS: the second operand when either is NaN or both are zeros
  static inline F minf(F a, F b) { return a < b ? a : b; }
  static inline F maxf(F a, F b) { return a > b ? a : b; }
  static constexpr bool kRangeCap = false;  // no VRANGEPS (zk_avx512's Q)
  // bits & 0x7FFFFFFF ? max(c, 1) : 0 (the raise / zero rule of the 8-bit v code)
  // code ? (code << 19) + base : 0 (the 8-bit v decode's bits of sqrt(v))
  static inline I v8_bits(I code, I base) { return code ? (code << 19) + base : 0u; }
  static inline I v8_raise(I bits, I c) { return (bits & 0x7FFFFFFFu) ? (static_cast<int32_t>(c) > 1 ? c : 1u) : 0u; }
  static inline I seli(M m, I a, I b) { return m ? a : b; }
  static inline F self(M m, F a, F b) { return m ? a : b; }
  static inline uint32_t hmaxi(I a) { return a; }
  static inline I maxu(I a, I b) { return a > b ? a : b; }
  static inline uint32_t hmaxu(I a) { return a; }
  static inline F lookup256(const ZkLevels& t, I code) { return t.tab[code]; }
  static inline I q8_code(const ZkLevels& t, F y) {
    I code = 0;
    for (int b = 7; b >= 0; --b) code += (t.lv[b][code >> (b + 1)] < y) ? (1u << b) : 0u;
    return code;
  }
};
}  // namespace zk_scalar

#if ZK_X86
// ============================================================================ AVX2
namespace zk_avx2 {
#define ZK_TGT ZK_TGT_AVX2
struct Q {
  using F = __m256;
  using I = __m256i;
  using M = __m256i;  // all-ones lanes
  static constexpr int W = 8;
  // Two vectors (16 elements) in 16-bit lanes, as the AVX-512 path's (the same bits as zk_c_join1 /
  // zk_c_split1 / V::store_bf16 / V::load_bf16): 16 words of a register are elements 0-15 in order after a
  // qword permute (packus / unpack work within 128-bit lanes). Fewer ops than one vector at a time
  // (per 16 elements: split 18 vs 38, join 6 vs 8, code stores 6 vs 10).
  static constexpr bool kPair = true;
  // words -> the order unpack / packus see: qwords 0, 2, 1, 3 (its own inverse)
  ZK_TGT static inline I qswap(I x) { return _mm256_permute4x64_epi64(x, 0xD8); }
  // the low 16 bits of a's then b's lanes (each lane within [0, 65535]), elements in order
  ZK_TGT static inline I words2(I a, I b) { return qswap(_mm256_packus_epi32(a, b)); }
  ZK_TGT static inline void join2(const uint16_t* hp, const int16_t* rp, F& x0, F& x1) {
    I r = qswap(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp)));
    I h = qswap(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp)));
    // under hi = +-0 a negative rem counts as 0, under hi = +-inf a positive one (zk_c_join1): max(rem, 0)
    // / min(rem, 0) there, max(rem, -32768) / min(rem, 32767) (no-ops) elsewhere
    const I mag = _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF));
    const I zero = _mm256_cmpeq_epi16(mag, _mm256_setzero_si256());
    const I inf = _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F80));
    r = _mm256_max_epi16(r, _mm256_andnot_si256(zero, _mm256_set1_epi16(static_cast<short>(0x8000))));
    r = _mm256_min_epi16(r, _mm256_andnot_si256(inf, _mm256_set1_epi16(0x7FFF)));
    h = _mm256_add_epi16(h, _mm256_cmpgt_epi16(_mm256_setzero_si256(), r));  // hi - 1 where rem < 0
    x0 = bf(_mm256_unpacklo_epi16(r, h));                                      // (hi << 16) | rem word
    x1 = bf(_mm256_unpackhi_epi16(r, h));
  }
  // hi / lo words of two vectors' bits; up: lanes rounded up to nearest even (lo > 0x8000, or a tie
  // under an odd hi): lo + (hi & 1) > 0x8000 unsigned (saturating), as a signed compare of t ^ 0x8000.
  ZK_TGT static inline void rne_words(F x0, F x1, I& hi, I& lo, I& up) {
    hi = words2(_mm256_srli_epi32(bi(x0), 16), _mm256_srli_epi32(bi(x1), 16));
    const I low = set1i(0xFFFF);
    lo = words2(_mm256_and_si256(bi(x0), low), _mm256_and_si256(bi(x1), low));
    const I t = _mm256_adds_epu16(lo, _mm256_and_si256(hi, _mm256_set1_epi16(1)));
    up = _mm256_cmpgt_epi16(_mm256_xor_si256(t, _mm256_set1_epi16(static_cast<short>(0x8000))),
                            _mm256_setzero_si256());
  }
  // The NaN lanes of x0, x1 as words (rare: callers test nan_any first).
  ZK_TGT static inline bool nan_any(F x0, F x1) { return _mm256_movemask_ps(_mm256_cmp_ps(x0, x1, _CMP_UNORD_Q)) != 0; }
  ZK_TGT static inline I nan_words(F x0, F x1) {
    return qswap(_mm256_packs_epi32(bi(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q)), bi(_mm256_cmp_ps(x1, x1, _CMP_UNORD_Q))));
  }
  // rem = lo where rounded up (as int16: lo - 65536), else min(lo, 0x7FFF) (the tie kept below); NaN -> 0x7FC0 / 0.
  ZK_TGT static inline void split2(F x0, F x1, uint16_t* hp, int16_t* rp) {
    I hi, lo, up;
    rne_words(x0, x1, hi, lo, up);
    I h = _mm256_sub_epi16(hi, up);
    I r = _mm256_blendv_epi8(_mm256_min_epu16(lo, _mm256_set1_epi16(0x7FFF)), lo, up);
    if (__builtin_expect(nan_any(x0, x1), 0)) {
      const I nan = nan_words(x0, x1);
      h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7FC0), nan);
      r = _mm256_andnot_si256(nan, r);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hp), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rp), r);
  }
  ZK_TGT static inline void bf16x2(F x0, F x1, uint16_t* hp, bool nt) {
    I hi, lo, up;
    rne_words(x0, x1, hi, lo, up);
    I out = _mm256_sub_epi16(hi, up);
    if (__builtin_expect(nan_any(x0, x1), 0))
      out = _mm256_blendv_epi8(out, _mm256_or_si256(hi, _mm256_set1_epi16(0x0040)), nan_words(x0, x1));
    if (nt) _mm256_stream_si256(reinterpret_cast<__m256i*>(hp), out);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(hp), out);
  }
  ZK_TGT static inline void bf16_2(const uint16_t* p, F& x0, F& x1) {
    const I g = qswap(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    x0 = bf(_mm256_unpacklo_epi16(_mm256_setzero_si256(), g));
    x1 = bf(_mm256_unpackhi_epi16(_mm256_setzero_si256(), g));
  }
  ZK_TGT static inline void st_u8x2(uint8_t* p, I a, I b) {
    const I low = set1i(0xFF);
    const I w = words2(_mm256_and_si256(a, low), _mm256_and_si256(b, low));   // 16 words, in order
    const I bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);  // qwords 0 and 2
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(bytes));
  }
  ZK_TGT static inline F bf(I x) { return _mm256_castsi256_ps(x); }
  ZK_TGT static inline I bi(F x) { return _mm256_castps_si256(x); }
  ZK_TGT static inline F ldf(const float* p) { return _mm256_loadu_ps(p); }
  ZK_TGT static inline void stf(float* p, F x) { _mm256_storeu_ps(p, x); }
  ZK_TGT static inline I ld_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  ZK_TGT static inline I ld_i8(const uint8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  ZK_TGT static inline I ld_u16(const uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ZK_TGT static inline I ld_i16(const int16_t* p) {
    return _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Lanes hold 0..255 / 0..65535 (u8, u16) or -32768..32767 (i16 via st_u16 of the masked bits).
  ZK_TGT static inline __m128i pack16(I x) {
    const I lo = _mm256_and_si256(x, _mm256_set1_epi32(0xFFFF));
    return _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
  }
  ZK_TGT static inline void st_u16(uint16_t* p, I x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack16(x));
  }
  ZK_TGT static inline void st_u8(uint8_t* p, I x) {
    const __m128i h = pack16(_mm256_and_si256(x, _mm256_set1_epi32(0xFF)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(h, h));
  }
  ZK_TGT static inline F set1f(float x) { return _mm256_set1_ps(x); }
  ZK_TGT static inline I set1i(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  ZK_TGT static inline I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  ZK_TGT static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  ZK_TGT static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  ZK_TGT static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  ZK_TGT static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  ZK_TGT static inline F sqrt(F a) { return _mm256_sqrt_ps(a); }
  ZK_TGT static inline F i2f(I a) { return _mm256_cvtepi32_ps(a); }
  ZK_TGT static inline I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  ZK_TGT static inline I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  ZK_TGT static inline I muli(I a, I b) { return _mm256_mullo_epi32(a, b); }
  ZK_TGT static inline I andi(I a, I b) { return _mm256_and_si256(a, b); }
  ZK_TGT static inline I ori(I a, I b) { return _mm256_or_si256(a, b); }
  ZK_TGT static inline I xori(I a, I b) { return _mm256_xor_si256(a, b); }
  template <int S> ZK_TGT static inline I shr(I a) { return _mm256_srli_epi32(a, S); }
  template <int S> ZK_TGT static inline I shl(I a) { return _mm256_slli_epi32(a, S); }
  template <int S> ZK_TGT static inline I srai(I a) { return _mm256_srai_epi32(a, S); }
  ZK_TGT static inline I mini(I a, I b) { return _mm256_min_epi32(a, b); }
  ZK_TGT static inline I maxi(I a, I b) { return _mm256_max_epi32(a, b); }
  ZK_TGT static inline M gti(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  ZK_TGT static inline M eqi(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  ZK_TGT static inline M isnan(F a) { return bi(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
  ZK_TGT static inline F minf(F a, F b) { return _mm256_min_ps(a, b); }  // b when either is NaN or both zeros
  ZK_TGT static inline F maxf(F a, F b) { return _mm256_max_ps(a, b); }
  static constexpr bool kRangeCap = false;  // no VRANGEPS (zk_avx512's Q)
  ZK_TGT static inline I v8_bits(I code, I base) {
    const M zero = _mm256_cmpeq_epi32(code, _mm256_setzero_si256());
    return _mm256_andnot_si256(zero, _mm256_add_epi32(_mm256_slli_epi32(code, 19), base));
  }
  ZK_TGT static inline I v8_raise(I bits, I c) {
    const M zero = _mm256_cmpeq_epi32(_mm256_and_si256(bits, set1i(0x7FFFFFFFu)), _mm256_setzero_si256());
    return _mm256_andnot_si256(zero, _mm256_max_epi32(c, set1i(1)));
  }
  ZK_TGT static inline I seli(M m, I a, I b) { return _mm256_blendv_epi8(b, a, m); }
  ZK_TGT static inline F self(M m, F a, F b) { return _mm256_blendv_ps(b, a, bf(m)); }
  ZK_TGT static inline uint32_t hmaxi(I a) {
    __m128i x = _mm_max_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_max_epi32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_max_epi32(x, _mm_shuffle_epi32(x, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  }
  ZK_TGT static inline I maxu(I a, I b) { return _mm256_max_epu32(a, b); }
  ZK_TGT static inline uint32_t hmaxu(I a) {
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4E));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(x));
  }
  ZK_TGT static inline F lookup256(const ZkLevels& t, I code) {
    return _mm256_i32gather_ps(t.tab, code, 4);
  }
  // One level: code += 2^B where the level's midpoint for this lane is < y.
  template <int B>
  ZK_TGT static inline I q8_level(const ZkLevels& t, I code, F y) {
    const I k = shr<B + 1>(code);
    F mid;
    if (B >= 4) {  // <= 8 entries: one in-register permute
      mid = _mm256_permutevar8x32_ps(_mm256_load_ps(t.lv[B]), k);
    } else if (B == 3) {  // 16 entries: two permutes, picked by bit 3 of k
      const F a = _mm256_permutevar8x32_ps(_mm256_load_ps(t.lv[B]), k);
      const F b = _mm256_permutevar8x32_ps(_mm256_load_ps(t.lv[B] + 8), k);
      mid = _mm256_blendv_ps(a, b, bf(shl<28>(k)));
    } else {
      mid = _mm256_i32gather_ps(t.lv[B], k, 4);
    }
    const I lt = bi(_mm256_cmp_ps(mid, y, _CMP_LT_OQ));
    return addi(code, andi(lt, set1i(1u << B)));
  }
  ZK_TGT static inline I q8_code(const ZkLevels& t, F y) {
    I c = _mm256_setzero_si256();
    c = q8_level<7>(t, c, y); c = q8_level<6>(t, c, y); c = q8_level<5>(t, c, y);
    c = q8_level<4>(t, c, y); c = q8_level<3>(t, c, y); c = q8_level<2>(t, c, y);
    c = q8_level<1>(t, c, y); c = q8_level<0>(t, c, y);
    return c;
  }
};
#undef ZK_TGT
}  // namespace zk_avx2

// ============================================================================ AVX-512 (F + BW + DQ)
namespace zk_avx512 {
#define ZK_TGT ZK_TGT_AVX512
struct Q {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr int W = 16;
  ZK_TGT static inline F bf(I x) { return _mm512_castsi512_ps(x); }
  ZK_TGT static inline I bi(F x) { return _mm512_castps_si512(x); }
  ZK_TGT static inline F ldf(const float* p) { return _mm512_loadu_ps(p); }
  ZK_TGT static inline void stf(float* p, F x) { _mm512_storeu_ps(p, x); }
  ZK_TGT static inline I ld_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ZK_TGT static inline I ld_i8(const uint8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ZK_TGT static inline I ld_u16(const uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ZK_TGT static inline I ld_i16(const int16_t* p) {
    return _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ZK_TGT static inline void st_u16(uint16_t* p, I x) {  // the low 16 bits of each lane
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  ZK_TGT static inline void st_u8(uint8_t* p, I x) {  // the low 8 bits of each lane
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
  ZK_TGT static inline F set1f(float x) { return _mm512_set1_ps(x); }
  ZK_TGT static inline I set1i(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  ZK_TGT static inline I iota() {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  ZK_TGT static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  ZK_TGT static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  ZK_TGT static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  ZK_TGT static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  ZK_TGT static inline F sqrt(F a) { return _mm512_sqrt_ps(a); }
  ZK_TGT static inline F i2f(I a) { return _mm512_cvtepi32_ps(a); }
  ZK_TGT static inline I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  ZK_TGT static inline I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  ZK_TGT static inline I muli(I a, I b) { return _mm512_mullo_epi32(a, b); }
  ZK_TGT static inline I andi(I a, I b) { return _mm512_and_si512(a, b); }
  ZK_TGT static inline I ori(I a, I b) { return _mm512_or_si512(a, b); }
  ZK_TGT static inline I xori(I a, I b) { return _mm512_xor_si512(a, b); }
  template <int S> ZK_TGT static inline I shr(I a) { return _mm512_srli_epi32(a, S); }
  template <int S> ZK_TGT static inline I shl(I a) { return _mm512_slli_epi32(a, S); }
  template <int S> ZK_TGT static inline I srai(I a) { return _mm512_srai_epi32(a, S); }
  ZK_TGT static inline I mini(I a, I b) { return _mm512_min_epi32(a, b); }
  ZK_TGT static inline I maxi(I a, I b) { return _mm512_max_epi32(a, b); }
  ZK_TGT static inline M gti(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  ZK_TGT static inline M eqi(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  ZK_TGT static inline M isnan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  ZK_TGT static inline F minf(F a, F b) { return _mm512_min_ps(a, b); }  // b when either is NaN or both zeros
  ZK_TGT static inline F maxf(F a, F b) { return _mm512_max_ps(a, b); }
  // VRANGEPS, imm 0b0010: min(|m|, |b|) with m's sign, so m where |m| <= |b|, else copysign(b, m), in ONE op
  // (the min / max form of zk_c_bounded takes three and a sign flip). Its NaN rule differs: a NaN m beside a
  // non-NaN b gives b (the other NaN cases give m). zk_c_block_q8 only: there m is NaN only with b.
  static constexpr bool kRangeCap = true;
  ZK_TGT static inline F range_cap(F m, F b) { return _mm512_range_ps(m, b, 0x02); }
  ZK_TGT static inline I v8_bits(I code, I base) {
    return _mm512_maskz_add_epi32(_mm512_test_epi32_mask(code, code), _mm512_slli_epi32(code, 19), base);
  }
  ZK_TGT static inline I v8_raise(I bits, I c) {
    return _mm512_maskz_max_epi32(_mm512_test_epi32_mask(bits, set1i(0x7FFFFFFFu)), c, set1i(1));
  }
  ZK_TGT static inline I seli(M m, I a, I b) { return _mm512_mask_blend_epi32(m, b, a); }
  ZK_TGT static inline F self(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  ZK_TGT static inline uint32_t hmaxi(I a) { return static_cast<uint32_t>(_mm512_reduce_max_epi32(a)); }
  ZK_TGT static inline I maxu(I a, I b) { return _mm512_max_epu32(a, b); }
  ZK_TGT static inline uint32_t hmaxu(I a) { return static_cast<uint32_t>(_mm512_reduce_max_epu32(a)); }
  // Two vectors (32 elements) of fp32 masters <-> 32 bf16 parameters + 32 int16 remainders, worked in
  // 16-bit lanes (AVX512BW): the same bits as cpu_adam_coded_simd.h's zk_c_join1 / zk_c_split1
  // ([Note: state codecs] 3): bits = (hi << 16) + rem is hi - (rem < 0) over the low word rem; the split
  // rounds hi up where lo > 0x8000 or lo == 0x8000 with hi odd (RNE), keeps rem = lo (as int16 it is
  // lo - 65536 where hi was rounded up) except a tie rounded down (0x8000 -> 0x7FFF), and writes a NaN
  // as 0x7FC0 / 0.
  static constexpr bool kPair = true;
  ZK_TGT static inline I words(int first) {  // 16-bit word indices first, first + 2, ..., first + 62
    return _mm512_add_epi16(_mm512_set1_epi16(static_cast<short>(first)),
                            _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                             30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0));
  }
  ZK_TGT static inline void join2(const uint16_t* hp, const int16_t* rp, F& x0, F& x1) {
    I r = _mm512_loadu_si512(rp);
    I h = _mm512_loadu_si512(hp);
    // under hi = +-0 a negative rem counts as 0, under hi = +-inf a positive one (zk_c_join1): rare (a parameter
    // written outside the optimizer), so the rule runs only where one unsigned compare finds a hi of magnitude 0
    // or >= 0x7F80 ((mag - 1) mod 2^16 >= 0x7F7F)
    const I mag = _mm512_and_si512(h, _mm512_set1_epi16(0x7FFF));
    if (__builtin_expect(_mm512_cmpge_epu16_mask(_mm512_sub_epi16(mag, _mm512_set1_epi16(1)),
                                                 _mm512_set1_epi16(0x7F7F)) != 0, 0)) {
      const __mmask32 sat =
          (_mm512_movepi16_mask(r) & _mm512_testn_epi16_mask(h, _mm512_set1_epi16(0x7FFF))) |
          (_mm512_cmpgt_epi16_mask(r, _mm512_setzero_si512()) & _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7F80)));
      r = _mm512_maskz_mov_epi16(~sat, r);
    }
    h = _mm512_mask_sub_epi16(h, _mm512_movepi16_mask(r), h, _mm512_set1_epi16(1));
    // word 2k of x0 / x1: rem k / rem 16 + k; word 2k + 1: hi k / hi 16 + k (index 32 + .. picks h)
    const I lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    x0 = bf(_mm512_permutex2var_epi16(r, lo_idx, h));
    x1 = bf(_mm512_permutex2var_epi16(r, _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16)), h));
  }
  // A NaN lane is rare (it poisons its parameter for good), so the NaN rules run only where one compare
  // of x0 with x1 (unordered: a NaN in either) finds one: 2 vector ops per 32 elements instead of 6, and
  // no call (an out-of-line path made the compiler rebuild its constants inside the loop).
  ZK_TGT static inline void split2(F x0, F x1, uint16_t* hp, int16_t* rp) {
    const I lo = _mm512_permutex2var_epi16(bi(x0), words(0), bi(x1));
    const I hi = _mm512_permutex2var_epi16(bi(x0), words(1), bi(x1));
    const __mmask32 up = rne_up(lo, hi);
    I h = _mm512_mask_add_epi16(hi, up, hi, _mm512_set1_epi16(1));
    I r = _mm512_mask_min_epu16(lo, _knot_mask32(up), lo, _mm512_set1_epi16(0x7FFF));  // not up: lo <= 0x8000
    if (__builtin_expect(_mm512_cmp_ps_mask(x0, x1, _CMP_UNORD_Q) != 0, 0)) {
      const __mmask32 nan = nan2(x0, x1);
      h = _mm512_mask_mov_epi16(h, nan, _mm512_set1_epi16(0x7FC0));
      r = _mm512_maskz_mov_epi16(~nan, r);
    }
    _mm512_storeu_si512(hp, h);
    _mm512_storeu_si512(rp, r);
  }
  // Round to nearest even on 16-bit halves: up where lo > 0x8000, or lo == 0x8000 and hi odd, i.e. where
  // lo + (hi & 1), saturating at 0xFFFF, exceeds 0x8000.
  ZK_TGT static inline __mmask32 rne_up(I lo, I hi) {
    return _mm512_cmpgt_epu16_mask(_mm512_adds_epu16(lo, _mm512_and_si512(hi, _mm512_set1_epi16(1))),
                                   _mm512_set1_epi16(static_cast<short>(0x8000)));
  }
  // The NaN lanes of x0 (bits 0-15) and x1 (bits 16-31).
  ZK_TGT static inline __mmask32 nan2(F x0, F x1) {
    return _mm512_kunpackw(_mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q), _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q));
  }
  // Two vectors rounded to bf16 in 16-bit lanes, the bits of V::store_bf16 (cpu_vec.h): round to nearest
  // even; a NaN keeps its sign and high payload, quieted (| 0x0040), as torch's cast. nt: a streaming
  // store (hp 64-byte aligned; the caller fences).
  ZK_TGT static inline void bf16x2(F x0, F x1, uint16_t* hp, bool nt) {
    const I lo = _mm512_permutex2var_epi16(bi(x0), words(0), bi(x1));
    const I hi = _mm512_permutex2var_epi16(bi(x0), words(1), bi(x1));
    I out = _mm512_mask_add_epi16(hi, rne_up(lo, hi), hi, _mm512_set1_epi16(1));
    if (__builtin_expect(_mm512_cmp_ps_mask(x0, x1, _CMP_UNORD_Q) != 0, 0))  // as split2: NaN lanes are rare
      out = _mm512_mask_mov_epi16(out, nan2(x0, x1), _mm512_or_si512(hi, _mm512_set1_epi16(0x0040)));
    if (nt) _mm512_stream_si512(reinterpret_cast<__m512i*>(hp), out);
    else _mm512_storeu_si512(hp, out);
  }
  ZK_TGT static inline void st_u8x2(uint8_t* p, I a, I b) { st_u8(p, a); st_u8(p + W, b); }
  // 32 bf16 values -> two fp32 vectors (elements 0-15, 16-31): one zero-masked word permute per vector puts
  // each bf16 in the high half of its lane (the bits of V::load_bf16, one vector op less per 16 elements).
  ZK_TGT static inline void bf16_2(const uint16_t* p, F& x0, F& x1) {
    const I g = _mm512_loadu_si512(p);
    const I idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                   7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    x0 = bf(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, idx, g));
    x1 = bf(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, _mm512_add_epi16(idx, _mm512_set1_epi16(16)), g));
  }
  // 32-entry lookup in two registers (bits 0-4 of the index), then blends on the higher bits.
  ZK_TGT static inline F perm32(const float* t, I k) {
    return _mm512_permutex2var_ps(_mm512_load_ps(t), k, _mm512_load_ps(t + 16));
  }
  ZK_TGT static inline F perm64(const float* t, I k) {
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(k, set1i(32)), perm32(t, k), perm32(t + 32, k));
  }
  ZK_TGT static inline F perm128(const float* t, I k) {
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(k, set1i(64)), perm64(t, k), perm64(t + 64, k));
  }
  ZK_TGT static inline F lookup256(const ZkLevels& t, I code) {
    return _mm512_mask_blend_ps(_mm512_test_epi32_mask(code, set1i(128)), perm128(t.tab, code),
                                perm128(t.tab + 128, code));
  }
  template <int B>
  ZK_TGT static inline I q8_level(const ZkLevels& t, I code, F y) {  // levels 5..3: <= 16 entries
    const F mid = _mm512_permutexvar_ps(shr<B + 1>(code), _mm512_load_ps(t.lv[B]));
    return _mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(mid, y, _CMP_LT_OQ), code, set1i(1u << B));
  }
  // The same comparisons as the generic search, fewer instructions: level 7 compares with a
  // broadcast, level 6 blends two broadcasts, levels 2..0 look up by one index j = code >> 3 and
  // pick their candidates with the masks of the levels above.
  ZK_TGT static inline I q8_code(const ZkLevels& t, F y) {
    const __mmask16 m7 = _mm512_cmp_ps_mask(set1f(t.mid[127]), y, _CMP_LT_OQ);
    I c = _mm512_maskz_mov_epi32(m7, set1i(128));
    const F mid6 = _mm512_mask_blend_ps(m7, set1f(t.mid[63]), set1f(t.mid[191]));
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(mid6, y, _CMP_LT_OQ), c, set1i(64));
    c = q8_level<5>(t, c, y); c = q8_level<4>(t, c, y); c = q8_level<3>(t, c, y);
    const I j = shr<3>(c);
    const __mmask16 m2 = _mm512_cmp_ps_mask(perm32(t.lv[2], j), y, _CMP_LT_OQ);
    const F mid1 = _mm512_mask_blend_ps(m2, perm32(t.tail[0], j), perm32(t.tail[1], j));
    const __mmask16 m1 = _mm512_cmp_ps_mask(mid1, y, _CMP_LT_OQ);
    const F lo = _mm512_mask_blend_ps(m1, perm32(t.tail[2], j), perm32(t.tail[3], j));
    const F hi = _mm512_mask_blend_ps(m1, perm32(t.tail[4], j), perm32(t.tail[5], j));
    const __mmask16 m0 = _mm512_cmp_ps_mask(_mm512_mask_blend_ps(m2, lo, hi), y, _CMP_LT_OQ);
    c = _mm512_mask_add_epi32(c, m2, c, set1i(4));
    c = _mm512_mask_add_epi32(c, m1, c, set1i(2));
    return _mm512_mask_add_epi32(c, m0, c, set1i(1));
  }
};
#undef ZK_TGT
}  // namespace zk_avx512
#endif  // ZK_X86
