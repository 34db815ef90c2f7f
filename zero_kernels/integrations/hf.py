"""Hugging Face ``Trainer`` with :class:`zero_kernels.ZeroAdamW`: ``ZeroTrainer``, a drop-in subclass.

    from zero_kernels.integrations.hf import ZeroTrainer
    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, zero_stage=3)
    trainer.train()                 # torchrun --nproc-per-node N train.py
    trainer.save_model("out")       # save_pretrained of the gathered (full) weights, loadable anywhere

Install with ``pip install 'zero_kernels[hf]'`` (transformers + accelerate).

[Note: ZeroTrainer]
What the plain Trainer would get wrong with a ZeRO optimizer, and what the subclass does instead:
- At world size > 1 the Trainer (through accelerate) wraps the model in DistributedDataParallel, which
  would all-reduce every gradient that ZeroAdamW already reduce-scatters (and, at stage 3, fight over
  the parameters' storage). ZeroTrainer prepares the model with accelerate's ``evaluation_mode`` (no DDP;
  with ``bf16=True`` forward runs under autocast, as for the plain Trainer: merely marking the model prepared
  skipped that, and bf16 runs trained in fp32, silently) and marks it prepared, accelerate's own "do not
  wrap again" flag, so the model stays unwrapped; ``trainer.model_wrapped is trainer.model``.
- The optimizer is the Trainer's own choice (``create_optimizer``: AdamW with its decay / no-decay
  groups from ``TrainingArguments``) translated into ZeroAdamW with the same groups and hyper-parameters.
- ``max_grad_norm`` clips with ``ZeroAdamW.clip_grad_norm_`` (the global norm over every shard): the
  Trainer's own ``accelerator.clip_grad_norm_(model.parameters())`` would raise ShardedGradError
  ([Note: gradient placeholders] in zero/grad_guard.py: p.grad holds no averaged gradient).
- ``save_model`` / ``save_pretrained`` write the gathered full weights (at stage 3 the module's own
  ``state_dict()`` holds freed parameters); intermediate checkpoints add ZeroAdamW's resharding
  checkpoint (``zero_optimizer/``) and ``resume_from_checkpoint`` restores parameters and states from it, as
  ``load_best_model_at_end`` does from the best checkpoint.
"""
from __future__ import annotations

import os

import torch
from transformers import Trainer

from ..zero import ZeroAdamW
from ._translate import check_no_loss_scale, to_zero_optimizer

__all__ = ["ZeroTrainer", "ZERO_CHECKPOINT_DIR"]

ZERO_CHECKPOINT_DIR = "zero_optimizer"
_SCHEDULER = "scheduler.pt"


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer is a ZeroAdamW ([Note: ZeroTrainer])."""

    def __init__(self, *args, zero_stage: int = 2, zero_kwargs: dict | None = None, **kwargs) -> None:
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage!r}")
        self.zero_stage, self.zero_kwargs = zero_stage, dict(zero_kwargs or {})
        check_no_loss_scale(self.zero_kwargs.get("loss_scale"))
        super().__init__(*args, **kwargs)
        if self.optimizer is not None and not isinstance(self.optimizer, ZeroAdamW):
            raise ValueError("ZeroTrainer builds its ZeroAdamW itself: leave optimizers=(None, scheduler) or pass "
                             "a ZeroAdamW constructed from the model")
        if self.args.save_only_model and self.args.load_best_model_at_end:    # transformers' rule for DeepSpeed, FSDP
            raise ValueError("ZeroTrainer can't be used with save_only_model=True along with load_best_model_at_end="
                             "True (as DeepSpeed and FSDP under transformers' Trainer): the best model is restored "
                             f"from the checkpoint's ZeroAdamW checkpoint ({ZERO_CHECKPOINT_DIR}/), which "
                             "save_only_model does not write. Drop one of the two options")
        # accelerate's preparation without its DDP wrap (evaluation_mode): bf16=True autocasts forward as for the
        # plain Trainer; then marked prepared (accelerate's own flag), so the Trainer's prepare never wraps it
        self.model = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        self.model._is_accelerate_prepared = True

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            base = super().create_optimizer(model)      # the Trainer's AdamW and its parameter groups
            self.optimizer = to_zero_optimizer(base, self.model, self.zero_stage, self.zero_kwargs)
        return self.optimizer

    @property
    def zero_optimizer(self) -> ZeroAdamW:
        opt = getattr(self.optimizer, "optimizer", self.optimizer)   # accelerate's AcceleratedOptimizer
        if not isinstance(opt, ZeroAdamW):
            raise RuntimeError("the ZeroAdamW does not exist yet: it is built when training starts")
        return opt

    def _clip_grad_norm(self, model):
        return self.zero_optimizer.clip_grad_norm_(float(self.args.max_grad_norm))

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.zero_optimizer.clip_grad_norm_(float("inf"))   # the norm, nothing clipped
        return super()._get_grad_norm(model, grad_norm)

    # -- saving: the gathered weights, and ZeroAdamW's own checkpoint for resuming ---------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not isinstance(getattr(self.optimizer, "optimizer", self.optimizer), ZeroAdamW):
            return super().save_model(output_dir, _internal_call)     # not trained yet: the module is whole
        output_dir = output_dir or self.args.output_dir
        full = self.zero_optimizer.full_model_state_dict()             # collective: every rank
        if self.args.should_save:
            self._save(output_dir, state_dict=full)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.zero_optimizer.save_checkpoint(os.path.join(output_dir, ZERO_CHECKPOINT_DIR))   # collective
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_CHECKPOINT_DIR)):
            weights = [f for f in ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json")
                       if os.path.exists(os.path.join(resume_from_checkpoint, f))]
            why = (f"it holds only the model weights ({weights[0]}): written with save_only_model=True, which cannot "
                   "resume training (no optimizer states); load the weights into a new model with from_pretrained "
                   "and train from there, or save without save_only_model" if weights else
                   "not a checkpoint written by ZeroTrainer")
            raise FileNotFoundError(f"{resume_from_checkpoint} has no {ZERO_CHECKPOINT_DIR}/: {why}")
        # the parameters are restored with the optimizer states, in _load_optimizer_and_scheduler

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's ZeroAdamW checkpoint (parameters with their optimizer
        states, as DeepSpeed's engine loads its own); the Trainer's loads a state dict into the module, which at
        stage 3 holds freed parameters."""
        self.zero_optimizer.load_checkpoint(os.path.join(self.state.best_model_checkpoint, ZERO_CHECKPOINT_DIR))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return
        self.zero_optimizer.load_checkpoint(os.path.join(checkpoint, ZERO_CHECKPOINT_DIR))
        sched = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
