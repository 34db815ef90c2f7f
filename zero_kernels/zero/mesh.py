"""ZeroMesh: the ranks a ZeroAdamW shards over and the ranks it replicates over.

[Note: hybrid sharding]
``ZeroAdamW(model, stage, mesh=mesh)`` with a 2-D ``DeviceMesh`` whose dimensions are named
``("replicate", "shard")`` (FSDP2's HSDP; DeepSpeed's MiCS and ZeRO++ hpZ are the same layout)
shards the optimizer states (stage 3: the parameters too) over the *shard* group, the ranks of
one mesh row, and keeps one identical copy of that sharded state per row. Per step:
  gradients   reduce-scatter (average) inside the shard group, then an all-reduce (average) of
              this rank's slice only across the replicate group (the ranks holding the same slice
              in the other rows): Psi/S elements cross rows, not Psi;
  parameters  all-gather inside the shard group only (stages 1-2 after the step, stage 3 in
              forward/backward): nothing crosses rows.
Every row therefore steps the same slices from the same averaged gradients and stays bit-identical
to the others. Everything the optimizer layout depends on (rank, world size, layout, memory
report, state_dict(), checkpoints) is the shard group's: the optimizer *is* a ZeRO optimizer over
the shard group, plus the replicate all-reduce on each reduced slice (:func:`reduce_scatter`). The
small agreements that must hold on every rank of the mesh (had-a-gradient flags, the non-finite
skip decision, the construction signature, the initial broadcast of the parameters) run over the
shard group and then over the replicate group (:func:`all_reduce_everywhere`,
:func:`broadcast_from_first`), which reaches every rank of the mesh without a third group.
A 1-D mesh is ``process_group=mesh.get_group()``; ``process_group=`` alone is a mesh with no
replicate group. The slices' global norm needs no replicate step: every row holds the same slices.
Checkpoints: the rows hold identical shards, so only the first row writes them (S shard files, once;
:meth:`ZeroMesh.on_first_replica`) and every row reads the same files; a load that fails on any row
changes nothing on any row (:meth:`ZeroMesh.any_replica`). Ordering: the replicate all-reduce is a
collective every rank must issue at the same point, so it runs in the reduce-scatter's finalize and
the handle never reports early completion (:class:`_InOrder`). qgZ (``quantize_grads``) rides on the
mesh because it changes this same reduce-scatter (qgz.py) and, under hybrid sharding, the replicate
average too ([Note: hierarchical qgZ]: int8 codes across nodes as well).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import collectives as C
from .qgz import quantized_average, quantized_reduce_scatter

__all__ = ["ZeroMesh", "resolve_mesh", "reduce_scatter", "all_reduce_everywhere", "broadcast_from_first",
           "replicate_average", "same_everywhere", "fingerprint", "MESH_DIM_NAMES"]

MESH_DIM_NAMES = ("replicate", "shard")


class ZeroMesh(NamedTuple):
    shard_group: Any                # the ZeRO process group (None: the default group)
    replicate_group: Any            # ranks holding the same slices in the other rows (None: no replicas)
    replicate_size: int = 1
    replicate_rank: int = 0
    quantize_grads: bool = False    # qgZ: int8 codes in the shard reduce-scatter (qgz.py)

    @property
    def groups(self) -> tuple:
        """The groups to agree over, shard group first (both reach every rank of the mesh)."""
        return (self.shard_group,) if self.replicate_size == 1 else (self.shard_group, self.replicate_group)

    def any_replica(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on some rank of this rank's replicate group
        (bounded by the enclosing timeout scope)."""
        if self.replicate_size == 1:
            return bool(flag)
        t = C.flag_tensor([int(bool(flag))], self.replicate_group)
        C.all_reduce_tensor(t, op=dist.ReduceOp.MAX, group=self.replicate_group)
        return bool(t.item())

    def on_first_replica(self, fn: Callable[[], str], error_cls: type[Exception]) -> str:
        """[Note: checkpoints under hybrid sharding] Run ``fn`` (a collective over the shard group
        returning a string) on the first row of the mesh only; the other rows get its result, or
        raise ``error_cls`` naming its failure. Rows hold identical shards, so one row writes them
        and no file is written twice; every row reads the same files when loading."""
        if self.replicate_size == 1:
            return fn()
        result, err = "", None
        if self.replicate_rank == 0:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - re-raised below, reported to the other rows
                err = e
        text = _broadcast_text(f"E{type(err).__name__}: {err}" if err is not None else f"R{result}",
                               self.replicate_group)
        if err is not None:
            raise err
        if text[0] == "E":
            raise error_cls(f"failed on the first replica of the mesh (replicate rank 0), which does it for "
                            f"every replica: {text[1:]}")
        return text[1:]


def resolve_mesh(mesh, process_group) -> ZeroMesh:
    """The ZeroMesh of ``ZeroAdamW(..., mesh=, process_group=)``; raises on a bad combination before
    any collective."""
    if mesh is None:
        return ZeroMesh(process_group, None)
    if process_group is not None:
        raise ValueError("ZeroAdamW got both mesh= and process_group=: pass one. mesh= (a DeviceMesh, 1-D, "
                         "or 2-D with dimensions named ('replicate', 'shard')) defines the sharding and "
                         "replication groups itself; process_group= is the 1-D form")
    if not isinstance(mesh, dist.device_mesh.DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.get_coordinate() is None:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not in the mesh {mesh.mesh.tolist()}: "
                         "construct the optimizer only on the ranks of its mesh")
    if mesh.ndim == 1:
        return ZeroMesh(mesh.get_group(), None)
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or set(names) != set(MESH_DIM_NAMES):
        raise ValueError(f"mesh must be 1-D, or 2-D with mesh_dim_names=('replicate', 'shard') (HSDP: shard "
                         f"inside 'shard', replicate across 'replicate'); got shape {tuple(mesh.shape)} with "
                         f"names {mesh.mesh_dim_names}. Build it with init_device_mesh(device, (R, S), "
                         "mesh_dim_names=('replicate', 'shard'))")
    rep = mesh.get_group("replicate")
    size = mesh.size(names.index("replicate"))
    return ZeroMesh(mesh.get_group("shard"), rep if size > 1 else None, size, mesh.get_local_rank("replicate"))


def replicate_average(t: Tensor, mesh: ZeroMesh) -> None:
    """Average ``t`` in place across the replicate group (bounded by the enclosing timeout scope);
    with qgZ in int8 codes ([Note: hierarchical qgZ] in qgz.py)."""
    if mesh.replicate_size > 1 and mesh.quantize_grads:
        quantized_average(t, mesh.replicate_group)
    elif mesh.replicate_size > 1:
        C.all_reduce_tensor(t, op=dist.ReduceOp.SUM, group=mesh.replicate_group)
        t.div_(mesh.replicate_size)


def reduce_scatter(flat: Tensor, output: Tensor, mesh: ZeroMesh, async_op: bool = True, tag: Any = None,
                   scratch: Tensor | None = None) -> C.ReduceScatterResult:
    """``collectives.reduce_scatter_bucket`` over the shard group whose slice is then averaged across
    the replicate group ([Note: hybrid sharding]): synchronously, or in the result's ``finalize``
    (run by ``collectives.wait`` after the reduce-scatter completes)."""
    rs = quantized_reduce_scatter if mesh.quantize_grads else C.reduce_scatter_bucket
    res = rs(flat, output, mesh.shard_group, async_op, tag, scratch)
    if mesh.replicate_size == 1:
        return res
    if res.work is None and res.finalize is None:           # already complete
        replicate_average(output, mesh)
        return res
    inner = res.finalize

    def finalize():
        if inner is not None:
            inner()
        replicate_average(output, mesh)
    return res._replace(work=_InOrder(res.work) if res.work is not None else None, finalize=finalize)


class _InOrder:
    """A reduce-scatter handle that reports completion only through ``wait()``. Its finalize issues
    the replicate all-reduce, a collective every rank must issue at the same point of its sequence;
    a caller that finishes handles as they happen to complete (hooks.py reaps completed buckets
    during backward) would otherwise issue it at a rank-dependent point, e.g. before the step's flag
    all-reduce on one replica and after it on another."""
    __slots__ = ("work",)

    def __init__(self, work):
        self.work = work

    def wait(self, timeout=None) -> bool:
        return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return False


def all_reduce_everywhere(t: Tensor, op, mesh: ZeroMesh) -> None:
    """All-reduce a small exchange tensor over every rank of the mesh (shard group, then replicate
    group: exact for MAX, MIN and SUM)."""
    for g in mesh.groups:
        C.all_reduce_tensor(t, op=op, group=g)


def same_everywhere(value: int, mesh: ZeroMesh) -> bool:
    """True on every rank when every rank of the mesh passed the same ``value`` (an int64: a fingerprint);
    one all-reduce(MAX) of (value, -value) per group, bounded by the enclosing timeout scope."""
    t = C.flag_tensor([value, -value], mesh.shard_group, dtype=torch.int64)
    all_reduce_everywhere(t, dist.ReduceOp.MAX, mesh)
    return int(t[0].item()) == -int(t[1].item())


def fingerprint(obj) -> int:
    """A 56-bit fingerprint of a JSON-able object (``same_everywhere``'s value)."""
    raw = json.dumps(obj, sort_keys=True, default=str).encode()
    return int(hashlib.sha256(raw).hexdigest()[:14], 16)


@torch.no_grad()
def broadcast_from_first(tensors: list[Tensor], mesh: ZeroMesh) -> None:
    """Every rank of the mesh takes the values of mesh rank (0, 0): the first rank of its shard group,
    whose values came from the first rank of its replicate group."""
    for g in mesh.groups:
        C.broadcast_from_first(tensors, g)


def _broadcast_text(text: str, group) -> str:
    """``text`` of the group's first rank, on every rank of ``group`` (two bounded broadcasts)."""
    raw = text.encode()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    C.broadcast_from_first([n], group)
    buf = data.clone() if C.group_rank(group) == 0 else torch.zeros(int(n.item()), dtype=torch.uint8)
    C.broadcast_from_first([buf], group)
    return bytes(buf.tolist()).decode()
