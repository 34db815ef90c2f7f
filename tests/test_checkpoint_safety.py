"""Checkpoints never silently wrong (issue 13, items 1, 3, 13, 18, 19): GPT-2-shaped models built from a
config here (tied embeddings, a persistent buffer per block; no download), gloo worlds of 1-4 processes.

Each test fails on the code before the fix: empty tensors saved under torch's activation-checkpoint
wrapper (1), user files deleted by a save (3), corrupted shards and edited metadata loaded (13), a
layout offset out of range consolidated into uninitialised memory (18), names leaving the checkpoint
followed and a dead peer surfacing as gloo's raw error (19).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                         checkpoint_wrapper)

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels import checkpoint as ck  # noqa: E402
from zero_kernels import checkpoint_tools as ckt  # noqa: E402
from zero_kernels.checkpoint_format import saved_layout  # noqa: E402
from zero_kernels.state_keys import canonical_names  # noqa: E402


# ---- a GPT-2-shaped model (Hugging Face layout and names: transformer.h.N.attn.c_attn, lm_head tied) ----
@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 97
    n_positions: int = 13
    n_embd: int = 24
    n_layer: int = 4
    n_head: int = 3


class Attention(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.n_head = c.n_head
        self.c_attn = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        n = c.n_positions      # a persistent buffer, as older GPT-2 checkpoints have (goes to model_rest)
        self.register_buffer("bias", torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.n_head)
        att = att.masked_fill(~self.bias[:, :, :T, :T], float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c.n_embd), Attention(c)
        self.ln_2, self.mlp = nn.LayerNorm(c.n_embd), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.n_embd), nn.Embedding(c.n_positions, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.h:
            x = blk(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, c: GPT2Config):
        super().__init__()
        self.config = c
        self.transformer = Transformer(c)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight          # tied, as GPT-2

    def forward(self, idx):
        return self.lm_head(self.transformer(idx))


def gpt2(seed=0, config=GPT2Config()):
    torch.manual_seed(seed)
    m = GPT2LMHeadModel(config)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.add_(torch.randn_like(mod.weight) * 0.1)
                mod.bias.add_(torch.randn_like(mod.bias) * 0.1)
    return m


def wrap_blocks(model):
    """torch's activation checkpointing on every block (renames state_dict keys, not named_parameters)."""
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper),
                                   check_fn=lambda m: isinstance(m, Block))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    return model


def train(model, opt, start, n, seed=0):
    c = model.config if hasattr(model, "config") else GPT2Config()
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(1000 * seed + s)
        idx = torch.randint(0, c.vocab_size, (4, c.n_positions - 2), generator=g)
        tgt = torch.randint(0, c.vocab_size, (4, c.n_positions - 2), generator=g)
        F.cross_entropy(model(idx).float().reshape(-1, c.vocab_size), tgt.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def zopt(model, stage, **kw):
    kw.setdefault("lr", 1e-2)
    return zk.ZeroAdamW(model, stage=stage, backend="reference", bucket_size=kw.pop("bucket_size", 4000),
                        weight_decay=0.1, **kw)


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def cli(*args):
    """``python -m zero_kernels.checkpoint ARGS``, in this process (its main(); the module entry point itself runs
    as a subprocess in tests/test_checkpoint.py): a CompletedProcess with the exit status and both streams."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = ckt.main(list(args))
        except SystemExit as e:         # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["zero_kernels.checkpoint", *args], rc, out.getvalue(), err.getvalue())


def rewrite(vdir, fname, edit):
    """Edit a file of a version and record its new size and sha256 in COMPLETE (as a buggy or
    malicious writer would): only the check under test can catch it."""
    p = os.path.join(vdir, fname)
    data = edit(open(p, "rb").read())
    open(p, "wb").write(data)
    c = json.load(open(os.path.join(vdir, "COMPLETE")))
    c["files"][fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    json.dump(c, open(os.path.join(vdir, "COMPLETE"), "w"))


def edit_meta(vdir, fn):
    def edit(data):
        m = json.loads(data)
        fn(m)
        return json.dumps(m).encode()
    rewrite(vdir, "metadata.json", edit)


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return ck.resolve(dst)


# ---- item 1: wrappers ---------------------------------------------------------------------------------
def _wrapped_job(rank_, world, tmp):
    ref = gpt2()
    ro = zopt(ref, 3)
    train(ref, ro, 0, 3)
    want = ro.full_model_state_dict()
    assert len(want) == 57 and all(v.numel() > 0 for v in want.values())
    model = wrap_blocks(gpt2())
    zo = zopt(model, 3)
    train(model, zo, 0, 3)
    got = zo.full_model_state_dict()
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape, (k, got[k].shape)
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    # The Hugging Face pattern (item 7's checkpoint part): save the full state dict, reload it strictly
    # into a fresh unwrapped model, same outputs as the ZeRO-3 model.
    weights = os.path.join(tmp, "pytorch_model.bin")
    if rank_ == 0:
        torch.save(got, weights)
    barrier()
    fresh = gpt2(seed=9)
    fresh.load_state_dict(torch.load(weights, weights_only=True), strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    idx = torch.randint(0, fresh.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(fresh(idx), model(idx), rtol=1e-6, atol=1e-6)
    root = os.path.join(tmp, "wrapped")
    vdir = zo.save_checkpoint(root)
    barrier()
    if rank_ == 0:
        rest = torch.load(os.path.join(vdir, "model_rest.pt"), weights_only=True)
        assert sorted(rest) == [f"transformer.h.{i}.attn.bias" for i in range(4)], sorted(rest)
        cons = ck.consolidate(root)["model"]
        assert list(cons) == list(want)
        for k in want:
            torch.testing.assert_close(cons[k], want[k].float() if want[k].is_floating_point() else want[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    # The wrapped checkpoint loads into an unwrapped model at stage 2 (wrapper-free names match) and back.
    plain = gpt2(seed=4)
    po = zopt(plain, 2, lr=5.0)
    po.load_checkpoint(root)
    for k, v in po.full_model_state_dict().items():
        assert torch.equal(v, want[k]), k
    train(plain, po, 3, 2)
    train(ref, ro, 3, 2)
    for k, v in ro.full_model_state_dict().items():
        torch.testing.assert_close(po.full_model_state_dict()[k], v, rtol=1e-6, atol=1e-7)


def test_item1_wrapped_zero3_state_dict_checkpoint_consolidate(tmp_path):
    """Activation-checkpoint wrapper under ZeRO-3: full_model_state_dict, model_rest.pt and consolidate
    hold every tensor at full size (equal to the unwrapped run), and the checkpoint loads unwrapped."""
    run_world(_wrapped_job, 2, str(tmp_path), timeout=240)


def _numel_job(rank_, world, tmp):
    model = wrap_blocks(gpt2())
    zo = zopt(model, 3)
    train(model, zo, 0, 2)
    root = os.path.join(tmp, "numel")
    v1 = zo.save_checkpoint(root)

    def newest(fname):
        return os.path.join(root, max(n for n in os.listdir(root) if n.startswith("v")), fname)

    def short_shard(r, fname):          # rank 1's shard file loses most of one tensor after writing
        if r == 1 and fname.startswith("shard-"):
            d = torch.load(newest(fname), weights_only=True)
            d["b0.exp_avg"] = d["b0.exp_avg"][:1].clone()
            torch.save(d, newest(fname))

    def empty_rest(r, fname):           # rank 0's model_rest.pt gets a 0-element tensor after writing
        if fname == "model_rest.pt":
            d = torch.load(newest(fname), weights_only=True)
            d["transformer.h.0.attn.bias"] = torch.empty(0, dtype=torch.bool)
            torch.save(d, newest(fname))
    for fault, where in ((short_shard, "rank 1"), (empty_rest, "rank 0")):
        ck._FAULT = fault
        try:
            with pytest.raises(ck.CheckpointError, match=rf"{where}.*elements"):
                zo.save_checkpoint(root)
        finally:
            ck._FAULT = None
        assert ck.resolve(root) == v1, "a save whose tensors do not match the record became the LATEST"
        barrier()


def test_item1_save_checks_recorded_numels_before_complete(tmp_path):
    """A tensor written with fewer elements than recorded fails the save; the previous stays LATEST."""
    run_world(_numel_job, 2, str(tmp_path), timeout=240)


class DDPNamed(nn.Module):
    """DDP's naming (``module.`` before every key) without a process group."""

    def __init__(self, m):
        super().__init__()
        self.module = m

    def forward(self, idx):
        return self.module(idx)


def test_item1_wrapper_prefixes_load_across(tmp_path):
    """Checkpoints match parameters by wrapper-free names: ``module.`` (DDP) and ``_orig_mod.``
    (torch.compile) prefixes on either side."""
    src = DDPNamed(gpt2())
    so = zopt(src, 2)
    train(src.module, so, 0, 2)
    want = {k[len("module."):]: v for k, v in so.full_model_state_dict().items()}
    root = str(tmp_path / "ddp")
    so.save_checkpoint(root)
    compiled = torch.compile(gpt2(seed=3))                 # never called: only its names matter here
    assert all(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    co = zopt(compiled, 1, lr=3.0)
    co.load_checkpoint(root)
    got = co.full_model_state_dict()
    assert sorted(got) == sorted("_orig_mod." + k for k in want)
    for k, v in want.items():
        assert torch.equal(got["_orig_mod." + k], v), k
    assert co.param_groups[0]["lr"] == 1e-2
    root2 = str(tmp_path / "compiled")
    co.save_checkpoint(root2)
    plain = gpt2(seed=4)
    po = zopt(plain, 2)
    po.load_checkpoint(root2)
    for k, v in po.full_model_state_dict().items():
        assert torch.equal(v, want[k]), k
    cons = ck.consolidate(root2)["model"]                  # keys as the saving module's state_dict
    assert sorted(cons) == sorted("_orig_mod." + k for k in want)
    with pytest.raises(ValueError, match="same without wrapper prefixes"):
        canonical_names(["a._orig_mod.w", "a.w"])


# ---- item 3: never delete what the project did not write ------------------------------------------------
def test_item3_save_refuses_foreign_directory_and_prunes_only_its_versions(tmp_path):
    user = tmp_path / "experiments"
    (user / "v20240101").mkdir(parents=True)
    (user / "v20240101" / "run.log").write_text("mine")
    (user / "important.txt").write_text("keep")
    (user / "notes.txt").write_text("keep too")
    before = sorted(str(p.relative_to(user)) for p in user.rglob("*"))
    model = gpt2()
    zo = zopt(model, 2)
    train(model, zo, 0, 1)
    with pytest.raises(ck.CheckpointError, match="not a zero_kernels checkpoint root"):
        zo.save_checkpoint(str(user))
    assert sorted(str(p.relative_to(user)) for p in user.rglob("*")) == before
    # A real root that also holds a user's files and look-alike version directories.
    root = tmp_path / "ckpt"
    v1 = zo.save_checkpoint(str(root))
    (root / "notes.txt").write_text("user")
    (root / "v000002").mkdir()
    (root / "v000002" / "data.bin").write_text("user")
    (root / "v20240101").mkdir()
    (root / "v20240101" / "run.log").write_text("user")
    (root / os.path.basename(v1) / "my_eval.json").write_text("user file inside our version")
    v3 = zo.save_checkpoint(str(root))
    assert os.path.basename(v3) == "v000003", v3           # the user's v000002 is not ours: skipped
    v4 = zo.save_checkpoint(str(root))                      # keep=1: prunes only our v000003 and v000001's files
    assert sorted(os.listdir(root)) == ["LATEST", "notes.txt", "v000001", "v000002", os.path.basename(v4),
                                        "v20240101"]
    assert os.listdir(v1) == ["my_eval.json"]
    assert not os.path.exists(v3)
    assert (root / "v000002" / "data.bin").read_text() == "user"
    assert (root / "v20240101" / "run.log").read_text() == "user"
    assert ck.resolve(str(root)) == v4


# ---- item 13: integrity verified by default ------------------------------------------------------------
def _flip_inside_tensor(path, t):
    """Flip 8 bytes inside the stored bytes of tensor ``t`` (the file keeps its size)."""
    data = bytearray(open(path, "rb").read())
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0
    at += len(raw) // 2
    data[at:at + 8] = bytes(b ^ 0x7F for b in data[at:at + 8])
    open(path, "wb").write(bytes(data))


def test_item13_integrity_verified_by_default(tmp_path):
    model = gpt2()
    zo = zopt(model, 1)
    train(model, zo, 0, 3)
    good = str(tmp_path / "good")
    vdir = zo.save_checkpoint(good)
    saved_master = zo.buckets[0].state_tensors()["master"].clone()
    target = gpt2(seed=1)
    to = zopt(target, 2, lr=7.0)
    snap = [p.detach().clone() for p in target.parameters()]
    unchanged = lambda: all(torch.equal(a, b) for a, b in zip(snap, target.parameters()))  # noqa: E731

    bad = str(tmp_path / "corrupt")
    bvdir = copy_ckpt(good, bad)
    shard = os.path.join(bvdir, "shard-00000-of-00001.pt")
    _flip_inside_tensor(shard, saved_master)
    with pytest.raises(ck.CheckpointError, match="sha256"):
        to.load_checkpoint(bad)
    assert unchanged()
    with pytest.raises(ck.CheckpointError, match="sha256"):
        ck.consolidate(bad)
    r = cli("consolidate", bad, str(tmp_path / "out.pt"))
    assert r.returncode == 2 and "sha256" in r.stderr and not os.path.exists(tmp_path / "out.pt")
    # The explicit opt-out reads the damaged values (negative control: the flip is inside the data).
    to.load_checkpoint(bad, verify=False)
    ref = ck.consolidate(good)["model"]
    assert any(not torch.equal(v, ref[k]) for k, v in to.full_model_state_dict().items())
    assert any(not torch.equal(v, ref[k]) for k, v in ck.consolidate(bad, verify=False)["model"].items())
    # Same-size edits of metadata.json (step 3 -> 9, lr 0.01 -> 0.09) are detected, even with verify=False.
    for name, old, new in (("step", b'"step": 3', b'"step": 9'), ("lr", b'"lr": 0.01', b'"lr": 0.09')):
        d = str(tmp_path / f"meta_{name}")
        mv = copy_ckpt(good, d)
        p = os.path.join(mv, "metadata.json")
        data = open(p, "rb").read()
        assert old in data, (old, data[:400])
        open(p, "wb").write(data.replace(old, new))
        assert os.path.getsize(p) == len(data)
        for verify in (True, False):
            with pytest.raises(ck.CheckpointError, match="metadata.json does not match its sha256"):
                to.load_checkpoint(d, verify=verify)
        with pytest.raises(ck.CheckpointError, match="sha256"):
            ck.consolidate(d)
    # The untouched checkpoint loads (the checks pass on good data).
    to.load_checkpoint(good)
    assert to.param_groups[0]["lr"] == 1e-2 and to._steps == [3] * len(to._steps)
    assert os.path.isdir(vdir)


# ---- item 18: consolidate writes every output element exactly once ---------------------------------------
def test_item18_consolidate_layout_out_of_range(tmp_path):
    model = gpt2()
    zo = zopt(model, 2, bucket_size=3000)
    train(model, zo, 0, 2)
    good = str(tmp_path / "good")
    zo.save_checkpoint(good)
    for name, fn in (("beyond", lambda p: p.update(offset=p["offset"] + 10**6)),
                     ("overlap", lambda p: p.update(offset=max(0, p["offset"] - 5)))):
        d = str(tmp_path / name)
        vdir = copy_ckpt(good, d)
        edit_meta(vdir, lambda m: fn(next(p for p in m["layout"]["params"] if p["offset"] > 0)))
        out = tmp_path / f"{name}.pt"
        r = cli("consolidate", d, str(out))
        assert r.returncode == 2, (name, r.returncode, r.stdout, r.stderr)
        assert "exactly once" in r.stderr and not out.exists(), r.stderr
        with pytest.raises(ck.CheckpointError, match="exactly once"):
            zo.load_checkpoint(d)
    # The coverage count itself: a piece missing from an otherwise valid layout is caught.
    vdir = ck.resolve(good)
    marker, meta = ck.read_metadata(vdir)
    lay = saved_layout(meta, "metadata.json")

    class Dropping:
        world_size, buckets, params = lay.world_size, lay.buckets, lay.params

        def pieces(self, b, r):
            return lay.pieces(b, r)[1:] if (b, r) == (0, 0) else lay.pieces(b, r)
    with pytest.raises(ck.CheckpointError, match="covered 0 times"):
        ckt._full_states(vdir, marker, meta, Dropping(), ["master"], True)
    assert len(ck.consolidate(good)["model"]) == 57          # 53 parameter entries + 4 buffers


# ---- item 19: names stay inside the checkpoint; a dead peer is the package's error -------------------------
def test_item19_names_never_leave_the_checkpoint(tmp_path):
    model = gpt2()
    zo = zopt(model, 2)
    train(model, zo, 0, 1)
    good = str(tmp_path / "good")
    vdir = zo.save_checkpoint(good)
    victim = str(tmp_path / "victim")
    victim_v = copy_ckpt(good, victim)

    def latest(value):
        d = str(tmp_path / f"latest{abs(hash(value))}")
        copy_ckpt(good, d)
        open(os.path.join(d, "LATEST"), "w").write(value)
        return d
    cases = [latest("../victim/" + os.path.basename(victim_v)), latest(victim_v)]
    for key, value in (("shards", lambda m: ["../../victim/" + os.path.basename(victim_v) + "/" + m["shards"][0]]),
                       ("shards", lambda m: [os.path.join(victim_v, m["shards"][0])]),
                       ("model_rest", lambda m: os.path.join(victim_v, "model_rest.pt")),
                       ("model_rest", lambda m: "../" + os.path.basename(vdir) + "/model_rest.pt")):
        d = str(tmp_path / f"meta{len(cases)}")
        mv = copy_ckpt(good, d)
        edit_meta(mv, lambda m: m.update({key: value(m)}))
        c = json.load(open(os.path.join(mv, "COMPLETE")))
        name = json.load(open(os.path.join(mv, "metadata.json")))[key]
        for n in (name if isinstance(name, list) else [name]):     # listed with the target's true size and
            t = os.path.join(mv, n)                                 # hash: only the name check can refuse it
            c["files"][n] = {"bytes": os.path.getsize(t), "sha256": hashlib.sha256(open(t, "rb").read()).hexdigest()}
        json.dump(c, open(os.path.join(mv, "COMPLETE"), "w"))
        cases.append(d)
    d = str(tmp_path / "symlink")           # a shard that is a symbolic link to a file outside
    sv = copy_ckpt(good, d)
    s = os.path.join(sv, "shard-00000-of-00001.pt")
    os.remove(s)
    os.symlink(os.path.join(victim_v, "shard-00000-of-00001.pt"), s)
    cases.append(d)
    for d in cases:
        with pytest.raises(ck.CheckpointError, match="plain file name|outside"):
            zo.load_checkpoint(d)
        r = cli("consolidate", d, str(tmp_path / "o.pt"))
        assert r.returncode == 2 and ("plain file name" in r.stderr or "outside" in r.stderr), (d, r.stderr)


def _dead_peer_save(rank_, world, tmp):
    model = gpt2()
    zo = zopt(model, 3 if world == 2 else 2)
    train(model, zo, 0, 1)
    root = os.path.join(tmp, "dead_save")
    v1 = zo.save_checkpoint(root)
    if rank_ == world - 1:
        ck._FAULT = lambda r, fname: os._exit(0)         # this rank dies after writing its shard
    with pytest.raises(ck.CheckpointError, match="another rank died"):
        zo.save_checkpoint(root)
    assert ck.resolve(root) == v1


def _dead_peer_load(rank_, world, tmp):
    model = gpt2()
    zo = zopt(model, 2)
    train(model, zo, 0, 1)
    root = os.path.join(tmp, "dead_load")
    zo.save_checkpoint(root)
    if rank_ == world - 1:
        ck.read_metadata = lambda vdir: os._exit(0)      # this rank dies while reading
    with pytest.raises(ck.CheckpointError, match="load_checkpoint.*another rank died"):
        zo.load_checkpoint(root)


@pytest.mark.parametrize("job,world", [(_dead_peer_save, 2), (_dead_peer_save, 3), (_dead_peer_load, 2)])
def test_item19_dead_peer_is_a_checkpoint_error(tmp_path, job, world):
    run_world(job, world, str(tmp_path), timeout=240)
