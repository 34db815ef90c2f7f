// Declarations shared by the C++ front end (csrc/adam_front.cpp), the CPU kernel
// (csrc/cpu_adam.cpp) and the CUDA kernel (csrc/cuda_adam.cu).
//
// The contract is [Note: the fused-Adam contract] in zero_kernels/reference.py.
//
// All argument checking (dtypes, contiguity, sizes, devices, list lengths) happens ONCE in the
// front end (check_fused_adam_args); the *_launch functions below assume checked arguments:
//   - masters, grads, exp_avgs, exp_avg_sqs: T tensors each, contiguous, same numel per index.
//   - masters / exp_avgs / exp_avg_sqs / max_exp_avg_sqs: fp32.
//   - grads: all fp32, all bf16 or all fp16.
//   - max_exp_avg_sqs: empty (no amsgrad) or T fp32 tensors.
//   - params16: empty (no 16-bit copy) or T tensors, all bf16 or all fp16.
//   - coeffs: fp32 [T, 3] contiguous (step_size, bc2_sqrt, decay), on the tensors' device.
//   - grad_scale / found_inf: absent or 1-element fp32 on the tensors' device.
//   - every tensor on the same device (CPU for the cpu launch, one CUDA device for the cuda one).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#define ZK_FUSED_ADAM_ARGS                                                                   \
  const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& grads,             \
      const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,  \
      const std::vector<at::Tensor>& max_exp_avg_sqs,                                        \
      const std::vector<at::Tensor>& params16, const at::Tensor& coeffs, double beta1,       \
      double beta2, double eps, double weight_decay, bool adamw, bool maximize,              \
      const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf

// Argument checks (front end). Throws c10::Error (RuntimeError in Python) with a message.
void check_fused_adam_args(ZK_FUSED_ADAM_ARGS, c10::DeviceType device_type, const char* fn_name);

// CPU kernel (csrc/cpu_adam.cpp). Arguments already checked.
void fused_adam_cpu_launch(ZK_FUSED_ADAM_ARGS);

#ifdef ZK_WITH_CUDA
// CUDA kernel (csrc/cuda_adam.cu). Arguments already checked (all tensors on one CUDA device);
// launch on the current stream of that device. found_inf / grad_scale stay on the device.
void fused_adam_cuda_launch(ZK_FUSED_ADAM_ARGS);
#endif

// Coded-state Adam (issue 11): [Note: state codecs] in zero_kernels/codecs.py; the reference is
// codecs.adam_step_coded, the Triton twin kernels/adam_coded.py. Decode -> the fp32 update of the
// fused-Adam contract -> encode, in one pass. One call holds tensors of ONE layout (the Python
// launcher groups them, as the Triton launcher does); checked by check_coded_adam_args:
//   - masters: T fp32 (fp32 master or fp32 parameter), or T int16 remainders (then params16 are
//     T bf16 parameters whose bits are the master's high half).
//   - grads: T fp32 | bf16 | fp16, one dtype.            - params16: empty or T bf16 | fp16.
//   - exp_avgs / exp_avg_sqs: T tensors of one dtype each: fp32 | bf16 (stochastic rounding) |
//     uint8 (8-bit blockwise: int8 codes of m, sqrt-domain codes of v) | float8_e4m3fn; exp_avg_scales / exp_avg_sq_scales: T fp32 tensors of
//     ceil(numel / 256) block scales when that moment is uint8 / float8_e4m3fn, else empty.
//   - coeffs: fp32 [T, 3] (step_size, bc2_sqrt, decay); keys: int64 [T, 3] (seed, step count, flat index
//     of element 0 for the SR bits): the kernel derives the SR key of exp_avg / exp_avg_sq as
//     sr_key(seed, step, 0 / 1) = fmix32(seed ^ fmix32(2 * step + stream)), all mod 2^32 (codecs.sr_key).
//   - grad_scale / found_inf as in the plain kernel. Blocks of 256 count from each tensor's element 0.
#define ZK_CODED_ADAM_ARGS                                                                      \
  const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& grads,                \
      const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,     \
      const std::vector<at::Tensor>& exp_avg_scales,                                            \
      const std::vector<at::Tensor>& exp_avg_sq_scales,                                         \
      const std::vector<at::Tensor>& params16, const at::Tensor& coeffs, const at::Tensor& keys, \
      double beta1, double beta2, double eps, double weight_decay,                              \
      bool adamw, bool maximize, const std::optional<at::Tensor>& grad_scale,                   \
      const std::optional<at::Tensor>& found_inf

void check_coded_adam_args(ZK_CODED_ADAM_ARGS, c10::DeviceType device_type, const char* fn_name);
void fused_adam_coded_cpu_launch(ZK_CODED_ADAM_ARGS);      // csrc/cpu_adam_coded.cpp
#ifdef ZK_WITH_CUDA
void fused_adam_coded_cuda_launch(ZK_CODED_ADAM_ARGS);     // csrc/cuda_adam_coded.cu
#endif

// ZeRO++ int8 wire codec (csrc/cpu_quant.cpp): codecs.encode_q8 / decode_q8 bit for bit, blocks of
// 256 from element 0. Checked by the front end (q8_encode_cpu / q8_decode_cpu):
//   encode: x contiguous fp32 | bf16 | fp16 [n]; mid fp32 [255] (the code book's midpoints);
//           codes uint8 [n] and scales fp32 [ceil(n / 256)] contiguous, written.
//   decode: codes uint8 [n], scales fp32 [ceil(n / 256)], table fp32 [256]; out fp32 [n] contiguous:
//           out = table[code] * scale, or out += it with accumulate.
//   Every tensor on the CPU.
void q8_encode_cpu_launch(const at::Tensor& x, const at::Tensor& mid, at::Tensor& codes, at::Tensor& scales);
void q8_decode_cpu_launch(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& table,
                          at::Tensor& out, bool accumulate);

// CPU helpers (csrc/cpu_adam.cpp).
// Which SIMD path the CPU kernel uses: "avx512", "avx2" or "scalar" (see zk_cpu_isa()).
const char* zk_cpu_isa();
// Bucket flatten / unflatten (csrc/cpu_flatten.cpp), arguments checked by the front end:
//   flatten:   dst[off_i : off_i + n_i] = cast(float(srcs[i]) * scale)   (dst flat fp32/bf16/fp16)
//   unflatten: dsts[i] = cast(src[off_i : off_i + n_i])
void flatten_cpu_launch(const std::vector<at::Tensor>& srcs, const at::Tensor& dst,
                        const std::vector<int64_t>& offsets, double scale);
void unflatten_cpu_launch(const at::Tensor& src, const std::vector<at::Tensor>& dsts,
                          const std::vector<int64_t>& offsets);
// Non-temporal stores for the 16-bit copy (nt16) and the in-place fp32 outputs (nt32); a tuning
// knob for benchmarks (defaults chosen by measurement, see cpu_adam.cpp).
void zk_set_cpu_nt(bool nt16, bool nt32);
// Streaming ceiling: in place, a += d; b += d; c += d over fp32 contiguous arrays of one numel
// (reads 4 arrays, writes 3 back: Adam's access mix), same SIMD dispatch and thread pool.
void stream_ceiling_cpu(at::Tensor& a, at::Tensor& b, at::Tensor& c, const at::Tensor& d);
// Gather cache (csrc/block_cache.cpp, [Note: the gather cache]): a 1-D CPU tensor of `numel`
// elements whose resizable storage allocates from a process-wide block cache.
at::Tensor zk_cached_empty(int64_t numel, at::ScalarType dtype);
void zk_cache_set_limit(int64_t bytes);   // bytes of freed blocks kept for reuse (trims now)
void zk_cache_empty();                    // return every cached block to the system
std::map<std::string, int64_t> zk_cache_stats();
