"""The low-precision Adam-state codecs of zero_kernels.codecs against their definition ([Note: state
codecs]), with negative controls, and the coded reference step against fused_adam_ref / torch AdamW.
Independent oracles: the hash in Python integers, nearest code by brute-force argmin, block scales by a
loop over blocks, torch's own fp32 -> bf16 cast."""
import math
import random

import pytest
import torch

from zero_kernels import codecs as C
from zero_kernels.reference import compute_coeffs, fused_adam_ref

SIZES = [1, 7, 255, 256, 257, 1000, 4099]          # below one block, exactly one, odd, not divisible by 256
BF, U8 = torch.bfloat16, torch.uint8


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- the uint32 hash
def fmix32_py(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_hash_is_uint32_fmix32():
    rng = random.Random(0)
    xs = [0, 1, 2, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(2000)]
    got = C.fmix32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [fmix32_py(x) for x in xs]
    assert fmix32_py(1) == 0x514E28B7 and C.fmix32(1) == 0x514E28B7       # MurmurHash3 fmix32 golden value
    seed, step, stream = 0xDEADBEEF, 12345, 1
    assert C.sr_key(seed, step, stream) == fmix32_py(seed ^ fmix32_py(2 * step + stream))
    r = C.sr_bits(5, C.sr_key(seed, step, stream), index_offset=2**32 - 2).tolist()
    assert r == [fmix32_py(((2**32 - 2 + i) & 0xFFFFFFFF) ^ C.sr_key(seed, step, stream)) >> 16 for i in range(5)]


# ---------------------------------------------------------------- bf16 stochastic rounding
def neighbours(x):
    """The two bf16 values around each fp32 x (truncation and one ulp further from zero)."""
    lo = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    hi = ((x.view(torch.int32) & ~0xFFFF) + 0x10000).view(torch.float32)
    return lo, hi


def test_bf16_sr_definition_and_determinism():
    x = torch.randn(4099, generator=gen(1)) * 10.0 ** torch.randint(-30, 30, (4099,), generator=gen(2))
    kw = dict(seed=7, step=3, stream=0)
    a = C.encode_bf16_sr(x, **kw)
    assert a.dtype == BF and torch.equal(a.view(torch.int16), C.encode_bf16_sr(x.clone(), **kw).view(torch.int16))
    lo, hi = neighbours(x)
    r = C.sr_bits(x.numel(), C.sr_key(7, 3, 0))
    up = (x.view(torch.int32).long() & 0xFFFF) + r >= 0x10000
    assert torch.equal(a.float(), torch.where(up, hi, lo))                # the Note's formula, element by element
    for other in (dict(seed=8, step=3, stream=0), dict(seed=7, step=4, stream=0), dict(seed=7, step=3, stream=1)):
        assert (C.encode_bf16_sr(x, **other).float() != a.float()).float().mean() > 0.2
    part = C.encode_bf16_sr(x[1000:3001], **kw, index_offset=1000)       # a ZeRO shard: same bits as the full tensor
    assert torch.equal(part.view(torch.int16), a[1000:3001].view(torch.int16))


def test_bf16_sr_special_values():
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -3.5, 1e-40, 3.3895e38])
    for step in range(1, 50):
        y = C.encode_bf16_sr(x, seed=1, step=step, stream=1).float()
        assert torch.equal(y[:4], x[:4]) and torch.isnan(y[4]) and torch.equal(y[5:7], x[5:7])
        assert y[7] in (neighbours(x[7:8])[0][0], neighbours(x[7:8])[1][0])  # subnormal: one of its neighbours


def test_bf16_sr_is_unbiased_and_rne_is_not():
    x = torch.rand(512, generator=gen(3)) * 2 - 1
    K = 2000
    sr = torch.stack([C.encode_bf16_sr(x, seed=11, step=s, stream=0).float() for s in range(K)]).double()
    lo, hi = neighbours(x)
    ulp = (hi - lo).double()
    assert bool(((sr == lo.double()) | (sr == hi.double())).all())
    err = (sr.mean(0) - x.double()) / ulp
    assert err.abs().max() < 5 * 0.5 / K ** 0.5                          # 5 sigma of a Bernoulli mean
    rne_err = (C.encode_bf16_rne(x).double() - x.double()) / ulp         # negative control: biased
    assert rne_err.abs().mean() > 0.2 and rne_err.abs().max() > 10 * 0.5 / K ** 0.5


def test_slow_v_stalls_with_rne_and_is_tracked_with_sr():
    """beta2 = 0.999 moves v by 0.1% per step, below half a bf16 ulp: nearest rounding freezes v."""
    n, b2, steps = 4096, 0.999, 1500
    v32 = torch.ones(n)
    v_sr, v_rne = v32.bfloat16(), v32.bfloat16()
    for t in range(1, steps + 1):
        g2 = 2.0
        v32 = b2 * v32 + (1 - b2) * g2
        v_rne = C.encode_bf16_rne(b2 * v_rne.float() + (1 - b2) * g2)
        v_sr = C.encode_bf16_sr(b2 * v_sr.float() + (1 - b2) * g2, seed=5, step=t, stream=1)
    assert torch.equal(v_rne.float(), torch.ones(n))                      # stalled at its start
    assert abs(float(v_sr.float().mean()) / float(v32[0]) - 1) < 2e-3     # tracks 2 - e^-1.5 = 1.777
    assert float(v32[0]) > 1.7


# ---------------------------------------------------------------- 8-bit blockwise
def test_code_books():
    bnbf = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes not installed: its map is the anchor")
    assert torch.equal(C.CODE_BOOKS["dynamic_signed"], bnbf.create_dynamic_map(True))
    assert torch.equal(C.CODE_BOOKS["dynamic_unsigned"], bnbf.create_dynamic_map(False))
    for name, t in C.CODE_BOOKS.items():
        assert t.shape == (256,) and t.dtype == torch.float32 and bool((t[1:] > t[:-1]).all()), name
        assert float(t[0]) == (0.0 if "unsigned" in name else float(t[0])) and 0.0 in t.tolist(), name


def check_q8(x, codes, scale, table):
    """Raises AssertionError unless (codes, scale) is THE encoding of x: scale = blockwise absmax, each
    code the nearest table entry to x / scale (ties: either), and decode within half a code gap."""
    n, nb = x.numel(), -(-x.numel() // C.BLOCK)
    assert codes.dtype == U8 and codes.shape == x.shape and scale.shape == (nb,) and scale.dtype == torch.float32
    xf = x.reshape(-1)
    want = torch.stack([xf[i * C.BLOCK:(i + 1) * C.BLOCK].abs().max() for i in range(nb)])
    assert torch.equal(scale, want), "block scale is not the block's absmax"
    s = scale.repeat_interleave(C.BLOCK)[:n]
    y = torch.where(s == 0, 0.0, xf / s)
    dist = (y[:, None] - table[None, :]).abs()
    best = dist.min(1).values
    got = dist.gather(1, codes.reshape(-1, 1).long())[:, 0]
    assert torch.equal(got, best), f"{int((got != best).sum())} codes are not the nearest table entry"
    dq = C.decode_q8(codes, scale, table).reshape(-1)
    c = codes.reshape(-1).long()
    gap = torch.maximum(table[c] - table[(c - 1).clamp(min=0)], table[(c + 1).clamp(max=255)] - table[c])
    step = torch.maximum(0.5 * gap, (y - table[-1]).abs() * (c == 255) + (table[0] - y).abs() * (c == 0))  # ends clamp
    assert bool(((dq - xf).abs() <= step * s + 2**-22 * xf.abs()).all()), "dequantized off by more than a step"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("book", sorted(C.CODE_BOOKS))
def test_q8_matches_definition(n, book):
    table = C.CODE_BOOKS[book]
    x = torch.randn(n, generator=gen(n)) * torch.logspace(-6, 0, n) ** 2    # moments span decades
    if "unsigned" in book:
        x = x.abs()
    codes, scale = C.encode_q8(x, table)
    check_q8(x, codes, scale, table)
    if n > C.BLOCK and n % C.BLOCK:                       # the partial last block has its own scale
        assert float(scale[-1]) == float(x[(n // C.BLOCK) * C.BLOCK:].abs().max())


def test_q8_negative_controls():
    """check_q8 (the parity check a kernel's output goes through) rejects a wrong scale or code book."""
    x = torch.randn(1000, generator=gen(4))
    table = C.CODE_BOOKS["dynamic_signed"]
    codes, scale = C.encode_q8(x, table)
    check_q8(x, codes, scale, table)
    bad_scale = scale * 1.01
    with pytest.raises(AssertionError, match="absmax"):
        check_q8(x, codes, bad_scale, table)
    ycodes = torch.bucketize(x / bad_scale.repeat_interleave(C.BLOCK)[:1000], C.midpoints(table)).to(U8)
    with pytest.raises(AssertionError, match="nearest"):                 # codes made with the wrong scale
        check_q8(x, ycodes, scale, table)
    lin_codes, _ = C.encode_q8(x, C.CODE_BOOKS["linear_signed"])
    with pytest.raises(AssertionError, match="nearest"):
        check_q8(x, lin_codes, scale, table)


def test_q8_zero_and_nan_blocks():
    x = torch.zeros(600)
    x[300] = float("nan")
    codes, scale = C.encode_q8(x, C.CODE_BOOKS["dynamic_signed"])
    dq = C.decode_q8(codes, scale, C.CODE_BOOKS["dynamic_signed"])
    assert torch.equal(dq[:256], torch.zeros(256)) and torch.equal(dq[512:], torch.zeros(88))
    assert bool(torch.isnan(dq[256:512]).all())                         # a NaN poisons its block, only


# ---------------------------------------------------------------- 8-bit moments (Note 2)
def check_m8(x, codes, scale):
    """Raises AssertionError unless (codes, scale) is an 8-bit code of exp_avg x, checked from its properties:
    scale = blockwise absmax; each int8 code a rounding (down or up: the code rounds stochastically) of
    127 x / scale (1e-5 of slack for the fp32 rounding of the product); decode within one step."""
    n, nb = x.numel(), -(-x.numel() // C.BLOCK)
    assert codes.dtype == U8 and codes.shape == x.shape and scale.shape == (nb,) and scale.dtype == torch.float32
    xf = x.reshape(-1).double()
    want = torch.stack([x.reshape(-1)[i * C.BLOCK:(i + 1) * C.BLOCK].abs().max() for i in range(nb)])
    assert torch.equal(scale, want), "block scale is not the block's absmax"
    s = scale.double().repeat_interleave(C.BLOCK)[:n]
    y = torch.where(s == 0, 0.0, 127 * xf / s)
    c = codes.reshape(-1).view(torch.int8).double()
    assert bool(((c - y).abs() < 1 + 1e-5).all()), "codes are not a rounding of 127 x / scale"
    dq = C.decode_m8(codes, scale).reshape(-1).double()
    assert bool(((dq - xf).abs() <= (1 + 1e-5) * s / 127 + 1e-7 * xf.abs()).all()), "decoded off by > one step"


def check_v8(x, codes, scale):
    """As check_m8 for exp_avg_sq: log codes of s = sqrt(x), 16 per octave below the block's max s (code 255
    - 16k is scale / 2^k exactly), nearest on the float bits, a nonzero x never code 0; decoded v = s'^2."""
    n, nb = x.numel(), -(-x.numel() // C.BLOCK)
    assert codes.dtype == U8 and codes.shape == x.shape and scale.shape == (nb,)
    s = x.reshape(-1).double().sqrt().float()          # double then fp32: the correctly rounded fp32 sqrt
    want = torch.stack([s[i * C.BLOCK:(i + 1) * C.BLOCK].max() for i in range(nb)])
    assert torch.equal(scale, want), "block scale is not the block's max sqrt(v)"
    c = codes.reshape(-1).long()
    assert bool(((c > 0) | (s == 0)).all()), "a nonzero v took code 0"
    assert bool((c[s == 0] == 0).all()), "v = 0 did not take code 0"
    dq = C.decode_v8(codes, scale).reshape(-1)
    sd = dq.double().sqrt().float()                     # s' (exact: dq = s' * s' rounded, s' its sqrt)
    sc = scale.repeat_interleave(C.BLOCK)[:n]
    octave = (c > 0) & ((255 - c) % 16 == 0)
    assert torch.equal(sd[octave].double(), sc[octave].double() * 2.0 ** (-((255 - c[octave]) // 16)).double()), \
        "code 255 - 16k does not decode to scale / 2^k"
    bs, bd = s.view(torch.int32).long(), sd.view(torch.int32).long()
    inner = (c > 1) & (s > 0)
    assert bool(((bs - bd).abs()[inner] <= 2**18).all()), "codes are not the nearest log step of sqrt(v)"
    assert bool((bs[c == 1] <= bd[c == 1] + 2**18).all()), "code 1 holds a v above its step"
    rel = ((sd.double() - s.double()).abs() / s.double())[inner]
    assert bool((rel <= 1 / 32 * (1 + 1e-6)).all()), "decoded sqrt(v) off by more than 1/32"


@pytest.mark.parametrize("n", SIZES)
def test_m8_v8_match_definition(n):
    x = torch.randn(n, generator=gen(70 + n)) * torch.logspace(-6, 0, n) ** 2    # moments span decades
    codes, scale = C.encode_m8(x)
    check_m8(x, codes, scale)
    v = x * x
    codes, scale = C.encode_v8(v)
    check_v8(v, codes, scale)
    if n > C.BLOCK and n % C.BLOCK:                       # the partial last block has its own scale
        assert float(scale[-1]) == float(C.sqrt_rn(v[(n // C.BLOCK) * C.BLOCK:].max()))


def test_m8_v8_ties_round_half_even():
    """m's code rounds stochastically: 127 x / scale = k + 1/2 (scale 127 makes y = x) codes to k or k + 1, an
    integer to itself, the block's max to 127; v's log code rounds a tie up."""
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0, -127.0])
    got = C.encode_m8(x, seed=3, step=9)[0].view(torch.int8)
    assert got[[0, 7, 8]].tolist() == [127, 3, -127]
    assert all(int(c) in (int(math.floor(v)), int(math.floor(v)) + 1) for c, v in zip(got[1:7], x[1:7]))
    # v: sqrt(v) a half step (2^18 in the bits) below a code ties up; s = s'^2 round-trips exactly.
    one = 0x3F800000
    sb = torch.tensor([one, one - 2**18, one - 3 * 2**18, one - 2**18 - 1, one - 240 * 2**19, one - 256 * 2**19, 0],
                      dtype=torch.int32)
    s = sb.view(torch.float32)
    codes, _ = C.encode_v8(s * s)
    assert codes.tolist() == [255, 255, 254, 254, 15, 1, 0]     # 2^-15 -> 15; 2^-16 -> -1, raised to 1


def test_m8_v8_negative_controls():
    """The checks reject a wrong scale, codes made with a wrong scale, and v rounded up (the rejected
    variant of the code) or to zero."""
    x = torch.randn(1000, generator=gen(4))
    codes, scale = C.encode_m8(x)
    check_m8(x, codes, scale)
    with pytest.raises(AssertionError, match="absmax"):
        check_m8(x, codes, scale * 1.01)
    bad = torch.round(127 * x / (scale * 1.05).repeat_interleave(C.BLOCK)[:1000]).to(torch.int8).view(U8)
    with pytest.raises(AssertionError, match="a rounding"):
        check_m8(x, bad, scale)
    v = x * x * torch.logspace(-8, 0, 1000)
    v[::7] *= 1e-14                                   # below 16 octaves of sqrt(v) under their block's max: raised
    codes, scale = C.encode_v8(v)
    check_v8(v, codes, scale)
    with pytest.raises(AssertionError, match="max sqrt"):
        check_v8(v, codes, scale * 1.01)
    c = codes.long()
    with pytest.raises(AssertionError, match="nearest"):                    # one code off
        check_v8(v, torch.where((c > 1) & (c < 255), c + 1, c).to(U8), scale)
    sb = C.sqrt_rn(v).view(torch.int32).long()
    top = (255 << 19) - scale.view(torch.int32).long().repeat_interleave(C.BLOCK)[:1000]
    trunc = torch.clamp((sb + top) >> 19, min=1)                               # rounded down, not to nearest
    with pytest.raises(AssertionError, match="nearest"):
        check_v8(v, torch.where(v > 0, trunc, 0).to(U8), scale)
    unraised = torch.clamp((sb + top + 2**18) >> 19, min=0)
    with pytest.raises(AssertionError, match="code 0"):
        check_v8(v, unraised.to(U8), scale)


def test_m8_rounds_stochastically_without_bias():
    """[Note: state codecs] 2: E[code] = 127 m / scale. Every element of 40 blocks at y = 3.3 (each block's max
    at 127): over indices, steps and seeds the codes average 3.3 (round to nearest would give 3, the negative
    control); an element's code over 400 steps averages its y; one step's codes follow the definition built
    here from its parts (q, the dither bits, the floor)."""
    x = torch.full((40 * C.BLOCK,), 3.3)
    x[::C.BLOCK] = 127.0
    codes = torch.stack([C.encode_m8(x, seed=sd, step=t)[0].view(torch.int8).float() for sd in range(3)
                         for t in range(1, 5)])
    rest = torch.ones(x.numel(), dtype=torch.bool)
    rest[::C.BLOCK] = False
    y = float(torch.tensor(3.3) * (torch.tensor(127.0 * 2**15) / 127.0)) / 2**15
    assert abs(float(codes[:, rest].mean()) - y) < 0.01
    from _codec_controls import wrong_m8_nearest                                          # the negative control
    assert abs(float(wrong_m8_nearest(x)[0].view(torch.int8)[rest].float().mean()) - y) > 0.25
    one = torch.stack([C.encode_m8(x[:C.BLOCK], seed=5, step=t)[0].view(torch.int8).float() for t in range(1, 401)])
    assert abs(float(one[:, 1:].mean()) - y) < 0.02 and set(one[:, 1:].unique().tolist()) == {3.0, 4.0}
    m = torch.randn(1000, generator=gen(8))
    scale = torch.stack([b.abs().max() for b in m.split(C.BLOCK)])
    inv = (torch.tensor(127.0 * 2**15) / scale).repeat_interleave(C.BLOCK)[:1000]
    q = torch.round(m * inv).long()
    idx = (torch.arange(1000) + 2**32 - 17) & 0xFFFFFFFF
    r = ((idx * 0x9E3779B1 + C.sr_key(11, 7, 0)) & 0xFFFFFFFF) >> 17
    want = torch.clamp((q + r) >> 15, -127, 127).to(torch.int8).view(U8)
    assert torch.equal(C.encode_m8(m, seed=11, step=7, index_offset=2**32 - 17)[0], want)


def test_m8_v8_zero_nan_inf_and_tiny_blocks():
    x = torch.zeros(1100)
    x[300], x[600], x[900] = float("nan"), float("inf"), 1e-45           # blocks 1, 2, 3 (tiny scale)
    x[1050] = 1e-3
    for enc, dec, xx in ((C.encode_m8, C.decode_m8, x), (C.encode_v8, C.decode_v8, x.abs())):
        codes, scale = enc(xx)
        assert scale[1].view(torch.int32) == 0x7FC00000                   # the canonical NaN
        dq = dec(codes, scale)
        assert torch.equal(dq[:256], torch.zeros(256)) and torch.equal(codes[:256], torch.zeros(256, dtype=U8))
        assert bool(torch.isnan(dq[256:768]).all())                         # a NaN or inf poisons its block, only
        if enc is C.encode_m8:                                              # 127 / 1e-45 overflows: all codes 0
            assert torch.equal(codes[768:1024], torch.zeros(256, dtype=U8))
        else:                                                               # sqrt(1e-45) is normal: code 255
            assert int(codes[900]) == 255 and float(dq[900]) > 0
        assert float(dq[1050]) > 0 and bool(torch.isfinite(dq[1024:]).all())


@pytest.mark.parametrize("n", SIZES)
def test_f8_matches_definition(n):
    x = torch.randn(n, generator=gen(40 + n)) * torch.logspace(-3, 0, n)
    codes, scale = C.encode_f8(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (-(-n // C.BLOCK),)
    want = torch.stack([x[i:i + C.BLOCK].abs().max() for i in range(0, n, C.BLOCK)]) / 448.0
    assert torch.equal(scale, want)
    s = scale.repeat_interleave(C.BLOCK)[:n]
    assert torch.equal(codes.view(torch.uint8), (x / s).to(torch.float8_e4m3fn).view(torch.uint8))
    dq = C.decode_f8(codes, scale)
    assert torch.equal(dq, codes.float() * s)
    assert bool(((dq - x).abs() <= (x.abs() * 2**-4).clamp_min(s * 2**-10) * (1 + 1e-6)).all())  # half an e4m3 ulp
    assert abs(float(dq.abs().max()) / float(x.abs().max()) - 1) < 2**-22  # the block maximum: to fp32 rounding


def test_f8_negative_control():
    x = torch.randn(1000, generator=gen(41))
    codes, scale = C.encode_f8(x)
    wrong = (x / (scale * 2).repeat_interleave(C.BLOCK)[:1000]).to(torch.float8_e4m3fn)
    assert not torch.equal(wrong.view(torch.uint8), codes.view(torch.uint8))
    assert float((C.decode_f8(wrong, scale) - x).abs().max()) > 0.3


def test_f8_exp_avg_sq_never_decodes_nonzero_to_zero():
    """[Note: state codecs] 3: exp_avg_sq's float8 code (encode_f8_v) stores a nonzero v whose e4m3fn code is 0
    (more than 2.3e5 under its block's largest) as 1, the smallest subnormal; every other code is encode_f8's.
    The negative control: encode_f8 (exp_avg's code) codes those to 0."""
    x = torch.rand(4133, generator=gen(42)) * 10.0 ** -(12 * torch.rand(4133, generator=gen(43)))
    x[::7] = 0.0
    codes, scale = C.encode_f8_v(x)
    plain, scale0 = C.encode_f8(x)
    assert torch.equal(scale, scale0)
    c, c0 = codes.view(torch.uint8), plain.view(torch.uint8)
    floored = (c0 == 0) & (x != 0)
    assert int(floored.sum()) > 1000                                  # the case is present
    assert torch.equal(c, torch.where(floored, 1, c0).to(torch.uint8))
    dq = C.decode_f8(codes, scale)
    assert bool((dq[x != 0] > 0).all()) and bool((dq[x == 0] == 0).all())
    assert bool((C.decode_f8(plain, scale)[floored] == 0).all())      # the negative control


# ---------------------------------------------------------------- bf16 parameter + int16 remainder
def bit_patterns():
    """Every class: random normals, subnormals, +-0, +-inf, NaNs, both ties, the largest finite values,
    and the full low half (all 65536 remainders) under a few high halves, odd and even."""
    rng = torch.Generator().manual_seed(6)
    rand = torch.randint(-2**31, 2**31, (200_000,), generator=rng, dtype=torch.int64)
    sub = torch.randint(1, 2**23, (1000,), generator=rng) | torch.tensor([0, 2**31]).repeat(500)
    hi = torch.tensor([0x0000, 0x0001, 0x3F80, 0x3F81, 0x7F7F, 0x8000, 0xBF80, 0xC0A3, 0x0080, 0x807F])
    sweep = ((hi[:, None] << 16) | torch.arange(65536)[None, :]).reshape(-1)
    special = torch.tensor([0, 2**31, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                            0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000, 0x3F818000, 0x00008000, 0x80018000])
    b = torch.cat([rand & 0xFFFFFFFF, sub, sweep, special])
    return (b - ((b & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def test_remainder_split_join_every_class():
    m = bit_patterns()
    p, rem = C.split_remainder(m)
    assert p.dtype == BF and rem.dtype == torch.int16
    nan = torch.isnan(m)
    ref = m.bfloat16()                                                  # torch's round-to-nearest-even
    assert torch.equal(p[~nan].view(torch.int16), ref[~nan].view(torch.int16))
    assert bool(torch.isnan(p[nan]).all()) and torch.equal(p[nan].view(torch.int16), torch.full((int(nan.sum()),), 0x7FC0, dtype=torch.int16))
    back = C.join_remainder(p, rem)
    lossy = C.remainder_is_lossy(m)
    exact = ~nan & ~lossy
    assert torch.equal(back[exact].view(torch.int32), m[exact].view(torch.int32))
    assert torch.equal(back[lossy].view(torch.int32), m[lossy].view(torch.int32) - 1)   # one ulp towards p
    assert bool(torch.isnan(back[nan]).all())
    assert lossy[-13:].nonzero().flatten().tolist() == [9, 11]          # 0x3F808000, 0x00008000: ties down to even
    assert torch.equal(C.split_remainder(back)[0].view(torch.int16), p.view(torch.int16))  # lossy: p unchanged
    n_even = ((torch.tensor([0x0000, 0x3F80, 0x8000, 0xBF80, 0x0080]) & 1) == 0).sum()
    assert int(lossy[-13 - 10 * 65536:-13].sum()) == int(n_even)        # exactly one lossy pattern per even high half


@pytest.mark.parametrize("value", [0.0, math.inf])
def test_remainder_join_saturates_at_zero_and_inf(value):
    """A bf16 parameter written to +-0 or +-inf outside the optimizer keeps its old remainder ([Note: state
    codecs] 4): the join is +-0 under a negative remainder and the subnormal sign | rem under a positive one;
    +-inf under a positive remainder and the finite (hi << 16) + rem above the largest bf16 under a negative
    one (as a split makes it); the wrapping join, the negative control, is NaN at the saturated elements. Every
    join rounds back to the parameter (except the exact tie -32768 under an odd value, which rounds to its
    even neighbour), and split pairs still join exactly (test_remainder_split_join_every_class)."""
    from _codec_controls import written_values
    p, rem, written = written_values(4133, 7, value)
    hi = p.view(torch.int16).to(torch.int64) & 0xFFFF
    r = rem.to(torch.int64)
    back = C.join_remainder(p, rem).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sat = written & ((r < 0) if value == 0.0 else (r > 0))
    assert torch.equal(back[written], ((hi << 16) + torch.where(sat, 0, r))[written] & 0xFFFFFFFF)
    rounds = ~(((hi & 1) == 1) & (r == -32768))
    assert torch.equal(C.join_remainder(p, rem).bfloat16()[rounds].view(torch.int16), p[rounds].view(torch.int16))
    wrap = (((hi << 16) + r) & 0xFFFFFFFF)
    wrapped = (wrap - ((wrap & 0x80000000) << 1)).to(torch.int32).view(torch.float32)
    assert bool(wrapped[sat].isnan().all()) and int(sat.sum()) > 1000


def test_remainder_negative_control():
    """Truncation instead of nearest-even (or a join that forgets the sign of the remainder) fails."""
    m = bit_patterns()
    ok = ~torch.isnan(m)
    trunc = (m.view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(trunc[ok], m.bfloat16()[ok].view(torch.int16))
    p, rem = C.split_remainder(m)
    wrong = C.join_remainder(p, rem.abs())
    assert not torch.equal(wrong[ok].view(torch.int32), m[ok].view(torch.int32))


# ---------------------------------------------------------------- the coded reference step
HP = [dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True),
      dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.03, adamw=False, maximize=True)]
SHAPES = [(1,), (7, 3), (257,), (1003,), (129, 65)]


def run_coded(params, grads_seq, hp, **fmt):
    states = [C.init_coded_state(p, **fmt) for p in params]
    for grads in grads_seq:
        for i, (p, g, s) in enumerate(zip(params, grads, states)):
            C.adam_step_coded(p, g, s, seed=i, **hp)
        yield states


def grad_seq(shapes, steps, seed, dtype=torch.float32):
    g = gen(seed)
    return [[(torch.randn(s, generator=g) * 10.0 ** torch.randint(-3, 1, (), generator=g)).to(dtype) for s in shapes]
            for _ in range(steps)]


def apply_tie_rule(master):
    """The one documented loss of split_remainder, applied to an fp32 master in place; returns the count."""
    lossy = C.remainder_is_lossy(master)
    master.view(torch.int32)[lossy] -= 1
    return int(lossy.sum())


@pytest.mark.parametrize("hp", HP, ids=["adamw", "adam-l2-maximize"])
def test_remainders_bit_identical_to_fp32_master(hp):
    """bf16 params + remainders vs fused_adam_ref with fp32 masters writing bf16 params: bit for bit, every
    step, except that the fp32 run's master loses one ulp where it lands on the one tie an int16 cannot
    hold (counted: rare, and the bf16 params stay identical through it)."""
    steps = 40
    p0 = [torch.randn(s, generator=gen(20)).bfloat16() for s in SHAPES]
    grads = grad_seq(SHAPES, steps, 21, torch.bfloat16)
    masters, p16 = [p.float() for p in p0], [p.clone() for p in p0]
    ms, vs = [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters]
    ours = [p.clone() for p in p0]
    hp_ref = {k: v for k, v in hp.items() if k not in ("lr", "maximize")}
    ties, n = 0, sum(p.numel() for p in p0) * steps
    for t, states in enumerate(run_coded(ours, grads, hp, store_param_remainders=True), start=1):
        coeffs = compute_coeffs([torch.tensor(float(t))] * len(SHAPES), hp["lr"], hp["beta1"], hp["beta2"],
                                hp["weight_decay"], hp["adamw"])
        fused_adam_ref(masters, grads[t - 1], ms, vs, None, p16, coeffs, maximize=hp.get("maximize", False), **hp_ref)
        for m, p, q, s in zip(masters, p16, ours, states):
            assert torch.equal(q.view(torch.int16), p.view(torch.int16)), f"bf16 params differ at step {t}"
            ties += apply_tie_rule(m)
            assert torch.equal(C.join_remainder(q, s["master_remainder"]).view(torch.int32), m.view(torch.int32))
            assert set(s) == {"step", "exp_avg", "exp_avg_sq", "master_remainder"}
    assert ties <= 20 * n / 2**17, (ties, n)                             # about one element-step in 2^17


def test_remainders_with_8bit_moments_equal_fp32_master_with_8bit_moments():
    p0 = [torch.randn(s, generator=gen(22)).bfloat16() for s in SHAPES]
    grads = grad_seq(SHAPES, 25, 23, torch.bfloat16)
    fmt = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8)
    a, b = [p.clone() for p in p0], [p.clone() for p in p0]
    for sa, sb in zip(run_coded(a, grads, HP[0], store_param_remainders=True, **fmt), run_coded(b, grads, HP[0], **fmt)):
        for pa, pb, xa, xb in zip(a, b, sa, sb):
            assert torch.equal(pa.view(torch.int16), pb.view(torch.int16))
            apply_tie_rule(xb["master_param"])
            assert torch.equal(C.join_remainder(pa, xa["master_remainder"]), xb["master_param"])
            assert all(torch.equal(xa[k], xb[k]) for k in xb if k != "master_param")


def test_fp32_states_equal_fused_adam_ref_and_torch_adamw():
    p0 = [torch.randn(s, generator=gen(24)) for s in SHAPES]
    grads = grad_seq(SHAPES, 10, 25)
    ours, ref = [p.clone() for p in p0], [p.clone().requires_grad_() for p in p0]
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for gs, _ in zip(grads, run_coded(ours, grads, HP[0])):
        for r, g in zip(ref, gs):
            r.grad = g.clone()
        opt.step()
        for q, r in zip(ours, ref):
            torch.testing.assert_close(q, r.detach(), rtol=1e-6, atol=1e-7)


F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("fmt,tol", [(dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF), 0.02),
                                     (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8), 0.1),
                                     (dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8), 0.1)], ids=["bf16", "8bit", "fp8"])
def test_coded_moments_track_fp32(fmt, tol):
    """Coded moments stay near the fp32 run (relative to the total movement), and are stored coded."""
    p0 = [torch.randn(s, generator=gen(26)) for s in SHAPES]
    grads = grad_seq(SHAPES, 30, 27)
    a, b = [p.clone() for p in p0], [p.clone() for p in p0]
    for _ in zip(run_coded(a, grads, HP[0], **fmt), run_coded(b, grads, HP[0])):
        pass
    cat = lambda ts: torch.cat([t.reshape(-1) for t in ts])
    assert float((cat(a) - cat(b)).norm()) < tol * float((cat(b) - cat(p0)).norm())
    for z in p0:
        s = C.init_coded_state(z, **fmt)
        dt = fmt["exp_avg_dtype"]
        want = dt if dt == BF or z.numel() >= C.BLOCK else torch.float32
        assert s["exp_avg"].dtype == want and s["exp_avg_sq"].dtype == want


def test_found_inf_changes_nothing():
    p = torch.randn(1003, generator=gen(28)).bfloat16()
    s = C.init_coded_state(p, exp_avg_dtype=U8, exp_avg_sq_dtype=BF, store_param_remainders=True)
    g = torch.randn(1003, generator=gen(29)).bfloat16()
    C.adam_step_coded(p, g, s, **HP[0])
    before = {k: v.clone() for k, v in s.items()}, p.clone()
    C.adam_step_coded(p, g * float("inf"), s, found_inf=torch.ones(1), **HP[0])
    assert all(torch.equal(before[0][k], s[k]) for k in s) and torch.equal(before[1], p)


@pytest.mark.parametrize("fmt,limit", [(dict(), 12), (dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF), 8),
                                       (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8), 6.1),
                                       (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=True), 4.1),
                                       (dict(exp_avg_dtype=F8, exp_avg_sq_dtype=F8), 6.1)],
                         ids=["fp32", "bf16", "8bit", "8bit+remainders", "fp8"])
def test_state_bytes_per_parameter(fmt, limit):
    p = torch.zeros(1_000_003, dtype=BF)                                # not a multiple of 256
    per = C.state_nbytes(C.init_coded_state(p, **fmt)) / p.numel()
    assert per <= limit and per > limit - 0.2, per


def test_small_tensors_keep_fp32_and_bad_arguments_raise():
    s = C.init_coded_state(torch.zeros(255), exp_avg_dtype=U8, exp_avg_sq_dtype=U8)
    assert s["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in s
    s = C.init_coded_state(torch.zeros(255), exp_avg_dtype=U8, exp_avg_sq_dtype=U8, min_8bit_size=1)
    assert s["exp_avg"].dtype == U8
    with pytest.raises(ValueError, match="store_param_remainders=True needs bf16"):
        C.init_coded_state(torch.zeros(3), store_param_remainders=True)
    with pytest.raises(ValueError, match="exp_avg_dtype"):
        C.init_coded_state(torch.zeros(3), exp_avg_dtype=torch.float16)
    with pytest.raises(ValueError, match="bf16_rounding"):
        C.adam_step_coded(torch.zeros(3), torch.zeros(3), C.init_coded_state(torch.zeros(3)), bf16_rounding="up", **HP[0])


def test_quality_script_smoke(capsys, monkeypatch):
    """bench/quality_states.py runs end to end (3 steps; the real run is the benchmark, not a test)."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "quality_states.py"
    spec = importlib.util.spec_from_file_location("quality_states", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(__import__("sys").modules, "quality_states", mod)   # dataclasses look their module up
    spec.loader.exec_module(mod)
    mod.main(["--steps", "3", "--only", "8-bit + remainders", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| torch AdamW fp32 | " in out and "| ours bf16 params, 8-bit + remainders | " in out


@pytest.mark.parametrize("key, dtype", [("exp_avg", U8), ("exp_avg_sq", U8), ("exp_avg", torch.float8_e4m3fn),
                                        ("exp_avg_sq", torch.float8_e4m3fn)])
def test_encode_moment_keeping_holds_kept_values(key, dtype):
    """codecs.encode_moment_keeping ([Note: coded ZeRO states]): 200 re-encodings while the other elements of the kept
    ones' blocks grow 1% per step. Kept values: exactly as stored for 8-bit v and float8 (the scale grows in whole
    code steps / powers of two), unbiased for 8-bit m; blocks without kept elements: as encode_moment codes them.
    Negative control: plain encode_moment makes the kept v follow the growing scale."""
    n = 600
    g = torch.Generator().manual_seed(3)
    base = torch.rand(n, generator=g) * 1e-4 * (1 if key == "exp_avg_sq" else torch.randn(n, generator=g).sign())
    keep = torch.zeros(n, dtype=torch.bool)
    keep[10:50] = True
    keep[300:320] = True
    runs = {}
    for how in ("keeping", "plain"):
        st = {key: torch.zeros(n, dtype=dtype), key + "_scale": torch.zeros(3)}
        C.encode_moment(st, key, base, sr=dict(seed=1, step=1, stream=0))
        d0 = C.decode_moment(st, key)
        for t in range(200):
            x = C.decode_moment(st, key)
            x[~keep] = d0[~keep] * (1.0 + 0.01 * (t + 1))
            sr = dict(seed=1, step=t + 2, stream=0)
            if how == "keeping":
                C.encode_moment_keeping(st, key, x, keep, sr)
            else:
                C.encode_moment(st, key, x, sr=sr)
        runs[how] = (d0, C.decode_moment(st, key), st, x)
    d0, d1, st, x = runs["keeping"]
    if key == "exp_avg" and dtype == U8:
        assert abs(float((d1[keep] - d0[keep]).sum() / d0[keep].abs().sum())) < 0.1      # unbiased, not held
    else:
        assert torch.equal(d1[keep], d0[keep])
    other = {key: torch.zeros(n - 512, dtype=dtype), key + "_scale": torch.zeros(1)}
    C.encode_moment(other, key, x[512:].contiguous(), sr=dict(seed=1, step=201, stream=0, index_offset=512))
    assert torch.equal(st[key].view(torch.uint8)[512:], other[key].view(torch.uint8))        # block 2: no kept element
    if key == "exp_avg_sq":
        p0, p1, _, _ = runs["plain"]
        assert float((p1[keep] / p0[keep]).median()) > 1.5                                    # followed the scale
