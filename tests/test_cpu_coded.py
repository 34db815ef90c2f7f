"""The C++ CPU kernel for coded Adam states (csrc/cpu_adam_coded.cpp, via zero_kernels._ext.fused_adam_coded_cpu and
zero_kernels._coded_host) against zero_kernels.codecs.adam_step_coded, the definition: every stored byte equal
(parameters, masters / remainders, codes, block scales) for every state kind and layout, odd sizes and partial
blocks, several steps, AdamW / Adam-L2 + maximize, grad_scale, found_inf, NaN / inf gradients, 1 and 2 threads and
every SIMD path (ZERO_KERNELS_CPU_ISA, in subprocesses); the optimizer with backend="cpu" against
backend="reference"; the front end's argument errors; negative controls (another code book, swapped midpoint
tables, another seed) must differ."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import zero_kernels as zk
from zero_kernels import _coded_host, _ext
from zero_kernels import codecs as C

from _codec_controls import (WRONG, check_f8_floor, check_f8_subnormal, check_written, f8_floor_run, f8_subnormal_run,
                             written_values, wrong_f8_unsaturated)

CPP = _ext.cpu_module()
pytestmark = pytest.mark.skipif(CPP is None and os.environ.get("ZK_REQUIRE_CPU") != "1",
                                reason=f"C++ extension unavailable: {_ext.load_error()}")

BF, F16, U8, F8, F32 = torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn, torch.float32
KINDS = [F32, BF, U8, F8]
SIZES = [1, 255, 256, 257, 1000, 5000, 70001]
LAYOUTS = {"remainder": (BF, True), "bf16+master": (BF, False), "fp16+master": (F16, False), "fp32": (F32, False)}
HP = {"adamw": dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True),
      "l2+max": dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.03, adamw=False, maximize=True),
      "l2": dict(lr=2e-3, beta1=0.9, beta2=0.995, eps=1e-7, weight_decay=0.05, adamw=False),
      # [Note: a power-of-two bias correction divides by multiplying] (csrc/cpu_adam_coded_simd.h): at step 1
      # bc2 = sqrt(1 - 0.75) = 0.5 (then not a power of two); with beta2 = 1e-8, bc2 rounds to 1.0 at every step
      "bc2=0.5": dict(lr=1e-2, beta1=0.9, beta2=0.75, eps=1e-8, weight_decay=0.1, adamw=True),
      "bc2=1": dict(lr=1e-2, beta1=0.9, beta2=1e-8, eps=1e-8, weight_decay=0.01, adamw=True),
      # [Note: the bound on 8-bit m]: beta1^2 >= beta2, so m_bound is inf and the cap leaves m (the kernel skips it)
      "no bound": dict(lr=1e-2, beta1=0.99, beta2=0.95, eps=1e-8, weight_decay=0.1, adamw=True)}


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def setup(seed, layout, m_dtype, v_dtype, sizes):
    dtype, rem = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    fmt = dict(exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype, store_param_remainders=rem)
    return ps, [C.init_coded_state(p, **fmt) for p in ps]


def grads_for(seed, t, ps, gdt):
    g = torch.Generator().manual_seed(seed * 100 + t)
    return [(torch.randn(p.shape, generator=g) * 10.0 ** float(torch.randint(-4, 1, (), generator=g))).to(gdt)
            for p in ps]


def kernel_step(ps, gs, states, seeds, hp, **kw):
    _coded_host.run_extension(_ext.fused_adam_coded_cpu, ps, gs, states, seeds, **hp, **kw)


def reference_step(ps, gs, states, seeds, hp, **kw):
    for p, g, s, sd in zip(ps, gs, states, seeds):
        C.adam_step_coded(p, g, s, seed=sd, **hp, **kw)


def assert_equal(ps, states, qs, refs):
    for i, (p, s, q, r) in enumerate(zip(ps, states, qs, refs)):
        assert torch.equal(bits(p), bits(q)), f"param {i} ({p.numel()} elements) differs"
        for k in s:
            assert torch.equal(bits(s[k]), bits(r[k])), f"param {i} ({p.numel()} elements): state {k!r} differs"


def check(layout, m_dtype, v_dtype, gdt=None, hp="adamw", steps=3, sizes=SIZES, seed=1, **kw):
    ps, states = setup(seed, layout, m_dtype, v_dtype, sizes)
    qs, refs = setup(seed, layout, m_dtype, v_dtype, sizes)
    seeds = list(range(len(ps)))
    for t in range(steps):
        gs = grads_for(seed, t, ps, gdt or ps[0].dtype)
        kernel_step(ps, gs, states, seeds, HP[hp], **kw)
        reference_step(qs, gs, refs, seeds, HP[hp], **kw)
    assert_equal(ps, states, qs, refs)
    return ps, states


@pytest.mark.parametrize("m_dtype", KINDS, ids=["m=fp32", "m=bf16", "m=u8", "m=f8"])
@pytest.mark.parametrize("v_dtype", KINDS, ids=["v=fp32", "v=bf16", "v=u8", "v=f8"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_kernel_equals_codec_definition(m_dtype, v_dtype, layout):
    check(layout, m_dtype, v_dtype, sizes=[1, 255, 257, 5000])


@pytest.mark.parametrize("gdt", [F32, BF, F16], ids=["g=fp32", "g=bf16", "g=fp16"])
@pytest.mark.parametrize("hp", list(HP))
def test_grad_dtypes_hyperparameters_and_odd_sizes(gdt, hp):
    check("remainder", U8, U8, gdt=gdt, hp=hp, steps=3)
    check("fp32", F8, BF, gdt=gdt, hp=hp, steps=2, sizes=[1, 256, 1000, 70001])


def test_fp16_master_layout_with_l2_and_maximize():
    check("fp16+master", BF, U8, hp="l2+max", steps=4, sizes=[255, 256, 257, 1000])


def _tie_masters(n, seed):
    """fp32 masters whose low 16 bits are mostly exact bf16 ties (0x8000) of both parities and signs, their
    neighbours (0x7FFF, 0x8001), 0 and 0xFFFF, plus NaN, +-inf, the largest float and -0."""
    g = torch.Generator().manual_seed(seed)
    hi = torch.randint(0x3000, 0x4F00, (n,), generator=g, dtype=torch.int64)
    hi = torch.where(torch.rand(n, generator=g) < 0.5, hi, hi | 0x8000)
    lows = torch.tensor([0x8000, 0x8000, 0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF])
    b = (hi << 16) | lows[torch.randint(0, 7, (n,), generator=g)]
    b[:6] = torch.tensor([0x7FC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x80000000, 0x7F7F8000])
    return (b - ((b & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("n", [32, 257, 1000, 4133])
def test_remainder_split_on_ties_and_special_values(n):
    """The remainder join / split (16-bit lanes on AVX-512) equals split_remainder on exact ties, their
    neighbours and special values: lr = 0 and no weight decay keep each master as it is, so the split sees
    the crafted bits (a NaN master poisons its own block's moments, as in the reference). A tie under an
    even bf16 is stored 0x7FFF below itself, so only an update makes one reach the split (the random
    gradients of the tests above do); ties under an odd one (rounded up) reach it here."""
    hp = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    runs = []
    for _ in range(2):
        master = _tie_masters(n, 5 + n)
        p = master.to(BF)
        st = C.init_coded_state(p, exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=True)
        p.copy_(C.split_remainder(master)[0])
        st["master_remainder"].copy_(C.split_remainder(master)[1])
        runs.append(([p], [st]))
    assert int(((runs[0][1][0]["master_remainder"] == 0x7FFF)).sum()) > n // 8      # ties rounded down are present
    for t in range(2):
        gs = grads_for(3, t, runs[0][0], BF)
        kernel_step(runs[0][0], gs, runs[0][1], [0], hp)
        reference_step(runs[1][0], gs, runs[1][1], [0], hp)
    assert_equal(runs[0][0], runs[0][1], runs[1][0], runs[1][1])


def written_case(step, mv, hp_name, lr, value):
    """Parameters written to +-``value`` outside the optimizer with their old remainders kept
    (``written_values``), one step by ``step`` (kernel or reference) with moments ``mv``; returns (params,
    states, the written elements, the parameters before the step, their old remainders)."""
    hp = dict(HP[hp_name], lr=lr)
    p, rem, written = written_values(4133, 11, value)
    before = p.clone()
    st = C.init_coded_state(p, exp_avg_dtype=mv[0], exp_avg_sq_dtype=mv[1], store_param_remainders=True)
    st["master_remainder"].copy_(rem)
    gs = grads_for(4, 0, [p], BF)
    step([p], gs, [st], [0], hp)
    return [p], [st], written, before, rem


WRITTEN_MOMENTS = {"u8": (U8, U8), "bf16": (BF, BF), "u8/bf16": (U8, BF)}
# +-inf only with decoupled weight decay: under L2 an inf parameter makes an inf gradient, whose block of
# 8-bit codes is NaN by design ([Note: state codecs] 2), so "no NaN" would not hold for a reason of its own.
WRITTEN_CASES = [(v, h) for v in (0.0, math.inf) for h in ("adamw", "l2") if not (v == math.inf and h == "l2")]


@pytest.mark.parametrize("mv", list(WRITTEN_MOMENTS))
@pytest.mark.parametrize("value,hp_name", WRITTEN_CASES, ids=[f"{v}-{h}" for v, h in WRITTEN_CASES])
@pytest.mark.parametrize("lr", [0.0, 1e-2])
def test_parameters_written_to_zero_or_inf_keep_them(mv, value, hp_name, lr):
    """[Note: state codecs] 4: a bf16 parameter written to +-0 or +-inf outside the optimizer (``p.data``) keeps
    its old remainder; the join saturates (a negative remainder under +-0, a positive one under +-inf count as
    0) as the reference's does (every stored byte equal: the 16-bit-lane pair joins of AVX-512 / AVX2 in the
    8-bit and bf16 fused blocks, zk_c_join1 in the general block, the L2 term and the scalar path); then
    ``check_written``. A join that wraps makes those masters NaN."""
    ps, states, written, before, rem = written_case(kernel_step, WRITTEN_MOMENTS[mv], hp_name, lr, value)
    qs, refs, _, _, _ = written_case(reference_step, WRITTEN_MOMENTS[mv], hp_name, lr, value)
    assert_equal(ps, states, qs, refs)
    check_written(ps[0], states[0]["master_remainder"], written, before, rem, lr, value)


@pytest.mark.parametrize("m_dtype", [F32, F8], ids=["m=fp32", "m=f8"])
def test_f8_exp_avg_sq_floor(m_dtype, monkeypatch):
    """[Note: state codecs] 3: a nonzero v never codes to 0 in exp_avg_sq's float8 (the kernel's bits equal the
    reference's over two steps whose v spans 14 decades per block, then a zero gradient for half of them:
    ``f8_floor_run`` / ``check_f8_floor``). The negative control: the reference with exp_avg's code for v
    (no floor) moves the zero-gradient elements by m / (0 + eps), and check_f8_floor fails."""
    hp = HP["adamw"]
    init = lambda p: C.init_coded_state(p, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=F8)   # noqa: E731
    runs = [f8_floor_run(init, lambda ps, gs, sts, s=s: s(ps, gs, sts, list(range(len(ps))), hp), hp["lr"])
            for s in (kernel_step, reference_step)]
    assert_equal(runs[0][1], runs[0][3], runs[1][1], runs[1][3])
    check_f8_floor(*runs[0][:3], hp["lr"])
    monkeypatch.setitem(C._ENCODERS, ("exp_avg_sq", F8), C.encode_f8)
    wrong = f8_floor_run(init, lambda ps, gs, sts: reference_step(ps, gs, sts, list(range(len(ps))), hp), hp["lr"])
    with pytest.raises(AssertionError):
        check_f8_floor(*wrong[:3], hp["lr"])


def test_nan_masters_stay_nan_in_the_bf16_parameter():
    """A NaN fp32 master whose low 16 bits would round its bf16 copy up (0x7FFFFFFF -> 0x8000 is -0) stays NaN in
    the bf16 parameter (AVX-512 rounds two vectors in 16-bit lanes and applies the NaN rule only where one
    compare finds a NaN): lr = 0 keeps every master as it is. Masters and non-NaN parameters equal the reference;
    a NaN parameter's payload may differ from torch's cast (0x7FC0), as in test_nan_and_inf_gradients."""
    hp = dict(lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    nans = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF, 0x7FC18001, 0xFFC0FFFF], dtype=torch.int64)
    nans = nans - ((nans & 0x80000000) << 1)                            # as int32 bit patterns
    runs = []
    for _ in range(2):
        ps, states = setup(11, "bf16+master", U8, U8, [300, 1000])
        for s in states:
            master = s["master_param"]
            master.view(torch.int32)[7:7 + len(nans)] = nans.to(torch.int32)
            master.view(torch.int32)[260:260 + len(nans)] = nans.to(torch.int32)
        runs.append((ps, states))
    for t in range(2):
        gs = grads_for(4, t, runs[0][0], BF)
        kernel_step(runs[0][0], gs, runs[0][1], [0, 1], hp)
        reference_step(runs[1][0], gs, runs[1][1], [0, 1], hp)
    for p, s, q, r in zip(*runs[0], *runs[1]):
        nan = torch.isnan(r["master_param"])
        assert int(nan.sum()) == 2 * len(nans) and torch.equal(torch.isnan(s["master_param"]), nan)
        assert torch.equal(bits(s["master_param"][~nan]), bits(r["master_param"][~nan]))
        assert torch.equal(torch.isnan(p), nan) and torch.equal(torch.isnan(q), nan)
        assert torch.equal(bits(p[~nan]), bits(q[~nan]))
        for k in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
            assert torch.equal(bits(s[k]), bits(r[k])), k


def test_grad_scale_and_found_inf():
    ps, states = check("remainder", U8, BF, steps=2, sizes=[300, 1025], grad_scale=torch.tensor([0.25]))
    before = [p.clone() for p in ps], [{k: v.clone() for k, v in s.items() if k != "step"} for s in states]
    steps = [float(s["step"]) for s in states]
    kernel_step(ps, grads_for(7, 0, ps, BF), states, [0, 1], HP["adamw"], found_inf=torch.ones(1))
    assert [float(s["step"]) for s in states] == steps                  # torch counts a skipped step as 0
    for p, s, q, r in zip(ps, states, *before):
        assert torch.equal(bits(p), bits(q)) and all(torch.equal(bits(s[k]), bits(r[k])) for k in r)


_NEG_NAN = {BF: -0x40, F16: -0x200, F32: -0x400000}   # 0xFFC0, 0xFE00, 0xFFC00000 as signed integers


@pytest.mark.parametrize("layout,m_dtype,v_dtype", [("remainder", U8, U8), ("remainder", BF, F8), ("fp32", F8, BF),
                                                    ("bf16+master", U8, F8), ("fp32", F32, U8),
                                                    ("bf16+master", U8, U8), ("remainder", BF, BF),
                                                    ("bf16+master", BF, BF)])
def test_nan_and_inf_gradients(layout, m_dtype, v_dtype):
    """A NaN gradient poisons its element (and its 8-bit / fp8 block), infinities theirs, over two steps (the
    poisoned codes are decoded again): every state bit as the reference after each step (the first step's
    poisoned blocks take the 8-bit fast path, the second's the general one). Only the NaN payload of a 16-bit
    parameter written from an fp32 master may differ (the fp32 kernel's rounding rule vs torch's cast)."""
    ps, states = setup(1, layout, m_dtype, v_dtype, [600, 1030])
    qs, refs = setup(1, layout, m_dtype, v_dtype, [600, 1030])
    for t in range(2):
        gs = grads_for(3, t, ps, ps[0].dtype)
        gs[0][300], gs[1][5], gs[1][700] = float("nan"), float("inf"), -float("inf")
        if v_dtype == U8 and layout != "bf16+master":
            # alone in its block: a sign-bit NaN must poison the 8-bit v scale too (the kernel takes the max of
            # sqrt(v)'s bits unsigned). Not with an fp32 master or fp8 codes: there the kernel's NaN keeps the
            # sign (master 0xFFC00000, code 0xFF) where the reference's is positive (not a bit-level contract)
            gs[0].view(torch.int16 if gs[0].element_size() == 2 else torch.int32)[100] = _NEG_NAN[gs[0].dtype]
            assert bool(torch.isnan(gs[0][100])) and bool(torch.signbit(gs[0][100]))
        kernel_step(ps, gs, states, [0, 1], HP["adamw"])
        reference_step(qs, gs, refs, [0, 1], HP["adamw"])
        for p, s, q, r in zip(ps, states, qs, refs):
            assert all(torch.equal(bits(s[k]), bits(r[k])) for k in s), f"step {t + 1}"
            nan = torch.isnan(q)
            assert bool(nan.any()) and torch.equal(torch.isnan(p), nan)
            assert torch.equal(bits(p[~nan]), bits(q[~nan]))
            if LAYOUTS[layout][1]:
                assert torch.equal(bits(p), bits(q)), f"step {t + 1}"


@pytest.mark.parametrize("hp", ["adamw", "no bound"])
@pytest.mark.parametrize("layout", ["remainder", "fp32"])
def test_8bit_cap_on_zero_gradients_and_an_infinite_bound(layout, hp):
    """The cap on 8-bit m (one VRANGEPS on AVX-512 in the 8-bit block, the min / max form elsewhere) where
    sqrt(v) is 0 (gradients 0 from step 1: m_bound * 0 is 0, or NaN for an infinite bound, which must leave
    m) and where it binds: every state bit as the reference, on 3 steps."""
    ps, states = setup(5, layout, U8, U8, [257, 1000])
    qs, refs = setup(5, layout, U8, U8, [257, 1000])
    for t in range(3):
        gs = grads_for(6, t, ps, ps[0].dtype)
        gs[0][:40] = 0.0                          # v stays 0 here: the bound is 0 (inf * 0 for "no bound")
        gs[1][::97] = gs[1][::97] * 1e4           # a large gradient per block: small m decode coarsely
        kernel_step(ps, gs, states, [0, 1], HP[hp])
        reference_step(qs, gs, refs, [0, 1], HP[hp])
    assert_equal(ps, states, qs, refs)


def _run_threads(nthreads):
    old = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        ps, states = setup(4, "remainder", U8, BF, [70001, 257, 200000])
        for t in range(2):
            kernel_step(ps, grads_for(4, t, ps, BF), states, [0, 1, 2], HP["adamw"])
        return ps, states
    finally:
        torch.set_num_threads(old)


def test_one_and_two_threads_bitwise():
    a, b = _run_threads(1), _run_threads(2)
    assert_equal(a[0], a[1], b[0], b[1])


def test_multi_tensor_groups_and_non_contiguous_parameter():
    """Tensors of several layouts in one step (one kernel call per group) and a transposed parameter."""
    base = torch.randn(40, 30).to(BF)
    p, q = base.t(), base.clone().t()
    fmts = [dict(exp_avg_dtype=U8, exp_avg_sq_dtype=BF, store_param_remainders=True),
            dict(exp_avg_dtype=F8, exp_avg_sq_dtype=U8)]
    extra = [torch.randn(513).to(BF), torch.randn(700).to(BF)]
    ps, qs = [p] + extra, [q] + [e.clone() for e in extra]
    ss = [C.init_coded_state(x, **fmts[i % 2]) for i, x in enumerate(ps)]
    rs = [C.init_coded_state(x, **fmts[i % 2]) for i, x in enumerate(qs)]
    gs = [torch.randn(40, 30).to(BF).t()] + [torch.randn(e.shape).to(BF) for e in extra]
    kernel_step(ps, gs, ss, [0, 1, 2], HP["adamw"])
    reference_step(qs, gs, rs, [0, 1, 2], HP["adamw"])
    assert_equal(ps, ss, qs, rs)


ISA_SCRIPT = textwrap.dedent("""
    import hashlib, json, sys, torch
    sys.path.insert(0, {tests!r})
    import test_cpu_coded as T
    from zero_kernels import _ext
    out = {{"isa": _ext.cpu_module().cpu_isa()}}
    torch.set_num_threads(2)
    # the special-value tests, on this path (the 16-bit-lane pair ops differ between AVX-512 and AVX2)
    T.test_remainder_split_on_ties_and_special_values(4133)
    T.test_nan_masters_stay_nan_in_the_bf16_parameter()
    for mv in T.WRITTEN_MOMENTS:
        for value, hp_name in T.WRITTEN_CASES:
            T.test_parameters_written_to_zero_or_inf_keep_them(mv, value, hp_name, 0.0)
            T.test_parameters_written_to_zero_or_inf_keep_them(mv, value, hp_name, 1e-2)
    T.test_nan_and_inf_gradients("remainder", T.U8, T.U8)
    for m, v, layout, gdt in ((T.U8, T.U8, "remainder", T.BF), (T.F8, T.BF, "fp32", T.F32),
                              (T.BF, T.F8, "fp16+master", T.F16), (T.F32, T.U8, "bf16+master", T.BF),
                              (T.U8, T.U8, "bf16+master", T.BF)):
        ps, states = T.check(layout, m, v, gdt=gdt, hp="l2+max" if m == T.F8 else "adamw", steps=2,
                             sizes=[1, 255, 257, 5000])
        h = hashlib.sha256()
        for p, s in zip(ps, states):
            h.update(T.bits(p).numpy().tobytes())
            for k in sorted(s):
                h.update(T.bits(s[k]).numpy().tobytes())
        out[f"{{m}}/{{v}}/{{layout}}"] = h.hexdigest()
    for layout in ("remainder", "fp32"):   # the cap on 8-bit m (VRANGEPS on AVX-512), on this path
        for hp in ("adamw", "no bound"):
            T.test_8bit_cap_on_zero_gradients_and_an_infinite_bound(layout, hp)
    for hp in ("bc2=0.5", "bc2=1"):     # the bias correction's division as a multiply, on this path
        T.check("remainder", T.U8, T.U8, gdt=T.BF, hp=hp, steps=2, sizes=[1, 257, 5000])
        T.check("fp32", T.BF, T.U8, hp=hp, steps=2, sizes=[1, 257, 5000])
    print(json.dumps(out))
""")


def test_every_simd_path_bitwise():
    """avx512, avx2 and scalar (ZERO_KERNELS_CPU_ISA; an unsupported one is lowered) each equal the reference
    (the script asserts it, and runs the tie / NaN tests above on that path) and give the same bits."""
    script = ISA_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for isa in ("avx512", "avx2", "scalar"):
        r = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, ZERO_KERNELS_CPU_ISA=isa),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads(r.stdout.strip().splitlines()[-1])
        results[res.pop("isa")] = res
    assert "scalar" in results
    vals = list(results.values())
    assert all(v == vals[0] for v in vals), results


@pytest.mark.parametrize("fmt", [dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=True),
                                 dict(exp_avg_dtype=F8, exp_avg_sq_dtype=BF),
                                 dict(exp_avg_dtype=BF, exp_avg_sq_dtype=U8, min_8bit_size=1)])
def test_optimizer_cpu_equals_reference(fmt):
    def run(backend):
        g = torch.Generator().manual_seed(5)
        ps = [torch.randn(s, generator=g).to(BF).requires_grad_() for s in [(7, 3), (255,), (33, 129), (1000,)]]
        opt = zk.FusedAdamW(ps, lr=1e-2, weight_decay=0.1, backend=backend, **fmt)
        for t in range(3):
            for p, gr in zip(ps, grads_for(6, t, ps, BF)):
                p.grad = gr
            opt.step()
        assert opt.backend == {"cpu": backend}
        return ps, [opt.state[p] for p in ps]
    assert_equal(*run("cpu"), *run("reference"))


def test_large_tensor_codes_are_staggered_views_of_one_buffer(tmp_path):
    """[Note: staggered code arrays]: a large CPU tensor's two 1-byte code arrays share one buffer, exp_avg_sq
    CODE_STAGGER bytes past a 4 KB boundary after exp_avg's end; the kernel on that layout equals the reference,
    and a state dict saved from it (one storage) resumes bit for bit. A small tensor and bf16 moments keep separate
    arrays (negative controls of the layout check)."""
    n = C.CODE_PACK_MIN + 3
    fmt = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=True)

    def make(backend, sizes=(n, 1000)):
        g = torch.Generator().manual_seed(11)
        ps = [torch.randn(s, generator=g).to(BF).requires_grad_() for s in sizes]
        return ps, zk.FusedAdamW(ps, lr=1e-2, weight_decay=0.1, backend=backend, **fmt)

    def steps(ps, opt, ts):
        for t in ts:
            for p, gr in zip(ps, grads_for(9, t, ps, BF)):
                p.grad = gr
            opt.step()

    def shares(st):
        m, v = st["exp_avg"], st["exp_avg_sq"]
        return m.untyped_storage().data_ptr() == v.untyped_storage().data_ptr(), v.data_ptr() - m.data_ptr()

    (ps, opt), (qs, ref) = make("cpu"), make("reference")
    steps(ps, opt, range(2))
    steps(qs, ref, range(2))
    assert_equal(ps, [opt.state[p] for p in ps], qs, [ref.state[q] for q in qs])
    same, delta = shares(opt.state[ps[0]])
    assert same and delta >= n and delta % 4096 == C.CODE_STAGGER
    assert opt.state[ps[0]]["exp_avg"].is_contiguous() and opt.state[ps[0]]["exp_avg_sq"].is_contiguous()
    assert not shares(opt.state[ps[1]])[0], "a 1000-element tensor should keep separate code arrays"
    bf = C.init_coded_state(torch.zeros(n, dtype=BF), exp_avg_dtype=BF, exp_avg_sq_dtype=BF)
    assert not shares(bf)[0], "2-byte moments should keep separate arrays"

    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    ps2, opt2 = make("cpu")
    for p, q in zip(ps2, ps):
        p.data.copy_(q.data)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    steps(ps, opt, [2])
    steps(ps2, opt2, [2])
    assert_equal(ps, [opt.state[p] for p in ps], ps2, [opt2.state[p] for p in ps2])


# ------------------------------------------------------------------------------------- negative controls
@pytest.mark.parametrize("wrong", ["v8 square root", "m8 truncated", "seed"])
def test_negative_controls(wrong, monkeypatch):
    """The comparison catches a kernel that codes v in the square-root domain, truncates m's codes, or draws
    other stochastic-rounding bits: each such reference run differs from the kernel's."""
    ps, states = setup(8, "fp32", U8, U8 if wrong != "seed" else BF, [1025, 300])
    qs, refs = setup(8, "fp32", U8, U8 if wrong != "seed" else BF, [1025, 300])
    gs = grads_for(9, 0, ps, F32)
    kernel_step(ps, gs, states, [1, 0] if wrong == "seed" else [0, 1], HP["adamw"])
    if wrong in WRONG:
        monkeypatch.setitem(C._ENCODERS, *WRONG[wrong])
    reference_step(qs, gs, refs, [0, 1], HP["adamw"])
    with pytest.raises(AssertionError, match="differs"):
        assert_equal(ps, states, qs, refs)


# ------------------------------------------------------------------------------------- argument errors
def _args(n=300, m_dtype=U8):
    p = torch.randn(n).to(BF)
    st = C.init_coded_state(p, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=BF, store_param_remainders=True)
    return dict(masters=[st["master_remainder"]], grads=[torch.randn(n).to(BF)], exp_avgs=[st["exp_avg"]],
                exp_avg_sqs=[st["exp_avg_sq"]], exp_avg_scales=[st["exp_avg_scale"]] if "exp_avg_scale" in st else [],
                exp_avg_sq_scales=[], params16=[p], coeffs=torch.tensor([[1e-2, 0.5, 1.0]]),
                keys=torch.zeros(1, 3, dtype=torch.int64))


@pytest.mark.parametrize("change,msg", [
    (dict(exp_avgs=[torch.zeros(300, dtype=torch.int8)]), "exp_avgs must be float32, bfloat16, uint8"),
    (dict(grads=[torch.zeros(300, dtype=torch.float64)]), "grads must be float32, bfloat16 or float16"),
    (dict(masters=[torch.zeros(300, dtype=torch.int32)]), "masters must be float32"),
    (dict(exp_avg_scales=[]), r"exp_avg_scales needs one fp32 scale tensor per parameter"),
    (dict(exp_avg_scales=[torch.zeros(1)]), r"exp_avg_scales\[0\] has 1 scales but masters\[0\] has 300"),
    (dict(exp_avg_sq_scales=[torch.zeros(2)]), "exp_avg_sq_scales must be empty"),
    (dict(grads=[torch.zeros(299, dtype=BF)]), r"grads\[0\] has 299 elements but masters\[0\] has 300"),
    (dict(params16=[]), "params16 must hold the T bf16 parameters"),
    (dict(params16=[torch.zeros(300, dtype=F16)]), "params16 must be bfloat16"),
    (dict(keys=torch.zeros(1, 3)), "keys must be a contiguous int64 tensor"),
    (dict(coeffs=torch.zeros(2, 3)), "coeffs must be a contiguous float32 tensor of shape"),
])
def test_front_end_argument_errors(change, msg):
    a = _args() | change
    with pytest.raises(RuntimeError, match=msg):
        CPP.fused_adam_coded_cpu(**a, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True,
                                 maximize=False)


def test_front_end_refuses_non_contiguous_and_bad_scales_dtype():
    a = _args()
    a["grads"] = [torch.zeros(600, dtype=BF)[::2]]
    with pytest.raises(RuntimeError, match=r"grads\[0\] is not contiguous"):
        CPP.fused_adam_coded_cpu(**a, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, maximize=False)
    a = _args()
    a["exp_avg_scales"] = [torch.zeros(2, dtype=F16)]
    with pytest.raises(RuntimeError, match=r"exp_avg_scales\[0\] has dtype"):
        CPP.fused_adam_coded_cpu(**a, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, maximize=False)



@pytest.mark.parametrize("m_dtype", [F32, F8], ids=["m=fp32", "m=f8"])
def test_f8_saturates_under_subnormal_scales(m_dtype, monkeypatch):
    """[Note: state codecs] 3: float8 codes saturate at 448. Gradients so small that the block scales are
    subnormal (``f8_subnormal_run``): the kernel's bits equal the reference's over three steps, and no state holds
    a NaN code (``check_f8_subnormal``). The negative control: the reference with c10's unsaturated cast (>= 464
    -> NaN, what the kernels did) turns blocks NaN, and the check fails."""
    hp = HP["adamw"]
    init = lambda p: C.init_coded_state(p, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=F8)   # noqa: E731
    runs = [f8_subnormal_run(init, lambda ps, gs, sts, s=s: s(ps, gs, sts, list(range(len(ps))), hp))
            for s in (kernel_step, reference_step)]
    assert_equal(runs[0][0], runs[0][1], runs[1][0], runs[1][1])
    check_f8_subnormal(*runs[0])
    for key in ("exp_avg", "exp_avg_sq"):
        monkeypatch.setitem(C._ENCODERS, (key, F8), wrong_f8_unsaturated)
    wrong = f8_subnormal_run(init, lambda ps, gs, sts: reference_step(ps, gs, sts, list(range(len(ps))), hp))
    with pytest.raises(AssertionError):
        check_f8_subnormal(*wrong)
