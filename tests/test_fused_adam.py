"""FusedAdam / FusedAdamW against torch.optim.Adam / AdamW, on every available backend.

The Triton kernel runs in the interpreter (conftest sets TRITON_INTERPRET=1), so it is the code
under test here, not only the reference.
"""
import copy
import random
from dataclasses import dataclass

import pytest
import torch

import zero_kernels as zk
from zero_kernels import backends
from conftest import BACKENDS

# Odd sizes, a 0-dim and an empty parameter, sizes around the Triton chunk (4096) and block (1024).
SHAPES = [(), (0,), (1,), (7, 3), (33,), (1003,), (4097,), (129, 65), (5, 1, 9)]


def make_params(seed, dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def random_hparams(rng):
    return dict(lr=rng.choice([1e-3, 3e-3, 1e-2]), betas=(rng.choice([0.8, 0.9]), rng.choice([0.99, 0.999])),
                eps=rng.choice([1e-8, 1e-6]), weight_decay=rng.choice([0.0, 0.1, 0.03]),
                amsgrad=rng.random() < 0.5, maximize=rng.random() < 0.3)


def groups_of(params, rng, hp):
    """Split params into 2-3 groups with different lr / weight decay."""
    cut1, cut2 = sorted(rng.sample(range(1, len(params)), 2))
    return [{"params": params[:cut1]},
            {"params": params[cut1:cut2], "lr": hp["lr"] * 0.5, "weight_decay": 0.0},
            {"params": params[cut2:], "weight_decay": hp["weight_decay"] + 0.05, "amsgrad": not hp["amsgrad"]}]


def set_grads(params_list, step, seed, dtype=None, skip=()):
    """The same random gradient (rounded to `dtype` if given) into each list of parameters."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    for i, ps in enumerate(zip(*params_list)):
        grad = torch.randn(ps[0].shape, generator=g) * (1 + i)
        if dtype is not None:
            grad = grad.to(dtype)
        for p in ps:
            p.grad = None if i in skip else grad.to(p.dtype).clone()


# [Note: sensitive cases]
# Random hyper-parameters with unit gradients leave some terms invisible: eps=1e-8 next to
# sqrt(v_hat) ~ 1 moves the result by 1e-8 (eps inside or outside the sqrt), Adam is invariant to a
# gradient scale unless eps or L2 weight decay matters, amsgrad equals plain Adam while v only grows,
# and a decoupled decay of 1 - 1e-5 applied before or after the update differs by 1e-7. Each case
# below makes ONE term decisive; its `control` is a change of that term that torch.optim itself must
# notice under the same tolerance (the proof that the case is sensitive, checked in every run).
# `mults` scale the gradient of each step; `grad_scale` (a loss scale, a power of two: exact) is
# passed to step() with the gradients multiplied by it, and `control` may scale torch's gradients
# ("grad_mult").
@dataclass(frozen=True)
class Case:
    adamw: bool
    hp: dict
    control: dict
    mults: tuple = (1.0,) * 6
    grad_scale: float | None = None


CASES = {
    "plain_bias_correction_betas": Case(True, dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
                                        dict(betas=(0.95, 0.8))),
    "eps_small_grads": Case(True, dict(lr=1e-2, eps=1e-6), dict(eps=1e-8), mults=(1e-6,) * 6),
    "eps_small_grads_amsgrad": Case(False, dict(lr=1e-2, eps=1e-6, amsgrad=True), dict(eps=1e-8),
                                    mults=(1e-6,) * 6),
    "maximize_adamw": Case(True, dict(lr=1e-2, weight_decay=0.1, maximize=True), dict(maximize=False)),
    "maximize_adam_l2": Case(False, dict(lr=1e-2, weight_decay=0.5, maximize=True), dict(maximize=False)),
    "amsgrad_decreasing": Case(True, dict(lr=1e-2, betas=(0.9, 0.5), amsgrad=True), dict(amsgrad=False),
                               mults=(10.0, 3.0, 1.0, 0.3, 0.1, 0.03)),
    "adamw_large_decay": Case(True, dict(lr=5e-2, weight_decay=1.0), dict(weight_decay=0.0)),
    "adam_l2": Case(False, dict(lr=1e-2, weight_decay=0.5), dict(weight_decay=0.0)),
    "grad_scale": Case(False, dict(lr=1e-2, eps=1e-3, weight_decay=0.1), dict(grad_mult=1024.0),
                       mults=(1e-3,) * 6, grad_scale=2.0 ** 10),
}
CASE_SHAPES = [(1,), (33,), (1003,), (4099,)]   # scalar tails, one masked block, two Triton chunks


def assert_close_rel(a, b, rel=1e-5, what=""):
    """Within rel of b elementwise, plus rel x max|b| absolute (scale-free: small-gradient states)."""
    torch.testing.assert_close(a, b, rtol=rel, atol=rel * float(b.abs().max()) + 1e-30,
                               msg=lambda m: f"{what}: {m}")


def run_torch(case, hp, seed, grad_mult=1.0):
    params = make_params(seed, shapes=CASE_SHAPES)
    opt = (torch.optim.AdamW if case.adamw else torch.optim.Adam)(params, foreach=False, **hp)
    for step, mult in enumerate(case.mults):
        set_grads([params], step, seed)
        for p in params:
            p.grad.mul_(mult * grad_mult)
        opt.step()
    return params, opt


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_each_hyperparameter_matters(backend, name):
    """See [Note: sensitive cases]: params and every state equal torch.optim's at rel 1e-5."""
    case, seed = CASES[name], 31
    ours = make_params(seed, shapes=CASE_SHAPES)
    oz = (zk.FusedAdamW if case.adamw else zk.FusedAdam)(ours, backend=backend, **case.hp)
    for step, mult in enumerate(case.mults):
        set_grads([ours], step, seed)
        for p in ours:
            p.grad.mul_(mult * (case.grad_scale or 1.0))
        oz.step(**({} if case.grad_scale is None else dict(grad_scale=torch.tensor(case.grad_scale))))
    ref, ot = run_torch(case, case.hp, seed)
    for i, (p, q) in enumerate(zip(ours, ref)):
        assert_close_rel(p.detach(), q.detach(), what=f"param {i}")
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert (k in oz.state[p]) == (k in ot.state[q]), k
            if k in ot.state[q]:
                assert_close_rel(oz.state[p][k], ot.state[q][k], what=f"{k} {i}")
    # negative control: the case's term changes torch's own result beyond the tolerance
    ctl = {k: v for k, v in case.control.items() if k != "grad_mult"}
    other, _ = run_torch(case, {**case.hp, **ctl}, seed, case.control.get("grad_mult", 1.0))
    q, o = torch.cat([x.detach().reshape(-1) for x in ref]), torch.cat([x.detach().reshape(-1) for x in other])
    with pytest.raises(AssertionError):
        assert_close_rel(o, q)


def bf16_tie_masters(n, seed):
    """fp32 values whose low 16 bits are mostly exact bf16 ties (0x8000), both bf16 parities and
    signs, plus the neighbours of a tie (0x7FFF, 0x8001) and exact / maximal low halves."""
    gen = torch.Generator().manual_seed(seed)
    hi = torch.randint(0x3E00, 0x4200, (n,), generator=gen, dtype=torch.int32)
    hi = torch.where(torch.rand(n, generator=gen) < 0.5, hi, hi | 0x8000)   # negative half
    lows = torch.tensor([0x8000, 0x8000, 0x8000, 0x7FFF, 0x8001, 0x0000, 0xFFFF], dtype=torch.int32)
    lo = lows[torch.arange(n) % len(lows)]
    return ((hi << 16) | lo).view(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_ties_round_to_nearest_even(backend):
    """The contract's p16 = round_to_nearest_even(master), bitwise, on ties (lr = 0 keeps the
    master as constructed): equal to torch's .bfloat16() and to the reference's output."""
    n = 1003
    outs = {}
    for name in ("reference", backend):
        master = bf16_tie_masters(n, seed=6)
        start = master.clone()
        p16 = torch.zeros(n, dtype=torch.bfloat16)
        g, m, v = torch.randn(n, generator=torch.Generator().manual_seed(7)), torch.zeros(n), torch.zeros(n)
        coeffs = torch.tensor([[0.0, 1.0, 1.0]])    # step_size 0, bc2_sqrt 1, decay 1
        backends.get(name)([master], [g], [m], [v], None, [p16], coeffs, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.0, adamw=True, maximize=False)
        assert torch.equal(master.view(torch.int32), start.view(torch.int32)), "lr = 0 must keep the master"
        outs[name] = p16.view(torch.int16)
    want = start.bfloat16().view(torch.int16)
    assert torch.equal(outs[backend], want), f"{int((outs[backend] != want).sum())} of {n} differ"
    assert torch.equal(outs[backend], outs["reference"])
    # negative controls: truncation and round-half-away differ from RNE on these inputs
    bits = start.view(torch.int32)
    trunc = (bits >> 16).to(torch.int16)
    half_up = ((bits + 0x8000) >> 16).to(torch.int16)
    assert not torch.equal(want, trunc) and not torch.equal(want, half_up)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("seed", [11, 23])
def test_fp32_parity_with_torch(backend, adamw, seed):
    rng = random.Random(seed + adamw)
    hp = random_hparams(rng)
    ours, ref = make_params(seed), make_params(seed)
    OptZ, OptT = (zk.FusedAdamW, torch.optim.AdamW) if adamw else (zk.FusedAdam, torch.optim.Adam)
    gz, gt = groups_of(ours, random.Random(seed), hp), groups_of(ref, random.Random(seed), hp)
    oz, ot = OptZ(gz, backend=backend, **hp), OptT(gt, **hp)
    before = [p.detach().clone() for p in ours]
    for step in range(20):
        # parameter 2 gets no gradient on odd steps: it must be skipped like torch skips it
        set_grads([ours, ref], step, seed, skip=(2,) if step % 2 else ())
        oz.step()
        ot.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for pz, pt in zip(ours, ref):
        sz, st = oz.state[pz], ot.state[pt]
        assert float(sz["step"]) == float(st["step"])
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            assert (k in sz) == (k in st)
            if k in sz:
                torch.testing.assert_close(sz[k], st[k], rtol=1e-5, atol=1e-6)
    moved = [not torch.equal(a, b) for a, b in zip(before, ours) if a.numel()]
    assert all(moved), "negative control: every non-empty parameter must have moved"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_low_precision_params_with_fp32_masters(backend, dtype, amsgrad):
    """16-bit params == fp32 torch AdamW (on an fp32 copy, fed the same 16-bit grads) rounded to
    16 bits, within one 16-bit ulp; the fp32 master equals torch's fp32 parameter."""
    seed = 5
    low = make_params(seed, dtype)
    ref = [p.detach().float().requires_grad_() for p in low]
    oz = zk.FusedAdamW(low, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, backend=backend)
    ot = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    for step in range(20):
        set_grads([low, ref], step, seed, dtype=dtype)
        oz.step()
        ot.step()
    for p, q in zip(low, ref):
        assert p.dtype == dtype
        torch.testing.assert_close(oz.state[p]["master_param"], q.detach(), rtol=1e-5, atol=1e-6)
        if p.numel() == 0:
            continue
        rounded = q.detach().to(dtype)
        ulp = torch.nextafter(rounded.float().abs(), torch.tensor(float("inf"))).to(dtype).float() - rounded.float().abs()
        diff = (p.detach().float() - rounded.float()).abs()
        # one 16-bit ulp of the value (nextafter in fp32 then rounding gives the 16-bit neighbour)
        spacing = (rounded.float().abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)).clamp_min(1e-30)
        assert torch.all(diff <= torch.maximum(ulp, spacing)), f"max diff {diff.max()}"
        # exact in the overwhelming majority of elements (a wrong rounding mode fails this)
        assert (diff == 0).float().mean() > 0.999


@pytest.mark.parametrize("backend", BACKENDS)
def test_16bit_copy_is_round_to_nearest_even_of_master(backend):
    p = make_params(3, torch.bfloat16, [(50001,)])
    opt = zk.FusedAdamW(p, lr=1e-2, backend=backend)
    set_grads([p], 0, 3, dtype=torch.bfloat16)
    opt.step()
    master = opt.state[p[0]]["master_param"]
    assert torch.equal(p[0].detach().view(torch.int16), master.bfloat16().view(torch.int16))
    # negative control: truncation (what the interpreter's plain cast does) differs somewhere
    trunc = (master.view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(p[0].detach().view(torch.int16), trunc)


@pytest.mark.parametrize("backend", BACKENDS)
def test_master_weights_off_keeps_16bit_states(backend):
    p = make_params(4, torch.bfloat16, [(37,)])
    opt = zk.FusedAdamW(p, lr=1e-2, master_weights=False, backend=backend)
    set_grads([p], 0, 4, dtype=torch.bfloat16)
    opt.step()
    st = opt.state[p[0]]
    assert "master_param" not in st and st["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_scaler_round_trip_with_injected_inf(backend, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.Tanh(), torch.nn.Linear(17, 3)).to(dtype)
    ref = copy.deepcopy(model).float()
    oz = zk.FusedAdamW(model.parameters(), lr=1e-2, backend=backend)
    ot = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    x = torch.randn(8, 9)
    for step in range(4):
        oz.zero_grad()
        scaler.scale(model(x.to(dtype)).float().square().mean()).backward()
        if step == 2:  # inject an inf: the whole step must be skipped
            next(model.parameters()).grad[0, 0] = float("inf")
            snap = ([p.detach().clone() for p in model.parameters()],
                    {id(p): {k: v.clone() for k, v in oz.state[p].items()} for p in model.parameters()})
        scaler.step(oz)
        scaler.update()
        if step == 2:
            assert scaler.get_scale() == 2.0 ** 9, "scale must halve after an inf"
            for p, before in zip(model.parameters(), snap[0]):
                assert torch.equal(p.detach(), before), "parameters changed on a skipped step"
                for k, v in oz.state[p].items():
                    assert torch.equal(v, snap[1][id(p)][k]), f"state {k} changed on a skipped step"
        else:
            # the unscaled step equals torch AdamW on the true gradient
            ot.zero_grad()
            ref(x).square().mean().backward()
            if dtype == torch.float32:
                ot.step()
    assert float(oz.state[next(model.parameters())]["step"]) == 3
    if dtype == torch.float32:
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_scale_and_found_inf_kwargs(backend):
    # Adam with L2 decay and a large eps: the step depends on the gradient's scale (plain Adam is
    # scale-invariant up to eps, so a dropped or inverted grad_scale would pass unnoticed)
    hp = dict(lr=1e-2, weight_decay=0.1, eps=1e-3)
    p, q, c = (make_params(8, shapes=[(100,)]) for _ in range(3))
    oz = zk.FusedAdam(p, backend=backend, **hp)
    ot, oc = torch.optim.Adam(q, **hp), torch.optim.Adam(c, **hp)
    set_grads([p, q, c], 0, 8)
    p[0].grad.mul_(64.0)
    c[0].grad.mul_(64.0)
    oz.step(grad_scale=torch.tensor(64.0), found_inf=torch.tensor(0.0))
    ot.step()
    oc.step()
    torch.testing.assert_close(p[0], q[0], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(c[0], q[0], rtol=1e-6, atol=1e-7), "negative control: the scale must matter"
    before = p[0].detach().clone()
    oz.step(grad_scale=torch.tensor(64.0), found_inf=torch.tensor(1.0))
    assert torch.equal(before, p[0].detach()) and float(oz.state[p[0]]["step"]) == 1
    # not one-element Tensors: refused naming the argument, before the step counters move (they used to)
    for kw in (dict(grad_scale=8.0), dict(grad_scale=torch.tensor([8.0, 8.0])), dict(found_inf=True),
               dict(found_inf=1.0), dict(found_inf=torch.zeros(2))):
        with pytest.raises(TypeError, match=rf"step\({next(iter(kw))}=...\) takes a one-element Tensor.*Nothing"):
            oz.step(**kw)
        assert torch.equal(before, p[0].detach()) and float(oz.state[p[0]]["step"]) == 1, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direction", ["torch_to_zk", "zk_to_torch"])
def test_state_dict_interchange_with_torch(backend, direction):
    torch.manual_seed(1)
    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(11, 23), torch.nn.GELU(), torch.nn.Linear(23, 4))
    x = torch.randn(6, 11)
    def train(m, o, n):
        for _ in range(n):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    make_z = lambda m: zk.FusedAdamW(m.parameters(), lr=5e-3, weight_decay=0.05, amsgrad=True, backend=backend)
    make_t = lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3, weight_decay=0.05, amsgrad=True)
    first, second = (make_t, make_z) if direction == "torch_to_zk" else (make_z, make_t)
    # uninterrupted run with the second optimizer type as ground truth for "continues identically"
    m_ref = model()
    o_ref = torch.optim.AdamW(m_ref.parameters(), lr=5e-3, weight_decay=0.05, amsgrad=True)
    train(m_ref, o_ref, 10)
    m1 = model()
    o1 = first(m1)
    train(m1, o1, 5)
    sd = copy.deepcopy(o1.state_dict())
    m2 = model()
    m2.load_state_dict(m1.state_dict())
    o2 = second(m2)
    o2.load_state_dict(sd)
    assert set(o2.state_dict()["state"][0]) >= {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    train(m2, o2, 5)
    for p, q in zip(m2.parameters(), m_ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # negative control: a fresh optimizer (state not loaded) ends elsewhere
    m3 = model()
    m3.load_state_dict(m1.state_dict())
    train(m3, second(m3), 5)
    assert not all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(m3.parameters(), m_ref.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_keys_with_master_weights(backend):
    p = make_params(2, torch.bfloat16, [(10,)])
    o = zk.FusedAdamW(p, backend=backend)
    set_grads([p], 0, 2, dtype=torch.bfloat16)
    o.step()
    st = o.state_dict()["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master_param"}
    assert st["master_param"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
    # a reload keeps fp32 state for bf16 params (torch would cast it down to bf16)
    o2 = zk.FusedAdamW(p, backend=backend)
    o2.load_state_dict(o.state_dict())
    assert o2.state[p[0]]["exp_avg"].dtype == torch.float32
    assert torch.equal(o2.state[p[0]]["master_param"], o.state[p[0]]["master_param"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_closure_zero_grad_scheduler_and_add_param_group(backend):
    torch.manual_seed(2)
    m = torch.nn.Linear(5, 3)
    r = copy.deepcopy(m)
    extra, extra_r = torch.nn.Parameter(torch.randn(4)), None
    extra_r = torch.nn.Parameter(extra.detach().clone())
    oz = zk.FusedAdamW(m.parameters(), lr=1e-2, backend=backend)
    ot = torch.optim.AdamW(r.parameters(), lr=1e-2)
    oz.add_param_group({"params": [extra], "lr": 3e-2, "weight_decay": 0.0})
    ot.add_param_group({"params": [extra_r], "lr": 3e-2, "weight_decay": 0.0})
    sz = torch.optim.lr_scheduler.StepLR(oz, step_size=2, gamma=0.5)
    st = torch.optim.lr_scheduler.StepLR(ot, step_size=2, gamma=0.5)
    x = torch.randn(7, 5)
    for _ in range(6):
        def cz():
            oz.zero_grad(set_to_none=True)
            loss = m(x).sum() + (extra ** 2).sum()
            loss.backward()
            return loss
        def ct():
            ot.zero_grad(set_to_none=False)
            loss = r(x).sum() + (extra_r ** 2).sum()
            loss.backward()
            return loss
        lz, lt = oz.step(cz), ot.step(ct)
        torch.testing.assert_close(lz, lt)
        sz.step(); st.step()
    assert oz.param_groups[0]["lr"] == ot.param_groups[0]["lr"] == 1e-2 * 0.125
    for p, q in zip(list(m.parameters()) + [extra], list(r.parameters()) + [extra_r]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    oz.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_param_groups_given_as_generators(backend):
    """``{"params": layer.parameters()}`` (a generator, read once) trains every parameter as torch does; the
    coded formats take the same groups (their bits equal to the same groups given as lists). Before the fix
    the groups were stored empty and step() did nothing."""
    def net():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(9, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5))

    def groups(m, as_list):
        get = (lambda x: list(x)) if as_list else (lambda x: x)
        return [{"params": get(m[0].parameters())}, {"params": get(m[2].parameters()), "lr": 3e-3}]

    def train(m, o):
        for s in range(3):
            torch.manual_seed(40 + s)
            o.zero_grad()
            m(torch.randn(6, 9)).pow(2).mean().backward()
            o.step()

    mz, mt = net(), net()
    start = [p.detach().clone() for p in mz.parameters()]
    oz, ot = zk.FusedAdamW(groups(mz, False), lr=1e-2, backend=backend), torch.optim.AdamW(groups(mt, False), lr=1e-2)
    assert [len(g["params"]) for g in oz.param_groups] == [2, 2]
    train(mz, oz)
    train(mt, ot)
    for p, q, p0 in zip(mz.parameters(), mt.parameters(), start):
        assert not torch.equal(p, p0)
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    coded = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.bfloat16, min_8bit_size=0, backend=backend)
    runs = []
    for as_list in (False, True):
        m = net()
        train(m, zk.FusedAdamW(groups(m, as_list), lr=1e-2, **coded))
        runs.append(list(m.parameters()))
    for p, q, p0 in zip(*runs, start):
        assert not torch.equal(p, p0) and torch.equal(p, q)


def test_optimizer_wide_arguments_refused_in_param_groups():
    """State formats, master weights and the backend hold for the whole optimizer: a group naming one (at
    construction, by add_param_group, or set on a group later) raises, naming it, before anything changes."""
    m = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"param_groups\[1\] sets 'exp_avg_dtype'.*own optimizer"):
        zk.FusedAdamW([{"params": [m.weight]}, {"params": [m.bias], "exp_avg_dtype": torch.uint8}])
    o = zk.FusedAdamW([m.weight], backend="reference")
    with pytest.raises(ValueError, match=r"param_groups\[1\] sets 'backend'"):
        o.add_param_group({"params": [m.bias], "backend": "cpu"})
    assert len(o.param_groups) == 1
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    before, state = m.weight.detach().clone(), {k: v.clone() for k, v in o.state[m.weight].items()}
    o.param_groups[0]["store_param_remainders"] = True
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets 'store_param_remainders'"):
        o.step()
    assert torch.equal(m.weight, before)
    assert all(torch.equal(v, o.state[m.weight][k]) for k, v in state.items())
    del o.param_groups[0]["store_param_remainders"]
    o.step()                                                  # the control: the same step runs without the key
    assert not torch.equal(m.weight, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_lr_and_capturable(backend):
    p, q = make_params(9, shapes=[(77,)]), make_params(9, shapes=[(77,)])
    oz = zk.FusedAdamW(p, lr=torch.tensor(1e-2), capturable=True, backend=backend)
    ot = torch.optim.AdamW(q, lr=torch.tensor(1e-2), foreach=False)  # torch: capturable is GPU-only
    for s in range(3):
        set_grads([p, q], s, 9)
        oz.step(); ot.step()
    torch.testing.assert_close(p[0], q[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_parameter_updated_in_place(backend):
    base = torch.randn(13, 7)
    p = torch.nn.Parameter(base.clone().t())  # non-contiguous view-shaped parameter
    assert not p.is_contiguous()
    q = torch.nn.Parameter(p.detach().clone())
    oz, ot = zk.FusedAdamW([p], lr=1e-2, backend=backend), torch.optim.AdamW([q], lr=1e-2)
    for s in range(3):
        g = torch.randn(7, 13)
        p.grad, q.grad = g.clone().t().contiguous().t().t().t(), g.clone()
        oz.step(); ot.step()
    assert not p.is_contiguous()
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # a non-contiguous bf16 parameter with its fp32 master: the kernel writes a contiguous 16-bit copy,
    # copied back in place (the parameter is the master's RNE rounding, as for a contiguous one)
    p = torch.nn.Parameter(base.bfloat16().t())
    q = torch.nn.Parameter(p.detach().float())
    oz, ot = zk.FusedAdamW([p], lr=1e-2, backend=backend), torch.optim.AdamW([q], lr=1e-2)
    for s in range(3):
        g = torch.randn(7, 13).bfloat16()
        p.grad, q.grad = g.t().contiguous().t(), g.float()
        oz.step(); ot.step()
    assert not p.is_contiguous()
    torch.testing.assert_close(oz.state[p]["master_param"], q.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(p.detach(), oz.state[p]["master_param"].bfloat16())


def test_launches_bounded_by_dtype_device_groups(monkeypatch):
    """100 parameters in one group, two dtypes: 2 backend calls and 2 Triton launches, not 100."""
    from zero_kernels.kernels import adam as tk
    calls = []
    real_get = backends.get
    def counting_get(name):
        fn = real_get(name)
        def wrapped(*a, **k):
            calls.append(len(a[0]))
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(backends, "get", counting_get)
    params = [torch.nn.Parameter(torch.randn(3 + i % 17)) for i in range(70)]
    params += [torch.nn.Parameter(torch.randn(5 + i % 13).bfloat16()) for i in range(30)]
    opt = zk.FusedAdamW(params, lr=1e-3, backend="triton")
    for p in params:
        p.grad = torch.randn_like(p)
    before = tk.launch_count
    opt.step()
    assert tk.launch_count - before == 2
    assert sorted(calls) == [30, 70]


BAD_HPARAMS = [
    (dict(lr=-1.0), "Invalid learning rate"), (dict(lr=float("nan")), "Invalid learning rate"),
    (dict(eps=-1e-8), "Invalid epsilon value"), (dict(eps=float("nan")), "Invalid epsilon value"),
    (dict(weight_decay=-0.1), "Invalid weight_decay value"),
    (dict(weight_decay=float("nan")), "Invalid weight_decay value"),
    (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    (dict(differentiable=True), "differentiable"), (dict(fused=False), "always fused"),
    (dict(foreach=True, fused=True), "cannot be `True` together.*drop foreach=True"),
    (dict(backend="tpu"), "backend"),
    (dict(eps=torch.tensor(1e-8)), "eps must be a number, got a Tensor .*pass eps=float"),
    (dict(weight_decay=torch.tensor(0.1)), "weight_decay must be a number, got a Tensor"),
]


@pytest.mark.parametrize("kwargs,msg", BAD_HPARAMS)
def test_bad_hyperparameters_raise(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        zk.FusedAdamW([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match=r"complex.*keep a real Parameter of shape \(\.\.\., 2\) and use "
                                         r"torch.view_as_complex"):
        zk.FusedAdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))])
    with pytest.raises(ValueError, match=r"\['params'\]\[2\] is an uninitialized parameter of a lazy module.*dry run"):
        zk.FusedAdamW(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LazyLinear(4)).parameters())
    with pytest.raises((ValueError, RuntimeError), match="floating"):
        zk.FusedAdamW([torch.zeros(3, dtype=torch.int64)])
    with pytest.raises(ValueError,
                       match=r"param_groups\[0\]\['params'\]\[1\] has dtype torch.float64; FusedAdamW"):
        zk.FusedAdamW([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[1\] is param_groups\[0\]\['params'\]\[0\] "
                                         r"too: a parameter belongs to one group"):   # torch's message names none
        zk.FusedAdamW([{"params": [p]}, {"params": [torch.nn.Parameter(torch.randn(3)), p]}])
    with pytest.raises(ValueError, match="mixes devices"):
        zk.FusedAdamW([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3, device="meta"))])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [{}, dict(exp_avg_dtype=torch.uint8)], ids=["fp32 states", "8-bit"])
def test_model_cast_to_float64_after_construction_raises(backend, fmt):
    """float64 parameters would be stepped in fp32 (every backend and the reference compute in fp32), each update
    rounded without a word (torch.optim.AdamW computes in float64): refused at construction (above) and, after
    ``model.double()``, at step(), naming the parameter, before any state or parameter changes."""
    m = torch.nn.Linear(7, 300)
    opt = zk.FusedAdamW(m.parameters(), backend=backend, min_8bit_size=1, **fmt)
    m(torch.randn(2, 7)).sum().backward()
    opt.step()
    opt.zero_grad()
    m.double()
    m(torch.randn(2, 7, dtype=torch.float64)).sum().backward()
    before = [p.detach().clone() for p in m.parameters()]
    states = copy.deepcopy(opt.state_dict()["state"])
    with pytest.raises(ValueError,
                       match=r"param_groups\[0\]\['params'\]\[0\] has dtype torch.float64.*torch.optim.AdamW"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), before))
    after = opt.state_dict()["state"]
    assert all(torch.equal(after[i][k], states[i][k]) for i in states for k in states[i])


def test_parameter_listed_twice_in_a_group_raises():
    """A tied weight taken from two modules' parameters() is one tensor listed twice: torch.optim warns and
    updates it twice per step; the fused launch updated it twice with one step counter (matching neither run,
    silently). Refused, naming both places, in the constructor and in add_param_group, before any change."""
    enc, dec = torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11, bias=False)
    dec.weight = enc.weight   # tied
    listed = list(enc.parameters()) + list(dec.parameters())
    with pytest.raises(ValueError, match=r"\['params'\]\[1\] is param_groups\[0\]\['params'\]\[0\] again"):
        zk.FusedAdamW(listed)
    other = torch.nn.Parameter(torch.randn(3))
    opt = zk.FusedAdamW([other])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[2\] is .*\[0\] again"):
        opt.add_param_group({"params": [enc.weight, torch.nn.Parameter(torch.randn(2)), enc.weight]})
    assert len(opt.param_groups) == 1
    opt = zk.FusedAdamW(list(dict.fromkeys(listed)))      # the fix the message names: one update per step
    ref = torch.optim.AdamW([torch.nn.Parameter(enc.weight.detach().clone())])
    for s in range(3):
        enc.weight.grad = torch.randn(11, 4, generator=torch.Generator().manual_seed(s))
        ref.param_groups[0]["params"][0].grad = enc.weight.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(enc.weight.detach(), ref.param_groups[0]["params"][0].detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameters_sharing_memory(backend):
    """Two Parameters over overlapping memory (b = Parameter(a.data.t())): torch.optim.AdamW updates one after
    the other; the fused step updated b from a contiguous copy taken before a's update and copied it back
    over it (a's update lost, silently). Refused naming both, in the constructor, add_param_group and
    ZeroAdamW; parameters over disjoint parts of one storage (slices, interleaved columns) step as torch's."""
    a = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4) / 10)
    b = torch.nn.Parameter(a.data.t())
    first_two = r"param_groups\[0\]\['params'\]\[0\] and param_groups\[0\]\['params'\]\[1\] share"
    with pytest.raises(ValueError, match=first_two):
        zk.FusedAdamW([a, b], backend=backend)
    opt = zk.FusedAdamW([a], backend=backend)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] and param_groups\[1\]\['params'\]\[0\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(a.data[1:, 2])]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))]})      # another storage: taken
    clone = copy.deepcopy(opt)                  # its storages are new: the index of them is made again
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] and param_groups\[2\]"):
        clone.add_param_group({"params": [torch.nn.Parameter(clone.param_groups[0]["params"][0].data[1:, 2])]})
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] has internally overlapping memory"):
        zk.FusedAdamW([torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(1).expand(4))],
                      backend=backend)                         # stride 0: was torch's error after a half step
    m = torch.nn.Linear(4, 4)
    m.weight = torch.nn.Parameter(a.data.t())
    with pytest.raises(ValueError, match="'x.weight' and 'y.0' share memory"):
        zk.ZeroAdamW(torch.nn.ModuleDict(dict(x=m, y=torch.nn.ParameterList([a]))), stage=1)
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    views = [base[:2], base[2:, ::2], base[2:, 1::2]]                # disjoint, two of them interleaved
    b2 = base.clone()
    ours = [torch.nn.Parameter(b2[:2]), torch.nn.Parameter(b2[2:, ::2]), torch.nn.Parameter(b2[2:, 1::2])]
    ref = [torch.nn.Parameter(v.clone()) for v in views]
    opt, ropt = zk.FusedAdamW(ours, lr=0.1, backend=backend), torch.optim.AdamW(ref, lr=0.1)
    for s in range(3):
        g = torch.Generator().manual_seed(10 + s)
        for p, r in zip(ours, ref):
            r.grad = torch.randn(r.shape, generator=g)
            p.grad = r.grad.clone()
        opt.step()
        ropt.step()
    for p, r in zip(ours, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=1e-6)
    assert not torch.equal(b2[:2], base[:2])


def test_unavailable_backend_by_name_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        zk.FusedAdamW([torch.nn.Parameter(torch.randn(3))], backend="triton")
    with pytest.raises(ValueError, match="cuda"):
        zk.FusedAdamW([torch.nn.Parameter(torch.randn(3))], backend="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_gradients_raise_before_any_state_changes(backend):
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(5))
    opt = zk.FusedAdamW([a, b], backend=backend)
    a.grad = torch.randn(4)
    b.grad = torch.randn(5).to_sparse()
    snapshot = a.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    b.grad = torch.randn(5)
    b.grad.data = torch.randn(6)  # autograd refuses this assignment; .data gets past its check
    with pytest.raises(RuntimeError, match="shape"):
        opt.step()
    b.grad = torch.randn(5)
    b.grad.data = torch.randn(5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="dtype"):
        opt.step()
    assert torch.equal(a.detach(), snapshot) and len(opt.state) == 0, "state changed before the error"


FMTS = [{}, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS, ids=["fp32 states", "8-bit"])
def test_replaced_or_reordered_group_params_step_the_new_ones(backend, fmt):
    """A group's ``params`` replaced (a library re-pointing the optimizer at moved parameters) or reordered after
    a step, same shapes: the step updates the listed tensors with their own gradients, as torch.optim.AdamW's
    (the launch plan was keyed on shapes only: [Note: launch plans])."""
    def run(make):
        torch.manual_seed(3)
        old, new = torch.nn.Parameter(torch.zeros(300)), torch.nn.Parameter(torch.zeros(300))
        a, b = torch.nn.Parameter(torch.zeros(300)), torch.nn.Parameter(torch.zeros(300))
        o1, o2 = make([old]), make([a, b])
        old.grad = torch.ones(300)
        a.grad, b.grad = torch.ones(300), -torch.ones(300)
        o1.step()
        o2.step()
        o1.param_groups[0]["params"] = [new]
        new.grad = torch.full((300,), 0.5)        # old.grad left in place: it must not be used
        o2.param_groups[0]["params"].reverse()
        b.grad = 2 * b.grad
        o1.step()
        o2.step()
        return [t.detach().clone() for t in (old, new, a, b)]
    want = run(lambda ps: torch.optim.AdamW(ps, lr=0.1))
    got = run(lambda ps: zk.FusedAdamW(ps, lr=0.1, backend=backend, **fmt))
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0.05 if fmt else 1e-6)
    assert torch.equal(got[0], want[0]) and got[1][0] < -0.05        # old stepped once only, new stepped


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS, ids=["fp32 states", "8-bit"])
def test_one_cycle_momentum_on_tensor_betas_steps_like_torch(backend, fmt):
    """OneCycleLR (cycle_momentum=True, its default) writes a float beta1 beside a Tensor beta2; torch.optim.AdamW
    steps on, and so does FusedAdamW (every step was refused: "betas must be either both floats or both
    Tensors"); fp32 states follow torch, 8-bit states the reference backend, over 6 scheduled steps."""
    def run(cls, **kw):
        torch.manual_seed(3)
        ps = [torch.nn.Parameter(torch.randn(n)) for n in (300, 1031)]
        o = cls(ps, lr=1e-3, betas=(torch.tensor(0.9), torch.tensor(0.999)), **kw)
        sched = torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10)
        for s in range(6):
            g = torch.Generator().manual_seed(s)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            o.step()
            sched.step()
        assert isinstance(o.param_groups[0]["betas"][0], float) and isinstance(o.param_groups[0]["betas"][1],
                                                                             torch.Tensor)
        return ps
    got = run(zk.FusedAdamW, backend=backend, **fmt)
    want = run(torch.optim.AdamW) if not fmt else run(zk.FusedAdamW, backend="reference", **fmt)
    tol = dict(rtol=0, atol=0) if fmt else dict(rtol=1e-6, atol=1e-7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS, ids=["fp32 states", "8-bit"])
@pytest.mark.parametrize("how", ["edit", "load"])
def test_hyperparameters_made_invalid_later_raise_before_any_change(backend, fmt, how):
    """betas / eps / weight_decay / lr set out of range after construction (a param_groups edit, a loaded state
    dict) are refused at the step, naming the group, before any group is stepped (the kernel used to refuse them
    after earlier groups had moved; the reference never did)."""
    a, b = torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(300))
    opt = zk.FusedAdamW([{"params": [a]}, {"params": [b]}], lr=0.1, backend=backend, **fmt)
    a.grad, b.grad = torch.randn(300), torch.randn(300)
    opt.step()
    for key, bad, msg in [("betas", (0.9, 1.0), "Invalid beta parameter at index 1"),
                          ("eps", -1.0, "Invalid epsilon value"), ("weight_decay", float("nan"), "weight_decay"),
                          ("lr", -1.0, "Invalid learning rate")]:
        if how == "edit":
            opt.param_groups[1][key] = bad
        else:
            sd = opt.state_dict()
            sd["param_groups"][1][key] = bad
            opt.load_state_dict(sd)
        before = [a.detach().clone(), b.detach().clone(), [float(st["step"]) for st in opt.state.values()]]
        with pytest.raises(ValueError, match=msg + r".*in param_groups\[1\] \(nothing was changed\)"):
            opt.step()
        after = [a.detach().clone(), b.detach().clone(), [float(st["step"]) for st in opt.state.values()]]
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]) and before[2] == after[2]
        opt.param_groups[1][key] = opt.param_groups[0][key]
    opt.step()                                           # valid again: steps


def test_adamw_loading_an_adam_state_dict_stays_adamw():
    """torch.optim.AdamW keeps decoupled weight decay whatever a loaded (Adam) state dict says; so does
    FusedAdamW (it used to turn into Adam with L2 decay, silently)."""
    torch.manual_seed(0)
    p0 = torch.randn(64)
    out = []
    for cls, src in ((torch.optim.AdamW, torch.optim.Adam), (zk.FusedAdamW, zk.FusedAdam)):
        p = torch.nn.Parameter(p0.clone())
        donor = src([torch.nn.Parameter(p0.clone())], lr=0.1, weight_decay=0.5)
        opt = cls([p], lr=0.1, weight_decay=0.5)
        opt.load_state_dict(donor.state_dict())
        assert opt.param_groups[0]["decoupled_weight_decay"] is True, cls
        for _ in range(3):
            p.grad = torch.ones(64)
            opt.step()
        out.append(p.detach().clone())
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-6)


def test_construction_errors_name_the_group():
    a, b = torch.nn.Parameter(torch.randn(3).bfloat16()), torch.nn.Parameter(torch.randn(3).half())
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] has dtype torch.float16"):
        zk.FusedAdamW([{"params": [a]}, {"params": [b]}], store_param_remainders=True)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] has dtype torch.float64"):
        zk.FusedAdamW([{"params": [torch.nn.Parameter(torch.randn(3))]},
                       {"params": [torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]}])
    with pytest.raises(ValueError, match=r"Invalid epsilon value: -1.0 \(param_groups\[1\]\)"):
        zk.FusedAdamW([{"params": [torch.nn.Parameter(torch.randn(3))]},
                       {"params": [torch.nn.Parameter(torch.randn(3))], "eps": -1.0}])
