"""Lightning strategies (zero_kernels.integrations.lightning): a tiny LightningModule trained by
``L.Trainer(strategy="zk_zeroN", devices=2)`` on gloo, launched by Lightning itself as a user's script
would be, against Lightning's own "ddp" strategy with torch.optim.AdamW (param groups, an LR
scheduler and gradient clipping included); checkpoints written at stage 3 resume at stage 1."""
import os
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning", reason="Lightning is an optional extra: pip install 'zero_kernels[lightning]'")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "lightning_train.py")


def _train(tmp_path, strategy, steps, name, *extra):
    out = tmp_path / f"{name}.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCAL_RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, SCRIPT, strategy, "2", str(steps), str(out), *extra], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out, weights_only=False)


def _max_diff(a, b):
    assert a["params"].keys() == b["params"].keys()
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def test_zero_strategies_match_ddp_and_checkpoints_reshard_across_stages(tmp_path):
    ddp4 = _train(tmp_path, "ddp", 4, "ddp4", "--save", str(tmp_path / "ddp.ckpt"))
    z3 = _train(tmp_path, "zk_zero3", 4, "z3", "--save", str(tmp_path / "zk_ckpt"))
    assert z3["global_step"] == 4
    assert _max_diff(ddp4, z3) < 1e-6                 # clipping, groups, scheduler: as DDP + AdamW
    assert (tmp_path / "zk_ckpt" / "lightning_state.pt").is_file()
    ddp8 = _train(tmp_path, "ddp", 8, "ddp8", "--resume", str(tmp_path / "ddp.ckpt"))
    z1 = _train(tmp_path, "zk_zero1", 8, "z1", "--resume", str(tmp_path / "zk_ckpt"))
    assert z1["global_step"] == 8 and z1["lr"] == pytest.approx(ddp8["lr"])
    assert _max_diff(ddp8, z1) < 1e-6                 # stage 3 checkpoint -> stage 1 run, exact resume
    # negative control: the resumed run moved away from the checkpointed parameters
    assert _max_diff(z3, z1) > 1e-3


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
        seq.step()
    assert old.param_groups[0]["lr"] == before and new.param_groups[0]["lr"] != before
