"""ZeRO-3: a forward that no backward follows gives its gathered units back (issue 13, item 11).

[Note: forward without backward] in zero_kernels/zero/unit_hold.py. A GPT-2-shaped model
(tests/test_checkpoint_safety.py, built from a config) on 2 gloo ranks: after an eval-mode forward
with grad mode on, after a train-mode forward whose output is dropped, and after a forward whose
graph is kept until the next training forward, the live gathered parameter bytes return to the
sharded level (0); training interleaved with those forwards stays bitwise equal to the same
training without them. Before the fix the root unit and the last block stayed gathered until the
next backward.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402
from test_checkpoint_safety import GPT2Config, gpt2  # noqa: E402

import zero_kernels as zk  # noqa: E402

C = GPT2Config()


def _batch(s, rank):
    g = torch.Generator().manual_seed(50 + 7 * s + rank)
    return (torch.randint(0, C.vocab_size, (3, C.n_positions - 2), generator=g),
            torch.randint(0, C.vocab_size, (3, C.n_positions - 2), generator=g))


def _loss(model, s, rank):
    idx, tgt = _batch(s, rank)
    return F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())


def _step(model, opt, s, rank):
    loss = _loss(model, s, rank)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _gathered(opt):
    return opt.memory_report()["gathered_params"]


def _eval_world(rank, world):
    model, ref = gpt2(seed=2), gpt2(seed=2)
    opt = zk.ZeroAdamW(model, stage=3, lr=1e-2, weight_decay=0.1, backend="reference")
    ropt = zk.ZeroAdamW(ref, stage=3, lr=1e-2, weight_decay=0.1, backend="reference")   # no eval forwards
    idx, _ = _batch(99, rank)
    losses, rlosses = [], []
    for s in range(5):
        if s == 1:      # eval mode, grad mode on, output kept: nothing stays gathered
            model.eval()
            out = model(idx)
            assert out.requires_grad and _gathered(opt) == 0
            model.train()
            del out
        if s == 2:      # train mode, output dropped without backward: freed with its graph
            out = model(idx)
            held = _gathered(opt)
            assert held > 0        # root + last block held for the backward (negative control)
            del out
            assert _gathered(opt) == 0
            v = _loss(model, 0, rank).item()          # only the value is used: the graph dies at once
            assert v > 0 and _gathered(opt) == 0
        if s == 3:      # a graph kept alive across a training step: the next forward frees its units
            kept = [model(idx)]
            assert _gathered(opt) == held
            opt.reset_peak_memory()
            ropt.reset_peak_memory()
        if s == 4:      # a backward after an eval-mode forward re-gathers what it needs: still exact
            model.eval()
        losses.append(_step(model, opt, s, rank))
        model.train()
        assert _gathered(opt) == 0
        rlosses.append(_step(ref, ropt, s, rank))
        if s == 3:      # the training forward started by freeing the held units (all but the root):
            # its peak is a plain step's (holding the last block through it would add one block)
            assert opt.memory_report()["peak_gathered_params"] == ropt.memory_report()["peak_gathered_params"]
            del kept
            assert _gathered(opt) == 0
    with torch.no_grad():           # grad mode off: freed at the end of the forward (as before)
        model(idx)
    assert _gathered(opt) == 0
    assert torch.equal(torch.stack(losses), torch.stack(rlosses))
    full, rfull = opt.full_model_state_dict(), ropt.full_model_state_dict()
    init = gpt2(seed=2).state_dict()
    for k in rfull:
        assert torch.equal(full[k], rfull[k]), k
    assert not torch.equal(full["transformer.h.0.mlp.c_fc.weight"], init["transformer.h.0.mlp.c_fc.weight"])
    opt.remove_hooks()
    ropt.remove_hooks()


def test_forward_without_backward_reshards_world2():
    run_world(_eval_world, 2, timeout=300)
