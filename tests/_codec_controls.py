"""Deliberately wrong 8-bit moment codecs for negative controls (tests/test_adam_coded.py,
tests/test_cpu_coded.py): swapped into the reference step with ``monkeypatch.setitem(codecs._ENCODERS, ...)``,
each makes the reference differ from a correct kernel, so a comparison that passes is not vacuous. Also
``written_zeros``: bf16 parameters written to +-0 outside the optimizer, their old remainders kept."""
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


def wrong_m8_trunc(x):
    """exp_avg coded like codecs.encode_m8 but m * inv truncated towards 0 instead of rounded."""
    xb, scale = C.block_absmax(x)
    inv = _inverse(scale, C.M8_LEVELS)
    code = torch.where(inv == 0, 0.0, torch.trunc(xb * inv)).to(torch.int8)
    return code.reshape(-1)[: x.numel()].view(torch.uint8).view(x.shape), scale


WRONG = {"v8 square root": (("exp_avg_sq", torch.uint8), wrong_v8_sqrt),
         "m8 truncated": (("exp_avg", torch.uint8), wrong_m8_trunc)}


def written_zeros(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 parameters, int16 remainders, mask): a third written +0 and a third -0 (as ``p.data.zero_()`` or
    pruning through ``.data`` leaves them), the rest random; every remainder a random int16 (a written
    parameter keeps the remainder of its old master: of either sign, -32768 included). A join that wraps turns
    (+-0, negative remainder) into a NaN master; [Note: state codecs] 4 saturates it at +-0."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(torch.bfloat16)
    kind = torch.randint(0, 3, (n,), generator=g)
    p[kind == 0] = 0.0
    p[kind == 1] = -0.0
    rem = torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    rem[:2] = -32768
    p[:2] = torch.tensor([0.0, -0.0])
    return p, rem, kind < 2


def check_written_zeros(p: torch.Tensor, remainder: torch.Tensor, zero: torch.Tensor, old_rem: torch.Tensor,
                        lr: float) -> None:
    """After one step from ``written_zeros`` (the kernel already compared with the reference): no NaN, the case
    present (>1000 written zeros over a negative remainder); lr = 0: each written zero still 0 (-0 - 0 * u may
    be +0, as in torch), its remainder max(old, 0); lr > 0: within one Adam step (<= lr) of 0."""
    assert not p.isnan().any() and int((zero & (old_rem < 0)).sum()) > 1000
    if lr == 0.0:
        assert bool((p[zero] == 0).all())
        assert torch.equal(remainder[zero], old_rem[zero].clamp(min=0))
    else:
        assert float(p[zero].float().abs().max()) <= lr * 1.01
