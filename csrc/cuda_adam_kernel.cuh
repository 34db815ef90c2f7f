// Multi-tensor fused Adam/AdamW: the CUDA kernel proper (no torch headers).
//
// The contract is [Note: the fused-Adam contract] in zero_kernels/reference.py. The host launcher
// (torch side: tensor lists, dtype dispatch, current stream) is csrc/cuda_adam.cu.
//
// [Note: why the kernel lives in a torch-free header]
// tests/test_nvcc.py compiles this header for sm_80 and sm_90 on machines without a GPU and
// asserts ptxas reports no spills. A CPU-only torch wheel ships ATen/c10 CUDA headers but not the
// CUDA libraries' headers they include (cusparse.h, cublas_v2.h via ATen/cuda/CUDAContext.h) nor
// the generated c10/cuda/impl/cuda_cmake_macros.h. Keeping the device code here, depending only
// on the CUDA toolkit, lets the test instantiate every template combination without torch; the
// .cu file is compiled as well, against a stub for the generated macro header (see the test).
// For the same reason the launcher uses c10::cuda::getCurrentCUDAStream (c10/cuda/CUDAStream.h)
// rather than ATen/cuda/CUDAContext.h: it is the same stream at::cuda::getCurrentCUDAStream returns.
//
// [Note: multi-tensor layout]
// Like apex's multi_tensor_apply, one launch covers up to kMaxTensors tensors whose pointers and
// sizes travel by value in the kernel's parameter space (AdamTensorTable, < 4 KB, passed as a
// __grid_constant__ so dynamic indexing reads the parameter bank directly instead of copying the
// struct to local memory). Unlike apex there is no per-block table: each tensor owns a contiguous
// range of blocks (block_end is the inclusive prefix sum of ceil(numel / kChunk)) and a block finds
// its tensor by a uniform scan of at most kMaxTensors entries. So the grid is as large as the work
// (a 1B-element ZeRO shard is one launch of ~122K blocks, not 50 launches of 320 blocks), and only
// the number of tensors, never their size, splits launches. Sizes and offsets are 64-bit.
//
// [Note: vector and scalar paths]
// A block checks (uniformly) whether every pointer of its tensor is 16-byte aligned. If so it
// streams kVec = 8 elements per thread per iteration with 128-bit accesses only: two 16-byte loads
// for each fp32 array and one for a 16-bit gradient, one 16-byte store of 8 16-bit parameters.
// Chunk starts are multiples of kChunk (a multiple of kVec), so every vector access stays aligned;
// the last < kVec elements of a tensor go through the scalar update. Unaligned tensors (e.g. views
// at odd offsets) take a coalesced scalar loop. Both paths run the same per-element function.
//
// [Note: bitwise agreement with the reference]
// torch's own kernels round every operation once, IEEE-style: no FMA contraction, no approximate
// division or square root, no flush of subnormals. The build passes no --use_fast_math
// (zero_kernels/_build.py), and the update is written with tiny inline-PTX helpers anyway
// (mul.rn.f32, add.rn.f32, div.rn.f32, sqrt.rn.f32, no .ftz: ptxas cannot contract or approximate
// them, whatever flags a user adds), in the operation order of reference.fused_adam_ref, with
// torch.maximum's NaN propagation (max.NaN.f32); negation flips the sign bit and found_inf is
// tested on its bits. The fp32 scalars are cast from the same doubles as torch casts its
// Python-float operands (1 - beta computed in double on the host: [Note: coefficients are computed
// once, in double] in reference.py), so the result matches the reference (run on a GPU) bit for
// bit. The kernel is memory-bound: FMAs it gives up cost nothing measurable.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace zk {
namespace cuda_adam {

constexpr int kThreads = 256;                 // threads per block
constexpr int kVec = 8;                       // elements per thread per vector iteration
constexpr int kItersPerChunk = 4;             // vector iterations per block
constexpr int64_t kChunk = int64_t(kThreads) * kVec * kItersPerChunk;  // 8192 elements per block
// Minimum resident blocks per SM for __launch_bounds__. 4 x 256 threads caps registers at 64,
// which fits the 4 x 8 live values of the plain update (56-64 used). amsgrad keeps a fifth array
// live and spills under 64 (and under ptxas' 80 for 3 blocks), so it asks for 2 blocks (cap 128);
// ptxas uses 82-92, i.e. 2-3 resident blocks (512-768 threads) per SM. Either way each thread has
// 10-11 128-bit loads in flight: 80+ KB per SM, several times what Little's law needs to saturate
// HBM (~10-20 KB per SM on A100/H100), so occupancy is not the limit. tests/test_nvcc.py prints
// the counts.
template <bool kAmsgrad>
constexpr int kMinBlocksPerSM = kAmsgrad ? 2 : 4;
constexpr int kMaxTensors = 48;               // tensors per launch (parameter space < 4 KB)

// Pointer slots of a table row.
enum Slot : int { kMaster = 0, kGrad, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kParam16, kNumSlots };

struct AdamTensorTable {
  int32_t ntensors;
  int32_t coeff_row[kMaxTensors];   // row of the [T, 3] coeffs tensor for this tensor
  int32_t block_end[kMaxTensors];   // inclusive prefix sum of blocks (tensor i owns [end[i-1], end[i]))
  int64_t numel[kMaxTensors];
  void* ptr[kNumSlots][kMaxTensors];  // nullptr when absent (no amsgrad / no 16-bit copy)
};

// Everything that is the same for all tensors of a launch.
struct AdamScalars {
  const float* coeffs;      // [T, 3] fp32 on the device: step_size, bc2_sqrt, decay
  const float* grad_scale;  // 1 element or nullptr: g *= *grad_scale
  const float* found_inf;   // 1 element or nullptr: nonzero -> write nothing
  float one_minus_beta1;    // (float)(1.0 - beta1), as torch casts the Python float (1 - beta1)
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;       // L2 coefficient, used iff l2
  float m_bound;            // reference.m_bound(beta1, beta2): the coded kernel's 8-bit exp_avg cap (kBoundM)
  bool l2;                  // !adamw && weight_decay != 0 (reference: g = g + weight_decay * p)
  bool adamw;               // p = p * decay (decay = 1 - lr * weight_decay, from coeffs)
  bool maximize;
  bool has_grad_scale;      // grad_scale != nullptr
};

// The kernel argument limit is 4 KB (portable to every driver); keep headroom.
static_assert(sizeof(AdamTensorTable) + sizeof(AdamScalars) <= 3968,
              "kernel parameters must stay under the 4 KB limit");

// "No 16-bit parameter copy" marker for the P16 template parameter.
struct NoParam16 {};

// ---- dtype traits: one template per storage type, no per-dtype copies of the kernel ----------
template <typename T> struct Storage;
template <> struct Storage<float> {
  __device__ __forceinline__ static float to_float(float x) { return x; }
  __device__ __forceinline__ static float from_float(float x) { return x; }
};
template <> struct Storage<__nv_bfloat16> {
  __device__ __forceinline__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  // Round to nearest even (NaN stays NaN), as torch's .to(torch.bfloat16).
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Storage<__half> {
  __device__ __forceinline__ static float to_float(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
};

// Load / store kVec consecutive elements with 16-byte transactions only. `p` must be 16-byte
// aligned (the caller's vector-path condition); kVec * sizeof(T) is a multiple of 16 for every
// storage type used here (8 x 2 B = 16 B, 8 x 4 B = 2 x 16 B).
template <typename T>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[kVec]) {
  static_assert((kVec * sizeof(T)) % 16 == 0, "vector must be whole 16-byte words");
  constexpr int kWords = int(kVec * sizeof(T) / 16);
  constexpr int kPerWord = int(16 / sizeof(T));
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    const uint4 raw = reinterpret_cast<const uint4*>(p)[w];
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int j = 0; j < kPerWord; ++j) out[w * kPerWord + j] = Storage<T>::to_float(e[j]);
  }
}

template <typename T>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[kVec]) {
  constexpr int kWords = int(kVec * sizeof(T) / 16);
  constexpr int kPerWord = int(16 / sizeof(T));
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int j = 0; j < kPerWord; ++j) e[j] = Storage<T>::from_float(in[w * kPerWord + j]);
    reinterpret_cast<uint4*>(p)[w] = raw;
  }
}

// One element's update, in the operation order of reference.fused_adam_ref (see the Note on
// bitwise agreement). `coef` = (step_size, bc2_sqrt, decay) of this tensor; gs = grad scale.
struct Coef {
  float step_size, bc2_sqrt, decay;
};

// IEEE single-precision operations, round to nearest even, subnormals kept (see the Note).
__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float add_rn(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sub_rn(float a, float b) {
  float r;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float sqrt_rn(float a) {
  float r;
  asm("sqrt.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
// torch.maximum: NaN if either operand is NaN (fmaxf would drop it).
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? __uint_as_float(0x7fc00000u) : fmaxf(a, b);
#endif
}
__device__ __forceinline__ float neg(float a) { return __uint_as_float(__float_as_uint(a) ^ 0x80000000u); }

// Returns the square root the denominator took (sqrt(v), sqrt(vmax) with amsgrad): the coded kernel's
// 8-bit exp_avg_sq code is taken of sqrt(v) ([Note: the coded CUDA kernel]) and reuses it.
// kBoundM (the coded kernel with an 8-bit exp_avg): m capped at m_bound * sqrt(v) before the parameter update,
// reference.bounded_m ([Note: the bound on 8-bit m] in zero_kernels/codecs.py; an ordered compare: a NaN m or
// bound leaves m).
template <bool kAmsgrad, bool kBoundM = false>
__device__ __forceinline__ float adam_update(float& p, float g, float& m, float& v, float& vmax,
                                             const Coef& c, float gmul, const AdamScalars& s) {
  // gmul = grad_scale, negated for maximize: RNE is sign-symmetric, so g * (-gs) == -(g * gs)
  // bit for bit and g * (+-1) == +-g; one multiply instead of two flag-dependent branches.
  g = mul_rn(g, gmul);
  // Launch-uniform flags: written as selects; the compiler is free to version the loop on them.
  const float g_l2 = add_rn(g, mul_rn(s.weight_decay, p));
  g = s.l2 ? g_l2 : g;
  const float p_decayed = mul_rn(p, c.decay);
  p = s.adamw ? p_decayed : p;
  m = add_rn(m, mul_rn(s.one_minus_beta1, sub_rn(g, m)));
  v = add_rn(mul_rn(s.beta2, v), mul_rn(mul_rn(s.one_minus_beta2, g), g));
  float vd = v;
  if constexpr (kAmsgrad) {
    vmax = max_nan(vmax, v);
    vd = vmax;
  }
  const float root = sqrt_rn(vd);
  if constexpr (kBoundM) {
    const float b = mul_rn(s.m_bound, root);
    m = fabsf(m) > b ? copysignf(b, m) : m;
  }
  const float denom = add_rn(div_rn(root, c.bc2_sqrt), s.eps);
  p = sub_rn(p, div_rn(mul_rn(c.step_size, m), denom));
  return root;
}

template <typename T>
__device__ __forceinline__ bool aligned16(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Scalar update of element i (tail of the vector path, and the unaligned path).
template <typename G, typename P16, bool kAmsgrad>
__device__ __forceinline__ void adam_scalar(int64_t i, float* __restrict__ master,
                                            const G* __restrict__ grad, float* __restrict__ m_ptr,
                                            float* __restrict__ v_ptr, float* __restrict__ vmax_ptr,
                                            P16* __restrict__ p16, const Coef& c, float gmul,
                                            const AdamScalars& s) {
  float p = master[i];
  const float g = Storage<G>::to_float(grad[i]);
  float m = m_ptr[i];
  float v = v_ptr[i];
  float vmax = kAmsgrad ? vmax_ptr[i] : 0.f;
  adam_update<kAmsgrad>(p, g, m, v, vmax, c, gmul, s);
  master[i] = p;
  m_ptr[i] = m;
  v_ptr[i] = v;
  if constexpr (kAmsgrad) vmax_ptr[i] = vmax;
  if constexpr (!std::is_same<P16, NoParam16>::value) p16[i] = Storage<P16>::from_float(p);
}

// G: gradient storage (float, __nv_bfloat16, __half). P16: 16-bit parameter copy
// (__nv_bfloat16, __half) or NoParam16. kAmsgrad: read/write max_exp_avg_sq.
template <typename G, typename P16, bool kAmsgrad>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM<kAmsgrad>)
fused_adam_kernel(const __grid_constant__ AdamTensorTable table, const AdamScalars s) {
  // found_inf is read on the device: no host synchronization, capturable in a CUDA graph.
  // Nonzero on the bits: NaN and subnormals skip too, whatever -ftz says.
  if (s.found_inf != nullptr && (__float_as_uint(*s.found_inf) & 0x7fffffffu) != 0u) return;

  // Which tensor does this block work on? Uniform scan of the prefix sums (<= kMaxTensors).
  const int32_t b = int32_t(blockIdx.x);
  int t = 0;
  while (t + 1 < table.ntensors && b >= table.block_end[t]) ++t;
  const int32_t first_block = t == 0 ? 0 : table.block_end[t - 1];
  const int64_t n = table.numel[t];
  const int64_t start = int64_t(b - first_block) * kChunk;
  const int64_t len = (n - start < kChunk) ? (n - start) : kChunk;
  if (len <= 0) return;

  float* __restrict__ master = static_cast<float*>(table.ptr[kMaster][t]) + start;
  const G* __restrict__ grad = static_cast<const G*>(table.ptr[kGrad][t]) + start;
  float* __restrict__ m_ptr = static_cast<float*>(table.ptr[kExpAvg][t]) + start;
  float* __restrict__ v_ptr = static_cast<float*>(table.ptr[kExpAvgSq][t]) + start;
  float* __restrict__ vmax_ptr =
      kAmsgrad ? static_cast<float*>(table.ptr[kMaxExpAvgSq][t]) + start : nullptr;
  P16* __restrict__ p16 = nullptr;
  if constexpr (!std::is_same<P16, NoParam16>::value)
    p16 = static_cast<P16*>(table.ptr[kParam16][t]) + start;

  const float* crow = s.coeffs + int64_t(table.coeff_row[t]) * 3;
  const Coef c{crow[0], crow[1], crow[2]};
  const float gs = s.has_grad_scale ? *s.grad_scale : 1.f;
  const float gmul = s.maximize ? neg(gs) : gs;

  bool aligned = aligned16(master) && aligned16(grad) && aligned16(m_ptr) && aligned16(v_ptr);
  if constexpr (kAmsgrad) aligned = aligned && aligned16(vmax_ptr);
  if constexpr (!std::is_same<P16, NoParam16>::value) aligned = aligned && aligned16(p16);

  if (aligned) {
    const int64_t nvec = len & ~int64_t(kVec - 1);
    // One iteration keeps 4-5 arrays x 8 elements in flight per thread (10-11 128-bit loads):
    // plenty of memory-level parallelism; unrolling further would only cost registers.
#pragma unroll 1
    for (int64_t i = int64_t(threadIdx.x) * kVec; i < nvec; i += int64_t(kThreads) * kVec) {
      float p[kVec], g[kVec], m[kVec], v[kVec], vmax[kVec];
      load_vec<float>(master + i, p);
      load_vec<G>(grad + i, g);
      load_vec<float>(m_ptr + i, m);
      load_vec<float>(v_ptr + i, v);
      if constexpr (kAmsgrad) load_vec<float>(vmax_ptr + i, vmax);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if constexpr (!kAmsgrad) vmax[j] = 0.f;
        adam_update<kAmsgrad>(p[j], g[j], m[j], v[j], vmax[j], c, gmul, s);
      }
      store_vec<float>(master + i, p);
      store_vec<float>(m_ptr + i, m);
      store_vec<float>(v_ptr + i, v);
      if constexpr (kAmsgrad) store_vec<float>(vmax_ptr + i, vmax);
      if constexpr (!std::is_same<P16, NoParam16>::value) store_vec<P16>(p16 + i, p);
    }
    // Tail: the last (< kVec) elements of the tensor.
    const int64_t i = nvec + threadIdx.x;
    if (i < len)
      adam_scalar<G, P16, kAmsgrad>(i, master, grad, m_ptr, v_ptr, vmax_ptr, p16, c, gmul, s);
  } else {
    // Unaligned tensors (rare: views at odd offsets). Not unrolled: keeps registers for the
    // vector path's 5 x 8 live values under the __launch_bounds__ budget.
#pragma unroll 1
    for (int64_t i = threadIdx.x; i < len; i += kThreads)
      adam_scalar<G, P16, kAmsgrad>(i, master, grad, m_ptr, v_ptr, vmax_ptr, p16, c, gmul, s);
  }
}

// Every (gradient, 16-bit parameter, amsgrad) combination, instantiated explicitly: by
// csrc/cuda_adam.cu (see [Note: host-only torch code] there) and by tests/test_nvcc.py.
#define ZK_CUDA_ADAM_INSTANTIATE_1(G, P16, AMS)                                               \
  template __global__ void zk::cuda_adam::fused_adam_kernel<G, P16, AMS>(                     \
      const __grid_constant__ zk::cuda_adam::AdamTensorTable, const zk::cuda_adam::AdamScalars);
#define ZK_CUDA_ADAM_INSTANTIATE_2(G, P16) \
  ZK_CUDA_ADAM_INSTANTIATE_1(G, P16, false) ZK_CUDA_ADAM_INSTANTIATE_1(G, P16, true)
#define ZK_CUDA_ADAM_INSTANTIATE_3(G)                        \
  ZK_CUDA_ADAM_INSTANTIATE_2(G, zk::cuda_adam::NoParam16)   \
  ZK_CUDA_ADAM_INSTANTIATE_2(G, __nv_bfloat16)              \
  ZK_CUDA_ADAM_INSTANTIATE_2(G, __half)
#define ZK_CUDA_ADAM_INSTANTIATE_ALL()   \
  ZK_CUDA_ADAM_INSTANTIATE_3(float)      \
  ZK_CUDA_ADAM_INSTANTIATE_3(__nv_bfloat16) \
  ZK_CUDA_ADAM_INSTANTIATE_3(__half)

}  // namespace cuda_adam
}  // namespace zk
