"""Hugging Face Trainer integration (zero_kernels.integrations.hf.ZeroTrainer): a tiny GPT-2 from a config
trained under torchrun on 2 gloo processes, against the plain Trainer (torch AdamW, DDP by accelerate);
save_model writes full weights at stage 3 that GPT2LMHeadModel.from_pretrained loads; resuming from an
intermediate checkpoint reproduces the uninterrupted run."""
import os
import socket
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="optional extra: pip install 'zero_kernels[hf]'")
pytest.importorskip("accelerate", reason="optional extra: pip install 'zero_kernels[hf]'")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "hf_train.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, mode, steps, name, *extra):
    out = tmp_path / name
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(_port()), SCRIPT, mode, str(steps),
                        str(out), *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    model = transformers.GPT2LMHeadModel.from_pretrained(str(out / "final"))
    return model.state_dict(), torch.load(out / "info.pt", weights_only=False)


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_zero_trainer_matches_ddp_trainer_and_resumes(tmp_path):
    ddp, ddp_info = _run(tmp_path, "ddp", 6, "ddp")
    z3, z3_info = _run(tmp_path, "zero3", 6, "z3")
    assert ddp_info["wrapped"] == "DistributedDataParallel"
    assert z3_info["wrapped"] == "GPT2LMHeadModel"             # never wrapped in DDP (no double reduction)
    # weights from save_pretrained at stage 3 are whole, and match the DDP run (clipping, groups, schedule)
    assert all(v.numel() > 0 for v in z3.values())
    assert _max_diff(ddp, z3) < 2e-5
    norms = [e["grad_norm"] for e in z3_info["log"] if "grad_norm" in e]
    ddp_norms = [e["grad_norm"] for e in ddp_info["log"] if "grad_norm" in e]
    assert norms == pytest.approx(ddp_norms, rel=1e-4) and max(norms) > 0.5   # clipping was active (0.5)
    # resume from the step-3 checkpoint of the stage-3 run, at stage 2
    z2r, _ = _run(tmp_path, "zero2", 6, "z2r", "--resume", str(tmp_path / "z3" / "checkpoint-3"))
    assert _max_diff(z3, z2r) < 2e-5
    # negative control: the step-3 weights differ from the final ones
    ck = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "z3" / "checkpoint-3")).state_dict()
    assert _max_diff(ck, z3) > 1e-3


def test_zero_trainer_refuses_a_loss_scale():
    """Trainer never multiplies the loss by zopt.scale_loss: a ZeroAdamW loss_scale would divide gradients that
    were never scaled (grad norms 65536x small, clipping and the update off). Refused at construction."""
    from zero_kernels.integrations.hf import ZeroTrainer
    with pytest.raises(ValueError, match="loss_scale='dynamic' needs the loss multiplied"):
        ZeroTrainer(zero_kwargs={"loss_scale": "dynamic"})
