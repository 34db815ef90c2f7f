// CPU fused Adam/AdamW step: [Note: the fused-Adam contract] in zero_kernels/reference.py.
//
// One pass over every element of every tensor of the call (multi-tensor), no temporaries:
//   read p, m, v (fp32), g (fp32/bf16/fp16) [, vmax]; write p, m, v [, vmax] [, p16 (bf16/fp16)].
//
// SIMD paths, chosen at run time (never -march=native): AVX-512F, AVX2+FMA+F16C, portable scalar.
// Each path is the same loop (csrc/cpu_adam_simd.h) compiled with a function-level target
// attribute. ZERO_KERNELS_CPU_ISA=avx512|avx2|scalar caps the path (tests use it to compare the
// paths bitwise; a request above what the CPU supports is lowered to what it supports).
//
// Threads: torch's intra-op pool (at::parallel_for semantics; sized by torch.set_num_threads).
// The work is split in 16-element units laid out tensor after tensor (each tensor padded to a
// whole unit), so every chunk boundary is 64-byte aligned relative to the tensor start; each
// chunk runs a vector body and a scalar tail that compute bit-identical results.
//
// Arguments are checked by the front end (csrc/adam_front.cpp) before fused_adam_cpu_launch.

#include "fused_adam.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#ifndef _OPENMP
// Without -fopenmp, ATen's inline at::parallel_for runs serially. Use the same function compiled
// inside libtorch_cpu (its OpenMP pool) through torch's exported C shim instead.
#include <torch/csrc/stable/c/shim.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#define ZK_X86 1
#include <immintrin.h>
#else
#define ZK_X86 0
#endif

#if defined(__GNUC__) && !defined(__clang__)
// GCC's own AVX-512 intrinsic headers trip this warning (undefined pass-through operands).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// The bitwise body/tail rule needs the compiler not to fuse a*b+c into an FMA on its own (GCC
// does by default, even with -std=c++17, and for vector intrinsics too): every FMA in the kernel
// is explicit (std::fma / _mm*_fmadd_ps). After all includes, so it only affects this file's code.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

constexpr int ZK_NONE = 0;  // params16 dtype codes
constexpr int ZK_F32 = 0;   // grad dtype codes
constexpr int ZK_BF16 = 1;
constexpr int ZK_F16 = 2;
constexpr int64_t ZK_UNIT = 16;  // elements per work unit (64 B of fp32)

struct ZkJob {
  float* p;
  const void* g;
  float* m;
  float* v;
  float* vmax;
  void* p16;
  int64_t n;
  int64_t units;
  float step_size, bc2, decay;
};

struct ZkHyper {
  float gscale, wd, omb1, omb2, b2, eps;
};

struct ZkCall {
  std::vector<ZkJob> jobs;
  std::vector<int64_t> unit_end;  // inclusive prefix sum of jobs[t].units
  ZkHyper h;
  bool nt16, nt32;
};

using ZkAdamFn = void (*)(const ZkCall&, int64_t, int64_t);

// bf16 <-> fp32 on the bits (same in every path).
static inline float zk_bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t zk_f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

// ============================================================================ portable scalar
namespace zk_scalar {
struct V {
  using F = float;
  static constexpr int W = 1;
  static inline F load(const float* p) { return *p; }
  static inline void store(float* p, F x, bool = false) { *p = x; }
  static inline F load_bf16(const uint16_t* p) { return zk_bf16_to_f32(*p); }
  static inline F load_fp16(const uint16_t* p) { return s_fp16_to_f32(*p); }
  static inline void store_bf16(uint16_t* p, F x, bool) { *p = zk_f32_to_bf16(x); }
  static inline void store_fp16(uint16_t* p, F x, bool) { *p = s_f32_to_fp16(x); }
  static inline F set1(float x) { return x; }
  static inline F add(F a, F b) { return a + b; }
  static inline F sub(F a, F b) { return a - b; }
  static inline F mul(F a, F b) { return a * b; }
  static inline F div(F a, F b) { return a / b; }
  static inline F fmadd(F a, F b, F c) { return std::fma(a, b, c); }
  static inline F sqrt(F a) { return std::sqrt(a); }
  static inline F max(F a, F b) { return a > b ? a : b; }
  static inline void sfence() {}
  static inline float s_fp16_to_f32(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
  static inline uint16_t s_f32_to_fp16(float f) { return c10::detail::fp16_ieee_from_fp32_value(f); }
};
#define ZK_TGT
#include "cpu_adam_simd.h"
#undef ZK_TGT
}  // namespace zk_scalar

#if ZK_X86
// ============================================================================ AVX2 + FMA + F16C
namespace zk_avx2 {
#define ZK_TGT __attribute__((target("avx2,fma,f16c")))
struct V {
  using F = __m256;
  static constexpr int W = 8;
  ZK_TGT static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  ZK_TGT static inline void store(float* p, F x, bool nt = false) {
    if (nt) _mm256_stream_ps(p, x);
    else _mm256_storeu_ps(p, x);
  }
  ZK_TGT static inline F load_bf16(const uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  ZK_TGT static inline F load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  ZK_TGT static inline void store16(uint16_t* p, __m128i x, bool nt) {
    if (nt) _mm_stream_si128(reinterpret_cast<__m128i*>(p), x);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
  }
  ZK_TGT static inline void store_bf16(uint16_t* p, F x, bool nt) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    // NaN -> quiet NaN with the same sign and top payload bits.
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
    const __m256i isnan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, qnan, isnan);
    store16(p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)), nt);
  }
  ZK_TGT static inline void store_fp16(uint16_t* p, F x, bool nt) {
    store16(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT), nt);
  }
  ZK_TGT static inline F set1(float x) { return _mm256_set1_ps(x); }
  ZK_TGT static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  ZK_TGT static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  ZK_TGT static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  ZK_TGT static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  ZK_TGT static inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  ZK_TGT static inline F sqrt(F a) { return _mm256_sqrt_ps(a); }
  ZK_TGT static inline F max(F a, F b) { return _mm256_max_ps(a, b); }  // a > b ? a : b
  ZK_TGT static inline void sfence() { _mm_sfence(); }
  ZK_TGT static inline float s_fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
  ZK_TGT static inline uint16_t s_f32_to_fp16(float f) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
  }
};
#include "cpu_adam_simd.h"
#undef ZK_TGT
}  // namespace zk_avx2

// ============================================================================ AVX-512F
namespace zk_avx512 {
#define ZK_TGT __attribute__((target("avx512f,avx2,fma,f16c")))
struct V {
  using F = __m512;
  static constexpr int W = 16;
  ZK_TGT static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  ZK_TGT static inline void store(float* p, F x, bool nt = false) {
    if (nt) _mm512_stream_ps(p, x);
    else _mm512_storeu_ps(p, x);
  }
  ZK_TGT static inline F load_bf16(const uint16_t* p) {
    const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  }
  ZK_TGT static inline F load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  ZK_TGT static inline void store16(uint16_t* p, __m256i x, bool nt) {
    if (nt) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
  ZK_TGT static inline void store_bf16(uint16_t* p, F x, bool nt) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __m512i qnan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    const __mmask16 isnan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    store16(p, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(isnan, r, qnan)), nt);
  }
  ZK_TGT static inline void store_fp16(uint16_t* p, F x, bool nt) {
    store16(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT), nt);
  }
  ZK_TGT static inline F set1(float x) { return _mm512_set1_ps(x); }
  ZK_TGT static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  ZK_TGT static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  ZK_TGT static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  ZK_TGT static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  ZK_TGT static inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  ZK_TGT static inline F sqrt(F a) { return _mm512_sqrt_ps(a); }
  ZK_TGT static inline F max(F a, F b) { return _mm512_max_ps(a, b); }  // a > b ? a : b
  ZK_TGT static inline void sfence() { _mm_sfence(); }
  ZK_TGT static inline float s_fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
  ZK_TGT static inline uint16_t s_f32_to_fp16(float f) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
  }
};
#include "cpu_adam_simd.h"
#undef ZK_TGT
}  // namespace zk_avx512
#endif  // ZK_X86

// ============================================================================ dispatch
namespace {

enum ZkIsa { ZK_ISA_SCALAR = 0, ZK_ISA_AVX2 = 1, ZK_ISA_AVX512 = 2 };

ZkIsa zk_detect_isa() {
  int best = ZK_ISA_SCALAR;
#if ZK_X86 && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    best = ZK_ISA_AVX2;
  if (best == ZK_ISA_AVX2 && __builtin_cpu_supports("avx512f")) best = ZK_ISA_AVX512;
#endif
  if (const char* env = std::getenv("ZERO_KERNELS_CPU_ISA")) {
    const std::string s(env);
    int cap = best;
    if (s == "scalar") cap = ZK_ISA_SCALAR;
    else if (s == "avx2") cap = ZK_ISA_AVX2;
    else if (s == "avx512") cap = ZK_ISA_AVX512;
    best = std::min(best, cap);
  }
  return static_cast<ZkIsa>(best);
}

ZkIsa zk_isa() {
  static const ZkIsa isa = zk_detect_isa();
  return isa;
}

// Non-temporal (streaming) stores: nt16 for the write-only 16-bit parameter copy, nt32 for the
// in-place fp32 outputs. Defaults from measurement (bench/bench_cpu_adam.py); ZERO_KERNELS_CPU_NT
// = "<nt16><nt32>" as two digits (e.g. "10") overrides them, as does zk_set_cpu_nt().
std::atomic<int> zk_nt_flags{-1};

int zk_nt() {
  int f = zk_nt_flags.load(std::memory_order_relaxed);
  if (f < 0) {
    f = 1 | 0;  // defaults: nt16 on, nt32 off
    if (const char* env = std::getenv("ZERO_KERNELS_CPU_NT")) {
      const std::string s(env);
      if (s.size() >= 1) f = (s[0] == '1' ? 1 : 0) | (s.size() >= 2 && s[1] == '1' ? 2 : 0);
    }
    zk_nt_flags.store(f, std::memory_order_relaxed);
  }
  return f;
}

int zk_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ZK_F32;
    case at::kBFloat16: return ZK_BF16;
    case at::kHalf: return ZK_F16;
    default: TORCH_CHECK(false, "zero_kernels: unsupported dtype ", t);
  }
}

// Run f(begin, end) over [0, n) on torch's intra-op pool.
template <class Fn>
void zk_parallel_for(int64_t n, int64_t grain, const Fn& f) {
  if (n <= 0) return;
#ifdef _OPENMP
  at::parallel_for(0, n, grain, f);
#else
  auto cb = [](int64_t b, int64_t e, void* ctx) { (*static_cast<const Fn*>(ctx))(b, e); };
  const AOTITorchError err = torch_parallel_for(0, n, grain, cb, const_cast<Fn*>(&f));
  TORCH_CHECK(err == AOTI_TORCH_SUCCESS, "zero_kernels: torch_parallel_for failed");
#endif
}

constexpr int64_t ZK_GRAIN_UNITS = 2048;  // 32K elements: below this, one thread

}  // namespace

void zk_set_cpu_nt(bool nt16, bool nt32) { zk_nt_flags.store((nt16 ? 1 : 0) | (nt32 ? 2 : 0)); }

const char* zk_cpu_isa() {
  switch (zk_isa()) {
    case ZK_ISA_AVX512: return "avx512";
    case ZK_ISA_AVX2: return "avx2";
    default: return "scalar";
  }
}

void fused_adam_cpu_launch(ZK_FUSED_ADAM_ARGS) {
  const int64_t T = static_cast<int64_t>(masters.size());
  if (T == 0) return;
  if (found_inf.has_value() && found_inf->data_ptr<float>()[0] != 0.0f) return;

  ZkCall c;
  float gs = grad_scale.has_value() ? grad_scale->data_ptr<float>()[0] : 1.0f;
  // -(g * s) == g * (-s) exactly (negation is exact and rounding is symmetric).
  c.h.gscale = maximize ? -gs : gs;
  c.h.wd = static_cast<float>(weight_decay);
  c.h.omb1 = static_cast<float>(1.0 - beta1);
  c.h.omb2 = static_cast<float>(1.0 - beta2);
  c.h.b2 = static_cast<float>(beta2);
  c.h.eps = static_cast<float>(eps);
  c.nt16 = (zk_nt() & 1) != 0;
  c.nt32 = (zk_nt() & 2) != 0;
  const bool ams = !max_exp_avg_sqs.empty();
  const bool has16 = !params16.empty();
  const bool l2 = !adamw && weight_decay != 0.0;
  const int gt = zk_code(grads[0].scalar_type());
  const int pt = has16 ? (params16[0].scalar_type() == at::kBFloat16 ? 1 : 2) : ZK_NONE;

  const float* co = coeffs.data_ptr<float>();
  c.jobs.resize(T);
  c.unit_end.resize(T);
  int64_t units = 0;
  for (int64_t t = 0; t < T; ++t) {
    ZkJob& j = c.jobs[t];
    j.p = masters[t].data_ptr<float>();
    j.g = grads[t].data_ptr();
    j.m = exp_avgs[t].data_ptr<float>();
    j.v = exp_avg_sqs[t].data_ptr<float>();
    j.vmax = ams ? max_exp_avg_sqs[t].data_ptr<float>() : nullptr;
    j.p16 = has16 ? params16[t].data_ptr() : nullptr;
    j.n = masters[t].numel();
    j.units = (j.n + ZK_UNIT - 1) / ZK_UNIT;
    j.step_size = co[3 * t + 0];
    j.bc2 = co[3 * t + 1];
    j.decay = adamw ? co[3 * t + 2] : 1.0f;
    units += j.units;
    c.unit_end[t] = units;
  }

  ZkAdamFn fn;
  switch (zk_isa()) {
#if ZK_X86
    case ZK_ISA_AVX512: fn = zk_avx512::zk_adam_lookup(gt, pt, ams, l2); break;
    case ZK_ISA_AVX2: fn = zk_avx2::zk_adam_lookup(gt, pt, ams, l2); break;
#endif
    default: fn = zk_scalar::zk_adam_lookup(gt, pt, ams, l2); break;
  }
  zk_parallel_for(units, ZK_GRAIN_UNITS, [&](int64_t b, int64_t e) { fn(c, b, e); });
}

void stream_ceiling_cpu(at::Tensor& a, at::Tensor& b, at::Tensor& c, const at::Tensor& d) {
  float* pa = a.data_ptr<float>();
  float* pb = b.data_ptr<float>();
  float* pc = c.data_ptr<float>();
  const float* pd = d.data_ptr<float>();
  const int64_t n = a.numel();
  const int64_t units = (n + ZK_UNIT - 1) / ZK_UNIT;
  const ZkIsa isa = zk_isa();
  zk_parallel_for(units, ZK_GRAIN_UNITS, [&](int64_t ub, int64_t ue) {
    const int64_t lo = ub * ZK_UNIT, hi = std::min(ue * ZK_UNIT, n);
    switch (isa) {
#if ZK_X86
      case ZK_ISA_AVX512: zk_avx512::zk_stream_range(pa, pb, pc, pd, lo, hi); break;
      case ZK_ISA_AVX2: zk_avx2::zk_stream_range(pa, pb, pc, pd, lo, hi); break;
#endif
      default: zk_scalar::zk_stream_range(pa, pb, pc, pd, lo, hi); break;
    }
  });
}
