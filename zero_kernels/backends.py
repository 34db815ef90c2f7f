"""Backend registry for the fused-Adam contract (see [Note: the fused-Adam contract] in
:mod:`zero_kernels.reference`).

``resolve(name, device)`` returns the name of the backend that will run and ``get(name)`` its
function, whose signature is exactly that of :func:`zero_kernels.reference.fused_adam_ref`.

    "reference"  pure torch, any device (the oracle and the last-resort fallback)
    "triton"     kernels/adam.py; CUDA tensors, or CPU tensors when TRITON_INTERPRET=1
    "cpu"        csrc/ C++ kernel (AVX2/AVX-512 with a portable fallback), CPU tensors
    "cuda"       csrc/ CUDA multi-tensor kernel, CUDA tensors
    "auto"       cuda tensors: triton > cuda > reference; cpu tensors: cpu > reference
"""
from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch

from .reference import fused_adam_ref

BACKENDS = ("auto", "reference", "triton", "cpu", "cuda")


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def why_unavailable(name: str, device: torch.device) -> str | None:
    """None when backend ``name`` can run on ``device``, else the reason (for error messages)."""
    if name == "reference":
        return None
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install triton)"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpret():
            return None
        return (f"triton needs CUDA tensors (got {device.type}); on CPU set TRITON_INTERPRET=1 "
                "before importing triton to run it in the interpreter")
    if name == "cpu":
        if device.type != "cpu":
            return f"the cpu backend needs CPU tensors (got {device.type})"
        try:
            from . import _ext
        except ImportError as e:  # pragma: no cover - a broken install
            return f"zero_kernels._ext cannot be imported: {e}"
        return None if _ext.cpu_module() is not None else f"the C++ extension is unavailable: {_ext.load_error()}"
    if name == "cuda":
        if device.type != "cuda":
            return f"the cuda backend needs CUDA tensors (got {device.type})"
        try:
            from . import _ext
        except ImportError as e:  # pragma: no cover
            return f"zero_kernels._ext cannot be imported: {e}"
        mod = _ext.cpu_module()
        if mod is None or not hasattr(mod, "fused_adam_cuda"):
            return "zero_kernels was built without CUDA (torch without CUDA or nvcc missing at install)"
        return None
    return f"unknown backend {name!r}; choose one of {BACKENDS}"


def resolve(name: str, device: torch.device) -> str:
    """The concrete backend for ``name`` on ``device``; raises ValueError naming the reason."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not one of {BACKENDS}")
    if name != "auto":
        why = why_unavailable(name, device)
        if why is not None:
            raise ValueError(f"backend={name!r} is unavailable: {why}. Use backend='auto' or 'reference'.")
        return name
    order = ("triton", "cuda") if device.type == "cuda" else ("cpu",)
    for cand in order:
        if why_unavailable(cand, device) is None:
            return cand
    if device.type == "cpu":
        try:
            from . import _ext
            _ext.warn_fallback_once()
        except ImportError:  # pragma: no cover
            pass
    return "reference"


def get(name: str) -> Callable[..., None]:
    if name == "reference":
        return fused_adam_ref
    if name == "triton":
        from .kernels.adam import fused_adam_triton
        return fused_adam_triton
    if name == "cpu":
        from . import _ext
        return _ext.fused_adam_cpu
    if name == "cuda":
        from . import _ext
        return _ext.fused_adam_cuda
    raise ValueError(f"no concrete backend {name!r}")
