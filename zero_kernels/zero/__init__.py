"""ZeRO stage 1/2/3 for PyTorch: flat buckets, overlapped reduce-scatter, fused Adam on each rank's slice.

One concept per file (after FSDP2's ``_fully_shard/``); the ``[Note: ...]`` blocks define the vocabulary:
    optimizer.py    ZeroAdamW / ZeroAdam: the facade over one strategy per stage
    config.py       ZeroConfig, validated before the model is touched ([Note: construction order])
    params.py       reading the model: names, tied parameters, param groups
    agreement.py    every rank builds the same optimizer ([Note: rank agreement])
    mesh.py         shard and replicate groups of a 2-D mesh ([Note: hybrid sharding])
    qwz.py, qgz.py  ZeRO++ int8 parameter all-gather / gradient reduce-scatter ([Note: quantized ...])
    strategy.py     stages 1 and 2 ([Note: stage strategies])
    buckets.py      FlatBucket = storage + OptimState + ReduceState ([Note: bucket objects])
    flat.py         flatten / unflatten dispatch: Triton or torch ([Note: views vs copies])
    reduce.py       the stage-1 reducer ([Note: stage-1 reduction])
    hooks.py        the stage-2/3 reducer: gradient hooks ([Note: stage-2 gradient flow])
    grad_guard.py   what p.grad holds: ShardedGrad, torch's clip raises ([Note: gradient placeholders])
    gather.py       stages 1-2 parameter all-gather ([Note: overlapped parameter all-gather])
    step.py         per-bucket fused step and global norm ([Note: the ZeRO step])
    coded.py        low-precision states of a slice: codes, remainders, their step ([Note: coded ZeRO states])
    scaling.py      loss scaling, GradScaler, non-finite skips ([Note: non-finite gradients])
    state_dict.py   shard and full-model state dicts ([Note: shard state dict])
    report.py       memory_report()
    collectives.py  stateless reduce-scatter / all-gather returning NamedTuples ([Note: gloo
                    collectives], [Note: communication device])
    timeouts.py     bounded waits, the timeout decorator ([Note: collective timeouts])
    wire.py         bytes each collective sends, per link class: comm_report() ([Note: bytes on the wire])
    stage3.py       the stage-3 strategy and reducer ([Note: stage-3 hooks])
    units.py        stage-3 units ([Note: stage-3 units])
    unit_bucket.py  stage-3 storage and the gather cache ([Note: stage-3 storage])
    unit_hooks.py   stage-3 forward/backward module hooks, prefetch
    unit_hold.py    units kept for a backward that may not come ([Note: forward without backward])
    unit_saved.py   backward gathers a unit its saved tensors need ([Note: tensors saved from a unit])
    unit_outside.py the first forward finds parameters used outside their unit ([Note: parameters used
                    outside their unit])
    relayout.py     flat slices <-> FSDP2's per-parameter Shard(0) chunks ([Note: dim-0 chunks])
    ../layout.py      the bucket layout as plain data ([Note: bucket], [Note: slice], [Note: padding])
    ../hparams.py     the hyper-parameter validator shared with FusedAdam ([Note: hyper-parameter rules])
    ../checkpoint.py  sharded resharding checkpoints + offline CLI ([Note: checkpoint format])
    ../dcp.py         FSDP2-form state dicts for torch.distributed.checkpoint ([Note: DCP interop])
"""
from ..layout import Layout, build_layout
from .config import ZeroConfig
from .grad_guard import ShardedGrad, ShardedGradError
from .optimizer import ZeroAdam, ZeroAdamW

__all__ = ["ZeroAdamW", "ZeroAdam", "ZeroConfig", "Layout", "build_layout", "ShardedGrad", "ShardedGradError"]
