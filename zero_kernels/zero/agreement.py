"""Rank agreement at construction: every rank of the group builds the same optimizer.

[Note: rank agreement]
One ``all_gather_object`` of a signature per rank and group of the mesh (shard group, then replicate
group): the parameter list (name, shape, dtype, requires_grad), the groups (parameter names), the
options every rank must share (``ZeroConfig.agreement_key``, by name), the hyper-parameters of every
group, and this rank's construction error (None if it had none). An error or a difference found in one
group becomes the signature's error before the next group's exchange, so on a 2-D mesh it reaches every
row; then every rank raises (the failing rank's message, others name the failing rank by its global
rank; a difference names the option or parameter and both ranks). With ``timeout=`` a join barrier
first bounds the wait for ranks that never construct (``join_barrier``).
"""
from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.nn.parameter import UninitializedParameter

from . import collectives as C
from .timeouts import CollectiveTimeoutError, timeout_scope

__all__ = ["signature", "check_same_everywhere", "raise_if_failed", "join_barrier"]


def signature(uniq, groups_spec, first_name, config_key: tuple, hparams: list, error: str | None) -> dict:
    return {"params": [(n, _shape(p), str(p.dtype), bool(p.requires_grad)) for n, p in uniq],
            "groups": [sorted(first_name[id(p)] for p in g["params"]) for g in groups_spec]
            if error is None else None,
            "config": config_key, "hparams": hparams if error is None else None, "error": error}


def _shape(p) -> tuple | None:
    """The shape (None for a lazy module's uninitialized parameter: params.model_error names it)."""
    return None if isinstance(p, UninitializedParameter) else tuple(p.shape)


def check_same_everywhere(sig: dict, group, world: int, rank: int) -> dict:
    """Exchange ``sig`` over ``group``; returns it with ``error`` set when any rank of the group failed or
    differs (the caller raises after every group of the mesh has seen the errors: [Note: rank agreement])."""
    if world == 1:
        return sig
    sigs: list = [None] * world
    dist.all_gather_object(sigs, sig, group=group)
    errs = [(r, s["error"]) for r, s in enumerate(sigs) if s["error"]]
    if errs:
        r, e = errs[0]
        if r == rank:
            return sig
        return {**sig, "error": f"rank {_global(group, r)} failed to construct the optimizer: {e}"}
    ref = sigs[0]
    for r, s in enumerate(sigs[1:], start=1):
        if s != ref:
            return {**sig, "error": _difference(ref, s, _global(group, 0), _global(group, r))}
    return sig


def raise_if_failed(sig: dict) -> None:
    if sig["error"]:
        raise ValueError(sig["error"])


def _global(group, r: int) -> int:
    """Global rank of group rank ``r`` (messages name global ranks, the ones in the user's logs)."""
    return r if group is None else dist.get_global_rank(group, r)


def _difference(ref: dict, s: dict, r0: int, r: int) -> str:
    if s["config"] != ref["config"]:
        mine, theirs = ref["config"], s["config"]
        diff = {k: (mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)}
        return "; ".join(f"rank {r} constructs the optimizer with {k}={b!r} but rank {r0} with {k}={a!r}"
                         for k, (a, b) in diff.items()) + ": every rank must pass the same options"
    a, b = ref["params"], s["params"]
    if len(a) != len(b):
        return (f"the model on rank {r} has {len(b)} parameters but rank {r0}'s has {len(a)}: every rank of "
                "the data-parallel group must build the same model")
    for x, y in zip(a, b):
        if x != y:
            return (f"the models differ across ranks: parameter (name, shape, dtype, requires_grad) is {x} on "
                    f"rank {r0} but {y} on rank {r}; every rank of the data-parallel group must build the same model")
    if s["groups"] != ref["groups"]:
        return f"param_groups differ between rank {r0} and rank {r}"
    return (f"the hyper-parameters differ between rank {r0} and rank {r}: {ref['hparams']} on rank {r0}, "
            f"{s['hparams']} on rank {r}; every rank must use the same lr, betas, eps, weight_decay, "
            "amsgrad and maximize (per group)")


def join_barrier(group, timeout: datetime.timedelta | None, world: int) -> None:
    """Fail with a clear error when a rank of the group never arrives (instead of hanging); without a
    timeout the process group's own bounds the wait."""
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
            return
    except RuntimeError as e:
        raise CollectiveTimeoutError(
            f"ZeroAdamW construction: not every rank of the process group ({world} ranks) arrived within "
            f"{'the process group timeout' if timeout is None else f'{timeout.total_seconds():g} s'}: "
            f"{str(e).splitlines()[0][:300]}. Likely cause: a rank died or "
            "never constructed the optimizer") from e
    with timeout_scope(timeout, group):
        C.all_reduce_tensor(C.flag_tensor([0], group), group=group)
