"""Sharded checkpoints: round trip, resharding across world sizes / stages / bucket sizes, atomic
saves, offline consolidation and inspect, bad input (gloo processes spawned on this machine).

Data: every rank trains on the SAME full batch, so the averaged gradient equals the one-process
gradient up to at most a rounding of sums of equal values (exact for 1, 2 and 4 ranks): the
continuation after a reshard is then comparable with the uninterrupted run at rtol=1e-6 without
the cancellation noise Adam amplifies (different micro-batch splits are covered in test_zero.py).
A save world writes checkpoints plus the uninterrupted run's final parameters; a load world of
another size/stage/bucket size loads and continues; results are compared through files.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402
from test_zero import batch, loss_fn, make_model  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels import checkpoint as ck  # noqa: E402

K = 3          # steps before the save, and after it
HUGE = 10**7


# (name, save world, save stage, save bucket, load world, load stage, load bucket)
CASES = [
    ("4to2", 4, 2, 64, 2, 1, HUGE),
    ("2to3", 2, 1, HUGE, 3, 2, 64),
    ("2to1", 2, 2, 200, 1, 2, 64),
    ("1to4", 1, 1, HUGE, 4, 2, 100),
    ("2to2s3", 2, 2, 64, 2, 3, 200),
    ("4to2s3", 4, 3, 200, 2, 1, 64),
]


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _world():
    return dist.get_world_size() if dist.is_initialized() else 1


def _opt(model, stage, bucket, **kw):
    kw.setdefault("lr", 1e-3)
    return zk.ZeroAdamW(model, stage=stage, bucket_size=bucket, backend="reference", betas=(0.9, 0.95),
                        param_groups=[{"params": [p for n, p in model.named_parameters() if p.ndim >= 2 and p.requires_grad],
                                       "weight_decay": 0.1},
                                      {"params": [p for n, p in model.named_parameters() if p.ndim < 2 and p.requires_grad],
                                       "weight_decay": 0.0}], **kw)


def _train(model, opt, start, n):
    for s in range(start, start + n):
        idx, tgt = batch(s, 4)
        loss_fn(model, idx, tgt).backward()
        opt.step()
        opt.zero_grad()


def _save_side(tmp, name, stage, bucket):
    model = make_model()
    opt = _opt(model, stage, bucket)
    _train(model, opt, 0, K)
    opt.save_checkpoint(os.path.join(tmp, name))
    at_save = opt.full_model_state_dict()
    _train(model, opt, K, K)
    final = opt.full_model_state_dict()
    if _rank() == 0:
        torch.save({"at_save": at_save, "final": final}, os.path.join(tmp, name + ".ref.pt"))


def _load_side(tmp, name, stage, bucket):
    ref = torch.load(os.path.join(tmp, name + ".ref.pt"), weights_only=True)
    model = make_model(seed=1)
    torch.manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    opt = _opt(model, stage, bucket, lr=1234.0)
    before = opt.full_model_state_dict()
    assert not torch.equal(before["blocks.0.fc1.weight"], ref["at_save"]["blocks.0.fc1.weight"])  # negative control
    # Record the saved element ranges this rank reads: exactly its own pieces, never the whole model.
    requested = []
    real_ranges = ck._saved_ranges
    def counting(bspec, offset, numel):
        for r in real_ranges(bspec, offset, numel):
            requested.append(r[2])
            yield r
    ck._saved_ranges = counting
    try:
        opt.load_checkpoint(os.path.join(tmp, name))
    finally:
        ck._saved_ranges = real_ranges
    own = sum(pc.numel for b in opt.buckets for pc in b.pieces)
    assert sum(requested) == own, (name, sum(requested), own)
    if _world() > 1:
        assert sum(requested) < opt.layout.numel, f"{name}: rank {_rank()} read the whole model"
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[1]["weight_decay"] == 0.0
    got = opt.full_model_state_dict()
    for k, v in ref["at_save"].items():
        assert torch.equal(got[k], v), f"{name}: {k} not restored bitwise"
    if stage != 3:                      # stage 3 holds no full parameters between uses
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert torch.equal(p.detach(), ref["at_save"][n]), (name, n)
    _train(model, opt, K, K)
    got = opt.full_model_state_dict()
    for k, v in ref["final"].items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name} {k}: {m}")


def _cases_for(world, side):
    out = []
    for c in CASES:
        if side == "save" and c[1] == world:
            out.append((c[0], c[2], c[3]))
        if side == "load" and c[4] == world:
            out.append((c[0], c[5], c[6]))
    return out


def _world_job(rank, world, tmp, saves, loads, extra):
    for name, stage, bucket in saves:
        _save_side(tmp, name, stage, bucket)
    for name, stage, bucket in loads:
        _load_side(tmp, name, stage, bucket)
    if "roundtrip" in extra:
        _roundtrip(tmp)
    if "killed" in extra:
        _killed_save(tmp)


def _roundtrip(tmp):
    """Same world size and stage: continuing after a load is bitwise identical."""
    for stage, dtype in ((2, None), (1, torch.bfloat16)):
        model = make_model()
        opt = _opt(model, stage, 64, param_dtype=dtype)
        _train(model, opt, 0, K)
        root = os.path.join(tmp, f"rt{stage}")
        opt.save_checkpoint(root)
        _train(model, opt, K, K)
        final = opt.full_model_state_dict()
        work = {n: p.detach().clone() for n, p in model.named_parameters()}
        m2 = make_model(seed=5)
        o2 = _opt(m2, stage, 64, param_dtype=dtype)
        assert not torch.equal(m2.blocks[0].fc1.weight, model.blocks[0].fc1.weight)
        o2.load_checkpoint(root)
        _train(m2, o2, K, K)
        f2 = o2.full_model_state_dict()
        for k in final:
            assert torch.equal(final[k], f2[k]), (stage, k)
        for n, p in m2.named_parameters():
            assert torch.equal(p.detach(), work[n]), (stage, n)
        # exp_avg etc. too
        for b1, b2 in zip(opt.buckets, o2.buckets):
            for k, t in b1.state_tensors().items():
                assert torch.equal(t, b2.state_tensors()[k]), (stage, k)
        assert opt._steps == o2._steps


def _killed_save(tmp):
    root = os.path.join(tmp, "killed")
    model = make_model()
    opt = _opt(model, 2, 64)
    _train(model, opt, 0, 2)
    v1 = opt.save_checkpoint(root)
    good = opt.full_model_state_dict()
    _train(model, opt, 2, 2)

    def fault(rank, fname):
        if rank == 1 and fname.startswith("shard-"):
            raise OSError("simulated crash while writing")
    ck._FAULT = fault
    try:
        with pytest.raises(ck.CheckpointError, match="rank 1"):
            opt.save_checkpoint(root)
    finally:
        ck._FAULT = None
    assert ck.resolve(root) == v1
    v2 = os.path.join(root, "v000002")
    assert os.path.isdir(v2) and not os.path.exists(os.path.join(v2, "COMPLETE"))
    with pytest.raises(ck.CheckpointError, match="v000002.*COMPLETE"):
        ck.resolve(v2)
    # Crash of rank 0 after the shards but before the marker.
    ck._FAULT = lambda rank, fname: (_ for _ in ()).throw(OSError("crash")) if fname == "model_rest.pt" else None
    try:
        with pytest.raises(ck.CheckpointError, match="rank 0"):
            opt.save_checkpoint(root)
    finally:
        ck._FAULT = None
    assert ck.resolve(root) == v1
    m2 = make_model(seed=3)
    o2 = _opt(m2, 2, 64)
    o2.load_checkpoint(root)
    got = o2.full_model_state_dict()
    for k in good:
        assert torch.equal(got[k], good[k]), k
    v4 = opt.save_checkpoint(root)        # a good save cleans up the half-written versions
    dist.barrier()
    assert sorted(os.listdir(root)) == ["LATEST", os.path.basename(v4)]


@pytest.fixture(scope="module")
def tmp_ckpt(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


def test_reshard_roundtrip_killed(tmp_ckpt):
    """Saves at 1, 4, 2 ranks; loads at 4, 2, 3, 1 ranks; stages and bucket sizes change."""
    tmp = tmp_ckpt
    # world 1 in this process (no process group)
    for name, stage, bucket in _cases_for(1, "save"):
        _save_side(tmp, name, stage, bucket)
    run_world(_world_job, 4, tmp, _cases_for(4, "save"), _cases_for(4, "load"), (), timeout=200)
    run_world(_world_job, 2, tmp, _cases_for(2, "save"), _cases_for(2, "load"), ("roundtrip", "killed"),
              timeout=200)
    run_world(_world_job, 3, tmp, [], _cases_for(3, "load"), (), timeout=200)
    for name, stage, bucket in _cases_for(1, "load"):
        _load_side(tmp, name, stage, bucket)


def test_consolidate_and_inspect(tmp_ckpt):
    """The 4-rank stage-2 checkpoint, consolidated offline, continues in torch.optim.AdamW."""
    tmp = tmp_ckpt
    root = os.path.join(tmp, "4to2")
    if not os.path.exists(root):
        run_world(_world_job, 4, tmp, [("4to2", 2, 64)], [], (), timeout=200)
    out = os.path.join(tmp, "full.pt")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "zero_kernels.checkpoint", "consolidate", root, out],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "zero_kernels.checkpoint", "inspect", root],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    for s in ("stage 2, world size 4", "emb.weight (= head.weight)", "format_version" if False else "version 1",
              "weight_decay=0.1", "shard-00003-of-00004.pt", "state format   exp_avg float32, exp_avg_sq float32, "
              "master fp32"):
        assert s in r.stdout, (s, r.stdout)
    ref = torch.load(os.path.join(tmp, "4to2.ref.pt"), weights_only=True)
    full = torch.load(out, weights_only=True)
    model = make_model(seed=7)
    model.load_state_dict(full["model"])
    for k, v in ref["at_save"].items():
        assert torch.equal(model.state_dict()[k], v), k
    assert model.head.weight is model.emb.weight
    decay = [p for p in model.parameters() if p.ndim >= 2 and p.requires_grad]
    nodecay = [p for p in model.parameters() if p.ndim < 2 and p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    assert full["param_names"] == [[names[id(p)] for p in decay], [names[id(p)] for p in nodecay]]
    topt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                             lr=99.0)
    topt.load_state_dict(full["optimizer"])
    assert topt.param_groups[0]["lr"] == 1e-3 and topt.param_groups[0]["betas"] == (0.9, 0.95)
    for s in range(K, 2 * K):
        idx, tgt = batch(s, 4)
        loss_fn(model, idx, tgt).backward()
        topt.step()
        topt.zero_grad()
    for k, v in ref["final"].items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-7, msg=lambda m: f"{k}: {m}")
    # ZeRO's own bookkeeping of the unused parameter: no torch state (never stepped).
    assert len(full["optimizer"]["state"]) == len(decay) + len(nodecay) - 1
    # An output inside the checkpoint (its LATEST, a shard of a version directory) would replace a file of it:
    # refused before anything is written, and the checkpoint still reads; a directory or a missing folder too.
    from zero_kernels.checkpoint_format import resolve
    from zero_kernels.checkpoint_tools import consolidate
    vdir = resolve(root)
    shard = os.path.join(vdir, "shard-00000-of-00004.pt")
    sizes = {f: os.path.getsize(os.path.join(vdir, f)) for f in os.listdir(vdir)}
    with open(os.path.join(root, "LATEST")) as f:
        latest = f.read()
    inside = "lies inside the checkpoint"
    for bad, msg in [(os.path.join(root, "LATEST"), inside), (shard, inside), (tmp, "is a directory"),
                     (os.path.join(tmp, "nowhere", "full.pt"), "does not exist")]:
        with pytest.raises(ck.CheckpointError, match=msg):
            consolidate(root, bad)
    assert {f: os.path.getsize(os.path.join(vdir, f)) for f in os.listdir(vdir)} == sizes
    with open(os.path.join(root, "LATEST")) as f:
        assert f.read() == latest
    r = subprocess.run([sys.executable, "-m", "zero_kernels.checkpoint", "consolidate", root, shard],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "error:" in r.stderr and "lies inside the checkpoint" in r.stderr, r.stderr


def _frozen_at_save_job(rank, world, root):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(3)])
    z = zk.ZeroAdamW(m, stage=2, lr=1e-2, timeout=30, backend="reference")
    for s in range(3):
        if s == 2:
            m[0].requires_grad_(False)          # frozen for a while (README), at the save too
        m(torch.randn(4, 8, generator=torch.Generator().manual_seed(s))).pow(2).mean().backward()
        z.step()
        z.zero_grad()
    z.save_checkpoint(root)
    torch.save({ps.name: z.steps[ps.index] for ps in z.layout.params}, root + ".steps.pt")


def test_consolidate_order_with_a_layer_frozen_at_save(tmp_path):
    """consolidate's indices follow registration order; a layer frozen (requires_grad_(False)) when the
    checkpoint was saved came last, so torch.optim.AdamW(model.parameters()) got every state on another
    parameter without an error (the old code)."""
    root = str(tmp_path / "ck")
    run_world(_frozen_at_save_job, 1, root, timeout=120)
    full = ck.consolidate(root)
    assert full["param_names"] == [["0.weight", "1.weight", "2.weight"]]
    steps = torch.load(root + ".steps.pt", weights_only=True)
    assert steps == {"0.weight": 2, "1.weight": 3, "2.weight": 3}
    m = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(3)])
    m.load_state_dict(full["model"])
    topt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    topt.load_state_dict(full["optimizer"])
    for n, p in m.named_parameters():
        assert float(topt.state[p]["step"]) == steps[n], n


def _snapshot(opt, model):
    return ([t.clone() for b in opt.buckets for t in b.state_tensors().values()],
            [p.detach().clone() for p in model.parameters()], list(opt._steps), opt.param_groups[0]["lr"])


def _same(a, b):
    return (all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
            and a[2] == b[2] and a[3] == b[3])


def test_bad_checkpoints(tmp_path):
    model = make_model()
    opt = _opt(model, 2, 64)
    _train(model, opt, 0, 2)
    good = str(tmp_path / "good")
    vdir = opt.save_checkpoint(good)
    tgt_model = make_model(seed=2)
    tgt = _opt(tgt_model, 1, HUGE, lr=5.0)
    snap = _snapshot(tgt, tgt_model)

    def variant(name, mutate):
        d = str(tmp_path / name)
        shutil.copytree(good, d)
        mutate(os.path.join(d, os.path.basename(vdir)))
        return d

    shard = "shard-00000-of-00001.pt"
    cases = [
        ("missing", lambda v: os.remove(os.path.join(v, shard)), rf"{shard} is missing"),
        ("truncated", lambda v: os.truncate(os.path.join(v, shard), os.path.getsize(os.path.join(v, shard)) // 2),
         rf"{shard} is truncated"),
        ("nomarker", lambda v: os.remove(os.path.join(v, "COMPLETE")), r"COMPLETE"),
    ]

    def bump(v, fname):
        p = os.path.join(v, fname)
        d = json.load(open(p))
        d["format_version"] = 99
        data = json.dumps(d).encode()
        open(p, "wb").write(data)
        if fname != "COMPLETE":     # keep the recorded size and hash right: only the version is wrong
            c = json.load(open(os.path.join(v, "COMPLETE")))
            c["files"][fname] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            json.dump(c, open(os.path.join(v, "COMPLETE"), "w"))
    cases.append(("version_marker", lambda v: bump(v, "COMPLETE"), r"COMPLETE: format .* version 99"))
    cases.append(("version_meta", lambda v: bump(v, "metadata.json"), r"metadata.json: format .* version 99"))
    for name, mutate, pattern in cases:
        d = variant(name, mutate)
        with pytest.raises(ck.CheckpointError, match=pattern):
            tgt.load_checkpoint(d)
        assert _same(snap, _snapshot(tgt, tgt_model)), name
        with pytest.raises(ck.CheckpointError):
            ck.consolidate(d)
    # A corrupted (same-size) shard is caught by the checksum (by default).
    d = variant("corrupt", lambda v: _flip_byte(os.path.join(v, shard)))
    with pytest.raises(ck.CheckpointError, match="sha256"):
        tgt.load_checkpoint(d)
    assert _same(snap, _snapshot(tgt, tgt_model))
    # Parameter shapes that do not match the model.
    m3 = make_model()
    m3.gate = nn.Parameter(torch.ones(2))
    o3 = _opt(m3, 2, 64)
    s3 = _snapshot(o3, m3)
    with pytest.raises(ck.CheckpointError, match=r"metadata.json: parameter 'gate' has shape \(1,\) in the checkpoint but \(2,\)"):
        o3.load_checkpoint(good)
    assert _same(s3, _snapshot(o3, m3))
    # A model with an extra trainable parameter.
    m4 = make_model()
    m4.extra = nn.Parameter(torch.ones(3))
    o4 = _opt(m4, 2, 64)
    with pytest.raises(ck.CheckpointError, match="'extra'.*not in the checkpoint"):
        o4.load_checkpoint(good)
    # Not a checkpoint at all.
    with pytest.raises(ck.CheckpointError, match="not a zero_kernels checkpoint"):
        tgt.load_checkpoint(str(tmp_path))
    # load_state_dict with a shard of another layout: clear error, nothing changes.
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="layout"):
        tgt.load_state_dict(sd)
    assert _same(snap, _snapshot(tgt, tgt_model))
    # The CLI reports errors cleanly.
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "zero_kernels.checkpoint", "inspect", str(tmp_path / "missing")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "is missing" in r.stderr


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
