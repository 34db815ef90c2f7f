// The "cuda" backend of coded-state Adam (issue 11; [Note: state codecs] in zero_kernels/codecs.py):
// host launcher of the multi-tensor kernel in cuda_adam_coded_kernel.cuh ([Note: the coded CUDA kernel]).
//
// Arguments were checked once by the front end (check_coded_adam_args in csrc/adam_front.cpp; the
// contract is the comment above ZK_CODED_ADAM_ARGS in fused_adam.h): T tensors of ONE layout, all
// contiguous on one CUDA device, with coeffs [T, 3], keys [T, 3], grad_scale and found_inf on that
// device (the 8-bit moment codes are arithmetic: no code book travels with them). This file only picks
// the kernel for the layout, packs and launches, on the current stream, without a host sync. Torch
// stays out of the device passes: [Note: host-only torch code] in csrc/cuda_adam.cu.
#include "cuda_adam_coded_kernel.cuh"

// All 32 (master, exp_avg, exp_avg_sq) kernels, in every compilation pass.
ZK_CUDA_ADAM_CODED_INSTANTIATE_ALL()

#ifndef __CUDA_ARCH__

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>
#include <cmath>
#include <limits>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifndef ZK_WITH_CUDA
#define ZK_WITH_CUDA 1  // this translation unit is the CUDA build: see the declaration
#endif
#include "fused_adam.h"

namespace {

using namespace zk::cuda_adam_coded;

int moment_kind(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return kMomF32;
    case at::kBFloat16: return kMomBF16;
    case at::kByte: return kMomU8;
    case at::kFloat8_e4m3fn: return kMomF8;
    default: TORCH_CHECK(false, "fused_adam_coded_cuda: unsupported moment dtype ", st);
  }
}

int dtype16(at::ScalarType st, bool fp32_ok, const char* what) {
  switch (st) {
    case at::kFloat: TORCH_CHECK(fp32_ok, "fused_adam_coded_cuda: ", what, " cannot be fp32"); return kNone;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, "fused_adam_coded_cuda: unsupported ", what, " dtype ", st);
  }
}

// Compile-time value of a runtime int in [0, N): f(std::integral_constant<int, k>{}).
template <int N, typename F>
void dispatch_int(int k, F&& f) {
  if constexpr (N > 0) {
    if (k == N - 1) return f(std::integral_constant<int, N - 1>{});
    return dispatch_int<N - 1>(k, std::forward<F>(f));
  } else {
    TORCH_CHECK(false, "fused_adam_coded_cuda: layout index out of range");
  }
}

void* ptr_or_null(const std::vector<at::Tensor>& v, size_t i) {   // optional lists are empty when absent
  return v.empty() ? nullptr : v[i].data_ptr();
}

// One launch per kCodedMaxTensors tensors (or before the grid would overflow int32: 2^31 blocks of
// 2048 elements, never in practice).
template <int kMasterKind, int kM, int kV>
void launch_all(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                const std::vector<at::Tensor>& exp_avg_scales, const std::vector<at::Tensor>& exp_avg_sq_scales,
                const std::vector<at::Tensor>& params16, const CodedScalars& s, cudaStream_t stream) {
  CodedTensorTable table{};
  int64_t blocks = 0;
  auto flush = [&]() {
    if (table.ntensors == 0) return;
    fused_adam_coded_kernel<kMasterKind, kM, kV>
        <<<dim3(static_cast<unsigned>(blocks)), dim3(zk::cuda_adam::kThreads), 0, stream>>>(table, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    table = CodedTensorTable{};
    blocks = 0;
  };
  for (size_t i = 0; i < masters.size(); ++i) {
    const int64_t n = masters[i].numel();
    if (n == 0) continue;
    const int64_t nblocks = (n + kCodedChunk - 1) / kCodedChunk;
    TORCH_CHECK(nblocks <= INT32_MAX, "fused_adam_coded_cuda: tensor ", i, " is too large (", n, " elements)");
    if (table.ntensors == kCodedMaxTensors || blocks + nblocks > INT32_MAX) flush();
    const int k = table.ntensors++;
    table.numel[k] = n;
    table.row[k] = static_cast<int32_t>(i);
    blocks += nblocks;
    table.block_end[k] = static_cast<int32_t>(blocks);
    table.ptr[kMaster][k] = masters[i].data_ptr();
    table.ptr[kGrad][k] = grads[i].data_ptr();
    table.ptr[kExpAvg][k] = exp_avgs[i].data_ptr();
    table.ptr[kExpAvgSq][k] = exp_avg_sqs[i].data_ptr();
    table.ptr[kExpAvgScale][k] = ptr_or_null(exp_avg_scales, i);
    table.ptr[kExpAvgSqScale][k] = ptr_or_null(exp_avg_sq_scales, i);
    table.ptr[kParam16][k] = ptr_or_null(params16, i);
  }
  flush();
}

}  // namespace

void fused_adam_coded_cuda_launch(ZK_CODED_ADAM_ARGS) {
  const size_t T = masters.size();
  if (T == 0) return;
  // The layout of tensor 0 picks the kernel: the front end checked that every tensor shares it, that
  // remainders come with bf16 params16, blockwise moments with their scales, and coeffs / keys.
  const bool remainder = masters[0].scalar_type() == at::kShort;
  const int m_kind = moment_kind(exp_avgs[0].scalar_type()), v_kind = moment_kind(exp_avg_sqs[0].scalar_type());
  const c10::cuda::CUDAGuard guard(masters[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(masters[0].device().index()).stream();

  CodedScalars s{};
  zk::cuda_adam::AdamScalars& a = s.adam;
  a.coeffs = coeffs.data_ptr<float>();
  a.grad_scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  a.found_inf = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  // Cast from double exactly as torch casts the reference's Python-float operands (cuda_adam.cu).
  a.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  a.beta2 = static_cast<float>(beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  // reference.m_bound, the same double operations ([Note: the bound on 8-bit m] in zero_kernels/codecs.py)
  a.m_bound = (0.0 <= beta1 && beta1 * beta1 < beta2 && beta2 < 1.0)
                  ? static_cast<float>((1.0 - beta1) / std::sqrt((1.0 - beta2) * (1.0 - beta1 * beta1 / beta2)))
                  : std::numeric_limits<float>::infinity();
  a.l2 = !adamw && weight_decay != 0.0;
  a.adamw = adamw;
  a.maximize = maximize;
  a.has_grad_scale = grad_scale.has_value();
  s.keys = keys.data_ptr<int64_t>();
  s.grad_dtype = dtype16(grads[0].scalar_type(), true, "gradient");
  s.p16_dtype = params16.empty() ? kNone : dtype16(params16[0].scalar_type(), false, "16-bit parameter");

  dispatch_int<2>(remainder ? kMasterRemainder : kMasterF32, [&](auto mk) {
    dispatch_int<4>(m_kind, [&](auto mm) {
      dispatch_int<4>(v_kind, [&](auto vv) {
        launch_all<decltype(mk)::value, decltype(mm)::value, decltype(vv)::value>(
            masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, params16, s, stream);
      });
    });
  });
}

#endif  // !__CUDA_ARCH__
