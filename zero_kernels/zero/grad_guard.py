"""What ``p.grad`` holds on a ZeRO model: a guard that makes torch's gradient utilities fail loudly.

[Note: gradient placeholders]
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (and everything built on it:
accelerate's ``Accelerator.clip_grad_norm_``, the plain Hugging Face ``Trainer``, hand-written loops)
reads ``p.grad``. On a ZeRO model no ``p.grad`` holds the gradient DDP would hold there (the
average over the ranks, full size):
  * stage 1: ``p.grad`` is this rank's *local* gradient until ``step()`` reduce-scatters it
    ([Note: stage-1 reduction] in reduce.py), so torch's norm is a different, wrong number on every
    rank and each rank clips by its own coefficient;
  * stages 2-3: the gradient hooks take ``p.grad`` away during backward and reduce it into the
    optimizer's slices ([Note: stage-2 gradient flow] in hooks.py): torch sees no gradient at all,
    returns a norm of 0.0 and clips nothing.
Both used to pass silently. Making torch's own function correct would need either DDP's
all-reduce of every gradient at the end of backward (stage 1: a second full gradient exchange
every step, on top of the parameter all-gather ZeRO needs anyway) or, as FSDP2 does, per-parameter
sharded DTensors (our shards are byte ranges of flat buckets that cut across parameters, which
no DTensor placement describes). So the misuse is made impossible to miss instead, and
``zopt.clip_grad_norm_(max_norm)`` stays the one way to clip (global norm over every rank's
slices, one all-reduce, folded into the step's gradient multiplier).

After a parameter's gradient arrives (its post-accumulate-grad hook), ``p.grad`` is a
:class:`ShardedGrad`: a tensor subclass with the parameter's shape, dtype and device, so
``p.grad is None`` checks, ``model.zero_grad()`` and GradScaler's bookkeeping see "has a gradient",
but any torch operation that would read or change its values (``torch.linalg.vector_norm``,
``_foreach_norm``, ``mul_``, ``clamp_``, ``clone``, printing the values, ...) raises
:class:`ShardedGradError`, naming the parameter and the fix, before anything was modified (torch's
clip computes every norm before it scales anything). Allowed, because they are exact:
  * ``add_`` during backward: autograd accumulating the next micro-batch's gradient (stage 1 adds
    into the local gradient; stages 2-3 hand it to the reducer's hook, which takes it at once);
  * ``zero_`` at stage 1 (``model.zero_grad(set_to_none=False)``): zeroing the local gradient;
  * ``_amp_foreach_non_finite_check_and_unscale_`` (``torch.amp.GradScaler``): stage 1 unscales the
    local gradients (linear, so exact); stages 2-3 have nothing to unscale here (the step checks and
    unscales the reduced slices itself, [Note: non-finite gradients] in scaling.py).
Stage 1 keeps the real local gradient inside (``local``): the reducer unwraps it with
:func:`local_grad`, so the zero-copy views path (reduce.py) is unchanged. Stages 2-3 keep one
empty placeholder per parameter (no storage). ``zopt.zero_grad()`` and ``step()`` at stages 2-3
(which consume the gradients) set ``p.grad = None`` as before.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = ["ShardedGrad", "ShardedGradError", "local_grad", "take_grad", "Stage1GradGuard"]

_aten = torch.ops.aten


class ShardedGradError(RuntimeError):
    """torch code used ``p.grad`` of a parameter whose real gradient ZeroAdamW holds elsewhere."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# what a model wrapped in DistributedDataParallel should be instead (also unit_hooks.py, at stage 3)
UNWRAPPED = ("give it, and train, the unwrapped model (accelerate: model = accelerator.prepare_model(model, "
             "evaluation_mode=True), then model._is_accelerate_prepared = True before prepare(...); Hugging Face: "
             "ZeroTrainer; Lightning: the zk_zeroN strategies)")


def _message(g: "ShardedGrad", op: str) -> str:
    if op == "zero_":               # model.zero_grad(set_to_none=False) between backward and step
        return (f"p.grad.zero_() of parameter {g.param_name!r} on a ZeRO-{g.stage} model between backward and "
                f"step() cannot drop its gradient: it was already reduced into ZeroAdamW's sharded slices. "
                f"Call zopt.zero_grad() (or model.zero_grad(), which sets p.grad to None, followed by it).")
    if _in_backward():              # no user code runs there: a hook of a wrapper that reduces gradients too
        return (f"p.grad of parameter {g.param_name!r} on a ZeRO-{g.stage} model was used during backward (torch "
                f"op `{op}`): something besides ZeroAdamW reduces the gradients, most likely "
                f"DistributedDataParallel around the model (accelerate's prepare(model), a plain Trainer, "
                f"Lightning's ddp strategy). ZeroAdamW reduces them itself: {UNWRAPPED}.")
    where = ("it holds this rank's local, not yet averaged gradient until step() reduce-scatters it, so "
             "anything computed from it differs on every rank and from DDP's") if g.stage == 1 else \
            ("it holds no data: the averaged gradient is sharded across the ranks inside ZeroAdamW (each rank "
             "keeps a slice of every bucket)")
    msg = (f"p.grad of parameter {g.param_name!r} cannot be read on a ZeRO-{g.stage} model between backward and "
           f"step() (torch op `{op}`): {where}. Per-parameter gradient statistics are not available under ZeRO; "
           f"zopt.clip_grad_norm_(float('inf')) measures the global gradient norm.")
    if op.lstrip("_").replace("foreach_", "") not in _CLIP_OPS:
        return msg
    return (msg + " To clip gradients call zopt.clip_grad_norm_(max_norm) on the ZeroAdamW instead of "
            "torch.nn.utils.clip_grad_norm_ / Accelerator.clip_grad_norm_ (the global norm over every rank's "
            "slices, tied parameters once; it returns the total norm as torch does); clip_grad_value_ has no "
            "ZeRO equivalent. The Lightning zk strategies (gradient_clip_val) and ZeroTrainer (max_grad_norm) "
            "already clip this way.")


# the ops of torch's clip_grad_norm_ / clip_grad_value_ (and their foreach forms): the message adds how to clip
_CLIP_OPS = frozenset({"norm", "linalg_vector_norm", "norm_", "clamp", "clamp_", "clip", "clip_", "mul_", "mul",
                       "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "abs", "amax", "max"})


class ShardedGrad(Tensor):
    """``p.grad`` of a ZeroAdamW parameter ([Note: gradient placeholders]); ``local`` is the stage-1
    local gradient (None at stages 2-3)."""

    @staticmethod
    def __new__(cls, param: Tensor, name: str, stage: int, local: Tensor | None = None,
                reduced: Callable[[], bool] | None = None):
        return Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)

    def __init__(self, param: Tensor, name: str, stage: int, local: Tensor | None = None,
                 reduced: Callable[[], bool] | None = None):
        self.param_name, self.stage, self.local = name, stage, local
        self.reduced = reduced      # stage 1: True once this step's gradients were reduce-scattered
        self.replaced = False       # a create_graph backward replaced p.grad by ``self + new`` (_add)

    def __repr__(self) -> str:      # printing must not raise: it names what this is instead
        return (f"ShardedGrad(param={self.param_name!r}, stage={self.stage}, shape={tuple(self.shape)}: "
                f"use zopt.clip_grad_norm_(max_norm), not torch's clip on p.grad)")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _ALLOWED.get(func)
        out = handler(*args, **kwargs) if handler is not None else NotImplemented
        if out is not NotImplemented:
            return out
        guards = [a for a in _flat(args) if isinstance(a, ShardedGrad)]
        raise ShardedGradError(_message(guards[0], func.overloadpacket.__name__))


def _flat(args) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(a)
        else:
            out.append(a)
    return out


def _add_(self, other, alpha=1):
    """autograd accumulating into p.grad (AccumulateGrad's ``grad += new``), backward only."""
    if not isinstance(self, ShardedGrad) or isinstance(other, ShardedGrad) or not _in_backward():
        return NotImplemented
    other = other if alpha == 1 else other * alpha
    if self.local is None:
        self.local = other          # stages 2-3: the reducer's hook takes it right after
    else:
        self.local.add_(other)
    return self


def _add(self, other, alpha=1):
    """``create_graph=True`` backward: AccumulateGrad computes ``grad + new`` out of place."""
    if not isinstance(self, ShardedGrad) or isinstance(other, ShardedGrad) or not _in_backward():
        return NotImplemented
    other = other if alpha == 1 else other * alpha
    self.replaced = True
    return other if self.local is None else self.local + other


def _zero_(self):
    if self.local is None:          # stages 2-3: the gradient is in the slices, not here
        return NotImplemented
    self.local.zero_()
    return self


def _unscale_(grads, found_inf, inv_scale):
    """GradScaler: unscale what p.grad really holds (stage 1); stages 2-3 hold nothing here.
    Stage 1 after ``zopt.clip_grad_norm_`` reduce-scattered the (scaled) gradients: unscaling the
    local ones cannot reach the slices, so it raises (a check with ``inv_scale == 1``, what
    ``scaler.step`` does, is allowed)."""
    late = [g for g in grads if isinstance(g, ShardedGrad) and g.reduced is not None and g.reduced()]
    if late and float(inv_scale.reshape(-1)[0]) != 1.0:
        raise ShardedGradError(
            f"scaler.unscale_(zopt) after zopt.clip_grad_norm_ on a ZeRO-1 model (parameter "
            f"{late[0].param_name!r}): clip_grad_norm_ already reduce-scattered the still-scaled gradients "
            f"into ZeroAdamW's slices, which unscaling p.grad cannot reach. Call scaler.unscale_(zopt) "
            f"before zopt.clip_grad_norm_ (the AMP recipe), or not at all: zopt.clip_grad_norm_ and the "
            f"step know the scale from the GradScaler given as ZeroAdamW(..., loss_scale=scaler). "
            f"Nothing was changed.")
    real = [g.local if isinstance(g, ShardedGrad) else g for g in grads]
    real = [g for g in real if g is not None]
    if real:
        torch._amp_foreach_non_finite_check_and_unscale_(real, found_inf, inv_scale)
    return None


_ALLOWED = {_aten.add_.Tensor: _add_, _aten.add.Tensor: _add, _aten.zero_.default: _zero_,
            _aten._amp_foreach_non_finite_check_and_unscale_.default: _unscale_}


def local_grad(p: Tensor) -> Tensor | None:
    """What p.grad really holds (the stage-1 local gradient inside a ShardedGrad, or a plain tensor)."""
    g = p.grad
    return g.local if isinstance(g, ShardedGrad) else g


def take_grad(p: Tensor) -> Tensor | None:
    """Stages 2-3 hook: the gradient autograd just delivered, removed from p.grad."""
    g = p.grad
    if isinstance(g, ShardedGrad):
        ph, g = g, g.local
        ph.local = None
    p.grad = None
    return g


class Stage1GradGuard:
    """Stage 1: wraps each local gradient in a ShardedGrad once autograd has delivered it. A fresh
    wrapper each step (~10 us per parameter): one kept per parameter would keep the last local
    gradient alive after ``model.zero_grad()`` drops p.grad."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], reduced: Callable[[], bool] | None = None):
        self.reduced = reduced      # True once step()/clip_grad_norm_ reduce-scattered this step's gradients
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in named]

    def _hook(self, name: str):
        def hook(p: nn.Parameter) -> None:
            g = p.grad
            if g is not None and not isinstance(g, ShardedGrad):
                p.grad = ShardedGrad(p, name, 1, local=g, reduced=self.reduced)
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
