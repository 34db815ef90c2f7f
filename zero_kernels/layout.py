"""The bucket layout: which parameter lives where in which flat buffer, and which rank owns what.

Pure data and pure functions: no tensors, no process group. A :class:`Layout` round-trips through
``to_dict()`` / ``Layout.from_dict()`` (plain ints, strings and lists), so a checkpoint can record
it and a loader at another world size can map byte ranges of the old layout onto the new one.

[Note: bucket]
A bucket is one flat 1-D buffer holding several parameters back to back (``offset`` .. ``offset +
numel`` each, in elements of the bucket's dtype). Every parameter of a bucket has the same working
dtype and the same param group, so one fused-Adam call with one set of hyperparameters covers a
bucket's slice. Buckets are filled in *reverse registration order* (the order autograd usually
produces gradients in), closing a bucket once it holds at least ``bucket_size`` bytes, so a
parameter larger than ``bucket_size`` gets a bucket of its own. Stage 3 builds one bucket per
sharding unit through the same function (``unit_of``).

[Note: padding]
A bucket's buffer is ``padded_numel`` elements: ``numel`` rounded up to a multiple of
``world_size * align_elems``, where ``align_elems = alignment_bytes / itemsize`` (alignment >= 16
bytes, so every slice starts on a 128-bit boundary). Padding is zero in every buffer, is never part
of a parameter view, and never enters norms, step counts or checkpoints.

[Note: slice]
Rank ``r`` owns the contiguous slice ``[r * shard_numel, (r + 1) * shard_numel)`` of every bucket,
``shard_numel = padded_numel / world_size``. Parameters may straddle slice boundaries: a parameter
is then updated piecewise by several ranks. :meth:`Layout.pieces` lists the parameter pieces inside
one rank's slice (the unit of per-parameter bookkeeping such as step counts).

[Note: shard]
A rank's shard is the union of its slices over all buckets: its fp32 master, exp_avg, exp_avg_sq
(and in stage 2 the reduced fp32 gradient) are stored per bucket as ``shard_numel``-element tensors.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Callable, NamedTuple, Sequence

import torch

__all__ = ["ParamInfo", "ParamSpec", "BucketSpec", "Piece", "Layout", "build_layout", "dtype_name",
           "dtype_from_name", "LAYOUT_VERSION"]

LAYOUT_VERSION = 1

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def itemsize(dtype_or_name: torch.dtype | str) -> int:
    d = dtype_from_name(dtype_or_name) if isinstance(dtype_or_name, str) else dtype_or_name
    return torch.empty((), dtype=d).element_size()


class ParamInfo(NamedTuple):
    """What the layout needs to know about one trainable parameter (input to build_layout)."""
    name: str                 # the first name under which the module registers it
    shape: tuple[int, ...]
    dtype: str                # working (16-bit or fp32) dtype in the bucket, e.g. "bfloat16"
    group: int                # index of its param group
    aliases: tuple[str, ...] = ()   # other names of the same tensor (tied weights)


@dataclass(frozen=True)
class ParamSpec:
    index: int                # position in Layout.params (the bucket-filling order)
    name: str
    shape: tuple[int, ...]
    dtype: str
    group: int
    bucket: int
    offset: int               # first element inside the bucket
    numel: int
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class BucketSpec:
    index: int
    dtype: str
    group: int
    params: tuple[int, ...]   # ParamSpec indices, in offset order
    numel: int                # sum of the parameters' numel (no padding)
    padded_numel: int
    shard_numel: int          # padded_numel // world_size
    unit: int = 0             # stage-3 sharding unit (0 for stages 1-2)

    def slice_bounds(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's slice inside the bucket, padding included."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def data_bounds(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's slice clipped to real data (no padding); may be empty."""
        s, e = self.slice_bounds(rank)
        return min(s, self.numel), min(e, self.numel)


class Piece(NamedTuple):
    """The part of parameter ``param`` that falls in one rank's slice of its bucket."""
    param: int                # ParamSpec index
    bucket: int
    start: int                # offset inside the rank's slice (0 .. shard_numel)
    numel: int
    param_start: int          # offset inside the flattened parameter


@dataclass(frozen=True)
class Layout:
    world_size: int
    alignment_bytes: int
    bucket_size: int
    params: tuple[ParamSpec, ...]
    buckets: tuple[BucketSpec, ...]
    version: int = LAYOUT_VERSION

    # ---- queries --------------------------------------------------------------------------
    @property
    def numel(self) -> int:
        """Psi: trainable elements, each tied tensor once, no padding."""
        return sum(p.numel for p in self.params)

    def param_by_name(self, name: str) -> ParamSpec:
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    def pieces(self, bucket: int, rank: int) -> list[Piece]:
        """Parameter pieces inside rank's slice of ``bucket``, in offset order."""
        b = self.buckets[bucket]
        s, e = b.slice_bounds(rank)
        out = []
        for pi in b.params:
            p = self.params[pi]
            lo, hi = max(s, p.offset), min(e, p.offset + p.numel)
            if lo < hi:
                out.append(Piece(pi, bucket, lo - s, hi - lo, lo - p.offset))
        return out

    # ---- plain data ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        for p in d["params"]:
            p["shape"] = list(p["shape"])
            p["aliases"] = list(p["aliases"])
        for b in d["buckets"]:
            b["params"] = list(b["params"])
        d["params"] = list(d["params"])
        d["buckets"] = list(d["buckets"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        params = tuple(ParamSpec(**{**p, "shape": tuple(p["shape"]), "aliases": tuple(p.get("aliases", ()))})
                       for p in d["params"])
        buckets = tuple(BucketSpec(**{**b, "params": tuple(b["params"])}) for b in d["buckets"])
        return cls(world_size=d["world_size"], alignment_bytes=d["alignment_bytes"],
                   bucket_size=d["bucket_size"], params=params, buckets=buckets,
                   version=d.get("version", LAYOUT_VERSION))

    def fingerprint(self) -> str:
        """A short hash of everything that decides where each element lives."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def build_layout(params: Sequence[ParamInfo], world_size: int, bucket_size: int,
                 alignment_bytes: int = 16, unit_of: Callable[[int], int] | None = None) -> Layout:
    """Lay out ``params`` (given in registration order, already deduplicated and trainable only).

    Buckets never mix (group, dtype, unit); within a key they are filled in reverse registration
    order and closed once they reach ``bucket_size`` bytes. Bucket indices follow the fill order
    (bucket 0 holds the last-registered parameters: its gradients are usually ready first).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size}")
    if alignment_bytes < 16 or alignment_bytes & (alignment_bytes - 1):
        raise ValueError(f"alignment_bytes must be a power of two >= 16, got {alignment_bytes}")
    order = list(range(len(params)))[::-1]
    open_buckets: dict[tuple, list[int]] = {}   # key -> registration indices in the open bucket
    open_bytes: dict[tuple, int] = {}
    closed: list[tuple[tuple, list[int]]] = []
    for i in order:
        p = params[i]
        key = (p.group, p.dtype, unit_of(i) if unit_of is not None else 0)
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + _numel(p.shape) * itemsize(p.dtype)
        if open_bytes[key] >= bucket_size:
            closed.append((key, open_buckets.pop(key)))
            open_bytes.pop(key)
    # Leftover open buckets close in the order of their first (i.e. latest-registered) member.
    leftovers = sorted(open_buckets.items(), key=lambda kv: -kv[1][0])
    closed.extend(leftovers)
    # Sort buckets by the registration index of their first member, descending: the fill order.
    closed.sort(key=lambda kv: -kv[1][0])

    specs: list[ParamSpec] = []
    buckets: list[BucketSpec] = []
    for bi, ((group, dt, unit), members) in enumerate(closed):
        off = 0
        idx = []
        for i in members:
            p = params[i]
            n = _numel(p.shape)
            specs.append(ParamSpec(index=len(specs), name=p.name, shape=tuple(p.shape), dtype=dt,
                                   group=group, bucket=bi, offset=off, numel=n, aliases=tuple(p.aliases)))
            idx.append(len(specs) - 1)
            off += n
        align = max(1, alignment_bytes // itemsize(dt))
        mult = world_size * align
        padded = -(-off // mult) * mult if off else mult
        buckets.append(BucketSpec(index=bi, dtype=dt, group=group, params=tuple(idx), numel=off,
                                  padded_numel=padded, shard_numel=padded // world_size, unit=unit))
    return Layout(world_size=world_size, alignment_bytes=alignment_bytes, bucket_size=bucket_size,
                  params=tuple(specs), buckets=tuple(buckets))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
