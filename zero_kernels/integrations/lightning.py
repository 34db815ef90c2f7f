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
  trainer's own state: loops, callbacks, schedulers); ``fit(ckpt_path=)`` restores both, at any world
  size. [Note: weights-only checkpoints] and [Note: evaluating a checkpoint] below.

[Note: weights-only checkpoints]
``ModelCheckpoint(save_weights_only=True)`` and ``trainer.save_checkpoint(path, weights_only=True)``
(Lightning's dumped checkpoint then has no "optimizer_states") write no optimizer shards: ``path`` is a
directory holding only ``lightning_state.pt``, a plain Lightning checkpoint whose "state_dict" is the
gathered full model (``zopt.full_model_state_dict()``: fp32 masters, a collective) and which has no
optimizer or scheduler states: ``torch.load(f"{path}/lightning_state.pt")["state_dict"]`` or
``MyModule.load_from_checkpoint(f"{path}/lightning_state.pt")`` load it without zero_kernels. Outside fit on a
fresh Trainer (no ZeroAdamW exists) every save is of this kind, with the module's own weights. A full save
replaces a weights-only checkpoint at its path; a weights-only save at a full checkpoint's path is refused
(it would delete optimizer states).
``fit(ckpt_path=)`` refuses such a checkpoint (ValueError naming save_weights_only and the fix) before
anything is loaded: resuming needs the optimizer states. validate/test/predict evaluate its weights.

[Note: evaluating a checkpoint]
``trainer.validate/test/predict(model, ckpt_path=...)`` load the checkpoint's weights into the module
and nothing else (as DeepSpeed's strategy does outside fit): a weights-only checkpoint's "state_dict", or
a full checkpoint's fp32 masters read shard by shard from its ZeroAdamW checkpoint by every rank, with
no process group (as ``python -m zero_kernels.checkpoint consolidate`` does, without the Adam states).
Lightning builds no optimizer outside fit, so on a fresh Trainer the module stays unsharded: every rank
holds and evaluates the full model, as under Lightning's DDP. After fit on the same Trainer (``test(ckpt_path=
"best")``) the module is still the ZeroAdamW's: the weights are written inside ``zopt.gathered()`` and
adopted into its masters (stage 3: into each rank's shard), its Adam states untouched.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Mapping

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from .. import checkpoint_format, checkpoint_tools
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
        # fit() again on this Trainer: the previous fit's ZeroAdamW still manages the module ([Note: one
        # ZeroAdamW per parameter] in zero/ownership.py). Stages 1-2: detached, its parameters (trained) go to
        # the new one, with fresh optimizer states as DDP's re-fit has; stage 3 left them sharded: refused.
        prev = self._module_optimizer()
        if prev is not None and prev.stage == 3:
            raise ValueError("fit() again on a Trainer whose ZeroStrategy(stage=3) sharded this module in an earlier "
                             "fit: its parameters live in that fit's ZeroAdamW shards. Save a checkpoint "
                             "(trainer.save_checkpoint) and fit a new Trainer and module with ckpt_path=, or use "
                             "stage 1 or 2")
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"the zk strategies take exactly one optimizer from configure_optimizers, "
                             f"got {len(self.optimizers)}")
        if prev is not None:
            prev.remove_hooks()
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

    def _module_optimizer(self) -> ZeroAdamW | None:
        """The ZeroAdamW that owns the module now attached: built by setup_optimizers in fit (and kept
        after it); None on a fresh Trainer outside fit, where Lightning builds no optimizer."""
        for opt in self.optimizers:
            opt = getattr(opt, "_optimizer", opt)
            if isinstance(opt, ZeroAdamW) and opt.module is self.lightning_module:
                return opt
        return None

    def _on_rank_zero(self, what: str, write) -> None:
        """``write()`` on rank 0 only; its failure raised on every rank (the others would wait for it)."""
        err = None
        if self.is_global_zero:
            try:
                write()
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                err = f"{type(e).__name__}: {e}"
        err = self.broadcast(err)
        if err is not None:
            raise RuntimeError(f"{what} failed on rank 0: {err}")

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("the zk strategies write their own checkpoint format: storage_options is not supported")
        path = self.broadcast(str(filepath))
        zopt = self._module_optimizer()
        if zopt is None or "optimizer_states" not in checkpoint:
            return self._save_weights_only(checkpoint, path, zopt)
        self._on_rank_zero(f"save_checkpoint({path!r})", lambda: _drop_weights_only(path))
        zopt.save_checkpoint(path)       # collective, verified, atomic
        state = {k: v for k, v in checkpoint.items() if k not in _EXCLUDED}
        self._on_rank_zero(f"save_checkpoint({path!r})", lambda: _write_state(path, state))

    def _save_weights_only(self, checkpoint: dict[str, Any], path: str, zopt: ZeroAdamW | None) -> None:
        """[Note: weights-only checkpoints]."""
        if zopt is not None:
            weights = zopt.full_model_state_dict()          # collective: every rank
        else:
            weights = self.lightning_module.state_dict()    # no ZeroAdamW: the module holds its full weights

        def write():
            _check_target(path)
            state = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
            state["state_dict"] = _to_cpu(weights)
            os.makedirs(path, exist_ok=True)
            _write_state(path, state)
        self._on_rank_zero(f"save_checkpoint({path!r}, weights_only=True)", write)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        state_file = os.path.join(path, LIGHTNING_STATE)
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"{path} is not a checkpoint written by a zk strategy (no {LIGHTNING_STATE})")
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            # [Note: evaluating a checkpoint]: the weights only, put into the module by load_model_state_dict
            if "state_dict" not in state:
                state["state_dict"] = checkpoint_tools.model_weights(path)
            return state
        # weights-only: a "state_dict" (or, saved by versions before it was kept there, no scheduler states)
        if "state_dict" in state or "lr_schedulers" not in state:
            raise ValueError(_no_resume(path, state_file, type(self.lightning_module).__name__,
                                        legacy="state_dict" not in state))
        _zero_optimizer(self.optimizers[0]).load_checkpoint(path)     # parameters and Adam states
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        weights = checkpoint.get("state_dict")
        if not weights:
            return           # fit: loaded with the optimizer states by load_checkpoint
        module, zopt = self.lightning_module, self._module_optimizer()
        if zopt is None:
            module.load_state_dict(weights, strict=strict)
            return
        with zopt.gathered():                    # stage 3: the full parameters, written back into the shards
            module.load_state_dict(weights, strict=strict)
        zopt.refresh_fp32_params()               # stages 1-2: the masters follow the loaded parameters

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


def _no_resume(path: str, state_file: str, module_cls: str, legacy: bool) -> str:
    load = (f"{module_cls}.load_from_checkpoint({state_file!r}) (or module.load_state_dict(torch.load({state_file!r})"
            "['state_dict']))") if not legacy else \
        (f"`python -m zero_kernels.checkpoint consolidate {path} full.pt`, then module.load_state_dict("
         "torch.load('full.pt')['model'])")
    return (f"fit(ckpt_path={path!r}): this is a weights-only checkpoint (ModelCheckpoint(save_weights_only=True), "
            "trainer.save_checkpoint(..., weights_only=True), or a save outside fit): it holds the model's weights but "
            "no optimizer, LR-scheduler or callback states, so training cannot resume from it. Nothing was loaded. "
            "Resume from a full checkpoint (ModelCheckpoint with save_weights_only=False, the default), or start a new "
            f"fit from these weights: {load}, then trainer.fit(module) without ckpt_path. "
            "validate/test/predict(ckpt_path=...) evaluate it as it is")


def _to_cpu(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights on the CPU (loadable without a GPU), tied names still sharing one tensor."""
    done: dict[int, torch.Tensor] = {}
    for v in weights.values():
        if id(v) not in done:
            done[id(v)] = v.detach().cpu()
    return {k: done[id(v)] for k, v in weights.items()}


def _write_state(path: str, state: dict[str, Any]) -> None:
    tmp = os.path.join(path, LIGHTNING_STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(path, LIGHTNING_STATE))


def _check_target(path: str) -> None:
    """A weights-only save writes into a new or empty directory, or over a checkpoint a zk strategy wrote."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"{path!r} exists and is not a directory (the zk strategies save checkpoint directories)")
    if os.path.isdir(path) and checkpoint_format.versions(path):
        raise FileExistsError(f"{path!r} holds a full ZeroAdamW checkpoint (optimizer states included): a weights-only "
                              "save there would have to delete it, and a save never deletes what it may not have "
                              "written. Save the weights to another path, or remove that checkpoint first")
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, LIGHTNING_STATE)):
        raise FileExistsError(f"{path!r} is a non-empty directory that holds no zk checkpoint: refusing to write "
                              "into it")


def _drop_weights_only(path: str) -> None:
    """Before a full save at ``path``: a weights-only checkpoint there (no ZeroAdamW versions, which the save
    would refuse to write next to) is replaced."""
    state_file = os.path.join(path, LIGHTNING_STATE)
    if os.path.isfile(state_file) and not checkpoint_format.versions(path):
        os.remove(state_file)


ZeroStrategy.register_strategies(StrategyRegistry)
