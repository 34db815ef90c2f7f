"""Trains a tiny LightningModule the way a user would (the Trainer launches its own processes), then
rank 0 saves the full parameters. Run by tests/test_lightning.py:

    python lightning_train.py STRATEGY DEVICES STEPS OUT [--save CKPT] [--resume CKPT]
"""
import argparse
import os

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
import zero_kernels.integrations.lightning  # noqa: F401  (registers zk_zero1/2/3)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # PYTHONSAFEPATH drops it
from _clean_exit import exit_cleanly  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 5))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if n.endswith("bias")]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=3e-2, betas=(0.9, 0.95))
        # a SequentialLR (warm-up, then steps): its children must follow the optimizer the strategy swaps in
        S = torch.optim.lr_scheduler
        sched = S.SequentialLR(opt, [S.LinearLR(opt, 0.5, total_iters=2), S.StepLR(opt, step_size=3, gamma=0.5)],
                               milestones=[2])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("strategy")
    ap.add_argument("devices", type=int)
    ap.add_argument("steps", type=int)
    ap.add_argument("out")
    ap.add_argument("--save")
    ap.add_argument("--resume")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 13, generator=g), torch.randn(32, 5, generator=g))
    module = Tiny()
    trainer = L.Trainer(strategy=a.strategy, accelerator="cpu", devices=a.devices, max_steps=a.steps,
                        gradient_clip_val=0.05, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=4, shuffle=False), ckpt_path=a.resume)
    if a.save:
        trainer.save_checkpoint(a.save)
    if a.strategy.startswith("zk_"):
        full = trainer.strategy.optimizers[0].full_model_state_dict()     # collective
    else:
        full = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save({"params": full, "global_step": trainer.global_step,
                    "lr": trainer.strategy.optimizers[0].param_groups[0]["lr"]}, a.out)
    exit_cleanly()


if __name__ == "__main__":
    main()
