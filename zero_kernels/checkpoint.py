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
                                     parameter registration order, the shard file names,
                                     ``state_dict_params`` (state-dict key -> layout parameter index,
                                     joined by identity: [Note: state-dict keys] in state_keys.py) and
                                     ``tensors`` (the element count of every tensor of a shard and of
                                     model_rest.pt).
    ckpt/v000007/model_rest.pt       rank 0; frozen parameters and buffers (torch.save of a flat
                                     {state-dict key: tensor} dict)
    ckpt/v000007/.zero_kernels       written first: marks the directory as ours
                                     ([Note: checkpoint ownership] in checkpoint_format.py)
    ckpt/v000007/shard-00001-of-00004.pt
                                     rank 1's shard: torch.save of a flat {key: tensor} dict with, per
                                     bucket i of the saved layout, ``b{i}.master``, ``b{i}.exp_avg``,
                                     ``b{i}.exp_avg_sq`` (``b{i}.max_exp_avg_sq`` with amsgrad),
                                     each the rank's whole fp32 slice (shard_numel elements, padding
                                     included: zero), ``b{i}.params16`` (the 16-bit working
                                     parameters the rank owns, for 16-bit buckets) and ``steps``
                                     (int64, per layout parameter). With coded states ([Note: coded
                                     ZeRO states] in zero/coded.py) the slices are stored as the
                                     optimizer holds them: ``b{i}.exp_avg`` / ``b{i}.exp_avg_sq`` as
                                     bf16 / uint8 / float8_e4m3fn codes with ``b{i}.exp_avg_scale`` /
                                     ``b{i}.exp_avg_sq_scale`` (fp32, shard_numel / 256), and
                                     ``b{i}.master_remainder`` (int16) instead of ``b{i}.master``;
                                     metadata.json's ``state_format`` names the formats.
    ckpt/v000007/COMPLETE            written LAST: JSON {"format", "format_version", "files":
                                     {name: {"bytes", "sha256"}}}

Every file is written to a temporary name, flushed, fsync'ed and renamed, and every tensor file is
read back (mmap) and checked against the element counts recorded for it; then the version directory
is fsync'ed, then COMPLETE, then LATEST is replaced. A save that fails or dies anywhere before that
(a short tensor included, or a peer that exits: CheckpointError on the other ranks) leaves LATEST
naming the previous complete version, so the previous checkpoint stays loadable; the half-written
directory is removed by the next successful save (which keeps ``keep`` complete versions, default
1, and removes only what it wrote). All files are read with ``torch.load(weights_only=True)`` (no
code objects) or ``json``, through plain names that stay inside the checkpoint ([Note: checkpoint
names]), with sha256 checks by default ([Note: checkpoint integrity]). Every rank must see the same
filesystem path (a shared or local filesystem).

[Note: resharding]
Loading maps the saved (layout A, world A) onto the loader's (layout B, world B) through parameter
*names* (wrapper-free: saved under torch's activation-checkpoint wrapper, ``torch.compile`` or DDP,
it loads without them, and back) and per-parameter flat offsets, never through bucket positions
(bucket layouts differ across stages, world sizes and bucket sizes). For every piece of its own slices (Layout.pieces:
parameter p, elements [k, k+n) of p), a loading rank finds p in layout A (offset o, bucket a),
the element range [o+k, o+k+n) of bucket a, and the saved ranks whose slices cover it
(rank = element // shard_numel_A); it reads exactly those ranges from those shard files, opened
with ``torch.load(mmap=True)``, so its memory stays near its own shard size (with ``verify=True``,
the default, each shard file it opens is hashed whole once; ``verify=False`` touches only the pages
it needs). Steps, hyperparameters and loss-scaler state come from the checkpoint. States travel as fp32
(``Shards.fp32`` decodes coded ones) and are encoded into the loader's format (re-blocking requantizes
blockwise 8-bit / fp8 moments: the dequantized states then agree within one quantization step, and a
UserWarning says so); a load into the same layout and state format copies the stored tensors, bit for bit.
Everything is read and checked (files present, sizes match COMPLETE, format version, parameter
names and shapes, buffers) and the ranks agree that nobody failed BEFORE any state is changed.
"""
from __future__ import annotations

import os
import sys
import uuid
import warnings
from typing import Any, Callable

import torch

from . import codecs
from .checkpoint_format import (FORMAT, FORMAT_VERSION, CheckpointError, Shards, atomic_write, canonical,
                                check_numels, check_state_codes, fsync_dir, json_bytes, load_small, new_version,
                                foreign_versions, lineage_of, prune, read_metadata, resolve, shard_name, versions)
from .checkpoint_tools import check_fit, consolidate, inspect, main
from .layout import Layout, dtype_name
from .state_keys import keyed_state
from .zero import collectives as C
from .zero.mesh import fingerprint, same_everywhere

__all__ = ["save_checkpoint", "load_checkpoint", "check_keep", "consolidate", "inspect", "main", "resolve",
           "read_metadata", "CheckpointError", "FORMAT", "FORMAT_VERSION"]

# Test hook: called as _FAULT(rank, file_name) after each file this process writes (raise to
# simulate a crash in the writer).
_FAULT: Callable[[int, str], None] | None = None


# ---- small file helpers -----------------------------------------------------------------------
def _atomic_write(final: str, write: Callable[[Any], None], rank: int) -> dict:
    """atomic_write, then the test hook."""
    info = atomic_write(final, write)
    if _FAULT is not None:
        _FAULT(rank, os.path.basename(final))
    return info


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


# ---- collectives (tiny objects only) ------------------------------------------------------------
def _gather(obj, opt, what: str) -> list:
    """Every rank's ``obj`` (JSON-able: tuples come back as lists), bounded by ``timeout=`` ([Note: collective
    timeouts]); a peer that died, left or timed out raises CheckpointError (not gloo's raw "connection
    reset"), naming the operation."""
    if opt.world_size == 1:
        return [obj]
    try:
        return C.exchange_json(obj, opt.process_group, f"{what.split('(')[0]} status exchange")
    except RuntimeError as e:               # DistBackendError / gloo errors / CollectiveTimeoutError included
        first = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{what}: exchanging status with the other {opt.world_size - 1} rank(s) failed on "
                              f"rank {opt.rank}: {first}. Likely cause: another rank died, exited or timed out "
                              "during the collective (check its log)"
                              + ("; the previous checkpoint (if any) is still the LATEST one"
                                 if what.startswith("save") else "; nothing was loaded")) from e


def _agree(err: str | None, opt, what: str) -> None:
    """Raise on every rank when any rank failed (its message first)."""
    errs = _gather(err, opt, what)
    failed = any(e is not None for e in errs) or err is not None
    if opt.mesh.any_replica(failed) and not failed:       # [Note: hybrid sharding]: every row or none
        raise CheckpointError(f"{what} failed on another replica of the mesh (see its log); nothing changed")
    if err is not None:
        raise CheckpointError(err)
    bad = [(r, e) for r, e in enumerate(errs) if e is not None]
    if bad:
        r, e = bad[0]
        raise CheckpointError(f"{what} failed on rank {r} of {opt.world_size}: {e}")


# ---- save ------------------------------------------------------------------------------------------
def _keyed(opt) -> list:
    """[Note: state-dict keys]: (key, ParamSpec or None, tensor) of the module's state dict."""
    return keyed_state(opt.module, opt.buckets)


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
    sd_keys = list(module.state_dict(keep_vars=True).keys())
    # the layout's parameters in registration order (p.requires_grad now would drop one frozen for a while,
    # and consolidate would put it last: its states on another parameter of a torch optimizer)
    in_layout = {p.name for p in lay.params}
    reg_order = [n for n, p in module.named_parameters() if n in in_layout]
    # each group's parameters in the order the optimizer's param_groups list them: the indices a torch
    # optimizer built from the same groups gives them (consolidate follows it)
    first = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), n)
    group_order = [[first[id(p)] for p in g["params"] if first.get(id(p)) in in_layout] for g in opt.param_groups]
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "version_dir": version_dir_name,
        "torch_version": torch.__version__, "stage": int(opt.stage), "world_size": int(opt.world_size),
        "psi": int(lay.numel), "optimizer": "AdamW" if opt.adamw else "Adam",
        "layout_fingerprint": lay.fingerprint(), "layout": lay.to_dict(),
        "params": [{"name": p.name, "aliases": list(p.aliases), "shape": list(p.shape), "dtype": p.dtype,
                    "group": p.group, "step": int(opt.steps[p.index])} for p in lay.params],
        "param_groups": groups,
        "amsgrad_state": any(b.amsgrad for b in opt.buckets),
        **opt.scaling.state_dict(),                 # "loss_scaler", "skipped_steps": as the shard state dict's
        "state_dict_keys": sd_keys, "registration_order": reg_order, "group_order": group_order,
        "master_dtype": dtype_name(torch.float32),
        "state_format": _state_format(opt),
        "shards": _shard_files(opt),
        "model_rest": "model_rest.pt",
        "lineage": opt.checkpoint_lineage,          # [Note: checkpoint lineage]: adopted by load_checkpoint
    }


_FP32_STATES = {"exp_avg_dtype": "float32", "exp_avg_sq_dtype": "float32", "store_param_remainders": False}


def _state_format(opt) -> dict:
    """The format names of metadata.json; with uint8 moments, their code (codecs.U8_CODE) as ``u8_code``."""
    fmt = opt.config.state_format
    out = {"exp_avg_dtype": dtype_name(fmt.exp_avg_dtype), "exp_avg_sq_dtype": dtype_name(fmt.exp_avg_sq_dtype),
           "store_param_remainders": bool(fmt.store_param_remainders)}
    if torch.uint8 in (fmt.exp_avg_dtype, fmt.exp_avg_sq_dtype):
        out["u8_code"] = codecs.U8_CODE
    return out


def _shard_numels(opt) -> dict[str, int]:
    """Element count of every tensor of a shard file, from the layout (the same for every rank)."""
    shard = {"steps": len(opt.layout.params)}
    for b in opt.buckets:
        for k, t in list(b.state_tensors().items()) + ([] if _owned16(b) is None else [("params16", None)]):
            shard[f"b{b.index}.{k}"] = int(b.spec.shard_numel) if t is None else t.numel()
    return shard


def _record(opt, keyed) -> dict:
    """What a save records beside _metadata: the state-dict join (key -> layout parameter index) and
    every tensor's element count (checked after writing, before COMPLETE, and on every read)."""
    return {"state_dict_params": {k: ps.index for k, ps, _ in keyed if ps is not None},
            "tensors": {"shard": _shard_numels(opt),
                        "model_rest.pt": {k: v.numel() for k, ps, v in keyed if ps is None}}}


def _shard_tensors(opt) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for b in opt.buckets:
        for k, t in b.state_tensors().items():
            out[f"b{b.index}.{k}"] = t.detach().contiguous()       # as stored (fp32, or codes)
        p16 = _owned16(b)
        if p16 is not None:
            out[f"b{b.index}.params16"] = p16.detach().contiguous()
    out["steps"] = torch.tensor(opt.steps, dtype=torch.int64)
    return out


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _write_shard(opt, vdir: str, expected: dict) -> tuple:
    """Every rank: its shard, written atomically and checked against the recorded element counts."""
    fname = shard_name(opt.rank, opt.world_size)
    fp = os.path.join(vdir, fname)
    try:
        tensors = _shard_tensors(opt)
        info = _atomic_write(fp, lambda f: torch.save(tensors, f), opt.rank)
        del tensors
        check_numels(fp, expected)
        return (fname, info), None
    except Exception as e:  # noqa: BLE001 - reported to every rank
        return None, f"writing {fp}: {_describe(e)}"


def _finish(opt, root: str, vdir: str, vname: str, infos: list, keep: int) -> None:
    """Rank 0: metadata, module rest (checked), COMPLETE (last), LATEST, pruning of this lineage's old versions."""
    files = {f: i for f, i in (x for x, _ in infos)}
    keyed = _keyed(opt)
    meta = {**_metadata(opt, vname), **_record(opt, keyed)}
    files["metadata.json"] = _atomic_write(os.path.join(vdir, "metadata.json"),
                                           lambda f: f.write(json_bytes(meta)), opt.rank)
    rest = {k: v.detach().cpu().contiguous() for k, ps, v in keyed if ps is None}
    rest_path = os.path.join(vdir, "model_rest.pt")
    files["model_rest.pt"] = _atomic_write(rest_path, lambda f: torch.save(rest, f), opt.rank)
    check_numels(rest_path, meta["tensors"]["model_rest.pt"])
    fsync_dir(vdir)
    marker = {"format": FORMAT, "format_version": FORMAT_VERSION, "files": files}
    _atomic_write(os.path.join(vdir, "COMPLETE"), lambda f: f.write(json_bytes(marker)), opt.rank)
    fsync_dir(vdir)
    _atomic_write(os.path.join(root, "LATEST"), lambda f: f.write(vname.encode()), opt.rank)
    fsync_dir(root)
    # [Note: checkpoint lineage]: drop this lineage's older versions (and half-written ones) beyond `keep`.
    lineage = opt.checkpoint_lineage
    ours = [n for _, n in versions(root) if lineage_of(os.path.join(root, n)) == lineage
            and os.path.exists(os.path.join(root, n, "COMPLETE"))]
    prune(root, set(ours[-keep:]) | {vname}, lineage)


def _warn_foreign(root: str, lineage: str, vname: str) -> None:
    others = [n for n in foreign_versions(root, lineage) if n != vname]
    if others:
        warnings.warn(f"save_checkpoint({root!r}): the root also holds {len(others)} version(s) this optimizer did "
                      f"not write and did not load ({', '.join(others[:4])}{' ...' if len(others) > 4 else ''}): they "
                      f"are kept (keep= counts only this run's versions) and LATEST now names this save ({vname}). "
                      "Two optimizers (a GAN's G and D) need two roots ([Note: checkpoint lineage])",
                      UserWarning, stacklevel=4)


def check_keep(keep) -> int:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"save_checkpoint: keep must be a positive int (the number of complete versions of this "
                         f"run to keep under the root), got {keep!r}")
    return keep


@torch.no_grad()
def save_checkpoint(opt, path, keep: int = 1) -> str:
    """Collective. Writes a new version under the root ``path``; returns its directory. ``path``
    must be new, empty or a checkpoint root ([Note: checkpoint ownership]). ``keep``: how many complete
    versions of this run ([Note: checkpoint lineage]) stay under the root; older ones are removed.

    Call between steps (after ``step()``/``zero_grad()``): pending gradients are not saved."""
    keep = check_keep(keep)
    opt.wait_for_params()              # overlap_param_gather: parameters settled first
    root = os.fspath(path)
    what = f"save_checkpoint({root!r})"
    vname, err = None, None
    lineage = opt.checkpoint_lineage or uuid.uuid4().hex
    if opt.rank == 0:
        try:
            vname = new_version(root, lineage, list(_written_files(opt)))
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = _describe(e)
    vname, lineage, err0 = _gather((vname, lineage, err), opt, what)[0]
    if err0 is not None:
        raise CheckpointError(f"{what}: rank 0 could not create the version directory: {err0}")
    opt.checkpoint_lineage = lineage          # rank 0's: every rank agrees on the run it saves
    vdir = os.path.join(root, vname)
    infos = _gather(_write_shard(opt, vdir, _shard_numels(opt)), opt, what)
    bad = [(r, e) for r, (_, e) in enumerate(infos) if e is not None]
    if bad:
        r, e = bad[0]
        raise CheckpointError(f"{what} failed on rank {r}: {e}; the previous checkpoint (if any) is still the "
                              "LATEST one")
    err = None
    if opt.rank == 0:
        try:
            _finish(opt, root, vdir, vname, infos, keep)
        except Exception as e:  # noqa: BLE001
            err = _describe(e)
    errs = _gather(err, opt, what)
    if errs[0] is not None:
        raise CheckpointError(f"{what} failed on rank 0 while finishing {vdir}: {errs[0]}; "
                              "the previous checkpoint (if any) is still the LATEST one")
    if opt.rank == 0:
        _warn_foreign(root, lineage, vname)
    return vdir


def _shard_files(opt) -> list[str]:
    """The shard files of a save of ``opt``, rank 0 first (metadata.json's "shards")."""
    return [shard_name(r, opt.world_size) for r in range(opt.world_size)]


def _written_files(opt) -> list[str]:
    """Every file a save of ``opt`` writes into its version directory (named in the owner file)."""
    return ["metadata.json", "model_rest.pt", "COMPLETE"] + _shard_files(opt)


# ---- reading ------------------------------------------------------------------------------------
def _saved_ranges(bspec, offset: int, numel: int):
    """(saved rank, start inside its slice, count, start inside the requested range) covering
    elements [offset, offset+numel) of a saved bucket."""
    pos, end, sn = offset, offset + numel, bspec.shard_numel
    while pos < end:
        r = pos // sn
        stop = min(end, (r + 1) * sn)
        yield r, pos - r * sn, stop - pos, pos - offset
        pos = stop


@torch.no_grad()
def load_checkpoint(opt, path, verify: bool = True) -> None:
    """Collective. Load a checkpoint saved at any world size/stage/bucket size into ``opt``
    (see [Note: resharding]). Nothing changes unless every rank read and checked everything,
    the sha256 of every file this rank reads included (``verify=False`` skips the tensor files';
    [Note: checkpoint integrity])."""
    err = None
    staged = None
    try:
        staged = _stage_load(opt, path, verify)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    _agree(err, opt, "load_checkpoint")
    new_state, new16, meta, rest, shards, steps, identity = staged
    if not same_everywhere(identity, opt.mesh):
        shards.close()
        raise CheckpointError(f"load_checkpoint({os.fspath(path)!r}): the ranks did not read the same checkpoint "
                              f"version (this rank read {meta.get('version_dir')!r}): a save into the root finished "
                              "while they resolved LATEST, or the ranks were given different paths. Pass every rank "
                              "the same version directory (e.g. root/v000007); nothing was loaded on any rank")
    # ---- apply (every rank succeeded) ----
    opt.wait_for_params()              # no all-gather may still be writing the parameters
    for b in opt.buckets:
        if b.index in new16:                # same layout and format: the stored tensors, bit for bit
            for k, t in b.state_tensors().items():
                t.copy_(new_state[b.index][k])
            if new16[b.index] is not None:
                _owned16(b).copy_(new16[b.index])
        else:                               # fp32 states, encoded into this optimizer's format
            b.store_fp32_states(new_state[b.index], max(steps, default=0))
    opt.steps = steps
    if isinstance(meta.get("lineage"), str):
        opt.checkpoint_lineage = meta["lineage"]     # [Note: checkpoint lineage]: a resumed run continues it
    saved_fmt = meta.get("state_format", _FP32_STATES)
    fmt = opt.config.state_format
    blockwise = [k for k in ("exp_avg", "exp_avg_sq") if getattr(fmt, k + "_dtype") in codecs.BLOCKWISE]
    if saved_fmt != _state_format(opt):
        warnings.warn(f"load_checkpoint converted the optimizer states from the checkpoint's format {saved_fmt} to this "
                      f"optimizer's {_state_format(opt)}: decoded to fp32 and encoded with zero_kernels.codecs "
                      "([Note: coded ZeRO states])", UserWarning, stacklevel=3)
    elif blockwise and not new16:
        warnings.warn(f"load_checkpoint re-blocked the blockwise {' and '.join(blockwise)} states: the checkpoint was "
                      f"saved at world size {meta.get('world_size')} with another bucket layout than this optimizer's "
                      f"(world size {opt.world_size}), so its {codecs.BLOCK}-element blocks were decoded and "
                      "quantized again; the dequantized states agree with the saved ones within one quantization "
                      "step ([Note: resharding]). Saved and loaded with the same layout they load bit for bit",
                      UserWarning, stacklevel=3)
    for g, saved in zip(opt.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            if k in g:
                g[k] = tuple(v) if k == "betas" else v
    opt.scaling.load_state_dict({"loss_scaler": meta.get("loss_scaler"), "skipped_steps": meta.get("skipped_steps", 0)})
    msd = opt.module.state_dict(keep_vars=True)
    for k, v in rest.items():
        msd[k].copy_(v)
    shards.close()
    opt.refresh_params()                # stages 1-2 all-gather; stage 3: the next forward gathers


def _load_rest(opt, vdir: str, marker: dict, meta: dict, verify: bool) -> dict:
    """model_rest.pt (frozen parameters, buffers: small, every rank reads it), keyed by the loader's
    state-dict keys (wrapper-free names matched), shapes checked."""
    rest_path = os.path.join(vdir, meta["model_rest"])
    saved = load_small(vdir, meta["model_rest"], marker, verify, meta.get("tensors", {}).get("model_rest.pt"))
    mine = {k: v for k, ps, v in _keyed(opt) if ps is None}
    mc, sc = canonical(mine, "the model"), canonical(saved, rest_path)
    by_c = {sc[k]: k for k in saved}
    out = {}
    for k, v in mine.items():
        sk = by_c.get(mc[k])
        if sk is None:
            raise CheckpointError(f"{rest_path}: the model's {k!r} (frozen parameter or buffer) is not in the checkpoint")
        if tuple(saved[sk].shape) != tuple(v.shape):
            raise CheckpointError(f"{rest_path}: {k!r} has shape {tuple(saved[sk].shape)} in the checkpoint but "
                                  f"{tuple(v.shape)} in the model")
        out[k] = saved[sk]
    extra = sorted(set(saved) - {by_c[mc[k]] for k in mine})
    if extra:
        raise CheckpointError(f"{rest_path}: the checkpoint has entries the model lacks: {extra[:5]}")
    return out


def _stage_load(opt, path, verify):
    vdir = resolve(path)
    marker, meta = read_metadata(vdir)
    identity = fingerprint(marker)          # every file's sha256: the same on every rank reading one version
    meta_path = os.path.join(vdir, "metadata.json")
    check_state_codes(meta, meta_path)
    match = check_fit(opt, meta, meta_path)
    saved = Layout.from_dict(meta["layout"])
    steps = [int(meta["params"][match[p.index].index]["step"]) for p in opt.layout.params]
    rest = _load_rest(opt, vdir, marker, meta, verify)
    shards = Shards(vdir, meta, marker, verify)
    new_state: dict[int, dict[str, torch.Tensor]] = {}
    new16: dict[int, torch.Tensor | None] = {}      # filled for buckets loaded as stored (bit for bit)
    have_ams_saved = bool(meta.get("amsgrad_state"))
    if _stored_as_is(opt, meta):
        for b in opt.buckets:
            new_state[b.index] = {k: shards.get(opt.rank, f"b{b.index}.{k}") for k in b.state_tensors()}
            new16[b.index] = None if _owned16(b) is None else shards.get(opt.rank, f"b{b.index}.params16")
        return new_state, new16, meta, rest, shards, steps, identity
    for b in opt.buckets:
        keys = ["master", "exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if b.amsgrad else [])
        out = {k: torch.zeros(b.spec.shard_numel, dtype=torch.float32) for k in keys}
        for pc in b.pieces:            # 16-bit working slices become RNE(master), as every step writes them
            sp = match[pc.param]
            sb = saved.buckets[sp.bucket]
            for r, s_start, n, d_off in _saved_ranges(sb, sp.offset + pc.param_start, pc.numel):
                dst = slice(pc.start + d_off, pc.start + d_off + n)
                src = slice(s_start, s_start + n)
                for k in keys:
                    if k == "max_exp_avg_sq" and not have_ams_saved:
                        continue                                    # fresh amsgrad state: zeros
                    out[k][dst].copy_(shards.fp32(r, sb.index, k)[src])
        new_state[b.index] = out
    return new_state, new16, meta, rest, shards, steps, identity


def _stored_as_is(opt, meta: dict) -> bool:
    """The checkpoint holds this rank's slices exactly as this optimizer stores them (same layout, world size
    and coded state format): they load by copying ([Note: resharding])."""
    fmt = meta.get("state_format")
    return (opt.config.state_format.coded and fmt == _state_format(opt) and meta.get("world_size") == opt.world_size
            and meta.get("layout_fingerprint") == opt.layout.fingerprint())


if __name__ == "__main__":
    sys.exit(main())
