"""Coded optimizer states (issue 11) on CUDA: FusedAdam/FusedAdamW with backend="cuda" (csrc/cuda_adam_coded.cu)
and backend="triton" (kernels/adam_coded.py) against backend="reference" (codecs.adam_step_coded, run by torch on
the same GPU), bit for bit: every state tensor (step, codes, block scales, bf16 moments, remainders, fp32 masters)
and every parameter, over several steps.

Covered: each (exp_avg, exp_avg_sq) format pair of fp32 / bf16 (stochastic rounding) / uint8 / float8_e4m3fn with
each master layout (fp32 parameters, bf16 or fp16 parameters with an fp32 master, bf16 parameters with int16
remainders); sizes below one block, partial last blocks and several CUDA blocks; tensors below min_8bit_size (fp32
moments in the same group: two layouts in one step); gradients at unaligned addresses (the kernels' element-wise
path); fp32 / bf16 / fp16 gradients (with the parameters' dtype); GradScaler's grad_scale and a found_inf that skips the
step; a NaN gradient (NaN block scales and codes); parameters written to +-0 and +-inf through ``p.data`` (the remainder
join saturates); float8 exp_avg_sq over 14 decades of v (its floor); the arithmetic uint8 codes of [Note: state
codecs] 2 at their edges
(round-half-even ties of exp_avg, every exp_avg_sq code and values just above them, all-zero, subnormal
and overflowing blocks, inf and NaN blocks, a partial last block).

Run on a GPU: ``TRITON_INTERPRET=0 python -m pytest tests/gpu/test_gpu_coded.py -q -rs``.
"""
import math

import pytest
import torch

import _gpu
import zero_kernels as zk

pytestmark = _gpu.MARKS

BF, F16, U8, F8, F32 = torch.bfloat16, torch.float16, torch.uint8, torch.float8_e4m3fn, torch.float32
MOMENTS = {"f32": F32, "bf16": BF, "u8": U8, "f8": F8}
# (parameter dtype, store_param_remainders): fp32 parameters are their own master.
MASTERS = {"fp32": (F32, False), "bf16+master": (BF, False), "fp16+master": (F16, False), "bf16+rem": (BF, True)}
# Below one block, one block, a partial last block, a CUDA block (2048) and more, a Triton chunk (4096) and more.
SHAPES = [(1,), (7, 3), (255,), (256,), (257,), (1003,), (33, 129), (2048,), (2049,), (4097,), (64, 257)]
HP = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw=True),
      dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.03, adamw=False, maximize=True)]
BACKENDS = ("cuda", "triton")


def _backend(name):
    """Skip, saying why, when ``name`` cannot run coded states on this GPU (extension not built, triton
    missing); a backend that is present but refuses coded states fails the test."""
    why = _gpu.why_no_gpu()
    if why is None:
        from zero_kernels import backends
        why = backends.why_unavailable(name, torch.device("cuda"))
    if why:
        pytest.skip(f"{name}: {why}")
    return name


def _at_odd_offset(x):
    """``x`` copied into a flat buffer at element offset 1: contiguous, but not 16-byte aligned (the kernels'
    element-wise path), as a gradient bucket or a flat parameter buffer can hold it."""
    buf = torch.zeros(x.numel() + 3, dtype=x.dtype, device=x.device)
    buf[1:1 + x.numel()] = x.reshape(-1)
    return buf[1:1 + x.numel()].view(x.shape)


def _params(seed, dtype, unaligned=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = [torch.randn(s, generator=g, device="cuda").to(dtype) for s in SHAPES]
    return [torch.nn.Parameter(_at_odd_offset(p) if unaligned else p) for p in out]


def _grads(seed, step, params, unaligned=False):
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + step)
    out = [(torch.randn(p.shape, generator=g, device="cuda") * 10.0 ** (step % 3 - 2)).to(p.dtype) for p in params]
    return [_at_odd_offset(x) if unaligned else x for x in out]


def _run(backend, dtype, hp, fmt, steps=3, seed=1, unaligned=False, scales=None, nan_at=None):
    """Parameters and optimizer after ``steps`` steps; ``scales[t]`` = (loss scale, found_inf) tensors or None;
    ``nan_at`` = (step, element): that gradient element of tensor 5 is NaN at that step."""
    params = _params(seed, dtype, unaligned)
    cls = zk.FusedAdamW if hp["adamw"] else zk.FusedAdam
    opt = cls(params, backend=backend, **{k: v for k, v in hp.items() if k != "adamw"}, **fmt)
    for t in range(steps):
        for p, g in zip(params, _grads(seed, t, params, unaligned)):
            p.grad = g
        if nan_at is not None and nan_at[0] == t:
            params[5].grad.view(-1)[nan_at[1]] = float("nan")
        gs, fi = (scales[t] if scales else None) or (None, None)
        opt.step(grad_scale=gs, found_inf=fi)
    torch.cuda.synchronize()
    return params, opt


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_same(run, ref, what):
    (pa, oa), (pb, ob) = run, ref
    for i, (p, q) in enumerate(zip(pa, pb)):
        sa, sb = oa.state[p], ob.state[q]
        assert set(sa) == set(sb), (what, i, sorted(sa), sorted(sb))
        for k in sorted(sb):
            assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, (what, i, k)
            assert torch.equal(_bits(sa[k]), _bits(sb[k])), f"{what}: param {i} {tuple(p.shape)} state {k!r} differs"
        assert torch.equal(_bits(p), _bits(q)), f"{what}: param {i} {tuple(p.shape)} differs"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("master", list(MASTERS))
@pytest.mark.parametrize("v", list(MOMENTS))
@pytest.mark.parametrize("m", list(MOMENTS))
def test_every_format_equals_reference(backend, master, m, v):
    """Each moment pair x master layout, AdamW and Adam(L2, maximize), default min_8bit_size (tensors under one
    block keep fp32 moments: two layouts in a group)."""
    backend = _backend(backend)
    dtype, rem = MASTERS[master]
    fmt = dict(exp_avg_dtype=MOMENTS[m], exp_avg_sq_dtype=MOMENTS[v], store_param_remainders=rem)
    for hpi, hp in enumerate(HP):
        what = f"{backend} m={m} v={v} {master} hp{hpi}"
        _assert_same(_run(backend, dtype, hp, fmt), _run("reference", dtype, hp, fmt), what)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("master", list(MASTERS))
@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
def test_every_block_coded_and_unaligned_tensors(backend, master, unaligned):
    """min_8bit_size=1 (even 1-element tensors are coded; blocks counted from element 0), and parameters and
    gradients at unaligned addresses (the element-wise path); fp32 / bf16 / fp16 gradients with the parameters."""
    backend = _backend(backend)
    dtype, rem = MASTERS[master]
    for fmt in (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=F8), dict(exp_avg_dtype=BF, exp_avg_sq_dtype=U8),
                dict(exp_avg_dtype=F8, exp_avg_sq_dtype=BF)):
        fmt = dict(fmt, store_param_remainders=rem, min_8bit_size=1)
        _assert_same(_run(backend, dtype, HP[0], fmt, unaligned=unaligned),
                     _run("reference", dtype, HP[0], fmt, unaligned=unaligned), f"{backend} {master} {fmt} {unaligned}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8),
                                 dict(exp_avg_dtype=F8, exp_avg_sq_dtype=BF, store_param_remainders=True)],
                         ids=["u8", "f8-bf16-rem"])
def test_grad_scale_and_found_inf(backend, fmt):
    """GradScaler's contract: gradients divided by the loss scale (a device tensor); a nonzero found_inf (a device
    tensor, not read on the host by the kernels) skips the whole step: nothing written, the step not counted."""
    backend = _backend(backend)
    dtype = BF if fmt.get("store_param_remainders") else F32
    dev = dict(device="cuda", dtype=torch.float32)
    scales = [(torch.tensor(1024.0, **dev), torch.zeros(1, **dev)), (torch.tensor(3.0, **dev), torch.zeros(1, **dev)),
              (torch.tensor(2048.0, **dev), torch.ones(1, **dev)), None]
    ours = _run(backend, dtype, HP[1], fmt, steps=4, scales=scales)
    _assert_same(ours, _run("reference", dtype, HP[1], fmt, steps=4, scales=scales), f"{backend} {fmt}")
    assert all(float(ours[1].state[p]["step"]) == 3 for p in ours[0])
    # The skipped step itself wrote nothing.
    params, opt = _run(backend, dtype, HP[1], fmt, steps=2, scales=scales)
    before = [(_bits(p).clone(), {k: _bits(t).clone() for k, t in opt.state[p].items()}) for p in params]
    for p, g in zip(params, _grads(1, 2, params)):
        p.grad = g
    opt.step(grad_scale=scales[2][0], found_inf=scales[2][1])
    for i, (p, (pb, sb)) in enumerate(zip(params, before)):
        assert torch.equal(_bits(p), pb), f"param {i} changed on a skipped step"
        assert all(torch.equal(_bits(opt.state[p][k]), b) for k, b in sb.items()), f"state {i} changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [dict(exp_avg_dtype=U8, exp_avg_sq_dtype=F8),
                                 dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF, store_param_remainders=True)],
                         ids=["u8-f8", "bf16-rem"])
def test_nan_gradient(backend, fmt):
    """A NaN gradient element: its block's scales (uint8: the canonical NaN 0x7FC00000, float8: NaN / 448), codes
    (uint8: 0, the inverse scale being 0; float8: 0x7F), bf16 moments (0x7FC0) and remainders (0x7FC0, 0) exactly as
    the reference writes them, the other blocks unaffected. Bit for bit including NaN
    payloads: every NaN that is stored comes out of an fp32 operation, and a GPU returns the canonical NaN
    0x7FFFFFFF from each (x86 propagates an operand's payload instead: on the CPU, the Triton interpreter's
    decoded float8 NaN keeps another payload than torch's, so this comparison is for GPUs only)."""
    backend = _backend(backend)
    dtype = BF if fmt.get("store_param_remainders") else F32
    ours = _run(backend, dtype, HP[0], fmt, nan_at=(1, 300))
    _assert_same(ours, _run("reference", dtype, HP[0], fmt, nan_at=(1, 300)), f"{backend} {fmt} NaN")
    p = ours[0][5]
    assert torch.isnan(p.detach().float().reshape(-1)[300]) and not torch.isnan(p.detach().float().reshape(-1)[0])


def _edge_grads(dtype):
    """A first-step gradient whose moments hit the edges of the uint8 codes. With beta1 = 0.5, beta2 = 0.75 and
    zero initial moments the first step stores m = g / 2 and v = (g / 4) * g, so s = sqrt(v) = |g| / 2 up to the
    roundings of g * g and the square root. Blocks of 256 (every value exact in bf16 too, except where noted):
      0  m / scale * 127 = j + 1/2 for j in -127..126: every round-half-even tie (scale 127/8, inverse 8 exactly)
      1  |g| = j^2 / 32 for j in 0..255 with alternating signs: s over 16 octaves below its max, codes 1..255
      2  block 1 times (1 + 2^-20) below its unchanged maximum (fp32 only)
      3  zeros: scale 0, inverse 0, codes 0
      4  m subnormal, |m| <= 1e-38: 127 / scale overflows, inverse 0, codes 0; v underflows to 0
      5  v subnormal (|g| ~ 2e-21), s normal: no flush to zero anywhere
      6  |g| up to 3.4e38 and one +inf: v overflows, the v (and m) scale is inf, inverse 0
      7  a partial block of 100 with a NaN: canonical NaN scales"""
    j = torch.arange(256, dtype=torch.float64)
    ties = torch.cat([torch.arange(-127, 127, dtype=torch.float64) + 0.5, torch.tensor([127.0, -127.0])]) / 4
    sign = 1 - 2 * (j % 2)
    exact = sign * j * j / 32
    above = exact * torch.where(j == 255, 1.0, 1 + 2.0 ** -20)
    gen = torch.Generator().manual_seed(5)
    tiny = torch.randn(256, generator=gen, dtype=torch.float64).clamp(-2, 2) * 1e-38
    subnormal_v = torch.randn(256, generator=gen, dtype=torch.float64) * 2e-21
    huge = (torch.rand(256, generator=gen, dtype=torch.float64) * 2 - 1) * 3.4e38
    huge[7], huge[8] = float("inf"), -3.4e38
    tail = torch.randn(100, generator=gen, dtype=torch.float64)
    tail[42] = float("nan")
    g = torch.cat([ties, exact, above, torch.zeros(256), tiny, subnormal_v, huge, tail]).float()
    return g.to("cuda", dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("master", ["fp32", "bf16+rem"])
def test_uint8_codes_at_their_edges(backend, master):
    """uint8 exp_avg and exp_avg_sq ([Note: state codecs] 2) from the edge gradient of :func:`_edge_grads`, then two
    ordinary steps that decode those codes (negative int8 codes, zero, inf and NaN scales), bit for bit against the
    reference: a kernel rounding ties away from zero, coding sqrt(v) linearly instead of its log code, not raising a
    nonzero v's code to 1, flushing subnormals or keeping a non-canonical NaN scale differs here."""
    backend = _backend(backend)
    dtype, rem = MASTERS[master]
    fmt = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=rem, min_8bit_size=1)
    hp = dict(lr=1e-3, betas=(0.5, 0.75), eps=1e-8, weight_decay=0.0)
    first = _edge_grads(dtype)

    def run(name):
        gen = torch.Generator(device="cuda").manual_seed(11)
        params = [torch.nn.Parameter(torch.randn(first.shape, generator=gen, device="cuda").to(dtype))]
        opt = zk.FusedAdamW(params, backend=name, **hp, **fmt)
        for t in range(3):
            params[0].grad = first.clone() if t == 0 else torch.randn(first.shape, generator=gen, device="cuda").to(dtype)
            opt.step()
        torch.cuda.synchronize()
        return params, opt

    ours, ref = run(backend), run("reference")
    _assert_same(ours, ref, f"{backend} {master} uint8 edges")
    # The edges were reached: after step 1 the reference's codes show the ties and the special blocks.
    params = [torch.nn.Parameter(torch.zeros(first.shape, device="cuda", dtype=dtype))]
    opt = zk.FusedAdamW(params, backend="reference", **hp, **fmt)
    params[0].grad = first.clone()
    opt.step()
    st = opt.state[params[0]]
    m_codes = st["exp_avg"].view(torch.int8)[:256].tolist()
    assert m_codes[:6] == [-126, -126, -124, -124, -122, -122], m_codes[:6]   # -126.5 -> -126, -125.5 -> -126, ...
    scale = st["exp_avg_sq_scale"].view(torch.int32).tolist()
    assert scale[3] == 0 and scale[6] == 0x7F800000 and scale[7] == 0x7FC00000, [hex(x & 0xFFFFFFFF) for x in scale]
    assert int(st["exp_avg"][4 * 256:5 * 256].count_nonzero()) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8), dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF),
                                 dict(exp_avg_dtype=F32, exp_avg_sq_dtype=F32)], ids=["u8", "bf16", "f32"])
def test_parameters_written_to_zero_or_inf_through_data(backend, fmt):
    """[Note: state codecs] 4: after two steps, every other element of each bf16 parameter is written to +-0
    and every fourth (from 1) to +-inf through ``p.data`` (no version counter, no refresh_fp32_params()): the
    old remainders stay, and the join saturates (a negative remainder under +-0, a positive one under +-inf
    count as 0; a wrapping join makes NaN masters) as the reference's does; two more steps bit for bit, no
    NaN, the zeros within two steps of 0, every written inf over a remainder >= 0 still that inf."""
    backend = _backend(backend)
    fmt = dict(fmt, store_param_remainders=True, min_8bit_size=1)
    runs = []
    for b in (backend, "reference"):
        params, opt = _run(b, BF, HP[0], fmt, steps=2)
        kept = []
        for p in params:
            w = p.data.view(-1)
            w[0::2] = torch.where(torch.arange(w[0::2].numel(), device="cuda") % 2 == 0, 0.0, -0.0).to(BF)
            w[1::4] = torch.where(torch.arange(w[1::4].numel(), device="cuda") % 2 == 0, math.inf, -math.inf).to(BF)
            kept.append((w[1::4].float(), opt.state[p]["master_remainder"].view(-1)[1::4] >= 0))
        for t in (2, 3):
            for p, g in zip(params, _grads(1, t, params)):
                p.grad = g
            opt.step()
        torch.cuda.synchronize()
        runs.append((params, opt, kept))
    _assert_same(runs[0][:2], runs[1][:2], f"{backend} {fmt} written zeros and infs")
    n_kept = 0
    for p, (inf, kept) in zip(runs[0][0], runs[0][2]):
        w = p.detach().float().view(-1)
        # two Adam steps from 0: each at most lr (1 - beta1) / sqrt(1 - beta2) = 3.2 lr (the old values are ~1)
        assert not w.isnan().any() and float(w[0::2].abs().max()) <= 2 * 3.2 * HP[0]["lr"]
        assert torch.equal(w[1::4][kept], inf[kept])
        n_kept += int(kept.sum())
    assert n_kept > 100


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m_dtype", [F32, F8], ids=["m=fp32", "m=f8"])
def test_f8_exp_avg_sq_floor(backend, m_dtype):
    """[Note: state codecs] 3: a nonzero v never codes to 0 in exp_avg_sq's float8. Gradients spanning 7 decades
    in every block (v: 14, past e4m3fn's 2.3e5), then zero for about half the elements: bit for bit the
    reference's, codes 1 present, and no element moved more than two Adam steps (without the floor, m / (0 +
    eps) moves them by ~10^3 lr and more)."""
    backend = _backend(backend)
    hp = {k: v for k, v in HP[0].items() if k != "adamw"}
    runs = []
    for b in (backend, "reference"):
        g = torch.Generator(device="cuda").manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(n, generator=g, device="cuda")) for n in (300, 4133, 70001)]
        before = [p.detach().clone() for p in params]
        opt = zk.FusedAdamW(params, backend=b, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=F8,
                            min_8bit_size=1, **hp)
        mags = [10.0 ** -(7 * torch.rand(p.shape, generator=g, device="cuda")) *
                torch.randn(p.shape, generator=g, device="cuda").sign() for p in params]
        for t in range(2):
            for p, m in zip(params, mags):
                p.grad = m if t == 0 else m * (torch.rand(m.shape, generator=g, device="cuda") < 0.5)
            opt.step()
            if t == 0:
                ones = sum(int((opt.state[p]["exp_avg_sq"].view(torch.uint8) == 1).sum()) for p in params)
        torch.cuda.synchronize()
        runs.append((params, opt))
        assert ones > 100, ones
        moved = max(float((p.detach() - q).abs().max()) for p, q in zip(params, before))
        assert moved <= 2 * 3.5 * hp["lr"], (b, moved / hp["lr"])
    _assert_same(runs[0], runs[1], f"{backend} f8 exp_avg_sq floor")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m_dtype", [F32, F8], ids=["m=fp32", "m=f8"])
def test_f8_saturates_under_subnormal_scales(backend, m_dtype):
    """[Note: state codecs] 3: float8 codes saturate at 448. Gradients so small that the block scales are
    subnormal (x / scale then passes 464 in some blocks, where an unsaturated cast codes NaN): bit for bit the
    reference's over three steps, parameters and scales finite, no NaN code, saturated codes present."""
    backend = _backend(backend)
    hp = {k: v for k, v in HP[0].items() if k != "adamw"}
    runs = []
    for b in (backend, "reference"):
        g = torch.Generator(device="cuda").manual_seed(7)
        sizes = (300, 4133, 70001)
        params = [torch.nn.Parameter(torch.randn(n, generator=g, device="cuda")) for n in sizes]
        opt = zk.FusedAdamW(params, backend=b, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=F8, min_8bit_size=1, **hp)
        kinds = [torch.randint(0, 2, (-(-n // 256),), generator=g, device="cuda").repeat_interleave(256)[:n]
                 for n in sizes]
        for _ in range(3):
            for p, k in zip(params, kinds):
                u = 2.0 ** (2 * torch.rand(k.shape, generator=g, device="cuda") - 1) * \
                    torch.randn(k.shape, generator=g, device="cuda").sign()
                p.grad = torch.where(k == 0, u.double() * 1.5e-20, u.double() * 1e-41).float()
            opt.step()
        torch.cuda.synchronize()
        runs.append((params, opt))
        assert all(bool(torch.isfinite(p).all()) for p in params), b
        for key in ("exp_avg", "exp_avg_sq"):
            sts = [opt.state[p] for p in params if opt.state[p][key].dtype == F8]
            for st in sts:
                assert bool(torch.isfinite(st[key + "_scale"]).all()), (b, key)
                assert not bool(((st[key].view(torch.uint8) & 0x7F) == 0x7F).any()), (b, key)
            if sts:
                assert sum(int(((st[key].view(torch.uint8) & 0x7F) == 0x7E).sum()) for st in sts) > 0, (b, key)
    _assert_same(runs[0], runs[1], f"{backend} f8 saturation")
