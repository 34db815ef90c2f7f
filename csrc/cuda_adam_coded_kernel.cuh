// Fused Adam/AdamW on coded (low-precision) optimizer states: the CUDA kernel proper (no torch headers).
//
// Definition: [Note: state codecs] in zero_kernels/codecs.py; reference step codecs.adam_step_coded
// (decode -> the fp32 update of the fused-Adam contract -> encode); Triton twin kernels/adam_coded.py
// with its device codecs kernels/_codecs.py, which this file follows rule for rule. Host launcher:
// csrc/cuda_adam_coded.cu. Torch-free for tests/test_nvcc.py, like csrc/cuda_adam_kernel.cuh (see
// [Note: why the kernel lives in a torch-free header] there), whose multi-tensor layout, IEEE helpers
// and per-element update (adam_update, which also hands back the sqrt(v) of its denominator) this
// kernel reuses unchanged.
//
// [Note: the coded CUDA kernel]
// Work split. A launch covers up to kCodedMaxTensors tensors of ONE layout (master kind, moment kinds:
// template parameters; gradient and 16-bit parameter dtypes: launch-uniform runtime switches, which
// cost a branch per 8 elements and keep 32 instead of 288 instantiations). Each tensor owns a range of
// blocks, found by the prefix-sum scan of [Note: multi-tensor layout]. A block of 8 warps handles
// kCodedChunk = 2048 elements: each WARP one whole 256-element quantization block (codecs.BLOCK,
// counted from the tensor's element 0; chunk starts are multiples of 256), lane l its elements
// 8l .. 8l+7. So the block absmax that sets the new scale is a per-thread
// max of 8 and one warp reduction (redux.sync.max.u32 on sm_80+, shuffles below): no shared memory,
// no __syncthreads. The absmax is taken on the bits, as the Triton kernel does: |x| as uint32 orders
// like the floats and every NaN lies above +inf, so the max is NaN when the block holds one (torch.amax).
// Accesses. When the quantization block is whole and every pointer of the tensor is aligned, each
// thread moves its 8 elements with 128-bit accesses (two per fp32 array, one per 16-bit array) and one
// 64-bit access for the 8 uint8 / float8 codes; besides them a quantization block reads and writes one
// fp32 scale per blockwise moment (one broadcast address for the warp). A partial last block, or a
// tensor at an unaligned address, takes element-wise accesses of the same registers (invalid lanes
// read 0 and stay out of the absmax).
// 8-bit moments ([Note: state codecs] 2) are arithmetic codes, with no table: per quantization block
// every lane derives its scalars from the one reduced scale (redundantly: no shuffle, no shared memory),
// then per element a few operations:
//   exp_avg:    decode m = float(int8 code) * (scale / 127);
//               encode q = cvt.rni.s32 (round half even) of m * (127 * 2^15 / scale), then stochastic
//               rounding: code = clamp((q + r) >> 15, -127, 127), r = (i * 0x9E3779B1 + key) >> 17
//               (15 random bits of the flat index i); the inverse is replaced by 0 unless finite (a block of
//               zeros, a scale so tiny that the inverse overflows): code 0 there.
//   exp_avg_sq: a log code of s = sqrt(v) on its bits, s the square root adam_update took for the
//               denominator (so a uint8 exp_avg_sq keeps s, not v, in its registers after the update):
//               encode code = max(int32(bits(s) - bits(scale) + 255 * 2^19 + 2^18) >> 19, 1), 0 where
//               s == 0 (the scale = the block's max s); decode s' = bits((code << 19) + bits(scale) -
//               255 * 2^19) (0 for code 0), v = s' * s'.
// An inf / NaN block has the scale NaN, stored as the canonical NaN 0x7FC00000; then its codes are 0 and
// it decodes to NaN everywhere, as the fp32 state would be poisoned.
// Numerics. Every codec is integer work on the bits plus IEEE fp32 operations (the inline-PTX helpers
// of cuda_adam_kernel.cuh: div.rn, add.rn, mul.rn, sqrt.rn; the float <-> int conversions are exact or
// the rounding the codec names), so the result is the reference's, bit for bit.
#pragma once

#include "cuda_adam_kernel.cuh"

namespace zk {
namespace cuda_adam_coded {

using zk::cuda_adam::AdamScalars;
using zk::cuda_adam::Coef;
using zk::cuda_adam::kThreads;

constexpr int kQBlock = 256;                              // codecs.BLOCK: elements per block scale
constexpr int kLaneElems = kQBlock / 32;                  // 8 elements per thread (one warp, one block)
constexpr int64_t kCodedChunk = int64_t(kQBlock) * (kThreads / 32);  // 2048 elements per block
// 3 x 256 threads per SM: at most 80 registers. A thread keeps 4 arrays x 8 elements live through the
// update, plus 7 tensor pointers, coefficients and keys; under 64 registers (4 blocks) the remainder
// layouts spill 8-16 B even with the arithmetic 8-bit codes (ptxas, CUDA 13, sm_90). A block does ONE
// quantization block per warp (no loop): with a loop, its invariants spilled even at 80 registers.
// tests/test_nvcc.py prints the counts.
constexpr int kCodedMinBlocksPerSM = 3;
constexpr int kCodedMaxTensors = 40;                      // tensors per launch (parameter space < 4 KB)
constexpr float kF8Max = 448.0f;                          // codecs.F8_MAX: largest finite e4m3fn
constexpr float kM8Levels = 127.0f;                       // codecs.M8_LEVELS: exp_avg codes -127..127
constexpr float kM8InvLevels = 4161536.0f;                // 127 * 2^15: the scaled inverse of the dithered m code
constexpr uint32_t kV8Top = 255u << 19;                    // codecs.V8_LEVELS (255) in the bits of sqrt(v)
constexpr uint32_t kV8Half = 1u << 18;                     // half a code step (codecs.V8_STEP_BITS = 19)
constexpr float kFltMax = 3.4028234663852886e38f;         // the largest finite fp32 (codecs._FLT_MAX)
constexpr uint32_t kCanonicalNaN = 0x7FC00000u;           // an 8-bit block's NaN scale (codecs.block_absmax)
static_assert(kThreads % 32 == 0 && kCodedChunk % kQBlock == 0, "blocks must hold whole warps and blocks");

// Master layout (template parameter): as MASTER_KIND of kernels/adam_coded.py.
enum MasterKind : int { kMasterF32 = 0, kMasterRemainder = 1 };
// Moment format (template parameters): as M_KIND / V_KIND of kernels/adam_coded.py.
enum MomentKind : int { kMomF32 = 0, kMomBF16 = 1, kMomU8 = 2, kMomF8 = 3 };
// Gradient / 16-bit parameter dtype (runtime, launch-uniform): 0 = fp32 / none, 1 = bf16, 2 = fp16.
enum Dtype16 : int { kNone = 0, kBF16 = 1, kF16 = 2 };

// Pointer slots of a table row.
enum CodedSlot : int {
  kMaster = 0,   // fp32 master (or the fp32 parameter) | int16 remainder (kMasterRemainder)
  kGrad,         // fp32 | bf16 | fp16 gradient, read only
  kExpAvg,       // exp_avg in its stored format (fp32 | bf16 | uint8 | float8_e4m3fn)
  kExpAvgSq,     // exp_avg_sq, likewise
  kExpAvgScale,  // fp32 [ceil(numel / 256)] block scales of exp_avg (blockwise formats), else nullptr
  kExpAvgSqScale,  // likewise for exp_avg_sq
  kParam16,      // bf16 | fp16 parameter copy, nullptr when absent; the bf16 parameter with remainders
  kCodedSlots
};

struct CodedTensorTable {
  int32_t ntensors;                          // rows in use
  int32_t row[kCodedMaxTensors];             // row of the [T, 3] coeffs and keys tensors
  int32_t block_end[kCodedMaxTensors];       // inclusive prefix sum of ceil(numel / kCodedChunk)
  int64_t numel[kCodedMaxTensors];           // elements of the tensor
  void* ptr[kCodedSlots][kCodedMaxTensors];  // see CodedSlot
};

// Everything that is the same for all tensors of a launch.
struct CodedScalars {
  AdamScalars adam;       // coeffs, grad_scale, found_inf and the update's scalars (cuda_adam_kernel.cuh)
  const int64_t* keys;    // [T, 3] on the device: seed, step count (sr_key of both: the moments' SR keys),
                          // and the flat index of element 0 (index_offset); all used mod 2^32
  int32_t grad_dtype;     // Dtype16: kNone means fp32
  int32_t p16_dtype;      // Dtype16 of params16 (kBF16 with remainders), kNone when absent
};

static_assert(sizeof(CodedTensorTable) + sizeof(CodedScalars) <= 3968,
              "kernel parameters must stay under the 4 KB limit");

// ---- raw element access: 8 consecutive elements as zero-extended uint32 bits --------------------
template <typename T>
__device__ __forceinline__ bool vec_aligned(const void* p) {
  constexpr uintptr_t kAlign = sizeof(T) * kLaneElems < 16 ? sizeof(T) * kLaneElems : 16;
  return (reinterpret_cast<uintptr_t>(p) & (kAlign - 1)) == 0;
}

// vec: all 8 valid and `p` aligned (vec_aligned): 128-bit accesses (64-bit for bytes). Otherwise
// element-wise, the first `valid` only; the others read as 0.
template <typename T>
__device__ __forceinline__ void load8(const void* p_, bool vec, int valid, uint32_t (&out)[kLaneElems]) {
  const T* __restrict__ p = static_cast<const T*>(p_);
  if (vec) {
    if constexpr (sizeof(T) == 4) {
      const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
      out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
      out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
    } else if constexpr (sizeof(T) == 2) {
      const uint4 a = *reinterpret_cast<const uint4*>(p);
      const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) { out[2 * j] = w[j] & 0xFFFFu; out[2 * j + 1] = w[j] >> 16; }
    } else {
      const uint2 a = *reinterpret_cast<const uint2*>(p);
#pragma unroll
      for (int j = 0; j < 4; ++j) { out[j] = (a.x >> (8 * j)) & 0xFFu; out[4 + j] = (a.y >> (8 * j)) & 0xFFu; }
    }
  } else {
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) out[j] = j < valid ? uint32_t(p[j]) : 0u;
  }
}

template <typename T>
__device__ __forceinline__ void store8(void* p_, bool vec, int valid, const uint32_t (&in)[kLaneElems]) {
  T* __restrict__ p = static_cast<T*>(p_);
  if (vec) {
    if constexpr (sizeof(T) == 4) {
      reinterpret_cast<uint4*>(p)[0] = make_uint4(in[0], in[1], in[2], in[3]);
      reinterpret_cast<uint4*>(p)[1] = make_uint4(in[4], in[5], in[6], in[7]);
    } else if constexpr (sizeof(T) == 2) {
      *reinterpret_cast<uint4*>(p) = make_uint4(in[0] | (in[1] << 16), in[2] | (in[3] << 16),
                                                in[4] | (in[5] << 16), in[6] | (in[7] << 16));
    } else {
      *reinterpret_cast<uint2*>(p) = make_uint2(in[0] | (in[1] << 8) | (in[2] << 16) | (in[3] << 24),
                                                in[4] | (in[5] << 8) | (in[6] << 16) | (in[7] << 24));
    }
  } else {
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j)
      if (j < valid) p[j] = T(in[j]);
  }
}

// ---- codecs ([Note: state codecs]; each mirrors the function of kernels/_codecs.py it names) -------
__device__ __forceinline__ uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// sr_key: the stochastic-rounding key of a tensor (seed), step and moment (stream 0 / 1), mod 2^32.
__device__ __forceinline__ uint32_t sr_key(uint32_t seed, uint32_t step, uint32_t stream) {
  return fmix32(seed ^ fmix32(2u * step + stream));
}

// encode_bf16_sr: `index` is the element's flat index mod 2^32 (offset in the tensor + index_offset).
__device__ __forceinline__ uint32_t encode_bf16_sr(float x, uint32_t index, uint32_t key) {
  const uint32_t r = fmix32(index ^ key) >> 16;
  return x != x ? 0x7FC0u : (__float_as_uint(x) + r) >> 16;
}

// decode_f8: float8_e4m3fn bits -> fp32, exactly (subnormals m * 2^-9; 0x7F / 0xFF are NaN).
__device__ __forceinline__ float decode_f8(uint32_t c) {
  const uint32_t e = (c >> 3) & 0xFu, mant = c & 7u;
  float mag = e == 0 ? zk::cuda_adam::mul_rn(__uint2float_rn(mant), 0.001953125f)
                     : __uint_as_float(((e + 120u) << 23) | (mant << 20));
  if ((c & 0x7Fu) == 0x7Fu) mag = __uint_as_float(__float_as_uint(mag) | 0x7FC00000u);
  return (c & 0x80u) ? zk::cuda_adam::neg(mag) : mag;
}

// encode_f8: fp32 -> float8_e4m3fn bits of clamp(y, -448, 448), round to nearest even (codecs.encode_f8):
// NaN -> 0x7F, |y| >= 448 (inf included) -> 0x7E, saturated; below 2^-6 through an fp32 add of 2^14.
__device__ __forceinline__ uint32_t encode_f8(float y) {
  const uint32_t b = __float_as_uint(y);
  const uint32_t sign = (b >> 24) & 0x80u, a = b & 0x7FFFFFFFu;
  const uint32_t small = __float_as_uint(zk::cuda_adam::add_rn(__uint_as_float(a), 16384.0f)) - (141u << 23);
  const uint32_t normal = (a - (120u << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;  // wraps only off this path
  const uint32_t code = a > 0x7F800000u ? 0x7Fu : a >= 0x43E00000u ? 0x7Eu : (a < (121u << 23) ? small : normal);
  return (code & 0xFFu) | sign;
}

// The 8-bit moment codes (codecs.encode_m8 / encode_v8).
// encode_m8, given inv = 127 * 2^15 / scale, finite or 0: round half to even (cvt.rni) of m * inv, plus the
// element's 15 dither bits, shifted down by 15 and clamped, as int8 bits; 0 where inv == 0 (x may be inf or
// NaN there, and x * 0 would not be 0).
__device__ __forceinline__ uint32_t encode_m8(float x, float inv, uint32_t index, uint32_t key) {
  const int32_t q = __float2int_rn(zk::cuda_adam::mul_rn(x, inv));
  const int32_t r = int32_t((index * 0x9E3779B1u + key) >> 17);
  const int32_t code = min(max((q + r) >> 15, -127), 127);
  return inv == 0.0f ? 0u : uint32_t(code) & 0xFFu;
}
// encode_v8, given k = 255 * 2^19 + 2^18 - bits(scale) (wrapping) for a finite scale: the log code of
// s = sqrt(v) >= 0 on its bits, max(int32(bits(s) + k) >> 19, 1), 0 where s == 0 (tested on the bits:
// no flush-to-zero compare); the caller writes 0 for a block whose scale is not finite.
__device__ __forceinline__ uint32_t encode_v8(float s, uint32_t k) {
  const uint32_t b = __float_as_uint(s);
  const int32_t code = max(int32_t(b + k) >> 19, 1);
  return (b & 0x7FFFFFFFu) == 0u ? 0u : uint32_t(code);
}

// split_remainder: fp32 bits -> (bf16 = round-to-nearest-even, int16 remainder with the tie 0x8000
// kept as 0x7FFF); a NaN master -> (0x7FC0, 0). join is (hi << 16) + sign-extended remainder (0 where
// negative under hi = +-0).
__device__ __forceinline__ void split_remainder(float p, uint32_t& hi, uint32_t& rem) {
  const uint32_t b = __float_as_uint(p);
  const uint32_t h = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const int32_t r = min(int32_t(b - (h << 16)), 0x7FFF);
  hi = p != p ? 0x7FC0u : h;
  rem = p != p ? 0u : uint32_t(r) & 0xFFFFu;
}

// Max over the warp (all 32 lanes active).
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xFFFFFFFFu, a);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
  return a;
#endif
}

// One lane's 8 elements of a moment, decoded to fp32. K: MomentKind; kSq: this is exp_avg_sq (for
// kMomU8: the log code of sqrt(v) of codecs.decode_v8, else the signed one of decode_m8). `q`: the
// quantization block (scale index).
template <int K, bool kSq>
__device__ __forceinline__ void load_moment(const void* ptr, const float* __restrict__ scales, int64_t e0,
                                            int64_t q, bool vec, int valid, float (&x)[kLaneElems]) {
  uint32_t raw[kLaneElems];
  if constexpr (K == kMomF32 || K == kMomBF16) {
    load8<std::conditional_t<K == kMomF32, uint32_t, uint16_t>>(
        static_cast<const char*>(ptr) + e0 * (K == kMomF32 ? 4 : 2), vec, valid, raw);
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) x[j] = __uint_as_float(K == kMomF32 ? raw[j] : raw[j] << 16);
  } else {
    load8<uint8_t>(static_cast<const uint8_t*>(ptr) + e0, vec, valid, raw);
    const float scale = scales[q];   // one address for the whole warp: one broadcast transaction
    if constexpr (K == kMomF8) {
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) x[j] = zk::cuda_adam::mul_rn(decode_f8(raw[j]), scale);
    } else if constexpr (kSq) {      // decode_v8: s = bits((code << 19) + bits(scale) - 255 * 2^19), v = s * s
      const uint32_t sb = __float_as_uint(scale);
      const bool finite = (sb & 0x7FFFFFFFu) < 0x7F800000u;   // else NaN everywhere
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) {
        const float sd = raw[j] == 0u ? 0.0f : __uint_as_float((raw[j] << 19) + sb - kV8Top);
        x[j] = finite ? zk::cuda_adam::mul_rn(sd, sd) : __uint_as_float(kCanonicalNaN);
      }
    } else {                         // decode_m8: m = int8(code) * (scale / 127)
      const float step = zk::cuda_adam::div_rn(scale, kM8Levels);
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j)
        x[j] = zk::cuda_adam::mul_rn(__int2float_rn(int32_t(int8_t(uint8_t(raw[j])))), step);
    }
  }
}

// Encode one lane's 8 updated elements and store them; blockwise formats also store the block's new
// scale (lane 0). Called by all 32 lanes of the warp (the absmax is a warp reduction). K, kSq: as for
// load_moment; for kMomU8 with kSq, x holds sqrt(v), what the code is taken of (see the kernel).
template <int K, bool kSq>
__device__ __forceinline__ void store_moment(const float (&x)[kLaneElems], void* ptr, float* __restrict__ scales,
                                             int64_t e0, int64_t q, bool vec, int valid, uint32_t index0,
                                             uint32_t key) {
  uint32_t raw[kLaneElems];
  if constexpr (K == kMomF32 || K == kMomBF16) {
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j)
      raw[j] = K == kMomF32 ? __float_as_uint(x[j]) : encode_bf16_sr(x[j], index0 + uint32_t(j), key);
    store8<std::conditional_t<K == kMomF32, uint32_t, uint16_t>>(
        static_cast<char*>(ptr) + e0 * (K == kMomF32 ? 4 : 2), vec, valid, raw);
  } else {
    uint32_t amax = 0;   // block_absmax on the bits; lanes past the end contribute 0
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) amax = max(amax, j < valid ? __float_as_uint(x[j]) & 0x7FFFFFFFu : 0u);
    const uint32_t block_max = warp_max_u32(amax);
    float scale;
    if constexpr (K == kMomF8) {     // codecs.encode_f8: scale = absmax / 448, code = e4m3fn(x / scale)
      scale = zk::cuda_adam::div_rn(__uint_as_float(block_max), kF8Max);
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) {
        const float y = scale == 0.0f ? 0.0f : zk::cuda_adam::div_rn(x[j], scale);
        raw[j] = encode_f8(y);
        if constexpr (kSq) raw[j] = (raw[j] == 0u && y != 0.0f) ? 1u : raw[j];   // codecs.encode_f8_v
      }
    } else {                         // codecs.encode_m8 / encode_v8; any NaN scale is the canonical one
      scale = __uint_as_float(block_max > 0x7F800000u ? kCanonicalNaN : block_max);
      if constexpr (kSq) {
        const uint32_t k = kV8Top + kV8Half - block_max;
        const bool finite = block_max < 0x7F800000u;
#pragma unroll
        for (int j = 0; j < kLaneElems; ++j) raw[j] = finite ? encode_v8(x[j], k) : 0u;
      } else {
        const float inv = zk::cuda_adam::div_rn(kM8InvLevels, scale);
        const float inv_or_0 = inv <= kFltMax ? inv : 0.0f;   // false for inf and NaN
#pragma unroll
        for (int j = 0; j < kLaneElems; ++j) raw[j] = encode_m8(x[j], inv_or_0, index0 + uint32_t(j), key);
      }
    }
    store8<uint8_t>(static_cast<uint8_t*>(ptr) + e0, vec, valid, raw);
    if ((threadIdx.x & 31u) == 0) scales[q] = scale;
  }
}

// kMasterKind: MasterKind. kM / kV: MomentKind of exp_avg / exp_avg_sq. Launched with kThreads threads
// and one block per kCodedChunk elements of each tensor (csrc/cuda_adam_coded.cu).
template <int kMasterKind, int kM, int kV>
__global__ void __launch_bounds__(kThreads, kCodedMinBlocksPerSM)
fused_adam_coded_kernel(const __grid_constant__ CodedTensorTable table,  // the launch's tensors, by value
                        const CodedScalars s) {                         // launch-wide scalars and pointers
  using zk::cuda_adam::Storage;
  // found_inf on the device and on its bits (no host sync; NaN and subnormals skip too).
  if (s.adam.found_inf != nullptr && (__float_as_uint(*s.adam.found_inf) & 0x7FFFFFFFu) != 0u) return;

  const int32_t b = int32_t(blockIdx.x);
  int t = 0;
  while (t + 1 < table.ntensors && b >= table.block_end[t]) ++t;
  const int64_t n = table.numel[t];
  const int64_t chunk = int64_t(b - (t == 0 ? 0 : table.block_end[t - 1])) * kCodedChunk;

  void* const master = table.ptr[kMaster][t];
  const void* const grad = table.ptr[kGrad][t];
  void* const m_ptr = table.ptr[kExpAvg][t];
  void* const v_ptr = table.ptr[kExpAvgSq][t];
  float* const m_scales = static_cast<float*>(table.ptr[kExpAvgScale][t]);
  float* const v_scales = static_cast<float*>(table.ptr[kExpAvgSqScale][t]);
  void* const p16 = table.ptr[kParam16][t];

  const int64_t row = table.row[t];
  const float* crow = s.adam.coeffs + row * 3;
  const Coef c{crow[0], crow[1], crow[2]};
  const uint32_t seed = uint32_t(s.keys[row * 3]), count = uint32_t(s.keys[row * 3 + 1]);
  const uint32_t m_key = sr_key(seed, count, 0u), v_key = sr_key(seed, count, 1u);
  const uint32_t index_offset = uint32_t(s.keys[row * 3 + 2]);
  const float gs = s.adam.has_grad_scale ? *s.adam.grad_scale : 1.f;
  const float gmul = s.adam.maximize ? zk::cuda_adam::neg(gs) : gs;   // as in fused_adam_kernel
  const int gdt = s.grad_dtype, pdt = s.p16_dtype;

  // May this tensor's whole blocks use vector accesses? (Per tensor, so uniform over the block.)
  bool aligned = (kMasterKind == kMasterF32 ? vec_aligned<float>(master) : vec_aligned<int16_t>(master)) &&
                 (gdt == kNone ? vec_aligned<float>(grad) : vec_aligned<uint16_t>(grad)) &&
                 (pdt == kNone || vec_aligned<uint16_t>(p16));
  aligned = aligned && (kM == kMomF32 ? vec_aligned<float>(m_ptr) : kM == kMomBF16 ? vec_aligned<uint16_t>(m_ptr)
                                                                                  : vec_aligned<uint8_t>(m_ptr));
  aligned = aligned && (kV == kMomF32 ? vec_aligned<float>(v_ptr) : kV == kMomBF16 ? vec_aligned<uint16_t>(v_ptr)
                                                                                  : vec_aligned<uint8_t>(v_ptr));
  const int lane = int(threadIdx.x & 31u);
  const int64_t q = chunk / kQBlock + int64_t(threadIdx.x >> 5);   // this warp's quantization block
  if (q * kQBlock >= n) return;   // warp-uniform: the block max below still sees all 32 lanes
  const int64_t e0 = q * kQBlock + lane * kLaneElems;  // this lane's first element
  const int64_t left = n - e0;
  const int valid = left >= kLaneElems ? kLaneElems : (left > 0 ? int(left) : 0);
  const bool vec = aligned && (q + 1) * kQBlock <= n;
  uint32_t raw[kLaneElems];
  float p[kLaneElems], g[kLaneElems], m[kLaneElems], v[kLaneElems];

  if constexpr (kMasterKind == kMasterRemainder) {   // join_remainder: (bf16 << 16) + int16
    uint32_t rem[kLaneElems];
    load8<uint16_t>(static_cast<const uint16_t*>(p16) + e0, vec, valid, raw);
    load8<uint16_t>(static_cast<const int16_t*>(master) + e0, vec, valid, rem);
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) {   // a negative rem under +-0 and a positive one under +-inf
      const int32_t r = int32_t(int16_t(rem[j]));   // count as 0 (codecs Note, 4)
      const uint32_t mag = raw[j] & 0x7FFFu;
      p[j] = __uint_as_float((raw[j] << 16) + uint32_t(mag == 0u ? max(r, 0) : mag == 0x7F80u ? min(r, 0) : r));
    }
  } else {
    load8<uint32_t>(static_cast<const float*>(master) + e0, vec, valid, raw);
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) p[j] = __uint_as_float(raw[j]);
  }
  if (gdt == kNone) {
    load8<uint32_t>(static_cast<const float*>(grad) + e0, vec, valid, raw);
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) g[j] = __uint_as_float(raw[j]);
  } else {
    load8<uint16_t>(static_cast<const uint16_t*>(grad) + e0, vec, valid, raw);
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j)
      g[j] = gdt == kBF16 ? __uint_as_float(raw[j] << 16) : __half2float(__ushort_as_half((unsigned short)raw[j]));
  }
  load_moment<kM, false>(m_ptr, m_scales, e0, q, vec, valid, m);
  load_moment<kV, true>(v_ptr, v_scales, e0, q, vec, valid, v);

#pragma unroll
  for (int j = 0; j < kLaneElems; ++j) {
    float unused = 0.f;
    const float root = zk::cuda_adam::adam_update<false, kM == kMomU8>(p[j], g[j], m[j], v[j], unused, c, gmul,
                                                                       s.adam);
    // A uint8 exp_avg_sq is coded from sqrt(v_new): from here on v holds the root the denominator took
    // (codecs.encode_v8: the same IEEE sqrt).
    if constexpr (kV == kMomU8) v[j] = root;
  }

  if constexpr (kMasterKind == kMasterRemainder) {
    uint32_t rem[kLaneElems];
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) split_remainder(p[j], raw[j], rem[j]);
    store8<uint16_t>(static_cast<uint16_t*>(p16) + e0, vec, valid, raw);
    store8<uint16_t>(static_cast<int16_t*>(master) + e0, vec, valid, rem);
  } else {
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) raw[j] = __float_as_uint(p[j]);
    store8<uint32_t>(static_cast<float*>(master) + e0, vec, valid, raw);
    if (pdt != kNone) {
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j)   // round to nearest even, as torch casts (Storage<>)
        raw[j] = pdt == kBF16 ? __bfloat16_as_ushort(Storage<__nv_bfloat16>::from_float(p[j]))
                              : __half_as_ushort(Storage<__half>::from_float(p[j]));
      store8<uint16_t>(static_cast<uint16_t*>(p16) + e0, vec, valid, raw);
    }
  }
  // The moments last: p is dead by then, which leaves registers for the 8-bit encodes.
  const uint32_t index0 = uint32_t(e0) + index_offset;   // flat index mod 2^32 of element e0
  store_moment<kM, false>(m, m_ptr, m_scales, e0, q, vec, valid, index0, m_key);
  store_moment<kV, true>(v, v_ptr, v_scales, e0, q, vec, valid, index0, v_key);
}

// Every (master, exp_avg, exp_avg_sq) layout, instantiated explicitly: by csrc/cuda_adam_coded.cu
// (see [Note: host-only torch code] in csrc/cuda_adam.cu) and by tests/test_nvcc.py.
#define ZK_CUDA_ADAM_CODED_INSTANTIATE_1(MK, M, V)                                                   \
  template __global__ void zk::cuda_adam_coded::fused_adam_coded_kernel<MK, M, V>(                   \
      const __grid_constant__ zk::cuda_adam_coded::CodedTensorTable, const zk::cuda_adam_coded::CodedScalars);
#define ZK_CUDA_ADAM_CODED_INSTANTIATE_2(MK, M)                                            \
  ZK_CUDA_ADAM_CODED_INSTANTIATE_1(MK, M, 0) ZK_CUDA_ADAM_CODED_INSTANTIATE_1(MK, M, 1) \
  ZK_CUDA_ADAM_CODED_INSTANTIATE_1(MK, M, 2) ZK_CUDA_ADAM_CODED_INSTANTIATE_1(MK, M, 3)
#define ZK_CUDA_ADAM_CODED_INSTANTIATE_3(MK)                                  \
  ZK_CUDA_ADAM_CODED_INSTANTIATE_2(MK, 0) ZK_CUDA_ADAM_CODED_INSTANTIATE_2(MK, 1) \
  ZK_CUDA_ADAM_CODED_INSTANTIATE_2(MK, 2) ZK_CUDA_ADAM_CODED_INSTANTIATE_2(MK, 3)
#define ZK_CUDA_ADAM_CODED_INSTANTIATE_ALL() \
  ZK_CUDA_ADAM_CODED_INSTANTIATE_3(0) ZK_CUDA_ADAM_CODED_INSTANTIATE_3(1)

}  // namespace cuda_adam_coded
}  // namespace zk
