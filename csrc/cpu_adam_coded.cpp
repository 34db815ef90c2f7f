// CPU fused Adam/AdamW step on coded (low-precision) optimizer states (issue 11): decode -> the fp32
// update of [Note: the fused-Adam contract] -> encode, in one pass, bit for bit
// zero_kernels.codecs.adam_step_coded ([Note: state codecs]; the Triton twin is kernels/adam_coded.py).
//
// Work unit: one 256-element quantization block of one tensor (blocks counted from each tensor's
// element 0), so a blockwise moment's new scale (the absmax of the updated block) is computed by
// the thread that encodes the block. Blocks are laid out tensor after tensor and split between
// torch's intra-op threads (at::parallel_for semantics) on block boundaries. The block body
// (csrc/cpu_adam_coded_simd.h) is compiled for AVX-512 (F+BW+DQ), AVX2+FMA+F16C and portable scalar and
// chosen at run time with the fp32 kernel's rule (zk_isa(), ZERO_KERNELS_CPU_ISA caps it); the
// paths give identical bits (exact integer codecs, IEEE fp32 ops, no FMA).
//
// Arguments are checked by the front end (check_coded_adam_args in csrc/adam_front.cpp).

#include <cmath>
#include <limits>
#include <type_traits>

#include "fused_adam.h"
#include "cpu_coded_vec.h"

namespace {

constexpr int ZK_MK_F32 = 0, ZK_MK_BF16 = 1, ZK_MK_U8 = 2, ZK_MK_F8 = 3;  // moment kinds
constexpr int ZK_MASTER_F32 = 0, ZK_MASTER_REM = 1;                    // master kinds

// One tensor of the call.
struct ZkCJob {
  void* master;       // fp32 master / fp32 parameter (ZK_MASTER_F32) or int16 remainder (ZK_MASTER_REM)
  const void* g;      // gradient: fp32 / bf16 / fp16 (the call's one dtype)
  void* m;            // exp_avg storage: fp32 / bf16 bits / int8 codes / e4m3fn codes (m_kind)
  void* v;            // exp_avg_sq storage (v_kind)
  float* m_scale;     // fp32 [blocks] block scales of a blockwise m, else nullptr
  float* v_scale;     // same for v
  void* p16;          // 16-bit parameter (bf16 / fp16, p16_kind), nullptr if none
  int64_t n;          // elements
  int64_t blocks;     // ceil(n / 256)
  int64_t index_offset;  // flat index of element 0 (stochastic-rounding bits)
  uint32_t m_key, v_key;  // stochastic-rounding keys (codecs.sr_key) of this tensor and step
  float step_size, bc2, decay;  // coeffs row (decay = 1 for Adam / L2)
  int master_kind, m_kind, v_kind, p16_kind;  // ZK_MASTER_*, ZK_MK_*, ZK_MK_*, ZK_NONE/ZK_BF16/ZK_F16
  int g_size;         // bytes per gradient element
};

struct ZkCHyper {
  float gscale, wd, omb1, omb2, b2, eps;
  float m_bound;  // reference.m_bound(beta1, beta2) rounded to fp32 (applied to an 8-bit exp_avg only)
  bool maximize;
};

struct ZkCCall {
  std::vector<ZkCJob> jobs;
  std::vector<int64_t> block_end;  // inclusive prefix sum of jobs[t].blocks
  ZkCHyper h;
};

using ZkCodedFn = void (*)(const ZkCCall&, int64_t, int64_t);

// The arrays of one block (pointers at its first element; scales at its block index).
struct ZkCArrays {
  float* master;
  int16_t* rem;
  void* p16;
  const void* g;
  void* m;
  void* v;
  float* m_scale;
  float* v_scale;
};

int zk_elem_size(int kind) { return kind == ZK_MK_F32 ? 4 : kind == ZK_MK_BF16 ? 2 : 1; }

ZkCArrays zk_c_arrays(const ZkCJob& j, int64_t off, int64_t blk) {
  ZkCArrays a{};
  if (j.master_kind == ZK_MASTER_REM) a.rem = static_cast<int16_t*>(j.master) + off;
  else a.master = static_cast<float*>(j.master) + off;
  a.p16 = j.p16 ? static_cast<uint16_t*>(j.p16) + off : nullptr;
  a.g = static_cast<const char*>(j.g) + off * j.g_size;
  a.m = static_cast<char*>(j.m) + off * zk_elem_size(j.m_kind);
  a.v = static_cast<char*>(j.v) + off * zk_elem_size(j.v_kind);
  a.m_scale = j.m_scale ? j.m_scale + blk : nullptr;
  a.v_scale = j.v_scale ? j.v_scale + blk : nullptr;
  return a;
}

// Zero-padded copies of a partial (last) block: the block body always runs on 256 elements.
struct alignas(64) ZkCStage {
  float master[ZK_QBLOCK];
  float g[ZK_QBLOCK];
  float m[ZK_QBLOCK];
  float v[ZK_QBLOCK];
  int16_t rem[ZK_QBLOCK];
  uint16_t p16[ZK_QBLOCK];
};

}  // namespace

namespace {

ZkCArrays zk_c_stage_in(const ZkCJob& j, const ZkCArrays& a, int n, ZkCStage& s) {
  std::memset(&s, 0, sizeof s);
  ZkCArrays p = a;
  if (a.master) { std::memcpy(s.master, a.master, n * 4); p.master = s.master; }
  if (a.rem) { std::memcpy(s.rem, a.rem, n * 2); p.rem = s.rem; }
  if (a.p16) { std::memcpy(s.p16, a.p16, n * 2); p.p16 = s.p16; }
  std::memcpy(s.g, a.g, n * j.g_size);
  p.g = s.g;
  std::memcpy(s.m, a.m, n * zk_elem_size(j.m_kind));
  p.m = s.m;
  std::memcpy(s.v, a.v, n * zk_elem_size(j.v_kind));
  p.v = s.v;
  return p;
}

void zk_c_stage_out(const ZkCJob& j, const ZkCArrays& a, const ZkCArrays& p, int n) {
  if (a.master) std::memcpy(a.master, p.master, n * 4);
  if (a.rem) std::memcpy(a.rem, p.rem, n * 2);
  if (a.p16) std::memcpy(a.p16, p.p16, n * 2);
  std::memcpy(a.m, p.m, n * zk_elem_size(j.m_kind));
  std::memcpy(a.v, p.v, n * zk_elem_size(j.v_kind));
}

}  // namespace

namespace zk_scalar {
#define ZK_TGT
#include "cpu_adam_coded_simd.h"
#undef ZK_TGT
}  // namespace zk_scalar

#if ZK_X86
namespace zk_avx2 {
#define ZK_TGT ZK_TGT_AVX2
#include "cpu_adam_coded_simd.h"
#undef ZK_TGT
}  // namespace zk_avx2

namespace zk_avx512 {
#define ZK_TGT ZK_TGT_AVX512
#include "cpu_adam_coded_simd.h"
#undef ZK_TGT
}  // namespace zk_avx512
#endif

namespace {

int zk_moment_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ZK_MK_F32;
    case at::kBFloat16: return ZK_MK_BF16;
    case at::kByte: return ZK_MK_U8;
    default: return ZK_MK_F8;  // float8_e4m3fn (the front end admits nothing else)
  }
}

}  // namespace

// codecs.sr_key: the stochastic-rounding key of a tensor (seed), step and moment (stream 0 / 1), mod 2^32.
static uint32_t zk_sr_key(uint32_t seed, uint32_t step, uint32_t stream) {
  return zk_scalar::zk_c_fmix32(seed ^ zk_scalar::zk_c_fmix32(2u * step + stream));
}

void fused_adam_coded_cpu_launch(ZK_CODED_ADAM_ARGS) {
  const int64_t T = static_cast<int64_t>(masters.size());
  if (T == 0) return;
  if (found_inf.has_value() && found_inf->data_ptr<float>()[0] != 0.0f) return;

  ZkCCall c;
  c.h.gscale = grad_scale.has_value() ? grad_scale->data_ptr<float>()[0] : 1.0f;
  c.h.maximize = maximize;
  c.h.wd = static_cast<float>(weight_decay);
  c.h.omb1 = static_cast<float>(1.0 - beta1);
  c.h.omb2 = static_cast<float>(1.0 - beta2);
  c.h.b2 = static_cast<float>(beta2);
  c.h.eps = static_cast<float>(eps);
  // reference.m_bound, the same double operations ([Note: the bound on 8-bit m] in zero_kernels/codecs.py)
  c.h.m_bound = (0.0 <= beta1 && beta1 * beta1 < beta2 && beta2 < 1.0)
                    ? static_cast<float>((1.0 - beta1) / std::sqrt((1.0 - beta2) * (1.0 - beta1 * beta1 / beta2)))
                    : std::numeric_limits<float>::infinity();
  const bool l2 = !adamw && weight_decay != 0.0;
  const int gt = zk_code(grads[0].scalar_type());
  const bool rem = masters[0].scalar_type() == at::kShort;
  const int pt = params16.empty() ? ZK_NONE : (params16[0].scalar_type() == at::kBFloat16 ? ZK_BF16 : ZK_F16);

  const float* co = coeffs.data_ptr<float>();
  const int64_t* ky = keys.data_ptr<int64_t>();
  c.jobs.resize(T);
  c.block_end.resize(T);
  int64_t blocks = 0;
  for (int64_t t = 0; t < T; ++t) {
    ZkCJob& j = c.jobs[t];
    j.master = masters[t].data_ptr();
    j.g = grads[t].data_ptr();
    j.g_size = static_cast<int>(grads[t].element_size());
    j.m = exp_avgs[t].data_ptr();
    j.v = exp_avg_sqs[t].data_ptr();
    j.m_kind = zk_moment_kind(exp_avgs[t]);
    j.v_kind = zk_moment_kind(exp_avg_sqs[t]);
    j.m_scale = exp_avg_scales.empty() ? nullptr : exp_avg_scales[t].data_ptr<float>();
    j.v_scale = exp_avg_sq_scales.empty() ? nullptr : exp_avg_sq_scales[t].data_ptr<float>();
    j.p16 = pt == ZK_NONE ? nullptr : params16[t].data_ptr();
    j.p16_kind = pt;
    j.master_kind = rem ? ZK_MASTER_REM : ZK_MASTER_F32;
    j.n = masters[t].numel();
    j.blocks = (j.n + ZK_QBLOCK - 1) / ZK_QBLOCK;
    j.m_key = zk_sr_key(static_cast<uint32_t>(ky[3 * t]), static_cast<uint32_t>(ky[3 * t + 1]), 0);
    j.v_key = zk_sr_key(static_cast<uint32_t>(ky[3 * t]), static_cast<uint32_t>(ky[3 * t + 1]), 1);
    j.index_offset = ky[3 * t + 2];
    j.step_size = co[3 * t + 0];
    j.bc2 = co[3 * t + 1];
    j.decay = adamw ? co[3 * t + 2] : 1.0f;
    blocks += j.blocks;
    c.block_end[t] = blocks;
  }

  ZkCodedFn fn;
  switch (zk_isa()) {
#if ZK_X86
    case ZK_ISA_AVX512: fn = zk_avx512::zk_coded_lookup(gt, l2); break;
    case ZK_ISA_AVX2: fn = zk_avx2::zk_coded_lookup(gt, l2); break;
#endif
    default: fn = zk_scalar::zk_coded_lookup(gt, l2); break;
  }
  zk_parallel_for(blocks, ZK_GRAIN_BLOCKS, [&](int64_t b, int64_t e) { fn(c, b, e); });
}
