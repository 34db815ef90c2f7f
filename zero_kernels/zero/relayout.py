"""Re-layout between a bucket's flat slices and per-parameter dim-0 chunks (FSDP2's ``Shard(0)``).

[Note: dim-0 chunks]
FSDP2 shards every parameter on its first dimension with ``torch.chunk`` semantics: with ``d0`` rows
and ``n`` ranks every rank gets ``c = ceil(d0 / n)`` rows, rank ``r`` the rows ``[r*c, min((r+1)*c,
d0))`` (empty for the last ranks when ``d0 < n*c`` runs out, e.g. a 1-row parameter on 2 ranks).
A 0-dim parameter cannot be split: it is held whole by every rank (``Replicate``); for the exchange
below rank 0 contributes it. In the *flattened* parameter a chunk is the contiguous element range
``[lo * row, hi * row)`` (``row`` = elements per row), so both layouts are element ranges of the
flat bucket ([Note: slice] in layout.py) and converting is moving ranges between ranks:
  * flat -> chunks (:func:`gather_chunks`): all-gather the bucket's slices into one full fp32 bucket
    buffer, cut every parameter's chunk out of it (cloned) and drop the buffer;
  * chunks -> flat (:func:`scatter_chunks`): every rank packs its chunks of the bucket's parameters
    back to back into its part of a ``n * pack`` buffer (``pack`` = the largest rank's total),
    all-gathers it, and copies the ranges that fall inside its own slice into it.
Both are one all-gather of about one bucket, so the transient memory is about one bucket (stage 3:
one unit), never the model; both move bits only (no arithmetic), so a round trip is bitwise. An
all-to-all would move 1/n of the bytes, but gloo's all-to-all is no faster than its all-reduce
([Note: gloo collectives]) and a checkpoint is not on the step's critical path.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from ..layout import ParamSpec
from . import collectives as C

__all__ = ["ChunkRange", "chunk_range", "chunk_shape", "Chunks", "gather_chunks", "Slice", "scatter_chunks"]


class ChunkRange(NamedTuple):
    """Rank ``rank``'s dim-0 chunk of a parameter as an element range of the flattened parameter."""
    start: int
    numel: int


def chunk_range(shape: Sequence[int], rank: int, world: int) -> ChunkRange:
    """[Note: dim-0 chunks]: ``torch.chunk(param, world, 0)[rank]`` as a range (0-dim: rank 0 whole)."""
    if len(shape) == 0:
        return ChunkRange(0, 1 if rank == 0 else 0)
    d0 = int(shape[0])
    row = math.prod(int(s) for s in shape[1:])
    c = -(-d0 // world)
    lo = min(rank * c, d0)
    hi = min(lo + c, d0)
    return ChunkRange(lo * row, (hi - lo) * row)


def chunk_shape(shape: Sequence[int], rank: int, world: int) -> tuple[int, ...]:
    """The local shape of rank's chunk (0-dim: the full, empty shape)."""
    if len(shape) == 0:
        return ()
    row = math.prod(int(s) for s in shape[1:])
    rows = chunk_range(shape, rank, world).numel // row if row else 0
    return (rows, *(int(s) for s in shape[1:]))


class Chunks(NamedTuple):
    """This rank's chunk of every parameter of one bucket, in the bucket's parameter order."""
    tensors: list[Tensor]


def gather_chunks(slice_: Tensor, specs: Sequence[ParamSpec], padded_numel: int, rank: int, world: int,
                  group, tag=None) -> Chunks:
    """Collective: from every rank's fp32 slice of one bucket to this rank's chunk of each parameter
    (0-dim parameters: the whole value on every rank)."""
    full = torch.empty(padded_numel, dtype=torch.float32, device=slice_.device)
    n = slice_.numel()
    full[rank * n:(rank + 1) * n].copy_(slice_)
    C.wait(C.all_gather_bucket(full, rank, group, async_op=False, tag=tag))
    out = []
    for ps in specs:
        flat = full[ps.offset:ps.offset + ps.numel]
        if not ps.shape:
            out.append(flat.view(()).clone())
            continue
        cr = chunk_range(ps.shape, rank, world)
        out.append(flat[cr.start:cr.start + cr.numel].view(chunk_shape(ps.shape, rank, world)).clone())
    return Chunks(out)


class Slice(NamedTuple):
    """This rank's fp32 slice of one bucket rebuilt from every rank's chunks (padding zero)."""
    output: Tensor


def scatter_chunks(chunks: Sequence[Tensor], specs: Sequence[ParamSpec], slice_bounds: tuple[int, int],
                   rank: int, world: int, group, tag=None) -> Slice:
    """Collective, the inverse of :func:`gather_chunks`: ``chunks`` are this rank's chunks of the
    bucket's parameters (shapes as :func:`chunk_shape`; 0-dim: the value, rank 0's is used)."""
    sizes = [sum(chunk_range(ps.shape, r, world).numel for ps in specs) for r in range(world)]
    pack = max(max(sizes), 1)
    device = chunks[0].device if chunks else torch.device("cpu")
    buf = torch.zeros(world * pack, dtype=torch.float32, device=device)
    pos = rank * pack
    for ps, t in zip(specs, chunks):
        n = chunk_range(ps.shape, rank, world).numel
        buf[pos:pos + n].copy_(t.reshape(-1)[:n])
        pos += n
    C.wait(C.all_gather_bucket(buf, rank, group, async_op=False, tag=tag))
    s, e = slice_bounds
    out = torch.zeros(e - s, dtype=torch.float32, device=device)
    for r in range(world):
        pos = r * pack
        for ps in specs:
            cr = chunk_range(ps.shape, r, world)
            lo, hi = ps.offset + cr.start, ps.offset + cr.start + cr.numel   # bucket coordinates
            a, b = max(lo, s), min(hi, e)
            if a < b:
                out[a - s:b - s].copy_(buf[pos + a - lo:pos + b - lo])
            pos += cr.numel
    return Slice(out)
