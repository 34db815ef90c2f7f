"""Pure-torch reference of the fused Adam/AdamW step: the oracle in tests and the CPU fallback.

[Note: the fused-Adam contract]
Every backend (``reference``, ``triton``, ``cpu``, ``cuda``) implements one function with the
signature of :func:`fused_adam_ref` below. It updates T tensors in place, elementwise:

    masters[i]        fp32, contiguous. The fp32 master copy (or the fp32 parameter itself).
    grads[i]          fp32 / bf16 / fp16, contiguous, same numel. Read only.
    exp_avgs[i]       fp32, contiguous (m).
    exp_avg_sqs[i]    fp32, contiguous (v).
    max_exp_avg_sqs   list of fp32 (amsgrad) or None.
    params16          list of bf16 / fp16 tensors written with round-to-nearest-even(master), or None.
    coeffs            fp32 tensor [T, 3], per tensor: (step_size = lr / (1 - beta1^t),
                      bc2_sqrt = sqrt(1 - beta2^t), decay = 1 - lr * weight_decay for AdamW, else 1).
                      Per tensor because torch keeps one step count per parameter.
    grad_scale        None or a 1-element fp32 tensor: the gradient is MULTIPLIED by it first
                      (1 / loss_scale x clip coefficient), before maximize and weight decay.
    found_inf         None or a 1-element fp32 tensor: nonzero means "write nothing at all".

Per element, with g the gradient read in fp32 (math in fp32 throughout, one cast at each store):

    g = g * grad_scale                       (if grad_scale is given)
    g = -g                                   (if maximize)
    g = g + weight_decay * p                 (Adam / L2, i.e. not adamw)
    p = p * decay                            (AdamW: decay = 1 - lr * wd)
    m = m + (1 - beta1) * (g - m)            (torch's lerp form)
    v = beta2 * v + (1 - beta2) * g * g
    vmax = max(vmax, v)                      (amsgrad; the denominator then uses vmax)
    p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps)
    p16 = round_to_nearest_even(p)           (if params16 is given)

[Note: coefficients are computed once, in double]
Every scalar of the update is computed once, outside the element loop, by one definition:
step_size, bc2_sqrt and decay by :func:`compute_coeffs` (in double from CPU steps and a float lr;
in fp32 on the device for capturable steps, the same expression), 1 - beta1 and 1 - beta2 by
:func:`moment_coeffs` (double), and the grad scale by the caller (a tensor). Kernels receive them
rounded once to fp32, exactly as torch rounds a Python float operand, and compute no coefficient
themselves (``1.0 - beta`` in an fp32 kernel is off by 1.7e-4 relative at beta2 = 0.9999). The
betas stay Python floats in the contract: each backend wrapper derives (1 - beta1, 1 - beta2) from
them in double (``moment_coeffs`` in Python, ``1.0 - beta`` on C++ doubles), so the signature above
is unchanged. Element-wise, every backend then performs the listed operations in the listed order,
each rounded once to fp32 (no contracted multiply-add, IEEE division and square root, subnormals
kept, a NaN-propagating max; the reference's own square root is :func:`sqrt_rn`, because torch's
CPU ``sqrt`` is not correctly rounded): the interpreter, the compiled Triton kernel, the CPU and the CUDA
kernels and this reference agree bit for bit (tests/test_numerics.py; the PTX is checked by
tests/test_codegen.py).

Bytes moved per element (the GB/s denominators used by every benchmark):
    fp32 grad, no 16-bit copy:  read p, m, v, g (16) + write p, m, v (12) = 28 B
    16-bit grad + 16-bit param: read p, m, v (12) + g (2) + write p, m, v (12) + p16 (2) = 28 B
    amsgrad adds 8 B (read + write vmax). See :func:`bytes_per_element`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["fused_adam_ref", "compute_coeffs", "moment_coeffs", "m_bound", "bounded_m", "sqrt_rn", "bytes_per_element"]


def bytes_per_element(grad_dtype: torch.dtype, param16_dtype: torch.dtype | None, amsgrad: bool = False) -> int:
    """Bytes one fused step moves per parameter element (reads + writes, each once)."""
    g = torch.empty((), dtype=grad_dtype).element_size()
    p16 = 0 if param16_dtype is None else torch.empty((), dtype=param16_dtype).element_size()
    return 12 + g + 12 + p16 + (8 if amsgrad else 0)


def compute_coeffs(steps: list[Tensor] | Tensor, lr: float | Tensor, beta1: float, beta2: float,
                   weight_decay: float, adamw: bool, device: torch.device | None = None) -> Tensor:
    """[T, 3] fp32 (step_size, bc2_sqrt, decay) from the per-tensor (already incremented) steps.

    Device steps: torch ops only (no ``.item()``), capturable when the steps and lr live on the device.
    CPU steps: the arithmetic is done in fp64, like torch's Python-float path (``beta ** step``); with a
    float lr in Python doubles, one row per distinct count (``_coeffs_double``), else in fp64 tensor ops.
    """
    s = steps if isinstance(steps, Tensor) else torch.stack([t.reshape(()) for t in steps])
    if s.device.type == "cpu" and not isinstance(lr, Tensor) and not torch.compiler.is_compiling():
        # CPU steps, a float lr: Python doubles, one row per distinct step count (the ~12 tiny tensor ops
        # below cost ~50 us of host time per launch). The same IEEE double operations (torch's scalar pow
        # is libm's pow, as Python's; tests/test_numerics.py checks the two paths bit for bit).
        flat = s.reshape(-1)
        first = flat[:1]
        if bool((flat == first).all()):          # one count (the usual case): one row, repeated
            counts, inverse = first, None
        else:
            counts, inverse = torch.unique(flat, return_inverse=True)
        hp = (float(lr), float(beta1), float(beta2), weight_decay, adamw)
        table = torch.tensor([_coeffs_double(t, *hp) for t in counts.tolist()], dtype=torch.float32).reshape(-1, 3)
        out = table.expand(flat.numel(), 3).contiguous() if inverse is None else table[inverse]
        return out if device is None else out.to(device, non_blocking=True)
    s = s.to(torch.float64 if s.device.type == "cpu" else torch.float32)
    # Python-float operands (never torch.tensor(x, device=...)): a host->device copy would block the
    # host and cannot be captured in a CUDA graph.
    lr_t = lr.to(s.device, s.dtype).reshape(()) if isinstance(lr, Tensor) else float(lr)
    # beta ** s with the base as a tensor (the same pow per element): under torch.compile a beta that changed
    # twice is a SymFloat too, and a Python-scalar base was baked as the decay's fill value was (below)
    bc1 = 1 - torch.ones_like(s).mul(beta1).pow(s)
    bc2 = 1 - torch.ones_like(s).mul(beta2).pow(s)
    step_size = lr_t / bc1
    if not adamw:
        decay = torch.ones_like(step_size)
    elif isinstance(lr_t, Tensor):
        decay = (1 - lr_t * weight_decay).expand_as(step_size)
    else:
        # 1 - lr * wd in doubles (Python's operations, one rounding to fp32 later), by tensor ops: under
        # torch.compile a float lr that changed twice becomes a SymFloat, and Inductor baked the fill value of
        # full_like(step_size, 1 - lr * wd) at its second value (a stale decay, silently; torch 2.13)
        decay = (1 - torch.ones_like(step_size, dtype=torch.float64).mul(lr_t).mul(weight_decay)).to(step_size.dtype)
    out = torch.stack([step_size, bc2.sqrt(), decay], dim=1).to(torch.float32)
    return out if device is None else out.to(device, non_blocking=True)


def _coeffs_double(t: float, lr: float, beta1: float, beta2: float, weight_decay: float,
                   adamw: bool) -> tuple[float, float, float]:
    """compute_coeffs' row for one step count ``t`` in Python doubles, IEEE results included where Python
    would raise: a zero bias correction (the count of a step that found_inf skipped before any was taken)
    gives +-inf, or the machine's default NaN (``inf - inf``, as 0 / 0 and sqrt(-x) give it)."""
    bc1 = 1 - beta1 ** t
    bc2 = 1 - beta2 ** t
    if bc1 != 0:
        step_size = lr / bc1
    elif lr == 0:
        step_size = math.inf - math.inf                           # 0 / 0
    else:
        step_size = math.copysign(math.inf, lr) if lr == lr else lr   # x / +0; a NaN lr propagates
    bc2_sqrt = math.sqrt(bc2) if bc2 >= 0 else (bc2 if bc2 != bc2 else math.inf - math.inf)
    return step_size, bc2_sqrt, 1 - lr * weight_decay if adamw else 1.0


def sqrt_rn(x: Tensor) -> Tensor:
    """fp32 square root, correctly rounded (IEEE), on every device.

    torch's CPU ``sqrt`` is not (its vectorized fp32 path is off by 1 ulp on ~20% of inputs; the
    CUDA one is exact). Rounded once from fp64 it is: a double square root carries 53 >= 2 x 24 + 2
    bits, so rounding it to fp32 gives the correctly rounded fp32 result.
    """
    return x.double().sqrt().float()


def m_bound(beta1: float, beta2: float) -> float:
    """Adam's bound on |m| / sqrt(v) for states that start at 0 ([Note: the bound on 8-bit m] in codecs.py):
    ``(1 - beta1) / sqrt((1 - beta2) (1 - beta1^2 / beta2))``, in double (the kernels take it rounded once to
    fp32), when ``0 <= beta1^2 < beta2 < 1``; else inf (no bound: the step applies none)."""
    b1, b2 = float(beta1), float(beta2)
    if not (0.0 <= b1 and b1 * b1 < b2 < 1.0):
        return math.inf
    return (1.0 - b1) / math.sqrt((1.0 - b2) * (1.0 - b1 * b1 / b2))


def bounded_m(m: Tensor, bound: Tensor) -> Tensor:
    """``m`` with |m| capped at ``bound`` (>= 0, or NaN): ``copysign(bound, m)`` where ``|m| > bound``, else ``m``
    (a NaN m, or a NaN bound, leaves m as it is)."""
    return torch.where(m.abs() > bound, torch.where(m < 0, -bound, bound), m)


def moment_coeffs(beta1: float, beta2: float) -> tuple[float, float]:
    """(1 - beta1, 1 - beta2) in double: the scalars the update multiplies by.

    torch rounds a Python float operand to fp32 when it multiplies an fp32 tensor, so every backend
    passes these doubles, rounded once to fp32, and never subtracts in fp32 itself ([Note:
    coefficients are computed once, in double]).
    """
    return 1.0 - float(beta1), 1.0 - float(beta2)


def fused_adam_ref(
    masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor] | None, params16: list[Tensor] | None, coeffs: Tensor, *,
    beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool, maximize: bool,
    grad_scale: Tensor | None = None, found_inf: Tensor | None = None, bound_m: bool = False,
) -> None:
    """The contract in plain torch (see the Note above). States may be fp32 or any float dtype:
    math runs in fp32 and results are cast back once (that is how ``master_weights=False`` with
    16-bit parameters keeps 16-bit states). ``bound_m`` (the coded step of an 8-bit exp_avg only, [Note: the
    bound on 8-bit m] in codecs.py): after the moments, ``m = bounded_m(m, fp32(m_bound) * sqrt(v))``."""
    skip = None if found_inf is None else (found_inf.reshape(()) != 0)
    one_minus_beta1, one_minus_beta2 = moment_coeffs(beta1, beta2)
    for i, (p, g, m, v) in enumerate(zip(masters, grads, exp_avgs, exp_avg_sqs)):
        step_size, bc2_sqrt, decay = coeffs[i, 0], coeffs[i, 1], coeffs[i, 2]
        pf, gf, mf, vf = p.float(), g.float(), m.float(), v.float()
        if grad_scale is not None:
            gf = gf * grad_scale.reshape(()).to(torch.float32)
        if maximize:
            gf = -gf
        if not adamw and weight_decay != 0:
            gf = gf + weight_decay * pf
        if adamw:
            pf = pf * decay
        mf = mf + one_minus_beta1 * (gf - mf)
        vf = beta2 * vf + one_minus_beta2 * gf * gf
        denom_v = vf
        new = [mf, vf]
        if max_exp_avg_sqs is not None:
            vmax = torch.maximum(max_exp_avg_sqs[i].float(), vf)
            denom_v = vmax
            new.append(vmax)
        root = sqrt_rn(denom_v)
        if bound_m:
            mf = bounded_m(mf, torch.tensor(m_bound(beta1, beta2), dtype=torch.float32, device=mf.device) * root)
            new[0] = mf
        pf = pf - step_size * mf / (root / bc2_sqrt + eps)
        outs = [p, m, v] + ([max_exp_avg_sqs[i]] if max_exp_avg_sqs is not None else [])
        vals = [pf] + new
        if params16 is not None:
            outs.append(params16[i])
            vals.append(pf)
        for dst, val in zip(outs, vals):
            if skip is not None:
                val = torch.where(skip, dst.float(), val)
            dst.copy_(val)
