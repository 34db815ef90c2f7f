"""The per-bucket fused step and the global gradient norm, as functions over buckets.

[Note: the ZeRO step]
At ``step()`` (after backward):
  stage 1: each bucket's full gradient is reduce-scattered (average, ``reduce_dtype``) into this
           rank's slice ([Note: stage-1 reduction] in reduce.py); stages 2-3: the hooks already
           launched those reduce-scatters during backward ([Note: stage-2 gradient flow] in
           hooks.py) and step() only waits.
  then, bucket by bucket in order: wait for its reduced slice, run the fused-Adam contract on the
  slice (:func:`step_bucket`: fp32 master, exp_avg, exp_avg_sq; grad_scale = the clip coefficient
  over the loss scale, so clipping and unscaling cost no extra pass), write the 16-bit parameter
  slice (or update fp32 parameters in place: their slice *is* the master), and launch that
  bucket's all-gather (gather.py), which writes straight into the module's parameters (they are
  views of the bucket). Later buckets' steps overlap earlier buckets' all-gathers.

Per-parameter semantics follow torch.optim.AdamW: a parameter whose gradient is None on every rank
is not updated and its step count does not advance ("had a gradient" is all-reduced with MAX, so
a parameter used on one rank only is updated everywhere). The slice of a bucket is therefore split
into runs of parameter pieces with the same step count (:func:`param_runs`; normally one run).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..hparams import as_float, scalar_lr
from ..reference import compute_coeffs, fused_adam_ref
from . import collectives as C
from .buckets import FlatBucket
from .coded import block_segments, step_coded_slice, step_decoded_slice

__all__ = ["param_runs", "step_bucket", "global_norm"]


def param_runs(b: FlatBucket, active: Tensor, steps: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, step) ranges of b's slice: consecutive active pieces with one step count."""
    runs: list[list[int]] = []
    for pc in b.pieces:
        if not active[pc.param]:
            continue
        st = steps[pc.param]
        if runs and runs[-1][1] == pc.start and runs[-1][2] == st:
            runs[-1][1] = pc.start + pc.numel
        else:
            runs.append([pc.start, pc.start + pc.numel, st])
    return [tuple(r) for r in runs]


def step_bucket(b: FlatBucket, group: dict, active: Tensor, steps: Sequence[int], scale: Tensor,
                fused: Callable, adamw: bool, device: torch.device, coded_backend: str | None = None) -> None:
    """One fused-Adam call over the active runs of b's slice (hyper-parameters of ``group``); coded
    states: [Note: coded ZeRO states] in coded.py (``coded_backend`` runs the whole-slice case)."""
    runs = param_runs(b, active, steps)
    if not runs:
        return
    if b.optim.coded or b.remainder is not None:
        data_end = b.pieces[-1].start + b.pieces[-1].numel
        if len(runs) == 1 and runs[0][:2] == (0, data_end):        # every piece active, one step count
            step_coded_slice(b, 0, data_end, group, runs[0][2], scale, coded_backend, adamw)
            return
        # blocks whose pieces all step with one count go to the coded kernel; the others (pieces without a step,
        # or another count, in the block) through fp32 ([Note: coded ZeRO states]); an 8-bit exp_avg takes its
        # cap there too, through the contract's own definition ([Note: the bound on 8-bit m] in codecs.py)
        dec = functools.partial(fused_adam_ref, bound_m=True) if b.optim.exp_avg.dtype == torch.uint8 \
            else fused
        for lo, hi, st in block_segments(b.pieces, runs, data_end):
            if st is not None:
                step_coded_slice(b, lo, hi, group, st, scale, coded_backend, adamw)
                continue
            sub = [(max(a, lo) - lo, min(e, hi) - lo, s) for a, e, s in runs if a < hi and e > lo]
            if not sub:                                 # only pieces without a step: nothing changes
                continue
            step_decoded_slice(b, lambda m, ea, eas, p16, sub=sub, lo=lo, hi=hi: _fused_runs(
                sub, group, m, b.reduce.grad_slice[lo:hi], ea, eas, None, p16, scale, dec, adamw, device),
                max(s for _, _, s in sub), sub, lo, hi)
        return
    st = b.optim
    _fused_runs(runs, group, b.master, b.reduce.grad_slice, st.exp_avg, st.exp_avg_sq,
                st.max_exp_avg_sq if group["amsgrad"] else None, None if b.master_is_param else b.owned_params,
                scale, fused, adamw, device)


def _fused_runs(runs, group: dict, master: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                vmax: Tensor | None, p16: Tensor | None, scale: Tensor, fused: Callable, adamw: bool,
                device: torch.device) -> None:
    """The fp32 fused step of the fused-Adam contract on the runs (start, end, step) of one slice."""
    beta1, beta2 = (as_float(x) for x in group["betas"])
    sl = [slice(s, e) for s, e, _ in runs]
    counts = torch.tensor([s for _, _, s in runs], dtype=torch.float64)
    coeffs = compute_coeffs(counts, scalar_lr(group["lr"]), beta1, beta2, group["weight_decay"], adamw,
                            device=device)
    fused([master[x] for x in sl], [grad[x] for x in sl], [exp_avg[x] for x in sl], [exp_avg_sq[x] for x in sl],
          None if vmax is None else [vmax[x] for x in sl], None if p16 is None else [p16[x] for x in sl], coeffs,
          beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], adamw=adamw,
          maximize=group["maximize"], grad_scale=scale)


def global_norm(buckets: Sequence[FlatBucket], rank: int, norm_type: float, process_group,
                device: torch.device) -> Tensor:
    """The norm of the whole reduced gradient: every rank's slices, tied parameters once, no
    padding (one all-reduce; fp32, a 0-d tensor on ``device``)."""
    acc = torch.zeros((), dtype=torch.float32, device=device)
    for b in buckets:
        if b.reduce.grad_slice is None:
            continue
        s, e = b.spec.data_bounds(rank)
        g = b.reduce.grad_slice[: e - s].float()
        if g.numel() == 0:
            continue
        acc = torch.maximum(acc, g.abs().max()) if math.isinf(norm_type) else acc + g.abs().pow(norm_type).sum()
    if math.isinf(norm_type):
        C.all_reduce_tensor(acc, op=dist.ReduceOp.MAX, group=process_group)
        return acc
    C.all_reduce_tensor(acc, op=dist.ReduceOp.SUM, group=process_group)
    return acc.pow(1.0 / norm_type)
