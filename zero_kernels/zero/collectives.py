"""Stateless collective wrappers over a process group; each returns a NamedTuple.

Every function takes the group explicitly and holds no state, so stage 3 units and checkpoint code
can reuse them. ``TRACE`` (None, or a list the caller installs) records ``(kind, tag, time)`` when
a collective is *issued*; tests use it to show reduce-scatters start before backward ends.

[Note: reduced gradients are averages]
A reduced gradient slice holds the group AVERAGE (``ReduceOp.AVG``, as DDP does); where a backend
lacks AVG the SUM is scaled by 1/Nd on the slice after the wait (a pass over the slice only).

[Note: gloo collectives]
Gloo's reduce-scatter and all-gather are slower than its all-reduce (measured here, 2 ranks, 32 MB
fp32: all_reduce 37 ms, reduce_scatter_single 96 ms, reduce_scatter(list) 52 ms,
all_gather_single 55-68 ms). On gloo these functions therefore run an all-reduce of the whole
bucket: reduce-scatter = all-reduce(AVG) in place, then this rank copies its slice out;
all-gather = zero the other ranks' slices, all-reduce(SUM) (x + 0 == x exactly; a -0.0 may come
back as +0.0). Same results and the same bytes held afterwards; NCCL uses the native collectives.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ReduceScatterResult", "AllGatherResult", "reduce_scatter_bucket", "all_gather_bucket",
           "all_reduce_tensor", "wait", "TRACE", "group_rank", "group_size", "timeout_scope",
           "wait_work", "CollectiveTimeoutError", "current_timeout"]

TRACE: list | None = None

# Newer torch names the single-tensor collectives *_single; older only has *_tensor / *_into_tensor.
_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _trace(kind: str, tag: Any) -> None:
    if TRACE is not None:
        TRACE.append((kind, tag, time.perf_counter()))


class ReduceScatterResult(NamedTuple):
    output: Tensor            # this rank's slice of the AVERAGE over the group (shard_numel elements)
    work: Any                 # async handle (None when synchronous or world size 1)
    tag: Any
    finalize: Any = None      # run by wait() after the handle completes (slice copy / 1/Nd scale)


class AllGatherResult(NamedTuple):
    output: Tensor            # the full flat buffer (written in place)
    work: Any
    tag: Any
    finalize: Any = None


def _is_gloo(group) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:
        return False




def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def reduces_in_place(group) -> bool:
    """True when reduce_scatter_bucket leaves the reduced values in ``flat`` itself (gloo path, or
    world size 1), so a caller may pass ``output`` = its slice of ``flat`` to skip the copy."""
    return group_size(group) == 1 or _is_gloo(group)


def reduce_scatter_bucket(flat: Tensor, output: Tensor, group=None, async_op: bool = True,
                          tag: Any = None) -> ReduceScatterResult:
    """AVERAGE the flat bucket ``flat`` (padded_numel) over ``group``; this rank receives its slice in
    ``output`` (shard_numel, same dtype). ``flat`` is clobbered (see [Note: gloo collectives])."""
    if not async_op and current_timeout() is not None:     # bounded wait ([Note: collective timeouts])
        res = reduce_scatter_bucket(flat, output, group, True, tag)
        wait(res)
        return res._replace(work=None, finalize=None)
    _trace("reduce_scatter", tag)
    n = group_size(group)
    if n == 1:
        if output.data_ptr() != flat.data_ptr():
            output.copy_(flat[:output.numel()])
        return ReduceScatterResult(output, None, tag)
    r = group_rank(group)
    shard = flat.numel() // n
    if _is_gloo(group):
        work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group, async_op=async_op)

        def fin():
            if output.data_ptr() != flat[r * shard:].data_ptr():   # output may be the slice itself
                output.copy_(flat[r * shard:(r + 1) * shard])
        if not async_op:
            fin()
            return ReduceScatterResult(output, None, tag)
        return ReduceScatterResult(output, work, tag, fin)
    try:
        work = _rs(output, flat, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
        fin = None
    except (RuntimeError, ValueError):          # no AVG on this backend: SUM, then scale the slice
        work = _rs(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

        def fin():
            output.mul_(1.0 / n)
        if not async_op:
            fin()
            fin = None
    return ReduceScatterResult(output, work, tag, fin)


def all_gather_bucket(flat: Tensor, rank: int, group=None, async_op: bool = True,
                      tag: Any = None) -> AllGatherResult:
    """Fill every slice of ``flat`` from its owner; this rank's slice ``rank`` is the input
    (in place: the input is a view of the output, as FSDP does)."""
    if not async_op and current_timeout() is not None:     # bounded wait ([Note: collective timeouts])
        res = all_gather_bucket(flat, rank, group, True, tag)
        wait(res)
        return res._replace(work=None, finalize=None)
    _trace("all_gather", tag)
    n = group_size(group)
    if n == 1:
        return AllGatherResult(flat, None, tag)
    shard = flat.numel() // n
    if _is_gloo(group):
        flat[:rank * shard].zero_()
        flat[(rank + 1) * shard:].zero_()
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return AllGatherResult(flat, work, tag)
    inp = flat[rank * shard:(rank + 1) * shard]
    work = _ag(flat, inp, group=group, async_op=async_op)
    return AllGatherResult(flat, work, tag)


def all_reduce_tensor(t: Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    _trace("all_reduce", None)
    if group_size(group) == 1:
        return None
    if not async_op and current_timeout() is not None:   # bounded wait (see [Note: collective timeouts])
        wait_work(dist.all_reduce(t, op=op, group=group, async_op=True), "all_reduce")
        return None
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def wait(result) -> Tensor | None:
    """Wait for a result's handle (no-op if synchronous); returns its output. Inside
    ``timeout_scope(seconds)`` the wait is bounded (see [Note: collective timeouts])."""
    if result is None:
        return None
    if result.work is not None:
        wait_work(result.work, type(result).__name__.replace("Result", ""), result.tag)
    if getattr(result, "finalize", None) is not None:
        result.finalize()
    return result.output


# ---- [Note: collective timeouts] ----------------------------------------------------------------
# ZeroAdamW(timeout=...) runs its collectives inside ``timeout_scope``: every wait then uses
# ``work.wait(timeout)`` (gloo and NCCL honour it) and a timeout or a peer failure becomes a
# CollectiveTimeoutError naming the collective, the group size and the likely cause, instead of a
# hang (a dead peer usually fails fast with "connection closed"; a live peer that never reaches
# the collective fails after ``timeout``). Outside a scope, waits use the process group's timeout.
import contextlib as _contextlib  # noqa: E402
import datetime as _datetime  # noqa: E402
import threading as _threading  # noqa: E402

_SCOPE = _threading.local()


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a rank died, hung, or never reached it."""


def _as_timedelta(timeout) -> "_datetime.timedelta | None":
    if timeout is None or isinstance(timeout, _datetime.timedelta):
        return timeout
    return _datetime.timedelta(seconds=float(timeout))


@_contextlib.contextmanager
def timeout_scope(timeout, group=None):
    """Bound every collective wait in this block by ``timeout`` (seconds or timedelta; None: no bound)."""
    prev = getattr(_SCOPE, "value", None)
    _SCOPE.value = None if timeout is None else (_as_timedelta(timeout), group)
    try:
        yield
    finally:
        _SCOPE.value = prev


def current_timeout():
    v = getattr(_SCOPE, "value", None)
    return None if v is None else v[0]


def wait_work(work, kind: str = "collective", tag: Any = None) -> None:
    v = getattr(_SCOPE, "value", None)
    if v is None:
        work.wait()
        return
    timeout, group = v
    t0 = time.perf_counter()
    try:
        ok = work.wait(timeout)
    except RuntimeError as e:
        raise CollectiveTimeoutError(_timeout_message(kind, tag, group, timeout, time.perf_counter() - t0, e)) from e
    if ok is False:
        raise CollectiveTimeoutError(_timeout_message(kind, tag, group, timeout, time.perf_counter() - t0, None))


def _timeout_message(kind, tag, group, timeout, waited, err) -> str:
    n = group_size(group)
    r = group_rank(group)
    why = str(err).strip().splitlines()[0][:200] if err is not None else "timed out"
    return (f"{kind} (tag {tag!r}) over a process group of {n} ranks did not complete on rank {r} "
            f"after {waited:.1f} s (timeout {timeout.total_seconds():g} s): {why}. Likely cause: another "
            "rank of the group died, is hung, or never reached this collective (e.g. it skipped step() "
            "or exited early); check the other ranks' logs.")
