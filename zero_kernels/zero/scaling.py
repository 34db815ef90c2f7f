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
  ``growth_factor`` (2.0) unless that would pass fp32's range -- the semantics of ``torch.amp.GradScaler`` /
  ``torch._amp_update_scale_``.
* ``loss_scale=<float>``: a static scale; non-finite steps are skipped (and counted) as well.
* ``loss_scale=None`` (bf16 / fp32): the skip is counted in ``zopt.skipped_steps`` and reported
  with ``warnings.warn`` -- a non-finite gradient never silently reaches the masters.
* ``torch.amp.GradScaler``: construct with ``ZeroAdamW(..., loss_scale=scaler)``, then
  ``scaler.scale(loss).backward(); scaler.step(zopt); scaler.update()``. ZeroAdamW follows the
  protocol of torch's fused optimizers: ``_step_supports_amp_scaling = True``, so GradScaler
  hands it ``grad_scale`` (the scale) and ``found_inf`` (this rank's check of ``p.grad``, which
  under stages 2-3 holds nothing: the gradients live in the buckets) as attributes; ``step()``
  also takes them as keyword arguments. The step combines ``found_inf`` with the slice check,
  all-reduces it, and records the agreed flag in the scaler it was given (the per-optimizer
  found-inf record ``scaler.update()`` reads, the record torch's ShardedGradScaler fills for
  FSDP) so every rank halves/grows the scale identically. A GradScaler driving ``step()``
  without having been given to the constructor is refused with an error (its ranks' scales
  would diverge); nothing searches the call stack for it. Clipping under GradScaler: call
  ``zopt.clip_grad_norm_`` *without* ``scaler.unscale_`` (stages 2-3 have no ``p.grad`` to
  unscale); clipping knows the scale from the scaler given to the constructor. Stage 1 may call
  ``scaler.unscale_(zopt)`` first (the AMP recipe): it unscales the local gradients and clipping
  then sees that GradScaler recorded them as unscaled.

With a loss scale the gradient multiplier handed to the fused kernel is ``clip_coef / scale``
(the reduced slices are already averages over the group), so unscaling costs no extra pass.
The decision is taken on the host (step counts are host ints), which costs one sync per step.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .mesh import ZeroMesh, all_reduce_everywhere

__all__ = ["DynamicLossScaler", "make_scaler", "StepScaling"]


def _finite_fp32(x: float) -> bool:
    """``x`` rounded to fp32 (the scale the kernels use) is finite."""
    return bool(torch.isfinite(torch.tensor(x, dtype=torch.float32)))


class DynamicLossScaler:
    """Loss scale state (plain floats/ints, so it goes into checkpoint metadata as is)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True):
        if init_scale <= 0 or not _finite_fp32(float(init_scale)):
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
                grown = self.scale * self.growth_factor
                if _finite_fp32(grown):     # as torch._amp_update_scale_: never past fp32 (inf: every other step
                    self.scale = grown      # overflowed, was skipped and backed off)
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


def _slices_nonfinite(buckets, rank: int, device: torch.device) -> Tensor:
    sums = []
    for b in buckets:
        g = b.reduce.grad_slice
        if g is None:
            continue
        s, e = b.spec.data_bounds(rank)
        if e > s:
            sums.append(g[: e - s].sum(dtype=torch.float32))
    if not sums:
        return torch.zeros((), dtype=torch.float32, device=device)
    return (~torch.isfinite(torch.stack(sums).sum())).to(torch.float32)


class StepScaling:
    """The loss-scale state of one ZeroAdamW and its non-finite-gradient decision per step."""

    def __init__(self, loss_scale, growth_interval: int, group, rank: int, world: int, stage: int,
                 device: torch.device, owner_id: int, mesh: ZeroMesh | None = None):
        self.loss_scaler, self.grad_scaler = make_scaler(loss_scale, growth_interval)
        self.owner_id = owner_id            # id() of the optimizer: GradScaler's key for its record
        self.group, self.rank, self.world, self.stage, self.device = group, rank, world, stage, device
        self.skipped_steps = 0
        self.mesh = mesh if mesh is not None else ZeroMesh(group, None)
        self.loss_scaled = False            # scale_loss() called since the last step (check_scaled)

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss * scale`` with a loss scaler (``loss_scale="dynamic"`` or a float), else ``loss``."""
        if self.loss_scaler is None:
            return loss
        self.loss_scaled = True
        return loss * self.loss_scaler.scale

    def check_scaled(self) -> None:
        """With ``loss_scale="dynamic"`` or a float the step divides the gradients by the scale: refuse, before
        anything changes, a step whose backward did not go through ``scale_loss`` (a plain
        ``loss.backward()`` would silently shrink every update by the scale, 65536 by default)."""
        if self.loss_scaler is not None and not self.loss_scaled:
            raise RuntimeError(
                f"ZeroAdamW(loss_scale=...) divides the gradients by the loss scale ({self.loss_scaler.scale:g}), "
                f"but zopt.scale_loss(loss) was not called since the last step: call "
                f"zopt.scale_loss(loss).backward() instead of loss.backward() (or construct without loss_scale, "
                f"as bf16 needs). Nothing was changed.")

    def state_dict(self) -> dict[str, Any]:
        """Plain data for the shard state dict: the loss scaler's state (None without one; a GradScaler given
        as ``loss_scale`` is saved by its owner, as torch's AMP recipe does) and the skipped-step count."""
        return {"loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
                "skipped_steps": self.skipped_steps}

    @staticmethod
    def check_state(d: Any) -> str | None:
        """Why ``d`` (a saved :meth:`state_dict`) cannot be loaded, or None."""
        if not isinstance(d, dict) or not isinstance(d.get("skipped_steps"), int) or d["skipped_steps"] < 0:
            return f"'scaling' must be a dict with a non-negative int 'skipped_steps', got {d!r}"
        ls = d.get("loss_scaler")
        if ls is not None:
            scale = ls.get("scale") if isinstance(ls, dict) else None
            if not isinstance(scale, (int, float)) or not 0.0 < float(scale) < float("inf"):
                return f"'scaling'['loss_scaler'] must hold a finite positive 'scale', got {ls!r}"
        return None

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a checked :meth:`state_dict` (a saved loss scaler into this optimizer's, when it has one)."""
        if self.loss_scaler is not None and d.get("loss_scaler"):
            self.loss_scaler.load_state_dict(d["loss_scaler"])
        self.skipped_steps = int(d["skipped_steps"])

    def current_scale(self) -> float | None:
        """The loss scale the reduced slices currently carry (None: unscaled)."""
        if self.loss_scaler is not None:
            return self.loss_scaler.scale
        gs = self.grad_scaler
        if gs is not None and gs.is_enabled() and not _unscaled(gs, self.owner_id):
            return float(gs.get_scale())
        return None

    def check_amp(self, grad_scale, found_inf) -> None:
        """Refuse what cannot work before anything changes (GradScaler protocol misuse)."""
        if found_inf is None:
            return
        if self.grad_scaler is None and (self.world > 1 or self.stage > 1):
            raise RuntimeError("a torch.amp.GradScaler drives this ZeroAdamW step but was not given to it: "
                               "construct ZeroAdamW(..., loss_scale=scaler) so that every rank's "
                               "scaler.update() sees the same inf/NaN decision")
        if grad_scale is None and self.stage != 1:
            raise RuntimeError("scaler.unscale_(zopt) cannot unscale ZeRO stage-2/3 gradients (they live in "
                               "the sharded buckets, not in p.grad): do not call unscale_; clip with "
                               "zopt.clip_grad_norm_ and construct ZeroAdamW(..., loss_scale=scaler)")

    def decide(self, buckets, grad_scale, found_inf) -> tuple[bool, Tensor | None]:
        """(skip, inverse loss scale) for this step, the same on every rank; see
        [Note: non-finite gradients]. The reduced slices must be complete."""
        flag = _slices_nonfinite(buckets, self.rank, self.device)
        if found_inf is not None:
            flag = torch.maximum(flag, torch.as_tensor(found_inf, dtype=torch.float32).reshape(()).to(flag.device))
        flag = flag.reshape(1).clone()
        all_reduce_everywhere(flag, dist.ReduceOp.MAX, self.mesh)     # a replica's GradScaler flag too
        found = bool(flag.item() != 0)
        inv = None
        if found_inf is not None:
            if grad_scale is not None:
                inv = torch.as_tensor(grad_scale, dtype=torch.float32).reshape(1).to(self.device).reciprocal()
            if self.grad_scaler is not None:
                _record_found_inf(self.grad_scaler, self.owner_id, flag)
        elif self.loss_scaler is not None:
            inv = torch.full((1,), 1.0 / self.loss_scaler.scale, dtype=torch.float32, device=self.device)
            self.loss_scaler.update(found)
        self.loss_scaled = False
        if found:
            self.skipped_steps += 1
            if found_inf is None and (self.loss_scaler is None or not self.loss_scaler.dynamic):
                warnings.warn(f"ZeroAdamW: non-finite gradient (inf/NaN) on some rank; step skipped on every "
                              f"rank, masters and moments unchanged ({self.skipped_steps} skipped so far)",
                              RuntimeWarning, stacklevel=4)
        return found, inv


def _unscaled(scaler, owner_id: int) -> bool:
    """``scaler.unscale_(zopt)`` already divided this step's (stage-1 local) gradients by the scale."""
    st = scaler._per_optimizer_states.get(owner_id)
    return st is not None and st["stage"] is torch.amp.grad_scaler.OptState.UNSCALED


def _record_found_inf(scaler, owner_id: int, flag: Tensor) -> None:
    """Record the group's agreed flag as this optimizer's found-inf for ``scaler.update()``
    (GradScaler's per-optimizer record, the one torch's ShardedGradScaler fills for FSDP)."""
    st = scaler._per_optimizer_states[owner_id]
    dev = scaler._scale.device if scaler._scale is not None else flag.device
    st["found_inf_per_device"] = {dev: flag.to(dev, torch.float32).reshape(())}
