"""Lightning strategies (zero_kernels.integrations.lightning): a tiny LightningModule trained by
``L.Trainer(strategy="zk_zeroN", devices=2)`` on gloo, launched by Lightning itself as a user's script
would be, against Lightning's own "ddp" strategy with torch.optim.AdamW (param groups, an LR
scheduler and gradient clipping included); checkpoints written at stage 3 resume at stage 1; weights-only
checkpoints and evaluation from checkpoints. Four launches in all (the ``runs`` fixture), shared by the tests."""
import functools
import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is an optional extra: pip install 'zero_kernels[lightning]'")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "lightning_train.py")
OVERRIDDEN = "has been overridden after learning rate scheduler initialization"


def _train(tmp_path, strategy, steps, name, *extra):
    out = tmp_path / f"{name}.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCAL_RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, SCRIPT, strategy, "2", str(steps), str(out), *extra], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = torch.load(out, weights_only=False)
    res["stderr"] = r.stderr
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("lightning")
    r = {"dir": d}
    r["ddp4"] = _train(d, "ddp", 4, "ddp4", "--save", str(d / "ddp.ckpt"))
    # stage 3, 4 steps: a full checkpoint, a weights-only one, ModelCheckpoint(save_weights_only=True) every
    # step keeping step 2, then trainer.test(ckpt_path="best") on the same Trainer
    r["z3"] = _train(d, "zk_zero3", 4, "z3", "--save", str(d / "zk_ckpt"), "--save-weights", str(d / "zk_w"),
                     "--overwrite", str(d / "full_then_w"), str(d / "w_then_full"), "--best-dir", str(d / "best"))
    r["ddp8"] = _train(d, "ddp", 8, "ddp8", "--resume", str(d / "ddp.ckpt"))
    # stage 1 resumes the stage-3 checkpoint, then fresh Trainers evaluate the checkpoints and refuse to
    # resume fit from the weights-only one
    r["z1"] = _train(d, "zk_zero1", 8, "z1", "--resume", str(d / "zk_ckpt"),
                     "--evaluate", str(d / "zk_ckpt"), r["z3"]["best"])
    return r


@functools.lru_cache(maxsize=None)
def _script():
    spec = importlib.util.spec_from_file_location("lightning_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _module(state_dict=None):
    m = _script().Tiny()
    if state_dict is not None:
        m.load_state_dict(state_dict)
    return m


@torch.no_grad()
def _loss(state_dict=None):
    """The mse of the script's Tiny with these weights (its initial ones for None) over the script's data."""
    x, y = _script().data().tensors
    return torch.nn.functional.mse_loss(_module(state_dict).net(x), y).item()


def _max_diff(a, b):
    assert a["params"].keys() == b["params"].keys()
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def test_zero_strategies_match_ddp_and_checkpoints_reshard_across_stages(runs):
    ddp4, z3, ddp8, z1 = runs["ddp4"], runs["z3"], runs["ddp8"], runs["z1"]
    assert z3["global_step"] == 4
    assert _max_diff(ddp4, z3) < 1e-6                 # clipping, groups, scheduler: as DDP + AdamW
    assert (runs["dir"] / "zk_ckpt" / "lightning_state.pt").is_file()
    assert z1["global_step"] == 8 and z1["lr"] == pytest.approx(ddp8["lr"])
    assert _max_diff(ddp8, z1) < 1e-6                 # stage 3 checkpoint -> stage 1 run, exact resume
    # negative control: the resumed run moved away from the checkpointed parameters
    assert _max_diff(z3, z1) > 1e-3
    # the schedulers re-pointed at the ZeroAdamW keep torch's step tracking: no false warning
    assert OVERRIDDEN not in z3["stderr"] + z1["stderr"]


def test_weights_only_checkpoints_hold_the_full_weights_and_no_optimizer_states(runs):
    """ModelCheckpoint(save_weights_only=True) and save_checkpoint(weights_only=True) write a plain Lightning
    checkpoint with the gathered full weights (stage 3 here) and no optimizer shards (they wrote the full
    ZeroAdamW checkpoint, and a "state_dict" of nothing)."""
    d, z3 = runs["dir"], runs["z3"]
    state = torch.load(d / "zk_w" / "lightning_state.pt", weights_only=False)
    assert os.listdir(d / "zk_w") == ["lightning_state.pt"]
    assert "optimizer_states" not in state and "lr_schedulers" not in state and state["global_step"] == 4
    assert state["state_dict"].keys() == z3["params"].keys()
    assert all(torch.equal(state["state_dict"][k], v) for k, v in z3["params"].items())
    # a full save replaces a weights-only one at its path; a weights-only save never deletes a full checkpoint:
    # refused on every rank, the full checkpoint left as it was
    err = z3["overwrite"][str(d / "full_then_w")]
    assert err.startswith("ERROR") and "holds a full ZeroAdamW checkpoint" in err, err
    assert sorted(os.listdir(d / "full_then_w")) == ["LATEST", "lightning_state.pt", "v000001"]
    assert "state_dict" not in torch.load(d / "full_then_w" / "lightning_state.pt", weights_only=False)
    assert z3["overwrite"][str(d / "w_then_full")] is None
    assert sorted(os.listdir(d / "w_then_full")) == ["LATEST", "lightning_state.pt", "v000001"]
    assert "state_dict" not in torch.load(d / "w_then_full" / "lightning_state.pt", weights_only=False)
    # ModelCheckpoint: saved at every step, kept the best (step 2), removed the others it had written
    best = z3["best"]
    assert os.listdir(d / "best") == [os.path.basename(best)] and "step=2" in best
    assert os.listdir(best) == ["lightning_state.pt"]
    path = os.path.join(best, "lightning_state.pt")
    w2 = torch.load(path, weights_only=False)["state_dict"]
    assert _max_diff({"params": w2}, z3) > 1e-3      # the step-2 weights, not the final ones
    loaded = type(_module()).load_from_checkpoint(path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in w2.items())


def test_fit_refuses_a_weights_only_checkpoint_before_loading_anything(runs):
    """Resuming from a weights-only checkpoint: a ValueError naming save_weights_only and the fix, the module's
    parameters unchanged (it loaded the parameters and states, then Lightning raised a KeyError about
    schedulers)."""
    res = runs["z1"]["resume"]
    assert res["error"].startswith("ERROR ValueError") and "weights-only checkpoint" in res["error"]
    assert "save_weights_only" in res["error"] and "Nothing was loaded" in res["error"]
    assert "load_from_checkpoint" in res["error"]
    assert res["params_changed"] is False


def test_validate_test_predict_evaluate_the_checkpoint_weights(runs):
    """validate/test/predict(ckpt_path=...) evaluate the checkpoint's weights, full (written at stage 3) or
    weights-only, on a fresh Trainer (it raised IndexError: no optimizer outside fit) and after fit on the same
    Trainer (stage 3: test(ckpt_path="best"); stage 1: a Trainer whose fit was refused). Each call loads weights
    other than the module held, so an evaluation of the un-loaded weights fails."""
    z3, z1 = runs["z3"], runs["z1"]
    ev = z1["eval"]
    outcomes = {**ev, "validate_full_after": z1["resume"]["validate_full_after"], "test_best": z3["test_best"]}
    assert not [f"{k}: {v}" for k, v in outcomes.items() if isinstance(v, str)]     # errors the script recorded
    w4 = z3["params"]
    w2 = torch.load(os.path.join(z3["best"], "lightning_state.pt"), weights_only=False)["state_dict"]
    l0, l2, l4 = _loss(), _loss(w2), _loss(w4)
    assert min(abs(l0 - l2), abs(l0 - l4), abs(l2 - l4)) > 1e-4
    assert ev["validate_full"] == pytest.approx(l4, rel=1e-5), ev["validate_full"]      # initial -> step 4
    assert ev["test_weights"] == pytest.approx(l2, rel=1e-5), ev["test_weights"]        # step 4 -> step 2
    x, pred = ev["predict_full"]                                                        # step 2 -> step 4
    with torch.no_grad():
        assert torch.allclose(pred, _module(w4).net(x), atol=1e-6)
    assert z1["resume"]["validate_full_after"] == pytest.approx(l4, rel=1e-5)           # initial -> step 4
    assert z3["test_best"] == pytest.approx(l2, rel=1e-5), z3["test_best"]              # step 4 -> step 2


def test_fit_twice_on_one_trainer(runs):
    """fit() again on the same Trainer and module ([Note: one ZeroAdamW per parameter]): it used to build a second
    ZeroAdamW on a module whose first one's hooks still fired. Stage 1: the first is detached and the new one
    takes the trained parameters (max_steps is reached: nothing changes); stage 3: refused, naming the fix."""
    assert runs["z1"]["refit"] is None and not runs["z1"]["refit_changed"], runs["z1"]["refit"]
    assert runs["z3"]["refit"].startswith("ERROR ValueError: fit() again on a Trainer whose ZeroStrategy(stage=3)")
    assert not runs["z3"]["refit_changed"]


def test_registered_names_and_errors():
    import zero_kernels.integrations.lightning as zl
    from zero_kernels.integrations._translate import to_zero_optimizer
    from lightning.pytorch.strategies import StrategyRegistry
    for s in (1, 2, 3):
        assert StrategyRegistry[f"zk_zero{s}"]["init_params"] == {"stage": s}
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        zl.ZeroStrategy(stage=4)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="torch.optim.AdamW or torch.optim.Adam"):
        to_zero_optimizer(opt, torch.nn.Linear(2, 2), 2, {})
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="leaves trainable parameters out"):
        to_zero_optimizer(torch.optim.AdamW([m.weight]), m, 2, {})
    # the frameworks never multiply the loss by zopt.scale_loss: a loss_scale would divide unscaled gradients
    msg = "loss_scale='dynamic' needs the loss multiplied by the ZeroAdamW's scale_loss"
    with pytest.raises(ValueError, match=msg):
        to_zero_optimizer(torch.optim.AdamW(m.parameters()), m, 2, {"loss_scale": "dynamic"})
    with pytest.raises(ValueError, match=msg):
        zl.ZeroStrategy(stage=2, zero_kwargs={"loss_scale": "dynamic"})


def test_schedulers_follow_the_swapped_optimizer_children_included():
    """A SequentialLR / ChainedScheduler keeps child schedulers on the optimizer they were built on: all are
    re-pointed (left behind, they stepped the discarded optimizer and the new one's lr stayed frozen)."""
    from torch.optim import lr_scheduler as S
    from zero_kernels.integrations._translate import repoint_schedulers
    p = [torch.nn.Parameter(torch.zeros(2))]
    old, new = torch.optim.AdamW(p, lr=1.0), torch.optim.AdamW(p, lr=1.0)
    seq = S.SequentialLR(old, [S.LinearLR(old, 0.5, total_iters=2), S.StepLR(old, 1, 0.5)], milestones=[2])
    chain = S.ChainedScheduler([S.ConstantLR(old, 0.5, total_iters=1)], optimizer=old)
    new.param_groups[0]["initial_lr"] = old.param_groups[0]["initial_lr"]
    new.param_groups[0]["lr"] = old.param_groups[0]["lr"]
    repoint_schedulers([seq, chain], old, new)
    assert all(s.optimizer is new for s in (seq, chain, *seq._schedulers, *chain._schedulers))
    before = old.param_groups[0]["lr"]
    for _ in range(3):
        new.step()                                    # (no gradients: changes nothing) before the scheduler's
        seq.step()
    assert old.param_groups[0]["lr"] == before and new.param_groups[0]["lr"] != before


def test_repointed_schedulers_do_not_warn_that_step_was_overridden():
    """torch's LRScheduler wraps its optimizer's step() at construction and checks the wrapper at its first
    step: on the swapped-in optimizer it was missing, and every run warned once per rank."""
    from torch.optim import lr_scheduler as S
    from zero_kernels.integrations._translate import repoint_schedulers
    p = [torch.nn.Parameter(torch.zeros(2))]
    old, new = torch.optim.AdamW(p, lr=1.0), torch.optim.AdamW(p, lr=1.0)
    seq = S.SequentialLR(old, [S.LinearLR(old, 0.5, total_iters=2), S.StepLR(old, 1, 0.5)], milestones=[2])
    new.param_groups[0]["initial_lr"] = old.param_groups[0]["initial_lr"]
    repoint_schedulers([seq], old, new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            p[0].grad = torch.ones(2)
            new.step()
            seq.step()
    assert [str(w.message) for w in caught] == []
    assert p[0].detach().ne(0).all()                  # the wrapped step still steps
