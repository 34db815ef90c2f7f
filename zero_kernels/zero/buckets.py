"""Runtime storage of one bucket on one rank (see [Note: bucket] / [Note: slice] in layout.py).

[Note: bucket objects]
A :class:`FlatBucket` is three separate objects over one :class:`BucketSpec`:
  * the bucket itself: the parameter *storage* (``param_flat``, the flat working-parameter buffer
    the module's parameters are views of, and the fp32 ``master`` slice, which for fp32
    parameters *is* the parameter slice);
  * ``b.optim`` (:class:`OptimState`): this rank's fp32 ``exp_avg`` / ``exp_avg_sq`` (and
    ``max_exp_avg_sq`` for amsgrad) slices;
  * ``b.reduce`` (:class:`ReduceState`): the bookkeeping of gradient reduction (the reduced slice,
    the full-size buffers of a reduction in flight) owned by the reducers (reduce.py, hooks.py).
Stage 3's unit buckets (unit_bucket.py) keep only the shard of ``param_flat`` persistently and use
the same binding functions (:func:`fill_flat`, :func:`master_from_originals`).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .coded import decode_slice, encode_slice, join_master, new_moments, remainder_of
from .._param_edits import adopt_master
from .flat import flatten
from ..hparams import StateFormat
from ..layout import BucketSpec, Layout, Piece, dtype_from_name

__all__ = ["check_amsgrad", "check_bound", "FlatBucket", "OptimState", "ReduceState", "fill_flat",
           "master_from_originals"]


class OptimState:
    """This rank's Adam moments for one bucket slice (``shard_numel`` elements each): fp32, or coded in
    ``fmt`` ([Note: coded ZeRO states] in coded.py; ``tensors`` then holds the codes and block scales)."""

    def __init__(self, numel: int, device: torch.device, amsgrad: bool, fmt: StateFormat | None = None):
        self.coded = fmt is not None and fmt.coded
        if self.coded:
            self.tensors = new_moments(numel, device, fmt)
            self.exp_avg, self.exp_avg_sq = self.tensors["exp_avg"], self.tensors["exp_avg_sq"]
            self.max_exp_avg_sq = None
            return
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.max_exp_avg_sq = torch.zeros_like(self.exp_avg) if amsgrad else None
        self.tensors = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if amsgrad:
            self.tensors["max_exp_avg_sq"] = self.max_exp_avg_sq

    def nbytes(self, prefix: str = "") -> int:
        """Bytes of the tensors whose key starts with ``prefix`` (block scales count with their moment)."""
        return sum(t.numel() * t.element_size() for k, t in self.tensors.items() if k.startswith(prefix))


class ReduceState:
    """Gradient-reduction bookkeeping of one bucket (written by the stage-1/2/3 reducers only)."""

    def __init__(self):
        self.grad_slice: Tensor | None = None       # reduced (averaged) slice, reduce dtype
        self.spare_slice: Tensor | None = None      # stage 2/3: grad_slice storage kept by zero_grad()
        self.grad_flat: Tensor | None = None        # stage-1 views path (working dtype)
        self.acc: Tensor | None = None              # full-size buffer of a reduction (stage 1: send buffer)
        self.acc_fresh = False                      # acc's round not sealed (hooks.py, 2)
        self.acc_written: set[int] = set()          # params a fresh acc holds a gradient of
        self.acc_unlaunched = False                 # acc holds gradients not yet reduced
        self.late_acc: Tensor | None = None         # stage 2: grads after the launch
        self.arrived = 0                            # grads arrived in the current backward
        self.launched = False                       # reduce-scatter issued this backward
        self.pending = None                         # ReduceScatterResult in flight
        self.pending_add: Tensor | None = None      # slice to add into grad_slice on wait


def fill_flat(flat: Tensor, originals: Sequence[Tensor], offsets: Sequence[int]) -> Tensor:
    """Copy the parameters' original values into a zeroed flat buffer (cast to its dtype)."""
    flatten(list(originals), flat, offsets)
    return flat


def master_from_originals(spec: BucketSpec, pieces: Sequence[Piece], originals: Sequence[Tensor],
                          device: torch.device) -> Tensor:
    """This rank's fp32 master slice built from the original (full precision) parameter values."""
    master = torch.zeros(spec.shard_numel, dtype=torch.float32, device=device)
    for pc in pieces:
        src = originals[spec.params.index(pc.param)].reshape(-1)
        master[pc.start:pc.start + pc.numel].copy_(src[pc.param_start:pc.param_start + pc.numel])
    return master


class FlatBucket:
    def __init__(self, layout: Layout, index: int, rank: int, params: Sequence[torch.nn.Parameter],
                 device: torch.device, amsgrad: bool, fmt: StateFormat | None = None):
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
        self.fmt = fmt if fmt is not None else StateFormat()
        self.remainder: Tensor | None = None                # int16 master remainder ([Note: coded ZeRO states])
        self.slice_start, self.slice_end = spec.slice_bounds(rank)
        self.param_flat: Tensor | None = None               # filled by bind()
        self.master: Tensor | None = None
        self.optim: OptimState | None = None
        self.reduce = ReduceState()

    # ---- construction -------------------------------------------------------------------------
    def bind(self, originals: Sequence[Tensor]) -> None:
        """Allocate the flat buffer from the parameters' original values, make the parameters views
        of it, and build this rank's fp32 master slice from the originals (full precision)."""
        flat = fill_flat(torch.zeros(self.spec.padded_numel, dtype=self.dtype, device=self.device),
                         originals, self.offsets)
        if self.master_is_param:
            self.master = flat[self.slice_start:self.slice_end]   # the fp32 slice IS the master
        else:
            self.set_master(master_from_originals(self.spec, self.pieces, originals, self.device))
        self.param_flat = flat
        self.point_params_at(flat)
        self.optim = OptimState(self.spec.shard_numel, self.device, self.amsgrad, self.fmt)
        self.record_versions()

    def set_master(self, master: Tensor) -> None:
        """Keep the fp32 master slice: as it is, or as the int16 remainder of the bf16 slice the
        parameters hold (store_param_remainders; their bits are master's round-to-nearest-even)."""
        if self.fmt.store_param_remainders:
            self.master, self.remainder = None, remainder_of(master)
        else:
            self.master = master

    # ---- parameters written outside the optimizer ([Note: parameters edited outside the optimizer]) ----
    def record_versions(self) -> None:
        """The parameters' version counters now (the step's own writes go through the flat buffer: they
        leave them as they are)."""
        self.versions = [p._version for p in self.params]

    def adopt_edits(self, force: bool = False) -> None:
        """When a parameter was written through torch since ``record_versions`` (``model.load_state_dict``,
        pruning, ``torch.nn.init``), or whatever the counters say with ``force`` (writes through ``p.data``:
        ``ZeroAdamW.refresh_fp32_params``), bring this rank's master slice to its slice of the working
        parameters, keeping every master that still rounds to its parameter."""
        if self.master_is_param or (not force and self.written_param() is None):
            return
        adopt_master(self.owned_params, self.master, self.remainder)
        self.record_versions()

    def written_param(self) -> str | None:
        """The name of the first parameter written through torch since ``record_versions``, else None."""
        if [p._version for p in self.params] == self.versions:
            return None
        return next(ps.name for p, ps, v in zip(self.params, self.param_specs, self.versions) if p._version != v)

    def placeholder_error(self) -> RuntimeError | None:
        """Stage 3 only (unit_bucket.py): the error naming a parameter written while freed."""
        return None

    def master_fp32(self) -> Tensor:
        """The fp32 master slice (joined from the bf16 slice and its remainder when remainders are kept)."""
        return join_master(self.owned_params, self.remainder, self.master)

    def point_params_at(self, flat: Tensor) -> None:
        """Make every parameter a view of its region of ``flat``."""
        for p, ps in zip(self.params, self.param_specs):
            p.data = flat[ps.offset:ps.offset + ps.numel].view(ps.shape)

    # ---- bound parameters ---------------------------------------------------------------------
    def moved_param(self) -> tuple[str, Tensor] | None:
        """(name, parameter) of the first parameter that is no longer this bucket's view, else None.

        [Note: bound parameters] Trainable parameters are views of the bucket's flat buffer (stage 3:
        of it while gathered, an empty placeholder otherwise). ``model.to(dtype)``, ``.half()``,
        ``.to(device)`` or ``p.data = ...`` after construction replace that storage: the model would
        read tensors the step never writes (the loss goes flat), or stage 3 would silently undo the
        cast at the next gather. step() checks this first and raises, before anything changes."""
        for p, ps in zip(self.params, self.param_specs):
            if self.recast(p) or (p.numel() and not self._is_view(p, ps)):
                return ps.name, p
        return None

    def recast(self, p: Tensor) -> bool:
        """``p`` (one of this bucket's parameters) was cast or moved to another device since construction."""
        return p.dtype != self.dtype or p.device != self.device

    def reshaped(self, p: Tensor, li: int) -> bool:
        """``p`` (this bucket's parameter li) holds elements but not the shape it was sharded with: its ``.data``
        was replaced by a tensor of another shape (``model.resize_token_embeddings()``)."""
        return bool(p.numel()) and tuple(p.shape) != tuple(self.param_specs[li].shape)

    def moved_error(self, name: str, p: Tensor) -> RuntimeError:
        """The error for a parameter that is no longer stored in this bucket ([Note: bound parameters])."""
        li = next((i for i, ps in enumerate(self.param_specs) if ps.name == name), None)
        if li is not None and self.reshaped(p, li):
            return RuntimeError(
                f"parameter {name!r} has shape {tuple(p.shape)}, but ZeroAdamW sharded it with shape "
                f"{tuple(self.param_specs[li].shape)}: its .data was replaced by a tensor of another shape after "
                "ZeroAdamW(...) was constructed (model.resize_token_embeddings(), a pruning or growing step), so "
                "ZeroAdamW's buffers no longer match the model. ZeroAdamW's buffers and states were not changed. "
                "Resize or replace parameters "
                "BEFORE constructing ZeroAdamW (DeepSpeed and FSDP ask the same), or build a new ZeroAdamW over "
                "the resized model (load_checkpoint cannot adopt the new shape either).")
        return RuntimeError(
            f"parameter {name!r} is no longer stored in ZeroAdamW's buffers (it is {p.dtype} on {p.device}; "
            f"ZeroAdamW keeps it as {self.dtype} on {self.device}): the model was cast or moved (model.to(...), "
            ".half(), .bfloat16(), .cuda()) or a parameter's .data was replaced after ZeroAdamW(...) was "
            "constructed, so step() would update buffers the model no longer reads. Cast or move the model "
            "before constructing ZeroAdamW (for 16-bit parameters pass param_dtype=torch.bfloat16).")

    def _is_view(self, p: Tensor, ps) -> bool:
        flat = self.param_flat
        return p.data_ptr() == flat.data_ptr() + ps.offset * flat.element_size()

    # ---- views ------------------------------------------------------------------------------
    @property
    def owned_params(self) -> Tensor:
        """This rank's slice of the working-parameter buffer (written by the fused step)."""
        return self.param_flat[self.slice_start:self.slice_end]

    @property
    def master_is_param(self) -> bool:
        return self.dtype == torch.float32

    def grad_views(self) -> list[Tensor]:
        g = self.reduce.grad_flat
        return [g[ps.offset:ps.offset + ps.numel].view(ps.shape) for ps in self.param_specs]

    def zero_missing(self, buf: Tensor, present: Sequence[bool]) -> None:
        """Zero the regions of parameters that contributed nothing, and the padding."""
        for ok, ps in zip(present, self.param_specs):
            if not ok:
                buf[ps.offset:ps.offset + ps.numel].zero_()
        buf[self.spec.numel:].zero_()

    def state_tensors(self) -> dict[str, Tensor]:
        """The persistent per-slice state as stored (what a shard state dict and a checkpoint shard hold):
        ``master`` (or ``master_remainder``) and the moments (codes and block scales when coded)."""
        d = {"master": self.master} if self.remainder is None else {"master_remainder": self.remainder}
        d.update(self.optim.tensors)
        return d

    def fp32_states(self) -> dict[str, Tensor]:
        """``master``, ``exp_avg``, ``exp_avg_sq`` (``max_exp_avg_sq``) in fp32: the live tensors for fp32
        states, decoded copies for coded ones (write them back with :meth:`store_fp32_states`)."""
        if not self.optim.coded and self.remainder is None:
            return self.state_tensors()
        out = {"master": self.master_fp32().clone()}
        out.update(decode_slice(self.optim.tensors) if self.optim.coded else
                   {k: t for k, t in self.optim.tensors.items()})
        return out

    def store_fp32_states(self, d: dict[str, Tensor], step: int) -> None:
        """Write the fp32 states of ``d`` (keys as :meth:`fp32_states` gives them; a missing key is left as it
        is) into the stored format; ``master`` also sets a 16-bit working slice to its round-to-nearest-even
        (``step``: the stochastic-rounding key of bf16 moments)."""
        if self.optim.coded and any(k in d for k in self.optim.tensors):
            full = {k: d[k] if k in d else v for k, v in decode_slice(self.optim.tensors).items()}
            encode_slice(self.optim.tensors, full, self.index, step, self.slice_start)
        elif not self.optim.coded:
            for k, t in self.optim.tensors.items():
                if k in d and t is not d[k]:
                    t.copy_(d[k])
        if "master" not in d:
            return
        if self.master_is_param:
            if self.master is not d["master"]:
                self.master.copy_(d["master"])
            return
        self.owned_params.copy_(d["master"])
        if self.remainder is not None:
            self.remainder.copy_(remainder_of(d["master"]))
        elif self.master is not d["master"]:
            self.master.copy_(d["master"])

def check_bound(buckets: Sequence[FlatBucket]) -> None:
    """Raise when a parameter stopped being a view of its bucket ([Note: bound parameters]), or was written
    while freed at stage 3 ([Note: writes to stage-3 parameters] in unit_bucket.py)."""
    for b in buckets:
        err = b.placeholder_error()
        if err is not None:
            raise err
        moved = b.moved_param()
        if moved is not None:
            raise b.moved_error(*moved)


def check_amsgrad(groups: Sequence[dict], buckets: Sequence[FlatBucket]) -> None:
    """ValueError when a param group asks for amsgrad that the buckets were not built with: ``max_exp_avg_sq``
    is allocated at construction (when some group has amsgrad then; coded states have none), so a
    ``param_groups[i]["amsgrad"] = True`` set later would run plain Adam without a word."""
    if any(b.amsgrad for b in buckets):
        return
    for gi, g in enumerate(groups):
        if g.get("amsgrad", False):
            coded = buckets[0].fmt.coded if buckets else False
            raise ValueError(
                f"param_groups[{gi}]['amsgrad'] is True, but ZeroAdamW was built without amsgrad: "
                + ("coded states (exp_avg_dtype / exp_avg_sq_dtype / store_param_remainders) have no "
                   "max_exp_avg_sq; set it back to False" if coded else
                   "its max_exp_avg_sq buffers are allocated at construction; build ZeroAdamW with amsgrad=True "
                   "(or with it in that group's param_groups=[...] entry)")
                + ". Nothing was changed.")
