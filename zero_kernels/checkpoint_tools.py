"""Offline checkpoint tools: ``consolidate`` (a full torch.optim.AdamW/Adam checkpoint, shard by
shard, no process group) and ``inspect`` (metadata only). CLI: ``python -m zero_kernels.checkpoint``;
the format: [Note: checkpoint format] in checkpoint.py.
"""
from __future__ import annotations

import os
import sys

import torch

from .checkpoint_format import (CheckpointError, Shards, atomic_write, load_small, param_names, read_metadata,
                                resolve, saved_layout)
from .state_keys import canonical_names

__all__ = ["consolidate", "inspect"]


# ---- offline tools (no process group) -------------------------------------------------------------------------------
def _torch_group(meta: dict, g: dict) -> dict:
    """A param group dict with every key torch.optim.AdamW / Adam would hold (params excluded)."""
    cls = torch.optim.AdamW if meta["optimizer"] == "AdamW" else torch.optim.Adam
    kw = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize") if k in g}
    kw["betas"] = tuple(kw.get("betas", (0.9, 0.999)))
    dummy = cls([torch.zeros(1, requires_grad=True)], **kw)
    out = {k: v for k, v in dummy.param_groups[0].items() if k != "params"}
    return out


def _full_states(vdir: str, marker: dict, meta: dict, lay, keys: list[str], verify: bool) -> dict:
    """{state key: {parameter index: full fp32 tensor}}, one shard file mapped at a time; every
    element of every output written exactly once (counted, CheckpointError otherwise)."""
    full = {k: {p.index: torch.empty(p.shape, dtype=torch.float32) for p in lay.params} for k in keys}
    cover = {p.index: torch.zeros(p.numel, dtype=torch.uint8) for p in lay.params}
    shards = Shards(vdir, meta, marker, verify)
    for r in range(lay.world_size):
        for b in lay.buckets:
            for pc in lay.pieces(b.index, r):
                dst = slice(pc.param_start, pc.param_start + pc.numel)
                cover[pc.param][dst] += 1
                for k in keys:
                    src = shards.get(r, f"b{b.index}.{k}")[pc.start:pc.start + pc.numel]
                    full[k][pc.param].view(-1)[dst].copy_(src)
        shards.close(r)
    for p in lay.params:
        bad = (cover[p.index] != 1).nonzero()
        if bad.numel():
            i = int(bad[0])
            raise CheckpointError(f"{vdir}/metadata.json: element {i} of parameter {p.name!r} is covered "
                                  f"{int(cover[p.index][i])} times by the saved layout ({bad.numel()} of "
                                  f"{p.numel} elements not exactly once): refusing to write uninitialised values")
    return full


def _model_entries(meta: dict, lay, master: dict, rest: dict) -> dict:
    """The consolidated model state dict, joined through the recorded key -> parameter index map
    (name join, wrapper-free, for checkpoints written before it was recorded)."""
    index = meta.get("state_dict_params")
    if index is None:
        c = canonical_names(n for p in lay.params for n in param_names(p))
        by_c = {c[n]: p.index for p in lay.params for n in param_names(p)}
        index = {k: by_c[ck] for k, ck in canonical_names(meta["state_dict_keys"]).items() if ck in by_c}
    model = {}
    for k in meta["state_dict_keys"]:
        if k in index:
            model[k] = master[index[k]]
        elif k in rest:
            model[k] = rest[k].float() if rest[k].is_floating_point() else rest[k]
        else:
            raise CheckpointError(f"{meta.get('version_dir')}/metadata.json: state-dict key {k!r} is neither a "
                                  "trainable parameter nor in model_rest.pt")
    return model


@torch.no_grad()
def consolidate(path, out: str | None = None, verify: bool = True) -> dict:
    """Full fp32 model state dict + a torch.optim.AdamW/Adam state dict, built shard by shard
    (one shard file mapped at a time; no process group). Writes it to ``out`` (atomically) when given.
    ``verify=False`` skips the sha256 of the tensor files ([Note: checkpoint integrity]).

    Result: {"model": state_dict (trainable parameters as fp32 masters, tied names sharing one
    tensor, frozen parameters and floating buffers as fp32), "optimizer": torch optimizer state
    dict whose parameter indices follow, group by group, the module's registration order of
    trainable parameters (``param_names`` lists them), "param_names", "metadata"}."""
    vdir = resolve(path)
    marker, meta = read_metadata(vdir)
    lay = saved_layout(meta, os.path.join(vdir, "metadata.json"))
    keys = ["master", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if meta.get("amsgrad_state") else [])
    full = _full_states(vdir, marker, meta, lay, keys, verify)
    rest = load_small(vdir, meta["model_rest"], marker, verify, meta.get("tensors", {}).get("model_rest.pt"))
    model = _model_entries(meta, lay, full["master"], rest)
    steps = {p.index: p_meta["step"] for p, p_meta in zip(lay.params, meta["params"])}
    order = {n: i for i, n in enumerate(meta["registration_order"])}
    groups, state, names = [], {}, []
    idx = 0
    for gi, g in enumerate(meta["param_groups"]):
        members = sorted((p for p in lay.params if p.group == gi), key=lambda p: order.get(p.name, 1 << 30))
        tg = _torch_group(meta, g)
        tg["params"] = []
        gnames = []
        for p in members:
            if steps[p.index] > 0:
                s = {"step": torch.tensor(float(steps[p.index]), dtype=torch.float32),
                     "exp_avg": full["exp_avg"][p.index], "exp_avg_sq": full["exp_avg_sq"][p.index]}
                if tg.get("amsgrad"):
                    s["max_exp_avg_sq"] = full["max_exp_avg_sq"][p.index] if "max_exp_avg_sq" in full else \
                        torch.zeros(p.shape)
                state[idx] = s
            tg["params"].append(idx)
            gnames.append(p.name)
            idx += 1
        groups.append(tg)
        names.append(gnames)
    summary = {k: meta[k] for k in ("format", "format_version", "stage", "world_size", "psi", "optimizer",
                                    "loss_scaler", "skipped_steps")}
    result = {"model": model, "optimizer": {"state": state, "param_groups": groups}, "param_names": names,
              "metadata": summary}
    if out is not None:
        atomic_write(os.fspath(out), lambda f: torch.save(result, f))
    return result


def inspect(path, file=None) -> dict:
    """Print a checkpoint's metadata (no tensors are read); returns it."""
    file = file or sys.stdout
    vdir = resolve(path)
    marker, meta = read_metadata(vdir)
    w = lambda s="": print(s, file=file)  # noqa: E731
    w(f"checkpoint     {vdir}")
    w(f"format         {meta['format']} version {meta['format_version']} (torch {meta['torch_version']})")
    w(f"saved by       Zero{meta['optimizer']} stage {meta['stage']}, world size {meta['world_size']}, "
      f"layout {meta['layout_fingerprint']}, bucket_size {meta['layout']['bucket_size']}")
    w(f"parameters     Psi = {meta['psi']:,} trainable elements in {len(meta['params'])} tensors, "
      f"{len(meta['layout']['buckets'])} buckets")
    w(f"loss scaler    {meta['loss_scaler']}; skipped steps {meta['skipped_steps']}")
    for i, g in enumerate(meta["param_groups"]):
        w(f"param group {i}  " + ", ".join(f"{k}={v}" for k, v in g.items()))
    w("files")
    for n, info in marker["files"].items():
        w(f"  {n:<28} {info['bytes']:>12,} bytes  sha256 {info['sha256'][:16]}")
    w(f"{'name':<40} {'shape':<16} {'dtype':<9} {'group':>5} {'step':>6}")
    for p in meta["params"]:
        nm = p["name"] + (f" (= {', '.join(p['aliases'])})" if p["aliases"] else "")
        w(f"{nm:<40} {str(tuple(p['shape'])):<16} {p['dtype']:<9} {p['group']:>5} {p['step']:>6}")
    return meta
