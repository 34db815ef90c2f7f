"""State dicts of a ZeroAdamW: this rank's shard (``state_dict`` / ``load_state_dict``) and the
full model (``full_model_state_dict``). Resharding checkpoints are zero_kernels/checkpoint.py.

[Note: shard state dict]
A shard holds, per bucket, this rank's slices as stored (``FlatBucket.state_tensors``: fp32 master,
exp_avg, exp_avg_sq, and max_exp_avg_sq with amsgrad; with coded states the codes and block scales,
and ``master_remainder`` + ``params16``, the bf16 slice it completes: [Note: coded ZeRO states]),
per parameter its step count, the groups' hyper-parameters, the layout (plain data) with its
fingerprint, and (added by ZeroAdamW.state_dict) ``scaling``: the loss scaler's state and the
skipped-step count (``StepScaling.state_dict``, also what checkpoints keep), so that an fp16 run with
``loss_scale="dynamic"`` resumes with its scale. It loads only into the same rank of the same layout,
bit for bit; a shard of another state format converts (decoded to fp32, encoded into this optimizer's
format, with a warning).
Everything is checked (and the restored hyper-parameters validated, hparams.py) before anything
changes.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import warnings

import torch.distributed as dist
from torch import Tensor, nn

from .. import codecs
from ..hparams import validate_hparams
from ..state_keys import keyed_state
from .buckets import FlatBucket
from . import collectives as C
from .coded import decode_saved, saved_problem
from .mesh import ZeroMesh, all_reduce_everywhere, fingerprint, same_everywhere
from ..layout import Layout

__all__ = ["SHARD_FORMAT", "SHARD_VERSION", "shard_state_dict", "check_shard", "apply_shard", "agree_to_load",
           "shard_identity",
           "full_model_state_dict"]

SHARD_FORMAT = "zero_kernels.zero/shard"
SHARD_VERSION = 1


def shard_state_dict(stage: int, rank: int, world: int, layout: Layout, steps: Sequence[int],
                     param_groups: list[dict], buckets: Sequence[FlatBucket]) -> dict[str, Any]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
    state = [_stored(b) for b in buckets]
    sd = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "stage": stage, "rank": rank, "world_size": world,
          "layout_fingerprint": layout.fingerprint(), "layout": layout.to_dict(), "steps": list(steps),
          "param_groups": groups, "state": state}
    if codecs.holds_u8_moments(state):
        sd["u8_code"] = codecs.U8_CODE          # checked by check_shard before any code is decoded
    return sd


def _stored(b: FlatBucket) -> dict[str, Tensor]:
    d = {k: t.detach().clone() for k, t in b.state_tensors().items()}
    if b.remainder is not None:
        d["params16"] = b.owned_params.detach().clone()     # the bf16 half of the master
    return d


def check_shard(sd: dict[str, Any], layout: Layout, world: int, rank: int, buckets: Sequence[FlatBucket],
                param_groups: list[dict]) -> None:
    """Raise ValueError when ``sd`` cannot be loaded here (nothing has changed yet)."""
    if not isinstance(sd, dict) or sd.get("format") != SHARD_FORMAT:
        raise ValueError("not a ZeroAdamW shard (missing format tag); a torch.optim state dict cannot "
                         "be loaded here: use full_model_state_dict()/checkpoint tools")
    if sd.get("version") != SHARD_VERSION:
        raise ValueError(f"shard format version {sd.get('version')} is not supported "
                         f"(this build reads version {SHARD_VERSION})")
    fp, mine = sd.get("layout_fingerprint"), layout.fingerprint()
    if fp != mine or sd.get("world_size") != world:
        raise ValueError(
            f"this shard was saved with layout {fp} (world size {sd.get('world_size')}, rank {sd.get('rank')}) "
            f"but this optimizer's layout is {mine} (world size {world}): the model, param groups, "
            "bucket_size, param_dtype and world size must match, and so must whether the moments are blockwise "
            "(uint8 / float8_e4m3fn moments pad each bucket to world_size x 256 elements, so switching to or from "
            "them changes the layout); to change any of them, save_checkpoint / load_checkpoint (it reshards and "
            "converts state formats)")
    if sd.get("rank") != rank:
        raise ValueError(f"this shard belongs to rank {sd.get('rank')}, but this is rank {rank}: load each "
                         "rank's own shard")
    if codecs.holds_u8_moments(st for st in sd["state"] if isinstance(st, dict)):
        why = codecs.u8_code_problem(sd.get("u8_code"))
        if why is not None:
            raise ValueError(f"this shard: {why}. Nothing was loaded.")
    for b, st in zip(buckets, sd["state"]):
        if not _same_format(b, st):
            why = saved_problem(st, b.spec.shard_numel, b.amsgrad)
            if why is not None:
                raise ValueError(f"shard bucket {b.index}: {why}. Nothing was loaded.")
    for gi, (g, saved) in enumerate(zip(param_groups, sd["param_groups"])):
        h = {**g, **saved}
        validate_hparams(h["lr"], h["betas"], h["eps"], h["weight_decay"], where=f" in param_groups[{gi}]")


def apply_shard(sd: dict[str, Any], buckets: Sequence[FlatBucket], param_groups: list[dict]) -> list[int]:
    """Copy a checked shard into the buckets and groups (converting another state format); returns the
    step counts."""
    converted = 0
    for b, st in zip(buckets, sd["state"]):
        if not _same_format(b, st):
            b.store_fp32_states(decode_saved(st, b.amsgrad), max(sd["steps"], default=0))
            converted += 1
            continue
        for k, t in b.state_tensors().items():
            t.copy_(st[k])
        if b.remainder is not None:
            b.owned_params.copy_(st["params16"])
        elif not b.master_is_param:
            b.owned_params.copy_(b.master)
    if converted:
        warnings.warn(f"load_state_dict converted {converted} bucket slice(s) saved in another optimizer-state format "
                      f"to this optimizer's ({buckets[0].fmt}): decoded to fp32 and encoded with zero_kernels.codecs "
                      "([Note: coded ZeRO states])", UserWarning, stacklevel=3)
    for g, saved in zip(param_groups, sd["param_groups"]):
        for k, v in saved.items():
            g[k] = tuple(v) if k == "betas" else v
    return list(sd["steps"])


def _same_format(b: FlatBucket, st: dict[str, Any]) -> bool:
    """``st`` holds exactly b's stored tensors (keys, dtypes, shapes): it loads by copying, bit for bit."""
    mine = b.state_tensors()
    want = set(mine) | ({"params16"} if b.remainder is not None else set())
    return set(st) == want and all(isinstance(st[k], Tensor) and st[k].dtype == t.dtype and st[k].shape == t.shape
                                   for k, t in mine.items())


def full_model_state_dict(buckets: Sequence[FlatBucket], module: nn.Module,
                          full_flat: Callable[[FlatBucket], Tensor]) -> dict[str, Tensor]:
    """Trainable parameters as their fp32 masters (tied names each point at the same values),
    frozen parameters and buffers as the module holds them."""
    full: dict[str, Tensor] = {}
    for b in buckets:
        flat = full_flat(b)
        for ps in b.param_specs:
            full[ps.name] = flat[ps.offset:ps.offset + ps.numel].view(ps.shape).clone()
    # joined by parameter identity, not by name ([Note: state-dict keys]): wrappers rename keys
    return {k: full[ps.name] if ps is not None else v.detach().clone() for k, ps, v in keyed_state(module, buckets)}


def shard_identity(sd: dict[str, Any]) -> int:
    """What every rank's shard of one save has in common (the step counts, group hyper-parameters and loss
    scaler state): its fingerprint, compared across ranks by ``agree_to_load``."""
    return fingerprint([sd.get("steps"), sd.get("param_groups"), sd.get("scaling")])


def agree_to_load(error: Exception | None, mesh: ZeroMesh, identity: int = 0) -> None:
    """Collective (every rank of the mesh, bounded by the enclosing timeout): raise on every rank when the shard
    check failed on any, before any rank applies its shard. A rank given a wrong shard (every rank loading rank
    0's file) used to fail alone while the others applied theirs and then waited in the parameter all-gather
    until the timeout, with different states on different ranks. ``identity`` (``shard_identity``) must agree
    too: shards of different saves (another step) were loaded silently, each rank its own step counts."""
    flag = C.flag_tensor([0 if error is None else 1], mesh.shard_group)
    all_reduce_everywhere(flag, dist.ReduceOp.MAX, mesh)
    if error is not None:
        raise error
    if int(flag.item()):
        raise ValueError("load_state_dict failed on another rank of the process group (its error names the "
                         "problem, e.g. a shard saved by another rank); nothing was loaded on any rank")
    if not same_everywhere(identity, mesh):
        raise ValueError("load_state_dict: the ranks were given shards of different saves (their step counts, "
                         "param-group hyper-parameters or loss-scaler states differ): load every rank's shard "
                         "saved by the same state_dict() call; nothing was loaded on any rank")
