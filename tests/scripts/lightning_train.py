"""Trains a tiny LightningModule the way a user would (the Trainer launches its own processes), then
rank 0 saves the full parameters. Run by tests/test_lightning.py:

    python lightning_train.py STRATEGY DEVICES STEPS OUT [--save CKPT] [--resume CKPT]
                              [--save-weights CKPT] [--overwrite A B] [--best-dir DIR]
                              [--evaluate FULL WEIGHTS]

--save-weights: after fit, trainer.save_checkpoint(CKPT, weights_only=True).
--overwrite A B: after fit, a weights-only save over a full one at A (refused), a full save over a weights-only
  one at B (replaces it).
--best-dir: fit with ModelCheckpoint(DIR, save_weights_only=True) saving every step, best = step 2, then
    trainer.test(ckpt_path="best") on the same Trainer: OUT["test_best"].
--evaluate: after the rest, on fresh Trainers (new modules) with STRATEGY: validate(ckpt_path=FULL),
    test(ckpt_path=WEIGHTS), predict(ckpt_path=FULL) (OUT["eval"]), then fit(ckpt_path=WEIGHTS) (OUT["resume"]:
    its error, and whether the module's parameters changed) and validate(ckpt_path=FULL) on that Trainer.
    Each call's error is recorded instead of raised.
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


def data():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(32, 13, generator=g), torch.randn(32, 5, generator=g))


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(13, 37), nn.GELU(), nn.Linear(37, 5))

    def training_step(self, batch, _):
        x, y = batch
        self.log("best_at_2", float((self.global_step + 1 - 2) ** 2), on_step=True)   # ModelCheckpoint's monitor
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, _):     # equal batches on every rank: the logged mean is the data's mse
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def test_step(self, batch, _):
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch, _):
        return batch[0], self.net(batch[0])

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


def _trainer(strategy, devices, steps, callbacks=()):
    return L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps,
                     gradient_clip_val=0.05, logger=False, enable_checkpointing=bool(callbacks),
                     callbacks=list(callbacks), enable_progress_bar=False, enable_model_summary=False)


def _loader():
    return DataLoader(data(), batch_size=4, shuffle=False)


def _attempt(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        return f"ERROR {type(e).__name__}: {e}"


def _params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def evaluate(a):
    """[Note: evaluating a checkpoint] in zero_kernels/integrations/lightning.py, on fresh Trainers."""
    full, weights = a.evaluate
    ev, m = {}, Tiny()
    t = _trainer(a.strategy, a.devices, 1)
    ev["validate_full"] = _attempt(lambda: t.validate(m, _loader(), ckpt_path=full, verbose=False)[0]["val_loss"])
    ev["test_weights"] = _attempt(lambda: t.test(m, _loader(), ckpt_path=weights, verbose=False)[0]["test_loss"])
    out = _attempt(lambda: t.predict(m, _loader(), ckpt_path=full))
    ev["predict_full"] = out if isinstance(out, str) else tuple(torch.cat(z) for z in zip(*out))
    m2 = Tiny()
    before = _params(m2)
    t2 = _trainer(a.strategy, a.devices, 1)
    err = _attempt(lambda: t2.fit(m2, _loader(), ckpt_path=weights))
    changed = any(not torch.equal(before[k], v) for k, v in _params(m2).items())
    # the module stays the (never stepped) ZeroAdamW's: an evaluation on that Trainer loads into it
    after = _attempt(lambda: t2.validate(m2, _loader(), ckpt_path=full, verbose=False)[0]["val_loss"])
    return ev, {"error": err, "params_changed": changed, "validate_full_after": after}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("strategy")
    ap.add_argument("devices", type=int)
    ap.add_argument("steps", type=int)
    ap.add_argument("out")
    ap.add_argument("--save")
    ap.add_argument("--resume")
    ap.add_argument("--save-weights")
    ap.add_argument("--overwrite", nargs=2, metavar=("A", "B"))
    ap.add_argument("--best-dir")
    ap.add_argument("--evaluate", nargs=2, metavar=("FULL", "WEIGHTS"))
    a = ap.parse_args()
    module = Tiny()
    callbacks = []
    if a.best_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=a.best_dir, save_weights_only=True, every_n_train_steps=1, monitor="best_at_2", mode="min"))
    trainer = _trainer(a.strategy, a.devices, a.steps, callbacks)
    trainer.fit(module, _loader(), ckpt_path=a.resume)
    if a.save:
        trainer.save_checkpoint(a.save)
    if a.save_weights:
        trainer.save_checkpoint(a.save_weights, weights_only=True)
    over = {}
    if a.overwrite:
        for path, first in zip(a.overwrite, (False, True)):
            trainer.save_checkpoint(path, weights_only=first)
            over[path] = _attempt(lambda: trainer.save_checkpoint(path, weights_only=not first))
    if a.strategy.startswith("zk_"):
        full = trainer.strategy.optimizers[0].full_model_state_dict()     # collective
    else:
        full = {k: v.detach().clone() for k, v in module.state_dict().items()}
    res = {"params": full, "global_step": trainer.global_step, "overwrite": over,
           "lr": trainer.strategy.optimizers[0].param_groups[0]["lr"]}
    if a.best_dir:
        res["best"] = trainer.checkpoint_callback.best_model_path
        res["test_best"] = _attempt(lambda: trainer.test(ckpt_path="best", dataloaders=_loader(),
                                                         verbose=False)[0]["test_loss"])
    if a.evaluate:
        res["eval"], res["resume"] = evaluate(a)
    if a.strategy.startswith("zk_"):        # fit() again on the same Trainer and module (max_steps is reached)
        full_now = lambda: trainer.strategy.optimizers[0].full_model_state_dict()  # noqa: E731 (collective)
        before = full_now()
        res["refit"] = _attempt(lambda: trainer.fit(module, _loader()))
        res["refit_changed"] = any(not torch.equal(before[k], v) for k, v in full_now().items())
    if trainer.global_rank == 0:
        torch.save(res, a.out)
    exit_cleanly()


if __name__ == "__main__":
    main()
