"""The one hyper-parameter validator shared by FusedAdam* and ZeroAdam*.

[Note: hyper-parameter rules]
torch.optim.Adam/AdamW's rules and messages, plus non-finite values rejected (a NaN or inf lr,
eps or weight decay turns every weight non-finite at the first step):
  * lr: a number or a one-element Tensor (any shape: ``scalar_lr`` reshapes it to a 0-d tensor
    before use), finite and >= 0;
  * betas: a pair, both numbers or both one-element Tensors, each in [0, 1);
  * eps, weight_decay: finite and >= 0.
Every optimizer calls :func:`validate_hparams` before it stores or changes anything (constructor,
``add_param_group``, groups restored by ``load_state_dict``).
"""
from __future__ import annotations

import math
from typing import Any

from torch import Tensor

__all__ = ["validate_hparams", "scalar_lr", "as_float"]


def _finite_nonneg(x: Any) -> bool:
    v = float(x.reshape(()).item()) if isinstance(x, Tensor) else float(x)
    return 0.0 <= v and math.isfinite(v)    # NaN fails both comparisons


def validate_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    """Raise ValueError (torch's messages; ``where`` names the param group) on a bad value."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element{where}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float, Tensor)) or not _finite_nonneg(lr):
        raise ValueError(f"Invalid learning rate: {lr}{where}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not _finite_nonneg(eps):
        raise ValueError(f"Invalid epsilon value: {eps}{where}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}{where}")
    tensors = [isinstance(b, Tensor) for b in betas]
    if any(tensors) and not all(tensors):
        raise ValueError(f"betas must be either both floats or both Tensors{where}")
    for i, b in enumerate(betas):
        if isinstance(b, Tensor) and b.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element{where}")
        if isinstance(b, bool) or not isinstance(b, (int, float, Tensor)) or not 0.0 <= as_float(b) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}{where}")
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) \
            or not _finite_nonneg(weight_decay):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}{where}")


def as_float(x: float | Tensor) -> float:
    """A number or a one-element Tensor as a Python float."""
    return float(x.reshape(()).item()) if isinstance(x, Tensor) else float(x)


def scalar_lr(lr: float | Tensor) -> float | Tensor:
    """A Tensor lr of any one-element shape as a 0-d tensor (numbers unchanged)."""
    return lr.reshape(()) if isinstance(lr, Tensor) else lr
