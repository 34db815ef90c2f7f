"""ZeroConfig: every constructor argument of ZeroAdamW except the model and the hyper-parameters,
validated once, on every rank, before the model is touched.

[Note: construction order]
ZeroAdamW's constructor (1) builds a :class:`ZeroConfig` (raises on a bad argument) and validates
the hyper-parameters (zero_kernels/hparams.py); (2) reads the model without changing it (params.py:
names, tied parameters, groups); (3) agrees with every rank of the process group (agreement.py: one
all-gather of a signature holding the parameter list, the config and the hyper-parameters; an
error on any rank raises on every rank); (4) builds the layout; only then (5) binds: parameters
become views of the flat buckets and hooks are registered. A constructor that raises therefore
leaves the model bit-identical and hook-free.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from .. import backends
from ..codecs import BLOCK, BLOCKWISE
from ..hparams import StateFormat, validate_state_format
from .scaling import make_scaler
from .timeouts import as_timedelta

__all__ = ["ZeroConfig"]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STAGE3_ONLY = ("prefetch", "reshard_after_forward", "wrap", "gather_cache")


def _check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {v!r}")


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 2
    bucket_size: int = 25 * 2**20
    overlap_comm: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    backend: str = "auto"
    alignment_bytes: int = 16
    loss_scale: Any = None
    growth_interval: int = 2000
    timeout: datetime.timedelta | None = None
    prefetch: int = 1
    reshard_after_forward: bool = True
    wrap: Any = None
    gather_cache: bool = True
    overlap_param_gather: bool = False
    # ZeRO++ qwZ ([Note: quantized weight all-gather], qwz.py): every parameter all-gather sends int8 codes.
    # Stages 1-2: between steps the model then holds int8-quantized copies of the other ranks' slices
    # (masters, state dicts and checkpoints stay exact); zopt.sync_exact_params() writes exact ones.
    quantize_weights: bool = False
    quantize_grads: bool = False        # ZeRO++ qgZ ([Note: quantized gradient reduce-scatter], qgz.py)
    exp_avg_dtype: torch.dtype = torch.float32      # coded states ([Note: coded ZeRO states], coded.py)
    exp_avg_sq_dtype: torch.dtype = torch.float32
    store_param_remainders: bool = False
    # DDP's broadcast_buffers: every rank takes rank 0's buffers (BatchNorm running statistics) at the end of
    # each step(), as DDP does before each forward; else each rank's buffers follow its own batches.
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        if self.stage not in (1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        if self.stage == 3 and (not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool)
                                or self.prefetch < 0):
            raise ValueError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        _check_bool("gather_cache", self.gather_cache)
        _check_bool("overlap_param_gather", self.overlap_param_gather)
        _check_bool("overlap_comm", self.overlap_comm)
        _check_bool("reshard_after_forward", self.reshard_after_forward)
        _check_bool("quantize_weights", self.quantize_weights)
        _check_bool("quantize_grads", self.quantize_grads)
        _check_bool("broadcast_buffers", self.broadcast_buffers)
        if self.overlap_param_gather and self.stage == 3:
            raise ValueError("overlap_param_gather is for stages 1 and 2: stage 3 gathers parameters in "
                             "forward already (see prefetch=)")
        if not isinstance(self.bucket_size, int) or isinstance(self.bucket_size, bool) or self.bucket_size <= 0:
            raise ValueError(f"bucket_size must be a positive int (bytes), got {self.bucket_size!r}")
        if self.param_dtype is not None and self.param_dtype not in FLOAT_DTYPES:
            raise ValueError(f"param_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {self.param_dtype}")
        if self.reduce_dtype not in FLOAT_DTYPES:
            raise ValueError(f"reduce_dtype must be a float dtype, got {self.reduce_dtype}")
        a = self.alignment_bytes
        if not isinstance(a, int) or a < 16 or a & (a - 1):
            raise ValueError(f"alignment_bytes must be a power of two >= 16, got {a!r}")
        if self.backend not in backends.BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {backends.BACKENDS}")
        if not isinstance(self.growth_interval, int) or isinstance(self.growth_interval, bool) \
                or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive int, got {self.growth_interval!r}")
        make_scaler(self.loss_scale, self.growth_interval)       # raises on a bad loss_scale
        validate_state_format(self.exp_avg_dtype, self.exp_avg_sq_dtype, self.store_param_remainders, 0)
        if self.store_param_remainders and self.param_dtype not in (None, torch.bfloat16):
            raise ValueError(f"store_param_remainders=True keeps the fp32 master as the bf16 parameter plus an int16 "
                             f"remainder: it needs bf16 parameters, got param_dtype={self.param_dtype}; pass "
                             "param_dtype=torch.bfloat16 (or drop store_param_remainders)")
        object.__setattr__(self, "timeout", as_timedelta(self.timeout))
        _check_wrap(self.wrap)

    @classmethod
    def from_options(cls, stage: Any, options: dict[str, Any]) -> "ZeroConfig":
        """The config of ``ZeroAdamW(model, stage=stage, **options)``: an unknown option raises TypeError
        naming it (not the dataclass's), an option of stage 3's gathers set at stage 1 or 2 ValueError."""
        known = {f.name for f in fields(cls)} - {"stage"}
        unknown = sorted(set(options) - known)
        if "min_8bit_size" in unknown:
            raise TypeError("ZeroAdamW has no min_8bit_size: it codes whole bucket slices in 256-element blocks "
                            "that never straddle a rank's shard, so every parameter takes exp_avg_dtype / "
                            "exp_avg_sq_dtype (FusedAdam/FusedAdamW keep tensors below min_8bit_size in fp32); "
                            "drop the argument")
        if unknown:
            raise TypeError(f"ZeroAdamW got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; its "
                            f"options are {', '.join(sorted(known))} (and lr, betas, eps, weight_decay, amsgrad, "
                            "maximize, param_groups, process_group, mesh)")
        cfg = cls(stage=stage, **options)
        if cfg.stage != 3:
            defaults = cls()
            set3 = [k for k in _STAGE3_ONLY if k in options and getattr(cfg, k) != getattr(defaults, k)]
            if set3:
                raise ValueError(f"{', '.join(k + '=' for k in set3)} configure stage 3's parameter gathers; "
                                 f"stage {cfg.stage} keeps whole parameters on every rank, so they would do "
                                 "nothing: drop them, or use stage=3")
        return cfg

    @property
    def state_format(self) -> StateFormat:
        """The optimizer-state format of every bucket slice ([Note: coded ZeRO states] in coded.py)."""
        return StateFormat(self.exp_avg_dtype, self.exp_avg_sq_dtype, self.store_param_remainders, 0)

    @property
    def layout_alignment(self) -> int:
        """alignment_bytes of the bucket layout: with a blockwise moment format every slice must hold whole
        256-element quantization blocks, at every working dtype ([Note: coded ZeRO states])."""
        blockwise = {self.exp_avg_dtype, self.exp_avg_sq_dtype} & set(BLOCKWISE)
        return max(self.alignment_bytes, BLOCK * 4) if blockwise else self.alignment_bytes

    def agreement_key(self) -> dict[str, Any]:
        """What every rank must agree on, by option name (plain data for the cross-rank signature): what decides
        the layout, the collectives' order and the numbers (a loss scale differing by rank unscaled each rank's
        slice by its own scale, silently). ``timeout``: whether it is set (ranks without it skip the join
        barrier). Not compared: prefetch, overlap_comm, overlap_param_gather, backend, gather_cache (same
        numbers and collectives either way) and the value of a callable ``wrap``."""
        scale = self.loss_scale
        return {"stage": self.stage, "bucket_size": self.bucket_size, "param_dtype": str(self.param_dtype),
                "reduce_dtype": str(self.reduce_dtype), "alignment_bytes": self.alignment_bytes,
                "exp_avg_dtype": str(self.exp_avg_dtype), "exp_avg_sq_dtype": str(self.exp_avg_sq_dtype),
                "store_param_remainders": self.store_param_remainders, "quantize_weights": self.quantize_weights,
                "quantize_grads": self.quantize_grads,
                "loss_scale": scale if scale is None or isinstance(scale, (str, int, float)) else type(scale).__name__,
                "growth_interval": self.growth_interval if scale == "dynamic" else None,
                "reshard_after_forward": self.reshard_after_forward if self.stage == 3 else None,
                "wrap": _wrap_key(self.wrap) if self.stage == 3 else None,
                "timeout set": self.timeout is not None}


def _wrap_key(wrap) -> Any:
    if wrap is None:
        return None
    if callable(wrap) and not isinstance(wrap, (list, tuple, set)):
        return "a callable"
    return sorted(f"{c.__module__}.{c.__qualname__}" for c in wrap)


def _check_wrap(wrap) -> None:
    if wrap is None or callable(wrap):
        return
    if isinstance(wrap, (list, tuple, set)) and all(isinstance(c, type) and issubclass(c, nn.Module)
                                                    for c in wrap):
        return
    raise TypeError(f"wrap must be None, a callable module -> bool or a list of nn.Module classes, got {wrap!r}")
