"""Launch plans: what one parameter group's step launches, built once and reused while nothing moves.

[Note: launch plans]
A step of ``FusedAdam`` is one kernel call per (device, grad dtype, 16-bit dtype, math path) of each
parameter group. Deciding those calls touches every parameter and its state (dtypes, contiguity,
DTensor shards, state initialisation): ~10 us per parameter in Python. A *plan* records the result:
per launch, the positions of its parameters and the lists of state tensors the kernel updates. It
is keyed on the group's *signature* (per parameter: ``None`` without a gradient, else the gradient's
shape, dtype, device, layout and contiguity, the parameter's dtype and contiguity and the parameter itself,
by ``id``: a group whose ``params`` were replaced or reordered gets a new plan; the plan holds its parameters,
so no id is reused while it lives) and on the optimizer's
``epoch`` (bumped whenever state or groups are replaced: ``load_state_dict``, ``add_param_group``,
unpickling). A step whose signature matches reuses the plan: its Python work is one pass over the
gradients, not a pass over every state.

Step counters. torch keeps one 0-dim ``state["step"]`` per parameter; incrementing 1,000 of them is
a 1,000-tensor foreach op (2-3 ms of host time on CPU). A launch's counters are instead views
``steps[k]`` of one 1-D buffer (same values, same ``state_dict``; a state dict loaded from torch is
repacked once), so a step is one ``add_`` on the buffer, found-inf included, and the coefficients
are computed from the buffer without stacking. A plan rebuilt because gradients came or went keeps the
buffer its launch's counters already live in (``shared_steps``: an ``index_add_`` and an ``index_select``
on the positions of the subset) rather than repacking them, so the counters never move. The buffer
lives on the parameters' device (as torch's fused AdamW keeps ``step``): with a GradScaler's device
``found_inf`` nothing is read back.

Plans with non-contiguous parameters (updated through contiguous temporaries copied back) are
rebuilt every step: correct, rare, and not worth a cache.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_dtensor(t: Any) -> bool:
    """A DTensor (FSDP2's parameters, grads and states)."""
    return t is not None and hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local(t: Tensor | None) -> Tensor | None:
    """The local shard of a DTensor (FSDP2 parameters, grads and states), else the tensor itself.
    ``to_local()`` shares storage, so the kernel's in-place writes land in the DTensor."""
    return t.to_local() if is_dtensor(t) else t


def signature(params: list[Tensor], grads: list[Tensor | None]) -> list:
    """What a cached plan depends on, per parameter (see [Note: launch plans])."""
    return [None if g is None else (g.shape, g.dtype, g.device, g.layout, g.is_contiguous(), p.dtype,
                                    p.is_contiguous(), id(p))
            for p, g in zip(params, grads)]


@dataclass
class Launch:
    """One kernel call: the group positions it covers and the tensors it updates in place."""
    device: torch.device
    p16_dtype: torch.dtype | None
    ref_only: bool                      # 16-bit states (master_weights=False): the reference runs
    index: list[int] = field(default_factory=list)
    masters: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)
    max_exp_avg_sqs: list[Tensor] = field(default_factory=list)
    params16: list[Tensor] = field(default_factory=list)
    steps: Tensor | None = None         # 1-D; state["step"] of index[k] is a view of steps[k] ...
    step_index: Tensor | None = None    # ... or of steps[step_index[k]] (a subset of an earlier plan's buffer)


@dataclass
class GroupPlan:
    signature: list
    epoch: int
    amsgrad: bool
    dtensor: bool                       # gradients are DTensors: take their local shards
    contiguous_grads: bool
    launches: list[Launch]
    writebacks: list[tuple[Tensor, Tensor]]   # (destination, contiguous temporary): never cached
    states: list[dict] = field(default_factory=list)   # the state dicts the launches read
    params: list = field(default_factory=list)         # the group's parameters: their ids stay theirs
    state_values: list = field(default_factory=list)   # their values when the plan was built

    @property
    def cacheable(self) -> bool:
        return not self.writebacks

    def snapshot(self) -> None:
        self.state_values = state_values(self.states)

    def matches(self, sig: list, epoch: int, amsgrad: bool) -> bool:
        """Same signature and epoch, and no state tensor replaced since (``opt.state[p]["exp_avg"] =
        ...``): identity checks only, no tensor comparison."""
        if self.epoch != epoch or self.amsgrad != amsgrad or self.signature != sig:
            return False
        return states_unchanged(self.states, self.state_values)

    def grads_for(self, launch: Launch, grads: list[Tensor | None]) -> list[Tensor]:
        gs = [grads[i] for i in launch.index]
        if self.dtensor:
            gs = [local(g) for g in gs]
        if not self.contiguous_grads:
            gs = [g if g.is_contiguous() else g.contiguous() for g in gs]
        return gs


def state_values(states: list[dict]) -> list:
    """Every value of every state dict, in order: what a plan snapshots."""
    return [v for st in states for v in st.values()]


def states_unchanged(states: list[dict], snapshot: list) -> bool:
    """No state value added, removed or replaced since ``snapshot`` (identity checks only)."""
    now = state_values(states)
    return len(now) == len(snapshot) and all(map(operator.is_, now, snapshot))


def _step_views(steps: list[Tensor], device: torch.device) -> tuple[Tensor, list[int]] | None:
    """(buffer, positions) when every step of ``steps`` is a distinct 0-d element of one contiguous 1-D fp32
    buffer on ``device`` (an earlier plan's), else None."""
    base = steps[0]._base if steps else None
    if (base is None or base.dim() != 1 or base.device != device or base.dtype != torch.float32
            or not base.is_contiguous() or not all(s._base is base and s.dim() == 0 for s in steps)):
        return None
    pos = [s.storage_offset() - base.storage_offset() for s in steps]
    return (base, pos) if len(set(pos)) == len(pos) else None


def shared_steps(steps: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor | None] | None:
    """(buffer, positions) of the buffer ``steps`` already live in (positions None: all of it, in order), else
    None. Used instead of a new buffer, the states' ``step`` tensors keep their identity when gradients come
    and go: torch.compile guards on it ([Note: the traced step]) and would otherwise recompile at every such
    switch."""
    views = _step_views(steps, device)
    if views is None:
        return None
    base, pos = views
    if pos == list(range(base.numel())):
        return base, None
    return base, torch.tensor(pos, dtype=torch.int64, device=device)


def packed_steps(steps: list[Tensor], device: torch.device) -> Tensor:
    """A 1-D fp32 buffer on ``device`` whose element k holds ``steps[k]``: the steps' common base
    when they already are its consecutive elements (the previous plan's buffer), else a new one
    (the caller then stores the views ``buf[k]`` as the states' ``"step"``)."""
    shared = shared_steps(steps, device)
    if shared is not None and shared[1] is None:
        return shared[0]
    return torch.stack([s.detach().reshape(()).to(device=device, dtype=torch.float32) for s in steps]) \
        if steps else torch.zeros(0, device=device)


def state_error(where: str, key: str, t: Any, p: Tensor, same_device: bool = True) -> str | None:
    """Why state ``key`` cannot be used with parameter ``p`` (None when it can): not a floating
    tensor, another shape than the parameter's, or (``same_device``) another device."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        return f"{where}: state {key!r} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}"
    lt, lp = local(t), local(p)
    if lt.shape != lp.shape:
        return (f"{where}: state {key!r} has shape {tuple(lt.shape)}, the parameter {tuple(lp.shape)}; "
                "was the state saved for another model?")
    if same_device and lt.device != lp.device:
        return f"{where}: state {key!r} is on {lt.device}, the parameter on {lp.device}"
    return None


def is_low_precision(dtype: torch.dtype) -> bool:
    return dtype in _LOW_PRECISION
