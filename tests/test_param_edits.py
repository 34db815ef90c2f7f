"""[Note: parameters edited outside the optimizer] (zero_kernels/_param_edits.py): a 16-bit parameter written
between steps (pruning, model.load_state_dict, p.data + refresh_fp32_params()) is what FusedAdamW continues
from, as torch.optim.AdamW does, for fp32 masters and remainders, fp32 and coded moments, on every backend;
unwritten elements keep their masters bit for bit (a checkpoint loaded model-after-optimizer resumes exactly).
Before the fix an fp32 master silently undid the write, and remainders joined to a pruned (zeroed) parameter
made NaN masters; a remainder join now also saturates at +-0, so ``.data`` writes stand with remainders even
without refresh_fp32_params()."""
import copy

import pytest
import torch

import zero_kernels as zk
from conftest import BACKENDS

BF = torch.bfloat16
FORMATS = {
    "fp32 master": {},
    "remainders": dict(store_param_remainders=True),
    "8-bit + fp32 master": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, min_8bit_size=0),
    "bf16 moments + remainders": dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF, store_param_remainders=True),
}
HP = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 41), torch.nn.Tanh(), torch.nn.Linear(41, 3))


def train(m, o, steps, seed):
    """``steps`` steps on gradients drawn from ``seed`` (bf16-rounded, so a bf16 and an fp32 copy of a model get
    the same values), whatever the model's dtype."""
    for s in range(steps):
        g = torch.Generator().manual_seed(seed * 100 + s)
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(BF).to(p.dtype)
        o.step()


def prune(m, how):
    """Zero every other element of the first weight through torch (``with torch.no_grad()``), or ``.data``."""
    w = m[0].weight
    mask = torch.arange(w.numel()).reshape(w.shape) % 2 == 0
    if how == "torch":
        with torch.no_grad():
            w.mul_(mask.to(w.dtype))
    else:
        w.data.mul_(mask.to(w.dtype))
    return mask


def bf16_run(fmt, backend, how):
    """bf16 model under FusedAdamW (fmt), pruned after 3 steps, 3 more steps; beside torch.optim.AdamW on an fp32
    copy of the same model with the same gradients, pruned alike."""
    m = net().to(BF)
    t = copy.deepcopy(m).float()
    o = zk.FusedAdamW(m.parameters(), backend=backend, **HP, **fmt)
    ot = torch.optim.AdamW(t.parameters(), **HP)
    train(m, o, 3, 1)
    train(t, ot, 3, 1)
    mask = prune(m, how)
    prune(t, "torch")
    if how == "data":
        o.refresh_fp32_params()
    train(m, o, 3, 2)
    train(t, ot, 3, 2)
    return m, t, o, mask


@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_pruned_parameter_continues_from_the_pruned_values(fmt, backend):
    m, t, _, mask = bf16_run(FORMATS[fmt], backend, "torch")
    w, wt = m[0].weight.float(), t[0].weight
    assert not torch.isnan(w).any()
    lr_steps = 3 * HP["lr"]
    # pruned elements restarted from 0: after 3 steps they are within 3 lr of it (they were ~0.1 before)
    assert w[~mask].abs().max() <= lr_steps * 1.01
    assert wt[~mask].abs().max() <= lr_steps * 1.01
    # and follow torch's fp32 run: the bf16 parameter is the rounding of a master equal to torch's fp32 parameter
    # (fp32 moments: one bf16 rounding apart; coded moments: their quantization error on top)
    for p, q in zip(m.parameters(), t.parameters()):
        if "8-bit" in fmt or "bf16 moments" in fmt:
            torch.testing.assert_close(p.float(), q, rtol=0.05, atol=2e-3)
        else:
            torch.testing.assert_close(p.float(), q, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_replaced_data_is_adopted_without_a_call(fmt, backend):
    """``p.data = x`` (``torch.nn.utils.vector_to_parameters`` writes so) moves the parameter's data pointer, which
    the watch records beside the version counter: the next step adopts it with no refresh_fp32_params(), and the
    run equals the one written through torch, bit for bit (was: an fp32 master silently undid the write)."""
    runs = []
    for how in ("torch", "vector_to_parameters"):
        m = net().to(BF)
        o = zk.FusedAdamW(m.parameters(), backend=backend, **HP, **FORMATS[fmt])
        train(m, o, 3, 1)
        vec = torch.nn.utils.parameters_to_vector(m.parameters())
        vec[::3] = 0
        if how == "torch":
            with torch.no_grad():
                for p, q in zip(m.parameters(), torch.split(vec, [p.numel() for p in m.parameters()])):
                    p.copy_(q.view_as(p))
        else:
            torch.nn.utils.vector_to_parameters(vec, m.parameters())
        train(m, o, 3, 2)
        runs.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert float(runs[1][0].float().abs().min()) <= 3 * HP["lr"] * 1.01     # the zeros were adopted


@pytest.mark.parametrize("fmt", ["fp32 master", "remainders"])
def test_data_writes_need_refresh_fp32_params(fmt):
    """``p.data`` writes bypass the version counter: refresh_fp32_params() adopts them (the same result as the
    write through torch). Without it, the negative control, an fp32 master silently wins; a remainder keeps the
    write: the join of the written bits and the old remainder rounds to them and saturates at +-0 ([Note: state
    codecs] 4; a wrapping join made NaN masters of the pruned elements), so that run equals the one pruned
    through torch, bit for bit."""
    m, _, _, mask = bf16_run(FORMATS[fmt], "cpu", "data")
    ref, _, _, _ = bf16_run(FORMATS[fmt], "cpu", "torch")
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters()))
    m2 = net().to(BF)
    o2 = zk.FusedAdamW(m2.parameters(), backend="cpu", **HP, **FORMATS[fmt])
    train(m2, o2, 3, 1)
    prune(m2, "data")                                  # no refresh: not seen
    train(m2, o2, 3, 2)
    w = m2[0].weight.float()[~mask]
    if fmt == "fp32 master":
        # the master won: pruned elements back near their old values (up to 0.2)
        assert (w.abs() > 2 * 3 * HP["lr"]).any()
    else:
        assert all(torch.equal(a, b) for a, b in zip(m2.parameters(), ref.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_data_writes_to_zero_with_remainders_on_every_backend(backend):
    """The remainder formats without refresh_fp32_params() on every backend (the kernels' joins): pruning through
    ``.data`` (about half the pruned elements keep a negative remainder) gives the run pruned through torch, bit
    for bit, and no NaN."""
    for fmt in ("remainders", "bf16 moments + remainders"):
        m = net().to(BF)
        o = zk.FusedAdamW(m.parameters(), backend=backend, **HP, **FORMATS[fmt])
        train(m, o, 3, 1)
        rem = o.state[m[0].weight]["master_remainder"]
        mask = prune(m, "data")
        assert int((rem[~mask] < 0).sum()) > 100       # the case a wrapping join turns into NaN masters
        train(m, o, 3, 2)
        ref, _, _, _ = bf16_run(FORMATS[fmt], backend, "torch")
        assert not m[0].weight.isnan().any()
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters())), fmt


@pytest.mark.parametrize("fmt", ["fp32 master", "remainders", "8-bit + fp32 master"])
@pytest.mark.parametrize("model_first", [True, False], ids=["model-then-opt", "opt-then-model"])
def test_checkpoint_loaded_in_either_order_resumes_bit_for_bit(fmt, model_first):
    """model.load_state_dict bumps every parameter's version: the next step adopts, and since every master of a
    consistent checkpoint rounds to its parameter, nothing changes: the resumed run equals the uninterrupted one."""
    a = net().to(BF)
    oa = zk.FusedAdamW(a.parameters(), backend="cpu", **HP, **FORMATS[fmt])
    train(a, oa, 3, 1)
    ckpt = copy.deepcopy((a.state_dict(), oa.state_dict()))
    train(a, oa, 3, 2)
    b = net(seed=9).to(BF)                             # other values: the loads must bring everything
    ob = zk.FusedAdamW(b.parameters(), backend="cpu", **HP, **FORMATS[fmt])
    train(b, ob, 2, 7)                                 # and states of its own, replaced by the load
    if model_first:
        b.load_state_dict(ckpt[0])
        ob.load_state_dict(ckpt[1])
    else:
        ob.load_state_dict(ckpt[1])
        b.load_state_dict(ckpt[0])
    train(b, ob, 3, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fmt", ["fp32 master", "remainders", "8-bit + fp32 master"])
def test_parameters_after_load_state_dict_are_what_the_run_continues_from(fmt):
    """optimizer.load_state_dict counts every parameter as written: (a) pruned after the load, the pruned values
    stand (one step later within its reach of 0); (b) an optimizer state loaded into a model holding other values
    (no model.load_state_dict) continues from those values, as torch's does: a step at lr 0 changes nothing.
    Before, load_state_dict forgot the version counters and the loaded fp32 masters overwrote both."""
    a = net().to(BF)
    oa = zk.FusedAdamW(a.parameters(), backend="cpu", **HP, **FORMATS[fmt])
    train(a, oa, 3, 1)
    sd = copy.deepcopy(oa.state_dict())
    b = copy.deepcopy(a)
    ob = zk.FusedAdamW(b.parameters(), backend="cpu", **HP, **FORMATS[fmt])
    ob.load_state_dict(sd)
    mask = prune(b, "torch")
    train(b, ob, 1, 2)
    w = b[0].weight.float()
    assert not torch.isnan(w).any() and float(w[~mask].abs().max()) <= 2 * HP["lr"]
    assert float(a[0].weight.float()[~mask].abs().max()) > 10 * HP["lr"]      # the pruned values were not ~0
    c = net(seed=9).to(BF)
    before = [p.detach().clone() for p in c.parameters()]
    oc = zk.FusedAdamW(c.parameters(), backend="cpu", **HP, **FORMATS[fmt])
    oc.load_state_dict(sd)
    oc.param_groups[0]["lr"] = 0.0
    train(c, oc, 1, 3)
    assert all(torch.equal(p, q) for p, q in zip(c.parameters(), before))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), before))   # a's masters would differ


def test_model_cast_to_fp32_continues_from_its_masters():
    """``model.float()`` after steps with fp32 masters: the fp32 parameters take their masters' values and train
    on as fp32 parameters (the master dropped), like a model trained in fp32 from those masters."""
    m = net().to(BF)
    o = zk.FusedAdamW(m.parameters(), backend="cpu", **HP)
    train(m, o, 3, 1)
    masters = [o.state[p]["master_param"].clone() for p in m.parameters()]
    m.float()
    o.zero_grad()
    for p, mp in zip(m.parameters(), masters):
        with torch.no_grad():
            assert torch.equal(p.to(BF), mp.to(BF))
    r = copy.deepcopy(m)
    with torch.no_grad():
        for p, mp in zip(r.parameters(), masters):
            p.copy_(mp)
    orr = zk.FusedAdamW(r.parameters(), backend="cpu", **HP)
    sd = copy.deepcopy(o.state_dict())                 # a copy: torch's load keeps the given tensors
    orr.load_state_dict({**sd, "state": {i: {k: v for k, v in st.items() if k != "master_param"}
                                         for i, st in sd["state"].items()}})
    train(m, o, 2, 2)
    train(r, orr, 2, 2)
    assert all("master_param" not in o.state[p] for p in m.parameters())
    for p, q in zip(m.parameters(), r.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q)


def _zero_worker(rank, world):
    """ZeroAdamW stages 1-2, bf16 parameters with fp32 masters or remainders, world 2: (a) pruned elements continue
    from 0 (no NaN, within the steps' reach of it); (b) a write that changes nothing (model.load_state_dict of the
    model's own values: versions move, values do not) keeps every master: the run equals an untouched one bit for
    bit; (c) pruning through ``p.data`` then ``refresh_fp32_params()`` equals pruning through torch, bit for bit;
    without the call an fp32 master undoes it (the negative control) while remainders keep it (the saturating
    join, [Note: state codecs] 4: bit for bit again)."""
    def run(stage, fmt, edit):
        torch.manual_seed(0)
        m = net()
        o = zk.ZeroAdamW(m, stage=stage, param_dtype=BF, backend="reference", bucket_size=700, timeout=60, **HP,
                         **fmt)
        for s in range(6):
            if s == 3 and edit == "prune":
                prune(m, "torch")
            if s == 3 and edit in ("data", "data+refresh"):
                prune(m, "data")
                if edit == "data+refresh":
                    o.refresh_fp32_params()
            if s == 3 and edit == "reload":
                m.load_state_dict(m.state_dict())
            g = torch.Generator().manual_seed(100 + s)
            x = torch.randn(4 * world, 24, generator=g)[rank * 4:(rank + 1) * 4].to(BF)
            m(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
        return o.full_model_state_dict()
    for stage in (1, 2):
        for name in ("fp32 master", "remainders"):
            fmt = FORMATS[name]
            by_torch = run(stage, fmt, "prune")
            pruned = by_torch["0.weight"].float()
            mask = torch.arange(pruned.numel()).reshape(pruned.shape) % 2 == 0
            assert not pruned.isnan().any(), (stage, name)
            assert pruned[~mask].abs().max() <= 3 * HP["lr"] * 1.01, (stage, name)
            same, untouched = run(stage, fmt, "reload"), run(stage, fmt, None)
            assert all(torch.equal(same[k], untouched[k]) for k in untouched), (stage, name)
            refreshed, unseen = run(stage, fmt, "data+refresh"), run(stage, fmt, "data")
            assert all(torch.equal(refreshed[k], by_torch[k]) for k in by_torch), (stage, name)
            if name == "fp32 master":
                assert unseen["0.weight"].float()[~mask].abs().max() > 2 * 3 * HP["lr"], (stage, name)
            else:
                assert all(torch.equal(unseen[k], by_torch[k]) for k in by_torch), (stage, name)
    for stage in (1, 2):    # .data REPLACED (not written in place): refresh_fp32_params raises as step() does
        m = net()
        o = zk.ZeroAdamW(m, stage=stage, param_dtype=BF, backend="reference", timeout=60, **HP)
        m[2].weight.data = m[2].weight.detach().clone()
        with pytest.raises(RuntimeError, match=r"parameter '2.weight' is no longer stored in ZeroAdamW's buffers"):
            o.refresh_fp32_params()


def test_zero_stages_1_2_adopt_parameters_written_between_steps():
    from _dist import run_world
    run_world(_zero_worker, 2, timeout=240)


@pytest.mark.parametrize("fmt", ["fp32 master", "remainders"])
def test_refresh_after_a_shape_or_dtype_change_through_data_names_the_parameter(fmt):
    """``p.data = <another shape>`` (or, with remainders, another dtype) then refresh_fp32_params(): an error naming
    the parameter and the fix, raised before any master changes (was torch's bare "The size of tensor a (20)
    must match ..." from the adoption)."""
    m = net().to(BF)
    o = zk.FusedAdamW(m.parameters(), backend="cpu", **HP, **FORMATS[fmt])
    train(m, o, 2, 1)
    key = "master_param" if fmt == "fp32 master" else "master_remainder"
    first = o.state[m[0].weight][key].clone()
    with torch.no_grad():
        m[0].weight.mul_(0.5)                             # a write the refresh would adopt ...
    m[2].weight.data = torch.zeros(5, 41, dtype=BF)      # ... and a shape change in a later parameter
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\]\[2\] has shape \(5, 41\), its state "
                                           f"'{key}' \\(3, 41\\).*build a new one.*No master was changed"):
        o.refresh_fp32_params()
    assert torch.equal(o.state[m[0].weight][key], first)
    if fmt == "remainders":
        m[2].weight.data = torch.zeros(3, 41)
        with pytest.raises(RuntimeError, match=r"\['params'\]\[2\] is torch.float32 now.*must stay bf16"):
            o.refresh_fp32_params()
        assert torch.equal(o.state[m[0].weight][key], first)
