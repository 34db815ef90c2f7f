"""Stateless collective wrappers over a process group; each returns a NamedTuple.

Every function takes the group explicitly and holds no state, so stage 3 units and checkpoint code
can reuse them. ``TRACE`` (None, or a list the caller installs) records ``(kind, tag, time)`` when
a collective is *issued*; tests use it to show reduce-scatters start before backward ends. Every
collective also counts the bytes it sends ([Note: bytes on the wire] in wire.py).

[Note: reduced gradients are averages]
A reduced gradient slice holds the group AVERAGE (``ReduceOp.AVG``, as DDP does); where a backend
lacks AVG the SUM is scaled by 1/Nd on the slice after the wait (a pass over the slice only).

[Note: gloo collectives]
Gloo's native reduce-scatter and all-gather are slower than its all-reduce (measured here, 2 ranks,
32 MB fp32: all_reduce 37 ms, reduce_scatter_single 96 ms, reduce_scatter(list) 52 ms,
all_gather_single 55-68 ms; all_to_all_single is no faster than all_reduce either). On gloo these
functions therefore exchange the slices with point-to-point messages (``GLOO_MODE = "p2p"``):
  reduce-scatter: every rank posts, all at once, an ``isend`` of slice j of ``flat`` to rank j and
      an ``irecv`` of each other rank's copy of its own slice (rank r-1's straight into ``output``
      when that is a separate buffer, the others into scratch); the wait sums them into the output
      (own slice + rank r-1 + r-2 + ...) and divides by Nd. Only ``flat``'s own slice may change
      (when ``output`` is that slice); the other slices are read by the sends;
  all-gather: every rank ``isend``s its slice to every other rank and ``irecv``s each other rank's
      slice straight into its place in ``flat`` (no copy).
Each rank sends and receives (Nd-1)/Nd of the bucket per collective: a reduce-scatter plus an
all-gather move what one ring all-reduce moves (2 ranks, 25 MB bucket, same run: all_reduce 35-67
ms, p2p reduce-scatter 16-40 ms, p2p all-gather 11-28 ms), half of the previous emulation (an
all-reduce each). Messages of concurrent collectives never cross: each collective uses its own
gloo tag (a CRC of its kind and the caller's tag; two collectives in flight with the same tag
still match, in posting order, since every rank posts in the same order). Gloo cannot test a
point-to-point handle for completion without waiting (``is_completed()`` stays False until
``wait()``), so callers that reap finished collectives bound how many they keep in flight.
``GLOO_MODE = "allreduce"`` keeps the previous emulation (reduce-scatter = all-reduce(AVG) of the
whole bucket; all-gather = zero the other slices, all-reduce(SUM)) and ``"native"`` the gloo
collectives; NCCL always uses the native collectives.
"""
from __future__ import annotations

import datetime
import json
import time
import zlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._env import choice
from .timeouts import CollectiveTimeoutError, current_timeout, timeout_scope, wait_work
from .wire import record_collective, record_sends

__all__ = ["ReduceScatterResult", "AllGatherResult", "broadcast_from_first", "reduce_scatter_bucket", "all_gather_bucket",
           "all_reduce_tensor", "wait", "TRACE", "group_rank", "group_size", "timeout_scope",
           "wait_work", "CollectiveTimeoutError", "current_timeout", "device_for_backend", "comm_device",
           "flag_tensor", "exchange_json"]

TRACE: list | None = None
# "p2p" | "allreduce" | "native" (see [Note: gloo collectives]); env ZK_GLOO_MODE sets the default
GLOO_MODE = choice("ZK_GLOO_MODE", ("p2p", "allreduce", "native"), "p2p")

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


# ---- [Note: communication device] ---------------------------------------------------------------
# Every tensor handed to a collective lives on the device the group's backend requires: CUDA for
# NCCL (it accepts nothing else), CPU for gloo and MPI. Buckets already live there when the model
# does (CUDA + NCCL, CPU + gloo); the small exchange tensors (had-a-gradient flags, step counts,
# non-finite flags, norms, join barriers) are built with ``flag_tensor`` and reduced by
# ``all_reduce_tensor``, which both use ``comm_device``: the one place that decides.
def device_for_backend(backend: str, fallback: torch.device | None = None) -> torch.device:
    """The device a backend's collectives take tensors on (``fallback`` for unknown backends)."""
    name = str(backend).lower()
    if name == "nccl":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cuda")
    if name in ("gloo", "mpi"):
        return torch.device("cpu")
    return fallback if fallback is not None else torch.device("cpu")


def comm_device(group, fallback: torch.device | None = None) -> torch.device:
    """The device collectives over ``group`` take tensors on (``fallback`` without a process group)."""
    if not dist.is_initialized():
        return fallback if fallback is not None else torch.device("cpu")
    return device_for_backend(dist.get_backend(group), fallback)


def flag_tensor(values, group, dtype: torch.dtype = torch.int32) -> Tensor:
    """A small exchange tensor (flags, counts) on the group's communication device."""
    return torch.as_tensor(values, dtype=dtype).to(comm_device(group))



def _gloo_mode(group) -> str | None:
    return GLOO_MODE if _is_gloo(group) else None


def _p2p_tag(kind: str, tag: Any) -> int:
    """A gloo tag (non-negative int32) the same on every rank for this collective."""
    return zlib.crc32(repr((kind, tag)).encode()) & 0x3FFFFFFF


def _peer(group, r: int) -> int:
    """Global rank of group rank r (isend/irecv take global ranks)."""
    if group is None or group is dist.group.WORLD:
        return r
    return dist.get_global_rank(group, r)


class _Works:
    """Several point-to-point handles waited for as one (``wait(timeout)`` bounds the total)."""
    __slots__ = ("works",)

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout=None) -> bool:
        if timeout is None:
            for w in self.works:
                w.wait()
            return True
        deadline = time.monotonic() + timeout.total_seconds()
        for w in self.works:
            left = max(deadline - time.monotonic(), 1e-3)
            if w.wait(datetime.timedelta(seconds=left)) is False:
                return False
        return True

    def is_completed(self) -> bool:     # gloo p2p: False until wait() (see [Note: gloo collectives])
        return all(w.is_completed() for w in self.works)


def _p2p_reduce_scatter(flat: Tensor, output: Tensor, group, n: int, r: int, tag: Any,
                        scratch: Tensor | None = None):
    shard = flat.numel() // n
    t = _p2p_tag("reduce_scatter", tag)
    own = flat[r * shard:(r + 1) * shard]
    in_place = output.data_ptr() == own.data_ptr()
    if scratch is None or scratch.numel() < (n - 1) * shard:
        scratch = torch.empty((n - 1) * shard, dtype=flat.dtype, device=flat.device)
    works, bufs = [], []
    for k in range(1, n):
        src, dst = (r - k) % n, (r + k) % n
        # rank r-1's copy lands in the output itself when that is a separate buffer (no scratch)
        buf = output if (k == 1 and not in_place) else scratch[(k - 1) * shard:k * shard]
        works.append(dist.irecv(buf, _peer(group, src), group=group, tag=t))
        works.append(dist.isend(flat[dst * shard:(dst + 1) * shard], _peer(group, dst), group=group, tag=t))
        bufs.append(buf)
    record_sends("reduce_scatter", group, [(_peer(group, (r + k) % n), shard * flat.element_size())
                                           for k in range(1, n)])     # [Note: bytes on the wire]

    def fin():                              # sum order: own + (r-1) + (r-2) + ... (a + b == b + a)
        output.add_(bufs[0] if in_place else own)
        for b in bufs[1:]:
            output.add_(b)
        output.div_(n)
        bufs.clear()                        # free the scratch now
    return _Works(works), fin


def _p2p_all_gather(flat: Tensor, group, n: int, r: int, tag: Any):
    shard = flat.numel() // n
    t = _p2p_tag("all_gather", tag)
    own = flat[r * shard:(r + 1) * shard]
    works = []
    for k in range(1, n):
        src, dst = (r - k) % n, (r + k) % n
        works.append(dist.irecv(flat[src * shard:(src + 1) * shard], _peer(group, src), group=group, tag=t))
        works.append(dist.isend(own, _peer(group, dst), group=group, tag=t))
    record_sends("all_gather", group, [(_peer(group, (r + k) % n), shard * flat.element_size())
                                       for k in range(1, n)])
    return _Works(works)


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def reduces_in_place(group) -> bool:
    """True when reduce_scatter_bucket may write the reduced values into ``flat``'s own slice (gloo
    p2p / all-reduce paths, or world size 1), so a caller may pass ``output`` = its slice of
    ``flat`` to skip the copy."""
    return group_size(group) == 1 or _gloo_mode(group) in ("p2p", "allreduce")


def reduce_scatter_bucket(flat: Tensor, output: Tensor, group=None, async_op: bool = True,
                          tag: Any = None, scratch: Tensor | None = None) -> ReduceScatterResult:
    """AVERAGE the flat bucket ``flat`` (padded_numel) over ``group``; this rank receives its slice in
    ``output`` (shard_numel, same dtype). ``flat`` is clobbered (see [Note: gloo collectives]).
    ``scratch`` ((Nd-1) * shard_numel elements, kept by the caller) receives the peers' copies on
    the gloo point-to-point path instead of fresh buffers."""
    if not async_op and current_timeout() is not None:     # bounded wait ([Note: collective timeouts])
        res = reduce_scatter_bucket(flat, output, group, True, tag, scratch)
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
    mode = _gloo_mode(group)
    if mode == "p2p":
        work, fin = _p2p_reduce_scatter(flat, output, group, n, r, tag, scratch)
        if not async_op:
            work.wait()
            fin()
            return ReduceScatterResult(output, None, tag)
        return ReduceScatterResult(output, work, tag, fin)
    if mode == "allreduce":
        record_collective("reduce_scatter", group, flat.numel() * flat.element_size(), algorithm="all_reduce")
        work = dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group, async_op=async_op)

        def fin():
            if output.data_ptr() != flat[r * shard:].data_ptr():   # output may be the slice itself
                output.copy_(flat[r * shard:(r + 1) * shard])
        if not async_op:
            fin()
            return ReduceScatterResult(output, None, tag)
        return ReduceScatterResult(output, work, tag, fin)
    record_collective("reduce_scatter", group, flat.numel() * flat.element_size())
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
    mode = _gloo_mode(group)
    if mode == "p2p":
        work = _p2p_all_gather(flat, group, n, rank, tag)
        if not async_op:
            work.wait()
            return AllGatherResult(flat, None, tag)
        return AllGatherResult(flat, work, tag)
    if mode == "allreduce":
        flat[:rank * shard].zero_()
        flat[(rank + 1) * shard:].zero_()
        record_collective("all_gather", group, flat.numel() * flat.element_size(), algorithm="all_reduce")
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        return AllGatherResult(flat, work, tag)
    inp = flat[rank * shard:(rank + 1) * shard]
    record_collective("all_gather", group, flat.numel() * flat.element_size())
    work = _ag(flat, inp, group=group, async_op=async_op)
    return AllGatherResult(flat, work, tag)


def all_reduce_tensor(t: Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    """All-reduce a small tensor in place; it travels on the group's device ([Note: communication
    device]): a tensor elsewhere is reduced through a copy there (synchronously)."""
    _trace("all_reduce", None)
    if group_size(group) == 1:
        return None
    dev = comm_device(group, t.device)
    if t.device != dev:
        moved = t.to(dev)
        all_reduce_tensor(moved, op, group)
        t.copy_(moved)
        return None
    record_collective("all_reduce", group, t.numel() * t.element_size())
    if not async_op and current_timeout() is not None:   # bounded wait (see [Note: collective timeouts])
        wait_work(dist.all_reduce(t, op=op, group=group, async_op=True), "all_reduce", group=group)
        return None
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


@torch.no_grad()
def broadcast_from_first(tensors: list[Tensor], group=None) -> None:
    """Overwrite ``tensors`` on every rank with group rank 0's values (what DDP does to parameters and
    buffers at construction): one broadcast per (device, dtype), through a flat copy on the group's
    device. Bounded by the enclosing ``timeout_scope``."""
    if group_size(group) == 1:
        return
    by_kind: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), ts in by_kind.items():
        _trace("broadcast", None)
        flat = torch.cat([t.detach().reshape(-1) for t in ts]).to(comm_device(group, device))
        record_collective("broadcast", group, flat.numel() * flat.element_size())
        work = dist.broadcast(flat, src=_peer(group, 0), group=group, async_op=True)
        wait_work(work, "broadcast", group=group) if current_timeout() is not None else work.wait()
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()


def exchange_json(obj: Any, group=None, kind: str = "status exchange") -> list:
    """Every rank's ``obj`` (small and JSON-able: statuses, names, file hashes; tuples come back as
    lists) on every rank of ``group``, in group-rank order: two all-gathers (lengths, then bytes)
    bounded by the enclosing ``timeout_scope`` like every wait here. ``all_gather_object`` would
    wait for the process group's own timeout, and unpickle what peers send."""
    n = group_size(group)
    if n == 1:
        return [obj]
    raw = json.dumps(obj).encode()
    dev = comm_device(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(n)]
    _bounded(dist.all_gather(lengths, torch.tensor([len(raw)], dtype=torch.int64, device=dev), group=group,
                             async_op=True), kind, group)
    m = max(int(x.item()) for x in lengths)
    mine = torch.zeros(m, dtype=torch.uint8)
    if raw:
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    outs = [torch.empty(m, dtype=torch.uint8, device=dev) for _ in range(n)]
    _bounded(dist.all_gather(outs, mine.to(dev), group=group, async_op=True), kind, group)
    return [json.loads(bytes(o[:int(k.item())].cpu().tolist()).decode()) for o, k in zip(outs, lengths)]


def _bounded(work, kind: str, group) -> None:
    wait_work(work, kind, group=group) if current_timeout() is not None else work.wait()


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


