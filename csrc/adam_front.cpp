// C++ front end of zero_kernels._C: every argument check (TORCH_CHECK with a message) and the
// pybind11 module definition. Kernels (csrc/cpu_adam.cpp, csrc/cuda_adam.cu) trust their inputs.
//
// Python-visible:
//   fused_adam_cpu(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs,
//                  beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf)
//   fused_adam_cuda(... same ...)            only when built with CUDA (ZK_WITH_CUDA)
//   fused_adam_coded_cpu(masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales,
//                        params16, coeffs, keys, beta1, beta2, eps, weight_decay, adamw, maximize,
//                        grad_scale, found_inf)
//                                            coded states (csrc/fused_adam.h ZK_CODED_ADAM_ARGS)
//   fused_adam_coded_cuda(... same ...)      only when built with CUDA
//   stream_ceiling(a, b, c, d)               a += d; b += d; c += d  (bandwidth ceiling)
//   flatten_cpu(srcs, dst, offsets, scale=1.0) / unflatten_cpu(src, dsts, offsets)
//                                            bucket copies, see csrc/cpu_flatten.cpp
//   q8_encode_cpu(x, mid, codes, scales) / q8_decode_cpu(codes, scales, table, out, accumulate)
//                                            the ZeRO++ int8 wire codec, see csrc/cpu_quant.cpp
//   set_cpu_nt(nt16, nt32)                   tuning knob: non-temporal stores
//   cpu_isa()                                "avx512" | "avx2" | "scalar"
// Empty lists stand for None (max_exp_avg_sqs without amsgrad, params16 without a 16-bit copy).

#include "fused_adam.h"

#include <torch/extension.h>

#include <string>

namespace {

const char* dev_name(c10::DeviceType t) { return t == c10::DeviceType::CPU ? "CPU" : "CUDA"; }

void check_list(const std::vector<at::Tensor>& ts, const char* what, int64_t T,
                const std::vector<at::Tensor>& masters, c10::DeviceType dt,
                const c10::Device& dev0, const char* fn) {
  TORCH_CHECK(static_cast<int64_t>(ts.size()) == T, fn, ": ", what, " has ", ts.size(),
              " tensors but masters has ", T, " (one per parameter)");
  for (int64_t i = 0; i < T; ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK(t.defined(), fn, ": ", what, "[", i, "] is undefined");
    TORCH_CHECK(t.device().type() == dt, fn, ": ", what, "[", i, "] is on ", t.device(),
                "; this kernel needs ", dev_name(dt), " tensors");
    TORCH_CHECK(t.device() == dev0, fn, ": ", what, "[", i, "] is on ", t.device(),
                " but masters[0] is on ", dev0, "; all tensors must be on one device");
    TORCH_CHECK(t.is_contiguous(), fn, ": ", what, "[", i,
                "] is not contiguous (strides ", t.strides(),
                "); pass contiguous tensors (e.g. .contiguous(), then copy the result back)");
    TORCH_CHECK(t.numel() == masters[i].numel(), fn, ": ", what, "[", i, "] has ", t.numel(),
                " elements but masters[", i, "] has ", masters[i].numel());
  }
}

void check_dtype(const std::vector<at::Tensor>& ts, const char* what, at::ScalarType want,
                 const char* fn) {
  for (size_t i = 0; i < ts.size(); ++i)
    TORCH_CHECK(ts[i].scalar_type() == want, fn, ": ", what, "[", i, "] has dtype ",
                ts[i].scalar_type(), "; expected ", want);
}

void check_scalar(const std::optional<at::Tensor>& t, const char* what, c10::DeviceType dt,
                  const c10::Device& dev0, const char* fn) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->defined(), fn, ": ", what, " is an undefined tensor (pass None instead)");
  TORCH_CHECK(t->numel() == 1, fn, ": ", what, " must have exactly 1 element, got ", t->numel());
  TORCH_CHECK(t->scalar_type() == at::kFloat, fn, ": ", what, " must be float32, got ",
              t->scalar_type());
  TORCH_CHECK(t->device().type() == dt && (dt == c10::DeviceType::CPU || t->device() == dev0), fn,
              ": ", what, " is on ", t->device(), " but the tensors are on ", dev0);
}

}  // namespace

void check_fused_adam_args(ZK_FUSED_ADAM_ARGS, c10::DeviceType dt, const char* fn) {
  const int64_t T = static_cast<int64_t>(masters.size());
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, fn, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, fn, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, fn, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(coeffs.defined(), fn, ": coeffs is undefined");
  TORCH_CHECK(coeffs.scalar_type() == at::kFloat, fn, ": coeffs must be float32 [T, 3], got ",
              coeffs.scalar_type());
  TORCH_CHECK(coeffs.dim() == 2 && coeffs.size(0) == T && coeffs.size(1) == 3, fn,
              ": coeffs must have shape [T, 3] = [", T, ", 3] (step_size, bc2_sqrt, decay), got ",
              coeffs.sizes());
  TORCH_CHECK(coeffs.is_contiguous(), fn, ": coeffs must be contiguous");
  if (T == 0) {
    TORCH_CHECK(grads.empty() && exp_avgs.empty() && exp_avg_sqs.empty() &&
                    max_exp_avg_sqs.empty() && params16.empty(),
                fn, ": masters is empty but the other lists are not");
    return;
  }
  TORCH_CHECK(masters[0].defined(), fn, ": masters[0] is undefined");
  const c10::Device dev0 = masters[0].device();
  TORCH_CHECK(coeffs.device().type() == dt && (dt == c10::DeviceType::CPU || coeffs.device() == dev0),
              fn, ": coeffs is on ", coeffs.device(), " but the tensors are on ", dev0);
  check_list(masters, "masters", T, masters, dt, dev0, fn);
  check_list(grads, "grads", T, masters, dt, dev0, fn);
  check_list(exp_avgs, "exp_avgs", T, masters, dt, dev0, fn);
  check_list(exp_avg_sqs, "exp_avg_sqs", T, masters, dt, dev0, fn);
  if (!max_exp_avg_sqs.empty())
    check_list(max_exp_avg_sqs, "max_exp_avg_sqs", T, masters, dt, dev0, fn);
  if (!params16.empty()) check_list(params16, "params16", T, masters, dt, dev0, fn);

  check_dtype(masters, "masters", at::kFloat, fn);
  check_dtype(exp_avgs, "exp_avgs", at::kFloat, fn);
  check_dtype(exp_avg_sqs, "exp_avg_sqs", at::kFloat, fn);
  check_dtype(max_exp_avg_sqs, "max_exp_avg_sqs", at::kFloat, fn);
  const at::ScalarType gt = grads[0].scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf, fn,
              ": grads must be float32, bfloat16 or float16, got ", gt);
  check_dtype(grads, "grads", gt, fn);  // one dtype per call (one call per dtype group)
  if (!params16.empty()) {
    const at::ScalarType pt = params16[0].scalar_type();
    TORCH_CHECK(pt == at::kBFloat16 || pt == at::kHalf, fn,
                ": params16 must be bfloat16 or float16, got ", pt);
    check_dtype(params16, "params16", pt, fn);
  }
  check_scalar(grad_scale, "grad_scale", dt, dev0, fn);
  check_scalar(found_inf, "found_inf", dt, dev0, fn);
}


namespace {

bool is_moment_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kByte || t == at::kFloat8_e4m3fn;
}

// A moment list (exp_avgs / exp_avg_sqs) of one stored dtype and its block scales.
void check_moment(const std::vector<at::Tensor>& ts, const char* what,
                  const std::vector<at::Tensor>& scales, const char* scales_what, int64_t T,
                  const std::vector<at::Tensor>& masters, c10::DeviceType dt, const c10::Device& dev0,
                  const char* fn) {
  check_list(ts, what, T, masters, dt, dev0, fn);
  const at::ScalarType kt = ts[0].scalar_type();
  TORCH_CHECK(is_moment_dtype(kt), fn, ": ", what,
              " must be float32, bfloat16, uint8 (code book) or float8_e4m3fn, got ", kt);
  check_dtype(ts, what, kt, fn);  // one stored format per call (one call per layout group)
  const bool blockwise = kt == at::kByte || kt == at::kFloat8_e4m3fn;
  if (!blockwise) {
    TORCH_CHECK(scales.empty(), fn, ": ", scales_what, " must be empty: ", what, " are ", kt,
                " (only uint8 / float8_e4m3fn moments have block scales)");
    return;
  }
  TORCH_CHECK(static_cast<int64_t>(scales.size()) == T, fn, ": ", what, " are ", kt, " codes, so ",
              scales_what, " needs one fp32 scale tensor per parameter (", T, "), got ", scales.size());
  for (int64_t i = 0; i < T; ++i) {
    const at::Tensor& s = scales[i];
    const int64_t want = (masters[i].numel() + 255) / 256;
    TORCH_CHECK(s.defined() && s.device() == dev0, fn, ": ", scales_what, "[", i,
                "] must be a tensor on ", dev0);
    TORCH_CHECK(s.scalar_type() == at::kFloat, fn, ": ", scales_what, "[", i, "] has dtype ",
                s.scalar_type(), "; expected float32");
    TORCH_CHECK(s.is_contiguous(), fn, ": ", scales_what, "[", i, "] is not contiguous");
    TORCH_CHECK(s.numel() == want, fn, ": ", scales_what, "[", i, "] has ", s.numel(),
                " scales but masters[", i, "] has ", masters[i].numel(),
                " elements: one scale per 256-element block, ceil(numel / 256) = ", want);
  }
}

}  // namespace

void check_coded_adam_args(ZK_CODED_ADAM_ARGS, c10::DeviceType dt, const char* fn) {
  const int64_t T = static_cast<int64_t>(masters.size());
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, fn, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, fn, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, fn, ": eps must be >= 0, got ", eps);
  TORCH_CHECK(coeffs.defined() && coeffs.scalar_type() == at::kFloat && coeffs.dim() == 2 &&
                  coeffs.size(0) == T && coeffs.size(1) == 3 && coeffs.is_contiguous(),
              fn, ": coeffs must be a contiguous float32 tensor of shape [T, 3] = [", T,
              ", 3] (step_size, bc2_sqrt, decay)");
  TORCH_CHECK(keys.defined() && keys.scalar_type() == at::kLong && keys.dim() == 2 &&
                  keys.size(0) == T && keys.size(1) == 3 && keys.is_contiguous(),
              fn, ": keys must be a contiguous int64 tensor of shape [T, 3] = [", T,
              ", 3] (seed, step count, flat index of element 0)");
  if (T == 0) {
    TORCH_CHECK(grads.empty() && exp_avgs.empty() && exp_avg_sqs.empty() && exp_avg_scales.empty() &&
                    exp_avg_sq_scales.empty() && params16.empty(),
                fn, ": masters is empty but the other lists are not");
    return;
  }
  TORCH_CHECK(masters[0].defined(), fn, ": masters[0] is undefined");
  const c10::Device dev0 = masters[0].device();
  for (const auto* t : {&coeffs, &keys})
    TORCH_CHECK(t->device().type() == dt && (dt == c10::DeviceType::CPU || t->device() == dev0), fn,
                ": ", (t == &coeffs ? "coeffs" : "keys"), " is on ", t->device(),
                " but the tensors are on ", dev0);
  check_list(masters, "masters", T, masters, dt, dev0, fn);
  check_list(grads, "grads", T, masters, dt, dev0, fn);
  const at::ScalarType mt = masters[0].scalar_type();
  TORCH_CHECK(mt == at::kFloat || mt == at::kShort, fn,
              ": masters must be float32 (master or fp32 parameter) or int16 (remainders), got ", mt);
  check_dtype(masters, "masters", mt, fn);
  const at::ScalarType gt = grads[0].scalar_type();
  TORCH_CHECK(gt == at::kFloat || gt == at::kBFloat16 || gt == at::kHalf, fn,
              ": grads must be float32, bfloat16 or float16, got ", gt);
  check_dtype(grads, "grads", gt, fn);
  if (mt == at::kShort) {
    TORCH_CHECK(!params16.empty(), fn, ": masters are int16 remainders, so params16 must hold the T "
                "bf16 parameters whose bits are the masters' high halves; got an empty list");
  }
  if (!params16.empty()) {
    check_list(params16, "params16", T, masters, dt, dev0, fn);
    const at::ScalarType pt = params16[0].scalar_type();
    TORCH_CHECK(pt == at::kBFloat16 || (pt == at::kHalf && mt == at::kFloat), fn, ": params16 must be ",
                mt == at::kShort ? "bfloat16 (remainders complete bf16 parameters)" : "bfloat16 or float16",
                ", got ", pt);
    check_dtype(params16, "params16", pt, fn);
  }
  check_moment(exp_avgs, "exp_avgs", exp_avg_scales, "exp_avg_scales", T, masters, dt, dev0, fn);
  check_moment(exp_avg_sqs, "exp_avg_sqs", exp_avg_sq_scales, "exp_avg_sq_scales", T, masters, dt, dev0, fn);
  check_scalar(grad_scale, "grad_scale", dt, dev0, fn);
  check_scalar(found_inf, "found_inf", dt, dev0, fn);
}

namespace {

void fused_adam_cpu(ZK_FUSED_ADAM_ARGS) {
  check_fused_adam_args(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs,
                        beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf,
                        c10::DeviceType::CPU, "fused_adam_cpu");
  fused_adam_cpu_launch(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs,
                        beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf);
}

#ifdef ZK_WITH_CUDA
void fused_adam_cuda(ZK_FUSED_ADAM_ARGS) {
  check_fused_adam_args(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs,
                        beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf,
                        c10::DeviceType::CUDA, "fused_adam_cuda");
  fused_adam_cuda_launch(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs,
                         beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf);
}
#endif

#define ZK_CODED_CALL_ARGS                                                                        \
  masters, grads, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, params16, coeffs, keys, \
      beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf

void fused_adam_coded_cpu(ZK_CODED_ADAM_ARGS) {
  check_coded_adam_args(ZK_CODED_CALL_ARGS, c10::DeviceType::CPU, "fused_adam_coded_cpu");
  fused_adam_coded_cpu_launch(ZK_CODED_CALL_ARGS);
}

#ifdef ZK_WITH_CUDA
void fused_adam_coded_cuda(ZK_CODED_ADAM_ARGS) {
  check_coded_adam_args(ZK_CODED_CALL_ARGS, c10::DeviceType::CUDA, "fused_adam_coded_cuda");
  fused_adam_coded_cuda_launch(ZK_CODED_CALL_ARGS);
}
#endif

void stream_ceiling(at::Tensor a, at::Tensor b, at::Tensor c, const at::Tensor& d) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&a, &b, &c, &d}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "stream_ceiling: needs contiguous float32 CPU tensors");
    TORCH_CHECK(t->numel() == a.numel(), "stream_ceiling: all four tensors need the same numel");
  }
  stream_ceiling_cpu(a, b, c, d);
}

bool is_flat_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Shared checks of flatten / unflatten: `flat` is the bucket, `parts` the per-tensor side.
void check_bucket(const at::Tensor& flat, const std::vector<at::Tensor>& parts,
                  const std::vector<int64_t>& offsets, const char* fn, const char* flat_name,
                  const char* parts_name, bool parts_may_be_fp64) {
  TORCH_CHECK(flat.defined() && flat.device().is_cpu(), fn, ": ", flat_name,
              " must be a CPU tensor");
  TORCH_CHECK(flat.is_contiguous(), fn, ": ", flat_name, " must be contiguous");
  TORCH_CHECK(is_flat_dtype(flat.scalar_type()), fn, ": ", flat_name,
              " must be float32, bfloat16 or float16, got ", flat.scalar_type());
  TORCH_CHECK(offsets.size() == parts.size(), fn, ": ", offsets.size(), " offsets for ",
              parts.size(), " tensors in ", parts_name);
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& t = parts[i];
    TORCH_CHECK(t.defined() && t.device().is_cpu(), fn, ": ", parts_name, "[", i,
                "] must be a CPU tensor");
    TORCH_CHECK(t.is_contiguous(), fn, ": ", parts_name, "[", i, "] is not contiguous (strides ",
                t.strides(), "); pass .contiguous() tensors");
    TORCH_CHECK(is_flat_dtype(t.scalar_type()) || (parts_may_be_fp64 && t.scalar_type() == at::kDouble),
                fn, ": ", parts_name, "[", i, "] has unsupported dtype ", t.scalar_type());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + t.numel() <= flat.numel(), fn, ": ", parts_name,
                "[", i, "] (", t.numel(), " elements at offset ", offsets[i],
                ") does not fit in ", flat_name, " (", flat.numel(), " elements)");
  }
}

void flatten_cpu(const std::vector<at::Tensor>& srcs, at::Tensor dst,
                 const std::vector<int64_t>& offsets, double scale) {
  check_bucket(dst, srcs, offsets, "flatten_cpu", "dst", "srcs", true);
  flatten_cpu_launch(srcs, dst, offsets, scale);
}

void unflatten_cpu(const at::Tensor& src, const std::vector<at::Tensor>& dsts,
                   const std::vector<int64_t>& offsets) {
  check_bucket(src, dsts, offsets, "unflatten_cpu", "src", "dsts", false);
  unflatten_cpu_launch(src, dsts, offsets);
}

// One tensor argument of the wire codec: defined, on the CPU, contiguous, of dtype `want` (or any of
// fp32 / bf16 / fp16 when `want` is Undefined) and of `numel` elements.
void check_wire(const at::Tensor& t, const char* fn, const char* what, at::ScalarType want, int64_t numel,
                const char* numel_why) {
  TORCH_CHECK(t.defined(), fn, ": ", what, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", what, " is on ", t.device(), "; this codec needs CPU tensors");
  if (want == at::ScalarType::Undefined) {
    TORCH_CHECK(is_flat_dtype(t.scalar_type()), fn, ": ", what,
                " must be float32, bfloat16 or float16, got ", t.scalar_type());
  } else {
    TORCH_CHECK(t.scalar_type() == want, fn, ": ", what, " has dtype ", t.scalar_type(), "; expected ", want);
  }
  TORCH_CHECK(t.is_contiguous(), fn, ": ", what, " is not contiguous (strides ", t.strides(),
              "); pass a .contiguous() tensor");
  TORCH_CHECK(t.numel() == numel, fn, ": ", what, " has ", t.numel(), " elements; expected ", numel, " (",
              numel_why, ")");
}

int64_t wire_blocks(int64_t n) { return (n + 255) / 256; }

void q8_encode_cpu(const at::Tensor& x, const at::Tensor& mid, at::Tensor codes, at::Tensor scales) {
  const char* fn = "q8_encode_cpu";
  TORCH_CHECK(x.defined(), fn, ": x is undefined");
  const int64_t n = x.numel();
  check_wire(x, fn, "x", at::ScalarType::Undefined, n, "the input");
  check_wire(mid, fn, "mid", at::kFloat, 255, "the code book's 255 midpoints");
  check_wire(codes, fn, "codes", at::kByte, n, "one code per element of x");
  check_wire(scales, fn, "scales", at::kFloat, wire_blocks(n), "one scale per 256-element block of x");
  q8_encode_cpu_launch(x, mid, codes, scales);
}

void q8_decode_cpu(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& table, at::Tensor out,
                   bool accumulate) {
  const char* fn = "q8_decode_cpu";
  TORCH_CHECK(codes.defined(), fn, ": codes is undefined");
  const int64_t n = codes.numel();
  check_wire(codes, fn, "codes", at::kByte, n, "the input");
  check_wire(scales, fn, "scales", at::kFloat, wire_blocks(n), "one scale per 256-element block of codes");
  check_wire(table, fn, "table", at::kFloat, 256, "the code book's 256 values");
  check_wire(out, fn, "out", at::kFloat, n, "one value per code");
  q8_decode_cpu_launch(codes, scales, table, out, accumulate);
}

at::Tensor cached_empty(int64_t numel, at::ScalarType dtype) {
  TORCH_CHECK(numel >= 0, "cached_empty: numel must be >= 0, got ", numel);
  return zk_cached_empty(numel, dtype);
}

void cache_set_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "cache_set_limit: bytes must be >= 0, got ", bytes);
  zk_cache_set_limit(bytes);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zero_kernels C++/CUDA kernels (see zero_kernels/reference.py for the contract)";
  const char* adam_doc =
      "Fused Adam/AdamW step, in place, over T tensors ([Note: the fused-Adam contract]). "
      "Empty lists mean None.";
  m.def("fused_adam_cpu", &fused_adam_cpu, adam_doc, py::arg("masters"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"),
        py::arg("params16"), py::arg("coeffs"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("maximize"),
        py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
        py::call_guard<py::gil_scoped_release>());
#ifdef ZK_WITH_CUDA
  m.def("fused_adam_cuda", &fused_adam_cuda, adam_doc, py::arg("masters"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"),
        py::arg("params16"), py::arg("coeffs"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("maximize"),
        py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),
        py::call_guard<py::gil_scoped_release>());
#endif
  const char* coded_doc =
      "Fused Adam/AdamW step on coded states, in place, over T tensors of one layout "
      "(csrc/fused_adam.h, ZK_CODED_ADAM_ARGS; reference: zero_kernels.codecs.adam_step_coded). "
      "Empty lists mean None.";
#define ZK_CODED_PYARGS                                                                          \
  py::arg("masters"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),              \
      py::arg("exp_avg_scales"), py::arg("exp_avg_sq_scales"), py::arg("params16"),                \
      py::arg("coeffs"), py::arg("keys"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),     \
      py::arg("weight_decay"), py::arg("adamw"), py::arg("maximize"),                             \
      py::arg("grad_scale") = py::none(), py::arg("found_inf") = py::none(),                       \
      py::call_guard<py::gil_scoped_release>()
  m.def("fused_adam_coded_cpu", &fused_adam_coded_cpu, coded_doc, ZK_CODED_PYARGS);
#ifdef ZK_WITH_CUDA
  m.def("fused_adam_coded_cuda", &fused_adam_coded_cuda, coded_doc, ZK_CODED_PYARGS);
#endif
#undef ZK_CODED_PYARGS
  m.def("stream_ceiling", &stream_ceiling,
        "In place a += d; b += d; c += d (fp32): the streaming-bandwidth ceiling with Adam's "
        "access mix (read 4 arrays, write 3 back), same SIMD dispatch and thread pool",
        py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"),
        py::call_guard<py::gil_scoped_release>());
  m.def("set_cpu_nt", &zk_set_cpu_nt,
        "Tuning knob: non-temporal stores for the 16-bit parameter copy / the fp32 outputs",
        py::arg("nt16"), py::arg("nt32"));
  m.def("cpu_isa", &zk_cpu_isa, "SIMD path used by the CPU kernels: avx512 | avx2 | scalar");
  m.attr("with_cuda") =
#ifdef ZK_WITH_CUDA
      true;
#else
      false;
#endif
  m.def("flatten_cpu", &flatten_cpu,
        "dst[off_i : off_i + n_i] = cast(float(srcs[i]) * scale), one parallel pass (ZeRO buckets)",
        py::arg("srcs"), py::arg("dst"), py::arg("offsets"), py::arg("scale") = 1.0,
        py::call_guard<py::gil_scoped_release>());
  m.def("unflatten_cpu", &unflatten_cpu,
        "dsts[i] = cast(src[off_i : off_i + n_i]), one parallel pass (ZeRO buckets)",
        py::arg("src"), py::arg("dsts"), py::arg("offsets"),
        py::call_guard<py::gil_scoped_release>());
  m.def("q8_encode_cpu", &q8_encode_cpu,
        "ZeRO++ int8 wire encode (csrc/cpu_quant.cpp): codes[i] = number of the 255 midpoints `mid` "
        "strictly below x[i] / scale of its 256-element block (max |x|), written to codes / scales; "
        "codecs.encode_q8's bits",
        py::arg("x"), py::arg("mid"), py::arg("codes"), py::arg("scales"),
        py::call_guard<py::gil_scoped_release>());
  m.def("q8_decode_cpu", &q8_decode_cpu,
        "ZeRO++ int8 wire decode (csrc/cpu_quant.cpp): out = table[codes] * the block's scale "
        "(codecs.decode_q8's bits), or out += it with accumulate=True",
        py::arg("codes"), py::arg("scales"), py::arg("table"), py::arg("out"), py::arg("accumulate") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("cached_empty", &cached_empty,
        "1-D CPU tensor whose resizable storage allocates from the gather cache "
        "([Note: the gather cache], csrc/block_cache.cpp)",
        py::arg("numel"), py::arg("dtype"));
  m.def("cache_set_limit", &cache_set_limit, "bytes of freed blocks the gather cache keeps",
        py::arg("bytes"));
  m.def("cache_empty", &zk_cache_empty, "return every cached block to the system");
  m.def("cache_stats", &zk_cache_stats,
        "gather cache: cached_bytes, live_bytes, limit_bytes, hits, misses");
}
