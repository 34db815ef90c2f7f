"""The fused-Adam kernels as PyTorch operators: ``torch.ops.zero_kernels.fused_adam_{cpu,cuda,triton}``.

[Note: kernels as operators]
``torch.compile`` cannot trace a pybind function (Dynamo skips it: "Attempted to call function
marked as skipped") nor a Triton launch whose tensors hide in a pointer table. Each backend is
therefore also registered with ``torch.library`` under one schema, the fused-Adam contract
(``zero_kernels.reference``) written positionally, empty lists standing for None::

    zero_kernels::fused_adam_<backend>(Tensor(a!)[] masters, Tensor[] grads, Tensor(b!)[] exp_avgs,
        Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] params16, Tensor coeffs,
        float beta1, float beta2, float eps, float weight_decay, bool adamw, bool maximize,
        Tensor? grad_scale=None, Tensor? found_inf=None) -> ()

The mutated lists are declared (``(a!)``), so functionalization knows what each call writes, and
every operator has a fake (meta) implementation that writes nothing and returns nothing, so
Dynamo and AOTAutograd run them on fake tensors.

C++ kernels (``cpu``, ``cuda``): ``torch.library.custom_op`` over the extension's functions, here,
rather than ``TORCH_LIBRARY_FRAGMENT`` in csrc/. The extension is loaded lazily and under two
module names (the installed ``zero_kernels._C`` or the JIT build), so a C++ registration would
make the operator exist only after that load and twice if both copies were ever loaded; the fake
implementation, the mutation declarations and the Triton operator live in Python anyway, and one
file now states the schema for every backend; the extension's ABI and the wheel build are
unchanged. What this gives up: the operators cannot be called from a Python-free C++ runtime
(AOTInductor packages without Python). The operator's implementation calls the same C++ front end
(argument checks, then the kernel), so ``torch.ops.zero_kernels.fused_adam_cpu`` is exactly
``zero_kernels._ext.fused_adam_cpu``.

[Note: the traced triton op]
The eager Triton path launches one kernel per group over a pointer table (``kernels/adam.py``,
[Note: why a pointer table, not flat buffers]); a tracer sees neither the pointers (fake tensors
have none) nor which tensors the kernel writes. ``zero_kernels::fused_adam_triton`` is a
``torch.library.triton_op`` whose body launches ``fused_adam_tensor_kernel`` once per tensor,
every tensor a kernel argument, through ``wrap_triton``: Inductor sees the launches, and the
block body is the eager kernel's, so the bits are the same (tests/test_compile.py). Under
``TRITON_INTERPRET=1`` (CPU tensors), ``wrap_triton`` returns the interpreted kernel unchanged
(``torch/_library/triton.py``) and cannot be traced, and Inductor cannot generate code for a user
Triton kernel on CPU: the same body is then registered as an opaque ``custom_op`` (traced as one
call, run eagerly by the ``aot_eager`` backend, which is what the CPU tests compile with).
The price of visibility on a GPU: the compiled step launches one kernel per tensor where the
eager step launches one per group. Each launch still streams 28 B/element with 128-bit accesses
(the "per-tensor" CODEGEN_CASES in kernels/adam.py), but thousands of small parameters pay a
launch each; CUDA graphs (``mode="reduce-overhead"``) absorb that. Not measured (no GPU here).

The eager optimizer keeps calling the kernels directly (no dispatcher on the hot path,
bench/bench_host_overhead.py); the operators are what the traced step calls
([Note: the traced step] in ``zero_kernels/_traced_step.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from . import _ext
from .backends import triton_interpret
from .reference import fused_adam_ref

__all__ = ["traceable", "MUTATED"]

MUTATED = ("masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "params16")


def _fake(masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
          max_exp_avg_sqs: list[Tensor], params16: list[Tensor], coeffs: Tensor, beta1: float, beta2: float,
          eps: float, weight_decay: float, adamw: bool, maximize: bool, grad_scale: Optional[Tensor] = None,
          found_inf: Optional[Tensor] = None) -> None:
    """Fake (meta) implementation: the kernels only write their arguments in place."""
    return None


def _cxx(fn: Callable[..., None]) -> Callable[..., None]:
    """The operator body of a C++ backend: the extension function with the empty lists as None."""
    def impl(masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
             max_exp_avg_sqs: list[Tensor], params16: list[Tensor], coeffs: Tensor, beta1: float, beta2: float,
             eps: float, weight_decay: float, adamw: bool, maximize: bool, grad_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None) -> None:
        fn(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or None, params16 or None, coeffs,
           beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw, maximize=maximize,
           grad_scale=grad_scale, found_inf=found_inf)
    impl.__name__ = fn.__name__
    return impl


def _register_cxx(name: str, fn: Callable[..., None], device: str) -> None:
    op = torch.library.custom_op(f"zero_kernels::{name}", _cxx(fn), mutates_args=MUTATED, device_types=device)
    op.register_fake(_fake)


_register_cxx("fused_adam_cpu", _ext.fused_adam_cpu, "cpu")
_register_cxx("fused_adam_cuda", _ext.fused_adam_cuda, "cuda")


def _check_triton_args(masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                       exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], params16: list[Tensor],
                       coeffs: Tensor, beta1: float, beta2: float, eps: float, grad_scale: Optional[Tensor],
                       found_inf: Optional[Tensor]) -> None:
    """The triton operator's argument checks: the C++ front end's (``check_fused_adam_args`` in
    csrc/adam_front.cpp, which the cpu / cuda operators run), for the one operator with no C++ in front
    of its kernel. Without them a short gradient was read past its end and a missing one skipped."""
    fn = "fused_adam_triton"

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise RuntimeError(f"{fn}: {msg}")

    need(0.0 <= beta1 < 1.0, f"beta1 must be in [0, 1), got {beta1}")
    need(0.0 <= beta2 < 1.0, f"beta2 must be in [0, 1), got {beta2}")
    need(eps >= 0.0, f"eps must be >= 0, got {eps}")
    T = len(masters)
    need(coeffs.dtype == torch.float32 and coeffs.dim() == 2 and tuple(coeffs.shape) == (T, 3)
         and coeffs.is_contiguous(), f"coeffs must be a contiguous float32 [T, 3] = [{T}, 3] tensor, got "
         f"{coeffs.dtype} {list(coeffs.shape)}")
    if T == 0:
        need(not (grads or exp_avgs or exp_avg_sqs or max_exp_avg_sqs or params16),
             "masters is empty but the other lists are not")
        return
    dev0 = masters[0].device
    need(coeffs.device == dev0, f"coeffs is on {coeffs.device} but the tensors are on {dev0}")
    lists = [("masters", masters), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)]
    lists += [(w, ts) for w, ts in (("max_exp_avg_sqs", max_exp_avg_sqs), ("params16", params16)) if ts]
    for what, ts in lists:
        need(len(ts) == T, f"{what} has {len(ts)} tensors but masters has {T} (one per parameter)")
        for i, t in enumerate(ts):
            need(t.device == dev0, f"{what}[{i}] is on {t.device} but masters[0] is on {dev0}; all tensors "
                 "must be on one device")
            need(t.is_contiguous(), f"{what}[{i}] is not contiguous (strides {list(t.stride())}); pass contiguous "
                 "tensors (e.g. .contiguous(), then copy the result back)")
            need(t.numel() == masters[i].numel(), f"{what}[{i}] has {t.numel()} elements but masters[{i}] has "
                 f"{masters[i].numel()}")
    allowed = {"grads": (torch.float32, torch.bfloat16, torch.float16), "params16": (torch.bfloat16, torch.float16)}
    for what, ts in lists:
        want = ts[0].dtype if what in allowed else torch.float32
        names = [str(d).replace("torch.", "") for d in allowed.get(what, (torch.float32,))]
        need(want in allowed.get(what, (torch.float32,)),
             f"{what} must be {', '.join(names[:-1])}{' or ' if len(names) > 1 else ''}{names[-1]}, got {want}")
        for i, t in enumerate(ts):
            need(t.dtype == want, f"{what}[{i}] has dtype {t.dtype}; expected {want}")
    for what, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is not None:
            need(t.numel() == 1 and t.dtype == torch.float32 and t.device == dev0,
                 f"{what} must be a 1-element float32 tensor on {dev0}, got {t.dtype} {list(t.shape)} on {t.device}")


def _register_triton() -> None:
    try:
        from .kernels.adam import fused_adam_per_tensor
    except ImportError:   # triton not installed: the backend is unavailable (backends.why_unavailable)
        return

    def fused_adam_triton(masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                          exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor], params16: list[Tensor],
                          coeffs: Tensor, beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool,
                          maximize: bool, grad_scale: Optional[Tensor] = None,
                          found_inf: Optional[Tensor] = None) -> None:
        _check_triton_args(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs, beta1, beta2,
                           eps, grad_scale, found_inf)
        fused_adam_per_tensor(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs, beta1,
                              beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf)

    if triton_interpret():   # [Note: the traced triton op]
        op = torch.library.custom_op("zero_kernels::fused_adam_triton", fused_adam_triton, mutates_args=MUTATED)
        op.register_fake(_fake)
    else:
        torch.library.triton_op("zero_kernels::fused_adam_triton", fused_adam_triton, mutates_args=MUTATED)


_register_triton()


def _contract(op: Callable[..., None]) -> Callable[..., None]:
    """Operator ``op`` behind the signature of :func:`zero_kernels.reference.fused_adam_ref`."""
    def call(masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
             max_exp_avg_sqs: list[Tensor] | None, params16: list[Tensor] | None, coeffs: Tensor, *,
             beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool, maximize: bool,
             grad_scale: Tensor | None = None, found_inf: Tensor | None = None) -> None:
        op(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs or [], params16 or [], coeffs, beta1, beta2,
           eps, weight_decay, adamw, maximize, grad_scale, found_inf)
    return call


# Backend name -> the contract through its operator ("reference" is pure torch: traceable as it is).
_TRACEABLE = {"reference": fused_adam_ref, "cpu": _contract(torch.ops.zero_kernels.fused_adam_cpu),
              "cuda": _contract(torch.ops.zero_kernels.fused_adam_cuda)}
if hasattr(torch.ops.zero_kernels, "fused_adam_triton"):
    _TRACEABLE["triton"] = _contract(torch.ops.zero_kernels.fused_adam_triton)


def traceable(backend: str) -> Callable[..., None]:
    """Backend ``backend`` with the contract's signature, as an operator call a tracer records
    (what the traced step calls; the eager step calls ``backends.get(backend)``)."""
    return _TRACEABLE[backend]
