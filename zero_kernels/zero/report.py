"""memory_report(): the bytes a rank holds for model states, beside the formula's prediction."""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from ..memory import model_state_bytes
from .buckets import FlatBucket

__all__ = ["nbytes", "state_report", "finish_report"]


def nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def state_report(buckets: Sequence[FlatBucket], params_bytes: int) -> dict[str, int]:
    """params (as given), the reduced-gradient slices, masters and moments."""
    return {"params": params_bytes,
            "grads": sum(nbytes(b.reduce.grad_slice) + nbytes(b.reduce.spare_slice) + nbytes(b.reduce.acc)
                         + nbytes(b.reduce.late_acc) for b in buckets),
            "master_params": sum(0 if b.master_is_param else nbytes(b.master) for b in buckets),
            "exp_avg": sum(nbytes(b.optim.exp_avg) for b in buckets),
            "exp_avg_sq": sum(nbytes(b.optim.exp_avg_sq) + nbytes(b.optim.max_exp_avg_sq) for b in buckets)}


def finish_report(rep: dict[str, Any], buckets: Sequence[FlatBucket], module: nn.Module, frozen, stage: int,
                  world: int, psi: int, reduce_dtype: torch.dtype, comm_bytes: int) -> dict[str, Any]:
    """Add buffers, comm buffers, the total and the prediction (zero_kernels.memory)."""
    rep["buffers"] = sum(nbytes(t) for t in module.buffers()) + sum(nbytes(p.data) for p in frozen)
    rep["comm_buffers"] = comm_bytes        # kept between steps to avoid page faults; not model states
    rep["total"] = sum(rep[k] for k in ("params", "grads", "master_params", "exp_avg", "exp_avg_sq"))
    pbytes = buckets[0].dtype.itemsize
    gbytes = pbytes if stage == 1 else reduce_dtype.itemsize
    mbytes = 0 if all(b.master_is_param for b in buckets) else 4
    rep["predicted"] = model_state_bytes(psi, world, stage, param_bytes=pbytes, grad_bytes=gbytes,
                                         master_bytes=mbytes, optim_bytes=8)
    rep["padding_elements"] = sum(b.spec.padded_numel - b.spec.numel for b in buckets)
    return rep
