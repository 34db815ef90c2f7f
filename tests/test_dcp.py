"""DCP checkpoints shared with FSDP2 (zero_kernels/dcp.py, [Note: DCP interop]): a run moves between
FSDP2 (``fully_shard`` + torch.optim.AdamW) and ZeRO stages 1-3 at other world sizes, both ways.

Data: every rank trains on the SAME full batch (as tests/test_checkpoint.py), so each continuation
after a reshard is comparable with the uninterrupted run of the saving world. The save world (2
gloo ranks) writes three DCP checkpoints and, per checkpoint, the full state at the save (parameters
and Adam moments, gathered independently of zero_kernels/dcp.py) and the uninterrupted run's final
parameters; load worlds of 3 and 1 ranks load, compare bitwise at the save, continue and compare.
The model has sizes that divide by neither 2 nor 3 (rows 37, 13, 5, 1: FSDP2 leaves a rank empty),
a 3-D parameter, a frozen parameter and a buffer; the ZeRO-1 case adds a 0-dim parameter.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402
from test_zero import batch as lm_batch, loss_fn, make_model as make_lm  # noqa: E402

import zero_kernels as zk  # noqa: E402
import zero_kernels.dcp as zk_dcp  # noqa: E402
from zero_kernels.zero.relayout import chunk_range, chunk_shape  # noqa: E402
from zero_kernels.zero.timeouts import CollectiveTimeoutError  # noqa: E402

V, D, H, T, B = 37, 10, 13, 4, 3
K = 3                                  # steps before the save, and after it
LR, LR_NO_DECAY = 1e-2, 2e-2


class Net(nn.Module):
    def __init__(self, scalar: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.1, requires_grad=False)     # frozen
        self.mix = nn.Parameter(torch.randn(5, 2, D) * 0.1)                        # 3-D, 5 rows
        self.fc1 = nn.Linear(D, H)
        self.ln = nn.LayerNorm(H)
        self.fc2 = nn.Linear(H, V)
        self.gate = nn.Parameter(torch.ones(1))                                    # 1 row
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D))
        self.temp = nn.Parameter(torch.tensor(1.25)) if scalar else None           # 0-dim

    def forward(self, idx):
        x = (self.emb(idx) + self.pos) * self.scale
        x = x + x @ self.mix.reshape(D, D).t()
        h = F.gelu(self.ln(self.fc1(x))) * self.gate
        if self.temp is not None:
            h = h * self.temp
        return self.fc2(h)


def make_model(seed=0, scalar=False):
    torch.manual_seed(seed)
    return Net(scalar)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def loss_of(model, step):
    idx, tgt = batch(step)
    return F.cross_entropy(model(idx).reshape(-1, V), tgt.reshape(-1))


def groups(model, lr=LR):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if p.ndim >= 2], "weight_decay": 0.1, "lr": lr},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0, "lr": lr * 2}]


def train(model, opt, start, n):
    for s in range(start, start + n):
        loss_of(model, s).backward()
        opt.step()
        opt.zero_grad()


def fsdp2(model):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def zero(model, stage, bucket, lr=LR, cls=zk.ZeroAdamW, grouped=True):
    return cls(model, stage=stage, bucket_size=bucket, backend="reference", betas=(0.9, 0.95),
               param_groups=groups(model, lr) if grouped else None, lr=lr)


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def zero_moments(zopt):
    """{param name: {exp_avg, exp_avg_sq}} as full tensors, assembled from every rank's bucket slices
    with all_gather_object and the layout (not through zero_kernels/dcp.py)."""
    mine = [{k: t.clone() for k, t in b.state_tensors().items()} for b in zopt.buckets]
    every = [None] * zopt.world_size
    dist.all_gather_object(every, mine)
    out = {}
    for bi, b in enumerate(zopt.buckets):
        for k in ("exp_avg", "exp_avg_sq"):
            flat = torch.cat([every[r][bi][k] for r in range(zopt.world_size)])
            for ps in b.param_specs:
                out.setdefault(ps.name, {})[k] = flat[ps.offset:ps.offset + ps.numel].view(ps.shape).clone()
    return out


def save_ref(tmp, name, at_save, final):
    if dist.get_rank() == 0:
        torch.save({"at_save": at_save, "final": final}, os.path.join(tmp, name + ".ref.pt"))


def load_ref(tmp, name):
    return torch.load(os.path.join(tmp, name + ".ref.pt"), weights_only=True)


# ---- the save world (2 ranks) ----------------------------------------------------------------------
def _save_fsdp2(tmp):
    model = fsdp2(make_model())
    opt = torch.optim.AdamW(groups(model), betas=(0.9, 0.95))
    train(model, opt, 0, K)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, "fsdp2"))
    at_save = {"model": {k: full(v) for k, v in msd.items()},
               "moments": {k: {m: full(st[m]) for m in ("exp_avg", "exp_avg_sq")} for k, st in osd["state"].items()}}
    train(model, opt, K, K)
    save_ref(tmp, "fsdp2", at_save, {n: full(p) for n, p in model.named_parameters()})


def _save_zero(tmp, name, stage, bucket, scalar):
    model = make_model(scalar=scalar)
    zopt = zero(model, stage, bucket)
    train(model, zopt, 0, K)
    msd, osd = zk_dcp.get_state_dict(zopt)
    assert all(isinstance(msd[n], DTensor) for n, p in model.named_parameters() if p.requires_grad)
    assert not isinstance(msd["pos"], DTensor) and not isinstance(msd["scale"], DTensor)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(tmp, name))
    at_save = {"model": zopt.full_model_state_dict(), "moments": zero_moments(zopt)}
    train(model, zopt, K, K)
    save_ref(tmp, name, at_save, zopt.full_model_state_dict())


def _save_world(rank, world, tmp):
    _save_fsdp2(tmp)
    _save_zero(tmp, "zero2", 2, 100, False)
    _save_zero(tmp, "zero1", 1, 64, True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    run_world(_save_world, 2, tmp, timeout=600)
    return tmp


# ---- load worlds ---------------------------------------------------------------------------------
def _perturbed(scalar=False):
    model = make_model(seed=1, scalar=scalar)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model


def _check_loaded_zero(zopt, ref, name):
    got = zopt.full_model_state_dict()
    for k, v in ref["at_save"]["model"].items():
        assert torch.equal(got[k], v), f"{name}: {k} not restored bitwise"
    msd, osd = zk_dcp.get_state_dict(zopt)          # and back out through the re-layout
    for k, st in ref["at_save"]["moments"].items():
        for m, v in st.items():
            assert torch.equal(full(osd["state"][k][m]), v), f"{name}: {k} {m} not restored bitwise"
        assert float(osd["state"][k]["step"]) == K
    assert zopt.steps == [K] * len(zopt.layout.params)
    assert [g["lr"] for g in zopt.param_groups] == [LR, 2 * LR]


def _load_zero(tmp, name, stage, bucket, scalar):
    ref = load_ref(tmp, name)
    model = _perturbed(scalar)
    zopt = zero(model, stage, bucket, lr=1234.0)
    assert not torch.equal(zopt.full_model_state_dict()["fc1.weight"], ref["at_save"]["model"]["fc1.weight"])
    msd, osd = zk_dcp.get_state_dict(zopt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(tmp, name))
    zk_dcp.set_state_dict(zopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _check_loaded_zero(zopt, ref, name)
    train(model, zopt, K, K)
    got = zopt.full_model_state_dict()
    for k, v in ref["final"].items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")


def _load_world3(rank, world, tmp):
    _load_zero(tmp, "fsdp2", 3, 200, False)      # (a) FSDP2 on 2 -> ZeRO-3 on 3
    _load_zero(tmp, "zero1", 1, 10**7, True)     # ZeRO-1 on 2 (0-dim parameter) -> ZeRO-1 on 3


def test_fsdp2_to_zero3_and_zero1_reshard(saved):
    run_world(_load_world3, 3, saved, timeout=600)


def _load_fsdp2_world1(rank, world, tmp):
    ref = load_ref(tmp, "zero2")
    model = fsdp2(_perturbed())
    opt = torch.optim.AdamW(groups(model, lr=1234.0), betas=(0.9, 0.95))
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(tmp, "zero2"))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for n, p in model.named_parameters():
        assert torch.equal(full(p), ref["at_save"]["model"][n]), n
    assert torch.equal(model.scale, ref["at_save"]["model"]["scale"])
    assert [g["lr"] for g in opt.param_groups] == [LR, 2 * LR]
    assert all(g["decoupled_weight_decay"] for g in opt.param_groups)
    train(model, opt, K, K)
    for n, p in model.named_parameters():
        torch.testing.assert_close(full(p), ref["final"][n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_zero2_to_fsdp2_world1(saved):
    """(b) ZeRO-2 on 2 -> DCP -> FSDP2 on 1, continued training matches ZeRO-2 continuing."""
    run_world(_load_fsdp2_world1, 1, saved, timeout=300)


def test_dcp_to_torch_save(saved, tmp_path):
    """format_utils.dcp_to_torch_save turns a zero_kernels DCP checkpoint into full tensors equal to the
    model (full_model_state_dict) and the optimizer (the moments from the bucket slices), bitwise."""
    out = str(tmp_path / "zero2.pt")
    dcp_to_torch_save(os.path.join(saved, "zero2"), out)
    sd = torch.load(out, weights_only=False)
    ref = load_ref(saved, "zero2")["at_save"]
    assert set(sd["model"]) == set(ref["model"])
    for k, v in ref["model"].items():
        assert torch.equal(sd["model"][k], v), k
    assert set(sd["optim"]["state"]) == set(ref["moments"])
    for k, st in ref["moments"].items():
        for m, v in st.items():
            assert torch.equal(sd["optim"]["state"][k][m], v), (k, m)
        assert float(sd["optim"]["state"][k]["step"]) == K
    g = sd["optim"]["param_groups"]
    assert [x["lr"] for x in g] == [LR, 2 * LR] and all(x["decoupled_weight_decay"] for x in g)
    assert sorted(g[0]["params"]) == sorted(["emb.weight", "mix", "fc1.weight", "fc2.weight"])


def test_fsdp2_reference_is_single_process_adamw(saved, tmp_path):
    """The reference of (a) (FSDP2 continuing on its 2 ranks, which ZeRO-3 on 3 ranks matches) is
    itself what one process with torch.optim.AdamW gives when continuing from the same state (the
    FSDP2 checkpoint turned into a plain file by dcp_to_torch_save)."""
    out = str(tmp_path / "fsdp2.pt")
    dcp_to_torch_save(os.path.join(saved, "fsdp2"), out)
    sd = torch.load(out, weights_only=False)
    ref = load_ref(saved, "fsdp2")
    model = _perturbed()
    opt = torch.optim.AdamW(groups(model, lr=1234.0), betas=(0.9, 0.95))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                   options=StateDictOptions(full_state_dict=True))
    assert [g["lr"] for g in opt.param_groups] == [LR, 2 * LR]
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref["at_save"]["model"][n]), n
    train(model, opt, K, K)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref["final"][n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


# ---- plain full tensors and mismatches (one process, no process group) ----------------------------
class Renamed(Net):
    def __init__(self):
        super().__init__()
        self.fc1b = self.fc1
        del self.fc1

    def forward(self, idx):
        raise NotImplementedError


def _snapshot(zopt):
    return {k: v.clone() for k, v in zopt.full_model_state_dict().items()}


def _refused(model, saved, dcp_match, zk_match, **parts):
    """A ZeRO-2 optimizer over ``model``: DCP's load of the zero2 checkpoint into its template and
    set_state_dict(**parts) both raise (matching the patterns); returns it and its state before."""
    zopt = zero(model, 2, 100)
    before = _snapshot(zopt)
    msd, osd = zk_dcp.get_state_dict(zopt)
    with pytest.raises(CheckpointException, match=dcp_match):
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(saved, "zero2"))
    with pytest.raises(ValueError, match=zk_match):
        zk_dcp.set_state_dict(zopt, **parts)
    return zopt, before


def test_plain_file_and_mismatches(saved, tmp_path):
    out = str(tmp_path / "zero2.pt")
    dcp_to_torch_save(os.path.join(saved, "zero2"), out)
    sd = torch.load(out, weights_only=False)
    ref = load_ref(saved, "zero2")
    # positive: the plain file (full tensors) loads into ZeRO-2 at world 1 and continues like the run
    model = _perturbed()
    zopt = zero(model, 2, 100, lr=1234.0)
    zk_dcp.set_state_dict(zopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _check_loaded_zero(zopt, ref, "plain")
    train(model, zopt, K, K)
    for k, v in ref["final"].items():
        torch.testing.assert_close(zopt.full_model_state_dict()[k], v, rtol=1e-5, atol=1e-6)
    # a renamed parameter: DCP refuses the template, set_state_dict names both keys; nothing changes
    zopt, before = _refused(Renamed(), saved, r"Missing key in checkpoint state_dict: model\.fc1b\.",
                            r"missing 'fc1b.bias', 'fc1b.weight' and has unexpected 'fc1.bias', 'fc1.weight'",
                            model_state_dict=sd["model"])
    bad = {"state": {k.replace("fc1.", "fc1b."): v for k, v in sd["optim"]["state"].items()},
           "param_groups": sd["optim"]["param_groups"]}
    with pytest.raises(ValueError, match="no saved param group holds exactly"):
        zk_dcp.set_state_dict(zopt, optim_state_dict=bad)
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(zopt).items())
    assert zopt.steps == [0] * len(zopt.layout.params)
    # a mis-shaped parameter (13 -> 14 rows): DCP and set_state_dict both refuse, naming it
    torch.manual_seed(0)
    model = make_model()
    model.fc1 = nn.Linear(D, H + 1)
    model.ln = nn.LayerNorm(H + 1)
    model.fc2 = nn.Linear(H + 1, V)
    zopt, before = _refused(model, saved, r"(?i)size mismatch.*fc1\.weight|fc1\.weight.*size mismatch",
                            r"model_state_dict\['fc1.weight'\] has shape \(13, 10\)",
                            model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(zopt).items())
    # other param groups, Adam vs AdamW, a bad step: refused before any change
    model = make_model()
    zopt = zero(model, 2, 100, grouped=False)
    with pytest.raises(ValueError, match="no saved param group holds exactly"):
        zk_dcp.set_state_dict(zopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    model = make_model()
    zopt = zero(model, 2, 100, cls=zk.ZeroAdam)
    with pytest.raises(ValueError, match="saved by AdamW.*load it into ZeroAdamW"):
        zk_dcp.set_state_dict(zopt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert all(torch.equal(v, make_model().state_dict()[k]) for k, v in model.state_dict().items())
    bad = {"state": {k: {**v, "step": torch.tensor(1.5)} for k, v in sd["optim"]["state"].items()},
           "param_groups": sd["optim"]["param_groups"]}
    with pytest.raises(ValueError, match=r"\['step'\] must be a non-negative whole number"):
        zk_dcp.set_state_dict(zopt, optim_state_dict=bad)


def test_chunk_ranges_are_torch_chunk():
    """[Note: dim-0 chunks] against torch.chunk (FSDP2's Shard(0)) for odd shapes and world sizes,
    including more ranks than rows and 0-dim / empty parameters."""
    for shape in [(1,), (2,), (7,), (13, 10), (5, 2, 10), (3, 1, 1), (0, 4), ()]:
        x = torch.arange(int(torch.tensor(shape).prod()) if shape else 1).reshape(shape)
        for world in (1, 2, 3, 4, 5, 8):
            ch = torch.chunk(x, world, 0) if shape else [x]
            for r in range(world):
                want = ch[r] if r < len(ch) else x[x.shape[0]:] if shape else None
                cr = chunk_range(shape, r, world)
                got = x.reshape(-1)[cr.start:cr.start + cr.numel]
                if want is None:
                    assert cr.numel == 0 and chunk_shape(shape, r, world) == ()
                    continue
                assert chunk_shape(shape, r, world) == tuple(want.shape), (shape, world, r)
                assert torch.equal(got, want.reshape(-1)), (shape, world, r)


def _peer_never_comes(rank, world):
    model = make_model()
    zopt = zk.ZeroAdamW(model, stage=2, bucket_size=100, backend="reference", timeout=3.0)
    if rank == 1:
        with pytest.raises(CollectiveTimeoutError, match="did not complete"):
            zk_dcp.get_state_dict(zopt)
        with pytest.raises(ValueError, match="optim_state_dict is missing 'param_groups'"):
            zk_dcp.set_state_dict(zopt, optim_state_dict={"state": {}})


def test_collectives_bounded_by_timeout():
    """A rank whose peer never reaches get_state_dict fails with CollectiveTimeoutError after the
    optimizer's timeout instead of hanging."""
    run_world(_peer_never_comes, 2, timeout=120)


def test_bf16_amsgrad_tied_round_trip(tmp_path):
    """One process, no process group (plain tensors): 16-bit working parameters, amsgrad's
    max_exp_avg_sq, tied/frozen/unused parameters (test_zero.TinyLM) and stage 3 units. DCP save ->
    load into a perturbed copy restores everything bitwise, and both continue bitwise alike."""
    for stage in (2, 3):
        runs = []
        for seed in (0, 7):
            model = make_lm(seed=seed)
            zopt = zk.ZeroAdamW(model, stage=stage, bucket_size=300, backend="reference", amsgrad=True,
                                param_dtype=torch.bfloat16, lr=1e-2)
            runs.append((model, zopt))
        (m0, z0), (m1, z1) = runs
        for s in range(K):
            loss_fn(m0, *lm_batch(s, 1)).backward()
            z0.step()
            z0.zero_grad()
        for z, v in ((z0, 0.0125), (z1, 5.0)):       # as an LR scheduler sets it (the loaded one must win)
            for g in z.param_groups:
                g["initial_lr"] = v
        msd, osd = zk_dcp.get_state_dict(z0)
        assert msd["head.weight"] is msd["emb.weight"] and "head.weight" not in osd["state"]
        assert set(osd["state"]["unused"]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
        assert float(osd["state"]["unused"]["step"]) == 0 and float(osd["state"]["gate"]["step"]) == K
        path = str(tmp_path / f"lm{stage}")
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        assert not torch.equal(z1.full_model_state_dict()["emb.weight"], z0.full_model_state_dict()["emb.weight"])
        msd, osd = zk_dcp.get_state_dict(z1)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        zk_dcp.set_state_dict(z1, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        assert [g["initial_lr"] for g in z1.param_groups] == [0.0125] * len(z1.param_groups)
        for b0, b1 in zip(z0.buckets, z1.buckets):
            for k, t in b0.state_tensors().items():
                assert torch.equal(t, b1.state_tensors()[k]), (stage, k)
            assert torch.equal(b0.owned_params, b1.owned_params)
        assert z0.steps == z1.steps
        for s in range(K, 2 * K):
            for m, z in runs:
                loss_fn(m, *lm_batch(s, 1)).backward()
                z.step()
                z.zero_grad()
        f0, f1 = z0.full_model_state_dict(), z1.full_model_state_dict()
        assert all(torch.equal(f0[k], f1[k]) for k in f0), stage
        with z0.gathered(), z1.gathered():
            for (n, p), q in zip(m0.named_parameters(), m1.parameters()):
                assert p.dtype == torch.bfloat16 and torch.equal(p, q), (stage, n)
