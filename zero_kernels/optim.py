"""``FusedAdam`` / ``FusedAdamW``: drop-in replacements for ``torch.optim.Adam`` / ``AdamW``.

The optimizer owns validation, parameter groups and state (torch's layout and keys); the math is
one function with one contract (``zero_kernels.reference``), run by the backend chosen in
``zero_kernels.backends``. A step launches one kernel per (parameter group, device, grad dtype,
16-bit dtype), whatever the number of parameters.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from . import backends
from .hparams import validate_hparams as _validate_hparams
from .reference import compute_coeffs, fused_adam_ref

__all__ = ["FusedAdam", "FusedAdamW"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_FP32_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _local(t: Tensor | None) -> Tensor | None:
    """The local shard of a DTensor (FSDP2 parameters, grads and states), else the tensor itself.
    ``to_local()`` shares storage, so the kernel's in-place writes land in the DTensor."""
    if t is not None and hasattr(t, "to_local") and hasattr(t, "device_mesh"):
        return t.to_local()
    return t


def _scalar(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


class FusedAdam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``: L2 added to the gradient) as one fused pass.

    Same constructor, defaults and semantics as ``torch.optim.Adam``. Extra keyword-only:

    master_weights: ``None`` (default) keeps an fp32 master copy (``state["master_param"]``) for
        every bf16/fp16 parameter and rewrites the 16-bit parameter from it in the same kernel
        pass; ``False`` keeps 16-bit states like torch does (runs the reference path);
        ``True`` is the same as ``None``.
    backend: ``"auto"`` | ``"triton"`` | ``"cpu"`` | ``"cuda"`` | ``"reference"``.

    ``foreach`` is accepted and ignored (the step is always multi-tensor); ``fused=False`` and
    ``differentiable=True`` are refused. ``capturable=True`` keeps ``step`` on the parameter's
    device and never calls ``.item()`` in ``step()``.
    """

    _decoupled_default = False

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool | None = None,
        master_weights: bool | None = None,
        backend: str = "auto",
    ) -> None:
        _validate_hparams(lr, betas, eps, weight_decay)
        if differentiable:
            raise ValueError(f"{type(self).__name__} does not support differentiable=True "
                             "(the fused kernel updates in place); use torch.optim.Adam(differentiable=True)")
        if fused is False:
            raise ValueError(f"{type(self).__name__} is always fused; fused=False asks for torch's "
                             "unfused loop: use torch.optim.Adam/AdamW for that")
        if backend not in backends.BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {backends.BACKENDS}")
        if master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be None, True or False, got {master_weights!r}")
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        self._backend_request = backend
        self._master_weights = master_weights
        self._resolved: dict[torch.device, str] = {}
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=False, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        # GradScaler: unscale + inf check happen inside our kernel (see step()).
        self._step_supports_amp_scaling = True

    # ------------------------------------------------------------------ groups and validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's checks (duplicates across groups, ...) plus ours, before anything is stored."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for i, p in enumerate(params):
            t = p[1] if isinstance(p, tuple) else p
            if not isinstance(t, Tensor):
                continue  # torch raises its own TypeError below
            if t.is_complex():
                raise ValueError(f"params[{i}] is complex ({t.dtype}); {type(self).__name__} supports "
                                 "real floating-point parameters only (view as real with torch.view_as_real)")
            if not t.is_floating_point():
                raise ValueError(f"params[{i}] has dtype {t.dtype}; optimizers need floating-point "
                                 "parameters (integer tensors have no gradient)")
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        devices = {t.device for t in tensors if isinstance(t, Tensor)}
        if len(devices) > 1:
            raise ValueError(f"one parameter group mixes devices {sorted(map(str, devices))}; a fused "
                             "group runs on one device: put each device's parameters in its own group")
        merged = {**self.defaults, **param_group}
        _validate_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"])
        for dev in devices:
            if dev not in self._resolved:
                self._resolved[dev] = backends.resolve(self._backend_request, dev)
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self._decoupled_default)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, except that with master weights the fp32 moments and master of 16-bit
        parameters stay fp32 (torch casts floating state to the parameter's dtype). A 16-bit
        state saved by torch.optim is upcast exactly at the first step."""
        saved = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for p, sid in zip(params, saved_ids):
            if not self._uses_master(p) or sid not in saved:
                continue
            for k in _FP32_STATE_KEYS:
                v = saved[sid].get(k)
                if isinstance(v, Tensor) and v.dtype == torch.float32:
                    self.state[p][k] = v.to(device=p.device, copy=True)

    # ------------------------------------------------------------------ state
    def _uses_master(self, p: Tensor) -> bool:
        return p.dtype in _LOW_PRECISION and self._master_weights is not False

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        master = self._uses_master(p)
        sdtype = torch.float32 if (master or p.dtype == torch.float32) else p.dtype
        if len(state) == 0:
            on_device = group["capturable"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            # zeros_like keeps DTensor-ness (FSDP2): states are sharded like their parameter
            state["exp_avg"] = torch.zeros_like(p, dtype=sdtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=sdtype, memory_format=torch.contiguous_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=sdtype, memory_format=torch.contiguous_format)
        if not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        if master and "master_param" not in state:
            # From the 16-bit values: also right after loading a torch.optim state_dict.
            state["master_param"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=sdtype, memory_format=torch.contiguous_format)
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if k in state and (state[k].dtype != sdtype or not _local(state[k]).is_contiguous()):
                state[k] = state[k].to(dtype=sdtype, memory_format=torch.contiguous_format)
        return state

    # ------------------------------------------------------------------ step
    def _check_grads(self) -> None:
        """Every bad gradient is reported before any state changes."""
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}]"
                if g.is_sparse:
                    raise RuntimeError(f"{where} has a sparse gradient; {type(self).__name__} does not "
                                       "support sparse gradients, please consider SparseAdam instead")
                if g.shape != p.shape:
                    raise RuntimeError(f"{where}: gradient shape {tuple(g.shape)} does not match the "
                                       f"parameter's {tuple(p.shape)}")
                if g.dtype != p.dtype:
                    raise RuntimeError(f"{where}: gradient dtype {g.dtype} does not match the "
                                       f"parameter's {p.dtype}")
                if g.device != p.device:
                    raise RuntimeError(f"{where}: gradient on {g.device}, parameter on {p.device}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: Tensor | None = None,
             found_inf: Tensor | None = None) -> float | None:
        """One fused step. ``grad_scale`` (the loss scale: gradients are divided by it) and
        ``found_inf`` (nonzero: skip everything) follow torch's fused AdamW / GradScaler contract;
        they are also read from ``self.grad_scale`` / ``self.found_inf`` set by GradScaler."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        self._check_grads()
        for group in self.param_groups:
            self._step_group(group, grad_scale, found_inf)
        return loss

    def _step_group(self, group: dict[str, Any], grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        beta1, beta2 = (_scalar(b) for b in group["betas"])
        adamw = bool(group["decoupled_weight_decay"])
        # Buckets of tensors that can share one launch: (device, grad dtype, 16-bit dtype, math path)
        launches: dict[tuple, dict[str, list]] = {}
        writebacks: list[tuple[Tensor, Tensor]] = []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._init_state(p, group)
            master = _local(state.get("master_param"))
            g = _local(p.grad)
            g = g if g.is_contiguous() else g.contiguous()
            if master is not None:
                target, p16 = master, _local(p)
            else:
                target, p16 = _local(p), None
            if p16 is not None and not p16.is_contiguous():
                tmp = torch.empty(p16.shape, dtype=p16.dtype, device=p16.device)
                writebacks.append((p16, tmp))
                p16 = tmp
            if not target.is_contiguous():
                # Never update a throwaway copy: the contiguous temporary is copied back below.
                tmp = target.contiguous()
                writebacks.append((target, tmp))
                target = tmp
            ref_only = target.dtype != torch.float32  # master_weights=False with 16-bit params
            key = (p.device, g.dtype, None if p16 is None else p16.dtype, ref_only)
            b = launches.setdefault(key, {k: [] for k in
                                          ("p", "g", "m", "v", "vmax", "p16", "step")})
            b["p"].append(target)
            b["g"].append(g)
            b["m"].append(_local(state["exp_avg"]))
            b["v"].append(_local(state["exp_avg_sq"]))
            b["vmax"].append(_local(state.get("max_exp_avg_sq")))
            b["p16"].append(p16)
            b["step"].append(state["step"])
        for (device, _, p16_dtype, ref_only), b in launches.items():
            steps = b["step"]
            if found_inf is not None:
                fi = found_inf.to(steps[0].device, torch.float32).reshape(())
                for s in steps:  # torch's fused path: +1, then -found_inf
                    s.add_(1.0 - fi)
            else:
                torch._foreach_add_(steps, 1.0)
            coeffs = compute_coeffs(steps, group["lr"], beta1, beta2, group["weight_decay"], adamw,
                                    device=device)
            gs = None
            if grad_scale is not None:
                gs = grad_scale.to(device, torch.float32).reshape(1).reciprocal()
            fi_dev = None if found_inf is None else found_inf.to(device, torch.float32).reshape(1)
            fn = fused_adam_ref if ref_only else backends.get(self._resolved.get(device)
                                                               or self._resolve(device))
            fn(b["p"], b["g"], b["m"], b["v"], b["vmax"] if group["amsgrad"] else None,
               b["p16"] if p16_dtype is not None else None, coeffs,
               beta1=beta1, beta2=beta2, eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
               adamw=adamw, maximize=bool(group["maximize"]), grad_scale=gs, found_inf=fi_dev)
        for dst, tmp in writebacks:
            dst.copy_(tmp)

    def _resolve(self, device: torch.device) -> str:
        self._resolved[device] = backends.resolve(self._backend_request, device)
        return self._resolved[device]

    @property
    def backend(self) -> dict[str, str]:
        """The backend that runs for each device, e.g. ``{"cpu": "cpu"}``."""
        return {str(d): b for d, b in self._resolved.items()}


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay, default ``weight_decay=1e-2``) as one fused pass; a drop-in
    for ``torch.optim.AdamW``. See :class:`FusedAdam` for the extra keyword arguments."""

    _decoupled_default = True

    def __init__(self, params, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool | None = None, backend: str = "auto") -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, master_weights=master_weights,
                         backend=backend)
