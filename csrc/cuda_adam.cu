// The "cuda" backend of the fused-Adam contract ([Note: the fused-Adam contract] in
// zero_kernels/reference.py): host launcher of the multi-tensor kernel in cuda_adam_kernel.cuh.
//
// Arguments were checked once by the front end (check_fused_adam_args in csrc/adam_front.cpp):
// T tensors per list, contiguous, fp32 states, one CUDA device, coeffs fp32 [T, 3] on it,
// grad_scale / found_inf 1-element fp32 on it. This file only groups, packs and launches.
//
// Headers: only ATen and c10/cuda (no ATen/cuda/CUDAContext.h, which pulls cuBLAS/cuSPARSE
// headers): see [Note: why the kernel lives in a torch-free header] in cuda_adam_kernel.cuh.
//
// [Note: host-only torch code]
// nvcc compiles a .cu once for the host and once per device architecture. Parsing ATen dominates
// each pass (~40 s of cicc per architecture here, against ~2 s for the kernels themselves), and
// only the host pass needs it. So everything that touches torch sits under #ifndef __CUDA_ARCH__,
// and the kernels are instantiated explicitly, outside that guard, so that host and device passes
// see the same set of __global__ instantiations (the CUDA Programming Guide's rule for
// __CUDA_ARCH__ and kernel templates). The build and tests/test_nvcc.py get both passes' checks
// for about a third of the time.
#include "cuda_adam_kernel.cuh"

// All 18 (gradient, 16-bit parameter, amsgrad) kernels, in every compilation pass.
ZK_CUDA_ADAM_INSTANTIATE_ALL()

#ifndef __CUDA_ARCH__

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#ifndef ZK_WITH_CUDA
#define ZK_WITH_CUDA 1  // this translation unit is the CUDA build: see the declaration
#endif
#include "fused_adam.h"

namespace {

using namespace zk::cuda_adam;

template <typename T>
struct Tag {
  using type = T;
};

// Storage type of a gradient / 16-bit parameter dtype, as a tag passed to a generic lambda: one
// switch per role instead of one copy of the launch per dtype combination.
template <typename F>
void dispatch_grad(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kFloat: return f(Tag<float>{});
    case at::kBFloat16: return f(Tag<__nv_bfloat16>{});
    case at::kHalf: return f(Tag<__half>{});
    default: TORCH_CHECK(false, "fused_adam_cuda: unsupported gradient dtype ", st);
  }
}

template <typename F>
void dispatch_p16(bool present, at::ScalarType st, F&& f) {
  if (!present) return f(Tag<NoParam16>{});
  switch (st) {
    case at::kBFloat16: return f(Tag<__nv_bfloat16>{});
    case at::kHalf: return f(Tag<__half>{});
    default: TORCH_CHECK(false, "fused_adam_cuda: 16-bit parameter copies must be bf16 or fp16, got ", st);
  }
}

template <typename F>
void dispatch_bool(bool b, F&& f) {
  if (b) return f(std::true_type{});
  return f(std::false_type{});
}

// Launch the kernel over tensors `idx` (all with the same grad / p16 dtype), kMaxTensors per
// launch; a launch is also cut before its grid would overflow int32 (never in practice: that is
// 2^31 x 8192 elements).
template <typename G, typename P16, bool kAmsgrad>
void launch_group(const std::vector<int64_t>& idx, const std::vector<at::Tensor>& masters,
                  const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& exp_avgs,
                  const std::vector<at::Tensor>& exp_avg_sqs,
                  const std::vector<at::Tensor>& max_exp_avg_sqs,
                  const std::vector<at::Tensor>& params16, const AdamScalars& scalars,
                  cudaStream_t stream) {
  AdamTensorTable table{};
  int64_t blocks = 0;
  auto flush = [&]() {
    if (table.ntensors == 0) return;
    fused_adam_kernel<G, P16, kAmsgrad>
        <<<dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, stream>>>(table, scalars);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    table = AdamTensorTable{};
    blocks = 0;
  };
  for (int64_t i : idx) {
    const int64_t n = masters[i].numel();
    if (n == 0) continue;
    const int64_t nblocks = (n + kChunk - 1) / kChunk;
    TORCH_CHECK(nblocks <= INT32_MAX, "fused_adam_cuda: tensor ", i, " is too large (", n, " elements)");
    if (table.ntensors == kMaxTensors || blocks + nblocks > INT32_MAX) flush();
    const int k = table.ntensors++;
    table.numel[k] = n;
    table.coeff_row[k] = static_cast<int32_t>(i);
    blocks += nblocks;
    table.block_end[k] = static_cast<int32_t>(blocks);
    table.ptr[kMaster][k] = masters[i].data_ptr();
    table.ptr[kGrad][k] = grads[i].data_ptr();
    table.ptr[kExpAvg][k] = exp_avgs[i].data_ptr();
    table.ptr[kExpAvgSq][k] = exp_avg_sqs[i].data_ptr();
    table.ptr[kMaxExpAvgSq][k] = kAmsgrad ? max_exp_avg_sqs[i].data_ptr() : nullptr;
    table.ptr[kParam16][k] = params16.empty() ? nullptr : params16[i].data_ptr();
  }
  flush();
}

}  // namespace

void fused_adam_cuda_launch(ZK_FUSED_ADAM_ARGS) {
  const int64_t T = static_cast<int64_t>(masters.size());
  if (T == 0) return;
  TORCH_CHECK(coeffs.is_cuda() && coeffs.scalar_type() == at::kFloat && coeffs.is_contiguous() &&
                  coeffs.numel() == 3 * T,
              "fused_adam_cuda: coeffs must be a contiguous fp32 CUDA tensor of shape [T, 3]");
  const c10::cuda::CUDAGuard guard(masters[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(masters[0].device().index()).stream();

  AdamScalars s{};
  s.coeffs = coeffs.data_ptr<float>();
  s.grad_scale = grad_scale.has_value() ? grad_scale->data_ptr<float>() : nullptr;
  s.found_inf = found_inf.has_value() ? found_inf->data_ptr<float>() : nullptr;
  // Cast from double exactly as torch casts the reference's Python-float operands.
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.weight_decay = static_cast<float>(weight_decay);
  s.l2 = !adamw && weight_decay != 0.0;
  s.adamw = adamw;
  s.maximize = maximize;
  s.has_grad_scale = grad_scale.has_value();

  // One launch (per kMaxTensors) for each (grad dtype, param16 dtype) present. The front end
  // requires a single dtype per list, so this is one group; grouping keeps the launcher correct
  // if that rule is ever relaxed.
  const bool has_p16 = !params16.empty();
  const bool amsgrad = !max_exp_avg_sqs.empty();
  std::map<std::pair<int, int>, std::vector<int64_t>> groups;
  for (int64_t i = 0; i < T; ++i) {
    const int p16 = has_p16 ? static_cast<int>(params16[i].scalar_type()) : -1;
    groups[{static_cast<int>(grads[i].scalar_type()), p16}].push_back(i);
  }
  for (const auto& [key, idx] : groups) {
    const at::ScalarType p16_type = has_p16 ? params16[idx[0]].scalar_type() : at::kBFloat16;
    dispatch_grad(grads[idx[0]].scalar_type(), [&](auto g_tag) {
      dispatch_p16(has_p16, p16_type, [&](auto p_tag) {
        dispatch_bool(amsgrad, [&](auto ams) {
          using G = typename decltype(g_tag)::type;
          using P16 = typename decltype(p_tag)::type;
          launch_group<G, P16, decltype(ams)::value>(idx, masters, grads, exp_avgs, exp_avg_sqs,
                                                     max_exp_avg_sqs, params16, s, stream);
        });
      });
    });
  }
}

#endif  // !__CUDA_ARCH__
