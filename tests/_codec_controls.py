"""Deliberately wrong 8-bit moment codecs for negative controls (tests/test_adam_coded.py,
tests/test_cpu_coded.py): swapped into the reference step with ``monkeypatch.setitem(codecs._ENCODERS, ...)``,
each makes the reference differ from a correct kernel, so a comparison that passes is not vacuous. Also
``written_values``: bf16 parameters written to +-0 or +-inf outside the optimizer, their old remainders kept;
``f8_floor_run``: float8 exp_avg_sq with v spanning more than e4m3fn's range in a block; ``f8_subnormal_run``:
float8 moments whose block scales are subnormal, and ``wrong_f8_unsaturated`` (c10's NaN code at >= 464)."""
from __future__ import annotations

import torch

from zero_kernels import codecs as C
from zero_kernels.reference import sqrt_rn


def _inverse(scale, levels):
    inv = torch.tensor(levels) / scale
    return torch.where(torch.isfinite(inv), inv, 0.0)[:, None]


def wrong_v8_sqrt(x):
    """exp_avg_sq coded linearly in sqrt(v) (255 levels under the block max, raised to 1) instead of codecs.encode_v8's
    log code."""
    sb, scale = C.block_absmax(sqrt_rn(x.float()))
    inv = _inverse(scale, C.V8_LEVELS)
    code = torch.where(inv == 0, 0.0, torch.clamp(torch.round(sb * inv), min=1.0)).to(torch.uint8)
    return code.reshape(-1)[: x.numel()].view(x.shape), scale


def wrong_m8_trunc(x, **_sr):
    """exp_avg coded like codecs.encode_m8 but m * inv truncated towards 0 instead of rounded."""
    xb, scale = C.block_absmax(x)
    inv = _inverse(scale, C.M8_LEVELS)
    code = torch.where(inv == 0, 0.0, torch.trunc(xb * inv)).to(torch.int8)
    return code.reshape(-1)[: x.numel()].view(torch.uint8).view(x.shape), scale


def wrong_m8_nearest(x, **_sr):
    """exp_avg coded like codecs.encode_m8 but rounded to nearest (the codec before its stochastic rounding, under
    which an element whose gradient stopped kept a code of 1-4 and moved forever)."""
    xb, scale = C.block_absmax(x)
    inv = _inverse(scale, C.M8_LEVELS)
    code = torch.where(inv == 0, 0.0, torch.round(xb * inv)).to(torch.int8)
    return code.reshape(-1)[: x.numel()].view(torch.uint8).view(x.shape), scale


WRONG = {"v8 square root": (("exp_avg_sq", torch.uint8), wrong_v8_sqrt),
         "m8 truncated": (("exp_avg", torch.uint8), wrong_m8_trunc),
         "m8 nearest": (("exp_avg", torch.uint8), wrong_m8_nearest)}


def written_values(n: int, seed: int, value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 parameters, int16 remainders, mask): a third written ``+value`` and a third ``-value`` (0: as
    ``p.data.zero_()`` or pruning through ``.data`` leaves them; inf: a blown-up write), the rest random; every
    remainder a random int16 (a written parameter keeps the remainder of its old master: of either sign, -32768
    and 32767 included). A join that wraps turns (+-0, negative remainder) and (+-inf, positive remainder) into
    NaN masters; [Note: state codecs] 4 saturates them."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(torch.bfloat16)
    kind = torch.randint(0, 3, (n,), generator=g)
    p[kind == 0] = value
    p[kind == 1] = -value
    rem = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    rem[:2] = -32768
    rem[2:4] = 32767
    p[:4] = torch.tensor([value, -value, value, -value])
    kind[:4] = torch.tensor([0, 1, 0, 1])
    return p, rem, kind < 2


def check_written(p: torch.Tensor, remainder: torch.Tensor, written: torch.Tensor, before: torch.Tensor,
                  old_rem: torch.Tensor, lr: float, value: float) -> None:
    """After one step from ``written_values`` (``before``: its parameters; the kernel already compared with the
    reference): no NaN, the case
    present (>1000 written values over a remainder the wrapping join makes NaN).
    value 0: lr = 0: each written zero still 0 (-0 - 0 * u may be +0, as in torch), its remainder max(old, 0);
    lr > 0: within one Adam step (<= lr) of 0.
    value inf: each written inf over a remainder >= 0 still that inf with remainder 0 (over a negative one the
    master is finite above the largest bf16, as a split makes it: lr = 0 keeps it, rounding to that inf, its
    remainder the old one); the sign of every written element kept."""
    bad = old_rem < 0 if value == 0.0 else old_rem > 0
    assert not p.isnan().any() and int((written & bad).sum()) > 1000
    if value == 0.0:
        if lr == 0.0:
            assert bool((p[written] == 0).all())
            assert torch.equal(remainder[written], old_rem[written].clamp(min=0))
        else:
            assert float(p[written].float().abs().max()) <= lr * 1.01
        return
    inf = written & ((old_rem >= 0) | (lr == 0.0))
    assert bool(torch.isinf(p[inf]).all()) and torch.equal(torch.signbit(p[written]), torch.signbit(before[written]))
    assert torch.equal(remainder[inf], old_rem[inf].clamp(max=0))


def f8_floor_run(init, step, lr: float, sizes=(300, 4133), seed: int = 5):
    """[Note: state codecs] 3, exp_avg_sq's float8 floor: fp32 parameters, two steps by ``step(ps, gs, states)``
    from states ``init(p)``: gradients spanning 7 decades in every block (v: 14, far past e4m3fn's 2.3e5 under
    the block max), then zero for about half the elements (an embedding row missing from a batch). Returns
    (params before, params, states after step 1 (cloned), states); ``check_f8_floor`` checks them."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g) for n in sizes]
    before = [p.clone() for p in ps]
    states = [init(p) for p in ps]
    mags = [10.0 ** -(7 * torch.rand(n, generator=g)) * torch.randn(n, generator=g).sign() for n in sizes]
    step(ps, mags, states)
    first = [{k: v.clone() for k, v in st.items()} for st in states]
    step(ps, [m * (torch.rand(m.shape, generator=g) < 0.5) for m in mags], states)
    return before, ps, first, states


def check_f8_floor(before, ps, first, lr: float) -> None:
    """After ``f8_floor_run`` (the kernel already compared with the reference): the floor applied (> 100 codes 1
    of nonzero v after step 1), and no element moved more than two Adam steps (~3.2 lr each, bias-corrected);
    without the floor v codes to 0 there and m / (0 + eps) moves those elements by ~10^3 lr and more."""
    ones = sum(int((st["exp_avg_sq"].view(torch.uint8) == 1).sum()) for st in first)
    assert ones > 100, ones
    moved = max(float((p - b).abs().max()) for p, b in zip(ps, before))
    assert moved <= 2 * 3.5 * lr, moved / lr


def wrong_f8_unsaturated(x):
    """float8 coded as codecs.encode_f8_v / encode_f8 were before they saturated: e4m3fn of x / scale unclamped,
    c10's scalar rule (|y| >= 464 rounds to the NaN code 0x7F) instead of torch 2.13's saturating cast."""
    codes, scale = C.encode_f8_v(x)
    y = C._blocks(x) / scale[:, None]
    nan = (y.abs() >= 464).reshape(-1)[: x.numel()].view(x.shape)
    c = codes.view(torch.uint8)
    return torch.where(nan, c | 0x7F, c).view(torch.float8_e4m3fn), scale


def f8_subnormal_run(init, step, steps: int = 3, sizes=(300, 4133), seed: int = 7):
    """[Note: state codecs] 3, saturation: fp32 parameters stepped ``steps`` times by ``step(ps, gs, states)``
    from ``init(p)`` with gradients so small that the float8 block scales (absmax / 448) are subnormal: every
    block's gradients ~1.5e-20 (v ~1e-42: its scale a few units of 2^-149) or ~1e-41 (m ~1e-42), by block. A
    subnormal scale rounds absmax / 448 by up to half its few bits, so x / scale passes 464 in some blocks,
    where an unsaturated cast codes NaN. Returns (params, states); ``check_f8_subnormal`` checks them."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g) for n in sizes]
    states = [init(p) for p in ps]
    kinds = [torch.randint(0, 2, (-(-n // C.BLOCK),), generator=g).repeat_interleave(C.BLOCK)[:n] for n in sizes]
    for _ in range(steps):
        gs = []
        for k in kinds:
            u = 2.0 ** (2 * torch.rand(k.shape, generator=g) - 1) * torch.randn(k.shape, generator=g).sign()
            gs.append(torch.where(k == 0, u.double() * 1.5e-20, u.double() * 1e-41).float())
        step(ps, gs, states)
    return ps, states


def check_f8_subnormal(ps, states) -> None:
    """After ``f8_subnormal_run`` (the kernel already compared with the reference): finite parameters and
    scales, no NaN code (0x7F / 0xFF) in any float8 state, and saturated codes (448) present in both moments."""
    assert all(bool(torch.isfinite(p).all()) for p in ps)
    for k in ("exp_avg", "exp_avg_sq"):
        f8 = [st for st in states if st[k].dtype == torch.float8_e4m3fn]
        for st in f8:
            assert bool(torch.isfinite(st[k + "_scale"]).all()), k
            assert not bool(((st[k].view(torch.uint8) & 0x7F) == 0x7F).any()), k
        if f8:
            assert sum(int(((st[k].view(torch.uint8) & 0x7F) == 0x7E).sum()) for st in f8) > 0, k
