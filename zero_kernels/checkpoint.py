"""Sharded, resharding, atomic checkpoints for ZeroAdamW (any stage, any data-parallel world size).

    zopt.save_checkpoint("ckpt")            # collective: every rank calls it
    zopt.load_checkpoint("ckpt")            # collective; any world size / stage / bucket size
    python -m zero_kernels.checkpoint inspect ckpt
    python -m zero_kernels.checkpoint consolidate ckpt full.pt   # no process group, shard by shard

[Note: checkpoint format]  (FORMAT_VERSION = 1)
A checkpoint *root* holds versioned directories and a pointer to the newest complete one:

    ckpt/LATEST                      text: "v000007" (replaced atomically with os.replace)
    ckpt/v000007/metadata.json       rank 0; plain JSON (no pickle): format + version, stage, world
                                     size, Psi, the bucket Layout (Layout.to_dict()) and its
                                     fingerprint, per parameter (layout order) its name, aliases,
                                     shape, working dtype, param group and step, the param groups'
                                     hyperparameters, Adam vs AdamW, the loss-scaler state and
                                     skipped-step counter, the module's state_dict key order and
                                     parameter registration order, the shard file names.
    ckpt/v000007/model_rest.pt       rank 0; frozen parameters and buffers (torch.save of a flat
                                     {name: tensor} dict)
    ckpt/v000007/shard-00001-of-00004.pt
                                     rank 1's shard: torch.save of a flat {key: tensor} dict with, per
                                     bucket i of the saved layout, ``b{i}.master``, ``b{i}.exp_avg``,
                                     ``b{i}.exp_avg_sq`` (``b{i}.max_exp_avg_sq`` with amsgrad),
                                     each the rank's whole fp32 slice (shard_numel elements, padding
                                     included: zero), ``b{i}.params16`` (the 16-bit working
                                     parameters the rank owns, for 16-bit buckets) and ``steps``
                                     (int64, per layout parameter).
    ckpt/v000007/COMPLETE            written LAST: JSON {"format", "format_version", "files":
                                     {name: {"bytes", "sha256"}}}

Every file is written to a temporary name, flushed, fsync'ed and renamed; the version directory is
fsync'ed, then COMPLETE, then LATEST is replaced. A save that dies anywhere before that leaves
LATEST naming the previous complete version, so the previous checkpoint stays loadable; the
half-written directory is removed by the next successful save (which keeps ``keep`` complete
versions, default 1). All files are read with ``torch.load(weights_only=True)`` (no code objects)
or ``json``. Every rank must see the same filesystem path (a shared or local filesystem).

[Note: resharding]
Loading maps the saved (layout A, world A) onto the loader's (layout B, world B) through parameter
*names* and per-parameter flat offsets, never through bucket positions (bucket layouts differ
across stages, world sizes and bucket sizes). For every piece of its own slices (Layout.pieces:
parameter p, elements [k, k+n) of p), a loading rank finds p in layout A (offset o, bucket a),
the element range [o+k, o+k+n) of bucket a, and the saved ranks whose slices cover it
(rank = element // shard_numel_A); it reads exactly those ranges from those shard files, opened
with ``torch.load(mmap=True)``, so only the pages it needs are touched and its memory stays near
its own shard size. Steps, hyperparameters and loss-scaler state come from the checkpoint.
Everything is read and checked (files present, sizes match COMPLETE, format version, parameter
names and shapes, buffers) and the ranks agree that nobody failed BEFORE any state is changed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import uuid
from typing import Any, Callable

import torch

from .layout import Layout, dtype_from_name, dtype_name

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "inspect", "resolve", "read_metadata",
           "CheckpointError", "FORMAT", "FORMAT_VERSION"]

FORMAT = "zero_kernels.checkpoint"
FORMAT_VERSION = 1
_VDIR = re.compile(r"^v(\d{6,})$")

# Test hook: called as _FAULT(rank, file_name) after each file this process writes (raise to
# simulate a crash in the writer).
_FAULT: Callable[[int, str], None] | None = None


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, of another format version, or does not fit."""


# ---- small file helpers -----------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(final: str, write: Callable[[Any], None], rank: int) -> dict:
    """write(f) into a temp file next to ``final``, fsync, rename; returns {"bytes", "sha256"}."""
    tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    info = {"bytes": os.path.getsize(final), "sha256": _sha256(final)}
    if _FAULT is not None:
        _FAULT(rank, os.path.basename(final))
    return info


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=False).encode()


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


# ---- collectives (tiny objects only) ------------------------------------------------------------
def _gather(obj, opt) -> list:
    import torch.distributed as dist
    if opt.world_size == 1:
        return [obj]
    out: list = [None] * opt.world_size
    dist.all_gather_object(out, obj, group=opt.process_group)
    return out


def _agree(err: str | None, opt, what: str) -> None:
    """Raise on every rank when any rank failed (its message first)."""
    errs = _gather(err, opt)
    if err is not None:
        raise CheckpointError(err)
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        r, e = bad[0]
        raise CheckpointError(f"{what} failed on rank {r} of {opt.world_size}: {e}")


# ---- save ------------------------------------------------------------------------------------------
def _trainable_names(layout) -> set[str]:
    return {n for p in layout.params for n in (p.name,) + tuple(p.aliases)}


def _owned16(b) -> torch.Tensor | None:
    """This rank's 16-bit working-parameter slice (None when the bucket is fp32: master is param)."""
    if b.master_is_param:
        return None
    return b.owned_params


def _metadata(opt, version_dir_name: str) -> dict:
    lay = opt.layout
    groups = []
    for g in opt.param_groups:
        groups.append({k: _plain(v) for k, v in g.items() if k != "params"})
    module = opt.module
    sd_keys = list(module.state_dict().keys())
    reg_order = [n for n, p in module.named_parameters() if p.requires_grad]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "version_dir": version_dir_name,
        "torch_version": torch.__version__, "stage": int(opt.stage), "world_size": int(opt.world_size),
        "psi": int(lay.numel), "optimizer": "AdamW" if opt.adamw else "Adam",
        "layout_fingerprint": lay.fingerprint(), "layout": lay.to_dict(),
        "params": [{"name": p.name, "aliases": list(p.aliases), "shape": list(p.shape), "dtype": p.dtype,
                    "group": p.group, "step": int(opt.steps[p.index])} for p in lay.params],
        "param_groups": groups,
        "amsgrad_state": any(b.amsgrad for b in opt.buckets),
        "loss_scaler": None if getattr(opt, "loss_scaler", None) is None else opt.loss_scaler.state_dict(),
        "skipped_steps": int(getattr(opt, "skipped_steps", 0)),
        "state_dict_keys": sd_keys, "registration_order": reg_order,
        "master_dtype": dtype_name(torch.float32),
        "shards": [shard_name(r, opt.world_size) for r in range(opt.world_size)],
        "model_rest": "model_rest.pt",
    }


def _shard_tensors(opt) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for b in opt.buckets:
        for k, t in b.state_tensors().items():
            out[f"b{b.index}.{k}"] = t.detach().to(torch.float32).contiguous().clone() if t.dtype != torch.float32 \
                else t.detach().contiguous()
        p16 = _owned16(b)
        if p16 is not None:
            out[f"b{b.index}.params16"] = p16.detach().contiguous()
    out["steps"] = torch.tensor(opt.steps, dtype=torch.int64)
    return out


def _module_rest(opt) -> dict[str, torch.Tensor]:
    names = _trainable_names(opt.layout)
    return {k: v.detach().cpu().contiguous() for k, v in opt.module.state_dict().items() if k not in names}


def _versions(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    out = []
    for n in os.listdir(root):
        m = _VDIR.match(n)
        if m and os.path.isdir(os.path.join(root, n)):
            out.append((int(m.group(1)), n))
    return sorted(out)


@torch.no_grad()
def save_checkpoint(opt, path, keep: int = 1) -> str:
    """Collective. Writes a new version under the root ``path``; returns its directory.

    Call between steps (after ``step()``/``zero_grad()``): pending gradients are not saved."""
    opt.wait_for_params()              # overlap_param_gather: parameters settled first
    root = os.fspath(path)
    rank = opt.rank
    err = None
    vname = None
    if rank == 0:
        try:
            if os.path.exists(root) and not os.path.isdir(root):
                raise CheckpointError(f"checkpoint path {root!r} exists and is not a directory")
            os.makedirs(root, exist_ok=True)
            vs = _versions(root)
            vname = f"v{(vs[-1][0] + 1) if vs else 1:06d}"
            os.makedirs(os.path.join(root, vname))
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = f"{type(e).__name__}: {e}"
    names = _gather((vname, err), opt)
    vname, err0 = names[0]
    if err0 is not None:
        raise CheckpointError(f"save_checkpoint({root!r}): rank 0 could not create the version directory: {err0}")
    vdir = os.path.join(root, vname)

    # 1. every rank: its shard
    info, err = None, None
    try:
        tensors = _shard_tensors(opt)
        fname = shard_name(rank, opt.world_size)
        info = (fname, _atomic_write(os.path.join(vdir, fname), lambda f: torch.save(tensors, f), rank))
        del tensors
    except Exception as e:  # noqa: BLE001
        err = f"writing {os.path.join(vdir, shard_name(rank, opt.world_size))}: {type(e).__name__}: {e}"
    infos = _gather((info, err), opt)
    bad = [(r, e) for r, (_, e) in enumerate(infos) if e is not None]
    if bad:
        r, e = bad[0]
        raise CheckpointError(f"save_checkpoint({root!r}) failed on rank {r}: {e}; the previous checkpoint "
                              f"(if any) is still the LATEST one")

    # 2. rank 0: metadata, module rest, COMPLETE (last), LATEST pointer
    err = None
    if rank == 0:
        try:
            files = {f: i for f, i in (x for x, _ in infos)}
            meta = _metadata(opt, vname)
            files["metadata.json"] = _atomic_write(os.path.join(vdir, "metadata.json"),
                                                   lambda f: f.write(_json_bytes(meta)), rank)
            rest = _module_rest(opt)
            files["model_rest.pt"] = _atomic_write(os.path.join(vdir, "model_rest.pt"),
                                                   lambda f: torch.save(rest, f), rank)
            _fsync_dir(vdir)
            marker = {"format": FORMAT, "format_version": FORMAT_VERSION, "files": files}
            _atomic_write(os.path.join(vdir, "COMPLETE"), lambda f: f.write(_json_bytes(marker)), rank)
            _fsync_dir(vdir)
            _atomic_write(os.path.join(root, "LATEST"), lambda f: f.write(vname.encode()), rank)
            _fsync_dir(root)
            # Drop older versions (and half-written ones) beyond `keep` complete versions.
            complete = [n for _, n in _versions(root) if os.path.exists(os.path.join(root, n, "COMPLETE"))]
            keep_set = set(complete[-max(1, keep):]) | {vname}
            for _, n in _versions(root):
                if n not in keep_set:
                    shutil.rmtree(os.path.join(root, n), ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
    errs = _gather(err, opt)
    if errs[0] is not None:
        raise CheckpointError(f"save_checkpoint({root!r}) failed on rank 0 while finishing {vdir}: {errs[0]}; "
                              "the previous checkpoint (if any) is still the LATEST one")
    return vdir


# ---- reading ------------------------------------------------------------------------------------
def resolve(path) -> str:
    """The complete version directory a checkpoint path designates, or CheckpointError."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise CheckpointError(f"checkpoint {p!r} does not exist")
    if os.path.isfile(os.path.join(p, "COMPLETE")):
        return p
    if _VDIR.match(os.path.basename(os.path.normpath(p))) or os.path.isfile(os.path.join(p, "metadata.json")):
        raise CheckpointError(f"checkpoint directory {p!r} has no COMPLETE marker: its save did not finish "
                              "(crashed or still running); load the checkpoint root or an earlier version")
    latest = os.path.join(p, "LATEST")
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        vdir = os.path.join(p, name)
        if not os.path.isfile(os.path.join(vdir, "COMPLETE")):
            raise CheckpointError(f"{latest} names {name!r}, but {vdir!r} has no COMPLETE marker")
        return vdir
    vs = _versions(p)
    if vs:
        raise CheckpointError(f"checkpoint root {p!r} has no complete checkpoint (no LATEST): "
                              f"{', '.join(n for _, n in vs)} lack the COMPLETE marker (interrupted saves)")
    raise CheckpointError(f"{p!r} is not a zero_kernels checkpoint (no LATEST, no COMPLETE marker)")


def read_metadata(vdir: str) -> tuple[dict, dict]:
    """(COMPLETE marker, metadata) of a complete version directory, with format and file checks."""
    mpath = os.path.join(vdir, "COMPLETE")
    try:
        with open(mpath) as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath}: unreadable completion marker: {e}") from e
    if marker.get("format") != FORMAT or marker.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format {marker.get('format')!r} version {marker.get('format_version')!r} "
                              f"is not supported (this build reads {FORMAT!r} version {FORMAT_VERSION})")
    files = marker.get("files", {})
    for name, info in files.items():
        fp = os.path.join(vdir, name)
        if not os.path.isfile(fp):
            raise CheckpointError(f"checkpoint file {fp} is missing (listed in {mpath})")
        size = os.path.getsize(fp)
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {fp} is truncated or altered: {size} bytes on disk, "
                                  f"{info['bytes']} bytes recorded in {mpath}")
    meta_path = os.path.join(vdir, "metadata.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: unreadable metadata: {e}") from e
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('format_version')!r} "
                              f"is not supported (this build reads {FORMAT!r} version {FORMAT_VERSION})")
    for s in meta["shards"] + [meta["model_rest"]]:
        if s not in files:
            raise CheckpointError(f"checkpoint file {os.path.join(vdir, s)} is not listed in {mpath}")
    return marker, meta


def verify_checksums(vdir: str, marker: dict, names=None) -> None:
    for name, info in marker["files"].items():
        if names is not None and name not in names:
            continue
        fp = os.path.join(vdir, name)
        if _sha256(fp) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {fp} does not match its sha256 in {vdir}/COMPLETE (corrupt)")


class _Shards:
    """Lazily mmap-opened shard files of one checkpoint version."""

    def __init__(self, vdir: str, meta: dict):
        self.vdir, self.meta, self.open = vdir, meta, {}

    def get(self, rank: int, key: str) -> torch.Tensor:
        name = self.meta["shards"][rank]
        fp = os.path.join(self.vdir, name)
        if rank not in self.open:
            try:
                self.open[rank] = torch.load(fp, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise CheckpointError(f"checkpoint file {fp} cannot be read: {type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}") from e
        d = self.open[rank]
        if key not in d:
            raise CheckpointError(f"checkpoint file {fp} has no tensor {key!r}")
        return d[key]

    def close(self, rank: int | None = None) -> None:
        if rank is None:
            self.open.clear()
        else:
            self.open.pop(rank, None)


def _saved_ranges(bspec, offset: int, numel: int):
    """(saved rank, start inside its slice, count, start inside the requested range) covering
    elements [offset, offset+numel) of a saved bucket."""
    pos, end, sn = offset, offset + numel, bspec.shard_numel
    while pos < end:
        r = pos // sn
        stop = min(end, (r + 1) * sn)
        yield r, pos - r * sn, stop - pos, pos - offset
        pos = stop


def _name_index(layout) -> dict:
    out = {}
    for p in layout.params:
        for n in (p.name,) + tuple(p.aliases):
            out[n] = p
    return out


def _check_fit(opt, meta: dict, meta_path: str) -> None:
    """Parameter names, shapes, groups and optimizer kind must match the loader's model."""
    saved = Layout.from_dict(meta["layout"])
    by_name = _name_index(saved)
    mine = opt.layout
    for p in mine.params:
        sp = by_name.get(p.name) or next((by_name[a] for a in p.aliases if a in by_name), None)
        if sp is None:
            raise CheckpointError(f"{meta_path}: the model's trainable parameter {p.name!r} (shape "
                                  f"{tuple(p.shape)}) is not in the checkpoint")
        if tuple(sp.shape) != tuple(p.shape):
            raise CheckpointError(f"{meta_path}: parameter {p.name!r} has shape {tuple(sp.shape)} in the "
                                  f"checkpoint but {tuple(p.shape)} in the model")
        if sp.group != p.group:
            raise CheckpointError(f"{meta_path}: parameter {p.name!r} is in param group {sp.group} in the "
                                  f"checkpoint but in group {p.group} here: build the same param_groups")
    mine_names = _name_index(mine)
    extra = [p.name for p in saved.params if p.name not in mine_names and not any(a in mine_names for a in p.aliases)]
    if extra:
        raise CheckpointError(f"{meta_path}: the checkpoint has trainable parameter(s) the model lacks: "
                              f"{extra[:5]}{' ...' if len(extra) > 5 else ''}")
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


@torch.no_grad()
def load_checkpoint(opt, path, verify: bool = False) -> None:
    """Collective. Load a checkpoint saved at any world size/stage/bucket size into ``opt``
    (see [Note: resharding]). Nothing changes unless every rank read and checked everything.
    ``verify=True`` also checks the sha256 of the files this rank reads."""
    err = None
    staged = None
    try:
        staged = _stage_load(opt, path, verify, Layout, dtype_from_name)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    _agree(err, opt, "load_checkpoint")
    new_state, new16, meta, rest, shards = staged
    # ---- apply (every rank succeeded) ----
    opt.wait_for_params()              # no all-gather may still be writing the parameters
    for b in opt.buckets:
        st = b.state_tensors()
        for k, t in st.items():
            if k == "master" and b.master_is_param:
                continue                    # written below through the parameter buffer
            t.copy_(new_state[b.index][k])
        if b.master_is_param:
            st["master"].copy_(new_state[b.index]["master"])
        else:
            _owned16(b).copy_(new16[b.index])
    by_name = {p["name"]: p for p in meta["params"]}
    alias = {a: p for p in meta["params"] for a in p["aliases"]}
    opt.steps = [int((by_name.get(p.name) or next(alias[a] for a in (p.name,) + p.aliases if a in alias))["step"])
                  for p in opt.layout.params]
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            if k in g:
                g[k] = tuple(v) if k == "betas" else v
    if getattr(opt, "loss_scaler", None) is not None and meta.get("loss_scaler"):
        opt.loss_scaler.load_state_dict(meta["loss_scaler"])
    opt.skipped_steps = int(meta.get("skipped_steps", 0))
    msd = opt.module.state_dict()
    for k, v in rest.items():
        msd[k].copy_(v)
    shards.close()
    opt.refresh_params()                # stages 1-2 all-gather; stage 3: the next forward gathers


def _stage_load(opt, path, verify, Layout, dtype_from_name):
    vdir = resolve(path)
    marker, meta = read_metadata(vdir)
    meta_path = os.path.join(vdir, "metadata.json")
    _check_fit(opt, meta, meta_path)
    saved = Layout.from_dict(meta["layout"])
    if len(meta["shards"]) != saved.world_size:
        raise CheckpointError(f"{meta_path}: {len(meta['shards'])} shard files for world size {saved.world_size}")
    by_name = _name_index(saved)
    # Module rest (frozen parameters, buffers): small, every rank reads it.
    rest_path = os.path.join(vdir, meta["model_rest"])
    try:
        rest = torch.load(rest_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {rest_path} cannot be read: {type(e).__name__}: {e}") from e
    msd = opt.module.state_dict()
    trainable = _trainable_names(opt.layout)
    for k, v in msd.items():
        if k in trainable:
            continue
        if k not in rest:
            raise CheckpointError(f"{rest_path}: the model's {k!r} (frozen parameter or buffer) is not in the checkpoint")
        if tuple(rest[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{rest_path}: {k!r} has shape {tuple(rest[k].shape)} in the checkpoint but "
                                  f"{tuple(v.shape)} in the model")
    extra = [k for k in rest if k not in msd]
    if extra:
        raise CheckpointError(f"{rest_path}: the checkpoint has entries the model lacks: {extra[:5]}")
    rest = {k: v for k, v in rest.items()}
    shards = _Shards(vdir, meta)
    needed: set[int] = set()
    new_state: dict[int, dict[str, torch.Tensor]] = {}
    new16: dict[int, torch.Tensor] = {}
    have_ams_saved = bool(meta.get("amsgrad_state"))
    for b in opt.buckets:
        keys = list(b.state_tensors().keys())
        out = {k: torch.zeros(b.spec.shard_numel, dtype=torch.float32) for k in keys}
        p16 = None if b.master_is_param else torch.zeros(b.spec.shard_numel, dtype=b.dtype)
        for pc in b.pieces:
            mine = opt.layout.params[pc.param]
            sp = by_name.get(mine.name) or next(by_name[a] for a in mine.aliases if a in by_name)
            sb = saved.buckets[sp.bucket]
            saved16 = dtype_from_name(sb.dtype) != torch.float32
            for r, s_start, n, d_off in _saved_ranges(sb, sp.offset + pc.param_start, pc.numel):
                needed.add(r)
                dst = slice(pc.start + d_off, pc.start + d_off + n)
                src = slice(s_start, s_start + n)
                for k in keys:
                    if k == "max_exp_avg_sq" and not have_ams_saved:
                        continue                                    # fresh amsgrad state: zeros
                    out[k][dst].copy_(shards.get(r, f"b{sb.index}.{k}")[src])
                if p16 is not None:
                    if saved16 and dtype_from_name(sb.dtype) == b.dtype:
                        p16[dst].copy_(shards.get(r, f"b{sb.index}.params16")[src])
                    else:                                           # other working dtype: RNE(master)
                        p16[dst].copy_(out["master"][dst])
        new_state[b.index] = out
        if p16 is not None:
            new16[b.index] = p16
    if verify:
        verify_checksums(vdir, marker, {meta["shards"][r] for r in needed} | {"metadata.json", meta["model_rest"]})
    return new_state, new16, meta, rest, shards


# ---- offline tools -------------------------------------------------------------------------------
def _torch_group(meta: dict, g: dict) -> dict:
    """A param group dict with every key torch.optim.AdamW / Adam would hold (params excluded)."""
    cls = torch.optim.AdamW if meta["optimizer"] == "AdamW" else torch.optim.Adam
    kw = {k: g[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize") if k in g}
    kw["betas"] = tuple(kw.get("betas", (0.9, 0.999)))
    dummy = cls([torch.zeros(1, requires_grad=True)], **kw)
    out = {k: v for k, v in dummy.param_groups[0].items() if k != "params"}
    return out


@torch.no_grad()
def consolidate(path, out: str | None = None, verify: bool = True) -> dict:
    """Full fp32 model state dict + a torch.optim.AdamW/Adam state dict, built shard by shard
    (one shard file mapped at a time; no process group). Writes it to ``out`` (atomically) when given.

    Result: {"model": state_dict (trainable parameters as fp32 masters, tied names sharing one
    tensor, frozen parameters and floating buffers as fp32), "optimizer": torch optimizer state
    dict whose parameter indices follow, group by group, the module's registration order of
    trainable parameters (``param_names`` lists them), "param_names", "metadata"}."""
    vdir = resolve(path)
    marker, meta = read_metadata(vdir)
    if verify:
        verify_checksums(vdir, marker)
    lay = Layout.from_dict(meta["layout"])
    keys = ["master", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if meta.get("amsgrad_state") else [])
    full = {k: {p.index: torch.empty(p.shape, dtype=torch.float32) for p in lay.params} for k in keys}
    shards = _Shards(vdir, meta)
    for r in range(lay.world_size):
        for b in lay.buckets:
            for pc in lay.pieces(b.index, r):
                for k in keys:
                    src = shards.get(r, f"b{b.index}.{k}")[pc.start:pc.start + pc.numel]
                    full[k][pc.param].view(-1)[pc.param_start:pc.param_start + pc.numel].copy_(src)
        shards.close(r)
    rest_path = os.path.join(vdir, meta["model_rest"])
    rest = torch.load(rest_path, map_location="cpu", weights_only=True)
    by_name = _name_index(lay)
    model = {}
    for k in meta["state_dict_keys"]:
        if k in by_name:
            model[k] = full["master"][by_name[k].index]
        else:
            v = rest[k]
            model[k] = v.float() if v.is_floating_point() else v
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
        _atomic_write(os.fspath(out), lambda f: torch.save(result, f), 0)
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


if __name__ == "__main__":
    sys.exit(main())
