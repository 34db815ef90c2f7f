"""Deliberately wrong 8-bit moment codecs for negative controls (tests/test_adam_coded.py,
tests/test_cpu_coded.py): swapped into the reference step with ``monkeypatch.setitem(codecs._ENCODERS, ...)``,
each makes the reference differ from a correct kernel, so a comparison that passes is not vacuous."""
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
