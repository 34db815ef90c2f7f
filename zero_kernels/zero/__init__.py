"""ZeRO stage 1/2 for PyTorch: flat buckets, overlapped reduce-scatter, fused Adam on each rank's slice.

    layout.py       the bucket layout as plain data ([Note: bucket], [Note: slice], [Note: padding])
    buckets.py      FlatBucket: one bucket's buffers on one rank
    flat.py         flatten / unflatten dispatch: Triton or torch ([Note: views vs copies])
    collectives.py  stateless reduce-scatter / all-gather wrappers returning NamedTuples
    hooks.py        stage-2 gradient hooks ([Note: stage-2 gradient flow])
    optimizer.py    ZeroAdamW / ZeroAdam ([Note: the ZeRO step])
"""
from .layout import Layout, build_layout
from .optimizer import ZeroAdam, ZeroAdamW

__all__ = ["ZeroAdamW", "ZeroAdam", "Layout", "build_layout"]
