"""Runtime storage of one bucket on one rank (see [Note: bucket] / [Note: slice] in layout.py).

A :class:`FlatBucket` owns the flat working-parameter buffer the module's parameters are views of,
this rank's fp32 slices of master / exp_avg / exp_avg_sq (and max_exp_avg_sq for amsgrad), the
reduced gradient slice, and the transient full-size gradient buffers of a reduction in flight.
It knows nothing about stages or hooks, so stage-3 units can hold one per unit and swap
``param_flat`` in and out.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .layout import BucketSpec, Layout, Piece, dtype_from_name

__all__ = ["FlatBucket"]


class FlatBucket:
    def __init__(self, layout: Layout, index: int, rank: int, params: Sequence[torch.nn.Parameter],
                 device: torch.device, amsgrad: bool):
        spec: BucketSpec = layout.buckets[index]
        self.spec = spec
        self.index = index
        self.rank = rank
        self.params = list(params)                         # Parameter objects, spec order
        self.param_specs = [layout.params[i] for i in spec.params]
        self.offsets = [p.offset for p in self.param_specs]
        self.pieces: list[Piece] = layout.pieces(index, rank)
        self.dtype = dtype_from_name(spec.dtype)
        self.device = device
        self.amsgrad = amsgrad
        s, e = spec.slice_bounds(rank)
        self.slice_start, self.slice_end = s, e
        # Filled by bind(): the working parameters and the fp32 optimizer slices.
        self.param_flat: Tensor | None = None
        self.master: Tensor | None = None
        self.exp_avg: Tensor | None = None
        self.exp_avg_sq: Tensor | None = None
        self.max_exp_avg_sq: Tensor | None = None
        # Gradients.
        self.grad_slice: Tensor | None = None               # reduced (averaged) slice, reduce dtype
        self.spare_slice: Tensor | None = None              # stage 2/3: grad_slice storage kept by zero_grad()
        self.grad_flat: Tensor | None = None                # stage-1 views path (working dtype)
        self.acc: Tensor | None = None                      # stage-2 full-size accumulation buffer
        self.acc_fresh = False                              # acc's round not sealed (hooks.py, 2)
        self.acc_written: set[int] = set()                  # params a fresh acc holds a gradient of
        self.acc_unlaunched = False                         # acc holds gradients not yet reduced
        self.late_acc: Tensor | None = None                 # stage 2: grads after the launch
        self.arrived = 0                                    # grads arrived in the current backward
        self.launched = False                               # reduce-scatter issued this backward
        self.pending = None                                 # ReduceScatterResult in flight
        self.pending_add: Tensor | None = None              # slice to add into grad_slice on wait

    # ---- construction -------------------------------------------------------------------------
    def bind(self, originals: Sequence[Tensor]) -> None:
        """Allocate the flat buffer from the parameters' original values, make the parameters views
        of it, and build this rank's fp32 master slice from the originals (full precision)."""
        from .flat import flatten
        spec = self.spec
        flat = torch.zeros(spec.padded_numel, dtype=self.dtype, device=self.device)
        flatten(list(originals), flat, self.offsets)
        fp32_params = self.dtype == torch.float32
        if fp32_params:
            master = flat[self.slice_start:self.slice_end]  # the fp32 parameter slice IS the master
        else:
            master = torch.zeros(spec.shard_numel, dtype=torch.float32, device=self.device)
            for pc in self.pieces:
                src = originals[spec.params.index(pc.param)].reshape(-1)
                master[pc.start:pc.start + pc.numel].copy_(src[pc.param_start:pc.param_start + pc.numel])
        for p, ps in zip(self.params, self.param_specs):
            p.data = flat[ps.offset:ps.offset + ps.numel].view(ps.shape)
        self.param_flat = flat
        self.master = master
        self.exp_avg = torch.zeros(spec.shard_numel, dtype=torch.float32, device=self.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        if self.amsgrad:
            self.max_exp_avg_sq = torch.zeros_like(self.exp_avg)

    # ---- views ------------------------------------------------------------------------------
    @property
    def owned_params(self) -> Tensor:
        """This rank's slice of the working-parameter buffer (written by the fused step)."""
        return self.param_flat[self.slice_start:self.slice_end]

    @property
    def master_is_param(self) -> bool:
        return self.dtype == torch.float32

    def grad_views(self) -> list[Tensor]:
        g = self.grad_flat
        return [g[ps.offset:ps.offset + ps.numel].view(ps.shape) for ps in self.param_specs]

    def zero_missing(self, buf: Tensor, present: Sequence[bool]) -> None:
        """Zero the regions of parameters that contributed nothing, and the padding."""
        for ok, ps in zip(present, self.param_specs):
            if not ok:
                buf[ps.offset:ps.offset + ps.numel].zero_()
        buf[self.spec.numel:].zero_()

    def state_tensors(self) -> dict[str, Tensor]:
        d = {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.amsgrad:
            d["max_exp_avg_sq"] = self.max_exp_avg_sq
        return d
