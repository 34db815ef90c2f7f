"""Rank agreement at construction: every rank of the group builds the same optimizer.

[Note: rank agreement]
One ``all_gather_object`` of a signature per rank: the parameter list (name, shape, dtype,
requires_grad), the groups (parameter names), the configuration that decides the layout, the
hyper-parameters of every group, and this rank's construction error (None if it had none). Any
error raises on every rank (the failing rank's message, others name the failing rank); any
difference raises naming the first rank and what differs. With ``timeout=`` a join barrier first
bounds the wait for ranks that never construct (``join_barrier``).
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from . import collectives as C
from .timeouts import CollectiveTimeoutError, timeout_scope

__all__ = ["signature", "check_same_everywhere", "join_barrier"]


def signature(uniq, groups_spec, first_name, config_key: tuple, hparams: list, error: str | None) -> dict:
    return {"params": [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in uniq],
            "groups": [sorted(first_name[id(p)] for p in g["params"]) for g in groups_spec]
            if error is None else None,
            "config": config_key, "hparams": hparams if error is None else None, "error": error}


def check_same_everywhere(sig: dict, group, world: int, rank: int) -> None:
    if world == 1:
        if sig["error"]:
            raise ValueError(sig["error"])
        return
    sigs: list = [None] * world
    dist.all_gather_object(sigs, sig, group=group)
    errs = [(r, s["error"]) for r, s in enumerate(sigs) if s["error"]]
    if errs:
        r, e = errs[0]
        raise ValueError(e if r == rank else f"rank {r} of the process group failed to construct: {e}")
    ref = sigs[0]
    for r, s in enumerate(sigs[1:], start=1):
        if s != ref:
            raise ValueError(_difference(ref, s, r))


def _difference(ref: dict, s: dict, r: int) -> str:
    if s["config"] != ref["config"]:
        return (f"rank {r} constructs the optimizer with (stage, bucket_size, param_dtype, reduce_dtype, "
                f"alignment) = {s['config']} but rank 0 with {ref['config']}")
    a, b = ref["params"], s["params"]
    if len(a) != len(b):
        return (f"the model on rank {r} has {len(b)} parameters but rank 0's has {len(a)}: every rank of "
                "the data-parallel group must build the same model")
    for x, y in zip(a, b):
        if x != y:
            return (f"the models differ across ranks: parameter (name, shape, dtype, requires_grad) is {x} on "
                    f"rank 0 but {y} on rank {r}; every rank of the data-parallel group must build the same model")
    if s["groups"] != ref["groups"]:
        return f"param_groups differ between rank 0 and rank {r}"
    return (f"the hyper-parameters differ between rank 0 and rank {r}: {ref['hparams']} on rank 0, "
            f"{s['hparams']} on rank {r}; every rank must use the same lr, betas, eps, weight_decay, "
            "amsgrad and maximize (per group)")


def join_barrier(group, timeout: datetime.timedelta, world: int) -> None:
    """Fail with a clear error when a rank of the group never arrives (instead of hanging)."""
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
            return
    except RuntimeError as e:
        raise CollectiveTimeoutError(
            f"ZeroAdamW construction: not every rank of the process group ({world} ranks) arrived within "
            f"{timeout.total_seconds():g} s: {str(e).splitlines()[0][:300]}. Likely cause: a rank died or "
            "never constructed the optimizer") from e
    with timeout_scope(timeout, group):
        C.all_reduce_tensor(C.flag_tensor([0], group), group=group)
