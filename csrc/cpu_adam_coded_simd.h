// The coded-state Adam block, written once over the vector structs V (cpu_vec.h: fp32 arithmetic,
// 16-bit loads/stores) and Q (cpu_coded_vec.h: integer lanes, code-book lookups) and included by
// csrc/cpu_adam_coded.cpp once per SIMD path (inside zk_avx512 / zk_avx2 / zk_scalar) with ZK_TGT
// set to that path's target attribute. No include guard on purpose.
//
// One call processes one whole 256-element quantization block (codecs.BLOCK): decode, run the
// update of reference.fused_adam_ref in its order (one IEEE rounding per op, no FMA), encode. A
// blockwise moment's new scale is the absmax of the UPDATED block, known only after the update, so
// the updated moments wait in L1 buffers for the encode. Every loop runs over exactly 256 elements
// (a partial last block is staged through zero-padded copies by the caller), so there is no scalar
// tail and every path computes each element with the same operations.

#ifndef ZK_TGT
#error "define ZK_TGT before including cpu_adam_coded_simd.h"
#endif

#include "cpu_q8_simd.h"  // zk_q8_absmax / zk_q8_absbits / zk_q8_scale: the block absmax on the bits

// ---------------------------------------------------------------- 8-bit moment codes (codecs.py Note 2)
// m: per block inv = 127 * 2^15 / scale, 0 unless finite; q = rint(m * inv), int8 code = clamp((q + r) >> 15,
// -127, 127) with r = ((i * 0x9E3779B1 + key) mod 2^32) >> 17 (15 random bits: a Weyl sequence over the flat
// index i, advanced by one add per vector; stochastic rounding), decoded with scale / 127. rint by the magic
// number 1.5 * 2^23 (|y| <= 2^22): one fp32 add rounds half to even and leaves the integer plus the magic's bits
// in the bits (st_u8 keeps the code's low 8).
// v: a log code of s = sqrt(v) on the int32 bits: code = max(((bits(s) - bits(scale)) + 255 * 2^19 +
// 2^18) >> 19, 1), 0 where s == 0 or the scale is not finite; decoded s' = bits((code << 19) +
// bits(scale) - 255 * 2^19) (0 for code 0), v' = s' * s'.
constexpr float ZK_M8_LEVELS = 127.0f;
constexpr float ZK_M8_INV_LEVELS = 4161536.0f;  // 127 * 2^15: the m code's inverse, scaled for its dither
constexpr uint32_t ZK_RNE_MAGIC_BITS = 0x4B400000u, ZK_M8_DITHER_MUL = 0x9E3779B1u;
constexpr uint32_t ZK_V8_TOP = 255u << 19, ZK_V8_HALF = 1u << 18;

ZK_TGT static inline float zk_c_inverse(float scale, float levels) {
  const float inv = levels / scale;
  return inv <= 3.4028234663852886e38f ? inv : 0.0f;  // scale 0, tiny, inf or NaN: all codes 0
}

ZK_TGT static inline uint32_t zk_f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

ZK_TGT static inline bool zk_v8_finite(float scale) { return (zk_f32_bits(scale) & 0x7FFFFFFFu) < 0x7F800000u; }

// One vector of codes. m: int8 codes (low 8 bits of each lane) of x given inv = 127 * 2^15 / scale != 0
// (magic: 1.5 * 2^23) and h = i * 0x9E3779B1 + key (mod 2^32) of the elements' flat indices i (zk_m8_weyl: the
// key is the tensor's and step's). v: log codes of s = sqrt(v) >= 0 given k = 255 * 2^19 + 2^18 - bits(scale) for a
// finite scale: (bits(s) - bits(scale)) + 255 * 2^19 + 2^18 fits an int32, so one wrapping add of the
// constant folded with -bits(scale) gives it.
// *_bits: the code in the low 8 bits of each lane (*_code1 stores them).
ZK_TGT static inline Q::I zk_m8_code_bits(const float* x, Q::F inv, Q::F magic, Q::I h) {
  const Q::I q = Q::subi(Q::bi(Q::add(Q::mul(Q::ldf(x), inv), magic)), Q::set1i(ZK_RNE_MAGIC_BITS));
  const Q::I r = Q::shr<17>(h);
  // codecs.encode_m8's clamp to [-127, 127] never binds: inv = RN(127 * 2^15 / scale) exceeds the exact quotient
  // by at most 2^-24 relative, so |m * inv| <= 127 * 2^15 + 0.25 for every |m| <= scale, which rounds to
  // |q| <= 127 * 2^15 (the fp32 spacing there is 1/4, a tie goes to the even 127 * 2^15), and with 0 <= r < 2^15
  // (q + r) >> 15 lies in [-127, 127]
  return Q::srai<15>(Q::addi(q, r));
}
ZK_TGT static inline Q::I zk_v8_code_bits(const float* s, Q::I k) {
  const Q::I b = Q::bi(Q::ldf(s));
  return Q::v8_raise(b, Q::srai<19>(Q::addi(b, k)));
}
ZK_TGT static inline void zk_m8_code1(const float* x, Q::F inv, Q::F magic, Q::I h, uint8_t* dst) {
  Q::st_u8(dst, zk_m8_code_bits(x, inv, magic, h));
}
// The m code's dither state of the vector whose element 0 has flat index idx0: h = i * 0x9E3779B1 + key per lane;
// zk_m8_weyl_step() advances it by one vector (Q::W elements).
ZK_TGT static inline Q::I zk_m8_weyl(uint32_t idx0, uint32_t key) {
  return Q::addi(Q::muli(Q::addi(Q::set1i(idx0), Q::iota()), Q::set1i(ZK_M8_DITHER_MUL)), Q::set1i(key));
}
ZK_TGT static inline Q::I zk_m8_weyl_step() { return Q::set1i(ZK_M8_DITHER_MUL * static_cast<uint32_t>(Q::W)); }
ZK_TGT static inline void zk_v8_code1(const float* s, Q::I k, uint8_t* dst) { Q::st_u8(dst, zk_v8_code_bits(s, k)); }
ZK_TGT static inline Q::I zk_v8_key(float scale) { return Q::set1i(ZK_V8_TOP + ZK_V8_HALF - zk_f32_bits(scale)); }

// int8 codes of m (x: the block's updated m), given inv; idx0: the flat index of x[0], key: the SR key.
ZK_TGT static inline void zk_m8_codes(const float* x, float inv, uint8_t* dst, uint32_t idx0, uint32_t key) {
  if (inv == 0.0f) { std::memset(dst, 0, ZK_QBLOCK); return; }
  const Q::F s = Q::set1f(inv), magic = Q::set1f(12582912.0f);
  const Q::I step = zk_m8_weyl_step();
  Q::I h = zk_m8_weyl(idx0, key);
  for (int i = 0; i < ZK_QBLOCK; i += Q::W, h = Q::addi(h, step)) zk_m8_code1(x + i, s, magic, h, dst + i);
}

// uint8 log codes of v (s: the block's sqrt(v) >= 0, scale: their max).
ZK_TGT static inline void zk_v8_codes(const float* s, float scale, uint8_t* dst) {
  if (!zk_v8_finite(scale)) { std::memset(dst, 0, ZK_QBLOCK); return; }
  const Q::I k = zk_v8_key(scale);
  for (int i = 0; i < ZK_QBLOCK; i += Q::W) zk_v8_code1(s + i, k, dst + i);
}

ZK_TGT static inline Q::F zk_m8_decode(const uint8_t* c, Q::F step) { return Q::mul(Q::i2f(Q::ld_i8(c)), step); }
// base = bits(scale) - 255 * 2^19 (a finite scale; the callers handle the others).
ZK_TGT static inline Q::F zk_v8_decode(const uint8_t* c, Q::I base) {
  const Q::F s = Q::bf(Q::v8_bits(Q::ld_u8(c), base));
  return Q::mul(s, s);
}

// fp32 <- stored moment (kind ZK_MK_*; V: exp_avg_sq's codes), 256 elements.
ZK_TGT static inline void zk_c_decode(int kind, bool V_, const void* src, float scale, float* out) {
  switch (kind) {
    case ZK_MK_F32:
      std::memcpy(out, src, ZK_QBLOCK * sizeof(float));
      return;
    case ZK_MK_BF16:
      for (int i = 0; i < ZK_QBLOCK; i += Q::W)
        Q::stf(out + i, Q::bf(Q::shl<16>(Q::ld_u16(static_cast<const uint16_t*>(src) + i))));
      return;
    case ZK_MK_U8: {
      const uint8_t* c = static_cast<const uint8_t*>(src);
      if (!V_) {
        const Q::F step = Q::set1f(scale / ZK_M8_LEVELS);
        for (int i = 0; i < ZK_QBLOCK; i += Q::W) Q::stf(out + i, zk_m8_decode(c + i, step));
      } else if (zk_v8_finite(scale)) {
        const Q::I base = Q::set1i(zk_f32_bits(scale) - ZK_V8_TOP);
        for (int i = 0; i < ZK_QBLOCK; i += Q::W) Q::stf(out + i, zk_v8_decode(c + i, base));
      } else {  // a NaN / inf block decodes to NaN everywhere
        for (int i = 0; i < ZK_QBLOCK; ++i) out[i] = std::numeric_limits<float>::quiet_NaN();
      }
      return;
    }
    default: {  // float8_e4m3fn: torch's exact conversion (NaN codes 0x7F/0xFF -> 0x7FF00000 | sign), * scale
      const Q::F s = Q::set1f(scale);
      for (int i = 0; i < ZK_QBLOCK; i += Q::W) {
        const Q::I c = Q::ld_u8(static_cast<const uint8_t*>(src) + i);
        const Q::I e = Q::andi(Q::shr<3>(c), Q::set1i(0xF));
        const Q::I mant = Q::andi(c, Q::set1i(7));
        const Q::I normal = Q::ori(Q::shl<23>(Q::addi(e, Q::set1i(120))), Q::shl<20>(mant));
        const Q::I sub = Q::bi(Q::mul(Q::i2f(mant), Q::set1f(0.001953125f)));  // m * 2^-9, exact
        Q::I mag = Q::seli(Q::eqi(e, Q::set1i(0)), sub, normal);
        const Q::M nan = Q::eqi(Q::andi(c, Q::set1i(0x7F)), Q::set1i(0x7F));
        mag = Q::seli(nan, Q::set1i(0x7FF00000u), mag);
        const Q::F x = Q::bf(Q::ori(mag, Q::shl<24>(Q::andi(c, Q::set1i(0x80)))));
        // NaN code: the product is the code's NaN (x86 returns the first NaN operand); explicit so
        // that no operand swap by the compiler can change its bits.
        Q::stf(out + i, Q::self(nan, x, Q::mul(x, s)));
      }
      return;
    }
  }
}

ZK_TGT static inline Q::I zk_c_fmix32(Q::I h) {
  h = Q::xori(h, Q::shr<16>(h));
  h = Q::muli(h, Q::set1i(0x85EBCA6Bu));
  h = Q::xori(h, Q::shr<13>(h));
  h = Q::muli(h, Q::set1i(0xC2B2AE35u));
  return Q::xori(h, Q::shr<16>(h));
}

// One vector of a bf16 moment, stochastically rounded: bf16 = (bits + (fmix32(idx ^ key) >> 16)) >> 16 (idx:
// the elements' flat indices mod 2^32, key: the tensor's and step's); NaN -> 0x7FC0.
ZK_TGT static inline void zk_c_sr_bf16(Q::F v, Q::I idx, Q::I key, uint16_t* dst) {
  const Q::I r = Q::shr<16>(zk_c_fmix32(Q::xori(idx, key)));
  const Q::I hi = Q::shr<16>(Q::addi(Q::bi(v), r));
  Q::st_u16(dst, Q::seli(Q::isnan(v), Q::set1i(0x7FC0), hi));
}

// fp32 -> stored moment, 256 elements (V_: exp_avg_sq); writes the block's scale for the blockwise
// kinds. x may be overwritten (the 8-bit v code takes its square root in place).
// idx0: flat index of the block's element 0 (mod 2^32) for the stochastic-rounding bits.
ZK_TGT static inline void zk_c_encode(int kind, bool V_, float* x, void* dst, float* scale_out, uint32_t key,
                                      uint32_t idx0) {
  switch (kind) {
    case ZK_MK_F32:
      std::memcpy(dst, x, ZK_QBLOCK * sizeof(float));
      return;
    case ZK_MK_BF16: {
      const Q::I k = Q::set1i(key);
      Q::I idx = Q::addi(Q::set1i(idx0), Q::iota());
      for (int i = 0; i < ZK_QBLOCK; i += Q::W, idx = Q::addi(idx, Q::set1i(Q::W)))
        zk_c_sr_bf16(Q::ldf(x + i), idx, k, static_cast<uint16_t*>(dst) + i);
      return;
    }
    case ZK_MK_U8: {
      if (V_)
        for (int i = 0; i < ZK_QBLOCK; i += Q::W) Q::stf(x + i, Q::sqrt(Q::ldf(x + i)));
      const float scale = zk_q8_absmax(x);
      *scale_out = scale;
      if (V_) zk_v8_codes(x, scale, static_cast<uint8_t*>(dst));
      else zk_m8_codes(x, zk_c_inverse(scale, ZK_M8_INV_LEVELS), static_cast<uint8_t*>(dst), idx0, key);
      return;
    }
    default: {  // float8_e4m3fn of clamp(x / (absmax / 448), +-448): RNE on the bits (kernels/_codecs.py)
      const float scale = zk_q8_absmax(x) / 448.0f;
      *scale_out = scale;
      const Q::F s = Q::set1f(scale);
      for (int i = 0; i < ZK_QBLOCK; i += Q::W) {
        const Q::F y = scale == 0.0f ? Q::set1f(0.0f) : Q::div(Q::ldf(x + i), s);
        const Q::I b = Q::bi(y);
        const Q::I sign = Q::andi(Q::shr<24>(b), Q::set1i(0x80));
        const Q::I a = Q::andi(b, Q::set1i(0x7FFFFFFF));
        const Q::I small = Q::subi(Q::bi(Q::add(Q::bf(a), Q::set1f(16384.0f))), Q::set1i(141u << 23));
        const Q::I normal = Q::shr<20>(Q::addi(Q::addi(Q::subi(a, Q::set1i(120u << 23)), Q::set1i(0x7FFFF)),
                                               Q::andi(Q::shr<20>(a), Q::set1i(1))));
        Q::I code = Q::seli(Q::gti(Q::set1i(121u << 23), a), small, normal);
        code = Q::seli(Q::gti(a, Q::set1i(0x43E00000 - 1)), Q::set1i(0x7E), code);   // saturate: codecs.encode_f8
        code = Q::seli(Q::gti(a, Q::set1i(0x7F800000)), Q::set1i(0x7F), code);       // NaN
        if (V_) code = Q::maxi(code, Q::seli(Q::eqi(a, Q::set1i(0)), Q::set1i(0), Q::set1i(1)));  // codecs.encode_f8_v
        Q::st_u8(static_cast<uint8_t*>(dst) + i, Q::ori(Q::andi(code, Q::set1i(0xFF)), sign));
      }
      return;
    }
  }
}

// bf16 parameter + int16 remainder -> fp32 master: bits = (hi << 16) + rem (int32 wrap), a negative rem
// under hi = +-0 and a positive one under hi = +-inf taken as 0 ([Note: state codecs] 4: a parameter
// written outside the optimizer keeps its old remainder; the join must not make it NaN).
ZK_TGT static inline Q::F zk_c_join1(const uint16_t* hi, const int16_t* rem) {
  const Q::I h = Q::ld_u16(hi);
  Q::I r = Q::ld_i16(rem);
  const Q::I mag = Q::andi(h, Q::set1i(0x7FFF));
  r = Q::seli(Q::eqi(mag, Q::set1i(0)), Q::maxi(r, Q::set1i(0)), r);
  r = Q::seli(Q::eqi(mag, Q::set1i(0x7F80)), Q::mini(r, Q::set1i(0)), r);
  return Q::bf(Q::addi(Q::shl<16>(h), r));
}

// fp32 master -> (bf16 = RNE(master), remainder = bits - (hi << 16), the tie 0x8000 kept as 0x7FFF;
// NaN -> 0x7FC0 / 0).
ZK_TGT static inline void zk_c_split1(Q::F x, uint16_t* hi_out, int16_t* rem_out) {
  const Q::I b = Q::bi(x);
  const Q::I hi = Q::shr<16>(Q::addi(Q::addi(b, Q::set1i(0x7FFF)), Q::andi(Q::shr<16>(b), Q::set1i(1))));
  const Q::I rem = Q::mini(Q::subi(b, Q::shl<16>(hi)), Q::set1i(0x7FFF));
  const Q::M nan = Q::isnan(x);
  Q::st_u16(hi_out, Q::seli(nan, Q::set1i(0x7FC0), hi));
  Q::st_u16(reinterpret_cast<uint16_t*>(rem_out), Q::seli(nan, Q::set1i(0), rem));
}

// The constants of the fused-Adam update (reference.fused_adam_ref) for one tensor.
// [Note: a power-of-two bias correction divides by multiplying]
// sqrt(v) / bc2 (bc2 = sqrt(1 - beta2^t), rounded to fp32 on the host) is one of the step's two divisions
// per element. On many cores the divider is the busiest unit of the coded steps (an Intel Xeon, AVX-512:
// ~3.6 ns per 16-lane division, ~4.1 per square root, against ~16 ns per 16 elements of the whole 8-bit
// step on one thread; with the division replaced by a multiply the 8-bit + remainders step took 10-20%
// less time there). When bc2 is a power of two, x / bc2 and x * (1 / bc2) are the same IEEE result for
// every x (1 / bc2 is exact, and both products of x with a power of two round the same exact value, inf
// and NaN included), so the multiply changes no bit. bc2 rounds to exactly 1.0f once beta2^t < 2^-24: after
// ~16,600 steps with beta2 = 0.999, ~330 with 0.95, that is, for nearly all of a training run.
struct ZkCConst {
  V::F gscale, wd, decay, omb1, omb2, b2, eps, bc2, ss, inv_bc2, m_bound;
  Q::I neg;
  bool bc2_pow2;  // bc2 a normal power of two: sqrt(v) * inv_bc2 instead of sqrt(v) / bc2
  bool bound_m;   // an 8-bit exp_avg: m capped at m_bound * sqrt(v) ([Note: the bound on 8-bit m]); not when
                  // m_bound is inf (beta1^2 >= beta2): the cap leaves m then (|m| > inf never, inf * 0 is NaN)
};

ZK_TGT static inline bool zk_pow2_normal(float x) {
  const uint32_t b = zk_f32_bits(x);
  return (b & 0x007fffffu) == 0 && (b >> 23) != 0 && (b >> 23) < 255;  // sign 0, mantissa 0, exponent 1..254
}

ZK_TGT static inline ZkCConst zk_c_const(const ZkCJob& j, const ZkCHyper& h) {
  const bool pow2 = zk_pow2_normal(j.bc2);
  return {V::set1(h.gscale), V::set1(h.wd), V::set1(j.decay), V::set1(h.omb1), V::set1(h.omb2),
          V::set1(h.b2), V::set1(h.eps), V::set1(j.bc2), V::set1(j.step_size),
          V::set1(pow2 ? 1.0f / j.bc2 : 1.0f), V::set1(h.m_bound), Q::set1i(h.maximize ? 0x80000000u : 0u), pow2,
          j.m_kind == ZK_MK_U8 && h.m_bound <= 3.4028234663852886e38f};
}

template <int GT>
ZK_TGT static inline V::F zk_c_grad(const void* g, int i) {
  if (GT == ZK_F32) return V::load(static_cast<const float*>(g) + i);
  if (GT == ZK_BF16) return V::load_bf16(static_cast<const uint16_t*>(g) + i);
  return V::load_fp16(static_cast<const uint16_t*>(g) + i);
}

// One vector of the fused-Adam update (reference.fused_adam_ref's operations; each IEEE op rounds once, so
// only the operands matter, not the order), in three parts a kernel can run in separate passes:
// zk_c_grad1: the gradient the moments take (grad scale, maximize's negation after it, the L2 term of Adam
// with weight decay, which reads p before its decay); PLAIN: grad scale 1 and no maximize, so g is used as
// loaded (x * 1 is x, and every use of g goes through an IEEE op that quiets a signaling NaN as the
// multiply would). zk_c_moments1: m and v, returns sqrt(v) (the 8-bit v code encodes it).
// zk_c_param1: the parameter from its m and sqrt(v).
template <bool L2, bool PLAIN>
ZK_TGT static inline V::F zk_c_grad1(const ZkCConst& k, V::F gv, V::F pv) {
  if (!PLAIN) gv = Q::bf(Q::xori(Q::bi(V::mul(gv, k.gscale)), k.neg));
  if (L2) gv = V::add(gv, V::mul(k.wd, pv));
  return gv;
}
// reference.bounded_m (copysign(b, m) where |m| > b, else m; a NaN m or b leaves m; b >= +0 or NaN) as
// max(-b, min(b, m)) with x86 MINPS / MAXPS, which return their second operand when either is NaN or both are
// zeros: a NaN m or b gives m, |m| == b and signed zeros give m, |m| > b gives +-b. In this form the cap cost the
// 8-bit step ~10% on the Intel machine of 2026-11-29 (19.7 -> 22.1 ms at 32M elements; the same with a compare
// and blend, or without the branch): m waits for sqrt(v) before its store and its block absmax.
ZK_TGT static inline V::F zk_c_bounded(V::F mv, V::F b) {
  return Q::maxf(Q::bf(Q::xori(Q::bi(b), Q::set1i(0x80000000u))), Q::minf(b, mv));
}
// The same cap where m is NaN only together with b (zk_c_block_q8: m and v decode finite, so a NaN m needs a
// NaN gradient, which makes v and b NaN too; an infinite m_bound skips the cap: zk_c_const): one VRANGEPS on
// AVX-512 (Q::range_cap; the cap took ~10% of the 8-bit step with the min / max form, ~6% with it).
template <typename QQ = Q>
ZK_TGT static inline V::F zk_c_bounded_q8(V::F mv, V::F b) {
  if constexpr (QQ::kRangeCap) return QQ::range_cap(mv, b);
  else return zk_c_bounded(mv, b);
}
// Q8: called from zk_c_block_q8 (the cap by zk_c_bounded_q8).
template <bool Q8 = false>
ZK_TGT static inline V::F zk_c_moments1(const ZkCConst& k, V::F gv, V::F& mv, V::F& vv) {
  mv = V::add(mv, V::mul(k.omb1, V::sub(gv, mv)));
  vv = V::add(V::mul(k.b2, vv), V::mul(V::mul(k.omb2, gv), gv));
  const V::F sq = V::sqrt(vv);
  if (k.bound_m) mv = Q8 ? zk_c_bounded_q8(mv, V::mul(k.m_bound, sq)) : zk_c_bounded(mv, V::mul(k.m_bound, sq));
  return sq;
}
ZK_TGT static inline V::F zk_c_param1(const ZkCConst& k, V::F pv, V::F mv, V::F sq) {
  pv = V::mul(pv, k.decay);
  // [Note: a power-of-two bias correction divides by multiplying]
  const V::F denom = V::add(k.bc2_pow2 ? V::mul(sq, k.inv_bc2) : V::div(sq, k.bc2), k.eps);
  return V::sub(pv, V::div(V::mul(k.ss, mv), denom));
}

// The fp32 master (or fp32 parameter) and its 16-bit copy, stored.
ZK_TGT static inline void zk_c_store_master(const ZkCJob& j, const ZkCArrays& a, int i, V::F pv) {
  V::store(a.master + i, pv);
  if (j.p16_kind == ZK_BF16) V::store_bf16(static_cast<uint16_t*>(a.p16) + i, pv, false);
  else if (j.p16_kind == ZK_F16) V::store_fp16(static_cast<uint16_t*>(a.p16) + i, pv, false);
}

// The general block: master and both moments decoded into fp32 buffers (L1-resident), updated, encoded.
template <int GT, bool L2>
ZK_TGT static void zk_c_block_general(const ZkCJob& j, const ZkCHyper& h, const ZkCArrays& a, int n,
                                      uint32_t idx0) {
  alignas(64) float bm[ZK_QBLOCK];
  alignas(64) float bv[ZK_QBLOCK];
  zk_c_decode(j.m_kind, false, a.m, a.m_scale ? *a.m_scale : 0.0f, bm);
  zk_c_decode(j.v_kind, true, a.v, a.v_scale ? *a.v_scale : 0.0f, bv);
  const ZkCConst k = zk_c_const(j, h);
  const bool rem = j.master_kind == ZK_MASTER_REM;
  for (int i = 0; i < ZK_QBLOCK; i += V::W) {
    V::F pv = rem ? zk_c_join1(static_cast<const uint16_t*>(a.p16) + i, a.rem + i) : V::load(a.master + i);
    V::F mv = V::load(bm + i), vv = V::load(bv + i);
    const V::F sq = zk_c_moments1(k, zk_c_grad1<L2, false>(k, zk_c_grad<GT>(a.g, i), pv), mv, vv);
    pv = zk_c_param1(k, pv, mv, sq);
    if (rem) zk_c_split1(pv, static_cast<uint16_t*>(a.p16) + i, a.rem + i);
    else zk_c_store_master(j, a, i, pv);
    V::store(bm + i, mv);
    V::store(bv + i, vv);
  }
  if (n < ZK_QBLOCK) {  // the padding must not enter the block scales
    std::memset(bm + n, 0, (ZK_QBLOCK - n) * sizeof(float));
    std::memset(bv + n, 0, (ZK_QBLOCK - n) * sizeof(float));
  }
  zk_c_encode(j.m_kind, false, bm, a.m, a.m_scale, j.m_key, idx0);
  zk_c_encode(j.v_kind, true, bv, a.v, a.v_scale, j.v_key, idx0);
}

// Software prefetch, two blocks ahead, of every 64-byte line of an array of ES-byte elements that the
// STEP elements from i0 begin (the step is compute-heavy per byte: without it the loads of a block wait
// behind the arithmetic of the last).
template <int ES, int STEP>
ZK_TGT static inline void zk_c_prefetch(const void* base, int i0) {
  constexpr int BYTES = STEP * ES;
  const char* p = static_cast<const char*>(base) + (2 * ZK_QBLOCK + i0) * ES;
  if constexpr (BYTES >= 64) {
    for (int o = 0; o < BYTES; o += 64) __builtin_prefetch(p + o);
  } else if ((i0 * ES) % 64 == 0) {
    __builtin_prefetch(p);
  }
}

// Elements per step of the fused blocks: with 16-bit lanes (Q::kPair) two vectors share one remainder join
// and split, one bf16 rounding, one gradient widening and one code store.
constexpr int ZK_C_STEP = Q::kPair ? 2 * V::W : V::W;

// The gradient vectors of the step at i0, after the prefetch of the gradient's and both moments' lines two
// blocks ahead (ES: bytes per moment element, 1 for codes, 2 for bf16).
template <int GT, int ES>
ZK_TGT static inline void zk_c_grads(const void* g, const void* m, const void* v, int i0, V::F* gx) {
  zk_c_prefetch<GT == ZK_F32 ? 4 : 2, ZK_C_STEP>(g, i0);
  zk_c_prefetch<ES, ZK_C_STEP>(m, i0);
  zk_c_prefetch<ES, ZK_C_STEP>(v, i0);
  if constexpr (GT == ZK_BF16 && Q::kPair) Q::bf16_2(static_cast<const uint16_t*>(g) + i0, gx[0], gx[1]);
  else
    for (int u = 0; u < ZK_C_STEP / V::W; ++u) gx[u] = zk_c_grad<GT>(g, i0 + u * V::W);
}

// The master side of a fused block, one step (ZK_C_STEP elements) at a time: the fp32 master (and its
// 16-bit copy) or, with REM, the bf16 parameter + int16 remainder; begin / get the step's vectors, put the
// new ones, end writes what goes by pairs. The arrays are copied out of `a` (the uint8 code stores may alias
// anything: the compiler would reload a's fields after each of them).
template <bool REM>
struct ZkCMasterSide {
  const ZkCJob& j;
  const ZkCArrays& a;
  uint16_t* p16;
  int16_t* rem;
  float* master;
  bool bf16_pair;  // the bf16 copy rounded two vectors at a time
  bool nt16;       // ... and streamed (write-only here: no read-for-ownership; zk_c_blocks fences per chunk)
  V::F px[2];
  ZK_TGT ZkCMasterSide(const ZkCJob& j_, const ZkCArrays& a_)
      : j(j_), a(a_), p16(static_cast<uint16_t*>(a_.p16)), rem(a_.rem), master(a_.master),
        bf16_pair(!REM && Q::kPair && j_.p16_kind == ZK_BF16),
        nt16(bf16_pair && (reinterpret_cast<uintptr_t>(a_.p16) & 63) == 0) {}
  ZK_TGT void begin(int i0) {
    if constexpr (REM) {
      zk_c_prefetch<2, ZK_C_STEP>(p16, i0);
      zk_c_prefetch<2, ZK_C_STEP>(rem, i0);
      if constexpr (Q::kPair) Q::join2(p16 + i0, rem + i0, px[0], px[1]);
    } else {
      zk_c_prefetch<4, ZK_C_STEP>(master, i0);
      if (p16 && !nt16) zk_c_prefetch<2, ZK_C_STEP>(p16, i0);
    }
  }
  ZK_TGT V::F get(int u, int i) const {
    if constexpr (REM && Q::kPair) return px[u];
    else if constexpr (REM) return zk_c_join1(p16 + i, rem + i);
    else return V::load(master + i);
  }
  ZK_TGT void put(int u, int i, V::F pv) {
    if constexpr (Q::kPair) px[u] = pv;
    if constexpr (REM && !Q::kPair) zk_c_split1(pv, p16 + i, rem + i);
    if constexpr (!REM) {
      if (bf16_pair) V::store(master + i, pv);
      else zk_c_store_master(j, a, i, pv);
    }
  }
  ZK_TGT void end(int i0) {
    if constexpr (REM && Q::kPair) Q::split2(px[0], px[1], p16 + i0, rem + i0);
    else if (bf16_pair) Q::bf16x2(px[0], px[1], p16 + i0, nt16);
  }
};

// Both moments 8-bit (the memory-saving layout): the first pass decodes and updates the moments, keeps
// them in L1 buffers (m and sqrt(v)) and their running absmax in registers; the block scales follow, and
// the second pass updates the master from the buffers and writes the codes from the same loads (a third
// pass over the buffers only when a scale is 0 or not finite); the next blocks' arrays are prefetched
// (zk_c_prefetch). Encoding in the second pass made the step 8-9% faster on a Zen 4 core (one thread,
// L2-resident block: 35.2 -> 32.2 cycles per 16 elements with an fp32 master, 36.5 -> 33.2 with
// remainders); it is compute-bound, not divider-bound (a division by RN(1 / bc2) with two FMAs, exact
// by Markstein's theorem, freed the divider and made it 10% slower: more instructions; without any
// division or square root it was still 29.6 cycles), so vector ops are what to save: the NaN rules of
// split2 / bf16x2 behind one compare, the v scale's max on the raw bits, the bf16 gradient by word
// permutes (Q::bf16_2) took it to 30.1 / 31.0 cycles. The AVX2 path got the 16-bit-lane pair ops too
// (Q::kPair, 16 elements per step): 44 -> 42 / 51 -> 42 cycles per 16 elements (same core, ymm).
// With 16-bit lanes (Q::kPair), two vectors share one remainder join and split, or one bf16 rounding.
// The caller sends a block whose v scale is not finite (its v decodes to NaN) to zk_c_block_general.
template <int GT, bool L2, bool REM, bool PLAIN>
ZK_TGT static void zk_c_block_q8(const ZkCJob& j, const ZkCHyper& h, const ZkCArrays& a, int n, uint32_t idx0) {
  alignas(64) float bm[ZK_QBLOCK];
  alignas(64) float bs[ZK_QBLOCK];
  constexpr int STEP = ZK_C_STEP;
  // The arrays as locals: the uint8 code stores may alias anything, so the compiler would reload a's
  // fields after each of them.
  uint8_t* mc = static_cast<uint8_t*>(a.m);
  uint8_t* vc = static_cast<uint8_t*>(a.v);
  ZkCMasterSide<REM> ms_(j, a);
  const uint16_t* p16 = ms_.p16;
  const int16_t* rem = ms_.rem;
  const float* master = ms_.master;
  const Q::F mstep = Q::set1f(*a.m_scale / ZK_M8_LEVELS);
  const Q::I vbase = Q::set1i(zk_f32_bits(*a.v_scale) - ZK_V8_TOP);
  const ZkCConst k = zk_c_const(j, h);
  Q::I am = Q::set1i(0), as = Q::set1i(0);
  // Two passes over the block: the moments and their square roots, then the divisions and the master.
  // Each pass's dependency chain is short, so the divider (a sqrt per vector in the first, two divisions
  // in the second) runs back to back while the other work overlaps it (a few % faster than one pass).
  // Adam's L2 term reads p in the first pass too.
  for (int i0 = 0; i0 < ZK_QBLOCK; i0 += STEP) {
    V::F gx[2];
    zk_c_grads<GT, 1>(a.g, mc, vc, i0, gx);
    for (int u = 0; u < STEP / V::W; ++u) {
      const int i = i0 + u * V::W;
      V::F pv = V::set1(0.0f);
      if constexpr (L2) pv = REM ? zk_c_join1(p16 + i, rem + i) : V::load(master + i);
      V::F mv = zk_m8_decode(mc + i, mstep), vv = zk_v8_decode(vc + i, vbase);
      const V::F sq = zk_c_moments1<true>(k, zk_c_grad1<L2, PLAIN>(k, gx[u], pv), mv, vv);
      V::store(bm + i, mv);
      V::store(bs + i, sq);
      am = Q::maxi(am, zk_q8_absbits(mv));
      as = Q::maxu(as, Q::bi(sq));  // sqrt(v) is +0, positive or NaN (v = b2 v + (1 - b2) g g is never -0)
    }
  }
  // The block scales are known now: the second pass also writes the codes (unless a scale is 0 or not
  // finite: then the codes are written after it, by the rules of zk_m8_codes / zk_v8_codes).
  float ms, vs;
  if (n == ZK_QBLOCK) {
    ms = zk_q8_scale(am);
    vs = zk_q8_scale_bits(Q::hmaxu(as));
  } else {  // the padding must not enter the block scales (a non-finite grad scale makes it NaN)
    std::memset(bm + n, 0, (ZK_QBLOCK - n) * sizeof(float));
    std::memset(bs + n, 0, (ZK_QBLOCK - n) * sizeof(float));
    ms = zk_q8_absmax(bm);
    vs = zk_q8_absmax(bs);
  }
  *a.m_scale = ms;
  *a.v_scale = vs;
  const float minv = zk_c_inverse(ms, ZK_M8_INV_LEVELS);
  const bool codes_here = minv != 0.0f && zk_v8_finite(vs);
  const Q::F m_inv = Q::set1f(minv), magic = Q::set1f(12582912.0f);
  const Q::I v_key = zk_v8_key(vs);
  const Q::I h_step = zk_m8_weyl_step();
  Q::I dither = zk_m8_weyl(idx0, j.m_key);   // m's dither state of the vector at i
  for (int i0 = 0; i0 < ZK_QBLOCK; i0 += STEP) {
    Q::I mcode[2], vcode[2];
    ms_.begin(i0);
    for (int u = 0; u < STEP / V::W; ++u) {
      const int i = i0 + u * V::W;
      const V::F pv = zk_c_param1(k, ms_.get(u, i), V::load(bm + i), V::load(bs + i));
      if (codes_here) {
        if constexpr (Q::kPair) {  // stored by pairs below
          mcode[u] = zk_m8_code_bits(bm + i, m_inv, magic, dither);
          vcode[u] = zk_v8_code_bits(bs + i, v_key);
        } else {
          zk_m8_code1(bm + i, m_inv, magic, dither, mc + i);
          zk_v8_code1(bs + i, v_key, vc + i);
        }
      }
      ms_.put(u, i, pv);
      dither = Q::addi(dither, h_step);
    }
    if constexpr (Q::kPair) {
      if (codes_here) {
        Q::st_u8x2(mc + i0, mcode[0], mcode[1]);
        Q::st_u8x2(vc + i0, vcode[0], vcode[1]);
      }
    }
    ms_.end(i0);
  }
  if (!codes_here) {
    zk_m8_codes(bm, minv, mc, idx0, j.m_key);
    zk_v8_codes(bs, vs, vc);
  }
}

// Both moments bf16 (no block scale: nothing waits for the block's end): one pass, every vector decoded,
// updated and stochastically rounded in registers; the master / remainders as zk_c_block_q8's second pass.
// The general block instead decodes both moments into L1 buffers and encodes them in two more passes
// (58 -> 41 cycles per 16 elements on one Zen 4 core, remainders, AVX-512).
template <int GT, bool L2, bool REM, bool PLAIN>
ZK_TGT static void zk_c_block_b16(const ZkCJob& j, const ZkCHyper& h, const ZkCArrays& a, uint32_t idx0) {
  uint16_t* mb = static_cast<uint16_t*>(a.m);
  uint16_t* vb = static_cast<uint16_t*>(a.v);
  ZkCMasterSide<REM> ms_(j, a);
  const ZkCConst k = zk_c_const(j, h);
  const Q::I mkey = Q::set1i(j.m_key), vkey = Q::set1i(j.v_key);
  Q::I idx = Q::addi(Q::set1i(idx0), Q::iota());
  for (int i0 = 0; i0 < ZK_QBLOCK; i0 += ZK_C_STEP) {
    V::F gx[2];
    zk_c_grads<GT, 2>(a.g, mb, vb, i0, gx);
    ms_.begin(i0);
    for (int u = 0; u < ZK_C_STEP / V::W; ++u, idx = Q::addi(idx, Q::set1i(V::W))) {
      const int i = i0 + u * V::W;
      V::F pv = ms_.get(u, i);
      V::F mv = V::load_bf16(mb + i), vv = V::load_bf16(vb + i);
      const V::F sq = zk_c_moments1(k, zk_c_grad1<L2, PLAIN>(k, gx[u], pv), mv, vv);
      pv = zk_c_param1(k, pv, mv, sq);
      zk_c_sr_bf16(mv, idx, mkey, mb + i);
      zk_c_sr_bf16(vv, idx, vkey, vb + i);
      ms_.put(u, i, pv);
    }
    ms_.end(i0);
  }
}

// Calls f(REM, PLAIN) with the two flags as std::bool_constant, so the fused blocks are instantiated for
// the four combinations: REM = remainders, PLAIN = grad scale 1 and no maximize.
template <typename Fn>
ZK_TGT static inline void zk_c_variant(const ZkCJob& j, const ZkCHyper& h, Fn&& f) {
  const bool rem = j.master_kind == ZK_MASTER_REM, plain = h.gscale == 1.0f && !h.maximize;
  if (rem && plain) f(std::true_type{}, std::true_type{});
  else if (rem) f(std::true_type{}, std::false_type{});
  else if (plain) f(std::false_type{}, std::true_type{});
  else f(std::false_type{}, std::false_type{});
}

// One 256-element block whose arrays are given by `a` (the tensors' own memory for a whole block,
// zero-padded copies for a partial one; n = its real element count, the scales are written to `a`).
template <int GT, bool L2>
ZK_TGT static inline void zk_c_block(const ZkCJob& j, const ZkCHyper& h, const ZkCArrays& a, int n,
                                     uint32_t idx0) {
  if (j.m_kind == ZK_MK_U8 && j.v_kind == ZK_MK_U8 && zk_v8_finite(*a.v_scale))
    zk_c_variant(j, h, [&](auto rem, auto plain) { zk_c_block_q8<GT, L2, rem(), plain()>(j, h, a, n, idx0); });
  else if (j.m_kind == ZK_MK_BF16 && j.v_kind == ZK_MK_BF16)
    zk_c_variant(j, h, [&](auto rem, auto plain) { zk_c_block_b16<GT, L2, rem(), plain()>(j, h, a, idx0); });
  else
    zk_c_block_general<GT, L2>(j, h, a, n, idx0);
}

// Blocks [b, e) of the block space of all tensors (each tensor's blocks counted from its element 0).
template <int GT, bool L2>
ZK_TGT static void zk_c_blocks(const ZkCCall& c, int64_t b, int64_t e) {
  const int64_t T = static_cast<int64_t>(c.jobs.size());
  int64_t t = std::upper_bound(c.block_end.begin(), c.block_end.end(), b) - c.block_end.begin();
  for (; t < T; ++t) {
    const ZkCJob& j = c.jobs[t];
    const int64_t b0 = c.block_end[t] - j.blocks;
    if (b0 >= e) break;
    const int64_t lo = std::max<int64_t>(b - b0, 0), hi = std::min<int64_t>(e - b0, j.blocks);
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t off = k * ZK_QBLOCK;
      const int n = static_cast<int>(std::min<int64_t>(ZK_QBLOCK, j.n - off));
      const uint32_t idx0 = static_cast<uint32_t>(static_cast<uint64_t>(j.index_offset + off));
      const ZkCArrays a = zk_c_arrays(j, off, k);
      if (n == ZK_QBLOCK) {
        zk_c_block<GT, L2>(j, c.h, a, n, idx0);
      } else {
        ZkCStage s;
        const ZkCArrays pa = zk_c_stage_in(j, a, n, s);
        zk_c_block<GT, L2>(j, c.h, pa, n, idx0);
        zk_c_stage_out(j, a, pa, n);
      }
    }
  }
  V::sfence();  // the streaming stores of zk_c_block_q8 are visible before the chunk returns
}

template <int GT, bool L2>
static void zk_c_entry(const ZkCCall& c, int64_t b, int64_t e) {
  zk_c_blocks<GT, L2>(c, b, e);
}

static ZkCodedFn zk_coded_lookup(int gt, bool l2) {
  static const ZkCodedFn table[3][2] = {
      {&zk_c_entry<ZK_F32, false>, &zk_c_entry<ZK_F32, true>},
      {&zk_c_entry<ZK_BF16, false>, &zk_c_entry<ZK_BF16, true>},
      {&zk_c_entry<ZK_F16, false>, &zk_c_entry<ZK_F16, true>},
  };
  return table[gt][l2 ? 1 : 0];
}
