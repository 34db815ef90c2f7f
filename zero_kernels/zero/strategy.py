"""One strategy object per ZeRO stage: what differs between the stages, behind one interface.

[Note: stage strategies]
ZeroAdamW (optimizer.py) runs the same step for every stage and asks its strategy for the parts
that differ:
  ``start_reduction()`` / ``reduce_all()`` / ``wait_bucket(b)``: make the reduced gradient slices
      available (stage 1 reduce-scatters at step(), stages 2-3 during backward);
  ``exchange_flags()``: the one per-step all-reduce of "had a gradient" flags (int32 [num params]);
  ``after_bucket_step(b)`` / ``end_step()``: publish updated slices (stages 1-2 all-gather into
      the parameters, stage 3 frees any gathered copy: the next forward gathers);
  ``check_grads()``: refuse gradients the caller dropped from p.grad after backward;
  ``zero_grad``, ``no_sync``, ``wait_for_params``, ``refresh_params`` (after a load),
  ``sync_exact_params`` (exact parameters in the model: the qwZ escape hatch of stages 1-2),
  ``full_flat(b)`` (full fp32 values of a bucket), ``memory_report``, ``remove``.
:class:`Stage1` and :class:`Stage2` live here, :class:`~.stage3.Stage3` in stage3.py.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import collectives as C
from .buckets import FlatBucket
from .gather import ParamGatherer
from .grad_guard import Stage1GradGuard, local_grad
from .hooks import Stage2Reducer
from .mesh import ZeroMesh, all_reduce_everywhere
from .reduce import Stage1Reducer
from .params import sparse_message
from .report import finish_report, nbytes, state_report

__all__ = ["Stage1", "Stage2", "HookReduced", "StrategyContext"]


class StrategyContext:
    """What a strategy needs from the optimizer (explicit: strategies read nothing else)."""

    def __init__(self, model, buckets, layout, frozen, config, group, rank: int, world: int,
                 mesh: ZeroMesh | None = None):
        self.model, self.buckets, self.layout, self.frozen = model, buckets, layout, frozen
        self.config, self.group, self.rank, self.world = config, group, rank, world
        self.mesh = mesh if mesh is not None else ZeroMesh(group, None)     # [Note: hybrid sharding]

    def report(self, rep: dict[str, Any], stage: int, comm_bytes: int) -> dict[str, Any]:
        return finish_report(rep, self.buckets, self.model, self.frozen, stage, self.world,
                             self.config.reduce_dtype, comm_bytes)


class _GatheredParams:
    """Stages 1-2: full parameters always present; updated slices are all-gathered."""

    @staticmethod
    def assign_units(model, trainable, wrap):
        return None                     # stage-3 units only

    @staticmethod
    def new_bucket(layout, index, rank, params, device, amsgrad, config) -> FlatBucket:
        return FlatBucket(layout, index, rank, params, device, amsgrad, config.state_format)

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx
        self.gatherer = ParamGatherer(ctx.model, ctx.buckets, ctx.group, ctx.rank, ctx.config.overlap_comm,
                                      ctx.config.overlap_param_gather, ctx.config.timeout,
                                      quantize_weights=ctx.config.quantize_weights)

    def after_bucket_step(self, b: FlatBucket) -> None:
        self.gatherer.after_bucket_step(b)

    def end_step(self) -> None:
        self.gatherer.end_step()

    def wait_for_params(self) -> None:
        self.gatherer.wait_for_params()

    def refresh_params(self) -> None:
        self.gatherer.gather_all()

    def sync_exact_params(self) -> None:
        self.gatherer.gather_exact()

    @property
    def pending_param_gathers(self) -> int:
        return len(self.gatherer.pending)

    @contextlib.contextmanager
    def gathered(self):
        self.wait_for_params()          # stages 1-2 always hold full parameters
        yield

    def reset_peak(self) -> None:
        pass

    def units(self) -> list:
        return []                       # stage-3 units only

    def full_flat(self, b: FlatBucket) -> Tensor:
        if b.master_is_param and not self.ctx.config.quantize_weights:
            return b.param_flat.detach().clone()    # every slice arrived through an exact all-gather
        # the owners' fp32 masters, exactly (with qwZ the other slices of param_flat are decoded codes)
        flat = torch.empty(b.spec.padded_numel, dtype=torch.float32, device=b.device)
        flat[b.slice_start:b.slice_end].copy_(b.master_fp32())
        C.wait(C.all_gather_bucket(flat, self.ctx.rank, self.ctx.group, async_op=False))
        return flat

    def memory_report(self) -> dict[str, Any]:
        bs = self.ctx.buckets
        rep = state_report(bs, sum(nbytes(b.param_flat) for b in bs))
        rep["grads"] += sum(nbytes(b.reduce.grad_flat) for b in bs)
        seen = set()
        for b in bs:                # .grad tensors that are not views of the bucket's grad_flat
            base = b.reduce.grad_flat.data_ptr() if b.reduce.grad_flat is not None else None
            for g in map(local_grad, b.params):
                if g is not None and id(g) not in seen:
                    seen.add(id(g))
                    if base is None or not (base <= g.data_ptr() < base + nbytes(b.reduce.grad_flat)):
                        rep["grads"] += nbytes(g)
        return self.ctx.report(rep, self.stage, self.comm_bytes())

    def remove(self) -> None:
        self.gatherer.remove()


class Stage1(_GatheredParams):
    stage = 1

    def __init__(self, ctx: StrategyContext, units=None):
        super().__init__(ctx)
        self.reducer = Stage1Reducer(ctx.buckets, ctx.group, ctx.config.reduce_dtype, ctx.config.overlap_comm,
                                     ctx.mesh)
        self.guard = Stage1GradGuard([(ps.name, p) for b in ctx.buckets for ps, p in zip(b.param_specs, b.params)],
                                     reduced=lambda: self.reducer.launched)

    def remove(self) -> None:
        super().remove()
        self.guard.remove()

    @contextlib.contextmanager
    def no_sync(self):
        yield                       # stage 1 reduces at step() only: nothing to suppress

    def zero_grad(self, set_to_none: bool) -> None:
        self.reducer.finish_step()
        self.reducer.zero_grad(set_to_none)

    def check_grads(self) -> None:
        """p.grad holds the local gradients themselves until step(): dense ones only."""
        for b in self.ctx.buckets:
            for ps, p in zip(b.param_specs, b.params):
                if p.grad is not None and local_grad(p).is_sparse:
                    raise RuntimeError(sparse_message(ps.name))

    def start_reduction(self) -> None:
        self.reducer.launch_all()   # every reduce-scatter now; they complete while buckets step

    def reduce_all(self) -> None:
        self.reducer.wait_all()

    def wait_bucket(self, b: FlatBucket) -> None:
        self.reducer.wait(b)

    def exchange_flags(self) -> Tensor:
        flags = C.flag_tensor(self.reducer.local_flags(), self.ctx.group)
        all_reduce_everywhere(flags, dist.ReduceOp.MAX, self.ctx.mesh)
        return flags.cpu()

    def finish_step(self) -> None:
        self.reducer.finish_step()

    def comm_bytes(self) -> int:
        return self.reducer.kept_bytes()


class HookReduced:
    """Stages 2-3: gradients are reduced during backward by hooks (hooks.py); the flags each
    step exchanges are kept on the host and sent through the group's device."""

    def __init__(self, ctx: StrategyContext, reducer_cls=Stage2Reducer, **reducer_kwargs):
        n = len(ctx.layout.params)
        self.had_grad = [0] * n         # since the last zero_grad(set_to_none=True)
        self.arrived_step = [0] * n     # in this step's backwards
        self.stepped = [0] * n          # had_grad at the last step (what zero_grad(set_to_none=False) keeps)
        self.reducer = reducer_cls(ctx.buckets, ctx.group, ctx.config.reduce_dtype, ctx.config.overlap_comm,
                                   self.mark_grad, pool_keep=2, timeout=ctx.config.timeout, mesh=ctx.mesh,
                                   **reducer_kwargs)
        self.reducer.register()
        self.ctx = ctx

    def mark_grad(self, bucket: int, li: int) -> None:
        i = self.ctx.layout.buckets[bucket].params[li]
        self.had_grad[i] = 1
        self.arrived_step[i] = 1

    @contextlib.contextmanager
    def no_sync(self):
        prev = self.reducer.sync
        self.reducer.sync = False
        try:
            yield
        finally:
            self.reducer.sync = prev

    def zero_grad(self, set_to_none: bool) -> None:
        """As torch's: ``set_to_none=False`` leaves every parameter that had a gradient at the last step with a
        zero one (stepped again, its moments decaying and weight decay applied, even if no gradient arrives);
        ``True`` leaves none."""
        self.reducer.zero_grad(set_to_none)
        if set_to_none:
            self.had_grad = [0] * len(self.had_grad)
        else:
            self.had_grad = [a | b for a, b in zip(self.had_grad, self.stepped)]

    def check_grads(self) -> None:
        self.reducer.check_held()   # [Note: dropped gradients] in hooks.py

    def start_reduction(self) -> None:
        self.reducer.launch_unlaunched()

    def reduce_all(self) -> None:
        self.reducer.launch_unlaunched()
        self.reducer.finish_all()

    def wait_bucket(self, b: FlatBucket) -> None:
        self.reducer.finish(b)

    def exchange_flags(self) -> Tensor:
        """One all-reduce carries had-a-grad, arrived-this-step and late-bucket flags; then the
        late gradients are reduced and next step's expected set is updated (hooks.py, 4)."""
        n, r = len(self.had_grad), self.reducer
        flags = C.flag_tensor(self.had_grad + self.arrived_step + [int(x) for x in r.late], self.ctx.group)
        all_reduce_everywhere(flags, dist.ReduceOp.MAX, self.ctx.mesh)
        flags = flags.cpu()
        active, arrived, late = flags[:n], flags[n:2 * n], flags[2 * n:]
        if bool(arrived.any()):
            r.set_expected([[bool(arrived[i]) for i in b.spec.params] for b in self.ctx.buckets])
        self.arrived_step = [0] * n
        r.reduce_late(late.tolist())
        return active

    def finish_step(self) -> None:
        # [Note: step() consumes the reduced gradients] At stages 2-3 the gradients live in the
        # optimizer's slices, not in p.grad, so model.zero_grad() (what Hugging Face's Trainer and many
        # loops call) cannot clear them: they would silently accumulate across steps. As DeepSpeed's
        # engine does, the step consumes them (zero_grad(set_to_none=True) semantics; the storage is
        # kept for the next backward). Micro-batches between two steps still accumulate. Which parameters
        # had a gradient is kept for zero_grad(set_to_none=False), which gives them zero gradients as torch's.
        self.stepped = list(self.had_grad)
        self.zero_grad(set_to_none=True)

    def comm_bytes(self) -> int:
        return self.reducer.pool_bytes()


class Stage2(HookReduced, _GatheredParams):
    stage = 2

    def __init__(self, ctx: StrategyContext, units=None):
        _GatheredParams.__init__(self, ctx)
        HookReduced.__init__(self, ctx)

    def remove(self) -> None:
        _GatheredParams.remove(self)
        self.reducer.remove()
