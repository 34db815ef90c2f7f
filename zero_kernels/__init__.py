"""zero_kernels: fused mixed-precision Adam (Triton / C++ / CUDA / reference) and ZeRO-1/2/3.

    import zero_kernels as zk
    opt = zk.FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)   # was torch.optim.AdamW
    zopt = zk.ZeroAdamW(model, stage=2, lr=3e-4)                        # ZeRO over torch.distributed

Names are loaded on first use, so ``python -m zero_kernels.plan`` does not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "FusedAdam": "optim", "FusedAdamW": "optim",
    "ZeroAdam": "zero", "ZeroAdamW": "zero",
    "fused_adam_ref": "reference", "compute_coeffs": "reference", "bytes_per_element": "reference",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from .optim import FusedAdam, FusedAdamW
    from .reference import bytes_per_element, compute_coeffs, fused_adam_ref
    from .zero import ZeroAdam, ZeroAdamW


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'zero_kernels' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
