// CPU fused Adam/AdamW step: [Note: the fused-Adam contract] in zero_kernels/reference.py.
//
// One pass over every element of every tensor of the call (multi-tensor), no temporaries:
//   read p, m, v (fp32), g (fp32/bf16/fp16) [, vmax]; write p, m, v [, vmax] [, p16 (bf16/fp16)].
//
// SIMD paths, chosen at run time (never -march=native): AVX-512 (F+BW+DQ), AVX2+FMA+F16C, portable scalar.
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
#include "cpu_vec.h"

namespace {

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

}  // namespace

namespace zk_scalar {
#define ZK_TGT
#include "cpu_adam_simd.h"
#undef ZK_TGT
}  // namespace zk_scalar

#if ZK_X86
namespace zk_avx2 {
#define ZK_TGT ZK_TGT_AVX2
#include "cpu_adam_simd.h"
#undef ZK_TGT
}  // namespace zk_avx2

namespace zk_avx512 {
#define ZK_TGT ZK_TGT_AVX512
#include "cpu_adam_simd.h"
#undef ZK_TGT
}  // namespace zk_avx512
#endif

// ============================================================================ dispatch
namespace {

ZkIsa zk_detect_isa() {
  int best = ZK_ISA_SCALAR;
#if ZK_X86 && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    best = ZK_ISA_AVX2;
  // AVX-512 means F + BW + DQ (every AVX-512 CPU since Skylake-SP; the coded kernel's 16-bit lanes need
  // BW, its cap on 8-bit m DQ's VRANGEPS).
  if (best == ZK_ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq"))
    best = ZK_ISA_AVX512;
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

}  // namespace

ZkIsa zk_isa() {
  static const ZkIsa isa = zk_detect_isa();
  return isa;
}

namespace {

// Non-temporal (streaming) stores: nt16 for the write-only 16-bit parameter copy, nt32 for the
// in-place fp32 outputs. Defaults from measurement (bench/bench_cpu_adam.py); ZERO_KERNELS_CPU_NT
// = "<nt16><nt32>" as two digits (e.g. "10") overrides them, as does zk_set_cpu_nt().
std::atomic<int> zk_nt_flags{-1};

int zk_nt() {
  int f = zk_nt_flags.load(std::memory_order_relaxed);
  if (f < 0) {
    // Defaults: nt16 on (measured a few % faster on the mixed step), nt32 off (no gain: the lines
    // were just read, so a streaming store saves no read-for-ownership; sometimes slower).
    f = 1;
    if (const char* env = std::getenv("ZERO_KERNELS_CPU_NT")) {
      const std::string s(env);
      if (s.size() >= 1) f = (s[0] == '1' ? 1 : 0) | (s.size() >= 2 && s[1] == '1' ? 2 : 0);
    }
    zk_nt_flags.store(f, std::memory_order_relaxed);
  }
  return f;
}

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
