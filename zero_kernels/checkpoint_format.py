"""The on-disk side of zero_kernels checkpoints: which directories are ours, safe names, integrity.
(The format itself: [Note: checkpoint format] in checkpoint.py.)

[Note: checkpoint ownership]
A version directory is *ours* when it holds the ``.zero_kernels`` file (written first, right after
the directory is created) or a COMPLETE marker of our format (checkpoints written before the owner
file existed). Only our version directories count as versions. A save refuses a non-empty directory
that is not a checkpoint root (none of our versions inside).

[Note: checkpoint lineage]
The owner file also names the save's *lineage* (a random token) and the files the save will write.
An optimizer takes a lineage at its first save, or adopts the loaded checkpoint's at
``load_checkpoint`` (a resumed run continues the run it resumed). Pruning (``keep``) removes only
versions of the saving optimizer's own lineage, complete beyond ``keep`` or half-written, and in them
only the files their owner file names (with their temporaries), then the owner file, then the
directory if it is empty: versions another optimizer wrote into the same root (a GAN's G and D, two
jobs, a rerun from scratch) and anything a user put there survive. Versions written before owner
files named a lineage are never pruned.

[Note: checkpoint names]
LATEST, the shard and model_rest names in metadata.json and the file names in COMPLETE are plain
file names: never ``..``, a separator or an absolute path, and the joined path (symbolic links
resolved) stays inside its directory. Anything else is refused, not followed.

[Note: checkpoint integrity]
COMPLETE records every file's size and sha256, metadata.json included. On read: sizes always;
metadata.json's sha256 always (it is small and parsed whole); the sha256 of each tensor file the
reader opens unless ``verify=False`` (hashed as it is opened: the bytes are read anyway). Every
tensor read is checked against the element count metadata.json records for it ("tensors"), and
the saved layout must tile each bucket exactly (``validate_layout``).
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import uuid
from typing import Any, Callable

import torch

from . import codecs
from .layout import Layout, dtype_from_name

from .state_keys import canonical_names

__all__ = ["FORMAT", "FORMAT_VERSION", "OWNER_FILE", "CheckpointError", "shard_name", "safe_join", "versions",
           "check_state_codes",
           "check_root", "new_version", "prune", "lineage_of", "foreign_versions", "resolve", "read_metadata",
           "validate_layout", "load_small",
           "check_numels", "Shards", "sha256_file", "fsync_dir", "json_bytes", "atomic_write", "saved_layout",
           "canonical", "param_names"]

FORMAT = "zero_kernels.checkpoint"
FORMAT_VERSION = 1
OWNER_FILE = ".zero_kernels"
VDIR = re.compile(r"^v(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, of another format version, or does not fit."""


def fsync_dir(path: str) -> None:
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


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=False).encode()


def atomic_write(final: str, write: Callable[[Any], None]) -> dict:
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
    return {"bytes": os.path.getsize(final), "sha256": sha256_file(final)}


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


# ---- [Note: checkpoint names] ---------------------------------------------------------------------
def safe_join(directory: str, name, what: str, source: str) -> str:
    """``directory/name`` when ``name`` is a plain file name that stays inside ``directory``."""
    plain = (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
             and "/" not in name and "\\" not in name and not os.path.isabs(name))
    if not plain:
        raise CheckpointError(f"{source}: {what} {name!r} is not a plain file name inside {directory!r}; "
                              "checkpoint names never leave the checkpoint (refusing '..', separators and "
                              "absolute paths)")
    path = os.path.join(directory, name)
    base = os.path.realpath(directory)
    if os.path.commonpath([os.path.realpath(path), base]) != base:
        raise CheckpointError(f"{source}: {what} {name!r} resolves to {os.path.realpath(path)!r}, outside "
                              f"{base!r} (a symbolic link): refusing to follow it")
    return path


# ---- [Note: checkpoint ownership] -----------------------------------------------------------------
def _ours(vdir: str) -> bool:
    if os.path.isfile(os.path.join(vdir, OWNER_FILE)):
        return True
    try:
        with open(os.path.join(vdir, "COMPLETE")) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def versions(root: str) -> list[tuple[int, str]]:
    """(number, name) of the version directories this project wrote under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for n in os.listdir(root):
        m = VDIR.match(n)
        p = os.path.join(root, n)
        if m and os.path.isdir(p) and not os.path.islink(p) and _ours(p):
            out.append((int(m.group(1)), n))
    return sorted(out)


def check_root(root: str) -> None:
    """A save may write under ``root``: absent, empty, or a checkpoint root (one of our versions)."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"checkpoint path {root!r} exists and is not a directory")
    if not os.path.isdir(root) or not os.listdir(root):
        return
    if versions(root):
        return
    raise CheckpointError(f"{root!r} is a non-empty directory that is not a zero_kernels checkpoint root (no "
                          "version directory written by zero_kernels): refusing to save there, since saves "
                          "replace LATEST and prune old versions; choose a new or empty directory")


def new_version(root: str, lineage: str, files: list[str]) -> str:
    """Create the next version directory under ``root`` with its owner file, which names the save's
    ``lineage`` and the ``files`` it will write ([Note: checkpoint lineage]); returns its name."""
    check_root(root)
    os.makedirs(root, exist_ok=True)
    vs = versions(root)
    n = (vs[-1][0] + 1) if vs else 1
    while True:
        name = f"v{n:06d}"
        try:
            os.makedirs(os.path.join(root, name))
            break
        except FileExistsError:            # a directory we did not write (or a concurrent save's): never reuse it
            n += 1
    with open(os.path.join(root, name, OWNER_FILE), "wb") as f:
        f.write(json_bytes({"format": FORMAT, "format_version": FORMAT_VERSION, "lineage": lineage,
                            "files": list(files)}))
    return name


def _owner(vdir: str) -> dict:
    """The owner file's record ({} when absent or unreadable: written before owner files, or not ours)."""
    try:
        with open(os.path.join(vdir, OWNER_FILE)) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def lineage_of(vdir: str) -> str | None:
    lin = _owner(vdir).get("lineage")
    return lin if isinstance(lin, str) else None


def prune(root: str, keep: set[str], lineage: str) -> None:
    """Remove the versions of ``lineage`` not in ``keep``: only the files their owner file names (and their
    temporaries), then the owner file and the directory if nothing else is left ([Note: checkpoint lineage])."""
    for _, name in versions(root):
        vdir = os.path.join(root, name)
        if name in keep or lineage_of(vdir) != lineage:
            continue
        written = {f for f in _owner(vdir).get("files", []) if isinstance(f, str) and "/" not in f}
        written |= {"COMPLETE", "metadata.json", "model_rest.pt"}
        for f in os.listdir(vdir):
            p = os.path.join(vdir, f)
            if os.path.isfile(p) and not os.path.islink(p) and (
                    f in written or any(f.startswith(w + ".tmp-") for w in written)):
                os.remove(p)
        os.remove(os.path.join(vdir, OWNER_FILE))      # the version is gone (a user's files may stay)
        try:
            os.rmdir(vdir)
        except OSError:
            pass                            # someone else's files are inside: keep them


def foreign_versions(root: str, lineage: str) -> list[str]:
    """Names of the versions under ``root`` written by another lineage (or before lineages were recorded)."""
    return [n for _, n in versions(root) if lineage_of(os.path.join(root, n)) != lineage]


# ---- reading ----------------------------------------------------------------------------------------
def resolve(path) -> str:
    """The complete version directory a checkpoint path designates, or CheckpointError."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise CheckpointError(f"checkpoint {p!r} does not exist")
    if os.path.isfile(os.path.join(p, "COMPLETE")):
        return p
    if VDIR.match(os.path.basename(os.path.normpath(p))) or os.path.isfile(os.path.join(p, "metadata.json")):
        raise CheckpointError(f"checkpoint directory {p!r} has no COMPLETE marker: its save did not finish "
                              "(crashed or still running); load the checkpoint root or an earlier version")
    latest = os.path.join(p, "LATEST")
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        vdir = safe_join(p, name, "the version named", latest)
        if not VDIR.match(name):
            raise CheckpointError(f"{latest} names {name!r}, which is not a version directory name (v000001)")
        if not os.path.isfile(os.path.join(vdir, "COMPLETE")):
            raise CheckpointError(f"{latest} names {name!r}, but {vdir!r} has no COMPLETE marker")
        return vdir
    vs = versions(p)
    done = [n for _, n in vs if os.path.isfile(os.path.join(p, n, "COMPLETE"))]
    if done:
        raise CheckpointError(f"checkpoint root {p!r} has no LATEST, but {', '.join(done)} "
                              f"{'is' if len(done) == 1 else 'are'} complete (a save was interrupted after its "
                              f"COMPLETE marker, before LATEST was written): load one by its path, e.g. "
                              f"{os.path.join(p, done[-1])!r}")
    if vs:
        raise CheckpointError(f"checkpoint root {p!r} has no complete checkpoint (no LATEST): "
                              f"{', '.join(n for _, n in vs)} lack the COMPLETE marker (interrupted saves)")
    raise CheckpointError(f"{p!r} is not a zero_kernels checkpoint (no LATEST, no COMPLETE marker)")


def _check_format(d: dict, where: str) -> None:
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("format_version") != FORMAT_VERSION:
        d = d if isinstance(d, dict) else {}
        raise CheckpointError(f"{where}: format {d.get('format')!r} version {d.get('format_version')!r} "
                              f"is not supported (this build reads {FORMAT!r} version {FORMAT_VERSION})")


def check_state_codes(meta: dict, where: str) -> None:
    """CheckpointError unless the checkpoint's uint8 moment codes (if any) are this build's
    (``state_format.u8_code`` == codecs.U8_CODE): checked before any shard is decoded."""
    fmt = meta.get("state_format") or {}
    if "uint8" in (fmt.get("exp_avg_dtype"), fmt.get("exp_avg_sq_dtype")):
        why = codecs.u8_code_problem(fmt.get("u8_code"))
        if why is not None:
            raise CheckpointError(f"{where}: {why}")


def read_metadata(vdir: str) -> tuple[dict, dict]:
    """(COMPLETE marker, metadata) of a complete version directory: formats, names, sizes and the
    sha256 of metadata.json checked ([Note: checkpoint integrity])."""
    mpath = os.path.join(vdir, "COMPLETE")
    try:
        with open(mpath) as f:
            marker = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath}: unreadable completion marker: {e}") from e
    _check_format(marker, mpath)
    files = marker.get("files", {})
    for name, info in files.items():
        fp = safe_join(vdir, name, "file", mpath)
        if not os.path.isfile(fp):
            raise CheckpointError(f"checkpoint file {fp} is missing (listed in {mpath})")
        size = os.path.getsize(fp)
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {fp} is truncated or altered: {size} bytes on disk, "
                                  f"{info['bytes']} bytes recorded in {mpath}")
    meta_path = os.path.join(vdir, "metadata.json")
    if "metadata.json" not in files:
        raise CheckpointError(f"{meta_path} is not listed in {mpath}")
    data = _read_checked(vdir, "metadata.json", marker, True)
    try:
        meta = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{meta_path}: unreadable metadata: {e}") from e
    _check_format(meta, meta_path)
    for s in list(meta["shards"]) + [meta["model_rest"]]:
        safe_join(vdir, s, "file name", meta_path)
        if s not in files:
            raise CheckpointError(f"checkpoint file {os.path.join(vdir, s)} is not listed in {mpath}")
    return marker, meta


def _read_checked(vdir: str, name: str, marker: dict, verify: bool) -> bytes:
    path = safe_join(vdir, name, "file", os.path.join(vdir, "COMPLETE"))
    with open(path, "rb") as f:
        data = f.read()
    if verify and hashlib.sha256(data).hexdigest() != marker["files"][name]["sha256"]:
        hint = ("metadata.json is always checked: it cannot be read past this" if name == "metadata.json" else
                "load with verify=False only to inspect a damaged checkpoint")
        raise CheckpointError(f"checkpoint file {path} does not match its sha256 in {vdir}/COMPLETE (corrupt "
                              f"or edited); {hint}")
    return data


def validate_layout(lay, where: str) -> None:
    """The saved layout tiles every bucket exactly: each parameter once, in range, no overlap."""
    seen: set[int] = set()
    for b in lay.buckets:
        if b.shard_numel * lay.world_size != b.padded_numel or b.padded_numel < b.numel:
            raise CheckpointError(f"{where}: bucket {b.index} has numel {b.numel}, padded {b.padded_numel}, "
                                  f"shard {b.shard_numel} at world size {lay.world_size}: inconsistent layout")
        pos = 0
        for pi in sorted(b.params, key=lambda i: lay.params[i].offset):
            p = lay.params[pi]
            if p.bucket != b.index or p.offset != pos or p.numel != math.prod(p.shape) or pi in seen:
                raise CheckpointError(f"{where}: parameter {p.name!r} (offset {p.offset}, numel {p.numel}, shape "
                                      f"{tuple(p.shape)}) does not tile bucket {b.index} at element {pos}: "
                                      "the layout does not cover every element exactly once")
            seen.add(pi)
            pos += p.numel
        if pos != b.numel:
            raise CheckpointError(f"{where}: bucket {b.index} records {b.numel} elements, its parameters {pos}")
    if len(seen) != len(lay.params):
        raise CheckpointError(f"{where}: {len(lay.params) - len(seen)} parameter(s) belong to no bucket")


def saved_layout(meta: dict, meta_path: str):
    """The saved Layout, validated (``validate_layout``) and matching the shard count."""
    try:
        lay = Layout.from_dict(meta["layout"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: unreadable layout: {type(e).__name__}: {e}") from e
    validate_layout(lay, meta_path)
    if len(meta["shards"]) != lay.world_size:
        raise CheckpointError(f"{meta_path}: {len(meta['shards'])} shard files for world size {lay.world_size}")
    return lay


def canonical(names, where: str) -> dict[str, str]:
    """canonical_names ([Note: state-dict keys]) with a collision reported as CheckpointError."""
    try:
        return canonical_names(names)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


def param_names(p) -> tuple[str, ...]:
    """A ParamSpec's name and its aliases (tied weights)."""
    return (p.name,) + tuple(p.aliases)


def _check_tensor(t, key: str, expected: dict | None, path: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"checkpoint file {path}: entry {key!r} is not a tensor")
    if expected is not None and key in expected and t.numel() != expected[key]:
        raise CheckpointError(f"checkpoint file {path}: tensor {key!r} has {t.numel()} elements, "
                              f"{expected[key]} recorded for it")


_SHARD_KEY = re.compile(r"^b(\d+)\.(.+)$")
_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8,
                 "float8_e4m3fn": torch.float8_e4m3fn}


def shard_dtype(meta: dict, key: str) -> torch.dtype | None:
    """The dtype shard tensor ``key`` has by metadata.json (its ``state_format``, absent: fp32 states, and the
    bucket's dtype for ``params16``); None for a key this build does not name. The decoders pick a codec by the
    tensor's dtype, so a tensor of another dtype would decode to wrong values without this check."""
    if key == "steps":
        return torch.int64
    m = _SHARD_KEY.match(key)
    if m is None:
        return None
    name, fmt = m[2], meta.get("state_format") or {}
    if name in ("exp_avg", "exp_avg_sq"):
        return _STATE_DTYPES.get(fmt.get(f"{name}_dtype", "float32"))
    if name in ("master", "max_exp_avg_sq") or name.endswith("_scale"):
        return torch.float32
    if name == "master_remainder":
        return torch.int16
    if name == "params16":
        try:
            return dtype_from_name(meta["layout"]["buckets"][int(m[1])]["dtype"])
        except (KeyError, IndexError, TypeError):
            return None
    return None


def load_small(vdir: str, name: str, marker: dict, verify: bool, expected: dict | None) -> dict:
    """torch.load of a small file (model_rest.pt), hashed while read, tensors checked against the record."""
    path = os.path.join(vdir, name)
    data = _read_checked(vdir, name, marker, verify)
    try:
        d = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {type(e).__name__}: {e}") from e
    for k, t in d.items():
        _check_tensor(t, k, expected, path)
    if expected is not None and set(expected) != set(d):
        raise CheckpointError(f"checkpoint file {path}: entries {sorted(set(expected) ^ set(d))[:5]} differ "
                              "from the ones metadata.json records")
    return d


def check_numels(path: str, expected: dict[str, int]) -> None:
    """After a save: the file holds exactly the recorded tensors with the recorded element counts."""
    d = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if set(d) != set(expected):
        raise CheckpointError(f"{path} holds {sorted(set(d) ^ set(expected))[:5]} beyond/short of the "
                              "tensors recorded for it")
    for k, t in d.items():
        _check_tensor(t, k, expected, path)


class Shards:
    """Lazily mmap-opened shard files of one checkpoint version; each file's sha256 is checked as
    it is opened (``verify``), each tensor's element count against metadata.json's record."""

    def __init__(self, vdir: str, meta: dict, marker: dict, verify: bool):
        self.vdir, self.meta, self.marker, self.verify, self.open = vdir, meta, marker, verify, {}
        self.expected = meta.get("tensors", {}).get("shard")
        self.decoded: dict[tuple, torch.Tensor] = {}

    def fp32(self, rank: int, bucket: int, key: str) -> torch.Tensor:
        """``b{bucket}.{key}`` of ``rank`` (master, exp_avg, exp_avg_sq, max_exp_avg_sq) in fp32: as stored,
        or decoded from codes + block scales / bf16 / bf16 params16 + master_remainder ([Note: coded ZeRO
        states] in zero/coded.py). Decoded slices of one (rank, bucket) are kept until another is asked for."""
        name = f"b{bucket}.{key}"
        remainders = bool((self.meta.get("state_format") or {}).get("store_param_remainders", False))
        stored_fp32 = not remainders if key == "master" else self.get(rank, name).dtype == torch.float32
        if stored_fp32:
            return self.get(rank, name)
        ck = (rank, bucket, key)
        if ck not in self.decoded:
            if any(k[:2] != (rank, bucket) for k in self.decoded):
                self.decoded.clear()
            if key == "master":
                t = codecs.join_remainder(self.get(rank, f"b{bucket}.params16"), self.get(rank, f"b{bucket}.master_remainder"))
            else:
                st = {key: self.get(rank, name)}
                if st[key].dtype in codecs.BLOCKWISE:
                    st[key + "_scale"] = self.get(rank, f"{name}_scale")
                elif st[key].dtype != torch.bfloat16:
                    raise CheckpointError(f"{self.vdir}: {name} of rank {rank} has dtype {st[key].dtype}, not a state format")
                t = codecs.decode_moment(st, key)
            self.decoded[ck] = t
        return self.decoded[ck]

    def get(self, rank: int, key: str) -> torch.Tensor:
        d, fp = self._file(rank)
        if key not in d:
            raise CheckpointError(f"checkpoint file {fp} has no tensor {key!r}")
        _check_tensor(d[key], key, self.expected, fp)
        want = shard_dtype(self.meta, key)
        if want is not None and d[key].dtype != want:
            raise CheckpointError(f"checkpoint file {fp}: tensor {key!r} is {d[key].dtype}, but metadata.json "
                                  f"(state_format / layout) records {want}: the file was altered or saved apart "
                                  "from this metadata, and would decode to wrong values")
        return d[key]

    def _file(self, rank: int) -> tuple[dict, str]:
        """(the mmap-opened shard file of ``rank``, its path); opened and hashed once."""
        if not 0 <= rank < len(self.meta["shards"]):
            raise CheckpointError(f"{self.vdir}/metadata.json: an element maps to rank {rank}, but the "
                                  f"checkpoint has {len(self.meta['shards'])} shards (inconsistent layout)")
        name = self.meta["shards"][rank]
        fp = safe_join(self.vdir, name, "shard", os.path.join(self.vdir, "metadata.json"))
        if rank not in self.open:
            if self.verify and sha256_file(fp) != self.marker["files"][name]["sha256"]:
                raise CheckpointError(f"checkpoint file {fp} does not match its sha256 in {self.vdir}/COMPLETE "
                                      "(corrupt); load with verify=False only to inspect a damaged checkpoint")
            try:
                self.open[rank] = torch.load(fp, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise CheckpointError(f"checkpoint file {fp} cannot be read: {type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}") from e
        return self.open[rank], fp

    def close(self, rank: int | None = None) -> None:
        self.decoded.clear()
        if rank is None:
            self.open.clear()
        else:
            self.open.pop(rank, None)
