// The fused-Adam element loop, written once over a vector-ops struct `V` and included by
// csrc/cpu_adam.cpp once per SIMD path (inside namespace zk_avx512 / zk_avx2 / zk_scalar), with
// ZK_TGT defined to that path's function-level target attribute. No include guard on purpose.
//
// Required from the including namespace:
//   struct V {
//     using F = <vector of W floats>; static constexpr int W;
//     F load(const float*); void store(float*, F);                    // unaligned
//     F load_bf16(const uint16_t*); F load_fp16(const uint16_t*);
//     void store_bf16(uint16_t*, F, bool nt); void store_fp16(uint16_t*, F, bool nt);
//     F set1(float); F add/sub/mul/div(F, F);
//     F sqrt(F); F max(a, b) = NaN if either is NaN, else a > b ? a : b; void sfence();
//     float s_fp16_to_f32(uint16_t); uint16_t s_f32_to_fp16(float);   // scalar, same rounding
//   };
//
// Bitwise rule: the vector body and the scalar tail perform the operations of
// reference.fused_adam_ref, in its order, each an IEEE fp32 operation rounded once (no FMA: torch
// rounds every op), and the same NaN-propagating max, so every element is computed identically
// whatever the thread count, chunking or tensor size, and equal to the reference bit for bit.

#ifndef ZK_TGT
#error "define ZK_TGT before including cpu_adam_simd.h"
#endif

// ----------------------------------------------------------------------------- scalar element
ZK_TGT static inline float zk_s_load_g(const void* g, int64_t i, int gt) {
  switch (gt) {
    case ZK_F32: return static_cast<const float*>(g)[i];
    case ZK_BF16: return zk_bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
    default: return V::s_fp16_to_f32(static_cast<const uint16_t*>(g)[i]);
  }
}

template <int GT, int PT, bool AMS, bool L2>
ZK_TGT static inline void zk_adam_scalar(const ZkJob& j, const ZkHyper& h, int64_t i) {
  float g = zk_s_load_g(j.g, i, GT) * h.gscale;
  float p = j.p[i];
  float m = j.m[i];
  float v = j.v[i];
  if (L2) g = g + h.wd * p;
  p = p * j.decay;
  m = m + h.omb1 * (g - m);
  v = h.b2 * v + h.omb2 * g * g;
  float vd = v;
  if (AMS) {
    const float vm = zk_max_nan(j.vmax[i], v);
    j.vmax[i] = vm;
    vd = vm;
  }
  const float denom = std::sqrt(vd) / j.bc2 + h.eps;
  p = p - (j.step_size * m) / denom;
  j.p[i] = p;
  j.m[i] = m;
  j.v[i] = v;
  if (PT == ZK_BF16) static_cast<uint16_t*>(j.p16)[i] = zk_f32_to_bf16(p);
  if (PT == ZK_F16) static_cast<uint16_t*>(j.p16)[i] = V::s_f32_to_fp16(p);
}

// ----------------------------------------------------------------------------- vector body
template <int GT>
ZK_TGT static inline V::F zk_v_load_g(const void* g, int64_t i) {
  if (GT == ZK_F32) return V::load(static_cast<const float*>(g) + i);
  if (GT == ZK_BF16) return V::load_bf16(static_cast<const uint16_t*>(g) + i);
  return V::load_fp16(static_cast<const uint16_t*>(g) + i);
}

// Elements [lo, hi) of one tensor: vector body, then a scalar tail.
template <int GT, int PT, bool AMS, bool L2>
ZK_TGT static void zk_adam_range(const ZkJob& j, const ZkHyper& h, int64_t lo, int64_t hi,
                                 bool nt16, bool nt32) {
  int64_t i = lo;
  if (V::W > 1) {
    const V::F gscale = V::set1(h.gscale), wd = V::set1(h.wd), decay = V::set1(j.decay);
    const V::F omb1 = V::set1(h.omb1), omb2 = V::set1(h.omb2), b2 = V::set1(h.b2);
    const V::F eps = V::set1(h.eps), bc2 = V::set1(j.bc2), ss = V::set1(j.step_size);
    // The 16-bit output is write-only: stream it (no read-for-ownership) when it is aligned.
    const bool nt = nt16 && PT != ZK_NONE &&
                    (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(j.p16) + lo) %
                     (2 * V::W)) == 0;
    // Optional streaming stores for the in-place fp32 outputs (only where aligned).
    const uintptr_t amask = 4 * V::W - 1;
    const bool ntf = nt32 && ((reinterpret_cast<uintptr_t>(j.p + lo) | reinterpret_cast<uintptr_t>(j.m + lo) |
                               reinterpret_cast<uintptr_t>(j.v + lo) |
                               (AMS ? reinterpret_cast<uintptr_t>(j.vmax + lo) : 0)) & amask) == 0;
    for (; i + V::W <= hi; i += V::W) {
      V::F g = V::mul(zk_v_load_g<GT>(j.g, i), gscale);
      V::F p = V::load(j.p + i);
      V::F m = V::load(j.m + i);
      V::F v = V::load(j.v + i);
      if (L2) g = V::add(g, V::mul(wd, p));
      p = V::mul(p, decay);
      m = V::add(m, V::mul(omb1, V::sub(g, m)));
      v = V::add(V::mul(b2, v), V::mul(V::mul(omb2, g), g));
      V::F vd = v;
      if (AMS) {
        vd = V::max(V::load(j.vmax + i), v);
        V::store(j.vmax + i, vd, ntf);
      }
      const V::F denom = V::add(V::div(V::sqrt(vd), bc2), eps);
      p = V::sub(p, V::div(V::mul(ss, m), denom));
      V::store(j.p + i, p, ntf);
      V::store(j.m + i, m, ntf);
      V::store(j.v + i, v, ntf);
      if (PT == ZK_BF16) V::store_bf16(static_cast<uint16_t*>(j.p16) + i, p, nt);
      if (PT == ZK_F16) V::store_fp16(static_cast<uint16_t*>(j.p16) + i, p, nt);
    }
    if (nt || ntf) V::sfence();
  }
  for (; i < hi; ++i) zk_adam_scalar<GT, PT, AMS, L2>(j, h, i);
}

// One parallel chunk [ub, ue) of 16-element units over the padded unit space of all tensors.
template <int GT, int PT, bool AMS, bool L2>
ZK_TGT static void zk_adam_units(const ZkCall& c, int64_t ub, int64_t ue) {
  // First tensor whose unit range ends after ub.
  const int64_t T = static_cast<int64_t>(c.jobs.size());
  int64_t t = std::upper_bound(c.unit_end.begin(), c.unit_end.end(), ub) - c.unit_end.begin();
  for (; t < T; ++t) {
    const ZkJob& j = c.jobs[t];
    const int64_t u0 = c.unit_end[t] - j.units;
    if (u0 >= ue) break;
    const int64_t lo = std::max<int64_t>(ub - u0, 0) * ZK_UNIT;
    const int64_t hi = std::min<int64_t>((ue - u0) * ZK_UNIT, j.n);
    if (lo < hi) zk_adam_range<GT, PT, AMS, L2>(j, c.h, lo, hi, c.nt16, c.nt32);
  }
}

// Type-erased entry: [gt][pt][ams][l2] table built by the including file.
template <int GT, int PT, bool AMS, bool L2>
static void zk_adam_entry(const ZkCall& c, int64_t ub, int64_t ue) {
  zk_adam_units<GT, PT, AMS, L2>(c, ub, ue);
}

static ZkAdamFn zk_adam_lookup(int gt, int pt, bool ams, bool l2) {
#define ZK_E(G, P) \
  {&zk_adam_entry<G, P, false, false>, &zk_adam_entry<G, P, false, true>, \
   &zk_adam_entry<G, P, true, false>, &zk_adam_entry<G, P, true, true>}
  static const ZkAdamFn table[3][3][4] = {
      {ZK_E(ZK_F32, ZK_NONE), ZK_E(ZK_F32, ZK_BF16), ZK_E(ZK_F32, ZK_F16)},
      {ZK_E(ZK_BF16, ZK_NONE), ZK_E(ZK_BF16, ZK_BF16), ZK_E(ZK_BF16, ZK_F16)},
      {ZK_E(ZK_F16, ZK_NONE), ZK_E(ZK_F16, ZK_BF16), ZK_E(ZK_F16, ZK_F16)},
  };
#undef ZK_E
  return table[gt][pt][(ams ? 2 : 0) + (l2 ? 1 : 0)];
}

// ----------------------------------------------------------------------------- streaming ceiling
ZK_TGT static void zk_stream_range(float* a, float* b, float* c, const float* d, int64_t lo,
                                   int64_t hi) {
  int64_t i = lo;
  if (V::W > 1) {
    for (; i + V::W <= hi; i += V::W) {
      const V::F x = V::load(d + i);
      V::store(a + i, V::add(V::load(a + i), x));
      V::store(b + i, V::add(V::load(b + i), x));
      V::store(c + i, V::add(V::load(c + i), x));
    }
  }
  for (; i < hi; ++i) {
    const float x = d[i];
    a[i] += x;
    b[i] += x;
    c[i] += x;
  }
}
