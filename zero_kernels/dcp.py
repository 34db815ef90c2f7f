"""FSDP2-compatible state dicts of a ZeroAdamW for ``torch.distributed.checkpoint`` (DCP).

    import torch.distributed.checkpoint as dcp
    import zero_kernels.dcp as zk_dcp

    model_sd, optim_sd = zk_dcp.get_state_dict(zopt)                 # save
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    model_sd, optim_sd = zk_dcp.get_state_dict(zopt)                 # load: a template of the right shapes
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)                                 # any world size, FSDP2's or ours
    zk_dcp.set_state_dict(zopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

[Note: DCP interop]
``get_state_dict`` / ``set_state_dict`` have the semantics of ``torch.distributed.checkpoint.
state_dict.get_state_dict(model, optim)`` / ``set_state_dict`` under FSDP2 (``fully_shard``):
  * keys are the unwrapped model's fully qualified names (``module.state_dict()`` keys with the
    wrapper components of [Note: state-dict keys] removed); tied parameters appear under each
    model key, and once in the optimizer state (under the first name, as torch's);
  * every trainable parameter is a DTensor on a 1-D mesh over the optimizer's process group with
    placement ``Shard(0)`` and ``torch.chunk`` chunks, exactly FSDP2's layout ([Note: dim-0 chunks]
    in zero/relayout.py; 0-dim parameters are ``Replicate()``), holding the fp32 *masters* (as
    ``full_model_state_dict``); frozen parameters and buffers are plain tensors (replicated);
  * the optimizer dict is torch's AdamW form: ``state[fqn] = {"step": fp32 scalar tensor,
    "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}`` (DTensors like the parameters) and
    ``param_groups`` with torch's keys (``decoupled_weight_decay`` says AdamW or Adam) and
    ``"params"`` as FQN lists. Every parameter has state (a never-stepped one: step 0, zero
    moments, which is what Adam's first step assumes); a torch checkpoint whose optimizer never saw
    a gradient for some parameter lacks its entry: load it with ``dcp.load(..., planner=
    DefaultLoadPlanner(allow_partial_load=True))`` so that entry keeps the template's zeros.
DCP reshards by element ranges of these global shapes, so a checkpoint moves between FSDP2 and
ZeRO stages 1-3 at any world sizes, and ``torch.distributed.checkpoint.format_utils.
dcp_to_torch_save`` turns one into a plain file of full tensors. ``set_state_dict`` also accepts
plain full tensors (such a file, ``torch.load``-ed). ZeRO keeps parameters in flat buckets split
across parameter boundaries, so both directions re-layout one bucket (stage 3: one unit) at a time
with one all-gather each, bounded by the optimizer's ``timeout`` ([Note: collective timeouts]);
the transient memory is about one bucket, not the model. ``set_state_dict`` checks everything
(names, shapes, layouts, groups, hyper-parameters) before any collective or change. Not in this
form: the dynamic loss scale and ``skipped_steps`` (FSDP2 has neither; GradScaler keeps its own).

Why the project's own checkpoint (``save_checkpoint``; checkpoint.py) stays the default: it is
atomic (a version directory becomes visible through its ``COMPLETE`` marker only after every rank's
files are written and fsynced, so a crash mid-save leaves the previous checkpoint loadable, and
``resolve`` never picks a torn one), every tensor file carries a sha256 checked on load, and a
rank reads exactly its own byte ranges of the saved flat shards (no re-layout, no all-gather).
DCP's filesystem writer has none of the integrity metadata and its resharding reads go through
the per-parameter layout; it is the interchange format, used when a run has to move to or from
FSDP2 (or to a plain file), not the one a long ZeRO run should rely on for restarts.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .dcp_check import DCPNames, check_model_sd, check_optim_sd, dcp_names, local_part
from .zero.relayout import gather_chunks, scatter_chunks
from .zero.timeouts import bounded_by_timeout

__all__ = ["get_state_dict", "set_state_dict"]

# the group keys of torch.optim.Adam(W) that ZeroAdamW has no setting for (their values there)
TORCH_ONLY_GROUP_KEYS = {"foreach": None, "capturable": False, "differentiable": False, "fused": None}


def _mesh(zopt) -> DeviceMesh | None:
    if not dist.is_initialized():
        return None                     # world 1 without a process group: plain tensors
    device = zopt.buckets[0].device.type if zopt.buckets else "cpu"
    return DeviceMesh.from_group(zopt.process_group or dist.group.WORLD, device)


def _wrap(local: Tensor, shape: tuple[int, ...], mesh: DeviceMesh | None) -> Tensor:
    if mesh is None:
        return local
    placement = [Shard(0)] if shape else [Replicate()]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placement, run_check=False, shape=torch.Size(shape), stride=stride)


@bounded_by_timeout
@torch.no_grad()
def get_state_dict(zopt) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: ``(model_state_dict, optim_state_dict)`` of ``zopt`` (a ZeroAdamW / ZeroAdam) in
    FSDP2's sharded form ([Note: DCP interop]); pass them to ``torch.distributed.checkpoint.save``,
    or use them as the template of ``torch.distributed.checkpoint.load``."""
    zopt.wait_for_params()
    names, mesh = dcp_names(zopt.module, zopt.buckets), _mesh(zopt)
    per_param: dict[int, dict[str, Tensor]] = {}
    for b in zopt.buckets:
        for kind, t in b.fp32_states().items():
            got = gather_chunks(t, b.param_specs, b.spec.padded_numel, zopt.rank, zopt.world_size,
                                zopt.process_group, tag=("dcp", b.index, kind))
            for ps, local in zip(b.param_specs, got.tensors):
                per_param.setdefault(ps.index, {})[kind] = _wrap(local, ps.shape, mesh)
    model_sd = {k: per_param[ps.index]["master"] if ps is not None else v.detach().clone()
                for k, ps, v in names.model}
    state = {}
    for ps in zopt.layout.params:
        st = {"step": torch.tensor(float(zopt.steps[ps.index]), dtype=torch.float32)}
        st.update({k: v for k, v in per_param[ps.index].items() if k != "master"})
        state[names.fqn[ps.index]] = st
    return model_sd, {"state": state, "param_groups": _groups(zopt, names)}


def _groups(zopt, names: DCPNames) -> list[dict[str, Any]]:
    out = []
    for g in zopt.param_groups:
        d = {k: v for k, v in g.items() if k != "params"}
        for k, v in TORCH_ONLY_GROUP_KEYS.items():
            d.setdefault(k, v)
        d["decoupled_weight_decay"] = bool(zopt.adamw)
        d["params"] = [names.fqn_of_param[id(p)] for p in g["params"]]
        out.append(d)
    return out


@bounded_by_timeout
@torch.no_grad()
def set_state_dict(zopt, *, model_state_dict: dict[str, Any] | None = None,
                   optim_state_dict: dict[str, Any] | None = None) -> None:
    """Collective: load FSDP2-form state dicts (as ``get_state_dict`` returns them, filled by
    ``torch.distributed.checkpoint.load``; or plain full tensors) into ``zopt`` and its module.
    Either may be omitted (its part is left as it is). Everything is checked first: a missing,
    unexpected or mis-shaped entry raises ValueError naming it, before anything changes."""
    names = dcp_names(zopt.module, zopt.buckets)
    if model_state_dict is not None:
        check_model_sd(model_state_dict, names, zopt.rank, zopt.world_size)
    new_groups = None
    if optim_state_dict is not None:
        new_groups = check_optim_sd(optim_state_dict, names, zopt)
    zopt.wait_for_params()
    step = max((int(st["step"]) for st in optim_state_dict["state"].values()), default=0) \
        if optim_state_dict is not None else max(zopt.steps, default=0)
    for b in zopt.buckets:
        loaded = {}
        for kind in b.fp32_states():
            src = _source(kind, b, names, model_state_dict, optim_state_dict)
            if src is None:
                continue
            chunks = [local_part(src[i], ps.shape, zopt.rank, zopt.world_size) for i, ps in
                      enumerate(b.param_specs)]
            got = scatter_chunks(chunks, b.param_specs, (b.slice_start, b.slice_end), zopt.rank,
                                 zopt.world_size, zopt.process_group, tag=("dcp-load", b.index, kind))
            loaded[kind] = got.output.to(torch.float32)
        b.store_fp32_states(loaded, step)      # coded states: encoded ([Note: coded ZeRO states])
    if model_state_dict is not None:
        for k, ps, v in names.model:
            if ps is None:
                v.copy_(model_state_dict[k])
    if optim_state_dict is not None:
        for ps in zopt.layout.params:
            zopt.steps[ps.index] = int(optim_state_dict["state"][names.fqn[ps.index]]["step"])
        for g, new in zip(zopt.param_groups, new_groups):
            g.update(new)
    zopt.refresh_params()


def _source(kind: str, b, names: DCPNames, model_sd, optim_sd) -> list | None:
    """The given values of state ``kind`` for every parameter of bucket ``b`` (None: not given)."""
    if kind == "master":
        return None if model_sd is None else [model_sd[names.fqn[ps.index]] for ps in b.param_specs]
    if optim_sd is None:
        return None
    return [optim_sd["state"][names.fqn[ps.index]][kind] for ps in b.param_specs]

