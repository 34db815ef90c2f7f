"""Offline checkpoint tools: ``consolidate`` (a full torch.optim.AdamW/Adam checkpoint, shard by
shard, no process group) and ``inspect`` (metadata only), their CLI (``main``: ``python -m
zero_kernels.checkpoint``), and the matching of a saved layout onto a loader's (``match_params``,
``check_fit``: wrapper-free names, shapes, groups);
the format: [Note: checkpoint format] in checkpoint.py.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from ._cli import until_reader_leaves
from .checkpoint_format import (VDIR, CheckpointError, Shards, atomic_write, canonical, check_state_codes, load_small,
                                param_names, read_metadata, resolve, saved_layout)
from .state_keys import canonical_names

__all__ = ["consolidate", "inspect", "match_params", "check_fit", "main"]


# ---- offline tools (no process group) -------------------------------------------------------------------------------
def _torch_group(meta: dict, g: dict) -> dict:
    """A param group dict with every key torch.optim.AdamW / Adam would hold (params excluded)."""
    cls = torch.optim.AdamW if meta["optimizer"] == "AdamW" else torch.optim.Adam
    kw = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize") if k in g}
    kw["betas"] = tuple(kw.get("betas", (0.9, 0.999)))
    dummy = cls([torch.zeros(1, requires_grad=True)], **kw)
    out = {k: v for k, v in dummy.param_groups[0].items() if k != "params"}
    # keys torch's optimizers do not set but keep in a group (a scheduler's initial_lr, user keys) carry over
    out.update({k: v for k, v in g.items() if k not in out and k != "params"})
    return out


def _group_members(meta: dict, lay, gi: int) -> list:
    """Group ``gi``'s saved parameters in the order the optimizer's param group listed them (recorded as
    ``group_order``; a torch optimizer built from the same groups numbers them so), else (checkpoints saved
    before it was recorded) in the module's registration order."""
    members = [p for p in lay.params if p.group == gi]
    listed = (meta.get("group_order") or [None] * (gi + 1))[gi]
    if listed is not None and sorted(listed) == sorted(p.name for p in members):
        order = {n: i for i, n in enumerate(listed)}
    else:
        order = {n: i for i, n in enumerate(meta["registration_order"])}
    return sorted(members, key=lambda p: order.get(p.name, 1 << 30))


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
                    src = shards.fp32(r, b.index, k)[pc.start:pc.start + pc.numel]
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
def check_output_path(out: str, vdir: str) -> None:
    """CheckpointError unless ``out`` is a file path consolidate may write: not inside the version directory it
    reads, nor the root's LATEST or another version directory (a write there replaced a checkpoint file, and
    the checkpoint could no longer be read), not a directory, its folder existing."""
    real, root = os.path.realpath(out), os.path.dirname(os.path.realpath(vdir))
    rel = os.path.relpath(real, root)
    first = rel.split(os.sep)[0]
    if not rel.startswith(os.pardir) and (first == "LATEST" or VDIR.match(first)):
        raise CheckpointError(f"output {out!r} lies inside the checkpoint {root!r} ({rel}): writing it would replace "
                              "a file of the checkpoint; write the consolidated file outside it")
    if os.path.isdir(real):
        raise CheckpointError(f"output {out!r} is a directory; give a file path, e.g. {os.path.join(out, 'full.pt')!r}")
    if not os.path.isdir(os.path.dirname(real)):
        raise CheckpointError(f"output {out!r}: its folder {os.path.dirname(real)!r} does not exist; create it first")


def _read(vdir: str) -> tuple:
    """(COMPLETE marker, metadata, saved layout) of version ``vdir``, its state codes checked."""
    marker, meta = read_metadata(vdir)
    check_state_codes(meta, os.path.join(vdir, "metadata.json"))
    return marker, meta, saved_layout(meta, os.path.join(vdir, "metadata.json"))


def _rest(vdir: str, marker: dict, meta: dict, verify: bool) -> dict:
    """The module entries that are not trainable parameters (frozen parameters, buffers)."""
    return load_small(vdir, meta["model_rest"], marker, verify, meta.get("tensors", {}).get("model_rest.pt"))


def model_weights(path, verify: bool = True) -> dict:
    """The full fp32 model state dict of the checkpoint at ``path``: :func:`consolidate`'s "model" without
    reading the Adam states (one shard file mapped at a time; no process group)."""
    vdir = resolve(path)
    marker, meta, lay = _read(vdir)
    master = _full_states(vdir, marker, meta, lay, ["master"], verify)["master"]
    return _model_entries(meta, lay, master, _rest(vdir, marker, meta, verify))


def consolidate(path, out: str | None = None, verify: bool = True) -> dict:
    """Full fp32 model state dict + a torch.optim.AdamW/Adam state dict, built shard by shard
    (one shard file mapped at a time; no process group). Writes it to ``out`` (atomically) when given.
    ``verify=False`` skips the sha256 of the tensor files ([Note: checkpoint integrity]).

    Result: {"model": state_dict (trainable parameters as fp32 masters, tied names sharing one
    tensor, frozen parameters and floating buffers as fp32), "optimizer": torch optimizer state
    dict whose parameter indices follow, group by group, the order in which the optimizer's param groups
    listed the trainable parameters (as ``torch.optim.AdamW`` built from the same groups numbers them; the
    module's registration order for checkpoints saved before that order was recorded); ``param_names``
    lists them, "metadata"}."""
    vdir = resolve(path)
    if out is not None:
        check_output_path(os.fspath(out), vdir)
    marker, meta, lay = _read(vdir)
    keys = ["master", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if meta.get("amsgrad_state") else [])
    full = _full_states(vdir, marker, meta, lay, keys, verify)
    model = _model_entries(meta, lay, full["master"], _rest(vdir, marker, meta, verify))
    steps = {p.index: p_meta["step"] for p, p_meta in zip(lay.params, meta["params"])}
    groups, state, names = [], {}, []
    idx = 0
    for gi, g in enumerate(meta["param_groups"]):
        members = _group_members(meta, lay, gi)
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
    fmt = meta.get("state_format") or {"exp_avg_dtype": "float32", "exp_avg_sq_dtype": "float32",
                                       "store_param_remainders": False}
    w(f"state format   exp_avg {fmt['exp_avg_dtype']}, exp_avg_sq {fmt['exp_avg_sq_dtype']}, master "
      + ("bf16 parameter + int16 remainder" if fmt.get("store_param_remainders") else "fp32")
      + (f"; 8-bit code {fmt['u8_code']}" if "u8_code" in fmt else ""))
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


def match_params(mine, saved, meta_path: str, saved_keys=(), model_keys=()) -> dict:
    """{loader parameter index: saved ParamSpec}, by wrapper-free names ([Note: state-dict keys]).
    ``saved_keys`` / ``model_keys`` (the saved and the loader's module state-dict keys) name, in the errors, a
    parameter trainable on one side and frozen on the other."""
    sc = canonical([n for p in saved.params for n in param_names(p)], meta_path)
    by_name = {sc[n]: p for p in saved.params for n in param_names(p)}
    mc = canonical([n for p in mine.params for n in param_names(p)], "the model")
    saved_rest = set(canonical(list(saved_keys), meta_path).values())
    model_rest = set(canonical(list(model_keys), "the model").values())
    out = {}
    for p in mine.params:
        sp = next((by_name[mc[n]] for n in param_names(p) if mc[n] in by_name), None)
        if sp is None:
            if mc[p.name] in saved_rest:
                raise CheckpointError(f"{meta_path}: the model's parameter {p.name!r} is trainable here but was frozen "
                                      "(requires_grad=False: no optimizer state) when the checkpoint was saved; "
                                      "freeze it before constructing the optimizer, as at save time")
            raise CheckpointError(f"{meta_path}: the model's trainable parameter {p.name!r} (shape "
                                  f"{tuple(p.shape)}) is not in the checkpoint")
        if tuple(sp.shape) != tuple(p.shape):
            raise CheckpointError(f"{meta_path}: parameter {p.name!r} has shape {tuple(sp.shape)} in the "
                                  f"checkpoint but {tuple(p.shape)} in the model")
        if sp.group != p.group:
            raise CheckpointError(f"{meta_path}: parameter {p.name!r} is in param group {sp.group} in the "
                                  f"checkpoint but in group {p.group} here: build the same param_groups")
        out[p.index] = sp
    used = {sp.index for sp in out.values()}
    extra = [p for p in saved.params if p.index not in used]
    frozen_here = [p.name for p in extra if sc[p.name] in model_rest]
    if frozen_here:
        raise CheckpointError(f"{meta_path}: parameter(s) {frozen_here[:5]} were trainable when the checkpoint was "
                              "saved but are frozen here (requires_grad=False); unfreeze them before constructing "
                              "the optimizer, as at save time")
    if extra:
        names = [p.name for p in extra]
        raise CheckpointError(f"{meta_path}: the checkpoint has trainable parameter(s) the model lacks: "
                              f"{names[:5]}{' ...' if len(names) > 5 else ''}")
    return out


def check_fit(opt, meta: dict, meta_path: str) -> dict:
    """Parameter names, shapes, groups and optimizer kind must match the loader's model; returns
    ``match_params`` of the loader's parameters onto the saved ones."""
    model_keys = list(opt.module.state_dict(keep_vars=True).keys())
    match = match_params(opt.layout, saved_layout(meta, meta_path), meta_path, meta.get("state_dict_keys", ()),
                         model_keys)
    if len(meta["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(f"{meta_path}: {len(meta['param_groups'])} param groups in the checkpoint, "
                              f"{len(opt.param_groups)} here")
    kind = "AdamW" if opt.adamw else "Adam"
    if meta["optimizer"] != kind:
        raise CheckpointError(f"{meta_path}: saved by Zero{meta['optimizer']}, loading into Zero{kind}")
    have_ams = any(b.amsgrad for b in opt.buckets)
    want_ams = any(g.get("amsgrad") for g in meta["param_groups"])
    if want_ams and not have_ams:
        raise CheckpointError(f"{meta_path}: the checkpoint uses amsgrad; construct the optimizer with amsgrad=True")
    return match


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zero_kernels.checkpoint",
                                 description="Inspect or consolidate a ZeroAdamW sharded checkpoint.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("inspect", help="print the metadata of a checkpoint")
    a.add_argument("path")
    c = sub.add_parser("consolidate", help="write {'model', 'optimizer'} (torch.optim.AdamW format) to OUT")
    c.add_argument("path")
    c.add_argument("out")
    c.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the files")
    args = ap.parse_args(argv)

    def run() -> int:
        try:
            if args.cmd == "inspect":
                inspect(args.path)
            else:
                res = consolidate(args.path, args.out, verify=not args.no_verify)
                n = sum(t.numel() for k, t in res["model"].items())
                print(f"wrote {args.out}: {len(res['model'])} model entries ({n:,} elements), "
                      f"{len(res['optimizer']['state'])} optimizer states")
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    return until_reader_leaves(run)      # `inspect ... | head`
