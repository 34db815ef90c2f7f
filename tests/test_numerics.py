"""Bit-for-bit numerics: the Triton kernels (interpreted with GPU scalar semantics), the C++ CPU kernel
and the reference agree exactly; the CUDA build's architecture flags.

[Note: coefficients are computed once, in double] (zero_kernels/reference.py) and [Note: interpreter
bits are GPU bits] (kernels/_multi_tensor.py) are the rules checked here. What the interpreter cannot
show by itself:

* scalar arithmetic. A Python float kernel argument stays a double in the interpreter, while a GPU
  receives it as fp32 and computes ``1.0 - beta`` in fp32 (1.7e-4 relative off at beta2 = 0.9999).
  ``Fp32Scalars`` launches a kernel with every float argument as an fp32 interpreter scalar, as the
  GPU sees it, so in-kernel coefficient arithmetic changes the bits and fails these tests;
* launch options. The interpreter ignores ``enable_fp_fusion``; the same harness records every
  launch's keyword arguments, and a test requires ``enable_fp_fusion=False`` on each;
* contraction, approximate division / square root, NaN-dropping max in the compiled code: checked on
  the PTX by tests/test_codegen.py (the interpreter is exact, so these tests pin the exact result).

The NaN of the amsgrad max is compared by position, not payload (torch's CPU and CUDA maxima return
different NaN bits).
"""
from __future__ import annotations

import os
import runpy

import numpy as np
import pytest
import torch
from torch import Tensor

from zero_kernels import backends
from zero_kernels.reference import compute_coeffs, fused_adam_ref, moment_coeffs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="runs the Triton kernels on CPU tensors: set TRITON_INTERPRET=1 (CI does)")
needs_cpu_ext = pytest.mark.skipif(
    backends.why_unavailable("cpu", torch.device("cpu")) is not None,
    reason=f"C++ extension unavailable: {backends.why_unavailable('cpu', torch.device('cpu'))}")

BETA1, BETA2 = 0.9, 0.9999    # fp32(1 - beta2) != fp32(1) - fp32(beta2): see test_betas_are_discriminating
GEN = torch.Generator().manual_seed(20261125)


class Fp32Scalars:
    """A Triton kernel launched with each Python-float argument as an fp32 interpreter scalar: what a
    GPU receives for an ``fp32`` parameter (the interpreter otherwise keeps doubles)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launch_options = []   # the keyword arguments of every launch (constexprs and options)

    def __getitem__(self, grid):
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        def fp32(x):
            return tl.tensor(TensorHandle(np.array([x], dtype=np.float32), tl.float32), tl.float32)

        def launch(*args, **kwargs):
            self.launch_options.append(kwargs)
            return self.kernel[grid](*[fp32(a) if type(a) is float else a for a in args], **kwargs)
        return launch


@pytest.fixture
def gpu_scalars(monkeypatch):
    """Every Triton launch of this test sees fp32 scalar arguments (see Fp32Scalars); returns the
    wrapped kernels by name."""
    from zero_kernels.kernels import adam, flatten
    wrapped = {}
    for mod, name in ((adam, "fused_adam_kernel"), (flatten, "flatten_kernel"), (flatten, "unflatten_kernel")):
        wrapped[name] = Fp32Scalars(getattr(mod, name))
        monkeypatch.setattr(mod, name, wrapped[name])
    return wrapped


def test_betas_are_discriminating():
    """Precondition of the bitwise tests: at these betas, fp32 subtraction gives other bits."""
    f = np.float32
    assert f(1.0 - BETA2) != f(1.0) - f(BETA2)
    assert moment_coeffs(BETA1, BETA2) == (1.0 - BETA1, 1.0 - BETA2)


def _coeffs_torch_scalar(t: float, lr: float, b1: float, b2: float, wd: float, adamw: bool) -> Tensor:
    """compute_coeffs' tensor expression on one CPU step count (torch's scalar pow: libm's, as torch.optim's
    Python ``beta ** step`` and its fused CPU kernel's std::pow)."""
    s = torch.tensor([t], dtype=torch.float64)
    bc1, bc2 = 1 - torch.pow(b1, s), 1 - torch.pow(b2, s)
    step_size = lr / bc1
    decay = torch.full_like(step_size, 1 - lr * wd) if adamw else torch.ones_like(step_size)
    return torch.stack([step_size, bc2.sqrt(), decay], dim=1).to(torch.float32)


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.8, 0.95), (0.5, 0.75), (0.0, 0.0), (0.9, 0.9999)])
def test_compute_coeffs_cpu_double_path_equals_the_tensor_expression(betas):
    """CPU steps with a float lr take Python doubles (host time); every bit equals the tensor expression per
    step count, the edge cases included: a step count of 0 (found_inf skipped the first step: inf / NaN),
    lr 0, negative, NaN or inf, a NaN count. Counts from 0 to past 10^5, one and several per call."""
    b1, b2 = betas
    counts = [0.0, 1.0, 2.0, 3.0, 17.0, 255.0, 1000.0, 16607.0, 99999.0, 1e6, float("nan")]
    counts += [float(c) for c in torch.randint(1, 200_000, (40,), generator=torch.Generator().manual_seed(7))]
    for lr in (1e-3, 3e-4, 0.1, 0.0, -1e-3, float("nan"), float("inf")):
        for adamw in (True, False):
            want = torch.cat([_coeffs_torch_scalar(t, lr, b1, b2, 0.01, adamw) for t in counts])
            got = compute_coeffs(torch.tensor(counts), lr, b1, b2, 0.01, adamw)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (lr, adamw)
            one = torch.cat([compute_coeffs([torch.tensor(t)], lr, b1, b2, 0.01, adamw) for t in counts])
            assert torch.equal(one.view(torch.int32), want.view(torch.int32)), (lr, adamw)
    # not vacuous: finite, distinct step sizes across the counts at lr 1e-3
    sizes = compute_coeffs(torch.tensor(counts[1:6]), 1e-3, b1, b2, 0.01, True)[:, 0]
    assert torch.isfinite(sizes).all() and (b1 == 0.0 or len(set(sizes.tolist())) == 5)


@needs_interpreter
def test_fp32_scalar_harness_sees_in_kernel_arithmetic():
    """Negative control: a kernel computing 1 - b itself gives fp32 bits under Fp32Scalars."""
    import triton
    import triton.language as tl

    @triton.jit
    def one_minus(x_ptr, out_ptr, b, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, tl.load(x_ptr + offs) * (1.0 - b))

    x, out = torch.ones(4), torch.empty(4)
    one_minus[(1,)](x, out, BETA2, N=4)
    assert out[0].item() == np.float32(1.0 - BETA2)                        # interpreter: double
    Fp32Scalars(one_minus)[(1,)](x, out, BETA2, N=4)
    assert out[0].item() == np.float32(1.0) - np.float32(BETA2)           # GPU: fp32


# ----------------------------------------------------------------------------- inputs
def _rand(n, scale=1.0, dtype=torch.float32):
    return (torch.randn(n, generator=GEN) * scale).to(dtype)


def _misaligned(n, dtype, fill):
    """A contiguous view starting one element past a 16-byte boundary (scalar path)."""
    base = torch.empty(n + 1, dtype=dtype)
    view = base[1:]
    view.copy_(fill.to(dtype))
    return view


def make_state(sizes, grad_dtype, p16_dtype, amsgrad, misaligned=()):
    """Lists for the fused-Adam contract; tensors whose index is in `misaligned` start 4 B off."""
    st = dict(masters=[], grads=[], exp_avgs=[], exp_avg_sqs=[],
              max_exp_avg_sqs=[] if amsgrad else None, params16=[] if p16_dtype else None)
    for i, n in enumerate(sizes):
        vals = dict(masters=_rand(n), grads=_rand(n, 1e-2), exp_avgs=_rand(n, 1e-3),
                    exp_avg_sqs=_rand(n, 1e-3).square())
        if amsgrad:
            vals["max_exp_avg_sqs"] = vals["exp_avg_sqs"] * torch.rand(n, generator=GEN) * 2
        for key, val in vals.items():
            dtype = grad_dtype if key == "grads" else torch.float32
            st[key].append(_misaligned(n, dtype, val) if i in misaligned else val.to(dtype).clone())
        if p16_dtype:
            st["params16"].append(torch.zeros(n, dtype=p16_dtype))
    return st


def clone_state(st):
    return {k: None if v is None else [t.clone() for t in v] for k, v in st.items()}


def assert_bitwise(got, want):
    """Equal bits everywhere, except that any NaN matches any NaN (payloads are not specified)."""
    for key in want:
        if want[key] is None:
            continue
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            af, bf = a.float(), b.float()
            nan = bf.isnan()
            assert torch.equal(af.isnan(), nan), f"{key}[{i}]: NaN positions differ"
            bits = torch.int16 if a.element_size() == 2 else torch.int32
            ok = a.view(bits) == b.view(bits)
            bad = (~ok & ~nan).nonzero()
            assert bad.numel() == 0, (f"{key}[{i}]: {bad.numel()} of {a.numel()} elements differ in bits, "
                                      f"first at {bad[0].item()}: {a[bad[0]].item()!r} vs {b[bad[0]].item()!r}")


def run_both(backend, st, coeffs, **kw):
    got, want = clone_state(st), clone_state(st)
    backends.get(backend)(*[got[k] for k in _ORDER], coeffs, **kw)
    fused_adam_ref(*[want[k] for k in _ORDER], coeffs, **kw)
    return got, want


_ORDER = ("masters", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "params16")
SIZES = (3001, 1, 4096 + 17, 5)
DTYPES = [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
          (torch.float32, torch.bfloat16)]
DTYPE_IDS = ["fp32", "bf16", "fp16", "fp32-grad-bf16-param"]


def _coeffs(n, adamw, lr=1e-3, wd=0.1):
    steps = [torch.tensor(float(s)) for s in range(1, n + 1)]
    return compute_coeffs(steps, lr, BETA1, BETA2, wd, adamw)


def _hp(adamw, eps=1e-8, wd=0.1, maximize=False):
    return dict(beta1=BETA1, beta2=BETA2, eps=eps, weight_decay=wd, adamw=adamw, maximize=maximize)


@needs_interpreter
def test_every_triton_launch_disables_fp_fusion(gpu_scalars):
    """The interpreter ignores enable_fp_fusion, so check the launches themselves: every one passes
    False (Triton 3.9 defaults to fusing a*b+c into one fma) and the options CODEGEN_CASES compile."""
    from zero_kernels.kernels import adam, flatten
    st = make_state((1031,), torch.bfloat16, torch.bfloat16, amsgrad=False)
    backends.get("triton")(*[st[k] for k in _ORDER], _coeffs(1, True), **_hp(True))
    out = torch.zeros(1031 + 7)
    flatten.flatten_triton([st["grads"][0], torch.ones(7)], out, [0, 1031], scale=0.5, accumulate=True)
    flatten.unflatten_triton(out, [torch.empty(1031), torch.empty(7)], [0, 1031])
    for name, want in (("fused_adam_kernel", adam.LAUNCH_OPTIONS), ("flatten_kernel", flatten.FLATTEN_LAUNCH),
                       ("unflatten_kernel", flatten.UNFLATTEN_LAUNCH)):
        launches = gpu_scalars[name].launch_options
        assert launches, f"{name} was not launched"
        for kw in launches:
            assert kw.get("enable_fp_fusion") is False, f"{name} launched without enable_fp_fusion=False: {kw}"
            assert {k: kw.get(k) for k in want} == want
    for mod in (adam, flatten):   # ... and the compiled cases are compiled that way too
        for case in mod.CODEGEN_CASES:
            assert case[4].get("enable_fp_fusion") is False, f"{mod.__name__}: {case[3]}"


# ----------------------------------------------------------------------------- Triton == reference
@needs_interpreter
def test_triton_call_mixing_grad_dtypes_launches_per_dtype():
    """One call with fp32 and bf16 gradients (callers outside the optimizer may mix them): the tensors are
    regrouped, one launch per gradient dtype, each with its own rows of the coefficients; bits as the reference."""
    from zero_kernels.kernels import adam
    a = make_state((301, 17), torch.float32, torch.bfloat16, amsgrad=True)
    b = make_state((1031, 4), torch.bfloat16, torch.bfloat16, amsgrad=True)
    st = {k: [a[k][0], b[k][0], a[k][1], b[k][1]] for k in _ORDER}
    coeffs = _coeffs(4, True)                    # another step per tensor: a wrong row would show
    before = adam.launch_count
    got, want = run_both("triton", st, coeffs, **_hp(True))
    assert adam.launch_count - before == 2
    assert_bitwise(got, want)


@needs_interpreter
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("gdt,pdt", DTYPES, ids=DTYPE_IDS)
def test_triton_bitwise_with_gpu_scalars(gpu_scalars, gdt, pdt, adamw, amsgrad):
    """Aligned and misaligned tensors in one launch (both per-tensor paths and masked tails), fp32
    scalars as on a GPU, grad scale and maximize: every output equals the reference bit for bit."""
    st = make_state(SIZES, gdt, pdt, amsgrad, misaligned=(2,))
    gs = torch.tensor([0.5])
    got, want = run_both("triton", st, _coeffs(len(SIZES), adamw), grad_scale=gs,
                         **_hp(adamw, maximize=not adamw))
    assert_bitwise(got, want)
    assert not torch.equal(got["masters"][0], st["masters"][0])   # it stepped


@needs_interpreter
def test_triton_eps_zero_and_subnormals(gpu_scalars):
    """eps = 0 with zero and subnormal second moments (IEEE sqrt/div keep subnormals)."""
    st = make_state((2049,), torch.float32, None, amsgrad=False)
    st["exp_avg_sqs"][0][:1000] = torch.rand(1000, generator=GEN) * 1e-39     # subnormal
    st["grads"][0][:500] = torch.rand(500, generator=GEN) * 1e-20             # g*g subnormal
    st["grads"][0][1000:1010] = 0.0
    st["exp_avgs"][0][1000:1010] = 0.0
    st["exp_avg_sqs"][0][1000:1010] = 0.0                                      # 0/0 -> NaN in both
    got, want = run_both("triton", st, _coeffs(1, True), **_hp(True, eps=0.0))
    assert want["masters"][0][:1000].isfinite().all()
    assert_bitwise(got, want)


def _nan_state(amsgrad=True):
    st = make_state((1031, 17), torch.float32, None, amsgrad)
    st["max_exp_avg_sqs"][0][3] = float("nan")      # NaN in the running max only
    st["grads"][0][7] = float("nan")                # NaN in v only
    st["max_exp_avg_sqs"][1][0] = float("nan")
    return st


@needs_interpreter
def test_triton_amsgrad_max_propagates_nan(gpu_scalars):
    """torch.maximum(vmax, v) is NaN when either is: the kernel must not drop it (fmax would)."""
    got, want = run_both("triton", _nan_state(), _coeffs(2, True), **_hp(True))
    assert want["max_exp_avg_sqs"][0][3].isnan() and want["max_exp_avg_sqs"][0][7].isnan()
    assert_bitwise(got, want)


@needs_interpreter
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                 (torch.float32, torch.bfloat16), (torch.float16, torch.float32)])
def test_flatten_bitwise_with_gpu_scalars(gpu_scalars, src_dtype, dst_dtype, accumulate):
    """Flatten's scale and accumulate round twice, as torch's mul then add (never one fma); one
    odd-sized region makes the following regions misaligned (per-tensor scalar path)."""
    from zero_kernels.kernels.flatten import flatten_triton
    sizes = (4096 + 3, 1, 2 * 1024 + 5, 7)
    srcs = [_rand(n, 3.0, src_dtype) for n in sizes]
    offsets = np.cumsum((0,) + sizes[:-1]).tolist()
    out = _rand(sum(sizes), 1.0, dst_dtype)
    want = out.clone()
    scale = 1.0 / 3.0
    for t, o in zip(srcs, offsets):
        x = t.float() * scale
        if accumulate:
            x = x + want[o:o + t.numel()].float()
        want[o:o + t.numel()] = x.to(dst_dtype)
    flatten_triton(srcs, out, offsets, scale=scale, accumulate=accumulate)
    bits = torch.int16 if out.element_size() == 2 else torch.int32
    assert torch.equal(out.view(bits), want.view(bits))


# ----------------------------------------------------------------------------- C++ CPU == reference
@needs_cpu_ext
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("gdt,pdt", DTYPES, ids=DTYPE_IDS)
def test_cpu_bitwise_equals_reference(gdt, pdt, adamw, amsgrad):
    """No contraction in the C++ kernel: each operation rounds once, as torch's (it used FMAs).
    The sizes run both the SIMD body and the scalar tail (tests/test_cpu_kernel.py compares the
    SIMD paths with each other)."""
    st = make_state(SIZES, gdt, pdt, amsgrad, misaligned=(2,))
    got, want = run_both("cpu", st, _coeffs(len(SIZES), adamw), grad_scale=torch.tensor([0.5]),
                         **_hp(adamw, maximize=not adamw))
    assert_bitwise(got, want)


@needs_cpu_ext
def test_cpu_amsgrad_max_propagates_nan():
    got, want = run_both("cpu", _nan_state(), _coeffs(2, True), **_hp(True))
    assert_bitwise(got, want)


@needs_cpu_ext
def test_cpu_eps_zero_and_subnormals():
    st = make_state((2049,), torch.float32, None, amsgrad=False)
    st["exp_avg_sqs"][0][:1000] = torch.rand(1000, generator=GEN) * 1e-39
    st["grads"][0][:500] = torch.rand(500, generator=GEN) * 1e-20
    got, want = run_both("cpu", st, _coeffs(1, True), **_hp(True, eps=0.0))
    assert_bitwise(got, want)


# ----------------------------------------------------------------------------- against torch
@needs_interpreter
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
def test_triton_tracks_torch_adam_at_beta2_9999(gpu_scalars, adamw):
    """Three steps of the Triton kernel (GPU scalars) against torch.optim.AdamW/Adam (single-tensor
    path): torch's lerp/addcmul/addcdiv round differently, so a tolerance, tight enough that
    fp32 (1 - beta2) (1.7e-4 relative on v) fails it."""
    n = 3001
    p0, grads = _rand(n), [_rand(n, 1e-2) for _ in range(3)]
    ref = torch.nn.Parameter(p0.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=1e-3, betas=(BETA1, BETA2), eps=1e-8, weight_decay=0.1, foreach=False)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        ref.grad = g.clone()
        opt.step()
        coeffs = compute_coeffs([torch.tensor(float(step))], 1e-3, BETA1, BETA2, 0.1, adamw)
        backends.get("triton")([p], [g], [m], [v], None, None, coeffs, **_hp(adamw))
    st = opt.state[ref]
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=2e-6, atol=0)
    torch.testing.assert_close(m, st["exp_avg"], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- CUDA build flags
def _build():
    return runpy.run_path(os.path.join(ROOT, "zero_kernels", "_build.py"))


def test_cuda_arch_flags_default_and_ptx_for_newest():
    flags = _build()["cuda_arch_flags"]
    default = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
               "-gencode=arch=compute_90,code=compute_90"]
    assert flags(None) == default and flags("") == default and flags("  ") == default
    assert flags("8.0;8.6 9.0") == ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_86,code=sm_86",
                                    "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"]
    assert flags("10.0;12.0")[-1] == "-gencode=arch=compute_120,code=compute_120"
    assert flags("7.5 8.0+PTX") == ["-gencode=arch=compute_75,code=sm_75", "-gencode=arch=compute_80,code=sm_80",
                                    "-gencode=arch=compute_80,code=compute_80"]
    assert flags("9.0a") == ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=compute_90"]
    assert flags("Ampere;Hopper") == flags("8.0;8.6;9.0")
    assert flags("9.0;8.0;9.0") == default


@pytest.mark.parametrize("bad", ["sm_80", "8", "8.x", "9.0b", "6.1"])
def test_cuda_arch_flags_reject_bad_entries(bad):
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        _build()["cuda_arch_flags"](bad)


def test_nvcc_flags_honour_torch_cuda_arch_list(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6;8.9")
    flags = _build()["NVCC_FLAGS"]
    assert [f for f in flags if f.startswith("-gencode")] == [
        "-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_89,code=sm_89",
        "-gencode=arch=compute_89,code=compute_89"]
    assert "--use_fast_math" not in flags and "-use_fast_math" not in flags
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert "-gencode=arch=compute_90,code=compute_90" in _build()["NVCC_FLAGS"]
