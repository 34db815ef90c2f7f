"""Loss scaling and non-finite gradient safety for ZeroAdamW.

[Note: non-finite gradients]
Every ``ZeroAdamW.step()`` checks the *reduced* gradient slices it is about to apply (one fp32 sum
per bucket slice, padding excluded: a sum is non-finite iff some element is inf/NaN, barring an
fp32 overflow of the sum, which would only cause a harmless skip). The local flag (max'ed with
GradScaler's per-rank ``found_inf`` when GradScaler drives the step) is all-reduced with MAX, so
every rank takes the same decision. A skipped step changes nothing: masters, exp_avg, exp_avg_sq,
16-bit parameters and per-parameter step counts stay as they were. Then:

* ``loss_scale="dynamic"``: the scale is multiplied by ``backoff_factor`` (0.5) and the growth
  counter restarts; after ``growth_interval`` consecutive good steps it is multiplied by
  ``growth_factor`` (2.0) -- the semantics of ``torch.amp.GradScaler`` / ``torch._amp_update_scale_``.
* ``loss_scale=<float>``: a static scale; non-finite steps are skipped (and counted) as well.
* ``loss_scale=None`` (bf16 / fp32): the skip is counted in ``zopt.skipped_steps`` and reported
  with ``warnings.warn`` -- a non-finite gradient never silently reaches the masters.
* ``torch.amp.GradScaler``: ``scaler.scale(loss).backward(); scaler.step(zopt); scaler.update()``.
  ZeroAdamW sets ``_step_supports_amp_scaling`` so GradScaler hands it ``grad_scale`` (the scale)
  and ``found_inf`` (this rank's check of ``p.grad``, which under stage 2 holds nothing: the
  gradients live in the buckets). The step combines that with the slice check, all-reduces it,
  and writes the agreed flag back into GradScaler's per-optimizer record so ``scaler.update()``
  halves/grows the scale identically on every rank (GradScaler keeps that record privately; we
  find the scaler as the caller of ``step``; if it cannot be found a warning says the scales may
  diverge). Clipping under GradScaler: call ``zopt.clip_grad_norm_`` *without*
  ``scaler.unscale_`` (stage 2 has no ``p.grad`` to unscale) and pass ``loss_scale=scaler`` to
  the constructor so clipping knows the scale; or use ``loss_scale="dynamic"``.

With a loss scale the gradient multiplier handed to the fused kernel is ``clip_coef / scale``
(the reduced slices are already averages over the group), so unscaling costs no extra pass.
The decision is taken on the host (step counts are host ints), which costs one sync per step.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import collectives as C

__all__ = ["DynamicLossScaler", "make_scaler", "check_step"]


class DynamicLossScaler:
    """Loss scale state (plain floats/ints, so it goes into checkpoint metadata as is)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True):
        if init_scale <= 0 or not torch.isfinite(torch.tensor(float(init_scale))):
            raise ValueError(f"loss scale must be a finite positive number, got {init_scale!r}")
        if growth_factor <= 1.0 or not (0.0 < backoff_factor < 1.0):
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, "
                             f"{backoff_factor}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.dynamic = dynamic
        self.growth_tracker = 0

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "dynamic": self.dynamic,
                "growth_tracker": self.growth_tracker}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "dynamic", "growth_tracker"):
            if k in d:
                setattr(self, k, d[k])

    def __repr__(self) -> str:
        return f"DynamicLossScaler({self.state_dict()})"


def make_scaler(loss_scale, growth_interval: int = 2000):
    """(internal scaler or None, attached torch GradScaler or None) from the constructor argument."""
    if loss_scale is None:
        return None, None
    if isinstance(loss_scale, str):
        if loss_scale != "dynamic":
            raise ValueError(f"loss_scale must be None, 'dynamic', a positive float or a torch.amp.GradScaler, "
                             f"got {loss_scale!r}")
        return DynamicLossScaler(growth_interval=growth_interval), None
    if isinstance(loss_scale, torch.amp.GradScaler):
        return None, loss_scale
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        return DynamicLossScaler(float(loss_scale), growth_interval=growth_interval, dynamic=False), None
    raise ValueError(f"loss_scale must be None, 'dynamic', a positive float or a torch.amp.GradScaler, "
                     f"got {loss_scale!r}")


def current_scale(opt) -> float | None:
    """The loss scale the reduced slices currently carry (None: unscaled)."""
    sc = getattr(opt, "loss_scaler", None)
    if sc is not None:
        return sc.scale
    gs = getattr(opt, "grad_scaler", None)
    if gs is not None and gs.is_enabled():
        return float(gs.get_scale())
    return None


def _slices_nonfinite(opt) -> Tensor:
    sums = []
    for b in opt.buckets:
        if b.grad_slice is None:
            continue
        s, e = b.spec.data_bounds(opt.rank)
        if e > s:
            sums.append(b.grad_slice[: e - s].sum(dtype=torch.float32))
    if not sums:
        return torch.zeros((), dtype=torch.float32, device=opt._device)
    return (~torch.isfinite(torch.stack(sums).sum())).to(torch.float32)


def _find_grad_scaler(opt):
    f = sys._getframe(2)
    for _ in range(12):                 # step's decorators/wrappers sit in between
        if f is None:
            break
        obj = f.f_locals.get("self")
        if isinstance(obj, torch.amp.GradScaler):
            return obj
        f = f.f_back
    return getattr(opt, "grad_scaler", None)


def check_step(opt) -> tuple[bool, Tensor | None]:
    """Called by ZeroAdamW.step() after the reductions were launched: (skip, inverse loss scale).

    Waits for every bucket's reduced slice, checks them, agrees on the flag over the group and
    updates the scaler state; see [Note: non-finite gradients]."""
    opt._reduce_all()
    amp_scale = getattr(opt, "grad_scale", None)      # set by torch.amp.GradScaler.step
    amp_found = getattr(opt, "found_inf", None)
    driven_by_amp = amp_found is not None
    flag = _slices_nonfinite(opt)
    if driven_by_amp:
        flag = torch.maximum(flag, torch.as_tensor(amp_found, dtype=torch.float32).reshape(()).to(flag.device))
        if amp_scale is None and opt.stage != 1:
            raise RuntimeError("scaler.unscale_(zopt) cannot unscale ZeRO stage-2/3 gradients (they live in "
                               "the sharded buckets, not in p.grad): do not call unscale_; clip with "
                               "zopt.clip_grad_norm_ and construct ZeroAdamW(..., loss_scale=scaler)")
    flag = flag.reshape(1).clone()
    C.all_reduce_tensor(flag, op=dist.ReduceOp.MAX, group=opt.process_group)
    found = bool(flag.item() != 0)
    inv = None
    if driven_by_amp:
        if amp_scale is not None:
            inv = torch.as_tensor(amp_scale, dtype=torch.float32).reshape(1).to(opt._device).reciprocal()
        scaler = _find_grad_scaler(opt)
        if scaler is not None:
            st = scaler._per_optimizer_states[id(opt)]
            dev = scaler._scale.device if scaler._scale is not None else opt._device
            st["found_inf_per_device"] = {dev: flag.to(dev, torch.float32).reshape(())}
        elif not getattr(opt, "_warned_scaler", False):
            opt._warned_scaler = True
            warnings.warn("ZeroAdamW could not find the GradScaler driving this step: each rank's "
                          "scaler.update() then sees only its own inf check and the loss scales may "
                          "diverge across ranks; pass ZeroAdamW(..., loss_scale=scaler)", RuntimeWarning)
    elif opt.loss_scaler is not None:
        inv = torch.full((1,), 1.0 / opt.loss_scaler.scale, dtype=torch.float32, device=opt._device)
        opt.loss_scaler.update(found)
    if found:
        opt.skipped_steps += 1
        if not driven_by_amp and (opt.loss_scaler is None or not opt.loss_scaler.dynamic):
            warnings.warn(f"ZeroAdamW: non-finite gradient (inf/NaN) on some rank; step skipped on every "
                          f"rank, masters and moments unchanged ({opt.skipped_steps} skipped so far)",
                          RuntimeWarning, stacklevel=3)
    return found, inv
