"""Bounded waits for collectives: a scope, a method decorator, and the package's timeout error.

[Note: collective timeouts]
ZeroAdamW(timeout=...) runs its collectives inside ``timeout_scope``: every wait then uses
``work.wait(timeout)`` (gloo and NCCL honour it) and a timeout or a peer failure becomes a
CollectiveTimeoutError naming the collective, the group size and the likely cause, instead of a
hang (a dead peer usually fails fast with "connection closed"; a live peer that never reaches
the collective fails after ``timeout``). Outside a scope, waits use the process group's timeout.
The optimizer's collective-issuing methods carry the :func:`bounded_by_timeout` decorator in the
class body (nothing is patched onto the class afterwards); the stage-2/3 reducers open the scope
themselves for the waits they do during backward.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import time
from typing import Any

import torch.distributed as dist

__all__ = ["CollectiveTimeoutError", "as_timedelta", "timeout_scope", "current_timeout", "wait_work",
           "timeout_message", "bounded_by_timeout", "scoped"]

_SCOPE = threading.local()
_PEER_FAILURE = ("Connection closed", "Connection reset", "Timed out", "timed out")


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a rank died, hung, or never reached it."""


def as_timedelta(timeout) -> datetime.timedelta | None:
    """None, a timedelta, or seconds (a positive finite number) as a timedelta."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        if timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be None, a positive datetime.timedelta or a positive number of seconds, "
                             f"got {timeout!r}")
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be None, a datetime.timedelta or a positive number of seconds, "
                         f"got {timeout!r}")
    return datetime.timedelta(seconds=float(timeout))


@contextlib.contextmanager
def timeout_scope(timeout, group=None):
    """Bound every collective wait in this block by ``timeout`` (seconds or timedelta; None: no bound)."""
    prev = getattr(_SCOPE, "value", None)
    _SCOPE.value = None if timeout is None else (as_timedelta(timeout), group)
    try:
        yield
    finally:
        _SCOPE.value = prev


def current_timeout():
    v = getattr(_SCOPE, "value", None)
    return None if v is None else v[0]


def wait_work(work, kind: str = "collective", tag: Any = None, group=None) -> None:
    """Wait for ``work``, bounded by the enclosing scope's timeout. ``group``: the group the collective
    runs over, for the message (default: the scope's group; a collective over another group, e.g. a
    hybrid mesh's replicate group inside the shard group's scope, passes its own)."""
    v = getattr(_SCOPE, "value", None)
    if v is None:
        work.wait()
        return
    timeout, scope_group = v
    group = scope_group if group is None else group
    t0 = time.perf_counter()
    try:
        ok = work.wait(timeout)
    except RuntimeError as e:
        raise CollectiveTimeoutError(timeout_message(kind, tag, group, timeout, time.perf_counter() - t0, e)) from e
    if ok is False:
        raise CollectiveTimeoutError(timeout_message(kind, tag, group, timeout, time.perf_counter() - t0, None))


def timeout_message(kind, tag, group, timeout, waited, err) -> str:
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    r = dist.get_rank(group) if dist.is_initialized() else 0
    why = str(err).strip().splitlines()[0][:200] if err is not None else "timed out"
    unit = (f" A ZeRO-3 unit's gather (unit {tag[1]} of zopt.sharding_units()): every rank must run the model "
            "(or the unit) too; a forward, generate() or evaluation on some ranks only (`if rank == 0:`) waits "
            "here. Run it on every rank (others may drop the result), or evaluate a plain copy built from "
            "zopt.full_model_state_dict() (every rank calls it). A unit the forward itself calls on some ranks "
            "only (an MoE layer's experts, routed by each rank's data) waits here too: make the layer one unit "
            "with wrap=[<the MoE layer's class>, ...] ([Note: stage-3 units])."
            if isinstance(tag, tuple) and tag[:1] == ("unit",) and len(tag) > 1 else "")
    return (f"{kind} (tag {tag!r}) over a process group of {n} ranks did not complete on rank {r} "
            f"after {waited:.1f} s (timeout {timeout.total_seconds():g} s): {why}. Likely cause: another "
            "rank of the group died, is hung, or never reached this collective (e.g. it skipped step() "
            f"or exited early); check the other ranks' logs.{unit}")


def scoped(timeout, group, fn):
    """``fn`` run inside ``timeout_scope(timeout, group)``: for module and autograd hooks, which run
    outside the optimizer's (decorated) methods but wait for collectives too (stage-3 gathers,
    overlapped parameter all-gathers)."""
    if timeout is None:
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with timeout_scope(timeout, group):
            return fn(*args, **kwargs)
    return run


def bounded_by_timeout(fn):
    """Method decorator: run the method inside ``timeout_scope(self.timeout, self.process_group)``;
    a peer failure raised when a collective is *issued* becomes a CollectiveTimeoutError too."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        timeout = self.timeout
        with timeout_scope(timeout, self.process_group):
            try:
                return fn(self, *args, **kwargs)
            except CollectiveTimeoutError:
                raise
            except RuntimeError as e:
                if timeout is None or not any(k in str(e) for k in _PEER_FAILURE):
                    raise
                raise CollectiveTimeoutError(timeout_message(
                    f"a collective in {fn.__name__}()", None, self.process_group, timeout, 0.0, e)) from e
    return wrapper
