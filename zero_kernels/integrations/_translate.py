"""One rule for turning a framework-built ``torch.optim.AdamW``/``Adam`` into a ZeroAdamW/ZeroAdam with
the same parameter groups and hyper-parameters (used by the Lightning and Hugging Face integrations)."""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ..zero import ZeroAdam, ZeroAdamW

__all__ = ["to_zero_optimizer", "repoint_schedulers", "check_no_loss_scale"]

_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def check_no_loss_scale(scale: Any) -> None:
    """ValueError for a ZeroAdamW ``loss_scale`` under a framework (at the integration's construction, and for
    an optimizer passed in): it needs the loss multiplied by ``scale_loss`` before backward, which neither
    Trainer nor Lightning does, so every gradient would be divided by a scale it never got."""
    if scale is not None:
        raise ValueError(f"loss_scale={scale!r} needs the loss multiplied by the ZeroAdamW's scale_loss(loss) before "
                         "backward(), which the framework's training step does not do: every gradient would be "
                         "divided by a scale it never got (clipping and the update off by that factor). Leave "
                         "loss_scale out; for 16-bit training pass param_dtype=torch.bfloat16, which needs no "
                         "loss scaling")


def to_zero_optimizer(optimizer: torch.optim.Optimizer, module: torch.nn.Module, stage: int,
                      zero_kwargs: dict[str, Any]) -> ZeroAdamW:
    """A ZeroAdamW (or ZeroAdam) with the parameter groups and hyper-parameters of ``optimizer``."""
    scale = optimizer.config.loss_scale if isinstance(optimizer, ZeroAdamW) else zero_kwargs.get("loss_scale")
    check_no_loss_scale(scale)
    if isinstance(optimizer, ZeroAdamW):
        return optimizer
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ValueError(f"the training framework built a {type(optimizer).__name__}; zero_kernels translates "
                         "torch.optim.AdamW or torch.optim.Adam into ZeroAdamW/ZeroAdam (or pass a ZeroAdamW "
                         "built from the model)")
    adamw = isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("decoupled_weight_decay", False)
    cls = ZeroAdamW if adamw else ZeroAdam
    groups = [{"params": list(g["params"]), **{k: g[k] for k in _HPARAMS if k in g}} for g in optimizer.param_groups]
    owned = {id(p) for g in groups for p in g["params"]}
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owned]
    if missing:
        raise ValueError(f"the optimizer leaves trainable parameters out ({missing[:3]}...): "
                         "ZeroAdamW shards every trainable parameter; set requires_grad=False on frozen ones")
    d = optimizer.defaults
    zopt = cls(module, stage=stage, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
               amsgrad=d.get("amsgrad", False), maximize=d.get("maximize", False), param_groups=groups,
               **zero_kwargs)
    for old, new in zip(optimizer.param_groups, zopt.param_groups):
        for k, v in old.items():          # e.g. initial_lr, set by an LR scheduler on the original
            if k != "params" and k not in new:
                new[k] = v
    return zopt


def repoint_schedulers(schedulers, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point every LR scheduler built on ``old`` at ``new``, keeping its state, the children of a
    ``SequentialLR`` / ``ChainedScheduler`` included (left on ``old``, they would change the discarded
    optimizer's lr and the new one's would stay frozen); ``new.step`` is then wrapped as a scheduler's
    construction wraps its optimizer's (:func:`_track_step_calls`)."""
    for sched in schedulers:
        if getattr(sched, "optimizer", None) is old:
            sched.optimizer = new
            _track_step_calls(new)
        repoint_schedulers(getattr(sched, "_schedulers", ()), old, new)


def _track_step_calls(opt: torch.optim.Optimizer) -> None:
    """What torch's ``LRScheduler.__init__`` does to the optimizer it is built on: ``opt.step`` wrapped to set
    ``opt._opt_called`` and marked ``_wrapped_by_lr_sched``. A scheduler checks both at its first step; on an
    optimizer swapped in after it was built, it warned once per process that "`optimizer.step()` has been
    overridden after learning rate scheduler initialization" although nothing was. (torch's own names: if a
    release renames them, that warning comes back, and this wrapper still only sets a flag.)"""
    step = opt.step
    if hasattr(step, "_wrapped_by_lr_sched") or not hasattr(step, "__func__"):
        return                             # wrapped already (a scheduler built on it), or not a method
    func, ref = step.__func__, weakref.ref(opt)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        o = ref()
        o._opt_called = True
        return func.__get__(o, o.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    opt.step = wrapper
