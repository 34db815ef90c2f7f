"""ZeRO-3 storage: a unit bucket holds its full parameter buffer only while gathered.

[Note: stage-3 storage]
Per bucket, persistently: ``shard`` (this rank's ``shard_numel`` slice of the working parameters:
the fused step writes it; for fp32 parameters it *is* the master) and the fp32 optimizer slices.
The full flat buffer ``param_flat`` keeps one storage for the life of the optimizer; freeing
resizes that storage to 0 bytes (``untyped_storage().resize_(0)``) AND points every parameter's
``.data`` at an empty tensor (so the module holds no full storage and a stray read fails with a
shape error instead of reading freed memory). Gathering resizes the storage back, copies the shard
into its slice, all-gathers, and points ``.data`` back at views of the buffer. The Parameter
objects never change. Resizing the *same* storage (as FSDP2 does) matters for autograd: tensors
saved in forward that are views of a parameter (``weight.t()`` in ``F.linear``) point into that
storage; they do not keep the memory alive while freed, and are valid again once re-gathered.
On CPU with ``gather_cache=True`` that storage allocates from the gather cache ([Note: the gather
cache] in csrc/block_cache.cpp): the freed block is kept for the next gather instead of being
page-faulted in again (at most ``Stage3.cache_limit`` bytes: the gathered working set).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .. import _ext
from . import collectives as C
from .buckets import FlatBucket, OptimState, check_bound, fill_flat, master_from_originals
from .heap import release_free_heap
from .qwz import quantized_all_gather

__all__ = ["UnitBucket", "gather_cache_stats", "empty_gather_cache", "cache_module", "FREE", "GATHERING",
           "GATHERED", "placeholder_write_error"]

FREE, GATHERING, GATHERED = 0, 1, 2


# [Note: writes to stage-3 parameters]
# Between steps a stage-3 parameter is a 0-element placeholder, so an in-place write through torch
# (``torch.nn.init.*_``, ``model.apply(init_fn)``, pruning ``p.mul_(mask)``) writes nothing, and the next
# gather brings back the shard as it was: the write was lost without a word. Each bucket records its
# parameters' version counters whenever it frees or gathers them (``.data`` swaps leave them alone); a
# counter that moved while freed is such a write, and the next gather or step() raises (once), naming the
# parameter, before anything changes. Writes made while gathered inside ``zopt.gathered()`` are kept:
# leaving the block writes each rank's slice of what it holds back into its shard (and brings its master
# to it by the rule of [Note: parameters edited outside the optimizer]), as FSDP's
# ``summon_full_params(writeback=True)``: every rank writes the same values (each keeps its own slice).
# Writes through ``p.data`` bypass the counter (nothing detects them, as for stages 1-2).


def lost_write_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"parameter {name!r} was written in place while ZeRO-3 held it gathered outside `zopt.gathered()` (a "
        "module of the model called outside its forward leaves the root unit gathered until the next forward), and "
        "the gathered copy was freed since, so the write was lost ([Note: writes to stage-3 parameters]). Write "
        "parameters inside `with zopt.gathered():` (on every rank, the same values; each rank keeps its slice when "
        "the block ends), or load them with zopt.load_checkpoint(...). Nothing was changed.")


def placeholder_write_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"parameter {name!r} was written in place (torch.nn.init, model.apply(init_fn), p.mul_(...), ...) while "
        "ZeRO-3 held it as a freed 0-element placeholder (between steps, outside forward), so the write did "
        "nothing ([Note: writes to stage-3 parameters]). Write parameters inside `with zopt.gathered():` (on "
        "every rank, the same values; each rank keeps its slice when the block ends), or load them with "
        "zopt.load_checkpoint(...). Nothing was changed.")


def cache_module():
    """The C++ extension when it has the gather cache ([Note: the gather cache] in
    csrc/block_cache.cpp), else None (then gathered buffers come from torch's allocator)."""
    mod = _ext.cpu_module()
    return mod if mod is not None and hasattr(mod, "cached_empty") else None


def copied_placeholder(copy: nn.Module, original: nn.Module, buckets) -> str | None:
    """The name of a parameter of ``copy`` (a ``copy.deepcopy`` of ``original``) that is an empty placeholder of a
    parameter ``buckets`` manage (a nonempty one), else None: the copy was taken outside ``zopt.gathered()``."""
    managed = {id(p) for b in buckets for p, ps in zip(b.params, b.param_specs) if ps.numel > 0}
    orig = dict(original.named_parameters())
    for n, p in copy.named_parameters():
        o = orig.get(n)
        if o is not None and o is not p and id(o) in managed and p.numel() == 0:
            return n
    return None


def copied_placeholder_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"parameter {name!r} of this module is an empty placeholder: the module is a copy.deepcopy of a model "
        "sharded by ZeroAdamW(stage=3) taken outside `with zopt.gathered():`, where the parameters are freed "
        "(0 elements). Take the copy inside `with zopt.gathered():` (on every rank) to give it the full weights.")


def _bits(t: Tensor) -> Tensor:
    """``t``'s bit patterns as integers (so NaN equals itself)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _full_buffer(numel: int, dtype: torch.dtype, device: torch.device, cached: bool) -> Tensor:
    """A unit bucket's full parameter buffer. On CPU with ``cached``, its storage allocates from the
    gather cache, so the resize_(0) / resize_(n) of every free / gather reuses a block instead of
    page-faulting a fresh one in (GPUs get the same from the CUDA caching allocator)."""
    if cached and device.type == "cpu":
        mod = cache_module()
        if mod is not None:
            return mod.cached_empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def gather_cache_stats() -> dict[str, int]:
    """Process-wide gather cache counters (all zero when the extension is unavailable)."""
    mod = cache_module()
    if mod is None:
        return {"cached_bytes": 0, "live_bytes": 0, "limit_bytes": 0, "hits": 0, "misses": 0}
    return dict(mod.cache_stats())


def empty_gather_cache() -> None:
    mod = cache_module()
    if mod is not None:
        mod.cache_empty()
        release_free_heap()         # the blocks went back to malloc: give them to the system too


class UnitBucket(FlatBucket):
    """A FlatBucket whose full parameter buffer exists only while gathered ([Note: stage-3 storage])."""

    def __init__(self, *args, use_gather_cache: bool = False, quantize_weights: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_gather_cache = use_gather_cache      # ZeroAdamW(gather_cache=...)
        # ZeroAdamW(quantize_weights=...): int8 codes on the wire ([Note: quantized weight all-gather])
        self.all_gather = quantized_all_gather if quantize_weights else C.all_gather_bucket

    def bind(self, originals: Sequence[Tensor]) -> None:
        """The binding code of FlatBucket (buckets.py); only the shard stays resident."""
        flat = _full_buffer(self.spec.padded_numel, self.dtype, self.device, self.use_gather_cache).zero_()
        fill_flat(flat, originals, self.offsets)
        self.shard = flat[self.slice_start:self.slice_end].clone()
        if self.master_is_param:
            self.master = self.shard                         # the fp32 parameter slice IS the master
        else:
            self.set_master(master_from_originals(self.spec, self.pieces, originals, self.device))
        self.param_flat = flat
        self.optim = OptimState(self.spec.shard_numel, self.device, self.amsgrad, self.fmt)
        self.gather_state = GATHERED
        self.ag = None                                       # AllGatherResult in flight
        self.s3_arrived: set[int] = set()                    # params with a gradient this backward
        self.s3_done = False                                 # freed in this backward: every gradient arrived
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.lost_write: str | None = None                   # written while gathered and lost at a free
        self.record_versions()
        self.free()

    @property
    def owned_params(self) -> Tensor:
        return self.shard

    def adopt_edits(self, force: bool = False) -> None:
        """Nothing to adopt: between steps the model holds empty placeholders ([Note: parameters edited
        outside the optimizer] in zero_kernels/_param_edits.py); writes to them raise (placeholder_error)
        and writes inside ``zopt.gathered()`` are written back as it ends (writeback)."""

    def placeholder_error(self) -> RuntimeError | None:
        """The error naming a parameter written in place while freed ([Note: writes to stage-3 parameters])."""
        if self.lost_write is not None:             # written while gathered, then freed (free)
            name, self.lost_write = self.lost_write, None
            return lost_write_error(name)
        name = self.written_param() if self.gather_state == FREE else None
        if name is None:
            return None
        self.record_versions()      # said once: the write changed nothing, so the run may go on
        return placeholder_write_error(name)

    @torch.no_grad()
    def writeback(self) -> None:
        """End of ``zopt.gathered()``: parameters written while gathered become this rank's shard (and its
        master, by adoption) ([Note: writes to stage-3 parameters]). A write through ``p.data`` moves no version
        counter: the rank's own slice is also compared with its shard, bit for bit (FSDP's writeback copies
        whatever the counters say)."""
        if self.gather_state != GATHERED:
            return
        mine = self.param_flat[self.slice_start:self.slice_end]
        if self.written_param() is None and torch.equal(_bits(mine), _bits(self.shard)):
            return
        self.shard.copy_(mine)
        super().adopt_edits(force=True)         # the master slice brought to the written shard
        self.record_versions()                  # adopted: not a lost write when freed (fp32: no master to adopt)

    def _is_view(self, p: Tensor, ps) -> bool:
        # freed (or still gathering): parameters are the empty placeholder, which has no elements
        return self.gather_state == GATHERED and super()._is_view(p, ps)

    @property
    def full_bytes(self) -> int:
        return self.spec.padded_numel * self.param_flat.element_size()

    def held_bytes(self) -> int:
        return self.param_flat.untyped_storage().nbytes()

    def start_gather(self, rank: int, group, async_op: bool, tag: Any) -> bool:
        if self.gather_state != FREE:
            return False
        check_bound([self])             # cast / moved since construction, or written while freed
        flat = self.param_flat
        flat.untyped_storage().resize_(self.full_bytes)
        flat[self.slice_start:self.slice_end].copy_(self.shard)
        self.ag = self.all_gather(flat, rank, group, async_op=async_op, tag=tag)
        self.gather_state = GATHERING
        return True

    def finish_gather(self) -> None:
        if self.gather_state == GATHERING:
            C.wait(self.ag)
            self.ag = None
            self.point_params_at(self.param_flat)
            self.gather_state = GATHERED
            self.record_versions()

    def free(self) -> None:
        if self.gather_state == FREE:
            return
        if self.gather_state == GATHERED and self.lost_write is None:
            self.lost_write = self.written_param()      # said by the next gather's check (placeholder_error)
        if self.gather_state == GATHERING:
            C.wait(self.ag)
            self.ag = None
        for p in self.params:
            p.data = self._empty
        self.param_flat.untyped_storage().resize_(0)
        self.gather_state = FREE
        self.record_versions()
