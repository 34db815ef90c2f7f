// SIMD building blocks shared by the CPU kernels (csrc/cpu_adam.cpp, csrc/cpu_flatten.cpp):
// one vector-ops struct `V` per path (zk_scalar, zk_avx2, zk_avx512; function-level target
// attributes, no -march=native), bf16/fp16 conversions, the run-time ISA choice and a parallel-for
// on torch's intra-op pool. Internal header: include it after all other headers (it switches off
// FP contraction for the code that follows).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
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

// The kernel performs the reference's operations one rounding each ([Note: coefficients are
// computed once, in double] in zero_kernels/reference.py): the compiler must not fuse a*b+c into
// an FMA on its own (GCC does by default, even with -std=c++17, and for vector intrinsics too).
// After all includes, so it only affects the kernels' code.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

enum ZkIsa { ZK_ISA_SCALAR = 0, ZK_ISA_AVX2 = 1, ZK_ISA_AVX512 = 2 };

// The SIMD path (detected once; capped by ZERO_KERNELS_CPU_ISA). Defined in cpu_adam.cpp.
ZkIsa zk_isa();

namespace {

constexpr int ZK_NONE = 0;  // params16 dtype codes
constexpr int ZK_F32 = 0;   // grad dtype codes
constexpr int ZK_BF16 = 1;
constexpr int ZK_F16 = 2;
constexpr int64_t ZK_UNIT = 16;  // elements per work unit (64 B of fp32)

// torch.maximum's NaN on the CPU (its vector path ORs an unordered-compare mask into the max):
// every SIMD path returns this one NaN, so they stay bitwise equal.
static inline float zk_max_nan(float a, float b) {
  if (a != a || b != b) {
    const uint32_t bits = 0xFFFFFFFFu;
    float nan;
    std::memcpy(&nan, &bits, sizeof nan);
    return nan;
  }
  return a > b ? a : b;
}

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

inline int zk_code(at::ScalarType t) {
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

#define ZK_TGT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZK_TGT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx2,fma,f16c")))

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
  static inline F sqrt(F a) { return std::sqrt(a); }
  static inline F max(F a, F b) { return zk_max_nan(a, b); }
  static inline void sfence() {}
  static inline float s_fp16_to_f32(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
  static inline uint16_t s_f32_to_fp16(float f) { return c10::detail::fp16_ieee_from_fp32_value(f); }
};
}  // namespace zk_scalar

#if ZK_X86
// ============================================================================ AVX2 + FMA + F16C
namespace zk_avx2 {
#define ZK_TGT ZK_TGT_AVX2
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
  ZK_TGT static inline F sqrt(F a) { return _mm256_sqrt_ps(a); }
  // torch.maximum (and torch's own AVX2 expression): a NaN operand gives the all-ones NaN.
  ZK_TGT static inline F max(F a, F b) {
    return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
  ZK_TGT static inline void sfence() { _mm_sfence(); }
  ZK_TGT static inline float s_fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
  ZK_TGT static inline uint16_t s_f32_to_fp16(float f) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
  }
};
#undef ZK_TGT
}  // namespace zk_avx2

// ============================================================================ AVX-512 (F + BW + DQ)
namespace zk_avx512 {
#define ZK_TGT ZK_TGT_AVX512
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
  ZK_TGT static inline F sqrt(F a) { return _mm512_sqrt_ps(a); }
  ZK_TGT static inline F max(F a, F b) {  // as the AVX2 path
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q), _mm512_max_ps(a, b),
                                _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
  }
  ZK_TGT static inline void sfence() { _mm_sfence(); }
  ZK_TGT static inline float s_fp16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
  ZK_TGT static inline uint16_t s_f32_to_fp16(float f) {
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
  }
};
#undef ZK_TGT
}  // namespace zk_avx512
#endif  // ZK_X86

