"""Stages 1-2: the parameter all-gather after each bucket's step, optionally overlapped with the
next forward.

[Note: overlapped parameter all-gather]
With overlap_param_gather=True (stages 1-2; Megatron's distributed optimizer has the same
option) step() does not wait for the parameter all-gathers: it launches them in forward order
(the last bucket holds the first layers) and returns. A forward pre-hook on every module that
registers a parameter waits for that parameter's bucket just before the module runs, so the
all-gather overlaps zero_grad(), data loading and the forward of earlier layers. Anything
else that reads the parameters must call wait_for_params() first (step(), state dicts and
checkpoints do): a parameter read outside the forward of a module registering it (e.g.
``F.linear(x, self.emb.weight)`` in a parent's forward, or an EMA copy right after step())
would otherwise see its value from before the step. Default off for that reason. Writes are
worse: a parameter written after step() while its gather is in flight (``torch.nn.init``,
pruning) is overwritten when the gather lands. ``model.state_dict()`` and
``model.load_state_dict()`` wait first (pre-hooks on the same modules); any other write is
found by its version counter when its bucket's gather is waited for (the bucket recorded the
counters at the step), which then raises once, naming the parameter and the fix.

With quantize_weights=True (ZeRO++ qwZ) every all-gather here (the step's, overlapped or not, and
``gather_all`` after a load) is :func:`~.qwz.quantized_all_gather`: this rank's slice stays exact,
the other ranks' slices hold the decode of their owners' int8 codes until the next gather
([Note: quantized weight all-gather] in qwz.py). :meth:`ParamGatherer.gather_exact` is the one exact
all-gather (``ZeroAdamW.sync_exact_params()``).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from . import collectives as C
from .buckets import FlatBucket
from .qwz import quantized_all_gather
from .timeouts import scoped

__all__ = ["ParamGatherer"]


class ParamGatherer:
    def __init__(self, model: nn.Module, buckets: list[FlatBucket], group, rank: int, overlap_comm: bool,
                 overlap_param_gather: bool, timeout=None, quantize_weights: bool = False):
        self.buckets = buckets
        self.by_index = {b.index: b for b in buckets}
        # ZeroAdamW(quantize_weights=...): int8 codes on the wire ([Note: quantized weight all-gather])
        self.all_gather = quantized_all_gather if quantize_weights else C.all_gather_bucket
        self.group = group
        self.rank = rank
        self.overlap_comm = overlap_comm
        self.overlap_param_gather = overlap_param_gather
        self.pending: dict[int, Any] = {}       # bucket index -> AllGatherResult in flight
        self._stepped: list[FlatBucket] = []
        self._in_step: list[Any] = []
        self.handles = []
        if overlap_param_gather:
            index = {id(p): b.index for b in buckets for p in b.params}
            owned: dict[nn.Module, set[int]] = {}
            for mod in model.modules():
                for p in mod.parameters(recurse=False):
                    if id(p) in index:
                        owned.setdefault(mod, set()).add(index[id(p)])
            wait_all = scoped(timeout, group, lambda *args: self.wait_for_params())
            for mod, bis in owned.items():
                self.handles.append(mod.register_forward_pre_hook(scoped(timeout, group, self._hook(sorted(bis))),
                                                                  prepend=True))   # before the user's pre-hooks
                self.handles.append(mod.register_state_dict_pre_hook(wait_all))
                self.handles.append(mod.register_load_state_dict_pre_hook(wait_all))

    def _hook(self, bucket_indices: list[int]):
        def hook(module, args):
            for bi in bucket_indices:
                self._wait(bi)
        return hook

    def _wait(self, bi: int) -> None:
        """Wait for bucket ``bi``'s in-flight gather; raise when a parameter was written meanwhile."""
        g = self.pending.pop(bi, None)
        if g is None:
            return
        C.wait(g)
        b = self.by_index[bi]
        name = b.written_param()
        if name is not None:
            b.record_versions()             # said once: the parameters hold the step's values now
            raise RuntimeError(
                f"parameter {name!r} was written after step() while its all-gather (overlap_param_gather=True) "
                "was in flight, and the gather has overwritten the write ([Note: overlapped parameter "
                "all-gather] in zero/gather.py). Call zopt.wait_for_params() after step() before writing "
                "parameters (torch.nn.init, pruning, p.copy_(...)); model.load_state_dict waits by itself.")

    def after_bucket_step(self, b: FlatBucket) -> None:
        """b's slice was updated: launch its all-gather now (or, overlapped, at end_step)."""
        if self.overlap_param_gather:
            self._stepped.append(b)
        else:
            self._in_step.append(self.all_gather(b.param_flat, self.rank, self.group,
                                                 async_op=self.overlap_comm, tag=b.index))

    def end_step(self) -> None:
        """Wait for the step's all-gathers, or leave them in flight in forward order."""
        for b in reversed(self._stepped):
            self.pending[b.index] = self.all_gather(b.param_flat, self.rank, self.group, async_op=True,
                                                    tag=b.index)
        for g in self._in_step:
            C.wait(g)
        self._stepped, self._in_step = [], []

    def gather_all(self) -> None:
        """Refresh every bucket's parameters from the owners' slices (after a load), over the
        configured wire (int8 codes with quantize_weights)."""
        for b in self.buckets:
            C.wait(self.all_gather(b.param_flat, self.rank, self.group, async_op=False))

    def gather_exact(self) -> None:
        """Every bucket's parameters exactly as their owners hold them (16-bit or fp32 values, no
        codes), whatever the wire: in-flight gathers are waited for first, so none lands after."""
        self.wait_for_params()
        for b in self.buckets:
            C.wait(C.all_gather_bucket(b.param_flat, self.rank, self.group, async_op=False, tag=("exact", b.index)))

    def wait_for_params(self) -> None:
        while self.pending:
            self._wait(next(iter(self.pending)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
