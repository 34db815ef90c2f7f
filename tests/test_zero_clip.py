"""Issue 13 item 6: torch's gradient clipping on a ZeRO model fails loudly instead of silently.

Before the fix, ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` after backward
returned 0.0 and clipped nothing at stages 2-3 (p.grad was None) and clipped each rank by the
norm of its own local gradient at stage 1. Now p.grad is a ShardedGrad placeholder
([Note: gradient placeholders] in zero_kernels/zero/grad_guard.py): torch's clip (directly, via
clip_grad_value_, or via accelerate's Accelerator.clip_grad_norm_) raises ShardedGradError naming
``zopt.clip_grad_norm_(max_norm)`` before anything is modified, and that fix gives the parameters of
DDP + torch clip + torch.optim.AdamW (world 2, gloo, stages 1-3). The negative control puts back
what p.grad held before the fix and shows the same check flags it. The Lightning precision plugin
routes gradient_clip_val to zopt.clip_grad_norm_; the Hugging Face ZeroTrainer overrides the
Trainer's clipping hooks (the end-to-end runs are tests/test_lightning.py and tests/test_hf.py).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402
from test_zero import batch, loss_fn, make_model  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels.zero.grad_guard import ShardedGrad, ShardedGradError, local_grad  # noqa: E402

MAX_NORM = 0.05          # below every step's gradient norm: clipping is active on every step
STEPS = 3
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
FIX = r"zopt\.clip_grad_norm_\(max_norm\)"


def _rows(s, world):
    idx, tgt = batch(s, world)
    r = dist.get_rank()
    return idx[2 * r:2 * r + 2], tgt[2 * r:2 * r + 2]


def _ddp_reference(world):
    """DDP + torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW: parameters after each step, norms."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HP)
    params, norms = [], []
    for s in range(STEPS):
        loss_fn(ddp, *_rows(s, world)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        params.append({k: v.clone() for k, v in model.state_dict().items()})
    assert min(norms) > 2 * MAX_NORM, norms          # clipping changed every step
    return params, norms


def _snapshot(model, zopt):
    grads = {n: None if local_grad(p) is None else local_grad(p).clone() for n, p in model.named_parameters()}
    slices = [None if b.reduce.grad_slice is None else b.reduce.grad_slice.clone() for b in zopt.buckets]
    return ({n: p.detach().clone() for n, p in model.named_parameters()}, grads, slices,
            [t.clone() for b in zopt.buckets for t in b.state_tensors().values()], list(zopt.steps))


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _params_diff(zopt, ref) -> float:
    full = zopt.full_model_state_dict()             # collective; stage 3 holds shards only
    assert full.keys() == ref.keys()
    return max((full[k] - ref[k]).abs().max().item() for k in ref)


def _torch_clip_outcome(model, zopt, ref_params, ref_norm, clip) -> str:
    """What a user's ``clip(model.parameters())`` + ``zopt.step()`` does: "loud" (raised the error
    naming the fix, nothing modified), "correct" (norm and parameters of DDP + torch clip) or
    "silent" (neither: the failure this item is about)."""
    zopt._reduce_all()                  # stages 2-3: finish the reduce-scatters, so slices are comparable
    before = _snapshot(model, zopt)
    try:
        norm = clip(model.parameters())
    except ShardedGradError as e:
        assert "zopt.clip_grad_norm_(max_norm)" in str(e) and "on a ZeRO-" in str(e), str(e)
        assert _same(before, _snapshot(model, zopt)), "modified before raising"
        return "loud"
    zopt.step()
    ok = norm is not None and abs(float(norm) - ref_norm) <= 1e-5 * ref_norm
    ok = ok and _params_diff(zopt, ref_params) < 1e-5
    return "correct" if ok else "silent"


def _zopt(stage, model, **kw):
    return zk.ZeroAdamW(model, stage=stage, bucket_size=64, backend="reference", **HP, **kw)


def _case_torch_clip(rank, world, stage, negative_control):
    ref_params, ref_norms = _ddp_reference(world)
    model = make_model()
    zopt = _zopt(stage, model)
    clips = [lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM),
             lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True),
             lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, norm_type=float("inf")),
             lambda ps: torch.nn.utils.clip_grad_value_(ps, 1e-3)]
    for s in range(STEPS):
        idx, tgt = _rows(s, world)
        if s == 0:
            loss_fn(model, idx, tgt).backward()
        else:                           # two micro-batches: autograd accumulates over the placeholders
            with zopt.no_sync():
                (loss_fn(model, idx[:1], tgt[:1]) / 2).backward()
            with pytest.raises(ShardedGradError, match=FIX):
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            (loss_fn(model, idx[1:], tgt[1:]) / 2).backward()
        if negative_control:            # what p.grad held before the fix: local grads (1), nothing (2-3)
            for p in model.parameters():
                p.grad = local_grad(p)
            if stage == 1:
                assert _torch_clip_outcome(model, zopt, ref_params[s], ref_norms[s], clips[0]) == "silent"
            else:                       # torch clips nothing (norm 0); the step now refuses the gradients
                with pytest.raises(ShardedGradError, match="set to None"):   # p.grad lost: [Note: dropped
                    _torch_clip_outcome(model, zopt, ref_params[s], ref_norms[s], clips[0])  # gradients]
            return
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        assert grads and all(isinstance(g, ShardedGrad) for g in grads)   # `p.grad is None` checks see a gradient
        for clip in clips:
            assert _torch_clip_outcome(model, zopt, ref_params[s], ref_norms[s], clip) == "loud"
        norm = zopt.clip_grad_norm_(MAX_NORM)          # the fix the error names
        assert float(norm) == pytest.approx(ref_norms[s], rel=1e-5)
        zopt.step()
        assert _params_diff(zopt, ref_params[s]) < 1e-5
        if stage > 1:                   # the step consumed the gradients
            assert all(p.grad is None for p in model.parameters())
        zopt.zero_grad()
        assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_torch_clip_raises_and_zopt_clip_matches_ddp(stage):
    run_world(_case_torch_clip, 2, stage, False)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_negative_control_pre_fix_grads_are_silently_wrong(stage):
    run_world(_case_torch_clip, 2, stage, True)


# ---- the wrappers users call: accelerate, Lightning, Hugging Face; zero_grad; GradScaler --------------
def _train_through(stage, world, ref_params, ref_norms, clip_fn, model=None, zopt=None):
    """STEPS steps where ``clip_fn(model, zopt)`` clips; the parameters must be DDP's after each."""
    model = model if model is not None else make_model()
    zopt = zopt if zopt is not None else _zopt(stage, model)
    for s in range(STEPS):
        loss_fn(model, *_rows(s, world)).backward()
        norm = clip_fn(model, zopt)
        if norm is not None:
            assert float(norm) == pytest.approx(ref_norms[s], rel=1e-5)
        zopt.step()
        assert _params_diff(zopt, ref_params[s]) < 1e-5
        model.zero_grad()                   # what Hugging Face's Trainer calls after the step
        zopt.zero_grad()


def _case_wrappers(rank, world, stage, tmp):
    import transformers
    from accelerate import Accelerator
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType
    from zero_kernels.integrations.hf import ZeroTrainer
    from zero_kernels.integrations.lightning import ZeroPrecision
    ref_params, ref_norms = _ddp_reference(world)
    model = make_model()
    zopt = _zopt(stage, model)
    loss_fn(model, *_rows(0, world)).backward()
    # accelerate (and the plain Trainer, through it): torch's clip underneath, so the same clear error
    acc = Accelerator(cpu=True)
    assert _torch_clip_outcome(model, zopt, ref_params[0], ref_norms[0],
                               lambda ps: acc.clip_grad_norm_(ps, MAX_NORM)) == "loud"
    args = transformers.TrainingArguments(output_dir=os.path.join(tmp, str(rank)), max_grad_norm=MAX_NORM,
                                          report_to=[], use_cpu=True)
    plain = transformers.Trainer(model=model, args=args, optimizers=(zopt, None))
    with pytest.raises(ShardedGradError, match=FIX):
        plain._clip_grad_norm(model)        # the plain Trainer's clipping step, what its loop calls
    # model.zero_grad(set_to_none=False) between backward and step: exact at stage 1, loud at 2-3
    if stage == 1:
        model.zero_grad(set_to_none=False)
        assert all(local_grad(p) is None or not local_grad(p).any() for p in model.parameters())
    else:
        with pytest.raises(ShardedGradError, match=r"zopt\.zero_grad\(\)"):
            model.zero_grad(set_to_none=False)
    zopt.zero_grad()
    # Lightning: gradient_clip_val goes to ZeroPrecision, which clips with zopt.clip_grad_norm_
    prec = ZeroPrecision()
    _train_through(stage, world, ref_params, ref_norms,
                   lambda m, o: prec.clip_gradients(o, MAX_NORM, GradClipAlgorithmType.NORM))
    with pytest.raises(ValueError, match=r"zopt\.clip_grad_norm_\(max_norm\)"):
        prec.clip_gradients(zopt, MAX_NORM, GradClipAlgorithmType.VALUE)
    # Hugging Face: ZeroTrainer's clipping step (max_grad_norm) is zopt.clip_grad_norm_
    model = make_model()
    zopt = _zopt(stage, model)
    zt = ZeroTrainer(model=model, args=args, optimizers=(zopt, None), zero_stage=stage)
    _train_through(stage, world, ref_params, ref_norms, lambda m, o: zt._clip_grad_norm(m), model, zopt)


def _case_ddp_wrapped(rank, world, stage):
    model = make_model()
    zopt = _zopt(stage, model)
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(ShardedGradError, match=r"used during backward .*DistributedDataParallel around the model"):
        for s in range(2):                      # DDP's reducer reaches p.grad in the second backward
            loss_fn(ddp, *_rows(s, world)).backward()
            zopt.step()
            zopt.zero_grad()


def _case_ddp_wrapped_stage3(rank, world):
    model = make_model()
    _zopt(3, model)
    ddp = nn.parallel.DistributedDataParallel(model)
    with pytest.raises(RuntimeError, match="ZeRO-3 model is running inside DistributedDataParallel"):
        loss_fn(ddp, *_rows(0, world))


def test_model_wrapped_in_ddp_is_named():
    """A ZeRO model wrapped in DistributedDataParallel (accelerate's prepare(model)): at stages 1-2 DDP's reducer
    touches the p.grad placeholders during backward, and the ShardedGradError names DDP and the fix, not
    clipping; at stage 3 forward refuses (DDP's backward failed on a 0-element gradient, naming neither)."""
    run_world(_case_ddp_wrapped, 2, 2)
    run_world(_case_ddp_wrapped_stage3, 2)


@pytest.mark.parametrize("stage", [1, 3])
def test_wrappers_route_or_raise(stage, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    run_world(_case_wrappers, 2, stage, str(tmp_path), timeout=400)


def _case_gradscaler(rank, world, stage):
    """torch.amp.GradScaler over the placeholders. Stage 1: the AMP recipe ``unscale_`` then clip
    works with zopt.clip_grad_norm_ (unscaling the local gradients is exact) and raises with torch's
    clip; stage 2: ``unscale_`` has nothing to unscale here and the step refuses it, changing nothing
    (clipping without it: tests/test_zero_safety.py)."""
    ref_params, ref_norms = _ddp_reference(world)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    model = make_model()
    zopt = _zopt(stage, model, loss_scale=scaler)
    for s in range(STEPS):
        scaler.scale(loss_fn(model, *_rows(s, world))).backward()
        if stage == 1:
            scaler.unscale_(zopt)
            assert _torch_clip_outcome(model, zopt, ref_params[s], ref_norms[s],
                                       lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM)) == "loud"
        elif s == 0:
            scaler.unscale_(zopt)
            zopt._reduce_all()              # the slices are final (no reduce-scatter in flight)
            before = _snapshot(model, zopt)
            with pytest.raises(RuntimeError, match="do not call unscale_"):
                scaler.step(zopt)
            assert _same(before, _snapshot(model, zopt))
            return
        norm = zopt.clip_grad_norm_(MAX_NORM)
        assert float(norm) == pytest.approx(ref_norms[s], rel=1e-5)
        scaler.step(zopt)
        scaler.update()
        assert _params_diff(zopt, ref_params[s]) < 1e-5
        zopt.zero_grad()
    assert float(scaler.get_scale()) == 2.0 ** 10


@pytest.mark.parametrize("stage", [1, 2])
def test_gradscaler_over_placeholders(stage):
    run_world(_case_gradscaler, 2, stage)


@pytest.mark.parametrize("stage", [1, 2])
def test_placeholder_keeps_no_gradient_alive_and_prints(stage):
    """One process (no group): after model.zero_grad() no gradient storage is kept by a placeholder
    (a wrapper kept per parameter would pin the stage-1 local gradient); repr names the fix."""
    import gc
    import weakref
    model = make_model()
    _zopt(stage, model)
    idx, tgt = batch(0, 1)
    loss_fn(model, idx[:2], tgt[:2]).backward()
    g = model.blocks[0].fc1.weight.grad
    assert isinstance(g, ShardedGrad) and "zopt.clip_grad_norm_(max_norm)" in repr(g)
    assert (g.local is not None) == (stage == 1)
    refs = [weakref.ref(local_grad(p)) for p in model.parameters() if local_grad(p) is not None]
    assert len(refs) == (len([p for p in model.parameters() if p.grad is not None]) if stage == 1 else 0)
    del g
    model.zero_grad()
    gc.collect()
    assert all(r() is None for r in refs)


# ---- gradients dropped from p.grad between backward and step ([Note: dropped gradients], hooks.py) ----
def _loss(model, s=0):
    idx, tgt = batch(s, 1)
    return loss_fn(model, idx[:2], tgt[:2])


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("how", ["model.zero_grad", "p.grad=None", "zero_grad+backward"])
def test_gradient_dropped_after_backward_is_refused(stage, how):
    """torch skips a parameter whose p.grad was dropped before step(); at stages 2-3 the gradient
    already sits in the reduced slices, so the step refuses (ShardedGradError naming the parameter
    and zopt.zero_grad()) before changing anything, instead of applying it silently. zopt.zero_grad()
    then recovers, and the step equals a fresh optimizer's first step on the same batch."""
    model = make_model()
    zopt = _zopt(stage, model)
    _loss(model).backward()
    if how == "p.grad=None":
        model.blocks[0].fc1.weight.grad = None
    else:
        model.zero_grad()
        if how == "zero_grad+backward":         # torch: the step would use only the second batch
            _loss(model, 1).backward()
    before = _snapshot(model, zopt)
    with pytest.raises(ShardedGradError, match=r"set to None .*zopt\.zero_grad\(\)"):
        zopt.step()
    with pytest.raises(ShardedGradError, match="set to None"):
        zopt.clip_grad_norm_(1.0)
    assert _same(before, _snapshot(model, zopt))
    zopt.zero_grad()
    _loss(model, 2).backward()
    zopt.step()
    fresh = make_model()
    fopt = _zopt(stage, fresh)
    _loss(fresh, 2).backward()
    fopt.step()
    assert _same(zopt.full_model_state_dict(), fopt.full_model_state_dict())


@pytest.mark.parametrize("stage", [2, 3])
def test_negative_control_held_gradients_step(stage):
    """What must not be refused: micro-batches accumulating, a create_graph backward (autograd
    replaces p.grad by ``placeholder + new``), model.zero_grad() right after step() (Hugging Face's
    Trainer), and torch code reading ``p.grad is None``."""
    model = make_model()
    zopt = _zopt(stage, model)
    for s in range(2):
        _loss(model, s).backward()
        _loss(model, s + 1).backward(create_graph=(stage == 2 and s == 1))
        assert isinstance(model.blocks[0].fc1.weight.grad, ShardedGrad)
        zopt.step()
        model.zero_grad()
    assert zopt.steps[0] == 2


def test_stage1_unscale_after_clip_is_refused():
    """Stage 1 with torch.amp.GradScaler: ``zopt.clip_grad_norm_`` reduce-scatters the scaled
    gradients; a later ``scaler.unscale_(zopt)`` cannot reach them (the step then applied
    still-scaled slices with no unscale, silently). It raises before touching anything; the AMP
    order (unscale_, clip, step) and clip without unscale_ both give the same parameters."""
    results = []
    for order in ["unscale-clip", "clip-only", "clip-unscale"]:
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        zopt = _zopt(1, model, loss_scale=scaler)
        scaler.scale(_loss(model)).backward()
        if order == "unscale-clip":
            scaler.unscale_(zopt)
        norm = zopt.clip_grad_norm_(MAX_NORM)
        if order == "clip-unscale":
            before = _snapshot(model, zopt)
            with pytest.raises(ShardedGradError, match=r"before zopt\.clip_grad_norm_"):
                scaler.unscale_(zopt)
            assert _same(before, _snapshot(model, zopt))
            continue
        scaler.step(zopt)
        scaler.update()
        results.append((float(norm), {n: p.detach().clone() for n, p in model.named_parameters()}))
    (n0, p0), (n1, p1) = results
    assert n0 == pytest.approx(n1, rel=1e-6) and n0 > MAX_NORM
    for k in p0:
        torch.testing.assert_close(p0[k], p1[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_twice_returns_what_torch_returns(stage):
    """A second clip_grad_norm_ before step() returned the unclipped norm again (torch: the norm of the clipped
    gradients); the parameters matched either way. One process (no process group)."""
    torch.manual_seed(0)
    model, ref = make_model(), make_model()
    ref.load_state_dict(model.state_dict())
    zopt = _zopt(stage, model)
    topt = torch.optim.AdamW(ref.parameters(), **HP)
    idx, tgt = batch(0, 1)
    loss_fn(model, idx, tgt).backward()
    loss_fn(ref, idx, tgt).backward()
    for max_norm in (0.05, 0.01, 1e9):
        ours = zopt.clip_grad_norm_(max_norm)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-7)
    zopt.step()
    topt.step()
    with zopt.gathered():
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


def test_placeholder_message_gives_clipping_advice_to_clipping_ops_only():
    """Any read of p.grad between backward and step() says that it cannot be read, and why; only the ops of
    torch's clipping add how to clip (a user probe: `p.grad.sum()` was told about a norm of 0 and clipping)."""
    from types import SimpleNamespace

    from zero_kernels.zero.grad_guard import _message
    for stage in (1, 2, 3):
        g = SimpleNamespace(param_name="w", stage=stage)
        msg = _message(g, "sum")
        assert "'w' cannot be read on a ZeRO-" in msg and "`sum`" in msg and "To clip" not in msg, msg
        for op in ("_foreach_norm", "linalg_vector_norm", "_foreach_clamp_min_", "clamp_", "_foreach_mul_"):
            assert "To clip gradients call zopt.clip_grad_norm_(max_norm)" in _message(g, op), op
