"""PyTorch Lightning strategies that train with :class:`zero_kernels.ZeroAdamW`.

    import lightning as L
    import zero_kernels.integrations.lightning   # registers "zk_zero1", "zk_zero2", "zk_zero3"

    trainer = L.Trainer(strategy="zk_zero2", accelerator="cpu", devices=2, gradient_clip_val=1.0)
    trainer.fit(module)            # configure_optimizers may return torch.optim.AdamW/Adam (+ schedulers)

or ``strategy=ZeroStrategy(stage=3, zero_kwargs={"param_dtype": torch.bfloat16})`` for more options.
Install with ``pip install 'zero_kernels[lightning]'``.

[Note: the Lightning strategy]
As Lightning's ``deepspeed_stage_2`` and ``fsdp`` strategies do, the strategy owns what DDP would do:
- processes and the process group come from Lightning's DDP machinery (launcher, cluster environment,
  distributed sampler), but the module is **not** wrapped in DistributedDataParallel: ZeroAdamW
  reduces the gradients itself (a DDP wrapper would reduce them twice).
- ``configure_optimizers`` is called as usual; its Adam/AdamW optimizer is translated into a
  ZeroAdamW with the same parameter groups and hyper-parameters (lr, betas, eps, weight_decay,
  amsgrad, maximize) and its LR schedulers are re-pointed at the ZeroAdamW, keeping their state.
- Gradient clipping (``gradient_clip_val``) goes through ``ZeroAdamW.clip_grad_norm_`` (the global
  norm over every shard) via :class:`ZeroPrecision`; torch's ``clip_grad_norm_`` on the module's
  parameters raises ShardedGradError ([Note: gradient placeholders] in zero/grad_guard.py).
- Checkpoints go through ZeroAdamW's own resharding checkpoints: ``trainer.save_checkpoint(path)``
  writes a checkpoint directory at ``path`` (one shard per rank) plus ``lightning_state.pt`` (the
  trainer's own state: loops, callbacks, schedulers); ``ckpt_path=`` restores both, at any world size.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Mapping

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from ..zero import ZeroAdamW
from ._translate import check_no_loss_scale, repoint_schedulers, to_zero_optimizer

__all__ = ["ZeroStrategy", "ZeroPrecision", "LIGHTNING_STATE"]

LIGHTNING_STATE = "lightning_state.pt"
_EXCLUDED = ("state_dict", "optimizer_states")   # saved by ZeroAdamW's checkpoint instead


class ZeroPrecision(Precision):
    """Full-precision plugin whose gradient clipping uses the ZeRO optimizer's global norm."""

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        _zero_optimizer(optimizer).clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        raise ValueError("gradient_clip_algorithm='value' is not supported by the zk strategies (gradients are "
                         "sharded across ranks; torch's clip_grad_value_ on p.grad raises ShardedGradError): use "
                         "gradient_clip_algorithm='norm', which calls zopt.clip_grad_norm_(max_norm)")


def _zero_optimizer(optimizer):
    opt = getattr(optimizer, "_optimizer", optimizer)   # LightningOptimizer wraps it
    if not isinstance(opt, ZeroAdamW):
        raise TypeError(f"expected the ZeroAdamW built by ZeroStrategy, got {type(opt).__name__}")
    return opt


class ZeroStrategy(DDPStrategy):
    """Lightning strategy for ZeRO stage 1, 2 or 3 with :class:`ZeroAdamW` ([Note: the Lightning strategy])."""

    strategy_name = "zk_zero"

    def __init__(self, stage: int = 2, zero_kwargs: dict[str, Any] | None = None, **ddp_kwargs: Any) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        ddp_kwargs.setdefault("precision_plugin", ZeroPrecision())
        super().__init__(**ddp_kwargs)
        self.stage = stage
        self.zero_kwargs = dict(zero_kwargs or {})
        check_no_loss_scale(self.zero_kwargs.get("loss_scale"))

    # -- the module is not wrapped: ZeroAdamW reduces gradients itself ---------------------------------
    def _setup_model(self, model):
        return model

    def setup(self, trainer) -> None:
        if type(self.precision_plugin) is Precision:        # the default "32-true": clipping through ZeRO
            self.precision_plugin = ZeroPrecision()
        if not isinstance(self.precision_plugin, ZeroPrecision):
            raise ValueError(f"the zk strategies run in full precision (precision='32-true'); got "
                             f"{type(self.precision_plugin).__name__}: for bf16 parameters pass "
                             "ZeroStrategy(zero_kwargs={'param_dtype': torch.bfloat16}) instead")
        super().setup(trainer)

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"the zk strategies take exactly one optimizer from configure_optimizers, "
                             f"got {len(self.optimizers)}")
        old = self.optimizers[0]
        zopt = to_zero_optimizer(old, self.lightning_module, self.stage, self.zero_kwargs)
        repoint_schedulers([cfg.scheduler for cfg in self.lr_scheduler_configs], old, zopt)
        self.optimizers = [zopt]

    # -- checkpoints: ZeroAdamW's resharding checkpoint + Lightning's own state ------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True          # the ZeroAdamW must exist before its checkpoint is read

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False         # restored with the parameters in load_checkpoint

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}            # the parameters are in the ZeroAdamW checkpoint (sharded at stage 3)

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("the zk strategies write their own checkpoint format: storage_options is not supported")
        path = self.broadcast(str(filepath))
        _zero_optimizer(self.optimizers[0]).save_checkpoint(path)       # collective, verified, atomic
        if self.is_global_zero:
            state = {k: v for k, v in checkpoint.items() if k not in _EXCLUDED}
            tmp = os.path.join(path, LIGHTNING_STATE + ".tmp")
            torch.save(state, tmp)
            os.replace(tmp, os.path.join(path, LIGHTNING_STATE))
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        state_file = os.path.join(path, LIGHTNING_STATE)
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"{path} is not a checkpoint written by a zk strategy (no {LIGHTNING_STATE})")
        _zero_optimizer(self.optimizers[0]).load_checkpoint(path)
        return torch.load(state_file, map_location="cpu", weights_only=False)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass                 # done by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass                 # done by load_checkpoint

    def remove_checkpoint(self, filepath) -> None:
        """Removes a checkpoint this strategy wrote (ModelCheckpoint's save_top_k), nothing else."""
        if self.is_global_zero and os.path.isfile(os.path.join(str(filepath), LIGHTNING_STATE)):
            shutil.rmtree(str(filepath))

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for stage in (1, 2, 3):
            strategy_registry.register(f"zk_zero{stage}", cls, description=f"zero_kernels ZeRO stage {stage}",
                                       override=True, stage=stage)


ZeroStrategy.register_strategies(StrategyRegistry)
