"""ZeRO stage 1/2/3 for PyTorch: flat buckets, overlapped reduce-scatter, fused Adam on each rank's slice.

    layout.py       the bucket layout as plain data ([Note: bucket], [Note: slice], [Note: padding])
    buckets.py      FlatBucket: one bucket's buffers on one rank
    flat.py         flatten / unflatten dispatch: Triton or torch ([Note: views vs copies])
    collectives.py  stateless reduce-scatter / all-gather wrappers returning NamedTuples
    hooks.py        stage-2 gradient hooks ([Note: stage-2 gradient flow])
    stage3.py       ZeRO-3: units, just-in-time gather/free, prefetch, backward hooks
                    ([Note: stage-3 units], [Note: stage-3 storage], [Note: stage-3 hooks])
    optimizer.py    ZeroAdamW / ZeroAdam ([Note: the ZeRO step])
    scaling.py      loss scaling, GradScaler, non-finite skips ([Note: non-finite gradients])
    ../checkpoint.py  sharded resharding checkpoints + offline CLI ([Note: checkpoint format])
"""
from .layout import Layout, build_layout
from .optimizer import ZeroAdam, ZeroAdamW

__all__ = ["ZeroAdamW", "ZeroAdam", "Layout", "build_layout"]
