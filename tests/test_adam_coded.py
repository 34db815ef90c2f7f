"""kernels/adam_coded.py (interpreted: the code under test) against zero_kernels.codecs.adam_step_coded, the
definition: every stored byte equal, for every state kind, odd sizes, partial last blocks, several steps,
grad_scale and found_inf, and a non-contiguous parameter; negative controls show the comparison catches a
round-to-nearest bf16 moment, a wrong seed and a wrong code book."""
import pytest
import torch

from zero_kernels import codecs as C
from zero_kernels.kernels.adam_coded import adam_step_coded_triton

BF, U8, F8, F32 = torch.bfloat16, torch.uint8, torch.float8_e4m3fn, torch.float32
SIZES = [1, 255, 256, 257, 1023, 1025, 4099, 5000]   # below a block, a block, partial blocks, two chunks
KINDS = [F32, BF, U8, F8]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def setup(seed, dtype, remainders, m_dtype, v_dtype, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    fmt = dict(exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype, store_param_remainders=remainders)
    return ps, [C.init_coded_state(p, **fmt) for p in ps]


def grads(seed, t, ps):
    g = torch.Generator().manual_seed(seed * 100 + t)
    return [(torch.randn(p.shape, generator=g) * 10.0 ** float(torch.randint(-4, 1, (), generator=g))).to(p.dtype)
            for p in ps]


def run(ps, states, steps, seed, triton, rounding="stochastic", m_code=C.M_CODE, seeds=None, **kw):
    seeds = seeds or list(range(len(ps)))
    for t in range(steps):
        gs = grads(seed, t, ps)
        if triton:
            adam_step_coded_triton(ps, gs, states, seeds, lr=HP["lr"], beta1=HP["beta1"], beta2=HP["beta2"],
                                   eps=HP["eps"], weight_decay=HP["weight_decay"], adamw=HP["adamw"], **kw)
        else:
            for p, g, s, sd in zip(ps, gs, states, seeds):
                C.adam_step_coded(p, g, s, seed=sd, bf16_rounding=rounding, m_code=m_code, **HP, **kw)


def assert_equal(ps, states, qs, rs):
    for i, (p, s, q, r) in enumerate(zip(ps, states, qs, rs)):
        assert torch.equal(bits(p), bits(q)), f"param {i} ({p.numel()} elements) differs"
        for k in s:
            assert torch.equal(bits(s[k]), bits(r[k])), f"param {i} ({p.numel()} elements): state {k!r} differs"


def check(seed, dtype, rem, m_dtype, v_dtype, steps):
    ps, states = setup(seed, dtype, rem, m_dtype, v_dtype)
    qs, refs = setup(seed, dtype, rem, m_dtype, v_dtype)
    run(ps, states, steps, seed + 1, triton=True)
    run(qs, refs, steps, seed + 1, triton=False)
    assert_equal(ps, states, qs, refs)


@pytest.mark.parametrize("m_dtype", KINDS, ids=["m=fp32", "m=bf16", "m=u8", "m=f8"])
@pytest.mark.parametrize("v_dtype", [BF, U8, F8], ids=["v=bf16", "v=u8", "v=f8"])
@pytest.mark.parametrize("layout", ["remainder", "bf16+master", "fp32"])
def test_kernel_equals_codec_definition(m_dtype, v_dtype, layout):
    dtype, rem = {"remainder": (BF, True), "bf16+master": (BF, False), "fp32": (F32, False)}[layout]
    check(1, dtype, rem, m_dtype, v_dtype, 3)


def test_fp32_moments_with_remainders_and_fp16_masters():
    check(3, BF, True, F32, F32, 4)
    check(3, torch.float16, False, F32, F32, 4)


def test_grad_scale_and_found_inf():
    ps, states = setup(5, BF, True, U8, BF, sizes=[300, 1025])
    qs, refs = setup(5, BF, True, U8, BF, sizes=[300, 1025])
    run(ps, states, 2, 6, triton=True, grad_scale=torch.tensor([0.25]))
    run(qs, refs, 2, 6, triton=False, grad_scale=torch.tensor([0.25]))
    assert_equal(ps, states, qs, refs)
    before = [p.clone() for p in ps], [{k: v.clone() for k, v in s.items()} for s in states]
    run(ps, states, 1, 7, triton=True, found_inf=torch.ones(1))
    assert_equal(ps, states, *before)


def test_non_contiguous_parameter_and_gradient():
    base = torch.randn(40, 30).to(BF)
    p, q = base.t(), base.clone().t()
    s, r = (C.init_coded_state(x, exp_avg_dtype=U8, exp_avg_sq_dtype=BF, store_param_remainders=True) for x in (p, q))
    g = torch.randn(40, 30).to(BF).t()
    adam_step_coded_triton([p], [g], [s], [0], **HP)
    C.adam_step_coded(q, g, r, seed=0, **HP)
    assert torch.equal(bits(p), bits(q)) and all(torch.equal(bits(s[k]), bits(r[k])) for k in s)


@pytest.mark.parametrize("wrong", ["nearest", "seed", "code book"])
def test_negative_controls(wrong):
    """The comparison above catches a kernel that rounds bf16 to nearest, uses other random bits, or
    another code book: each such reference run differs from the kernel's."""
    m_dtype = U8 if wrong == "code book" else BF
    ps, states = setup(8, F32, False, m_dtype, BF, sizes=[1025, 300])
    qs, refs = setup(8, F32, False, m_dtype, BF, sizes=[1025, 300])
    run(ps, states, 2, 9, triton=True)
    kw = {"nearest": dict(rounding="nearest"), "seed": dict(seeds=[1, 0]),
          "code book": dict(m_code="linear_signed")}[wrong]
    run(qs, refs, 2, 9, triton=False, **kw)
    with pytest.raises(AssertionError, match="differs"):
        assert_equal(ps, states, qs, refs)


@pytest.mark.parametrize("dtype,rem,m_dtype,v_dtype", [(BF, True, U8, U8), (BF, True, BF, F8), (F32, False, F8, BF),
                                                       (BF, False, U8, F8)])
def test_nan_and_inf_gradients(dtype, rem, m_dtype, v_dtype):
    """A NaN gradient poisons its element (and its 8-bit / fp8 block), infinities theirs, over two steps: every
    state bit as the reference (a NaN block scale is torch.amax's canonical 0x7FC00000). Only the NaN payload of a bf16 parameter written from an fp32 master may differ (the fp32 kernel's
    rule, adam.py's round_bf16_bits, vs torch's CPU cast): there both must be NaN."""
    ps, states = setup(1, dtype, rem, m_dtype, v_dtype, sizes=[600, 1030])
    qs, refs = setup(1, dtype, rem, m_dtype, v_dtype, sizes=[600, 1030])
    for t in range(2):   # the second step decodes the poisoned codes (an fp8 NaN decodes to 0x7FF00000)
        gs = grads(3, t, ps)
        gs[0][300], gs[1][5], gs[1][700] = float("nan"), float("inf"), -float("inf")
        adam_step_coded_triton(ps, gs, states, [0, 1], **HP)
        for q, g, r, sd in zip(qs, gs, refs, [0, 1]):
            C.adam_step_coded(q, g, r, seed=sd, **HP)
    for p, s, q, r in zip(ps, states, qs, refs):
        assert all(torch.equal(bits(s[k]), bits(r[k])) for k in s)
        nan = torch.isnan(q)
        assert bool(nan.any()) and torch.equal(torch.isnan(p), nan)
        assert torch.equal(bits(p[~nan]), bits(q[~nan]))
        if rem:
            assert torch.equal(bits(p), bits(q))
