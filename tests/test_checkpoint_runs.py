"""Checkpoints of more than one run, and the ranks of one load (found by a probe using checkpoints as users do;
each test fails on the code before the fix):

- a save pruned every version under its root, another optimizer's included (a GAN's G and D saving to one
  root lost G's checkpoint) and a user's file named like a shard: [Note: checkpoint lineage];
- ``zopt.save_checkpoint(path, keep=)`` did not exist (only the module function had keep);
- consolidate numbered a group's parameters in registration order, so a torch optimizer built from the same
  (reordered) groups took every state on another parameter, silently; and it dropped ``initial_lr``;
- a root whose only complete version lacked LATEST was called incomplete; a parameter frozen on one side of
  a save/load was called missing;
- ranks could load different versions (LATEST moved between their reads) or shards of different
  state_dict() calls, silently; and the status exchanges of save/load waited for the process group's
  timeout instead of ``timeout=``.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels import checkpoint as ck  # noqa: E402


def _model(seed, widths=(6, 6, 6)):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])])


def _train(model, opt, start, n, sched=None):
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(100 + s)
        x = torch.randn(5, model[0].in_features, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _zopt(model, **kw):
    kw.setdefault("lr", 1e-2)
    return zk.ZeroAdamW(model, stage=kw.pop("stage", 2), backend="reference", **kw)


def _listing(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# ---- [Note: checkpoint lineage] -------------------------------------------------------------------------------
def test_two_optimizers_share_a_root_and_prune_only_their_own(tmp_path):
    root = str(tmp_path / "ckpt")
    g_model, d_model = _model(0), _model(1, (6, 4))
    g, d = _zopt(g_model), _zopt(d_model)
    _train(g_model, g, 0, 1)
    _train(d_model, d, 0, 1)
    g1 = g.save_checkpoint(root)
    with pytest.warns(UserWarning, match=r"1 version\(s\) this optimizer did not write.*v000001.*kept"):
        d2 = d.save_checkpoint(root)
    assert os.path.isfile(os.path.join(g1, "COMPLETE"))           # the old code had removed G's checkpoint
    open(os.path.join(g1, "shard-00007-of-00009.pt"), "w").write("a user's file named like a shard")
    with pytest.warns(UserWarning, match="did not write"):
        g3 = g.save_checkpoint(root)                              # keep=1: G's v000001 goes, D's v000002 stays
    assert _listing(root) == sorted(["LATEST", "v000001/shard-00007-of-00009.pt"] + [
        os.path.join(os.path.basename(v), f) for v in (d2, g3)
        for f in (".zero_kernels", "COMPLETE", "metadata.json", "model_rest.pt", "shard-00000-of-00001.pt")])
    assert ck.resolve(root) == g3
    # each loads its own; D by its version path (LATEST names the newest save, G's)
    d_back = _zopt(_model(5, (6, 4)))
    d_back.load_checkpoint(d2)
    assert torch.equal(d_back.module[0].weight, d_model[0].weight)
    with pytest.raises(ck.CheckpointError, match="has shape"):
        _zopt(_model(5, (6, 4))).load_checkpoint(root)
    # a resumed run continues G's lineage: its save prunes G's v000003, not D's, and keep= is the method's
    g_back = _zopt(_model(7))
    g_back.load_checkpoint(root)
    assert g_back.checkpoint_lineage == g.checkpoint_lineage
    with pytest.warns(UserWarning, match="did not write"):
        vs = [g_back.save_checkpoint(root, keep=2) for _ in range(3)]
    names = sorted(n for n in os.listdir(root) if n.startswith("v"))
    assert names == ["v000001", os.path.basename(d2)] + [os.path.basename(v) for v in vs[1:]], names
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="keep must be a positive int"):
            g_back.save_checkpoint(root, keep=bad)


def test_a_complete_version_without_latest_is_named(tmp_path):
    root = str(tmp_path / "ckpt")
    m = _model(0)
    z = _zopt(m)
    _train(m, z, 0, 1)
    v1 = z.save_checkpoint(root)
    os.remove(os.path.join(root, "LATEST"))            # killed between COMPLETE and LATEST
    with pytest.raises(ck.CheckpointError, match=r"no LATEST, but v000001 is complete.*load one by its path"):
        z.load_checkpoint(root)
    z.load_checkpoint(v1)


def test_frozen_on_one_side_of_a_save_is_named(tmp_path):
    m = _model(0)
    m[0].weight.requires_grad_(False)
    z = _zopt(m)
    _train(m, z, 0, 1)
    v = z.save_checkpoint(str(tmp_path / "a"))
    with pytest.raises(ck.CheckpointError, match=r"'0.weight' is trainable here but was frozen.*freeze it"):
        _zopt(_model(0)).load_checkpoint(v)
    m2 = _model(0)
    z2 = _zopt(m2)
    _train(m2, z2, 0, 1)
    v2 = z2.save_checkpoint(str(tmp_path / "b"))
    m3 = _model(0)
    m3[0].weight.requires_grad_(False)
    with pytest.raises(ck.CheckpointError, match=r"\['0.weight'\] were trainable when the checkpoint was saved but "
                                                 r"are frozen here.*unfreeze"):
        _zopt(m3).load_checkpoint(v2)


# ---- consolidate: the groups' own order, initial_lr ----------------------------------------------------------
def test_consolidate_follows_the_groups_order_and_keeps_initial_lr(tmp_path):
    def groups(m):        # out of registration order, two groups
        return [{"params": [m[1].weight, m[1].bias, m[0].weight], "weight_decay": 0.1},
                {"params": [m[0].bias], "weight_decay": 0.0, "lr": 3e-3}]

    def f(step):
        return 0.5 ** step

    zm, tm = _model(3), _model(3)
    z = _zopt(zm, param_groups=groups(zm))
    zs = torch.optim.lr_scheduler.LambdaLR(z, f)
    t = torch.optim.AdamW(groups(tm), lr=1e-2)
    ts = torch.optim.lr_scheduler.LambdaLR(t, f)
    _train(zm, z, 0, 3, zs)
    _train(tm, t, 0, 3, ts)
    z.save_checkpoint(str(tmp_path / "ck"))
    full = ck.consolidate(str(tmp_path / "ck"))
    assert full["param_names"] == [["1.weight", "1.bias", "0.weight"], ["0.bias"]]
    want = t.state_dict()
    for i, s in want["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full["optimizer"]["state"][i][k], s[k], rtol=1e-5, atol=1e-7)
    assert [g["initial_lr"] for g in full["optimizer"]["param_groups"]] == [1e-2, 3e-3]
    # a torch optimizer built from the same groups resumes as the uninterrupted one (its scheduler included)
    rm = _model(9)
    rm.load_state_dict(full["model"])
    r = torch.optim.AdamW(groups(rm), lr=1e-2)
    r.load_state_dict(full["optimizer"])
    rs = torch.optim.lr_scheduler.LambdaLR(r, f, last_epoch=2)
    _train(rm, r, 3, 2, rs)
    _train(tm, t, 3, 2, ts)
    for a, b in zip(rm.parameters(), tm.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- the ranks of one load ------------------------------------------------------------------------------------
def _ranks_job(rank, world, tmp):
    m = _model(0)
    z = _zopt(m, timeout=30)
    _train(m, z, 0, 1)
    root = os.path.join(tmp, "ck")
    v1 = z.save_checkpoint(root)
    sd1 = z.state_dict()
    _train(m, z, 1, 1)
    v2 = z.save_checkpoint(root, keep=2)
    sd2 = z.state_dict()
    _train(m, z, 2, 1)
    before = [p.detach().clone() for p in m.parameters()], list(z.steps)
    # 1. rank 0 given v1, rank 1 v2 (as when a save finished while they read LATEST): refused on both
    with pytest.raises(ck.CheckpointError, match="did not read the same checkpoint version.*nothing was loaded"):
        z.load_checkpoint(v1 if rank == 0 else v2)
    # 2. shards of two state_dict() calls: refused on both
    with pytest.raises(ValueError, match="shards of different saves"):
        z.load_state_dict(sd1 if rank == 0 else sd2)
    after = [p.detach().clone() for p in m.parameters()], list(z.steps)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and before[1] == after[1]
    z.load_checkpoint(v1)                                 # controls: the same version / save everywhere loads
    assert z.steps == [1] * len(z.steps)
    z.load_state_dict(sd2)
    assert z.steps == [2] * len(z.steps)
    # 3. save / load wait for a peer that never comes no longer than timeout= (the group's is 60 s here)
    for what in ("save", "load"):
        g = dist.new_group([0, 1])
        zt = _zopt(_model(0), process_group=g, timeout=3)
        if rank == 0:
            t0 = time.monotonic()
            with pytest.raises(ck.CheckpointError, match=r"did not complete on rank 0 after .*timeout 3 s"):
                zt.save_checkpoint(os.path.join(tmp, "t")) if what == "save" else zt.load_checkpoint(v1)
            assert time.monotonic() - t0 < 30, time.monotonic() - t0
        else:
            time.sleep(5)
        dist.barrier()


def test_ranks_load_one_version_and_wait_no_longer_than_timeout_world2(tmp_path):
    run_world(_ranks_job, 2, str(tmp_path), timeout=240, collective_timeout=60)
