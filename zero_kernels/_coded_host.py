"""Host side of the fused coded-state Adam step, shared by every kernel that runs it: the Triton kernel
(``kernels/adam_coded.py``) and the C++ ``fused_adam_coded_cpu`` / ``fused_adam_coded_cuda`` (csrc/, the
ZK_CODED_ADAM_ARGS contract of csrc/fused_adam.h). Importable without triton.

:func:`prepare` does everything that is not the element loop, once, by one rule: increments the steps
as torch counts them (by ``1 - found_inf``), computes the coefficients (``reference.compute_coeffs``) and
the kernels' key rows (seed, step count, index offset: each kernel derives the stochastic-rounding keys
``codecs.sr_key`` from them), makes gradients and parameters contiguous (non-contiguous
parameters are updated in a contiguous copy and written back by :meth:`CodedStep.finish`), and groups the
tensors by layout key (grad dtype, 16-bit parameter dtype, master kind, exp_avg dtype, exp_avg_sq dtype):
one kernel call per group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from . import codecs
from .reference import compute_coeffs

__all__ = ["CodedEntry", "CodedStep", "prepare", "group_arrays", "run_extension"]

MASTER_FP32, MASTER_REMAINDER = 0, 1


@dataclass
class CodedEntry:
    """The tensors of one parameter as a kernel sees them (all contiguous)."""
    master: Tensor                     # fp32 master / fp32 parameter, or the int16 remainder
    grad: Tensor                       # fp32 / bf16 / fp16
    exp_avg: Tensor                    # stored format: fp32 / bf16 / uint8 / float8_e4m3fn
    exp_avg_sq: Tensor
    exp_avg_scale: Tensor | None       # fp32 block scales of a blockwise exp_avg
    exp_avg_sq_scale: Tensor | None
    param16: Tensor | None             # the 16-bit parameter (bf16 / fp16), None for an fp32 parameter

    @property
    def layout(self) -> tuple:
        """(grad dtype, param16 dtype or None, master kind, exp_avg dtype, exp_avg_sq dtype)."""
        return (self.grad.dtype, None if self.param16 is None else self.param16.dtype,
                MASTER_REMAINDER if self.master.dtype == torch.int16 else MASTER_FP32,
                self.exp_avg.dtype, self.exp_avg_sq.dtype)


@dataclass
class CodedStep:
    entries: list[CodedEntry]
    coeffs: Tensor                     # fp32 [T, 3] on the device (step_size, bc2_sqrt, decay)
    keys: Tensor                       # int64 [T, 3] on the device (seed, step count, flat index of element 0)
    groups: dict[tuple, list[int]]     # layout -> indices into entries, in parameter order
    writebacks: list[tuple[Tensor, Tensor]] = field(default_factory=list)   # (parameter, contiguous copy)

    def finish(self) -> None:
        """Copy the updated contiguous copies back into non-contiguous parameters."""
        for dst, tmp in self.writebacks:
            dst.detach().copy_(tmp)


def prepare(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]], seeds: list[int], *,
            lr, beta1: float, beta2: float, weight_decay: float, adamw: bool,
            found_inf: Tensor | None = None, index_offsets: list[int] | None = None,
            step_buffer: Tensor | None = None, cache: dict | None = None) -> CodedStep:
    """Increment every state's step (by 1 - found_inf) and build the kernels' arguments (see the module doc).
    ``index_offsets``: flat index of each tensor's element 0 in its full tensor (a ZeRO slice's offset; the
    stochastic-rounding bits are keyed by it), default 0. ``step_buffer``: a 1-D fp32 buffer whose element k
    IS ``states[k]["step"]`` (its view, [Note: launch plans]): one in-place add increments them all.
    ``cache``: a dict owned by a launch plan, valid while the plan is (same parameters, states, gradient
    layouts): what depends on those alone (entries, groups, key tensors) is built once and kept there."""
    device = params[0].device
    inc = 1.0 if found_inf is None else 1.0 - found_inf.to(device, torch.float32).reshape(())
    if step_buffer is not None:
        steps = step_buffer.add_(inc)
    else:
        steps = torch.stack([s["step"].reshape(()) for s in states]).add_(inc)
        torch._foreach_copy_([s["step"] for s in states], list(steps.unbind()))    # one launch, not one per tensor
    coeffs = compute_coeffs(steps, lr, beta1, beta2, weight_decay, adamw, device=device)
    cache = {} if cache is None else cache
    if "entries" in cache:                     # the plan's entries; this step's gradients and parameters (whose
        step = CodedStep(cache["entries"], coeffs, _keys(cache, steps, states, seeds, index_offsets, device),
                         cache["groups"])        # storage ``p.data = ...`` may have replaced)
        for e, p, g in zip(step.entries, params, grads):
            e.grad = g if g.is_contiguous() else g.contiguous()
            if e.param16 is None:
                e.master = p
            else:
                e.param16 = p
        return step
    step = CodedStep([], coeffs, _keys(cache, steps, states, seeds, index_offsets, device), {})
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        if not p.is_contiguous():
            tmp = p.detach().contiguous()
            step.writebacks.append((p, tmp))
            p = tmp
        master = s.get("master_remainder", s.get("master_param", p))
        e = CodedEntry(master=master.detach(), grad=g if g.is_contiguous() else g.contiguous(),
                       exp_avg=s["exp_avg"], exp_avg_sq=s["exp_avg_sq"], exp_avg_scale=s.get("exp_avg_scale"),
                       exp_avg_sq_scale=s.get("exp_avg_sq_scale"), param16=None if master is p else p.detach())
        step.entries.append(e)
        step.groups.setdefault(e.layout, []).append(i)
    if not step.writebacks:                    # entries of contiguous copies are never reused
        cache["entries"], cache["groups"] = step.entries, step.groups
    return step


def _keys(cache: dict, steps: Tensor, states: list[dict[str, Tensor]], seeds: list[int],
          index_offsets: list[int] | None, device: torch.device) -> Tensor:
    """int64 [T, 3] (seed, step count, flat index of element 0): each kernel derives the moments' stochastic-
    rounding keys ``codecs.sr_key(seed, step, 0 | 1)`` per tensor itself. One tensor kept in ``cache``; its step
    column is refreshed from this step's counts (one copy, no host sync) only when a moment is rounded
    stochastically (bf16, or the 8-bit exp_avg; otherwise the kernels read only the index)."""
    if "keys" not in cache:
        sr = any(codecs.rounds_stochastically(k, s[k].dtype) for s in states for k in ("exp_avg", "exp_avg_sq"))
        offs = [0] * len(states) if index_offsets is None else list(index_offsets)
        rows = [[seed & codecs.M32, 0, off] for seed, off in zip(seeds, offs)]
        cache["sr"], cache["keys"] = sr, torch.tensor(rows, dtype=torch.int64).reshape(len(states), 3).to(device)
    if cache["sr"]:
        cache["keys"][:, 1].copy_(steps)
    return cache["keys"]


def group_arrays(step: CodedStep, key: tuple, idx: list[int], cache: dict | None) -> tuple[Tensor, Tensor]:
    """(coeffs, keys) rows of layout group ``key`` (the tensors ``idx``): the step's own tensors when the group
    is every tensor in order, else their rows (index_select; the index tensor is kept in ``cache``)."""
    if idx == list(range(len(step.entries))):
        return step.coeffs, step.keys
    cache = {} if cache is None else cache
    index = cache.get(("index", key))
    if index is None:
        index = cache[("index", key)] = torch.tensor(idx, dtype=torch.int64).to(step.coeffs.device)
    return step.coeffs.index_select(0, index).contiguous(), step.keys.index_select(0, index).contiguous()


def run_extension(fn: Callable[..., None], params: list[Tensor], grads: list[Tensor],
                  states: list[dict[str, Tensor]], seeds: list[int], *, lr, beta1: float, beta2: float, eps: float,
                  weight_decay: float, adamw: bool, maximize: bool = False, grad_scale: Tensor | None = None,
                  found_inf: Tensor | None = None, index_offsets: list[int] | None = None,
                  step_buffer: Tensor | None = None, cache: dict | None = None) -> None:
    """``codecs.adam_step_coded`` for every (param, grad, state, seed[, index offset]) through a C++ entry point of the
    ZK_CODED_ADAM_ARGS contract (``_ext.fused_adam_coded_cpu`` / ``_cuda``): one call per layout group."""
    if not params:
        return
    step = prepare(params, grads, states, seeds, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                   adamw=adamw, found_inf=found_inf, index_offsets=index_offsets, step_buffer=step_buffer,
                   cache=cache)
    device = params[0].device
    gs = None if grad_scale is None else grad_scale.to(device, torch.float32).reshape(1)
    fi = None if found_inf is None else found_inf.to(device, torch.float32).reshape(1)
    for key, idx in step.groups.items():
        es = [step.entries[i] for i in idx]
        c, k = group_arrays(step, key, idx, cache)
        fn([e.master for e in es], [e.grad for e in es], [e.exp_avg for e in es], [e.exp_avg_sq for e in es],
           [e.exp_avg_scale for e in es if e.exp_avg_scale is not None],
           [e.exp_avg_sq_scale for e in es if e.exp_avg_sq_scale is not None],
           [e.param16 for e in es if e.param16 is not None], c, k,
           beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
           maximize=maximize, grad_scale=gs, found_inf=fi)
    step.finish()
