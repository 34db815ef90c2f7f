"""A Hugging Face training script as a user writes it, run under torchrun by tests/test_hf.py:

    torchrun --nproc-per-node 2 hf_train.py MODE STEPS OUT_DIR [--resume CKPT] [--twice]

MODE: "ddp" (the plain Trainer with torch AdamW, wrapped in DDP by accelerate) or "zero2"/"zero3"
(ZeroTrainer). A tiny GPT-2 (tied embeddings) from a config; random token data; rank 0 saves the final
weights with save_model (save_pretrained) into OUT_DIR/final. --twice: trainer.train() a second time.
"""
import argparse
import os

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from zero_kernels.integrations.hf import ZeroTrainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH drops it
from _clean_exit import exit_cleanly  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randint(0, 97, (48, 16), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["ddp", "zero2", "zero3"])
    ap.add_argument("steps", type=int)
    ap.add_argument("out")
    ap.add_argument("--resume")
    ap.add_argument("--twice", action="store_true", help="train() a second time on the same Trainer")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=2, learning_rate=1e-2,
                             weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="linear", warmup_steps=1,
                             save_strategy="steps", save_steps=3, report_to=[], use_cpu=True, seed=0,
                             data_seed=0, logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    if a.mode == "ddp":
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
    else:
        trainer = ZeroTrainer(model=model, args=args, train_dataset=Tokens(), zero_stage=int(a.mode[-1]))
    trainer.train(resume_from_checkpoint=a.resume)
    first_log = list(trainer.state.log_history)
    if a.twice:     # a notebook's second trainer.train(): the same optimizer (and states), a new schedule
        trainer.train()
    trainer.save_model(os.path.join(a.out, "final"))
    if trainer.args.should_save:
        wrapped = type(trainer.model_wrapped).__name__
        torch.save({"wrapped": wrapped, "log": trainer.state.log_history, "first_log": first_log},
                   os.path.join(a.out, "info.pt"))
    exit_cleanly()


if __name__ == "__main__":
    main()
