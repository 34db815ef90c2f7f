"""memory_report(): the bytes a rank holds for model states, beside the formula's prediction."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..memory import STATE_FORMATS, model_state_bytes
from .buckets import FlatBucket

__all__ = ["nbytes", "state_report", "finish_report"]


def nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def state_report(buckets: Sequence[FlatBucket], params_bytes: int) -> dict[str, int]:
    """params (as given), the reduced-gradient slices, masters and moments."""
    return {"params": params_bytes,
            "grads": sum(nbytes(b.reduce.grad_slice) + nbytes(b.reduce.spare_slice) + nbytes(b.reduce.acc)
                         + nbytes(b.reduce.late_acc) for b in buckets),
            "master_params": sum(nbytes(b.remainder) + (0 if b.master_is_param else nbytes(b.master)) for b in buckets),
            "exp_avg": sum(_moment_bytes(b, "exp_avg") for b in buckets),
            "exp_avg_sq": sum(_moment_bytes(b, "exp_avg_sq") + nbytes(b.optim.max_exp_avg_sq) for b in buckets)}


def _moment_bytes(b: FlatBucket, key: str) -> int:
    """A moment's stored bytes: codes (or values) and, for blockwise formats, its block scales."""
    return nbytes(b.optim.tensors[key]) + nbytes(b.optim.tensors.get(key + "_scale"))


def _format_bytes(fmt) -> tuple[float, float]:
    """(master bytes per fp32-master element, optimizer-state bytes per element) of a state format, from
    zero_kernels.memory.STATE_FORMATS (the planner's rule)."""
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "8bit", torch.float8_e4m3fn: "8bit"}
    optim = STATE_FORMATS[name[fmt.exp_avg_dtype]] + STATE_FORMATS[name[fmt.exp_avg_sq_dtype]]
    return (2 if fmt.store_param_remainders else 4), optim


def finish_report(rep: dict[str, Any], buckets: Sequence[FlatBucket], module: nn.Module, frozen, stage: int,
                  world: int, reduce_dtype: torch.dtype, comm_bytes: int) -> dict[str, Any]:
    """Add buffers, comm buffers, the total and the prediction (zero_kernels.memory)."""
    rep["buffers"] = sum(nbytes(t) for t in module.buffers()) + sum(nbytes(p.data) for p in frozen)
    rep["comm_buffers"] = comm_bytes        # kept between steps to avoid page faults; not model states
    rep["total"] = sum(rep[k] for k in ("params", "grads", "master_params", "exp_avg", "exp_avg_sq"))
    rep["predicted"] = _predicted(buckets, world, stage, reduce_dtype)
    rep["padding_elements"] = sum(b.spec.padded_numel - b.spec.numel for b in buckets)
    return rep


def _predicted(buckets: Sequence[FlatBucket], world: int, stage: int, reduce_dtype: torch.dtype) -> dict[str, float]:
    """The formula's bytes, summed over the working-parameter dtypes (a model may keep fp32 and 16-bit
    parameters: each has its own parameter and gradient bytes, and only 16-bit ones a master). The buckets
    hold every parameter once, so their element counts add up to Ψ."""
    numel: dict[torch.dtype, int] = {}
    for b in buckets:
        numel[b.dtype] = numel.get(b.dtype, 0) + b.spec.numel
    master_bytes, optim_bytes = _format_bytes(buckets[0].fmt)
    out: dict[str, float] = {}
    for dtype, n in numel.items():
        part = model_state_bytes(n, world, stage, param_bytes=dtype.itemsize,
                                 grad_bytes=dtype.itemsize if stage == 1 else reduce_dtype.itemsize,
                                 master_bytes=0 if dtype == torch.float32 else master_bytes,
                                 optim_bytes=optim_bytes)
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out

