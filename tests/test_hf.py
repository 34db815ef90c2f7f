"""Hugging Face Trainer integration (zero_kernels.integrations.hf.ZeroTrainer): a tiny GPT-2 from a config
trained under torchrun on 2 gloo processes, against the plain Trainer (torch AdamW, DDP by accelerate);
save_model writes full weights at stage 3 that GPT2LMHeadModel.from_pretrained loads; resuming from an
intermediate checkpoint reproduces the uninterrupted run."""
import dataclasses
import os
import shutil
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


def test_train_twice_on_one_zero_trainer_matches_the_plain_trainer(tmp_path):
    """A second trainer.train() on the same ZeroTrainer (a notebook cell run again) reuses its ZeroAdamW, states
    included, with a fresh schedule, as the plain Trainer reuses its AdamW: the same losses and final weights."""
    ddp, ddp_info = _run(tmp_path, "ddp", 3, "ddp", "--twice")
    z2, z2_info = _run(tmp_path, "zero2", 3, "z2", "--twice")
    def losses(info, key):
        return [e["loss"] for e in info[key] if "loss" in e]
    for key in ("first_log", "log"):
        want = losses(ddp_info, key)
        assert len(want) == 3 and losses(z2_info, key) == pytest.approx(want, rel=1e-5)
    assert _max_diff(ddp, z2) < 2e-5
    # the second run went on from the first one's weights (a restart would repeat its first loss)
    assert losses(z2_info, "log")[0] < losses(z2_info, "first_log")[0] - 0.05


def test_zero_trainer_refuses_a_loss_scale():
    """Trainer never multiplies the loss by zopt.scale_loss: a ZeroAdamW loss_scale would divide gradients that
    were never scaled (grad norms 65536x small, clipping and the update off). Refused at construction."""
    from zero_kernels.integrations.hf import ZeroTrainer
    with pytest.raises(ValueError, match="loss_scale='dynamic' needs the loss multiplied"):
        ZeroTrainer(zero_kwargs={"loss_scale": "dynamic"})


def _one_layer_gpt2():
    """(a one-layer GPT-2 from seed 0, a Dataset class of 24 random 16-token rows) for the in-process runs."""
    class Tokens(torch.utils.data.Dataset):
        x = torch.randint(0, 97, (24, 16), generator=torch.Generator().manual_seed(3))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)), Tokens


def _bf16_losses(rank, world, mode, out):
    """One rank: 3 steps of a one-layer GPT-2 with TrainingArguments(bf16=True); the dtypes c_attn produced and
    the logged losses, saved to ``out``."""
    from transformers import Trainer, TrainingArguments
    from zero_kernels.integrations.hf import ZeroTrainer

    model, Tokens = _one_layer_gpt2()
    seen = set()
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, i, o: seen.add(o.dtype))
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(out), mode), max_steps=3, bf16=True,
                             per_device_train_batch_size=2, learning_rate=1e-2, report_to=[], use_cpu=True, seed=0,
                             logging_steps=1, disable_tqdm=True, save_strategy="no")
    trainer = (Trainer(model=model, args=args, train_dataset=Tokens()) if mode == "plain" else
               ZeroTrainer(model=model, args=args, train_dataset=Tokens(), zero_stage=2))
    trainer.train()
    torch.save({"dtypes": seen, "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}, out)


def test_zero_trainer_autocasts_under_bf16(tmp_path):
    """TrainingArguments(bf16=True): forward runs under bf16 autocast as for the plain Trainer, and the losses are
    the plain Trainer's. Before, ZeroTrainer marked the model prepared, accelerate skipped its autocast wrap and
    the run trained in fp32 without a word."""
    from _dist import run_world
    res = {}
    for mode in ("plain", "zero"):
        run_world(_bf16_losses, 1, mode, str(tmp_path / f"{mode}.pt"))
        res[mode] = torch.load(tmp_path / f"{mode}.pt", weights_only=False)
    assert res["plain"]["dtypes"] == {torch.bfloat16}                     # the control: bf16 reaches c_attn
    assert res["zero"]["dtypes"] == {torch.bfloat16}
    assert len(res["zero"]["losses"]) == 3 and res["zero"]["losses"] == pytest.approx(res["plain"]["losses"], abs=1e-6)


def _best_model(rank, world, out):
    """One rank, stage 3: evaluation and a checkpoint after every step, load_best_model_at_end with the HIGHEST
    eval loss as the best (the first checkpoint, not the last); saves the final full weights and each
    checkpoint's."""
    from safetensors.torch import load_file
    from transformers import TrainingArguments
    from zero_kernels.integrations.hf import ZeroTrainer

    model, Tokens = _one_layer_gpt2()
    d = os.path.dirname(out)
    args = TrainingArguments(output_dir=d, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                             report_to=[], use_cpu=True, seed=0, disable_tqdm=True, eval_strategy="steps",
                             eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                             metric_for_best_model="eval_loss", greater_is_better=True)
    # save_only_model + load_best_model_at_end: refused at construction (was a CheckpointError after the whole run)
    with pytest.raises(ValueError, match="save_only_model=True along with load_best_model_at_end"):
        ZeroTrainer(model=model, args=dataclasses.replace(args, save_only_model=True), train_dataset=Tokens(),
                    eval_dataset=Tokens(), zero_stage=3)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(), zero_stage=3)
    trainer.train()
    full = trainer.zero_optimizer.full_model_state_dict()
    ck = {c: load_file(os.path.join(d, f"checkpoint-{c}", "model.safetensors")) for c in (1, 3)}
    # a weights-only checkpoint (what save_only_model writes) cannot resume: the error says so
    weights_only = os.path.join(d, "weights-only")
    shutil.copytree(os.path.join(d, "checkpoint-1"), weights_only, ignore=shutil.ignore_patterns("zero_optimizer"))
    with pytest.raises(FileNotFoundError, match="written with save_only_model=True, which cannot resume"):
        ZeroTrainer(model=_one_layer_gpt2()[0], args=dataclasses.replace(args, load_best_model_at_end=False),
                    train_dataset=Tokens(), eval_dataset=Tokens(), zero_stage=3).train(resume_from_checkpoint=weights_only)
    torch.save({"best": trainer.state.best_model_checkpoint, "final": full, "ck": ck}, out)


def test_zero_trainer_loads_the_best_model_at_end_at_stage_3(tmp_path):
    """load_best_model_at_end at stage 3 restores the best checkpoint from its ZeroAdamW checkpoint. Before, the
    Trainer loaded a state dict into the module's freed (empty) parameters and failed after the whole run."""
    from _dist import run_world
    run_world(_best_model, 1, str(tmp_path / "best.pt"))
    r = torch.load(tmp_path / "best.pt", weights_only=False)
    assert r["best"].endswith("checkpoint-1")
    saved = r["ck"][1]
    for k, v in saved.items():
        assert torch.equal(r["final"][k], v), k
    assert any(not torch.equal(r["ck"][3][k], v) for k, v in saved.items())   # the last checkpoint differs
