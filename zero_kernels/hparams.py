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
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._launch_plan import is_dtensor
from .codecs import BLOCK, MOMENT_DTYPES

__all__ = ["validate_hparams", "scalar_lr", "as_float", "StateFormat", "validate_state_format", "check_param_format",
           "check_coded_amsgrad"]


def _finite_nonneg(x: Any) -> bool:
    v = float(x.reshape(()).item()) if isinstance(x, Tensor) else float(x)
    return 0.0 <= v and math.isfinite(v)    # NaN fails both comparisons


def validate_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> None:
    """Raise ValueError (torch's messages; ``where`` names the param group) on a bad value."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element{where}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float, Tensor)) or not _finite_nonneg(lr):
        raise ValueError(f"Invalid learning rate: {lr}{where}")
    _check_number("eps", eps, where)
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
    _check_number("weight_decay", weight_decay, where)
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) \
            or not _finite_nonneg(weight_decay):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}{where}")


def _check_number(name: str, x: Any, where: str) -> None:
    """eps and weight_decay are numbers here (torch.optim.AdamW also takes a Tensor): say so, not "Invalid"."""
    if isinstance(x, Tensor):
        raise ValueError(f"{name} must be a number, got a Tensor ({x!r}){where}: the kernels take {name} as a "
                         f"scalar argument; pass {name}=float(...) (only lr and betas may be Tensors)")


def as_float(x: float | Tensor) -> float:
    """A number or a one-element Tensor as a Python float."""
    return float(x.reshape(()).item()) if isinstance(x, Tensor) else float(x)


def scalar_lr(lr: float | Tensor) -> float | Tensor:
    """A Tensor lr of any one-element shape as a 0-d tensor (numbers unchanged)."""
    return lr.reshape(()) if isinstance(lr, Tensor) else lr


# [Note: state formats]
# ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` pick the stored format of each Adam moment (the codecs of
# [Note: state codecs] in codecs.py): float32 (the default: today's kernels, bit for bit), bfloat16
# (stochastic rounding), uint8 (8-bit blockwise) or float8_e4m3fn (blockwise scaled). Tensors with
# fewer than ``min_8bit_size`` elements keep fp32 moments where a blockwise format was asked for.
# ``store_param_remainders`` keeps the fp32 master of a bf16 parameter as the parameter's bits plus
# an int16 remainder. Any non-default choice makes the optimizer *coded*: amsgrad and
# ``master_weights=False`` are refused with it (neither has a coded definition).
class StateFormat(NamedTuple):
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    store_param_remainders: bool = False
    min_8bit_size: int = BLOCK

    @property
    def coded(self) -> bool:
        return self != StateFormat(min_8bit_size=self.min_8bit_size)


def validate_state_format(exp_avg_dtype: Any, exp_avg_sq_dtype: Any, store_param_remainders: Any,
                          min_8bit_size: Any, *, master_weights: Any = None) -> StateFormat:
    """The optimizer's :class:`StateFormat`, or ValueError naming the bad argument ([Note: state formats])."""
    for name, dt in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dt not in MOMENT_DTYPES:
            raise ValueError(f"{name}={dt!r} is not supported; use one of {list(MOMENT_DTYPES)}")
    if not isinstance(store_param_remainders, bool):
        raise ValueError(f"store_param_remainders must be True or False, got {store_param_remainders!r}")
    if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
        raise ValueError(f"min_8bit_size must be an int >= 0 (elements), got {min_8bit_size!r}")
    fmt = StateFormat(exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders, min_8bit_size)
    if fmt.coded and master_weights is False:
        raise ValueError("master_weights=False keeps torch's 16-bit states and cannot be combined with coded "
                         "states (exp_avg_dtype / exp_avg_sq_dtype / store_param_remainders); drop one of them")
    return fmt


def check_param_format(fmt: StateFormat, where: str, p: Tensor, amsgrad: Any) -> None:
    """ValueError naming the parameter (``where``) when it cannot hold the coded states of ``fmt``."""
    if fmt.store_param_remainders and p.dtype != torch.bfloat16:
        raise ValueError(f"{where} has dtype {p.dtype}; store_param_remainders=True needs bf16 parameters "
                         "(the fp32 master is kept as the bf16 bits plus an int16 remainder): put the other "
                         "parameters in another optimizer, or use store_param_remainders=False")
    if fmt.coded and is_dtensor(p):
        raise ValueError(f"{where} is a DTensor (an FSDP2 / fully_shard parameter): FusedAdam's coded states "
                         "(exp_avg_dtype / exp_avg_sq_dtype / store_param_remainders) are per-tensor blocks that "
                         "torch.distributed.checkpoint cannot reshard; keep fp32 states for FSDP2 models, or shard "
                         "the model with zk.ZeroAdamW(model, stage=3, exp_avg_dtype=...), which holds coded states "
                         "in its own resharding checkpoints (and loads FSDP2's through zero_kernels.dcp)")
    check_coded_amsgrad(fmt, "", amsgrad)


def check_coded_amsgrad(fmt: StateFormat, where: str, amsgrad: Any) -> None:
    """ValueError when amsgrad is asked of coded states: at construction, add_param_group, and each step (a
    ``param_groups[i]["amsgrad"] = True`` set later would otherwise be ignored)."""
    if fmt.coded and amsgrad:
        raise ValueError(f"{where}{CODED_AMSGRAD}")


# The one refusal of amsgrad with coded states (FusedAdam here, ZeroAdamW in zero/coded.format_error).
CODED_AMSGRAD = ("amsgrad=True is not supported with coded states (exp_avg_dtype / exp_avg_sq_dtype / "
                 "store_param_remainders): max_exp_avg_sq has no coded format; use amsgrad=False")
