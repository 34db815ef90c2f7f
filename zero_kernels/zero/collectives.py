"""Stateless collective wrappers over a process group; each returns a NamedTuple.

Every function takes the group explicitly and holds no state, so stage 3 units and checkpoint code
can reuse them. ``TRACE`` (None, or a list the caller installs) records ``(kind, tag, time)`` when
a collective is *issued*; tests use it to show reduce-scatters start before backward ends.

Gradients are reduced with SUM and the 1/Nd average is folded into the fused kernel's
``grad_scale`` (one multiply per element that the kernel does anyway; works on every backend,
including ones without ``ReduceOp.AVG``).
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ReduceScatterResult", "AllGatherResult", "reduce_scatter_bucket", "all_gather_bucket",
           "all_reduce_tensor", "wait", "TRACE", "group_rank", "group_size"]

TRACE: list | None = None

# Newer torch names the single-tensor collectives *_single; older only has *_tensor / *_into_tensor.
_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _trace(kind: str, tag: Any) -> None:
    if TRACE is not None:
        TRACE.append((kind, tag, time.perf_counter()))


class ReduceScatterResult(NamedTuple):
    output: Tensor            # this rank's slice of the SUM over the group (shard_numel elements)
    work: Any                 # async handle (None when synchronous or world size 1)
    tag: Any


class AllGatherResult(NamedTuple):
    output: Tensor            # the full flat buffer (written in place)
    work: Any
    tag: Any


def group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def reduce_scatter_bucket(flat: Tensor, output: Tensor, group=None, async_op: bool = True,
                          tag: Any = None) -> ReduceScatterResult:
    """SUM-reduce the flat bucket ``flat`` (padded_numel) over ``group``; this rank receives its
    slice in ``output`` (shard_numel, same dtype)."""
    _trace("reduce_scatter", tag)
    if group_size(group) == 1:
        output.copy_(flat)
        return ReduceScatterResult(output, None, tag)
    work = _rs(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return ReduceScatterResult(output, work, tag)


def all_gather_bucket(flat: Tensor, rank: int, group=None, async_op: bool = True,
                      tag: Any = None) -> AllGatherResult:
    """Fill every slice of ``flat`` from its owner; this rank's slice ``rank`` is the input
    (in place: the input is a view of the output, as FSDP does)."""
    _trace("all_gather", tag)
    n = group_size(group)
    if n == 1:
        return AllGatherResult(flat, None, tag)
    shard = flat.numel() // n
    # Gloo's all-gather reads every input before writing outputs, so the in-place form is safe.
    inp = flat[rank * shard:(rank + 1) * shard]
    work = _ag(flat, inp, group=group, async_op=async_op)
    return AllGatherResult(flat, work, tag)


def all_reduce_tensor(t: Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
    _trace("all_reduce", None)
    if group_size(group) == 1:
        return None
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def wait(result) -> Tensor | None:
    """Wait for a result's handle (no-op if synchronous); returns its output."""
    if result is None:
        return None
    if result.work is not None:
        result.work.wait()
    return result.output
