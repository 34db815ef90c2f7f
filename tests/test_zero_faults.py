"""Focused ZeRO-layer checks for single-line faults the parity suites (tests/test_zero.py, test_zero3.py) did
not see (tools/mutation_check.py, the ``zero.*`` faults; suite ``zero12``). One gloo world of 3 ranks runs
every case: sizes divide neither by 3 nor by the alignment, so parameters straddle slices.

* Pieces with different step counts in one slice: a parameter that first gets a gradient at step 1 sits
  between parameters already at step 2 in one bucket; each keeps its own bias correction (torch.optim.AdamW
  on the full batch, rtol 1e-5). One run per step count, not one per adjacent range.
* A parameter used on one rank only, and the next step on another: a rank that has no gradient for it
  contributes zeros (stage 1's kept send buffer holds that rank's previous gradient there).
* Stage 1 with 16-bit parameters and ``zero_grad(set_to_none=False)``: the gradients are views of a bf16
  flat buffer, cast into the fp32 send buffer each step; bit for bit the run with ``set_to_none=True``
  (fresh gradients, flatten's cast).
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from _dist import Cases, run_world  # noqa: E402

import zero_kernels as zk  # noqa: E402

LR, WD = 1e-2, 0.1
# per step, the ranks that use `extra`: none, rank 0 (its first gradient: step count 1 while the others are
# at 2), rank 1 (ranks 0 and 2 have none: zeros), all (rank 0 had none at the previous step)
USE_EXTRA = [(), (0,), (1,), (0, 1, 2)]


class Branchy(nn.Module):
    """88 trainable elements (40 + 30 + 18); ``extra`` sits between ``a`` and ``b`` in the bucket."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.extra = nn.Linear(5, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x, use_extra):
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.b(h)


def _one_unit(stage):
    return {"wrap": lambda m: False} if stage == 3 else {}


def _data(step, world):
    g = torch.Generator().manual_seed(31 + step)
    return torch.randn(world, 3, 7, generator=g), torch.randn(world, 3, 3, generator=g)


def _case_step_counts_and_missing_grads(rank, world, stage, bucket_size):
    torch.manual_seed(4)
    model = Branchy()
    ref = copy.deepcopy(model)
    # stage 3: one unit (the root): `extra` runs on some ranks only, so it cannot gather as a unit of its own
    zopt = zk.ZeroAdamW(model, stage=stage, lr=LR, weight_decay=WD, bucket_size=bucket_size, backend="reference",
                        timeout=60, **_one_unit(stage))
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for s, users in enumerate(USE_EXTRA):
        x, y = _data(s, world)
        F.mse_loss(model(x[rank], rank in users), y[rank]).backward()
        zopt.step()
        zopt.zero_grad()
        sum(F.mse_loss(ref(x[r], r in users), y[r]) for r in range(world)).div(world).backward()
        ropt.step()
        ropt.zero_grad()
    full = zopt.full_model_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"stage {stage} bucket {bucket_size} {k}: {m}")
    steps = {ps.name: zopt.steps[ps.index] for ps in zopt.layout.params}
    assert steps == {"a.weight": 4, "a.bias": 4, "extra.weight": 3, "extra.bias": 3, "b.weight": 4, "b.bias": 4}, steps
    zopt.remove_hooks()


def _bf16_run(rank, world, set_to_none):
    torch.manual_seed(5)
    model = Branchy()
    zopt = zk.ZeroAdamW(model, stage=1, lr=LR, weight_decay=WD, param_dtype=torch.bfloat16, bucket_size=100,
                        backend="reference", timeout=60)
    for s in range(4):
        x, y = _data(s, world)
        F.mse_loss(model(x[rank].bfloat16(), True).float(), y[rank]).backward()
        zopt.step()
        zopt.zero_grad(set_to_none=set_to_none)
    out = zopt.full_model_state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()}
    zopt.remove_hooks()
    return out


def _case_stage1_views_path(rank, world):
    (full_v, params_v), (full_c, params_c) = _bf16_run(rank, world, False), _bf16_run(rank, world, True)
    for k in full_c:
        assert torch.equal(full_v[k], full_c[k]), ("master", k, (full_v[k] - full_c[k]).abs().max())
        assert torch.equal(params_v[k], params_c[k]), ("bf16 parameter", k)
    torch.manual_seed(5)
    assert not torch.equal(full_c["a.weight"], Branchy().a.weight.detach()), "negative control: it trained"


def _faults_world(rank, world):
    cases = Cases(rank, world)

    for stage in (1, 2, 3):
        for bucket_size in (10**6, 64):
            cases.run(f"step counts / missing grads, stage {stage} bucket {bucket_size}",
                      lambda stage=stage, bs=bucket_size: _case_step_counts_and_missing_grads(rank, world, stage, bs))
    cases.run("stage-1 bf16 views path", lambda: _case_stage1_views_path(rank, world))
    cases.check()


def test_zero_faults_world3():
    run_world(_faults_world, 3, timeout=240)


def test_cases_report_every_failure():
    """Negative control of the collector every world function here reports through (tests/_dist.py Cases): a failed
    case is never swallowed, and the cases after it still run."""
    import pytest
    cases, ran = Cases(1, 3), []
    cases.run("fails", lambda: 1 / 0)
    cases.run("runs after", lambda: ran.append(True))
    assert ran == [True]
    with pytest.raises(AssertionError, match=r"rank 1/3: 1 case\(s\) failed:\n\[fails\] ZeroDivisionError"):
        cases.check()
    Cases(0, 1).check()                                     # nothing failed: nothing raised
