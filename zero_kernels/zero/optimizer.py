"""ZeroAdamW / ZeroAdam: the facade. Construction follows [Note: construction order] (config.py);
the step is [Note: the ZeRO step] (step.py); what differs between stages is one strategy object
([Note: stage strategies] in strategy.py)."""
from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from .. import backends, checkpoint
from ..hparams import validate_hparams
from .buckets import check_amsgrad, check_bound
from .build import bind, plan
from .config import ZeroConfig
from .mesh import broadcast_from_first, resolve_mesh
from .ownership import claim, release
from .params import check_added, check_frozen
from .scaling import StepScaling
from .stage3 import Stage3
from .state_dict import (agree_to_load, apply_shard, check_shard, full_model_state_dict, shard_identity,
                         shard_state_dict)
from .step import global_norm, step_bucket
from .strategy import Stage1, Stage2, StrategyContext
from .timeouts import bounded_by_timeout, timeout_scope
from .unit_bucket import empty_gather_cache
from .wire import WireMeter

__all__ = ["ZeroAdamW", "ZeroAdam"]

STRATEGIES = {1: Stage1, 2: Stage2, 3: Stage3}
QWZ_STAGE12_WARNING = (
    "ZeroAdamW(stage={stage}, quantize_weights=True): between steps the model's parameters hold int8-quantized "
    "copies (within half a code step) of the slices other ranks own, so model.state_dict(), save_pretrained "
    "and evaluation read quantized weights; masters, optimizer state dicts and checkpoints stay exact. Call "
    "zopt.sync_exact_params() (collective, every rank) before saving or evaluating for exact parameters, or "
    "save zopt.full_model_state_dict() ([Note: quantized weight all-gather] in zero_kernels/zero/qwz.py)")


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW with ZeRO-1/2/3 sharding over ``process_group``, or over the "shard" dimension of a 2-D
    ``mesh`` with replication across its "replicate" dimension ([Note: hybrid sharding]). Takes the
    module (it needs parameter names for the layout and hooks for stages 2-3). Trainable parameters become views into flat
    per-bucket buffers; frozen ones are left alone (cast to ``param_dtype`` when one is given).

    ``quantize_weights=True`` (ZeRO++ qwZ, any stage) sends the parameter all-gathers as int8 codes with
    one fp32 scale per block of 256 ([Note: quantized weight all-gather] in qwz.py). Masters, moments,
    state dicts and checkpoints stay exact. At stages 1-2 the model keeps its full parameters between
    steps, so the other ranks' slices there are quantized copies (within half a code step): a plain
    ``model.state_dict()``, ``save_pretrained`` or evaluation reads them. Call ``sync_exact_params()``
    (collective) first for exact parameters, or save ``full_model_state_dict()`` (exact fp32 masters)."""
    adamw = True                        # decoupled weight decay (ZeroAdam: L2 added to the gradient)

    def __init__(self, model: nn.Module, stage: int = 2, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | None = None, amsgrad: bool = False, maximize: bool = False, *,
                 param_groups: list[dict] | None = None, process_group=None, mesh=None, **options):
        # ---- 1. arguments (identical on every rank: raise before any collective or change) ------
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(self).__name__} takes the module itself (it needs parameter names "
                            f"and gradient hooks), got {type(model).__name__}: pass `model`, not "
                            "`model.parameters()`; per-group settings go in param_groups=[...]")
        cfg = ZeroConfig.from_options(stage, options)
        zmesh = resolve_mesh(mesh, process_group)._replace(quantize_grads=cfg.quantize_grads)  # mesh.py
        process_group = zmesh.shard_group
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, (list, tuple)) else betas, eps=eps,
                        weight_decay=(0.01 if self.adamw else 0.0) if weight_decay is None else weight_decay,
                        amsgrad=amsgrad, maximize=maximize)
        validate_hparams(lr, betas, eps, defaults["weight_decay"])
        strategy_cls = STRATEGIES[cfg.stage]
        # ---- 2.-4. read the model (no change), agree with every rank, lay out ----------------------
        plan_ = plan(model, cfg, defaults, param_groups, zmesh, strategy_cls)
        if cfg.quantize_weights and cfg.stage < 3 and plan_.world > 1:
            warnings.warn(QWZ_STAGE12_WARNING.format(stage=cfg.stage), UserWarning, stacklevel=2)
        super().__init__(plan_.groups, defaults)
        self.module, self.config, self.stage, self.layout = model, cfg, cfg.stage, plan_.layout
        self.process_group, self.world_size, self.rank = process_group, plan_.world, plan_.rank
        self.mesh = zmesh                               # shard_group (= process_group) and replicate_group
        self.timeout = cfg.timeout                      # [Note: collective timeouts]
        self.backend, self._fused, self._device = plan_.backend, backends.get(plan_.backend), plan_.device
        self._coded_backend = plan_.coded_backend       # [Note: coded ZeRO states] (coded.py)
        # ---- 5. bind: parameters become views of the buckets, hooks registered ----------------------
        self.buckets = bind(plan_, cfg, strategy_cls, any(g["amsgrad"] for g in self.param_groups))
        self._claimed = [p for _, p in plan_.params.trainable]          # [Note: one ZeroAdamW per parameter]
        self._claim = claim(self._claimed, type(self).__name__, cfg.stage)
        self._frozen_named = plan_.params.frozen        # unfrozen since and given a gradient: refused
        self._model_ids = {id(p) for p in model.parameters()}          # added since and given a gradient: refused
        self.steps = [0] * len(self.layout.params)      # per parameter, like torch's state["step"]
        ctx = StrategyContext(model, self.buckets, self.layout, [p for _, p in self._frozen_named], cfg,
                              process_group, self.rank, self.world_size, zmesh)
        self.strategy = strategy_cls(ctx, plan_.units)
        self.scaling = StepScaling(cfg.loss_scale, cfg.growth_interval, process_group, self.rank, self.world_size,
                                   cfg.stage, self._device, id(self), zmesh)
        self._step_supports_amp_scaling = True          # torch.amp.GradScaler protocol ([Note: non-finite gradients])
        self._clip_coef: Tensor | None = None
        self._active_cache: Tensor | None = None
        self.wire = WireMeter(zmesh.groups)             # [Note: bytes on the wire] (wire.py)
        self.checkpoint_lineage: str | None = None      # [Note: checkpoint lineage] (checkpoint_format.py)

    # ---- torch.optim.Optimizer plumbing -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "buckets"):
            raise NotImplementedError("the ZeRO bucket layout is fixed at construction: pass every group "
                                      "to the constructor via param_groups=[...]")
        super().add_param_group(param_group)

    @property
    def loss_scaler(self):
        return self.scaling.loss_scaler

    @property
    def grad_scaler(self):
        return self.scaling.grad_scaler

    @property
    def skipped_steps(self) -> int:
        return self.scaling.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, n: int) -> None:
        self.scaling.skipped_steps = int(n)

    @property
    def _steps(self) -> list[int]:      # read by tests/test_checkpoint.py (owned elsewhere): use .steps
        return self.steps

    def no_sync(self):
        """Accumulate gradients locally (no communication) for all but the last micro-batch."""
        return self.strategy.no_sync()

    def comm_report(self) -> dict[str, Any]:
        """Bytes this rank sent on the optimizer's groups, per link class ("intra" / "inter" node)
        and collective kind: ``last_step`` (from the end of the previous step to the end of the last,
        its backward included) and ``total`` (since construction) ([Note: bytes on the wire])."""
        return self.wire.report()

    @contextlib.contextmanager
    def gathered(self):
        """Collective: every parameter full-size inside the block (stage 3 gathers all units and frees
        them after, as FSDP's ``summon_full_params(writeback=True)``: parameters written inside, on every
        rank the same values, become each rank's slice when the block ends; [Note: writes to stage-3
        parameters] in unit_bucket.py; a block left by an exception writes nothing back, unlike FSDP's: the
        exception may be one rank's, and the ranks' slices must not come from different writes). Stages 1-2 hold full parameters anyway (in-flight all-gathers are
        waited for; writes are adopted by the next step; with quantize_weights the other ranks' slices are
        int8-quantized copies: ``sync_exact_params()``). Its gathers and write-backs are bounded by
        ``timeout=`` (as is the block's body)."""
        with timeout_scope(self.timeout, self.process_group), self.strategy.gathered():
            yield

    @bounded_by_timeout
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.strategy.zero_grad(set_to_none)
        self._clip_coef = None
        self._active_cache = None

    def _active(self) -> Tensor:
        """int32 [num params]: 1 where some rank has a gradient (one collective per step, cached)."""
        if self._active_cache is None:
            self._active_cache = self.strategy.exchange_flags()
        return self._active_cache

    def _reduce_all(self) -> None:
        self.strategy.reduce_all()
        self._active()                  # stages 2-3: folds late gradients into the slices

    @bounded_by_timeout
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the global gradient norm (all ranks' slices, tied parameters once, no padding) like
        ``torch.nn.utils.clip_grad_norm_`` on the full model; returns the total norm (fp32). The clip
        coefficient is folded into the next step's grad_scale (no pass over the gradients). torch's own
        ``clip_grad_norm_(model.parameters(), ...)`` raises ShardedGradError naming this method
        ([Note: gradient placeholders] in grad_guard.py)."""
        self._check_attached("clip_grad_norm_()")
        check_frozen(self._frozen_named)
        check_added(self.module, self._model_ids)
        self.strategy.check_grads()
        self._reduce_all()
        total = global_norm(self.buckets, self.rank, float(norm_type), self.process_group, self._device)
        ls = self.scaling.current_scale()
        if ls is not None:              # the slices hold loss-scaled gradients
            total = total / ls
        if self._clip_coef is not None:     # clipped before this step: torch would see the clipped gradients
            total = total * self._clip_coef
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        self._clip_coef = coef if self._clip_coef is None else self._clip_coef * coef
        return total

    def wait_for_params(self) -> None:
        """Wait for the parameter all-gathers step() left in flight (overlap_param_gather=True);
        a no-op otherwise. Call before reading parameters outside their modules' forward."""
        self.strategy.wait_for_params()

    @property
    def pending_param_gathers(self) -> int:
        """Parameter all-gathers step() left in flight ([Note: overlapped parameter all-gather])."""
        return self.strategy.pending_param_gathers

    # ---- the step -----------------------------------------------------------------------------------
    @bounded_by_timeout
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: Tensor | None = None, found_inf: Tensor | None = None):
        """[Note: the ZeRO step]. ``grad_scale`` / ``found_inf``: the GradScaler protocol of torch's
        fused optimizers (also read from the attributes GradScaler sets)."""
        self._check_attached("step()")
        self.strategy.wait_for_params()                 # the step writes the slices the gathers read
        check_bound(self.buckets)                       # [Note: bound parameters] (buckets.py)
        check_frozen(self._frozen_named)                # a parameter unfrozen since construction
        check_added(self.module, self._model_ids)       # ... or added / replaced since
        check_amsgrad(self.param_groups, self.buckets)  # set on a group since construction
        if closure is None:
            self.scaling.check_scaled()                 # a loss scale needs zopt.scale_loss(loss).backward()
        for b in self.buckets:                          # [Note: parameters edited outside the optimizer]
            b.adopt_edits()
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        self.scaling.check_amp(grad_scale, found_inf)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self.scaling.check_scaled()
        self.strategy.check_grads()                     # [Note: dropped gradients] (hooks.py)
        self.strategy.start_reduction()
        active = self._active()
        if bool(active.any()):
            self._reduce_all()
            skip, inv_loss_scale = self.scaling.decide(self.buckets, grad_scale, found_inf)
            if not skip:                                # every rank skips alike: nothing changes
                self._apply(active, inv_loss_scale)
        self.strategy.finish_step()
        if self.config.broadcast_buffers:               # as DDP's broadcast_buffers=True (config.py)
            broadcast_from_first(list(self.module.buffers()), self.mesh)
        for b in self.buckets:
            b.record_versions()
        self.wire.mark()
        self._clip_coef = None
        self._active_cache = None
        return loss

    def _apply(self, active: Tensor, inv_loss_scale: Tensor | None) -> None:
        for i in active.nonzero().flatten().tolist():
            self.steps[i] += 1
        scale = torch.ones(1, dtype=torch.float32, device=self._device)   # slices are averages
        if self._clip_coef is not None:
            scale = scale * self._clip_coef.to(self._device)
        if inv_loss_scale is not None:
            scale = scale * inv_loss_scale
        for b in self.buckets:
            self.strategy.wait_bucket(b)
            if any(bool(active[i]) for i in b.spec.params):
                step_bucket(b, self.param_groups[b.spec.group], active, self.steps, scale, self._fused,
                            self.adamw, self._device, self._coded_backend)
                self.strategy.after_bucket_step(b)
        self.strategy.end_step()

    # ---- state ----------------------------------------------------------------------------------------
    @bounded_by_timeout
    @torch.no_grad()
    def full_model_state_dict(self) -> dict[str, Tensor]:
        """The full, unsharded model state dict on every rank (collective)."""
        self.wait_for_params()
        return full_model_state_dict(self.buckets, self.module, self.strategy.full_flat)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard ([Note: shard state dict] in state_dict.py)."""
        sd = shard_state_dict(self.stage, self.rank, self.world_size, self.layout, self.steps,
                              self.param_groups, self.buckets)
        sd["scaling"] = self.scaling.state_dict()      # loss scale and skipped steps: resume exactly
        return sd

    @bounded_by_timeout
    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by state_dict() on the same rank of the same layout (collective: the
        working parameters are refreshed from the loaded masters). Raises before changing anything."""
        error, identity = None, 0
        try:
            check_shard(state_dict, self.layout, self.world_size, self.rank, self.buckets, self.param_groups)
            why = None if "scaling" not in state_dict else self.scaling.check_state(state_dict["scaling"])
            if why is not None:
                raise ValueError(f"{why}. Nothing was loaded.")
            identity = shard_identity(state_dict)
        except Exception as e:  # noqa: BLE001 - raised again by agree_to_load, on this rank and (named) on others
            error = e
        agree_to_load(error, self.mesh, identity)
        self.wait_for_params()
        self.steps = apply_shard(state_dict, self.buckets, self.param_groups)
        if "scaling" in state_dict:                     # shards saved before it was kept: scaling unchanged
            self.scaling.load_state_dict(state_dict["scaling"])
        self.refresh_params()

    @torch.no_grad()
    def refresh_fp32_params(self) -> None:
        """Adopt the working parameters into this rank's masters (stages 1-2: fp32 master slices or remainders)
        element by element, as step() does by itself for writes through torch ([Note: parameters edited
        outside the optimizer]): call it after writes through ``p.data``, which no version counter sees
        (DeepSpeed's name). Not collective: each rank adopts the slice it owns, which the next all-gather
        spreads, so every rank must have written the same values. Stage 3 keeps no parameters between steps:
        nothing to adopt. A parameter whose ``.data`` was REPLACED (not written in place) is no longer ZeroAdamW's:
        that raises here, as at step(), before any master changes."""
        self.wait_for_params()
        for b in self.buckets:
            moved = b.moved_param()
            if moved is not None:
                raise b.moved_error(*moved)
        for b in self.buckets:
            b.adopt_edits(force=True)

    @bounded_by_timeout
    def refresh_params(self) -> None:
        """Collective: make the working parameters reflect the masters/shards after they were
        written (stages 1-2 all-gather, int8 codes with quantize_weights; stage 3 drops gathered
        copies: the next forward gathers)."""
        self.strategy.refresh_params()

    @bounded_by_timeout
    @torch.no_grad()
    def sync_exact_params(self) -> None:
        """Collective (every rank), stages 1-2: make every model parameter bit-equal to its owner's
        working value (the master's 16-bit rounding, or the fp32 master itself) with an exact all-gather
        after waiting for any in flight. With ``quantize_weights=True`` call it before
        ``model.state_dict()``, ``save_pretrained`` or evaluation: between steps the other ranks' slices
        are int8-quantized copies ([Note: quantized weight all-gather]); the next step() quantizes them
        again. Without quantize_weights the parameters are exact already (this only costs an all-gather).
        Stage 3 raises ValueError: its parameters are not kept (use ``full_model_state_dict()``)."""
        self.strategy.sync_exact_params()

    # ---- checkpoints (zero_kernels/checkpoint.py: format, atomicity, resharding) ------------------
    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss * scale`` with ``loss_scale="dynamic"`` or a float (identity otherwise); call
        ``.backward()`` on the result. The step unscales inside the fused kernel."""
        return self.scaling.scale_loss(loss)

    @bounded_by_timeout
    def save_checkpoint(self, path, keep: int = 1) -> str:
        """Collective: every rank writes its shard of a resharding checkpoint under ``path`` (with a 2-D
        mesh, the first replica's ranks write; [Note: hybrid sharding]); ``keep`` complete versions of this
        run stay under ``path`` ([Note: checkpoint lineage])."""
        checkpoint.check_keep(keep)         # on every row of the mesh, before any collective
        return self.mesh.on_first_replica(lambda: checkpoint.save_checkpoint(self, path, keep=keep),
                                          checkpoint.CheckpointError)

    @bounded_by_timeout
    def load_checkpoint(self, path, verify: bool = True) -> None:
        """Collective: load a checkpoint saved at any world size / stage / bucket size
        (``verify=False`` skips the sha256 check of the tensor files)."""
        checkpoint.load_checkpoint(self, path, verify=verify)

    # ---- introspection ------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds for model states now (call after step()), and the formula's
        prediction for this stage, world size and dtypes (zero_kernels.memory.model_state_bytes)."""
        return self.strategy.memory_report()

    def reset_peak_memory(self) -> None:
        """Stage 3: restart ``memory_report()["peak_gathered_*"]`` from what is gathered now."""
        self.strategy.reset_peak()

    def sharding_units(self) -> list[tuple[str, nn.Module]]:
        """Stage 3: the (name, module) of every sharding unit, the root first ([Note: stage-3 units])."""
        return self.strategy.units()

    def empty_cache(self) -> None:
        """Stage 3 on CPU: return the freed gathered-parameter buffers kept for reuse to the system
        (``memory_report()["gather_cache"]``), as ``torch.cuda.empty_cache()`` does on CUDA."""
        empty_gather_cache()

    def remove_hooks(self) -> None:
        """Detach the optimizer from the module (gradient and forward hooks); it cannot step after (step() and
        clip_grad_norm_ raise; state_dict / save_checkpoint still work). At stages 1-2 the parameters keep their
        values and another ZeroAdamW may take them; at stage 3 they stay empty ([Note: one ZeroAdamW per
        parameter] in ownership.py)."""
        self.strategy.remove()
        release(self._claimed, self._claim)
        self._detached = True

    def _check_attached(self, what: str) -> None:
        if getattr(self, "_detached", False):
            raise RuntimeError(f"{what} on a ZeroAdamW detached from its module by remove_hooks(): it no longer "
                               "receives gradients and may not own the parameters; build a new ZeroAdamW for the "
                               "module (its state_dict() or checkpoint carries this one's states over). Nothing "
                               "was changed.")


class ZeroAdam(ZeroAdamW):
    """ZeRO Adam with L2 weight decay added to the gradient (torch.optim.Adam semantics)."""
    adamw = False
