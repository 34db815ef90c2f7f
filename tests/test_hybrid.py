"""Hybrid sharding (mesh=, [Note: hybrid sharding] in zero_kernels/zero/mesh.py) on 4 gloo processes.

Parity: every rank trains on its own micro-batch (global rank r takes rows [rB, (r+1)B) of the batch)
and the result must equal ONE process running torch.optim.AdamW on the whole batch, with
tests/test_zero.py's tolerances (rtol 1e-5, atol 1e-6). Negative control: the same run over the shard
groups alone (process_group=, no replicate all-reduce) trains each row on half the data and must fail
that comparison. Checkpoints: saved by 2x2 and loaded at world 3 (1-D), and back.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402
from test_zero import B, batch, loss_fn, make_model, reference  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels.memory import model_state_bytes  # noqa: E402

STEPS = 10
KW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def mesh_2d(r: int, s: int):
    return init_device_mesh("cpu", (r, s), mesh_dim_names=("replicate", "shard"))


# ---- TinyLM (test_zero's model) against one-process AdamW on the full batch --------------------------
def hybrid_run(cfg, seed=0, norms=None, **where):
    """Train test_zero's TinyLM with ZeroAdamW(**where) (mesh= or process_group=) on the global rank's
    micro-batch; returns the full model state dict (every rank). With ``cfg["clip"]`` the global norms
    clip_grad_norm_ returns are appended to ``norms``."""
    world, r = dist.get_world_size(), dist.get_rank()
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=cfg["stage"], bucket_size=cfg.get("bucket_size", 25 * 2**20),
                       overlap_comm=cfg.get("overlap", True), backend="reference", timeout=60, **where, **KW)
    for s in range(STEPS):
        idx, tgt = batch(s, world, seed)
        rows = slice(r * B, (r + 1) * B)
        loss_fn(model, idx[rows], tgt[rows]).backward()
        if cfg.get("clip"):
            norm = opt.clip_grad_norm_(*cfg["clip"])
            if norms is not None:
                norms.append(norm)
        opt.step()
        opt.zero_grad()
    return opt.full_model_state_dict(), opt


def assert_matches(full, ref):
    for k, v in ref.state_dict().items():
        if k != "pos":
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def assert_same_on_every_rank(full):
    """The replicas (and every rank) hold bit-identical parameters."""
    flat = torch.cat([v.reshape(-1).float() for _, v in sorted(full.items())])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    assert torch.equal(lo, hi), "ranks disagree"


PARITY = [dict(stage=1), dict(stage=1, bucket_size=64, overlap=False),
          dict(stage=2, bucket_size=64, clip=(0.05, 2.0)), dict(stage=2, overlap=False),
          dict(stage=3), dict(stage=3, bucket_size=64)]


def _parity_cases(rank, world):
    ref, _ = reference({}, world)
    for shape in [(2, 2), (4, 1), (1, 4)]:
        mesh = mesh_2d(*shape)
        for cfg in PARITY if shape == (2, 2) else PARITY[2:5]:
            norms = []
            full, opt = hybrid_run(cfg, mesh=mesh, norms=norms)
            want, want_norms = reference({"clip": cfg["clip"]}, world) if cfg.get("clip") else (ref, [])
            try:
                assert_matches(full, want)
                assert_same_on_every_rank(full)
                # the averaged gradient itself: Adam is blind to a constant gradient factor (and clipping
                # rescales to max_norm), so a replica sum not divided by the replicate size, or divided by
                # another group's size, shows only in the norm
                assert len(norms) == len(want_norms)
                for a, b in zip(norms, want_norms):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
            except AssertionError as e:
                raise AssertionError(f"mesh {shape} {cfg}: {e}") from e
            assert opt.world_size == shape[1] and opt.process_group is mesh.get_group("shard")
            opt.remove_hooks()
    # ---- negative control: the shard groups alone (no replicate all-reduce) must fail the parity check
    mesh = mesh_2d(2, 2)
    for stage in (1, 2, 3):
        full, opt = hybrid_run(dict(stage=stage), process_group=mesh.get_group("shard"))
        with pytest.raises(AssertionError):
            assert_matches(full, ref)
        opt.remove_hooks()


def test_hybrid_parity_world4():
    """Stages 1-3 on 2x2 (and stages 2-3 on 4x1, 1x4) equal one-process AdamW on the whole batch."""
    run_world(_parity_cases, 4, timeout=600)


# ---- odd sizes: no parameter or bucket divides by the shard group size --------------------------------
class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)          # 35 + 5
        self.b = nn.Linear(5, 3)          # 15 + 3
        self.c = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.c


def odd_data(step, world):
    g = torch.Generator().manual_seed(77 + step)
    return torch.randn(world * 3, 7, generator=g), torch.randn(world * 3, 3, generator=g)


def _odd_cases(rank, world):
    mesh = mesh_2d(2, 2)
    for stage in (1, 2, 3):
        for bucket_size in (36, 2**20):
            torch.manual_seed(5)
            model = Odd()
            ref = copy.deepcopy(model)
            ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
            opt = zk.ZeroAdamW(model, stage=stage, mesh=mesh, lr=1e-2, weight_decay=0.1, bucket_size=bucket_size,
                               backend="reference", timeout=60)
            assert all(p.numel() % 2 for p in ref.parameters())        # no parameter divides by 2
            for s in range(6):
                x, y = odd_data(s, world)
                F.mse_loss(model(x[3 * rank:3 * rank + 3]), y[3 * rank:3 * rank + 3]).backward()
                opt.step()
                opt.zero_grad()
                F.mse_loss(ref(x), y).backward()
                ropt.step()
                ropt.zero_grad()
            full = opt.full_model_state_dict()
            for k, v in ref.state_dict().items():
                torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"stage {stage} bucket {bucket_size} {k}: {m}")
            # memory report: sharded over the shard group (2 ranks), not the world (4): the exp_avg
            # this rank holds is its padded slice, and the prediction uses world size 2
            rep = opt.memory_report()
            psi = sum(p.numel() for p in ref.parameters())
            assert rep["exp_avg"] == 4 * sum(b.shard_numel for b in opt.layout.buckets)
            assert rep["exp_avg"] >= 4 * psi / 2 and rep["exp_avg"] < 4 * psi
            assert rep["predicted"] == model_state_bytes(psi, 2, stage, param_bytes=4, grad_bytes=4,
                                                         master_bytes=0, optim_bytes=8)
            opt.remove_hooks()


def test_hybrid_odd_sizes_world4():
    run_world(_odd_cases, 4, timeout=400)


# ---- the API: mesh= vs process_group= ----------------------------------------------------------------
def _api_cases(rank, world):
    mesh = mesh_2d(2, 2)
    m = Odd()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=r"mesh=.*process_group=|process_group=.*mesh="):
        zk.ZeroAdamW(m, mesh=mesh, process_group=mesh.get_group("shard"))
    bad = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="replicate"):
        zk.ZeroAdamW(m, mesh=bad)
    with pytest.raises(TypeError, match="DeviceMesh"):
        zk.ZeroAdamW(m, mesh=mesh.get_group("shard"))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())     # nothing changed
    # one rank of row 1 differs: every row raises at once, naming global ranks 2 and 3 (row 0 used to time out,
    # and rows named shard-group ranks)
    with pytest.raises(ValueError, match=r"lr=0\.002 but rank 2 with lr=0\.001|hyper-parameters differ between "
                                         r"rank 2 and rank 3"):
        zk.ZeroAdamW(Odd(), mesh=mesh, lr=2e-3 if rank == 3 else 1e-3, timeout=60)
    # a 1-D mesh is process_group=mesh.get_group(): bit-identical training
    mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    a, _ = hybrid_run(dict(stage=2, bucket_size=64), mesh=mesh1)
    b, _ = hybrid_run(dict(stage=2, bucket_size=64), process_group=mesh1.get_group())
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hybrid_api_world4():
    run_world(_api_cases, 4, timeout=300)


# ---- checkpoints: 2x2 -> world 3 (1-D) -> 2x2 ---------------------------------------------------------
CK_BATCH = 12          # rows per step: 3 per rank at world 4, 4 per rank at world 3


def ck_train(model, opt, steps, rank, world):
    for s in steps:
        x, y = odd_data(s, 4)                                   # 12 rows whatever the world
        n = CK_BATCH // world
        F.mse_loss(model(x[n * rank:n * rank + n]), y[n * rank:n * rank + n]).backward()
        opt.step()
        opt.zero_grad()


def ck_opt(stage, **where):
    torch.manual_seed(11)
    model = Odd()
    return model, zk.ZeroAdamW(model, stage=stage, lr=1e-2, bucket_size=36, backend="reference", timeout=60,
                               **where)


def _ck_save_2x2(rank, world, root, stage):
    mesh = mesh_2d(2, 2)
    model, opt = ck_opt(stage, mesh=mesh)
    ck_train(model, opt, range(3), rank, world)
    vdir = opt.save_checkpoint(os.path.join(root, "a"))
    at3 = opt.full_model_state_dict()
    ck_train(model, opt, range(3, 5), rank, world)
    at5 = opt.full_model_state_dict()
    if rank == 0:
        torch.save({"vdir": vdir, "at3": at3, "at5": at5}, os.path.join(root, "a.pt"))


def _ck_world3(rank, world, root, stage):
    saved = torch.load(os.path.join(root, "a.pt"))
    model, opt = ck_opt(stage)
    opt.load_checkpoint(os.path.join(root, "a"))
    full = opt.full_model_state_dict()
    assert all(torch.equal(full[k], v) for k, v in saved["at3"].items())
    ck_train(model, opt, range(3, 5), rank, world)              # the moments came back too
    full = opt.full_model_state_dict()
    for k, v in saved["at5"].items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    opt.save_checkpoint(os.path.join(root, "b"))
    if rank == 0:
        torch.save(full, os.path.join(root, "b.pt"))


def _ck_load_2x2(rank, world, root, stage):
    saved = torch.load(os.path.join(root, "b.pt"))
    model, opt = ck_opt(stage, mesh=mesh_2d(2, 2))
    opt.load_checkpoint(os.path.join(root, "b"))
    full = opt.full_model_state_dict()
    assert all(torch.equal(full[k], v) for k, v in saved.items())
    ck_train(model, opt, range(5, 6), rank, world)
    assert_same_on_every_rank(opt.full_model_state_dict())


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_checkpoint_2x2_to_world3_and_back(tmp_path, stage):
    root = str(tmp_path)
    run_world(_ck_save_2x2, 4, root, stage, timeout=300)
    vdir = torch.load(os.path.join(root, "a.pt"))["vdir"]
    names = sorted(os.listdir(vdir))
    shards = [n for n in names if n.startswith("shard") or "rank" in n]
    assert len(shards) == 2, names             # the shard group's 2 shards, written once (first replica)
    run_world(_ck_world3, 3, root, stage, timeout=300)
    run_world(_ck_load_2x2, 4, root, stage, timeout=300)


# ---- the step-time model's hybrid layout (zero_kernels/step_time.py) -----------------------------------
def test_step_time_hybrid_mesh_shapes():
    """Per-link bytes of a (R, S) mesh, by hand: the 2x2 layout of these tests on 2 GPUs per node, and
    the two ends S = n (plain ZeRO) and S = 1 (DDP's all-reduce)."""
    from zero_kernels.step_time import Cluster, Options, estimate
    psi, b = 1e9, 2
    two_nodes = Cluster(gpus=4, gpus_per_node=2)
    for stage, gathers in ((1, 1), (2, 1), (3, 2)):
        est = estimate(psi, 1024, two_nodes, Options(stage, hybrid=True, shard_size=2))
        # reduce-scatter + gathers over 2 ranks inside a node: V/2 each; gradient shard (psi/2)
        # all-reduced across 2 replicas on the other node: 2 * (psi/2) * b * 1/2
        assert est.bytes_by_link["intra"] == pytest.approx((1 + gathers) * psi * b / 2)
        assert est.bytes_by_link["inter"] == pytest.approx(psi * b / 2)
        plain = estimate(psi, 1024, two_nodes, Options(stage))
        assert plain.bytes_by_link["inter"] == pytest.approx((1 + gathers) * psi * b * 3 / 4)
        full = estimate(psi, 1024, two_nodes, Options(stage, hybrid=True, shard_size=4))
        assert full.bytes_by_link == plain.bytes_by_link                       # S = n: plain ZeRO
    ddp = estimate(psi, 1024, two_nodes, Options(0))
    s1 = estimate(psi, 1024, two_nodes, Options(2, hybrid=True, shard_size=1))
    assert s1.bytes_by_link == ddp.bytes_by_link                                # S = 1: DDP
    one_node = Cluster(gpus=4, gpus_per_node=4)
    est = estimate(psi, 1024, one_node, Options(3, hybrid=True, shard_size=2))
    assert est.bytes_by_link["inter"] == 0                                      # replicas in one node
    with pytest.raises(ValueError, match="shard_size"):
        estimate(psi, 1024, two_nodes, Options(3, hybrid=True, shard_size=3))
    with pytest.raises(ValueError, match="hybrid"):
        Options(3, shard_size=2)


def test_plan_simulate_shard_size(capsys):
    """`plan --simulate --shard-size S` prints the (R, S) mesh rows; an S that does not divide --gpus is
    refused naming the flag."""
    from zero_kernels.plan import main
    assert main(["--params", "1e9", "--gpus", "4", "--gpus-per-node", "2", "--stage", "3", "--simulate",
                 "--shard-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 + hybrid S=2" in out and "ZeRO-2 + hybrid S=2" in out
    assert main(["--params", "1e9", "--gpus", "4", "--gpus-per-node", "2", "--simulate", "--shard-size", "3"]) == 2
    assert "--shard-size 3" in capsys.readouterr().err
