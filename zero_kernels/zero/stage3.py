"""ZeRO stage 3: parameters sharded too, gathered just in time per sharding unit, freed after use.

Units (which modules gather together) are chosen in units.py ([Note: stage-3 units]); their
storage is unit_bucket.py ([Note: stage-3 storage]); this file is the runtime: module hooks,
prefetch, the gradient reducer's frees, and the :class:`Stage3` strategy ([Note: stage
strategies] in strategy.py).

[Note: stage-3 hooks]
Forward (module hooks on each unit): the pre-hook waits for the unit's all-gather (issuing it if
no prefetch did) and issues the async all-gathers of the next ``prefetch`` units of the forward
call sequence recorded in the first forward; the post-hook frees the unit (``reshard_after_forward``)
and registers a pre-backward hook (``Tensor.register_hook``) on every output that requires grad.
The root unit, and the last unit of the recorded forward order, are not freed after a forward
that needs a backward: they are the first to get gradients (FSDP2 keeps its root the same way);
this saves one all-gather per step. When no backward follows (eval mode, grad off, or the graph
dropped) they are given back ([Note: forward without backward] in unit_hold.py). A forward that
runs *inside* backward (activation checkpointing recomputation,
``torch._C._current_graph_task_id() != -1``) gathers and never frees: the unit is freed when its
gradients are complete.
Backward: the first output gradient of a unit (per call: a unit called twice has hooks on both
calls' outputs; the hook is idempotent) re-gathers it and prefetches the next ``prefetch`` units of
the backward sequence (the reverse forward post-order in the first backward, the recorded order
afterwards). Gradients go through the stage-2 reducer (``hooks.py``: post-accumulate-grad hooks,
one copy_/add_ per gradient, async reduce-scatter into ``grad_slice``, no_sync accumulation, late gradients):
a bucket's parameters are freed as soon as *every* parameter of the bucket delivered its
gradient in this backward. AccumulateGrad runs once per backward after all uses of a parameter,
so a unit called twice is reduced after its last use; with reentrant checkpointing a parameter
can deliver twice (one nested backward per region): the second is a "late" gradient, still
correct. One end-of-backward callback (queued on the outermost backward) completes the reducer
and frees whatever is still gathered (parameters without gradients). Backward also gathers a unit
that no output hook gathered when it reads a tensor saved from its parameters or accumulates one of
its gradients ([Note: tensors saved from a unit] in unit_saved.py); the first forward finds
parameters used outside their unit's forward ([Note: parameters used outside their unit]).

Every rank must call the same units in the same order (as with FSDP): the all-gathers are
collectives issued from forward hooks.

[Note: stage-3 reduce order]
The reducer reduce-scatters buckets in one order on every rank, a bucket waiting for those before
it (hooks.py, point 3). Bucket order (reverse registration) does not follow backward at stage 3: a
parent unit's parameters registered after its blocks (GPT-2's ``ln_f`` after ``h``) put its bucket
first, but its other parameters (``wpe``, used at the start of forward) get their gradients last,
so every block's full-size fp32 gradient buffer waited for the end of backward: the whole model's
gradients, unsharded, at once (52.6M-parameter GPT at world 2: ~200 MB per rank, kept by the
allocator afterwards). After the first forward the reducer's order becomes the reverse order in
which the units were first *entered* (a unit's backward ends after those entered after it, nested
units included; the root last); units never called come last. The recorded forward order is the
same on every rank (the requirement above), so the reduce-scatters are too.

[Note: stage-3 launch points]
Stage 2 launches a bucket once its expected gradients arrived, in launch order, and every rank issues
the same reduce-scatters in the same order. Stage 3 also all-gathers in backward (each unit's
pre-backward hook), and "arrived" depends on the rank: a parameter a rank did not use (a branch taken on
rank 0 only) never arrives there, so its bucket waited for the end of backward on that rank but left
early on the others. The two ranks then issued the reduce-scatter and the next unit's all-gather in
opposite orders and each waited for the other (until the timeout; a deadlock without one). So at stage 3
buckets leave only at points every rank reaches in the same order: where the backward of a unit ``u``
starts (its first pre-backward hook, before its all-gather; or, inside a reentrant checkpoint, whose
forward ran without grad and left no such hook, its recomputation's pre-forward; a non-reentrant
recomputation runs after the region's last pre-backward and before its gradients, so it is not one) it
launches, in launch order, the buckets up to ``launch_cut[u]`` (the leading run of ``launch_order``
whose units were entered after ``u`` and are not nested in it) as long as their units' backward started
before. Those units' outputs feed ``u``'s output in a chain of units, so their backward is done when
``u``'s output gradient is ready (a tensor hook fires once every consumer contributed); a unit
recomputed later in the same checkpoint region has not started, so it waits. The end of backward
launches the rest. A gradient that still arrives after its bucket left (units on parallel branches, a
unit called twice, a first forward in another unit order) takes the late path of hooks.py, point 4:
correct, with one more reduce-scatter at step().
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import collectives as C
from .buckets import FlatBucket, check_bound
from .grad_guard import local_grad
from .heap import release_free_heap
from .hooks import Stage2Reducer
from .report import nbytes, state_report
from .strategy import HookReduced, StrategyContext
from .unit_bucket import GATHERED, UnitBucket, copied_placeholder, copied_placeholder_error, gather_cache_stats
from .unit_hooks import UnitRuntime
from .units import assign_units

__all__ = ["Stage3", "Stage3Reducer"]


# ---- the reducer: stage 2's, plus "free a bucket once all its gradients arrived" ---------------------
class Stage3Reducer(Stage2Reducer):
    stage = 3
    def __init__(self, *args, on_backward_start: Callable[[], None], free_bucket: Callable[[UnitBucket], None],
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.on_backward_start = on_backward_start
        self.free_bucket = free_bucket
        self.launch_when_ready = False
        self.launch_cut: dict[int, int] = {}    # unit -> buckets of launch_order its backward may launch
        self.units_seen: set[int] = set()       # units whose backward started in this backward

    def _start_backward(self) -> None:
        if not self.in_backward:
            # The end-of-backward work is queued once, on the outermost backward (see note).
            self.in_backward = True
            self.on_backward_start()

    @torch.no_grad()
    def unit_backward(self, unit: int) -> None:
        """The backward of ``unit`` starts (its first pre-backward, or its recomputation in a reentrant
        checkpoint): launch the buckets up to its cut whose units started theirs
        ([Note: stage-3 launch points]); the same on every rank."""
        self._start_backward()
        if not (self.sync and self.overlap_comm):
            return
        self.units_seen.add(unit)
        cut = self.launch_cut.get(unit, 0)
        while self.next_launch < cut and self.launch_order[self.next_launch].spec.unit in self.units_seen:
            b = self.launch_order[self.next_launch]
            if not b.reduce.launched:
                self._launch(b)
            self.next_launch += 1
        self._reap()

    def _reset_backward(self) -> None:
        super()._reset_backward()
        self.units_seen = set()

    @torch.no_grad()
    def on_grad(self, b: FlatBucket, li: int, p: nn.Parameter) -> None:
        self._start_backward()
        super().on_grad(b, li, p)
        if li in b.s3_arrived:
            # A second delivery in one backward (reentrant checkpoint regions run one nested backward
            # each): count a new round, else the bucket would be freed while its other parameters
            # still expect AccumulateGrad (which needs their full shape).
            b.s3_arrived.clear()
            b.s3_done = False
        b.s3_arrived.add(li)
        if len(b.s3_arrived) == len(b.params):
            b.s3_done = True            # [Note: buckets done in a backward] in unit_hooks.py
            self.free_bucket(b)


class Stage3(HookReduced):
    """The stage-3 strategy: hook-reduced gradients (as stage 2) over unit buckets that are
    gathered by the module hooks of :class:`UnitRuntime`."""
    stage = 3

    @staticmethod
    def assign_units(model: nn.Module, trainable, wrap):
        return assign_units(model, trainable, wrap)

    @staticmethod
    def new_bucket(layout, index, rank, params, device, amsgrad, config) -> UnitBucket:
        return UnitBucket(layout, index, rank, params, device, amsgrad, config.state_format,
                          use_gather_cache=config.gather_cache,
                          quantize_weights=config.quantize_weights)

    def __init__(self, ctx: StrategyContext, units: list[tuple[str, nn.Module]]):
        cfg = ctx.config
        self.runtime = UnitRuntime(units, ctx.buckets, ctx.group, ctx.rank, cfg.prefetch,
                                   cfg.reshard_after_forward, self._end_backward, cfg.timeout,
                                   on_forward_order=self._reduce_in_backward_order,
                                   on_unit_backward=self._unit_backward)
        # overlap_comm honoured as in stage 2: False defers every reduce-scatter to the end of backward
        HookReduced.__init__(self, ctx, Stage3Reducer, on_backward_start=self.runtime.ensure_final_callback,
                             free_bucket=self.runtime.free)
        guard = self._state_dict_guard     # through a plain function: copy.deepcopy(model) copies a bound
        self._state_dict_hook = ctx.model.register_state_dict_pre_hook(   # method's object (this whole strategy)
            lambda module, prefix, keep_vars: guard(module, prefix, keep_vars))

    def _state_dict_guard(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """[Note: the module's own state_dict at stage 3] Outside forward the parameters are freed
        (0 elements): ``model.state_dict()`` (``save_pretrained``, ``torch.save(model.state_dict())``)
        would write empty weights that fail to load later. It raises instead, naming the fix, unless
        every unit is gathered (inside ``zopt.gathered()``). ``keep_vars=True`` (the Parameter objects
        themselves, what identity joins use) is always allowed."""
        if module is not self.ctx.model:            # a deepcopy of the model is no optimizer's: its own tensors,
            name = copied_placeholder(module, self.ctx.model, self.ctx.buckets)   # unless copied while freed
            if name is not None and not keep_vars:
                raise copied_placeholder_error(name)
            return
        if keep_vars or all(b.gather_state == GATHERED for b in self.ctx.buckets):
            return
        raise RuntimeError(
            "model.state_dict() under ZeRO-3: the parameters are sharded across ranks and freed outside "
            "forward, so it would return 0-element tensors. Use zopt.full_model_state_dict() (collective: "
            "call it on every rank), or `with zopt.gathered(): sd = model.state_dict()` (every rank), e.g. "
            "before save_pretrained(..., state_dict=sd)")

    def _reduce_in_backward_order(self, fwd_seq: list[int]) -> None:
        """[Note: stage-3 reduce order] and [Note: stage-3 launch points]: called once, after the first forward
        (before any backward)."""
        entered: dict[int, int] = {}
        for pos, ui in enumerate(fwd_seq):
            entered.setdefault(ui, pos)
        order = self.reducer.launch_order = sorted(
            self.ctx.buckets, key=lambda b: (0, -entered[b.spec.unit], b.index) if b.spec.unit in entered
            else (1, 0, b.index))
        # [Note: stage-3 launch points]: the leading run of units entered after u and not nested in u
        units = self.runtime.units
        inside = [{id(m) for m in u.module.modules()} for u in units]
        cut = self.reducer.launch_cut = {}
        for ui in entered:
            n = 0
            while n < len(order) and entered.get(order[n].spec.unit, -1) > entered[ui] and \
                    id(units[order[n].spec.unit].module) not in inside[ui]:
                n += 1
            cut[ui] = n

    def _unit_backward(self, unit: int) -> None:
        self.reducer.unit_backward(unit)

    def _end_backward(self) -> None:
        if self.reducer.in_backward:
            self.reducer.post_backward()

    # ---- parameters: the next forward gathers ----------------------------------------------------
    def after_bucket_step(self, b: FlatBucket) -> None:
        pass                                    # no all-gather: the next forward gathers

    def end_step(self) -> None:
        self.runtime.free_all()                 # gathered copies (if any) are stale now
        if self.ctx.buckets and self.ctx.buckets[0].device.type == "cpu":
            release_free_heap()                 # [Note: resident memory at stage 3] in heap.py

    def refresh_params(self) -> None:           # after a load: the next forward gathers the new shards
        self.runtime.free_all()

    def wait_for_params(self) -> None:
        pass

    def sync_exact_params(self) -> None:
        raise ValueError("sync_exact_params() writes exact full parameters into a model that keeps them between "
                         "steps (stages 1-2); at stage 3 they are freed after use and every forward gathers "
                         "them again. For exact full values use zopt.full_model_state_dict() (collective)")

    pending_param_gathers = 0

    def full_flat(self, b: FlatBucket) -> Tensor:
        flat = torch.empty(b.spec.padded_numel, dtype=torch.float32, device=b.device)
        flat[b.slice_start:b.slice_end].copy_(b.master_fp32())
        C.wait(C.all_gather_bucket(flat, self.ctx.rank, self.ctx.group, async_op=False))
        return flat

    @contextlib.contextmanager
    def gathered(self):
        with torch.no_grad():
            self.runtime.gather_all()
        self.runtime.pinned += 1                # a forward inside keeps the units (its post-hooks would free them)
        try:
            yield
            check_bound(self.ctx.buckets)       # a .data replaced inside (resize_token_embeddings): not adoptable
            with torch.no_grad():               # [Note: writes to stage-3 parameters] in unit_bucket.py
                for b in self.ctx.buckets:
                    b.writeback()
        except BaseException:
            for b in self.ctx.buckets:          # left by an exception: its writes are dropped as documented, so
                b.record_versions()             # the free below does not report them as lost (UnitBucket.free)
            raise
        finally:
            self.runtime.pinned -= 1
            if not self.runtime.pinned:
                self.runtime.free_all()

    # ---- introspection -----------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        bs, rt = self.ctx.buckets, self.runtime
        rep = state_report(bs, sum(nbytes(b.shard) + b.held_bytes() for b in bs))
        rep["grads"] += sum(nbytes(local_grad(p)) for b in bs for p in b.params)
        rep = self.ctx.report(rep, 3, self.reducer.pool_bytes())
        # freed gathered buffers kept for reuse (process-wide; ZeroAdamW.empty_cache() releases them)
        rep["gather_cache"] = gather_cache_stats()["cached_bytes"]
        rep["gathered_params"] = sum(b.held_bytes() for b in bs)
        rep["peak_gathered_params"] = rt.peak_gathered_bytes
        rep["peak_gathered_units"] = rt.peak_gathered_units
        rep["largest_unit_bytes"] = max((sum(b.full_bytes for b in u.buckets) for u in rt.units), default=0)
        rep["num_units"] = sum(1 for u in rt.units if u.buckets)
        rep["gather_cache_limit"] = rt.cache_limit
        return rep

    def reset_peak(self) -> None:
        self.runtime.reset_peak()

    def units(self) -> list[tuple[str, nn.Module]]:
        return [(u.name, u.module) for u in self.runtime.units]

    def remove(self) -> None:
        self._state_dict_hook.remove()
        # the parameters stay empty after remove_hooks() ([Note: one ZeroAdamW per parameter]): the module's
        # own state_dict keeps refusing, else torch.save(model.state_dict()) would write 0-element weights
        self._state_dict_hook = self.ctx.model.register_state_dict_pre_hook(_detached_guard)
        self.runtime.remove()
        self.reducer.remove()


def _detached_guard(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    """[Note: the module's own state_dict at stage 3], after ``remove_hooks()``: nothing gathers the
    parameters any more, so ``model.state_dict()`` would return their 0-element placeholders for good."""
    if keep_vars:
        return
    raise RuntimeError(
        "model.state_dict() after ZeroAdamW(stage=3).remove_hooks(): the parameters are empty (0-element "
        "placeholders); their values live only in that optimizer's shards. Take zopt.full_model_state_dict() "
        "(collective: every rank) or save a checkpoint before remove_hooks(), and load it into a fresh model")
