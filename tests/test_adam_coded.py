"""kernels/adam_coded.py (interpreted: the code under test) against zero_kernels.codecs.adam_step_coded, the
definition: every stored byte equal, for every state kind, odd sizes, partial last blocks, 8-bit states below
one block, several steps, grad_scale and found_inf, NaN / inf gradients and a non-contiguous parameter;
negative controls show the comparison catches a round-to-nearest bf16 moment, a wrong seed and a wrong 8-bit
moment codec (v coded in the square-root domain, m truncated instead of rounded). The 8-bit moment codec's
Triton device functions (kernels/_codecs.py) are also checked alone against codecs.encode_m8 / encode_v8 /
decode_m8 / decode_v8 on edge cases: ties, all-zero, NaN and inf blocks, tiny and subnormal scales, partial
last blocks."""
import math

import pytest
import torch
import triton
import triton.language as tl

from zero_kernels import codecs as C
from zero_kernels.kernels._codecs import QBLOCK, decode_m8, decode_v8, encode_m8, encode_v8, sr_key
from zero_kernels.kernels.adam_coded import adam_step_coded_triton
from zero_kernels.reference import sqrt_rn

from _codec_controls import (WRONG, check_f8_floor, check_f8_subnormal, check_written, f8_floor_run, f8_subnormal_run,
                             written_values, wrong_v8_sqrt)

BF, U8, F8, F32 = torch.bfloat16, torch.uint8, torch.float8_e4m3fn, torch.float32
SIZES = [1, 255, 256, 257, 1023, 1025, 4099, 5000]   # below a block, a block, partial blocks, two chunks
KINDS = [F32, BF, U8, F8]
HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True)


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def setup(seed, dtype, remainders, m_dtype, v_dtype, sizes=SIZES, min_8bit_size=C.BLOCK):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    fmt = dict(exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype, store_param_remainders=remainders,
               min_8bit_size=min_8bit_size)
    return ps, [C.init_coded_state(p, **fmt) for p in ps]


def grads(seed, t, ps):
    g = torch.Generator().manual_seed(seed * 100 + t)
    return [(torch.randn(p.shape, generator=g) * 10.0 ** float(torch.randint(-4, 1, (), generator=g))).to(p.dtype)
            for p in ps]


def run(ps, states, steps, seed, triton, rounding="stochastic", seeds=None, **kw):
    seeds = seeds or list(range(len(ps)))
    for t in range(steps):
        gs = grads(seed, t, ps)
        if triton:
            adam_step_coded_triton(ps, gs, states, seeds, lr=HP["lr"], beta1=HP["beta1"], beta2=HP["beta2"],
                                   eps=HP["eps"], weight_decay=HP["weight_decay"], adamw=HP["adamw"], **kw)
        else:
            for p, g, s, sd in zip(ps, gs, states, seeds):
                C.adam_step_coded(p, g, s, seed=sd, bf16_rounding=rounding, **HP, **kw)


def assert_equal(ps, states, qs, rs):
    for i, (p, s, q, r) in enumerate(zip(ps, states, qs, rs)):
        assert torch.equal(bits(p), bits(q)), f"param {i} ({p.numel()} elements) differs"
        for k in s:
            assert torch.equal(bits(s[k]), bits(r[k])), f"param {i} ({p.numel()} elements): state {k!r} differs"


def check(seed, dtype, rem, m_dtype, v_dtype, steps, **fmt):
    ps, states = setup(seed, dtype, rem, m_dtype, v_dtype, **fmt)
    qs, refs = setup(seed, dtype, rem, m_dtype, v_dtype, **fmt)
    run(ps, states, steps, seed + 1, triton=True)
    run(qs, refs, steps, seed + 1, triton=False)
    assert_equal(ps, states, qs, refs)


def test_split_chunks_and_alignment_rule():
    """[Note: full and rest launches]: chunk j of tensor t goes to the FULL launch iff the tensor is aligned and
    the chunk lies inside it; the alignment rule is the kernel's (master, grad, exp_avg, exp_avg_sq, param16 to
    16 bytes; the block scales are not read by vectors; 0 = absent)."""
    from zero_kernels.kernels.adam_coded import CHUNK, aligned_tensors
    from zero_kernels.kernels._multi_tensor import split_chunks
    row = [4096, 8192, 64, 128, 36, 4, 0]
    rows = row + [x + 2 if i == 1 else x for i, x in enumerate(row)] + [x + 8 if i == 6 else x for i, x in
                                                                         enumerate(row)] + [4, 8, 4, 4, 0, 0, 0]
    assert aligned_tensors(rows) == (True, False, False, False)
    assert aligned_tensors([x + 2 if i == 4 else x for i, x in enumerate(row)]) == (True,)   # a scale
    numels = (2 * CHUNK + 5, CHUNK, 300, 2 * CHUNK)
    ft, fs, rt, rs = split_chunks(numels, (True, True, True, False), CHUNK)
    assert list(zip(ft, fs)) == [(0, 0), (0, CHUNK), (1, 0)]
    assert list(zip(rt, rs)) == [(0, 2 * CHUNK), (2, 0), (3, 0), (3, CHUNK)]


@pytest.mark.parametrize("m_dtype", KINDS, ids=["m=fp32", "m=bf16", "m=u8", "m=f8"])
@pytest.mark.parametrize("v_dtype", [BF, U8, F8], ids=["v=bf16", "v=u8", "v=f8"])
@pytest.mark.parametrize("layout", ["remainder", "bf16+master", "fp32"])
def test_kernel_equals_codec_definition(m_dtype, v_dtype, layout):
    dtype, rem = {"remainder": (BF, True), "bf16+master": (BF, False), "fp32": (F32, False)}[layout]
    check(1, dtype, rem, m_dtype, v_dtype, 3)


@pytest.mark.parametrize("layout", ["remainder", "fp32"])
def test_8bit_moments_below_one_block(layout):
    """min_8bit_size=1: tensors of 1 and 255 elements (one partial block) and 257 (a full and a 1-element
    block) keep uint8 moments; four steps."""
    dtype, rem = {"remainder": (BF, True), "fp32": (F32, False)}[layout]
    _, states = setup(2, dtype, rem, U8, U8, sizes=[1, 255, 257], min_8bit_size=1)
    assert all(st[k].dtype == U8 for st in states for k in ("exp_avg", "exp_avg_sq"))
    check(2, dtype, rem, U8, U8, 4, sizes=[1, 255, 257], min_8bit_size=1)


def test_fp32_moments_with_remainders_and_fp16_masters():
    check(3, BF, True, F32, F32, 4)
    check(3, torch.float16, False, F32, F32, 4)


@pytest.mark.parametrize("pipeline, rem, mv_dtype", [(False, True, U8), (True, True, U8), (True, False, BF)])
def test_full_and_rest_launches(pipeline, rem, mv_dtype, monkeypatch):
    """The full chunks run in the FULL launch, every other chunk (a tensor's last partial one, each of a
    misaligned tensor's) in the rest launch, and both give the definition's bits. The interpreter does not
    fault on a misaligned vector access, so the launches are recorded too: a FULL launch never gets a chunk of
    a misaligned tensor or one past a tensor's end. ``pipeline``: the FULL launch with its loads one tile ahead
    (PIPELINE_FULL; remainders: 8 elements per thread, an fp32 master: 4)."""
    from zero_kernels.kernels import adam_coded as AC
    kernel, launches = AC.fused_adam_coded_kernel, []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                assert kw["PIPELINE"] == (pipeline and kw["FULL"])
                launches.append((kw["FULL"], list(zip(args[4].tolist(), args[5].tolist()))))
                return kernel[grid](*args, **kw)
            return launch
    monkeypatch.setattr(AC, "fused_adam_coded_kernel", Spy())
    monkeypatch.setattr(AC, "PIPELINE_FULL", pipeline)
    C_ = AC.CHUNK
    sizes = [2 * C_ + 5, C_, 300, 2 * C_]

    def make():
        ps, states = setup(11, BF, rem, mv_dtype, mv_dtype, sizes=sizes)
        buf = torch.empty(ps[3].numel() + 1, dtype=BF)       # tensor 3: a view 2 bytes past an aligned buffer
        buf[1:].copy_(ps[3])
        ps[3] = buf[1:]
        return ps, states
    ps, states = make()
    qs, refs = make()
    run(ps, states, 2, 12, triton=True)
    run(qs, refs, 2, 12, triton=False)
    assert_equal(ps, states, qs, refs)
    assert launches[:2] == [(True, [(0, 0), (0, C_), (1, 0)]), (False, [(0, 2 * C_), (2, 0), (3, 0), (3, C_)])]
    assert len(launches) == 4 and launches[2:] == launches[:2]


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


@pytest.mark.parametrize("wrong", ["nearest", "seed", "v8 square root", "m8 truncated"])
def test_negative_controls(wrong, monkeypatch):
    """The comparison above catches a kernel that rounds bf16 to nearest, uses other random bits, or codes
    the 8-bit moments another way: each such reference run differs from the kernel's."""
    m_dtype, v_dtype = {"v8 square root": (BF, U8), "m8 truncated": (U8, BF)}.get(wrong, (BF, BF))
    ps, states = setup(8, F32, False, m_dtype, v_dtype, sizes=[1025, 300])
    qs, refs = setup(8, F32, False, m_dtype, v_dtype, sizes=[1025, 300])
    run(ps, states, 2, 9, triton=True)
    if wrong in WRONG:
        monkeypatch.setitem(C._ENCODERS, *WRONG[wrong])
    kw = {"nearest": dict(rounding="nearest"), "seed": dict(seeds=[1, 0])}.get(wrong, {})
    run(qs, refs, 2, 9, triton=False, **kw)
    with pytest.raises(AssertionError, match="differs"):
        assert_equal(ps, states, qs, refs)


@pytest.mark.parametrize("dtype,rem,m_dtype,v_dtype", [(BF, True, U8, U8), (BF, True, BF, F8), (F32, False, F8, BF),
                                                       (BF, False, U8, F8), (F32, False, BF, U8)])
def test_nan_and_inf_gradients(dtype, rem, m_dtype, v_dtype):
    """A NaN gradient poisons its element (and its 8-bit / fp8 block), infinities theirs, over two steps: every
    state bit as the reference (a NaN block scale is torch.amax's canonical 0x7FC00000). Only the NaN payload
    of a bf16 parameter written from an fp32 master may differ (the fp32 kernel's rule, adam.py's
    round_bf16_bits, vs torch's CPU cast): there both must be NaN."""
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


# ---------------------------------------------------------------- the 8-bit moment codec alone
@triton.jit
def _encode_kernel(
    m_ptr,          # fp32 [numel]: exp_avg values to code
    v_ptr,          # fp32 [numel]: exp_avg_sq values to code (their IEEE square roots are coded)
    m_codes_ptr,    # uint8 [numel]: int8 codes of m out
    m_scales_ptr,   # fp32 [ceil(numel / 256)]: block scales of m out
    v_codes_ptr,    # uint8 [numel]: log codes of sqrt(v) out
    v_scales_ptr,   # fp32 [ceil(numel / 256)]: block scales (max sqrt(v)) out
    numel,          # int64: elements
    sr_ptr,         # int64 [3]: seed, step, flat index of element 0: m's stochastic rounding (codecs.M8_SR)
    ROWS: tl.constexpr,   # 256-element blocks per program, as the coded kernel's [4, 256] tile
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK).to(tl.int64)[None, :]
    mask = offs < numel
    row_mask = rows * QBLOCK < numel
    key = sr_key(tl.load(sr_ptr), tl.load(sr_ptr + 1), 0)
    code, scale = encode_m8(tl.load(m_ptr + offs, mask=mask, other=0.0), offs, tl.load(sr_ptr + 2), key, mask)
    tl.store(m_codes_ptr + offs, code, mask=mask)
    tl.store(m_scales_ptr + rows, scale, mask=row_mask)
    code, scale = encode_v8(tl.sqrt_rn(tl.load(v_ptr + offs, mask=mask, other=0.0)), mask)
    tl.store(v_codes_ptr + offs, code, mask=mask)
    tl.store(v_scales_ptr + rows, scale, mask=row_mask)


@triton.jit
def _decode_kernel(
    codes_ptr,      # uint8 [numel]: codes (int8 bits for m)
    scales_ptr,     # fp32 [ceil(numel / 256)]: block scales
    m_ptr,          # fp32 [numel]: the codes decoded as exp_avg out
    v_ptr,          # fp32 [numel]: the codes decoded as exp_avg_sq out
    numel,          # int64: elements
    ROWS: tl.constexpr,   # 256-element blocks per program
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK).to(tl.int64)[None, :]
    mask = offs < numel
    code = tl.load(codes_ptr + offs, mask=mask, other=0)
    scale = tl.load(scales_ptr + offs // QBLOCK, mask=mask, other=0.0)   # per element, as the coded kernel
    tl.store(m_ptr + offs, decode_m8(code, scale), mask=mask)
    tl.store(v_ptr + offs, decode_v8(code, scale), mask=mask)


def triton_encode(m, v, rows=4):
    n = m.numel()
    nb = -(-n // C.BLOCK)
    out = (torch.empty(n, dtype=U8), torch.empty(nb), torch.empty(n, dtype=U8), torch.empty(nb))
    _encode_kernel[(-(-nb // rows),)](m, v, *out, n, torch.tensor([M8_SR["seed"], M8_SR["step"], M8_SR["index_offset"]]),
                                      ROWS=rows)
    return out


M8_SR = dict(seed=7, step=5, stream=0, index_offset=2**32 - 300)   # the m code's keys in the codec checks: an
                                                                    # index that wraps mod 2^32 inside the tensor


def triton_decode(codes, scales, rows=4):
    m, v = torch.empty(codes.numel()), torch.empty(codes.numel())
    _decode_kernel[(-(-scales.numel() // rows),)](codes, scales, m, v, codes.numel(), ROWS=rows)
    return m, v


def _round_half_away(y):
    return torch.trunc(y + 0.5 * torch.sign(y))


def _v8_unclamped(v, scale):
    """codecs.encode_v8's code before the raise to 1 (int64): nearest log step of sqrt(v) under ``scale``."""
    sb, tb = sqrt_rn(v).view(torch.int32).long(), scale.view(torch.int32).long()
    return (sb - tb + (255 << 19) + (1 << 18)) >> 19


def edge_blocks():
    """(m, v): fp32 tensors of 10 blocks + 37 elements, block by block (B = 256):
    0 ties: scale 127 (inv exactly 1), x = k + 0.5 for k in -127..126 plus +-127, so x * inv is an exact tie;
    1 ties at scale 127 * 2^-10 (inv exactly 2^10); v: block 0 the squares of the 256 code points under
      scale 1 (code k exactly), block 1 random;
    2 all zeros; 3 a NaN; 4 +inf (v) / -inf (m); 5 subnormal values only (m: 127 / scale overflows -> codes
    0; v: the square root is normal); 6 m scale 3.7e-37 (127 / scale just above FLT_MAX -> 0), v subnormals
    next to 3e38 (far below 16 octaves: raised to code 1);
    7 m scale 3.8e-37 (inverse finite, about 3.3e38) with subnormal values in the block; 8, 9 random
    magnitudes; then a partial block of 37 random elements."""
    g = torch.Generator().manual_seed(11)
    B = C.BLOCK
    ties = torch.cat([torch.arange(-127, 127, dtype=F32) + 0.5, torch.tensor([127.0, -127.0])])
    assert ties.numel() == B
    m = [ties, ties * 2.0 ** -10, torch.zeros(B)]
    nan = torch.randn(B, generator=g)
    nan[17] = float("nan")
    inf = torch.randn(B, generator=g)
    inf[200] = -float("inf")
    sub = torch.rand(B, generator=g) * 1e-39
    m += [nan, inf, sub]
    for top in (1.22e-32, 1.23e-32):                  # 127 * 2^15 / top overflows fp32, then does not
        x = torch.randn(B, generator=g) * 1e-38
        x[:64] = torch.rand(64, generator=g) * 1e-39          # subnormals
        x[100] = -top
        m.append(x)
    m += [torch.randn(B, generator=g) * 10.0 ** torch.randint(-20, 5, (B,), generator=g).float() for _ in range(2)]
    m.append(torch.randn(37, generator=g))

    points = (0x3F800000 - (255 - torch.arange(B, dtype=torch.int32)) * 2**19).view(F32)   # s of code k, scale 1
    points[0] = 0.0
    v = [points * points, torch.rand(B, generator=g), torch.zeros(B)]
    vnan = torch.rand(B, generator=g)
    vnan[3] = float("nan")
    vinf = torch.rand(B, generator=g)
    vinf[250] = float("inf")
    vsub = torch.rand(B, generator=g) * 1e-39
    vmix = torch.rand(B, generator=g) * 1e-40
    vmix[9] = 3e38                                    # sqrt 1.7e19: the block's scale
    vmix[10:20] = 1.4e-45                             # sqrt 3.7e-23: 141 octaves below, raised to code 1
    v += [vnan, vinf, vsub, vmix, torch.rand(B, generator=g) * 1e-30]
    v += [torch.rand(B, generator=g) * 10.0 ** torch.randint(-30, 10, (B,), generator=g).float() for _ in range(2)]
    v.append(torch.rand(37, generator=g))
    return torch.cat(m), torch.cat(v)


def test_codec_device_functions_equal_the_definition_on_edge_cases():
    m, v = edge_blocks()
    mc, ms, vc, vs = triton_encode(m, v)
    mc_ref, ms_ref = C.encode_m8(m, **M8_SR)
    vc_ref, vs_ref = C.encode_v8(v)
    assert torch.equal(mc, mc_ref), f"m codes differ at {(mc != mc_ref).nonzero().flatten()[:8].tolist()}"
    assert torch.equal(vc, vc_ref), f"v codes differ at {(vc != vc_ref).nonzero().flatten()[:8].tolist()}"
    for got, want in ((ms, ms_ref), (vs, vs_ref)):
        assert torch.equal(bits(got), bits(want)), "block scales differ"
    for codes, scales in ((mc, ms), (vc, vs)):
        dm, dv = triton_decode(codes, scales)
        assert torch.equal(bits(dm), bits(C.decode_m8(codes, scales)))
        assert torch.equal(bits(dv), bits(C.decode_v8(codes, scales)))

    # The cases are what they claim (each would catch a kernel that gets it wrong).
    B = C.BLOCK
    assert bits(ms[3:4]).view(torch.int32).item() == 0x7FC00000 and vs[3].isnan()       # canonical NaN scale
    assert ms[4].isinf() and vs[4].isinf() and ms[2] == 0 and vs[2] == 0
    dm, dv = C.decode_m8(mc, ms), C.decode_v8(vc, vs)
    assert dm[3 * B:5 * B].isnan().all() and dv[3 * B:5 * B].isnan().all()             # NaN / inf poison
    assert (mc[5 * B:7 * B] == 0).all() and bool((m[5 * B:6 * B] != 0).all())            # inverse overflow
    m_inv_levels = torch.tensor(C.M8_LEVELS * 2 ** C.M8_DITHER_BITS)
    assert not torch.isfinite(m_inv_levels / ms[6]) and torch.isfinite(m_inv_levels / ms[7])
    assert (mc[7 * B:8 * B] != 0).any()
    assert bool((v[5 * B:6 * B] < 1.2e-38).all()) and (vc[5 * B:6 * B] != 0).any()      # subnormal v codes
    assert bool((_v8_unclamped(v[6 * B + 10:6 * B + 20], vs[6]) < 1).all()) and (vc[6 * B + 10:6 * B + 20] == 1).all()
    assert vc[-37:].max() == 255 and mc[-37:].view(torch.int8).abs().max() == 127      # partial block coded
    # Ties: blocks 0 and 1 of m are exact ties (round half away from zero would code them differently); v's
    # block 0 runs through every code; the random v blocks hold elements raised to 1 and elements a linear
    # code of sqrt(v) would code differently.
    # m's stochastic rounding: every code is floor(y) or floor(y) + 1, each for about half of the halves
    for blk in (0, 1):
        y = m[blk * B:(blk + 1) * B] * (torch.tensor(C.M8_LEVELS) / ms[blk])
        half = y - torch.floor(y) == 0.5
        assert int(half.sum()) == B - 2
        up = mc[blk * B:(blk + 1) * B].view(torch.int8).float() - torch.floor(y)
        assert bool(((up == 0) | (up == 1)).all()) and 0.35 < float(up[half].mean()) < 0.65
        assert not torch.equal(_round_half_away(y).to(torch.int8).view(U8), mc[blk * B:(blk + 1) * B])
    assert vc[:B].tolist() == list(range(B))
    yv = _v8_unclamped(v[8 * B:10 * B], vs[8:10].repeat_interleave(B))
    raised = (v[8 * B:10 * B] > 0) & (yv < 1)
    assert bool(raised.any()) and bool((vc[8 * B:10 * B][raised] == 1).all())
    assert not torch.equal(wrong_v8_sqrt(v[8 * B:10 * B])[0], vc[8 * B:10 * B])


def test_codec_device_functions_on_random_blocks_and_decode_edge_scales():
    """Random blocks over 40 decades (many full and partial tiles), and every code decoded under scales 0,
    NaN, inf, the smallest subnormal, subnormal, 1 and FLT_MAX (s'^2 overflows to inf)."""
    g = torch.Generator().manual_seed(12)
    n = 13 * C.BLOCK + 201
    mag = 10.0 ** torch.randint(-20, 20, (n // C.BLOCK + 1,), generator=g).float()
    m = torch.randn(n, generator=g) * mag.repeat_interleave(C.BLOCK)[:n]
    v = torch.rand(n, generator=g) ** 8 * mag.repeat_interleave(C.BLOCK)[:n] ** 2   # sqrt(v) over octaves
    mc, ms, vc, vs = triton_encode(m, v)
    assert torch.equal(mc, C.encode_m8(m, **M8_SR)[0]) and torch.equal(bits(ms), bits(C.encode_m8(m, **M8_SR)[1]))
    assert torch.equal(vc, C.encode_v8(v)[0]) and torch.equal(bits(vs), bits(C.encode_v8(v)[1]))
    assert len(set(vc.tolist())) > 150 and len(set(mc.tolist())) > 200                  # not a trivial code

    scales = torch.tensor([0.0, float("nan"), float("inf"), 1e-45, 1e-40, 1.0, 3.4028234663852886e38, 0.37])
    codes = torch.cat([torch.randperm(256, generator=g).to(U8) for _ in scales])[:-19]   # last block partial
    dm, dv = triton_decode(codes, scales)
    want_m, want_v = C.decode_m8(codes, scales), C.decode_v8(codes, scales)
    assert torch.equal(bits(dm), bits(want_m)) and torch.equal(bits(dv), bits(want_v))
    assert want_v.isinf().any() and want_m.isnan().any() and (want_m[3 * 256:5 * 256] != 0).any()


@pytest.mark.parametrize("value", [0.0, math.inf])
@pytest.mark.parametrize("lr", [0.0, 1e-2])
def test_parameters_written_to_zero_or_inf_keep_them(value, lr):
    """[Note: state codecs] 4: bf16 parameters written to +-0 or +-inf outside the optimizer (``p.data``) keep
    their old remainders; the kernel's join saturates (a negative remainder under +-0, a positive one under
    +-inf count as 0) as the reference's (every stored byte equal, full and rest launches); then
    ``check_written``. A join that wraps makes those masters NaN."""
    hp = dict(HP, lr=lr, weight_decay=0.0)
    out = []
    for use_triton in (True, False):
        p, rem, written = written_values(4133, 12, value)
        before = p.clone()
        st = C.init_coded_state(p, exp_avg_dtype=U8, exp_avg_sq_dtype=BF, store_param_remainders=True)
        st["master_remainder"].copy_(rem)
        g = grads(5, 0, [p])
        if use_triton:
            adam_step_coded_triton([p], g, [st], [0], **hp)
        else:
            C.adam_step_coded(p, g[0], st, seed=0, bf16_rounding="stochastic", **hp)
        out.append(([p], [st]))
    assert_equal(*out[0], *out[1])
    p, r = out[0][0][0], out[0][1][0]["master_remainder"]
    check_written(p, r, written, before, rem, lr, value)


@pytest.mark.parametrize("m_dtype", [F32, F8], ids=["m=fp32", "m=f8"])
def test_f8_floor_and_saturation(m_dtype):
    """[Note: state codecs] 3: a nonzero v never codes to 0 in exp_avg_sq's float8: the Triton kernel's bits equal
    the reference's over ``f8_floor_run`` (v spanning 14 decades per block, then a zero gradient for half of the
    elements), and ``check_f8_floor``; likewise the codes' saturation at 448 over ``f8_subnormal_run`` (subnormal
    block scales) and ``check_f8_subnormal`` (both negative controls are in tests/test_cpu_coded.py)."""
    init = lambda p: C.init_coded_state(p, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=F8)   # noqa: E731
    kw = dict(lr=HP["lr"], beta1=HP["beta1"], beta2=HP["beta2"], eps=HP["eps"], weight_decay=HP["weight_decay"],
              adamw=HP["adamw"])

    def triton_step(ps, gs, states):
        adam_step_coded_triton(ps, gs, states, list(range(len(ps))), **kw)

    def reference_step(ps, gs, states):
        for i, (p, g, s) in enumerate(zip(ps, gs, states)):
            C.adam_step_coded(p, g, s, seed=i, **HP)

    runs = [f8_floor_run(init, s, HP["lr"]) for s in (triton_step, reference_step)]
    assert_equal(runs[0][1], runs[0][3], runs[1][1], runs[1][3])
    check_f8_floor(*runs[0][:3], HP["lr"])
    runs = [f8_subnormal_run(init, s) for s in (triton_step, reference_step)]   # saturation ([Note: state codecs] 3)
    assert_equal(runs[0][0], runs[0][1], runs[1][0], runs[1][1])
    check_f8_subnormal(*runs[0])
