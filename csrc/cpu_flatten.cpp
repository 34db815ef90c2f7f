// Bucket flatten / unflatten for the ZeRO layer, CPU (same SIMD dispatch and thread pool as the
// Adam kernel; arguments are checked by the front end, csrc/adam_front.cpp).
//
//   flatten:   dst[off_i : off_i + n_i] = cast_dst(float(srcs[i]) * scale)   (scale == 1: no multiply)
//   unflatten: dsts[i] = cast_dst_i(src[off_i : off_i + n_i])
//
// Casts are torch's: bf16 round-to-nearest-even on the bits, fp16 by F16C (or c10::Half), fp64
// sources rounded to fp32 first, i.e. bitwise `(src.float() * scale).to(dst.dtype)`.
// One parallel pass over all tensors, split in 16-element units (tensor after tensor).

#include "fused_adam.h"
#include "cpu_vec.h"

namespace {

constexpr int ZK_F64 = 3;  // source-only dtype code (scalar path)

struct ZkCopyJob {
  const void* src;
  void* dst;
  int st, dt;
  int64_t n, units;
};

struct ZkCopyCall {
  std::vector<ZkCopyJob> jobs;
  std::vector<int64_t> unit_end;
  float scale;
  bool apply_scale;
};

int zk_code_src(at::ScalarType t) { return t == at::kDouble ? ZK_F64 : zk_code(t); }

}  // namespace

#define ZK_FLATTEN_BODY                                                                          \
  template <int ST>                                                                              \
  ZK_TGT static inline float s_load(const void* p, int64_t i) {                                  \
    if (ST == ZK_F32) return static_cast<const float*>(p)[i];                                    \
    if (ST == ZK_BF16) return zk_bf16_to_f32(static_cast<const uint16_t*>(p)[i]);                \
    if (ST == ZK_F16) return V::s_fp16_to_f32(static_cast<const uint16_t*>(p)[i]);               \
    return static_cast<float>(static_cast<const double*>(p)[i]);                                 \
  }                                                                                              \
  template <int DT>                                                                              \
  ZK_TGT static inline void s_store(void* p, int64_t i, float x) {                               \
    if (DT == ZK_F32) static_cast<float*>(p)[i] = x;                                             \
    if (DT == ZK_BF16) static_cast<uint16_t*>(p)[i] = zk_f32_to_bf16(x);                         \
    if (DT == ZK_F16) static_cast<uint16_t*>(p)[i] = V::s_f32_to_fp16(x);                        \
  }                                                                                              \
  template <int ST, int DT, bool SCALE>                                                          \
  ZK_TGT static void copy_range(const ZkCopyJob& j, float scale, int64_t lo, int64_t hi) {       \
    int64_t i = lo;                                                                              \
    if (V::W > 1 && ST != ZK_F64) {                                                              \
      const V::F s = V::set1(scale);                                                             \
      for (; i + V::W <= hi; i += V::W) {                                                        \
        V::F x;                                                                                  \
        if (ST == ZK_F32) x = V::load(static_cast<const float*>(j.src) + i);                     \
        else if (ST == ZK_BF16) x = V::load_bf16(static_cast<const uint16_t*>(j.src) + i);       \
        else x = V::load_fp16(static_cast<const uint16_t*>(j.src) + i);                          \
        if (SCALE) x = V::mul(x, s);                                                             \
        if (DT == ZK_F32) V::store(static_cast<float*>(j.dst) + i, x);                           \
        else if (DT == ZK_BF16) V::store_bf16(static_cast<uint16_t*>(j.dst) + i, x, false);      \
        else V::store_fp16(static_cast<uint16_t*>(j.dst) + i, x, false);                         \
      }                                                                                          \
    }                                                                                            \
    for (; i < hi; ++i) {                                                                        \
      float x = s_load<ST>(j.src, i);                                                            \
      if (SCALE) x = x * scale;                                                                  \
      s_store<DT>(j.dst, i, x);                                                                  \
    }                                                                                            \
  }                                                                                              \
  template <int ST, int DT>                                                                      \
  static void copy_job(const ZkCopyJob& j, float scale, bool sc, int64_t lo, int64_t hi) {       \
    if (ST == DT && !sc) {                                                                       \
      const int64_t es = DT == ZK_F32 ? 4 : 2;                                                   \
      std::memcpy(static_cast<char*>(j.dst) + lo * es,                                           \
                  static_cast<const char*>(j.src) + lo * es, (hi - lo) * es);                    \
    } else if (sc) {                                                                             \
      copy_range<ST, DT, true>(j, scale, lo, hi);                                                \
    } else {                                                                                     \
      copy_range<ST, DT, false>(j, scale, lo, hi);                                               \
    }                                                                                            \
  }                                                                                              \
  using CopyFn = void (*)(const ZkCopyJob&, float, bool, int64_t, int64_t);                      \
  static void copy_dispatch(const ZkCopyJob& j, float scale, bool sc, int64_t lo, int64_t hi) {  \
    static const CopyFn table[4][3] = {                                                          \
        {&copy_job<ZK_F32, ZK_F32>, &copy_job<ZK_F32, ZK_BF16>, &copy_job<ZK_F32, ZK_F16>},      \
        {&copy_job<ZK_BF16, ZK_F32>, &copy_job<ZK_BF16, ZK_BF16>, &copy_job<ZK_BF16, ZK_F16>},   \
        {&copy_job<ZK_F16, ZK_F32>, &copy_job<ZK_F16, ZK_BF16>, &copy_job<ZK_F16, ZK_F16>},      \
        {&copy_job<ZK_F64, ZK_F32>, &copy_job<ZK_F64, ZK_BF16>, &copy_job<ZK_F64, ZK_F16>},      \
    };                                                                                           \
    table[j.st][j.dt](j, scale, sc, lo, hi);                                                     \
  }

namespace zk_scalar {
#define ZK_TGT
ZK_FLATTEN_BODY
#undef ZK_TGT
}  // namespace zk_scalar

#if ZK_X86
namespace zk_avx2 {
#define ZK_TGT ZK_TGT_AVX2
ZK_FLATTEN_BODY
#undef ZK_TGT
}  // namespace zk_avx2

namespace zk_avx512 {
#define ZK_TGT ZK_TGT_AVX512
ZK_FLATTEN_BODY
#undef ZK_TGT
}  // namespace zk_avx512
#endif

namespace {

void zk_run_copies(ZkCopyCall& c) {
  int64_t units = 0;
  c.unit_end.resize(c.jobs.size());
  for (size_t t = 0; t < c.jobs.size(); ++t) {
    c.jobs[t].units = (c.jobs[t].n + ZK_UNIT - 1) / ZK_UNIT;
    units += c.jobs[t].units;
    c.unit_end[t] = units;
  }
  const ZkIsa isa = zk_isa();
  const int64_t T = static_cast<int64_t>(c.jobs.size());
  zk_parallel_for(units, ZK_GRAIN_UNITS, [&](int64_t ub, int64_t ue) {
    int64_t t = std::upper_bound(c.unit_end.begin(), c.unit_end.end(), ub) - c.unit_end.begin();
    for (; t < T; ++t) {
      const ZkCopyJob& j = c.jobs[t];
      const int64_t u0 = c.unit_end[t] - j.units;
      if (u0 >= ue) break;
      const int64_t lo = std::max<int64_t>(ub - u0, 0) * ZK_UNIT;
      const int64_t hi = std::min<int64_t>((ue - u0) * ZK_UNIT, j.n);
      if (lo >= hi) continue;
      switch (isa) {
#if ZK_X86
        case ZK_ISA_AVX512: zk_avx512::copy_dispatch(j, c.scale, c.apply_scale, lo, hi); break;
        case ZK_ISA_AVX2: zk_avx2::copy_dispatch(j, c.scale, c.apply_scale, lo, hi); break;
#endif
        default: zk_scalar::copy_dispatch(j, c.scale, c.apply_scale, lo, hi); break;
      }
    }
  });
}

}  // namespace

void flatten_cpu_launch(const std::vector<at::Tensor>& srcs, const at::Tensor& dst,
                        const std::vector<int64_t>& offsets, double scale) {
  ZkCopyCall c;
  c.scale = static_cast<float>(scale);
  c.apply_scale = scale != 1.0;
  const int dt = zk_code(dst.scalar_type());
  char* base = static_cast<char*>(dst.data_ptr());
  for (size_t i = 0; i < srcs.size(); ++i) {
    if (srcs[i].numel() == 0) continue;
    c.jobs.push_back({srcs[i].data_ptr(), base + offsets[i] * dst.element_size(),
                      zk_code_src(srcs[i].scalar_type()), dt, srcs[i].numel(), 0});
  }
  zk_run_copies(c);
}

void unflatten_cpu_launch(const at::Tensor& src, const std::vector<at::Tensor>& dsts,
                          const std::vector<int64_t>& offsets) {
  ZkCopyCall c;
  c.scale = 1.0f;
  c.apply_scale = false;
  const int st = zk_code(src.scalar_type());
  const char* base = static_cast<const char*>(src.data_ptr());
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (dsts[i].numel() == 0) continue;
    c.jobs.push_back({base + offsets[i] * src.element_size(), dsts[i].data_ptr(), st,
                      zk_code(dsts[i].scalar_type()), dsts[i].numel(), 0});
  }
  zk_run_copies(c);
}
