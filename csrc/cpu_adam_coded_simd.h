// The coded-state Adam block, written once over the vector structs V (cpu_vec.h: fp32 arithmetic,
// 16-bit loads/stores) and Q (cpu_coded_vec.h: integer lanes, code-book lookups) and included by
// csrc/cpu_adam_coded.cpp once per SIMD path (inside zk_avx512 / zk_avx2 / zk_scalar) with ZK_TGT
// set to that path's target attribute. No include guard on purpose.
//
// One call processes one whole 256-element quantization block (codecs.BLOCK): decode the master and
// both moments into fp32 buffers (L1-resident), run the update of reference.fused_adam_ref on them
// in its order (one IEEE rounding per op, no FMA), then encode: a blockwise moment's new scale is the
// absmax of the UPDATED block, so it is known only after the update. Every loop runs over exactly
// 256 elements (a partial last block is staged through zero-padded copies by the caller), so there
// is no scalar tail and every path computes each element with the same operations.

#ifndef ZK_TGT
#error "define ZK_TGT before including cpu_adam_coded_simd.h"
#endif

#include "cpu_q8_simd.h"  // zk_q8_absmax / zk_q8_encode / zk_q8_decode (the 8-bit blockwise codec)

// fp32 <- stored moment (kind ZK_MK_*), 256 elements.
ZK_TGT static inline void zk_c_decode(int kind, const void* src, float scale, const ZkLevels& lv,
                                      float* out) {
  switch (kind) {
    case ZK_MK_F32:
      std::memcpy(out, src, ZK_QBLOCK * sizeof(float));
      return;
    case ZK_MK_BF16:
      for (int i = 0; i < ZK_QBLOCK; i += Q::W)
        Q::stf(out + i, Q::bf(Q::shl<16>(Q::ld_u16(static_cast<const uint16_t*>(src) + i))));
      return;
    case ZK_MK_U8:  // table[code] * scale
      zk_q8_decode<false>(static_cast<const uint8_t*>(src), scale, lv, out);
      return;
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

// fp32 -> stored moment, 256 elements; writes the block's scale for the blockwise kinds.
// idx0: flat index of the block's element 0 (mod 2^32) for the stochastic-rounding bits.
ZK_TGT static inline void zk_c_encode(int kind, const float* x, void* dst, float* scale_out,
                                      const ZkLevels& lv, uint32_t key, uint32_t idx0) {
  switch (kind) {
    case ZK_MK_F32:
      std::memcpy(dst, x, ZK_QBLOCK * sizeof(float));
      return;
    case ZK_MK_BF16: {  // bf16 = (bits + (fmix32(i ^ key) >> 16)) >> 16; NaN -> 0x7FC0
      const Q::I k = Q::set1i(key);
      Q::I idx = Q::addi(Q::set1i(idx0), Q::iota());
      for (int i = 0; i < ZK_QBLOCK; i += Q::W, idx = Q::addi(idx, Q::set1i(Q::W))) {
        const Q::F v = Q::ldf(x + i);
        const Q::I r = Q::shr<16>(zk_c_fmix32(Q::xori(idx, k)));
        const Q::I hi = Q::shr<16>(Q::addi(Q::bi(v), r));
        Q::st_u16(static_cast<uint16_t*>(dst) + i, Q::seli(Q::isnan(v), Q::set1i(0x7FC0), hi));
      }
      return;
    }
    case ZK_MK_U8:  // code = #midpoints < x / scale (0 where scale == 0), NaN -> 255
      zk_q8_encode(x, static_cast<uint8_t*>(dst), scale_out, lv);
      return;
    default: {  // float8_e4m3fn of x / (absmax / 448): torch's RNE cast on the bits (kernels/_codecs.py)
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
        code = Q::seli(Q::gti(a, Q::set1i((1087u << 20) - 1)), Q::set1i(0x7F), code);
        Q::st_u8(static_cast<uint8_t*>(dst) + i, Q::ori(Q::andi(code, Q::set1i(0xFF)), sign));
      }
      return;
    }
  }
}

// bf16 parameter + int16 remainder -> fp32 master: bits = (hi << 16) + rem (int32 wrap).
ZK_TGT static inline void zk_c_join(const uint16_t* hi, const int16_t* rem, float* out) {
  for (int i = 0; i < ZK_QBLOCK; i += Q::W)
    Q::stf(out + i, Q::bf(Q::addi(Q::shl<16>(Q::ld_u16(hi + i)), Q::ld_i16(rem + i))));
}

// fp32 master -> (bf16 = RNE(master), remainder = bits - (hi << 16), the tie 0x8000 kept as 0x7FFF;
// NaN -> 0x7FC0 / 0).
ZK_TGT static inline void zk_c_split(const float* p, uint16_t* hi_out, int16_t* rem_out) {
  for (int i = 0; i < ZK_QBLOCK; i += Q::W) {
    const Q::F x = Q::ldf(p + i);
    const Q::I b = Q::bi(x);
    const Q::I hi = Q::shr<16>(Q::addi(Q::addi(b, Q::set1i(0x7FFF)), Q::andi(Q::shr<16>(b), Q::set1i(1))));
    const Q::I rem = Q::mini(Q::subi(b, Q::shl<16>(hi)), Q::set1i(0x7FFF));
    const Q::M nan = Q::isnan(x);
    Q::st_u16(hi_out + i, Q::seli(nan, Q::set1i(0x7FC0), hi));
    Q::st_u16(reinterpret_cast<uint16_t*>(rem_out) + i, Q::seli(nan, Q::set1i(0), rem));
  }
}

// The fused-Adam update in place on the block's buffers p, m, v (reference.fused_adam_ref's
// operations and order; maximize negates g after the grad scale, as the reference does).
template <int GT, bool L2>
ZK_TGT static inline void zk_c_update(const ZkCJob& j, const ZkCHyper& h, const void* g, float* p,
                                      float* m, float* v) {
  const V::F gscale = V::set1(h.gscale), wd = V::set1(h.wd), decay = V::set1(j.decay);
  const V::F omb1 = V::set1(h.omb1), omb2 = V::set1(h.omb2), b2 = V::set1(h.b2);
  const V::F eps = V::set1(h.eps), bc2 = V::set1(j.bc2), ss = V::set1(j.step_size);
  const Q::I neg = Q::set1i(h.maximize ? 0x80000000u : 0u);
  for (int i = 0; i < ZK_QBLOCK; i += V::W) {
    V::F gv;
    if (GT == ZK_F32) gv = V::load(static_cast<const float*>(g) + i);
    else if (GT == ZK_BF16) gv = V::load_bf16(static_cast<const uint16_t*>(g) + i);
    else gv = V::load_fp16(static_cast<const uint16_t*>(g) + i);
    gv = Q::bf(Q::xori(Q::bi(V::mul(gv, gscale)), neg));
    V::F pv = V::load(p + i), mv = V::load(m + i), vv = V::load(v + i);
    if (L2) gv = V::add(gv, V::mul(wd, pv));
    pv = V::mul(pv, decay);
    mv = V::add(mv, V::mul(omb1, V::sub(gv, mv)));
    vv = V::add(V::mul(b2, vv), V::mul(V::mul(omb2, gv), gv));
    const V::F denom = V::add(V::div(V::sqrt(vv), bc2), eps);
    pv = V::sub(pv, V::div(V::mul(ss, mv), denom));
    V::store(p + i, pv);
    V::store(m + i, mv);
    V::store(v + i, vv);
  }
}

// One 256-element block whose arrays are given by `a` (the tensors' own memory for a whole block,
// zero-padded copies for a partial one; n = its real element count, the scales are written to `a`).
template <int GT, bool L2>
ZK_TGT static void zk_c_block(const ZkCJob& j, const ZkCHyper& h, const ZkCArrays& a, int n,
                              uint32_t idx0) {
  alignas(64) float bp[ZK_QBLOCK];
  alignas(64) float bm[ZK_QBLOCK];
  alignas(64) float bv[ZK_QBLOCK];
  if (j.master_kind == ZK_MASTER_REM) zk_c_join(static_cast<const uint16_t*>(a.p16), a.rem, bp);
  else std::memcpy(bp, a.master, sizeof bp);
  zk_c_decode(j.m_kind, a.m, a.m_scale ? *a.m_scale : 0.0f, *h.m_lv, bm);
  zk_c_decode(j.v_kind, a.v, a.v_scale ? *a.v_scale : 0.0f, *h.v_lv, bv);
  zk_c_update<GT, L2>(j, h, a.g, bp, bm, bv);
  if (n < ZK_QBLOCK) {  // the padding must not enter the block scales
    std::memset(bm + n, 0, (ZK_QBLOCK - n) * sizeof(float));
    std::memset(bv + n, 0, (ZK_QBLOCK - n) * sizeof(float));
  }
  zk_c_encode(j.m_kind, bm, a.m, a.m_scale, *h.m_lv, j.m_key, idx0);
  zk_c_encode(j.v_kind, bv, a.v, a.v_scale, *h.v_lv, j.v_key, idx0);
  if (j.master_kind == ZK_MASTER_REM) {
    zk_c_split(bp, static_cast<uint16_t*>(a.p16), a.rem);
    return;
  }
  std::memcpy(a.master, bp, sizeof bp);
  if (j.p16_kind == ZK_BF16)
    for (int i = 0; i < ZK_QBLOCK; i += V::W) V::store_bf16(static_cast<uint16_t*>(a.p16) + i, V::load(bp + i), false);
  else if (j.p16_kind == ZK_F16)
    for (int i = 0; i < ZK_QBLOCK; i += V::W) V::store_fp16(static_cast<uint16_t*>(a.p16) + i, V::load(bp + i), false);
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
