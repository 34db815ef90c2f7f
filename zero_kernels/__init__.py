"""zero_kernels: fused mixed-precision Adam (Triton / C++ / CUDA / reference) and ZeRO-1/2/3.

    import zero_kernels as zk
    opt = zk.FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    zopt = zk.ZeroAdamW(model, stage=2, lr=3e-4)
"""
from __future__ import annotations

from .optim import FusedAdam, FusedAdamW
from .reference import bytes_per_element, compute_coeffs, fused_adam_ref

__version__ = "0.1.0"
__all__ = ["FusedAdam", "FusedAdamW", "ZeroAdam", "ZeroAdamW", "fused_adam_ref", "compute_coeffs",
           "bytes_per_element"]


def __getattr__(name: str):
    # The ZeRO layer imports torch.distributed; load it only when asked for.
    if name in ("ZeroAdam", "ZeroAdamW"):
        from . import zero
        return getattr(zero, name)
    raise AttributeError(f"module 'zero_kernels' has no attribute {name!r}")
