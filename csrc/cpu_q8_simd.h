// The 8-bit blockwise codec on one 256-element block ([Note: state codecs] 2 in
// zero_kernels/codecs.py), written once over the vector struct Q (csrc/cpu_coded_vec.h) and included
// once per SIMD path (inside zk_avx512 / zk_avx2 / zk_scalar, with ZK_TGT set to that path's target
// attribute) by csrc/cpu_adam_coded_simd.h (8-bit moments) and csrc/cpu_quant.cpp (the ZeRO++ wire
// codec). Every loop runs over exactly ZK_QBLOCK elements (callers stage a partial block through a
// zero-padded copy), so there is no scalar tail and the paths compute every element alike: integer
// ops, IEEE fp32 division and multiply, no FMA. No include guard on purpose.

#ifndef ZK_TGT
#error "define ZK_TGT before including cpu_q8_simd.h"
#endif

// Block absmax on the bits: |x| as int32 orders like the floats, every NaN above +inf; a NaN
// result is torch.amax's canonical 0x7FC00000 whatever the NaNs' payloads (a decoded fp8 NaN is
// 0x7FF00000).
// zk_q8_absbits: |x| as bits (a lane of the running max); zk_q8_scale: the block scale from the running max.
ZK_TGT static inline Q::I zk_q8_absbits(Q::F x) { return Q::andi(Q::bi(x), Q::set1i(0x7FFFFFFF)); }

// zk_q8_scale_bits: the scale from the max of the bits (|x| bits, or the raw bits of values >= +0 / NaN).
ZK_TGT static inline float zk_q8_scale_bits(uint32_t u) {
  if (u > 0x7F800000u) u = 0x7FC00000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
ZK_TGT static inline float zk_q8_scale(Q::I acc) { return zk_q8_scale_bits(Q::hmaxi(acc)); }

ZK_TGT static inline float zk_q8_absmax(const float* x) {
  Q::I acc = Q::set1i(0);
  for (int i = 0; i < ZK_QBLOCK; i += Q::W) acc = Q::maxi(acc, zk_q8_absbits(Q::ldf(x + i)));
  return zk_q8_scale(acc);
}

// codes = number of midpoints strictly below x / scale (y = 0 where scale == 0), NaN y -> 255;
// scale = absmax of the block, written to *scale_out.
ZK_TGT static inline void zk_q8_encode(const float* x, uint8_t* out, float* scale_out, const ZkLevels& lv) {
  const float scale = zk_q8_absmax(x);
  *scale_out = scale;
  if (scale == 0.0f) {  // y = 0 everywhere: one code
    const uint8_t c0 = static_cast<uint8_t>(zk_scalar::Q::q8_code(lv, 0.0f));
    std::memset(out, c0, ZK_QBLOCK);
    return;
  }
  const Q::F s = Q::set1f(scale);
  if (scale <= 3.4028234663852886e38f) {  // finite scale >= |x|: no NaN y (NaN x or inf x make it NaN / inf)
    for (int i = 0; i < ZK_QBLOCK; i += Q::W) Q::st_u8(out + i, Q::q8_code(lv, Q::div(Q::ldf(x + i), s)));
    return;
  }
  for (int i = 0; i < ZK_QBLOCK; i += Q::W) {
    const Q::F y = Q::div(Q::ldf(x + i), s);
    Q::st_u8(out + i, Q::seli(Q::isnan(y), Q::set1i(255), Q::q8_code(lv, y)));
  }
}

// out = table[code] * scale (one fp32 multiply), or with ACC out += that product (rounded first).
template <bool ACC>
ZK_TGT static inline void zk_q8_decode(const uint8_t* src, float scale, const ZkLevels& lv, float* out) {
  const Q::F s = Q::set1f(scale);
  for (int i = 0; i < ZK_QBLOCK; i += Q::W) {
    const Q::F x = Q::mul(Q::lookup256(lv, Q::ld_u8(src + i)), s);
    Q::stf(out + i, ACC ? Q::add(Q::ldf(out + i), x) : x);
  }
}
