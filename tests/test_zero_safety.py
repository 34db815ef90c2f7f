"""Mixed-precision safety and failure handling of ZeroAdamW (gloo processes on this machine).

* fp16 + loss_scale="dynamic" with an inf injected into ONE element of ONE rank's gradient: every
  rank skips (nothing changes), the scale halves on every rank, grows again after growth_interval
  good steps, no hang; the same through torch.amp.GradScaler (scales stay equal across ranks).
* a power-of-two static loss scale gives bitwise the unscaled result (unscaling in the kernel).
* bf16 without a scaler and a NaN on one rank: masters untouched, skipped_steps + a warning.
* timeout=...: a rank that never reaches a collective, a rank that exits early, a rank that never
  constructs the optimizer -> the other fails within the timeout with a clear error.
"""
from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402
from test_zero import batch, loss_fn, make_model  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels.zero import ShardedGradError  # noqa: E402
from zero_kernels.zero.collectives import CollectiveTimeoutError  # noqa: E402


def _state(opt):
    return [t.clone() for b in opt.buckets for t in b.state_tensors().values()]


def _rows():
    r = dist.get_rank()
    return slice(2 * r, 2 * r + 2)


def _backward(model, s, scale_fn=lambda x: x, poison=None):
    idx, tgt = batch(s, dist.get_world_size())
    rows = _rows()
    h = None
    if poison is not None:      # one element of one parameter's gradient on this rank only
        h = model.gate.register_hook(lambda g: g.clone().fill_(poison))
    scale_fn(loss_fn(model, idx[rows], tgt[rows])).backward()
    if h is not None:
        h.remove()


def _case_dynamic(rank, stage):
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=stage, param_dtype=torch.float16, loss_scale="dynamic", growth_interval=3,
                       bucket_size=64, backend="reference")
    opt.loss_scaler.scale = s0 = 2.0 ** 8     # the default 2**16 overflows this fp16 model at once
    _backward(model, 0, opt.scale_loss)
    opt.step()
    opt.zero_grad()
    assert opt.loss_scaler.scale == s0 and opt.steps[0] == 1
    before = _state(opt)
    params = [p.detach().clone() for p in model.parameters()]
    steps = list(opt.steps)
    _backward(model, 1, opt.scale_loss, poison=float("inf") if rank == 1 else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # dynamic scaling: skips are routine, no warning
        opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(opt))), "state changed on a skipped step"
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert opt.steps == steps and opt.skipped_steps == 1
    assert opt.loss_scaler.scale == s0 / 2
    # the loss scale is part of the state: a shard state dict and a checkpoint taken here resume exactly
    sd = opt.state_dict()
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root)
    opt.save_checkpoint(root[0])
    for s in range(2, 5):
        _backward(model, s, opt.scale_loss)
        opt.step()
        opt.zero_grad()
    assert opt.loss_scaler.scale == s0        # grown back after growth_interval=3 good steps
    assert opt.steps[0] == 4
    full = opt.full_model_state_dict()
    for resume in ("state_dict", "checkpoint"):
        m2 = make_model()
        o2 = zk.ZeroAdamW(m2, stage=stage, param_dtype=torch.float16, loss_scale="dynamic", growth_interval=3,
                          bucket_size=64, backend="reference")
        assert o2.loss_scaler.scale == 2.0 ** 16
        if resume == "state_dict":
            o2.load_state_dict(torch.load(_roundtrip(sd, rank), weights_only=True))
        else:
            o2.load_checkpoint(root[0])
        assert o2.loss_scaler.scale == s0 / 2 and o2.skipped_steps == 1, resume
        for s in range(2, 5):
            _backward(m2, s, o2.scale_loss)
            o2.step()
            o2.zero_grad()
        assert o2.loss_scaler.scale == s0 and o2.steps == opt.steps, resume
        got = o2.full_model_state_dict()
        assert all(torch.equal(got[k], full[k]) for k in full), resume
        o2.remove_hooks()
    bad = {**sd, "scaling": {"loss_scaler": {"scale": float("inf")}, "skipped_steps": 1}}
    with pytest.raises(ValueError, match="finite positive 'scale'.*Nothing was loaded"):
        opt.load_state_dict(bad)
    assert opt.loss_scaler.scale == s0
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root[0])
    scales = [None] * dist.get_world_size()
    dist.all_gather_object(scales, (opt.loss_scaler.scale, opt.skipped_steps))
    assert len(set(scales)) == 1


def _roundtrip(obj, rank) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _case_gradscaler(rank):
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    opt = zk.ZeroAdamW(model, stage=2, param_dtype=torch.float16, bucket_size=64, backend="reference",
                       loss_scale=scaler)
    for s in range(4):
        before = _state(opt)
        poison = float("nan") if (s == 1 and rank == 0) else None
        _backward(model, s, scaler.scale, poison=poison)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales = [None] * dist.get_world_size()
        dist.all_gather_object(scales, float(scaler.get_scale()))
        assert len(set(scales)) == 1, scales
        if s == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, _state(opt)))
            assert scales[0] == 2.0 ** 9
    assert opt.skipped_steps == 1 and opt.steps[0] == 3
    assert float(scaler.get_scale()) == 2.0 ** 10          # grew after 2 good steps


def _case_static_exact(rank):
    """Scaling by 1024 and unscaling in the kernel is exact: bitwise the unscaled run."""
    out = []
    for ls in (None, 1024.0):
        model = make_model()
        opt = zk.ZeroAdamW(model, stage=2, loss_scale=ls, bucket_size=64, backend="reference")
        for s in range(3):
            _backward(model, s, opt.scale_loss)
            opt.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()
        out.append(opt.full_model_state_dict())
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k]), k


def _case_bf16_nan(rank, stage):
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=stage, param_dtype=torch.bfloat16, bucket_size=64, backend="reference")
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    before = _state(opt)
    params = [p.detach().clone() for p in model.parameters()]
    _backward(model, 1, poison=float("nan") if rank == 1 else None)
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(opt)))
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert opt.skipped_steps == 1 and opt.steps[0] == 1
    _backward(model, 2)
    opt.step()                                  # training goes on
    assert opt.steps[0] == 2 and all(torch.isfinite(t).all() for t in _state(opt))


def _case_unscaled_backward(rank):
    """loss_scale set, loss.backward() without zopt.scale_loss: the step would divide unscaled gradients by the
    scale (every update 1024x too small, silently). It raises before anything changes; scaled, it steps."""
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=2, loss_scale=1024.0, bucket_size=64, backend="reference")
    before, params = _state(opt), [p.detach().clone() for p in model.parameters()]
    _backward(model, 0)
    with pytest.raises(RuntimeError, match=r"zopt\.scale_loss\(loss\) was not called since the last step"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(opt))) and opt.steps[0] == 0
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    opt.zero_grad()
    _backward(model, 0, opt.scale_loss)
    opt.step()
    assert opt.steps[0] == 1
    _backward(model, 1)                          # the flag does not outlive its step
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()


def _precision_world(rank, world):
    fails = []
    for name, fn in [("dynamic s1", lambda: _case_dynamic(rank, 1)), ("dynamic s2", lambda: _case_dynamic(rank, 2)),
                     ("dynamic s3", lambda: _case_dynamic(rank, 3)),
                     ("gradscaler", lambda: _case_gradscaler(rank)), ("static exact", lambda: _case_static_exact(rank)),
                     ("unscaled backward", lambda: _case_unscaled_backward(rank)),
                     ("bf16 nan s1", lambda: _case_bf16_nan(rank, 1)), ("bf16 nan s2", lambda: _case_bf16_nan(rank, 2)),
                     ("bf16 nan s3", lambda: _case_bf16_nan(rank, 3))]:
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback
            fails.append(f"[{name}] {type(e).__name__}: {e}\n{traceback.format_exc()[-1200:]}")
    if fails:
        raise AssertionError("\n".join(fails))


def test_mixed_precision_safety_world2():
    run_world(_precision_world, 2, timeout=200)


# ---- failures ------------------------------------------------------------------------------------
T_OUT = 5.0


def _failure_world(rank, world, check_time):
    g_ctor, g_hang, g_exit = dist.new_group([0, 1]), dist.new_group([0, 1]), dist.new_group([0, 1])
    # 1. rank 1 never constructs the optimizer: rank 0's construction fails within the timeout.
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"2 ranks\).*arrived|construction"):
            zk.ZeroAdamW(make_model(), stage=2, process_group=g_ctor, timeout=T_OUT, backend="reference")
        assert not check_time or time.monotonic() - t0 < T_OUT + 3
    else:
        time.sleep(T_OUT + 2)
    dist.barrier()
    # 2. rank 1 is alive but never reaches step(): rank 0's step fails after ~timeout.
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=2, process_group=g_hang, timeout=T_OUT, bucket_size=64, backend="reference")
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    if rank == 0:
        t0 = time.monotonic()
        # Stage 2 bounds the reductions in flight during backward, so the wait (and the error) may
        # come in backward already, else in step().
        with pytest.raises(RuntimeError, match=r"group of 2 ranks did not complete on rank 0.*"
                                               r"(never reached|died)"):
            _backward(model, 1)
            opt.step()
        assert not check_time or T_OUT - 0.5 < time.monotonic() - t0 < T_OUT + 3
    else:
        time.sleep(T_OUT + 2)
    dist.barrier()
    # 3. rank 1 exits early: rank 0 fails fast (connection closed) or within the timeout.
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=1, process_group=g_exit, timeout=T_OUT, bucket_size=64, backend="reference")
    if rank == 1:
        os._exit(0)                  # dies without any cleanup
    time.sleep(0.5)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="Likely cause: another rank"):
        _backward(model, 0)
        opt.step()
    assert not check_time or time.monotonic() - t0 < T_OUT + 3


def test_rank_failure_errors_world2():
    """The errors (CollectiveTimeoutError naming the collective and cause); run_world bounds it."""
    run_world(_failure_world, 2, False, timeout=120, collective_timeout=60)


@pytest.mark.perf
def test_rank_failure_timeouts_world2():
    """The same, with the wall-clock bounds: each failure surfaces within the timeout."""
    t0 = time.monotonic()
    run_world(_failure_world, 2, True, timeout=120, collective_timeout=60)
    assert time.monotonic() - t0 < 60


# ---- construction is all-or-nothing (issue 13.4) and hyper-parameters follow torch (13.5, 15.3) --------
def _snapshot(model):
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._state_dict_pre_hooks)) for m in model.modules()]
    phooks = [len(p._post_accumulate_grad_hooks or {}) if hasattr(p, "_post_accumulate_grad_hooks") else 0
              for p in model.parameters()]
    return ({k: (v.data_ptr(), v.dtype, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()}, hooks, phooks)


def _same(a, b) -> bool:
    (sa, ha, pa), (sb, hb, pb) = a, b
    return ha == hb and pa == pb and sa.keys() == sb.keys() and all(
        sa[k][0] == sb[k][0] and sa[k][1] == sb[k][1] and torch.equal(sa[k][2], sb[k][2]) for k in sa)


NAN, INF = float("nan"), float("inf")
BAD_CTOR = [   # (stage, kwargs, exception, message) -- each raises before the model is touched
    (2, dict(stage=0), ValueError, "stage"), (2, dict(stage=4), ValueError, "stage"),
    (2, dict(lr=-1.0), ValueError, "Invalid learning rate"), (2, dict(lr=NAN), ValueError, "Invalid learning rate"),
    (2, dict(lr=INF), ValueError, "Invalid learning rate"), (1, dict(weight_decay=NAN), ValueError, "weight_decay"),
    (3, dict(eps=INF), ValueError, "epsilon"), (2, dict(betas=(0.9, 1.5)), ValueError, "beta parameter at index 1"),
    (2, dict(betas=(torch.tensor(0.9), 0.999)), ValueError, "both floats or both Tensors"),
    (2, dict(lr=torch.tensor([1e-3, 2e-3])), ValueError, "Tensor lr must be 1-element"),
    (2, dict(bucket_size=0), ValueError, "bucket_size"), (1, dict(loss_scale=0.0), ValueError, "loss scale"),
    (2, dict(loss_scale="static"), ValueError, "loss_scale"), (3, dict(loss_scale=-2.0), ValueError, "loss scale"),
    (2, dict(growth_interval=0), ValueError, "growth_interval"), (2, dict(param_dtype=torch.int8), ValueError, "param_dtype"),
    (2, dict(reduce_dtype=torch.int32), ValueError, "reduce_dtype"), (2, dict(alignment_bytes=24), ValueError, "alignment"),
    (2, dict(backend="nope"), ValueError, "backend"), (2, dict(timeout=-1), ValueError, "timeout"),
    (3, dict(prefetch=-1), ValueError, "prefetch"), (3, dict(wrap=42), TypeError, "wrap"),
    (3, dict(wrap=lambda m: isinstance(m, nn.ModuleList)), ValueError, "no forward"),
    (3, dict(overlap_param_gather=True), ValueError, "overlap_param_gather"),
    (2, dict(gather_cache="yes"), TypeError, "gather_cache"), (2, dict(overlap_comm="no"), TypeError, "overlap_comm"),
    (2, dict(reshard_after_forward=1), TypeError, "reshard_after_forward"),
    (2, dict(param_groups=[{"params": ["gate"], "lr": NAN}, {"params": ["emb.weight"]}]), ValueError,
     r"Invalid learning rate: nan in param_groups\[0\]"),
    (2, dict(param_groups=[{"params": ["gate"], "lr": 0.1}]), ValueError, "in no param group"),
    (2, dict(param_groups=[{"params": ["gate"], "stage": 3}]), ValueError,
     r"param_groups\[0\] sets 'stage', which holds for the whole optimizer"),
    (2, dict(param_groups=[{"params": ["gate"], "note": object()}]), ValueError,
     r"param_groups\[0\]\['note'\] is a object: .*plain data"),
    (2, dict(bogus=1), TypeError, r"unexpected keyword argument\(s\) 'bogus'; its options are"),
    (2, dict(exp_avg_dtype=torch.uint8, min_8bit_size=0), TypeError, "ZeroAdamW has no min_8bit_size"),
    (2, dict(prefetch=2), ValueError, r"prefetch= configure stage 3's parameter gathers; stage 2"),
    (1, dict(gather_cache=False, wrap=[nn.Linear]), ValueError, "wrap=, gather_cache= configure stage 3"),
]


def test_param_group_keys_besides_the_hyperparameters_are_kept():
    """As torch.optim: a group's own keys (a ``"name"``, timm's ``"lr_scale"`` that its scheduler reads) stay in
    param_groups and the state dict (they were refused as unknown keys)."""
    model = make_model()
    ps = dict(model.named_parameters())
    groups = [{"params": [ps["gate"]], "name": "gate", "lr_scale": 0.5},
              {"params": [p for n, p in ps.items() if n != "gate"], "name": "rest", "tags": ["a", 1]}]
    zopt = zk.ZeroAdamW(model, stage=2, backend="reference", param_groups=groups)
    try:
        assert [g["name"] for g in zopt.param_groups] == ["gate", "rest"] and zopt.param_groups[0]["lr_scale"] == 0.5
        sd = zopt.state_dict()
        assert [g.get("name") for g in sd["param_groups"]] == ["gate", "rest"], sd["param_groups"]
    finally:
        zopt.remove_hooks()


@pytest.mark.parametrize("stage,kw,exc,msg", BAD_CTOR, ids=[str(i) for i in range(len(BAD_CTOR))])
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_failed_construction_leaves_model_untouched(stage, kw, exc, msg, param_dtype):
    model = make_model()
    kw = dict(kw)
    if "param_groups" in kw:                      # names -> the model's parameters
        params = dict(model.named_parameters())
        kw["param_groups"] = [{**g, "params": [params[n] for n in g["params"]]} for g in kw["param_groups"]]
    if param_dtype is not None and "param_dtype" not in kw:
        kw["param_dtype"] = param_dtype           # a late failure would have cast the model already
    kw.setdefault("stage", stage)
    kw.setdefault("backend", "reference")
    before = _snapshot(model)
    with pytest.raises(exc, match=msg):
        zk.ZeroAdamW(model, **kw)
    assert _same(before, _snapshot(model)), kw


class _Odd(nn.Module):
    """A Linear plus a parameter ZeRO cannot take: ``kind`` "expanded" (stride 0), "sparse" (an
    nn.Embedding(sparse=True)), "functional" (F.embedding(..., sparse=True) on a dense module)."""

    def __init__(self, kind):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.kind = kind
        if kind == "expanded":
            self.gain = nn.Parameter(torch.randn(1).expand(4))
        else:
            self.emb = nn.Embedding(9, 4, sparse=kind == "sparse")

    def forward(self, i):
        if self.kind == "expanded":
            return self.lin(self.gain * torch.ones(2, 4))
        return self.lin(nn.functional.embedding(i, self.emb.weight, sparse=True) if self.kind == "functional"
                        else self.emb(i))


@pytest.mark.parametrize("stage", [1, 3])
def test_lazy_module_before_its_dry_run_is_named(stage):
    """A LazyLinear not yet run: named with the fix (was torch's "Can't access the shape of an uninitialized
    parameter", from the ranks' agreement); after one forward ZeroAdamW takes it."""
    model = nn.Sequential(nn.Linear(4, 3), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"parameter '1.weight' is an uninitialized parameter of a lazy module.*dry "
                                         r"run"):
        zk.ZeroAdamW(model, stage=stage, backend="reference")
    model(torch.randn(2, 4))
    zk.ZeroAdamW(model, stage=stage, backend="reference").remove_hooks()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_what_zero_cannot_take_is_named(stage):
    """Parameters and gradients ZeRO cannot step are refused naming the parameter, before anything changes:
    a stride-0 parameter (its broadcast overwrote rank 1's model, then failed with torch's overlap error), a
    sparse embedding (torch's copy_ errors inside step() or backward), and at stages 2-3 a gradient set by hand
    (p.grad = g without backward: the step ignored it, silently)."""
    for kind, msg in (("expanded", "'gain' has internally overlapping memory"),
                      ("sparse", "'emb.weight' has a sparse gradient")):
        model = _Odd(kind)
        before = _snapshot(model)
        with pytest.raises(ValueError, match=msg):
            zk.ZeroAdamW(model, stage=stage, backend="reference")
        assert _same(before, _snapshot(model))
    if stage < 3:                             # stage 3: a parent's F.embedding reads a freed placeholder
        model = _Odd("functional")
        zopt = zk.ZeroAdamW(model, stage=stage, backend="reference")
        with pytest.raises(RuntimeError, match="'emb.weight' has a sparse gradient"):
            model(torch.tensor([1, 2])).sum().backward()
            zopt.step()
        assert zopt.steps == [0] * len(zopt.steps)
        zopt.zero_grad()
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    zopt = zk.ZeroAdamW(model, stage=stage, backend="reference", lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    zopt.step()
    zopt.zero_grad()
    if stage == 3:
        with zopt.gathered():
            w = model[0].weight.detach().clone()
    else:
        w = model[0].weight.detach().clone()
        model[0].weight.grad = torch.ones_like(model[0].weight)           # stage 1: reduced at step()
    if stage > 1:
        for p in model.parameters():
            p.grad = torch.ones_like(p) if stage == 2 else None
        if stage == 3:
            model[1].bias.grad = torch.zeros_like(model[1].bias)      # the placeholder's shape (0 elements)
            model[1].bias.grad.data = torch.ones(2)
        with pytest.raises(ShardedGradError, match="did not come from backward"):
            zopt.step()
        assert zopt.steps == [1] * len(zopt.steps)
        zopt.zero_grad()
    else:
        zopt.step()
        assert not torch.equal(model[0].weight.detach(), w)


def test_successful_construction_changes_model():
    """Negative control for the test above: a construction that succeeds re-binds and hooks."""
    for stage in (2, 3):
        model = make_model()
        before = _snapshot(model)
        zk.ZeroAdamW(model, stage=stage, param_dtype=torch.bfloat16, backend="reference")
        assert not _same(before, _snapshot(model))


def test_hparams_shared_with_fused_adam():
    """One validator (zero_kernels/hparams.py): FusedAdamW and ZeroAdamW reject the same values
    with torch's messages; torch.optim.AdamW agrees on what it checks."""
    for kw, msg in [(dict(lr=NAN), "Invalid learning rate"), (dict(lr=INF), "Invalid learning rate"),
                    (dict(weight_decay=NAN), "Invalid weight_decay"), (dict(eps=NAN), "Invalid epsilon"),
                    (dict(betas=(0.9, NAN)), "Invalid beta parameter at index 1"),
                    (dict(lr=torch.ones(2)), "Tensor lr must be 1-element")]:
        with pytest.raises(ValueError, match=msg):
            zk.FusedAdamW([nn.Parameter(torch.ones(3))], **kw)
        with pytest.raises(ValueError, match=msg):
            zk.ZeroAdamW(make_model(), backend="reference", **kw)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        torch.optim.AdamW([nn.Parameter(torch.ones(3))], lr=NAN)


def _single_step_params(lr, betas=(0.9, 0.999), stage=2):
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=stage, lr=lr, betas=betas, backend="reference")
    for s in range(2):
        idx, tgt = batch(s, 1)
        loss_fn(model, idx[:2], tgt[:2]).backward()
        opt.step()
        opt.zero_grad()
    return opt.full_model_state_dict(), opt


@pytest.mark.parametrize("stage", [1, 3])
def test_tensor_lr_any_shape(stage):
    """A one-element Tensor lr of shape [1, 1] (and Tensor betas) trains exactly like the floats."""
    ref, _ = _single_step_params(1e-2, stage=stage)
    for lr, betas in [(torch.tensor([[1e-2]]), (0.9, 0.999)),
                      (torch.tensor(1e-2), (torch.tensor([0.9]), torch.tensor(0.999)))]:
        got, opt = _single_step_params(lr, betas, stage=stage)
        assert opt.steps[0] == 2
        for k in ref:       # a Tensor lr is fp32 (as in torch): equal up to lr's rounding
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-8)
    other, _ = _single_step_params(1.01e-2, stage=stage)       # negative control: 1% apart fails
    assert any(not torch.allclose(other[k], ref[k], rtol=1e-6, atol=1e-8) for k in ref)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("fmt", [{}, dict(exp_avg_dtype=torch.uint8)], ids=["fp32", "8-bit"])
def test_amsgrad_set_on_a_group_later_raises(stage, fmt):
    """max_exp_avg_sq is allocated at construction (coded states have none): amsgrad set on a param group later
    ran plain Adam without a word. step() refuses it, naming the group, before anything changes; unset, it runs."""
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=stage, lr=1e-2, backend="reference", **fmt)
    for s in range(2):
        if s == 1:
            opt.param_groups[0]["amsgrad"] = True
            before, steps = opt.full_model_state_dict(), list(opt.steps)
        idx, tgt = batch(s, 1)
        loss_fn(model, idx[:2], tgt[:2]).backward()
        if s == 1:
            with pytest.raises(ValueError, match=r"param_groups\[0\]\['amsgrad'\] is True, but ZeroAdamW was built "
                               "without amsgrad.*Nothing was changed"):
                opt.step()
            after = opt.full_model_state_dict()
            assert opt.steps == steps and all(torch.equal(after[k], before[k]) for k in before)
            opt.param_groups[0]["amsgrad"] = False
        opt.step()
        opt.zero_grad()
    assert opt.steps[0] == 2


def test_load_state_dict_rejects_nonfinite_groups():
    _, opt = _single_step_params(1e-2)
    sd = opt.state_dict()
    before = (list(opt.steps), [t.clone() for b in opt.buckets for t in b.state_tensors().values()])
    for k, v, msg in [("lr", NAN, "Invalid learning rate"), ("weight_decay", INF, "weight_decay"),
                      ("betas", (0.9, 1.0), "beta parameter at index 1")]:
        bad = dict(sd, param_groups=[dict(g, **{k: v}) for g in sd["param_groups"]],
                   steps=[7] * len(sd["steps"]))
        with pytest.raises(ValueError, match=msg):
            opt.load_state_dict(bad)
        assert opt.steps == before[0] and opt.param_groups[0]["lr"] == 1e-2
        assert all(torch.equal(a, t) for a, t in zip(before[1], (t for b in opt.buckets
                                                                for t in b.state_tensors().values())))
    opt.load_state_dict(sd)                     # the good one still loads


def test_gradscaler_must_be_given():
    """GradScaler drives ZeroAdamW through the public protocol (grad_scale / found_inf); one that
    was not given to the constructor is refused before anything changes (no stack walking)."""
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=2, backend="reference")
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    idx, tgt = batch(0, 1)
    scaler.scale(loss_fn(model, idx[:2], tgt[:2])).backward()
    before = _state(opt)
    with pytest.raises(RuntimeError, match="loss_scale=scaler"):
        scaler.step(opt)
    assert opt.steps[0] == 0 and all(torch.equal(a, b) for a, b in zip(before, _state(opt)))
    # through the step kwargs directly, with the scaler given: the scale divides the gradients
    model2 = make_model()
    opt2 = zk.ZeroAdamW(model2, stage=2, backend="reference", loss_scale=scaler)
    loss_fn(model2, idx[:2], tgt[:2]).mul(4.0).backward()
    opt2.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(0.0))
    model3 = make_model()
    opt3 = zk.ZeroAdamW(model3, stage=2, backend="reference")
    loss_fn(model3, idx[:2], tgt[:2]).backward()
    opt3.step()
    a, b = opt2.full_model_state_dict(), opt3.full_model_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stage2_hooks_do_not_flatten(monkeypatch):
    """Issue 10.6: each gradient goes into its bucket region with one copy_/add_ (no flatten
    launch per gradient)."""
    import zero_kernels.kernels.flatten as kf
    from zero_kernels.zero import flat
    calls = []
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=2, bucket_size=64, backend="reference")   # bind flattens: before
    monkeypatch.setattr(kf, "flatten_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(flat, "flatten_torch", lambda *a, **k: calls.append("torch"))
    idx, tgt = batch(0, 1)
    for _ in range(2):                          # the second accumulates (add_)
        loss_fn(model, idx[:2], tgt[:2]).backward()
    assert calls == []
    monkeypatch.undo()
    ref = make_model()
    ropt = zk.ZeroAdamW(ref, stage=1, bucket_size=64, backend="reference")
    for _ in range(2):
        loss_fn(ref, idx[:2], tgt[:2]).backward()
    opt.step()
    ropt.step()
    a, b = opt.full_model_state_dict(), ropt.full_model_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_stage3_overlap_comm_honoured():
    """Stage 3 honours overlap_comm: False issues no reduce-scatter before backward ends; both
    give the same result."""
    from zero_kernels.zero import collectives as C
    out, issued_early = {}, {}
    for overlap in (True, False):
        model = make_model()
        opt = zk.ZeroAdamW(model, stage=3, bucket_size=64, overlap_comm=overlap, backend="reference")
        seen = []
        h = model.emb.register_full_backward_pre_hook(
            lambda m, g: seen.append(sum(k == "reduce_scatter" for k, _, _ in C.TRACE)))
        C.TRACE = []
        try:
            for s in range(2):
                idx, tgt = batch(s, 1)
                loss_fn(model, idx[:2], tgt[:2]).backward()
                opt.step()
                opt.zero_grad()
        finally:
            C.TRACE = None
            h.remove()
        issued_early[overlap] = seen[0]
        out[overlap] = opt.full_model_state_dict()
    assert issued_early[True] > 0 and issued_early[False] == 0, issued_early
    assert all(torch.equal(out[True][k], out[False][k]) for k in out[True])


def _zero_grad_case(rank, world, stage, out):
    torch.manual_seed(0)
    results = []
    for use_model in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 3))
        zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            model(torch.randn(5, 7, generator=g)).square().mean().backward()
            zopt.step()
            (model.zero_grad if use_model else zopt.zero_grad)()
        results.append(zopt.full_model_state_dict())
        zopt.remove_hooks()
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_zero_grad_clears_zero_gradients_world2(stage, tmp_path):
    """Loops that call model.zero_grad() (Hugging Face's Trainer does) instead of zopt.zero_grad()
    train exactly the same: at stages 2-3 step() consumes the reduced gradient shards, which
    model.zero_grad() cannot reach (they used to accumulate across steps, silently)."""
    out = str(tmp_path / "r.pt")
    run_world(_zero_grad_case, 2, stage, out, timeout=180)
    a, b = torch.load(out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _different_seeds_case(rank, world, stage, out):
    torch.manual_seed(100 + rank)                      # every rank initialises its own model
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 3))
    model.register_buffer("count", torch.full((2,), float(rank)))
    zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(5, 7, generator=g) for _ in range(3)]
    for x in xs:
        model(x).square().mean().backward()
        zopt.step()
        zopt.zero_grad()
    full = zopt.full_model_state_dict()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, (full, xs))
    if rank == 0:
        torch.save(gathered, out)
    zopt.remove_hooks()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ranks_start_from_rank0_model_world2(stage, tmp_path):
    """Issue 13.14: ranks that initialised differently train rank 0's model (as DDP broadcasts at
    construction), equal to one process running AdamW from rank 0's initialisation on all batches."""
    out = str(tmp_path / "r.pt")
    run_world(_different_seeds_case, 2, stage, out, timeout=180)
    (full0, xs0), (full1, xs1) = torch.load(out)
    for k in full0:
        assert torch.equal(full0[k], full1[k]), k
    assert torch.equal(full0["count"], torch.zeros(2))                 # rank 0's buffer everywhere
    torch.manual_seed(100)
    ref = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.LayerNorm(13), torch.nn.Linear(13, 3))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x0, x1 in zip(xs0, xs1):
        ((ref(x0).square().mean() + ref(x1).square().mean()) / 2).backward()
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full0[k], v, rtol=1e-5, atol=1e-6)


def _moved_case(rank, world, stage, how):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 3))
    zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2)
    model(torch.randn(5, 7)).square().mean().backward()
    zopt.step()
    zopt.zero_grad()
    before = zopt.state_dict()["state"]
    assert before and all(len(b) >= 3 for b in before)    # master, exp_avg, exp_avg_sq per bucket
    steps = list(zopt.steps)
    if how == "double":
        model.double()
    elif how.startswith("bfloat16"):
        model.to(torch.bfloat16)
    else:                                           # p.data replaced by a copy: same dtype, new storage
        for p in model.parameters():
            p.data = p.data.clone()
    if how.endswith("backward"):                    # the next backward says so too (not torch's grad-dtype error)
        with pytest.raises(RuntimeError, match="is no longer stored in ZeroAdamW's buffers.*before constructing"):
            model(torch.randn(5, 7).bfloat16()).float().square().mean().backward()
    with pytest.raises(RuntimeError, match="before constructing ZeroAdamW"):
        zopt.step()
    assert zopt.steps == steps                      # nothing changed
    after = zopt.state_dict()["state"]
    assert all(torch.equal(x[k], y[k]) for x, y in zip(before, after) for k in x)
    zopt.remove_hooks()


@pytest.mark.parametrize("stage,how", [(1, "double"), (2, "bfloat16"), (2, "data"), (3, "bfloat16"), (3, "double"),
                                       (2, "bfloat16-backward"), (3, "bfloat16-backward")])
def test_cast_after_construction_is_an_error_world2(stage, how):
    """Issue 13.2: model.to(dtype) / p.data = ... after ZeroAdamW(...) used to stop training silently
    (stages 1-2) or be undone at the next gather (stage 3); step() now raises before changing anything. A cast
    model's next backward (stage 2: the gradient hook; stage 3: the forward's gather) raises the same error, not
    torch's "gradient with dtype 'float' ... grad_dtype 'BFloat16'"."""
    run_world(_moved_case, 2, stage, how, timeout=180)


def _embedding_model_after_a_step(stage):
    """(model, ZeroAdamW, ids, its step counts) after one step of an Embedding(10, 6) -> Linear(6, 3) model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 3))
    zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2, timeout=60.0)
    ids = torch.arange(10).view(2, 5)
    model(ids).square().mean().backward()
    zopt.step()
    zopt.zero_grad()
    steps = list(zopt.steps)
    return model, zopt, ids, steps


def _resized_case(rank, world, stage):
    """An embedding grown after construction (Hugging Face's resize_token_embeddings swaps ``weight.data`` for a
    larger tensor): stage 1 at step(), stage 2 at the next backward (was: torch's "size of tensor a (10) must match
    ... (12)" inside the gradient hook), stage 3 when ``zopt.gathered()`` ends (was: the resize silently undone,
    the next forward failing on the config's new size) raise naming the parameter, both shapes and the fix."""
    model, zopt, ids, steps = _embedding_model_after_a_step(stage)
    want = r"parameter '0.weight' has shape \(12, 6\), but ZeroAdamW sharded it with shape \(10, 6\).*BEFORE constructing"

    def grow():
        model[0].weight.data = torch.cat([model[0].weight.data, torch.zeros(2, 6)])
    if stage == 3:
        with pytest.raises(RuntimeError, match=want):
            with zopt.gathered():
                grow()
        assert model[0].weight.numel() == 0           # freed again: the model still trains at the old size
        model(ids).square().mean().backward()
        zopt.step()
    else:
        grow()
        with pytest.raises(RuntimeError, match=want):
            model(ids + 2).square().mean().backward()
            zopt.step()
        assert zopt.steps == steps
    zopt.remove_hooks()


def _added_case(rank, world, stage):
    """A module replaced after construction (Hugging Face's resize of an untied head makes a new nn.Linear): its
    parameters are no ZeRO optimizer's; once they have a gradient, step() and clip_grad_norm_ raise naming them
    (was: trained never, silently, as by a torch.optim.AdamW built before the change), before any change."""
    model, zopt, ids, steps = _embedding_model_after_a_step(stage)
    model[1] = torch.nn.Linear(6, 4)
    model(ids).square().mean().backward()
    for call in (lambda: zopt.clip_grad_norm_(1.0), zopt.step):
        with pytest.raises(ValueError, match=r"parameter '1.weight' is not one of the ZeRO optimizer's.*Nothing was changed"):
            call()
    assert zopt.steps == steps
    zopt.remove_hooks()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_module_replaced_after_construction_is_an_error_world2(stage):
    run_world(_added_case, 2, stage, timeout=180)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_resized_after_construction_is_an_error_world2(stage):
    run_world(_resized_case, 2, stage, timeout=180)


def _rank0_shard_everywhere(rank, world, stage):
    model = make_model()
    zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2, timeout=60.0, backend="reference",
                        param_dtype=torch.bfloat16, exp_avg_dtype=torch.uint8, store_param_remainders=True)
    for s in range(2):
        _backward(model, s)
        zopt.step()
        zopt.zero_grad()
        if s == 0:
            sd = zopt.state_dict()
            objs = [sd if rank == 0 else None]
            dist.broadcast_object_list(objs, src=0)     # every rank loads rank 0's shard (a common mistake)
            shard0 = objs[0]
    steps, params = list(zopt.steps), [p.detach().clone() for p in model.parameters()]
    t0 = time.monotonic()
    want = ("this shard belongs to rank 0" if rank == 1 else "failed on another rank of the process group")
    with pytest.raises(ValueError, match=want):
        zopt.load_state_dict(shard0)
    assert time.monotonic() - t0 < 20, "a failed load must not wait for the collective timeout"
    assert zopt.steps == steps and all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    _backward(model, 5)                                 # and the ranks still train together
    zopt.step()


def test_shard_wrong_on_one_rank_changes_nothing_anywhere_world2(stage=1):
    """ZeroAdamW.load_state_dict with rank 0's shard on every rank: rank 1 refused it, but rank 0 applied it
    and then waited in the parameter all-gather until the timeout (states differing across ranks). Now the
    ranks agree first: both raise at once (rank 0 naming the other rank's failure), nothing changes, and
    training goes on. (The agreement precedes the stage's own apply / refresh: stage 1 stands for all.)"""
    run_world(_rank0_shard_everywhere, 2, stage, timeout=180)


def _stage3_forward_stall(rank, world):
    g = dist.new_group([0, 1])
    model = make_model()
    opt = zk.ZeroAdamW(model, stage=3, process_group=g, timeout=T_OUT, backend="reference")
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    if rank == 0:
        # rank 1 never runs this forward: the stage-3 gather in the forward hook is bounded by timeout=
        with pytest.raises(CollectiveTimeoutError, match=r"did not complete on rank 0.*Likely cause.*unit \d+ of "
                           r"zopt.sharding_units\(\)\): every rank must run the model.*some ranks only.*MoE layer's "
                           r"experts.*wrap=\["):
            _backward(model, 1)
    else:
        time.sleep(T_OUT + 3)


def test_stage3_forward_gather_honours_timeout_world2():
    """Issue 13.8: a stalled peer during ZeRO-3's forward gathers raises the package's timeout error
    (naming the collective and the likely cause) after timeout=, not gloo's own 60 s here."""
    run_world(_stage3_forward_stall, 2, timeout=120, collective_timeout=60)


def _options_differ(rank, world):
    """Options every rank must share, set differently on one rank: each raised on neither rank before (a loss
    scale differing by rank unscaled each rank's slice by its own: 3.5e-3 off torch in 4 steps; a timeout on one
    rank only failed as "a rank died"; wrap / reshard_after_forward hung in the first gather)."""
    import datetime
    cases = [(dict(loss_scale=1024.0 * (1 + 3 * rank)), "loss_scale=4096.0 but rank 0 with loss_scale=1024.0"),
             (dict(loss_scale=1024.0 if rank == 0 else None), "loss_scale=None but rank 0 with loss_scale=1024.0"),
             (dict(loss_scale="dynamic", growth_interval=1 + 2 * rank), "growth_interval=3 but rank 0 with"),
             (dict(timeout=30 if rank == 0 else None), "timeout set=False but rank 0 with timeout set=True"),
             (dict(stage=3, reshard_after_forward=rank == 0), "reshard_after_forward=False"),
             (dict(stage=3, wrap=[nn.Linear] if rank else None), "rank 1 constructs the optimizer with wrap=")]
    for kw, msg in cases:
        model = make_model()
        kw = {"stage": 2, **kw}
        with pytest.raises(ValueError, match=msg if rank == 1 else "rank 1 constructs the optimizer with"):
            zk.ZeroAdamW(model, backend="reference", **kw)
    zk.ZeroAdamW(make_model(), stage=2, backend="reference", loss_scale=1024.0, timeout=30)   # control: the same
    with pytest.raises(ValueError, match="positive datetime.timedelta"):
        zk.ZeroAdamW(make_model(), stage=2, backend="reference", timeout=datetime.timedelta(0))
    # gathered() and refresh_params() wait for a peer that never comes no longer than timeout= (group's: 60 s)
    for what in ("gathered", "refresh_params"):
        g = dist.new_group([0, 1])
        model = make_model()
        opt = zk.ZeroAdamW(model, stage=3 if what == "gathered" else 2, process_group=g, timeout=3,
                           backend="reference")
        if rank == 0:
            t0 = time.monotonic()
            with pytest.raises(CollectiveTimeoutError, match="did not complete on rank 0"):
                if what == "gathered":
                    with opt.gathered():
                        pass
                else:
                    opt.refresh_params()
            assert time.monotonic() - t0 < 30, time.monotonic() - t0
        else:
            time.sleep(5)
        dist.barrier()


def test_options_every_rank_must_share_world2():
    run_world(_options_differ, 2, timeout=240, collective_timeout=60)


def _unfreeze_case(rank, world, out):
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 3))

    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(5, 7, generator=g) for _ in range(5)]
    fulls = []
    for stage in (1, 2, 3):
        # Frozen at construction, unfrozen later: refused (it has no shard), before anything changes.
        model = make()
        model[0].weight.requires_grad_(False)
        zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2, timeout=T_OUT)
        model(xs[0]).square().mean().backward()
        zopt.step()
        zopt.zero_grad()
        model[0].weight.requires_grad_(True)
        model(xs[1]).square().mean().backward()
        before, steps = zopt.state_dict()["state"], list(zopt.steps)
        with pytest.raises(ValueError, match=r"parameter '0.weight' was frozen .* Build the optimizer after"):
            zopt.clip_grad_norm_(1.0)
        with pytest.raises(ValueError, match=r"parameter '0.weight' was frozen"):
            zopt.step()
        assert zopt.steps == steps
        after = zopt.state_dict()["state"]
        assert all(torch.equal(x[k], y[k]) for x, y in zip(before, after) for k in x)
        model[0].weight.requires_grad_(False)       # frozen again: its leftover gradient is ignored (as by torch)
        w0 = model[0].weight.detach().clone()
        zopt.step()
        assert torch.equal(model[0].weight.detach(), w0) and zopt.steps != steps
        zopt.remove_hooks()
        # The fix the message names: trainable at construction, frozen for a while, trained again.
        model = make()
        zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2, timeout=T_OUT)
        for s, x in enumerate(xs):
            model[0].weight.requires_grad_(not 1 <= s <= 2)
            model(x).square().mean().backward()
            zopt.step()
            zopt.zero_grad()
        fulls.append(zopt.full_model_state_dict())
        zopt.remove_hooks()
    gathered = [None] * world
    dist.all_gather_object(gathered, xs)
    if rank == 0:
        torch.save((fulls, gathered), out)


def test_unfrozen_parameter_refused_and_freezing_later_trains_world2(tmp_path):
    """A parameter frozen when ZeroAdamW was built and unfrozen since used to get gradients and never train
    (no error): step() and clip_grad_norm_ now raise naming it. Built trainable and frozen for a while, it is
    skipped like torch.optim.AdamW skips it and trains again once unfrozen (equal to AdamW on one process)."""
    out = str(tmp_path / "r.pt")
    run_world(_unfreeze_case, 2, out, timeout=240)
    fulls, (xs0, xs1) = torch.load(out)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 3))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for s, (x0, x1) in enumerate(zip(xs0, xs1)):
        ref[0].weight.requires_grad_(not 1 <= s <= 2)
        ((ref(x0).square().mean() + ref(x1).square().mean()) / 2).backward()
        opt.step()
        opt.zero_grad()
    for stage, full in zip((1, 2, 3), fulls):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage} {k}: {m}")


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_dynamic_scale_follows_torch_amp_update_scale(interval):
    """The dynamic loss scale is torch._amp_update_scale_'s, step for step, near the top of fp32 too: it never
    grows past fp32's range (it grew to 2**128, inf in fp32: every other step overflowed, was skipped and backed
    off, without a word)."""
    from zero_kernels.zero.scaling import DynamicLossScaler
    ours = DynamicLossScaler(init_scale=2.0 ** 124, growth_interval=interval)
    scale, tracker = torch.tensor([2.0 ** 124]), torch.zeros(1, dtype=torch.int32)
    pattern = [False] * 12 + [True] + [False] * 9 + [True, True] + [False] * 6
    for found in pattern:
        ours.update(found)
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(found)]), 2.0, 0.5, interval)
        assert ours.scale == float(scale) and ours.growth_tracker == int(tracker)
    assert ours.scale <= torch.finfo(torch.float32).max


def _buffers_worker(rank, world):
    """BatchNorm running statistics under ZeroAdamW at every stage, rank-dependent batches, 3 steps: with the default
    broadcast_buffers=True every rank holds rank 0's statistics after each step, equal (allclose: the parameters
    agree to rounding) to DDP's rank 0 beside it (DDP broadcasts rank 0's buffers before each forward); with
    broadcast_buffers=False each rank's follow its own batches (the negative control: they differ)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 1))
    for stage in (1, 2, 3):
        ddp_m = model()
        ddp = nn.parallel.DistributedDataParallel(ddp_m)
        od = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        for sync in (True, False):
            m = model()
            z = zk.ZeroAdamW(m, stage=stage, lr=1e-2, broadcast_buffers=sync, timeout=60)
            for s in range(3):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * s + rank)) + rank
                # not .sum(): the sum of a BatchNorm's outputs does not depend on its input, so the first layer's
                # gradient would be rounding noise, which Adam turns into +-lr steps of any sign (DDP's all-reduce
                # and ZeRO's reduce-scatter round differently: the statistics disagreed by 1e-3 on an AMD CPU)
                m(x).square().mean().backward()
                z.step()
                z.zero_grad()
                if sync:
                    od.zero_grad()
                    ddp(x).square().mean().backward()
                    od.step()
            mine = torch.cat([m[1].running_mean, m[1].running_var, m[1].num_batches_tracked.float().view(1)])
            first = mine.clone()
            dist.broadcast(first, src=0)
            if sync:
                assert torch.equal(mine, first), (stage, rank)
                ref = torch.cat([ddp_m[1].running_mean, ddp_m[1].running_var])
                dist.broadcast(ref, src=0)
                torch.testing.assert_close(mine[:-1], ref, rtol=1e-5, atol=1e-6)
                assert int(mine[-1]) == 3
            elif rank == 1:
                assert not torch.equal(mine[:6], first[:6]), stage
            z.remove_hooks()


def test_buffers_follow_rank_0_like_ddp_world2():
    from _dist import run_world
    run_world(_buffers_worker, 2, timeout=240)
