// The ZeRO++ int8 wire codec on CPU (qwZ's parameter all-gather, qgZ's gradient reduce-scatter:
// zero_kernels/zero/qwz.py, [Note: the wire codec kernels] for the Triton twin): the 8-bit blockwise
// codec of [Note: state codecs] 2 in zero_kernels/codecs.py, bit for bit codecs.encode_q8 /
// codecs.decode_q8 with any code book (the wire passes the linear one, qwz.QWZ_CODE):
//
//   encode: blocks of 256 elements from element 0 (the last one partial), scale = max |x| (NaN if
//           the block holds a NaN), code = number of midpoints strictly below x / scale (IEEE
//           division; y = 0 where scale == 0; a NaN y -> 255). x: fp32, bf16 or fp16 (exact widening).
//   decode: out = table[code] * scale (one fp32 multiply), or out += that product (rounded to fp32
//           first, then the add: acc.add_(decode_q8(...))).
//
// The code is the exact 8-step search over the midpoints of csrc/cpu_coded_vec.h (ZkLevels,
// Q::q8_code; csrc/cpu_q8_simd.h is shared with the coded-state kernel), compiled for AVX-512 (F+BW),
// AVX2+FMA+F16C and portable scalar and chosen at run time by zk_isa() (ZERO_KERNELS_CPU_ISA caps it);
// the paths give the same bits. Threads: torch's intra-op pool, split on block boundaries.
//
// Encode needs only the midpoints, decode only the code book.
// Arguments are checked by the front end (q8_encode_cpu / q8_decode_cpu in csrc/adam_front.cpp).

#include "fused_adam.h"
#include "cpu_coded_vec.h"

#define ZK_QUANT_BODY                                                                              \
  /* x[0:n] (n <= ZK_QBLOCK, source dtype XT) -> fp32 buf, zero-padded to a whole block. */         \
  template <int XT>                                                                                \
  ZK_TGT static inline void zk_w_widen(const void* x, int64_t off, int n, float* buf) {             \
    if (n < ZK_QBLOCK) std::memset(buf, 0, sizeof(float) * ZK_QBLOCK);                              \
    int i = 0;                                                                                     \
    if (XT == ZK_F32) {                                                                            \
      std::memcpy(buf, static_cast<const float*>(x) + off, sizeof(float) * n);                     \
      return;                                                                                      \
    }                                                                                              \
    const uint16_t* p = static_cast<const uint16_t*>(x) + off;                                     \
    for (; i + V::W <= n; i += V::W)                                                               \
      V::store(buf + i, XT == ZK_BF16 ? V::load_bf16(p + i) : V::load_fp16(p + i));                \
    for (; i < n; ++i)                                                                             \
      buf[i] = XT == ZK_BF16 ? zk_bf16_to_f32(p[i]) : V::s_fp16_to_f32(p[i]);                      \
  }                                                                                                \
  /* block k: its first element, its element count (the last block may be partial) */           \
  static inline int zk_w_span(const ZkWire& w, int64_t k, int64_t& off) {                          \
    off = k * ZK_QBLOCK;                                                                           \
    return static_cast<int>(std::min<int64_t>(ZK_QBLOCK, w.n - off));                              \
  }                                                                                                \
  template <int XT>                                                                                \
  ZK_TGT static inline void zk_w_encode_block(const ZkWire& w, int64_t k) {                        \
    int64_t off;                                                                                   \
    const int n = zk_w_span(w, k, off);                                                            \
    if (XT == ZK_F32 && n == ZK_QBLOCK) {  /* a whole fp32 block: straight from memory */            \
      zk_q8_encode(static_cast<const float*>(w.x) + off, w.codes + off, w.scales + k, *w.lv);      \
      return;                                                                                      \
    }                                                                                              \
    alignas(64) float buf[ZK_QBLOCK];                                                              \
    alignas(64) uint8_t codes[ZK_QBLOCK];                                                          \
    zk_w_widen<XT>(w.x, off, n, buf);                                                              \
    zk_q8_encode(buf, n == ZK_QBLOCK ? w.codes + off : codes, w.scales + k, *w.lv);                \
    if (n < ZK_QBLOCK) std::memcpy(w.codes + off, codes, n);                                       \
  }                                                                                                \
  template <bool ACC>                                                                              \
  ZK_TGT static inline void zk_w_decode_block(const ZkWire& w, int64_t k) {                        \
    int64_t off;                                                                                   \
    const int n = zk_w_span(w, k, off);                                                            \
    if (n == ZK_QBLOCK) {                                                                          \
      zk_q8_decode<ACC>(w.codes + off, w.scales[k], *w.lv, w.out + off);                           \
      return;                                                                                      \
    }                                                                                              \
    alignas(64) uint8_t codes[ZK_QBLOCK] = {};  /* a partial block through zero-padded copies */    \
    alignas(64) float buf[ZK_QBLOCK] = {};                                                         \
    std::memcpy(codes, w.codes + off, n);                                                          \
    if (ACC) std::memcpy(buf, w.out + off, sizeof(float) * n);                                     \
    zk_q8_decode<ACC>(codes, w.scales[k], *w.lv, buf);                                             \
    std::memcpy(w.out + off, buf, sizeof(float) * n);                                              \
  }                                                                                                \
  template <int XT>                                                                                \
  ZK_TGT static void zk_w_encode(const ZkWire& w, int64_t b, int64_t e) {                           \
    for (int64_t k = b; k < e; ++k) zk_w_encode_block<XT>(w, k);                                   \
  }                                                                                                \
  template <bool ACC>                                                                              \
  ZK_TGT static void zk_w_decode(const ZkWire& w, int64_t b, int64_t e) {                           \
    for (int64_t k = b; k < e; ++k) zk_w_decode_block<ACC>(w, k);                                  \
  }                                                                                                \
  static ZkWireFn zk_w_lookup(bool encode, int xt, bool acc) {                                     \
    if (!encode) return acc ? &zk_w_decode<true> : &zk_w_decode<false>;                            \
    return xt == ZK_F32 ? &zk_w_encode<ZK_F32> : xt == ZK_BF16 ? &zk_w_encode<ZK_BF16>              \
                                                               : &zk_w_encode<ZK_F16>;             \
  }

namespace {

// One encode or decode call: n elements, ceil(n / 256) blocks.
struct ZkWire {
  const void* x;        // encode: the input (fp32 / bf16 / fp16)
  uint8_t* codes;       // encode: written; decode: read (const)
  float* scales;        // encode: written; decode: read
  float* out;           // decode: written (or accumulated into)
  int64_t n;
  const ZkLevels* lv;   // the code book and its search tables
};

using ZkWireFn = void (*)(const ZkWire&, int64_t, int64_t);

}  // namespace

namespace zk_scalar {
#define ZK_TGT
#include "cpu_q8_simd.h"
ZK_QUANT_BODY
#undef ZK_TGT
}  // namespace zk_scalar

#if ZK_X86
namespace zk_avx2 {
#define ZK_TGT ZK_TGT_AVX2
#include "cpu_q8_simd.h"
ZK_QUANT_BODY
#undef ZK_TGT
}  // namespace zk_avx2

namespace zk_avx512 {
#define ZK_TGT ZK_TGT_AVX512
#include "cpu_q8_simd.h"
ZK_QUANT_BODY
#undef ZK_TGT
}  // namespace zk_avx512
#endif

namespace {

void zk_wire_run(const ZkWire& w, bool encode, int xt, bool acc) {
  if (w.n == 0) return;
  ZkWireFn fn;
  switch (zk_isa()) {
#if ZK_X86
    case ZK_ISA_AVX512: fn = zk_avx512::zk_w_lookup(encode, xt, acc); break;
    case ZK_ISA_AVX2: fn = zk_avx2::zk_w_lookup(encode, xt, acc); break;
#endif
    default: fn = zk_scalar::zk_w_lookup(encode, xt, acc); break;
  }
  const int64_t blocks = (w.n + ZK_QBLOCK - 1) / ZK_QBLOCK;
  zk_parallel_for(blocks, ZK_GRAIN_BLOCKS, [&](int64_t b, int64_t e) { fn(w, b, e); });
}

}  // namespace

void q8_encode_cpu_launch(const at::Tensor& x, const at::Tensor& mid, at::Tensor& codes, at::Tensor& scales) {
  ZkLevels lv;  // encode reads only the search tables
  zk_build_levels(nullptr, mid.data_ptr<float>(), lv);
  ZkWire w{};
  w.x = x.data_ptr();
  w.codes = codes.data_ptr<uint8_t>();
  w.scales = scales.data_ptr<float>();
  w.n = x.numel();
  w.lv = &lv;
  zk_wire_run(w, true, zk_code(x.scalar_type()), false);
}

void q8_decode_cpu_launch(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& table,
                          at::Tensor& out, bool accumulate) {
  ZkLevels lv;  // decode reads only the code book (lv.tab); the search tables stay zero
  std::memset(&lv, 0, sizeof lv);
  std::memcpy(lv.tab, table.data_ptr<float>(), sizeof lv.tab);
  ZkWire w{};
  w.codes = const_cast<uint8_t*>(codes.data_ptr<uint8_t>());
  w.scales = const_cast<float*>(scales.data_ptr<float>());
  w.out = out.data_ptr<float>();
  w.n = codes.numel();
  w.lv = &lv;
  zk_wire_run(w, false, ZK_F32, accumulate);
}
