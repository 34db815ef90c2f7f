"""Construction of a ZeroAdamW in the order of [Note: construction order] (config.py): read the
model without changing it, agree with every rank, lay out the buckets (:func:`plan`); then bind
the parameters to the buckets (:func:`bind`), the first step that changes the model."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import backends, optim_coded
from ..layout import Layout, ParamInfo, build_layout, dtype_name
from . import collectives as C
from .agreement import check_same_everywhere, join_barrier, raise_if_failed, signature
from .coded import format_error
from .config import ZeroConfig
from .mesh import ZeroMesh, broadcast_from_first
from .ownership import owner_error
from .params import (HPARAM_KEYS, ModelParams, model_error, plain, read_model, resolve_groups,
                     sparse_module_error)
from .timeouts import timeout_scope

__all__ = ["Plan", "plan", "bind"]


class Plan(NamedTuple):
    params: ModelParams
    groups: list[dict]              # torch.optim param groups (Parameters + per-group overrides)
    world: int
    rank: int
    device: torch.device
    backend: str                    # resolved fused-Adam backend name
    coded_backend: str | None       # the backend of coded states ([Note: coded ZeRO states]), None: fp32 states
    layout: Layout
    units: Any                      # stage 3: [(name, module)], else None
    model: nn.Module
    group: Any                      # the ZeRO (shard) process group (None: the default group)
    mesh: ZeroMesh                  # shard and replicate groups ([Note: hybrid sharding])


def plan(model: nn.Module, cfg: ZeroConfig, defaults: dict, param_groups, mesh: ZeroMesh, strategy_cls) -> Plan:
    """Everything up to (not including) the first change to the model; raises on every rank alike."""
    process_group = mesh.shard_group
    if process_group is not None and not torch.distributed.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialized")
    world, rank = C.group_size(process_group), C.group_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group: construct the optimizer "
                         "only on the ranks of its data-parallel group")
    mp = read_model(model)
    groups, group_of, group_err = resolve_groups(param_groups, mp, defaults,
                                                 optimizer_wide=tuple(f.name for f in fields(ZeroConfig)))
    error = owner_error(mp.uniq) or model_error(mp.trainable, cfg.param_dtype) or sparse_module_error(model, mp) \
        or group_err \
        or format_error(cfg, mp.trainable, [{**defaults, **g} for g in groups])
    device = mp.trainable[0][1].device if mp.trainable else torch.device("cpu")
    backend, coded = cfg.backend, None
    if error is None:
        try:
            backend = backends.resolve(cfg.backend, device)
            coded = optim_coded.resolve_backend(cfg.backend, device) if cfg.state_format.coded else None
        except (ValueError, NotImplementedError) as e:
            error = str(e)
    hp = [[plain({**defaults, **g}[k]) for k in HPARAM_KEYS] for g in groups]
    sig = signature(mp.uniq, groups, mp.first_name, cfg.agreement_key(), hp, error)
    for g in mesh.groups:           # shard group, then replicate group: every rank of the mesh
        if C.group_size(g) > 1:     # also without timeout=: a rank with it must not wait alone in its barrier
            join_barrier(g, cfg.timeout, C.group_size(g))
        sig = check_same_everywhere(sig, g, C.group_size(g), C.group_rank(g))
    raise_if_failed(sig)
    assigned = strategy_cls.assign_units(model, mp.trainable, cfg.wrap)     # [Note: stage-3 units]
    units, unit_of = assigned if assigned is not None else (None, None)
    infos = [ParamInfo(n, tuple(p.shape), dtype_name(cfg.param_dtype or p.dtype), group_of[id(p)],
                       tuple(mp.aliases[id(p)])) for n, p in mp.trainable]
    layout = build_layout(infos, world, cfg.bucket_size, cfg.layout_alignment,
                          unit_of=(lambda i: unit_of[i]) if unit_of is not None else None)
    return Plan(mp, groups, world, rank, device, backend, coded, layout, units, model, process_group, mesh)


@torch.no_grad()
def bind(p: Plan, cfg: ZeroConfig, strategy_cls, amsgrad: bool) -> list:
    """Parameters become views of the buckets (stage 3: of buckets gathered only when needed);
    frozen parameters are cast to ``param_dtype``. Returns the buckets.

    First every rank takes group rank 0's parameters and buffers (as DDP does at construction): ranks
    that initialised differently (another seed) would otherwise train a mixture of their models."""
    with timeout_scope(cfg.timeout, p.group):
        broadcast_from_first([x.data for _, x in p.params.uniq] + [b for b in p.model.buffers()], p.mesh)
    by_name = dict(p.params.trainable)
    buckets = []
    for bs in p.layout.buckets:
        ps = [by_name[p.layout.params[i].name] for i in bs.params]
        b = strategy_cls.new_bucket(p.layout, bs.index, p.rank, ps, p.device, amsgrad, cfg)
        b.bind([x.detach() for x in ps])
        buckets.append(b)
    for _, x in p.params.frozen:
        if cfg.param_dtype is not None and x.is_floating_point() and x.dtype != cfg.param_dtype:
            x.data = x.data.to(cfg.param_dtype)
    return buckets
