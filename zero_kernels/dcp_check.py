"""Names and checks for the FSDP2-form state dicts of zero_kernels/dcp.py ([Note: DCP interop]).

Pure functions of the state dicts, the module and the layout: no collective, no change, so a bad
state dict raises on every rank alike before ``set_state_dict`` moves or writes anything.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .hparams import validate_hparams
from .state_keys import canonical_names, keyed_state
from .zero.relayout import chunk_range, chunk_shape

__all__ = ["DCPNames", "dcp_names", "check_model_sd", "check_optim_sd", "local_part", "MOMENT_KEYS"]

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
LOADED_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize", "initial_lr")   # initial_lr: LR schedulers


class DCPNames(NamedTuple):
    model: list[tuple[str, Any, Tensor]]    # (FQN, ParamSpec or None, the module's tensor), state_dict order
    fqn: dict[int, str]                     # ParamSpec index -> FQN of its optimizer state (first name)
    fqn_of_param: dict[int, str]            # id(Parameter) -> that FQN


def dcp_names(module: nn.Module, buckets: Sequence) -> DCPNames:
    """The unwrapped model's FQNs ([Note: state-dict keys]) joined to the optimizer's parameters."""
    entries = keyed_state(module, buckets)
    canon = canonical_names(k for k, _, _ in entries)
    model = [(canon[k], ps, v) for k, ps, v in entries]
    fqn: dict[int, str] = {}
    for k, ps, _ in model:
        if ps is not None:
            fqn.setdefault(ps.index, k)
    by_param = {id(p): fqn[ps.index] for b in buckets for p, ps in zip(b.params, b.param_specs)}
    return DCPNames(model, fqn, by_param)


def _names(keys) -> str:
    keys = sorted(keys)
    return ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _same_keys(given, expected, what: str) -> None:
    if not isinstance(given, dict):
        raise TypeError(f"{what} must be a dict, got {type(given).__name__}")
    missing, unexpected = set(expected) - set(given), set(given) - set(expected)
    if missing or unexpected:
        parts = ([f"is missing {_names(missing)}"] if missing else []) + \
                ([f"has unexpected {_names(unexpected)}"] if unexpected else [])
        raise ValueError(f"{what} {' and '.join(parts)}: it was saved from a different model (a renamed, "
                         "added or removed parameter?). Load it into the model it was saved from, or "
                         "rename its keys to this model's fully qualified names first; nothing was loaded")


def check_tensor(where: str, value: Any, shape: tuple[int, ...], rank: int, world: int) -> None:
    """``value`` is this parameter's Shard(0) DTensor over ``world`` ranks ([Note: dim-0 chunks]),
    or a plain tensor of the full shape."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where} has shape {tuple(value.shape)} but this model's parameter has shape "
                         f"{tuple(shape)}: the checkpoint belongs to a different model; nothing was loaded")
    if not value.is_floating_point():
        raise ValueError(f"{where} is {value.dtype}, expected a floating-point tensor")
    if not isinstance(value, DTensor):
        return
    want = (Shard(0),) if shape else (Replicate(),)
    local = tuple(value.to_local().shape)
    if value.device_mesh.size() != world or tuple(value.placements) != want or \
            local != chunk_shape(shape, rank, world):
        raise ValueError(f"{where} is a DTensor with placements {tuple(value.placements)} over "
                         f"{value.device_mesh.size()} ranks (local shape {local}); set_state_dict takes the "
                         f"layout get_state_dict produces ({want} over {world} ranks, local shape "
                         f"{chunk_shape(shape, rank, world)}) or plain full tensors: fill "
                         "zero_kernels.dcp.get_state_dict(zopt)'s dicts with torch.distributed.checkpoint.load")


def local_part(value: Tensor, shape: tuple[int, ...], rank: int, world: int) -> Tensor:
    """This rank's dim-0 chunk of a checked value (fp32, flattened)."""
    if isinstance(value, DTensor):
        return value.to_local().reshape(-1).float()
    cr = chunk_range(shape, rank, world)
    return value.detach().reshape(-1)[cr.start:cr.start + cr.numel].float()


def check_model_sd(sd: Any, names: DCPNames, rank: int, world: int) -> None:
    _same_keys(sd, [k for k, _, _ in names.model], "model_state_dict")
    for k, ps, v in names.model:
        where = f"model_state_dict[{k!r}]"
        if ps is not None:
            check_tensor(where, sd[k], ps.shape, rank, world)
        elif isinstance(sd[k], DTensor) or not isinstance(sd[k], Tensor) or sd[k].shape != v.shape:
            got = type(sd[k]).__name__ if not isinstance(sd[k], Tensor) else tuple(sd[k].shape)
            raise ValueError(f"{where} (a frozen parameter or buffer) must be a plain tensor of shape "
                             f"{tuple(v.shape)}, got {got}; nothing was loaded")


def _check_step(where: str, step: Any) -> None:
    v = step.item() if isinstance(step, Tensor) and step.numel() == 1 else step
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or v != int(v):
        raise ValueError(f"{where} must be a non-negative whole number of steps, got {step!r}")


def check_optim_sd(sd: Any, names: DCPNames, zopt) -> list[dict[str, Any]]:
    """Check an optimizer state dict; returns each param group's new hyper-parameters."""
    _same_keys(sd, ["state", "param_groups"], "optim_state_dict")
    _same_keys(sd["state"], list(names.fqn.values()), "optim_state_dict['state']")
    kinds = MOMENT_KEYS + (("max_exp_avg_sq",) if any(b.amsgrad for b in zopt.buckets) else ())
    for ps in zopt.layout.params:
        fqn = names.fqn[ps.index]
        st = sd["state"][fqn]
        _same_keys(st, ("step",) + kinds, f"optim_state_dict['state'][{fqn!r}]")
        _check_step(f"optim_state_dict['state'][{fqn!r}]['step']", st["step"])
        for k in kinds:
            check_tensor(f"optim_state_dict['state'][{fqn!r}][{k!r}]", st[k], ps.shape, zopt.rank,
                         zopt.world_size)
    return [_group_update(gi, g, sd["param_groups"], names, zopt) for gi, g in enumerate(zopt.param_groups)]


def _group_update(gi: int, group: dict, saved_groups: Any, names: DCPNames, zopt) -> dict[str, Any]:
    mine = [names.fqn_of_param[id(p)] for p in group["params"]]
    where = f"optim_state_dict['param_groups'] (this optimizer's param_groups[{gi}])"
    found = [g for g in saved_groups if isinstance(g, dict) and mine[0] in g.get("params", ())]
    if not found or set(found[0]["params"]) != set(mine):
        raise ValueError(f"{where}: no saved param group holds exactly the parameters {_names(mine)}; the "
                         "optimizer was built with other param groups than the saved one. Build it with the "
                         "same grouping (e.g. the same decay / no-decay split); nothing was loaded")
    saved = found[0]
    if bool(saved.get("amsgrad", False)) != bool(group["amsgrad"]):
        raise ValueError(f"{where}: saved amsgrad={saved.get('amsgrad')} but this optimizer has "
                         f"amsgrad={group['amsgrad']}; construct it with the saved setting")
    new = {k: (tuple(saved[k]) if k == "betas" else saved[k]) for k in LOADED_GROUP_KEYS if k in saved}
    h = {**group, **new}
    decoupled = saved.get("decoupled_weight_decay")
    if decoupled is not None and bool(decoupled) != bool(zopt.adamw) and h["weight_decay"] != 0:
        raise ValueError(f"{where}: saved by {'AdamW' if decoupled else 'Adam'} (weight decay "
                         f"{'decoupled' if decoupled else 'added to the gradient'}) but this is "
                         f"{type(zopt).__name__}; load it into {'ZeroAdamW' if decoupled else 'ZeroAdam'}")
    validate_hparams(h["lr"], h["betas"], h["eps"], h["weight_decay"], where=f" in {where}")
    return new
