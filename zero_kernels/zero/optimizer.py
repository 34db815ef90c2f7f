"""ZeroAdamW / ZeroAdam: ZeRO stage 1 and 2 over any data-parallel process group.

[Note: the ZeRO step]
At ``step()`` (after backward):
  stage 1: each bucket's full gradient (``.grad`` views, or a flatten copy) is reduce-scattered
           (average, fp32) into this rank's slice; stage 2: the hooks already launched those
           reduce-scatters during backward (see [Note: stage-2 gradient flow] in hooks.py) and
           step() only waits.
  then, bucket by bucket in order: wait for its reduced slice, run the fused-Adam contract on the
  slice (fp32 master, exp_avg, exp_avg_sq; grad_scale = the clip coefficient, so clipping costs
  no extra pass), write the 16-bit parameter slice (or update fp32 parameters in
  place: their slice *is* the master), and launch that bucket's all-gather, which writes straight
  into the module's parameters (they are views of the bucket). Later buckets' steps overlap
  earlier buckets' all-gathers.

Per-parameter semantics follow torch.optim.AdamW: a parameter whose gradient is None on every rank
is not updated and its step count does not advance ("had a gradient" is all-reduced with MAX, so
a parameter used on one rank only is updated everywhere). The slice of a bucket is therefore split
into runs of parameter pieces with the same step count (normally one run per bucket).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import backends
from ..reference import compute_coeffs
from ..state_keys import keyed_state
from . import collectives as C
from .buckets import FlatBucket
from .flat import flatten
from .hooks import Stage2Reducer
from .layout import Layout, ParamInfo, build_layout, dtype_name

__all__ = ["ZeroAdamW", "ZeroAdam"]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
SHARD_FORMAT = "zero_kernels.zero/shard"
SHARD_VERSION = 1


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW with ZeRO-1/2 sharding of optimizer states (and gradients) over ``process_group``.

    Takes the module (it needs parameter names for the layout and hooks for stage 2). Trainable
    parameters become views into flat per-bucket buffers; frozen ones are left alone (cast to
    ``param_dtype`` when one is given). See [Note: the ZeRO step].
    """
    _adamw = True

    def __init__(self, model: nn.Module, stage: int = 2, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | None = None, amsgrad: bool = False, maximize: bool = False, *,
                 param_groups: list[dict] | None = None, process_group=None,
                 bucket_size: int = 25 * 2**20, overlap_comm: bool = True,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
                 backend: str = "auto", alignment_bytes: int = 16,
                 loss_scale=None, growth_interval: int = 2000, timeout=None,
                 prefetch: int = 1, reshard_after_forward: bool = True, wrap=None,
                 gather_cache: bool = True, overlap_param_gather: bool = False):
        if weight_decay is None:
            weight_decay = 1e-2 if self._adamw else 0.0
        # ---- argument checks (identical on every rank: raise before any collective) ----------
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(self).__name__} takes the module itself (it needs parameter names "
                            f"and gradient hooks), got {type(model).__name__}: pass `model`, not "
                            "`model.parameters()`; per-group settings go in param_groups=[...]")
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if stage == 3 and (not isinstance(prefetch, int) or prefetch < 0):
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        if not isinstance(gather_cache, bool):
            raise TypeError(f"gather_cache must be True or False, got {gather_cache!r}")
        if not isinstance(overlap_param_gather, bool):
            raise TypeError(f"overlap_param_gather must be True or False, got {overlap_param_gather!r}")
        if overlap_param_gather and stage == 3:
            raise ValueError("overlap_param_gather is for stages 1 and 2: stage 3 gathers parameters in "
                             "forward already (see prefetch=)")
        _check_hparams(lr, betas, eps, weight_decay, where="")
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"bucket_size must be a positive int (bytes), got {bucket_size!r}")
        if param_dtype is not None and param_dtype not in _FLOAT:
            raise ValueError(f"param_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {param_dtype}")
        if reduce_dtype not in _FLOAT:
            raise ValueError(f"reduce_dtype must be a float dtype, got {reduce_dtype}")
        if process_group is not None and not dist.is_initialized():
            raise ValueError("process_group was given but torch.distributed is not initialized")
        world = C.group_size(process_group)
        rank = C.group_rank(process_group)
        if rank < 0:
            raise ValueError("this process is not a member of process_group: construct the optimizer "
                             "only on the ranks of its data-parallel group")

        # ---- the model: names, dedup (tied), trainable, groups ------------------------------------
        named = list(model.named_parameters(remove_duplicate=False))
        first_name: dict[int, str] = {}
        aliases: dict[int, list[str]] = {}
        uniq: list[tuple[str, nn.Parameter]] = []
        for n, p in named:
            if id(p) in first_name:
                aliases[id(p)].append(n)
            else:
                first_name[id(p)] = n
                aliases[id(p)] = []
                uniq.append((n, p))
        trainable = [(n, p) for n, p in uniq if p.requires_grad]
        frozen = [(n, p) for n, p in uniq if not p.requires_grad]
        local_error = _model_error(trainable, param_dtype)
        groups_spec, group_of, group_error = _resolve_groups(param_groups, trainable, first_name, uniq, lr,
                                                             betas, eps, weight_decay, amsgrad, maximize)
        local_error = local_error or group_error
        if not trainable and local_error is None:
            local_error = "the model has no trainable parameters (all have requires_grad=False)"
        device = trainable[0][1].device if trainable else torch.device("cpu")
        backend_name = backend
        if local_error is None:
            try:
                backend_name = backends.resolve(backend, device)
            except ValueError as e:
                local_error = str(e)

        # ---- every rank must hold the same parameter list --------------------------------------
        signature = {"params": [(n, tuple(p.shape), str(p.dtype), bool(p.requires_grad)) for n, p in uniq],
                     "groups": [sorted(first_name[id(p)] for p in g["params"]) for g in groups_spec]
                     if local_error is None else None,
                     "config": (stage, bucket_size, str(param_dtype), str(reduce_dtype), alignment_bytes),
                     "error": local_error}
        self._timeout = C._as_timedelta(timeout)           # [Note: collective timeouts]
        if self._timeout is not None and world > 1:
            _join_barrier(process_group, self._timeout, world)
        _check_same_everywhere(signature, process_group, world, rank)

        # ---- layout --------------------------------------------------------------------------
        infos = []
        for n, p in trainable:
            wdt = param_dtype or p.dtype
            infos.append(ParamInfo(n, tuple(p.shape), dtype_name(wdt), group_of[id(p)], tuple(aliases[id(p)])))
        units = unit_of = None
        if stage == 3:                      # [Note: stage-3 units] in stage3.py
            from .stage3 import assign_units
            units, unit_of = assign_units(model, trainable, wrap)
        layout = build_layout(infos, world, bucket_size, alignment_bytes,
                              unit_of=(lambda i: unit_of[i]) if unit_of is not None else None)

        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        self._initializing = True
        super().__init__(groups_spec, defaults)
        self._initializing = False

        # ---- bind: parameters become views of the buckets -------------------------------------------
        by_name = {n: p for n, p in trainable}
        self.module = model
        self.stage = stage
        self.process_group = process_group
        self.world_size = world
        self.rank = rank
        self.layout: Layout = layout
        self.overlap_comm = overlap_comm
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.backend = backend_name
        self._fused = backends.get(backend_name)
        self._device = device
        self.buckets: list[FlatBucket] = []
        with torch.no_grad():
            for bs in layout.buckets:
                ps = [by_name[layout.params[i].name] for i in bs.params]
                fb = _bucket_class(stage)(layout, bs.index, rank, ps, device, amsgrad=any(
                    g["amsgrad"] for g in self.param_groups))
                if stage == 3:
                    fb.use_gather_cache = gather_cache     # [Note: the gather cache]
                fb.bind([p.detach() for p in ps])
                self.buckets.append(fb)
            if param_dtype is not None:
                for _, p in frozen:
                    if p.is_floating_point() and p.dtype != param_dtype:
                        p.data = p.data.to(param_dtype)
        self._frozen = [p for _, p in frozen]
        self._steps = [0] * len(layout.params)              # per parameter, like torch's state["step"]
        self._had_grad = torch.zeros(len(layout.params), dtype=torch.int32)   # stage 2: set by hooks
        self._arrived_step = torch.zeros(len(layout.params), dtype=torch.int32)  # stage 2, this step
        self._pindex = {id(b.params[li]): (b.index, li) for b in self.buckets for li in range(len(b.params))}
        # [Note: overlapped parameter all-gather]
        self.overlap_param_gather = overlap_param_gather
        self._pending_gathers: dict[int, Any] = {}          # bucket index -> AllGatherResult in flight
        self._gather_hooks = []
        if overlap_param_gather:
            owned: dict[nn.Module, set[int]] = {}
            for mod in model.modules():
                for p in mod.parameters(recurse=False):
                    if id(p) in self._pindex:
                        owned.setdefault(mod, set()).add(self._pindex[id(p)][0])
            for mod, bis in owned.items():
                self._gather_hooks.append(mod.register_forward_pre_hook(self._gather_hook(sorted(bis))))
        self._clip_coef: Tensor | None = None
        self._active_cache: Tensor | None = None
        self._reduced = False                               # stage 1: grads reduced for this step
        self._reducer: Stage2Reducer | None = None
        from .scaling import make_scaler                    # [Note: non-finite gradients]
        self.loss_scaler, self.grad_scaler = make_scaler(loss_scale, growth_interval)
        self.skipped_steps = 0
        self._step_supports_amp_scaling = True              # torch.amp.GradScaler hands us grad_scale/found_inf
        if stage == 2:
            self._reducer = Stage2Reducer(self.buckets, process_group, reduce_dtype, overlap_comm,
                                          self._mark_grad)
            self._reducer.pool_keep = 2     # recycle full-size buffers ([Note: stage-2 gradient flow], 6)
            self._reducer.register()
        self._s3 = None
        if stage == 3:
            from .stage3 import Stage3
            self._s3 = Stage3(self, units, prefetch, reshard_after_forward)
            self._reducer = self._s3.reducer
        if self._reducer is not None:                       # backward-time waits honour the timeout
            self._reducer.timeout = self._timeout

    # ---- torch.optim.Optimizer plumbing -------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_initializing", False):
            raise NotImplementedError("the ZeRO bucket layout is fixed at construction: pass every group "
                                      "to the constructor via param_groups=[...]")
        super().add_param_group(param_group)

    def _mark_grad(self, bucket: int, li: int) -> None:
        i = self.layout.buckets[bucket].params[li]
        self._had_grad[i] = 1
        self._arrived_step[i] = 1

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for all but the last micro-batch."""
        if self._reducer is None:
            yield                       # stage 1 reduces at step() only: nothing to suppress
            return
        prev = self._reducer.sync
        self._reducer.sync = False
        try:
            yield
        finally:
            self._reducer.sync = prev

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.stage == 1:
            if set_to_none:
                for b in self.buckets:
                    b.grad_flat = None
                    for p in b.params:
                        p.grad = None
            else:
                # The views path: .grad become views of one flat buffer per bucket; autograd then
                # accumulates into it in place and step() reduce-scatters it without a copy.
                for b in self.buckets:
                    if b.grad_flat is None:
                        b.grad_flat = torch.zeros(b.spec.padded_numel, dtype=b.dtype, device=b.device)
                    else:
                        b.grad_flat.zero_()
                    for p, v in zip(b.params, b.grad_views()):
                        if p.grad is not None:
                            p.grad = v
        else:
            self._reducer.clear()
            for b in self.buckets:
                if set_to_none:             # the storage is kept for the next backward (hooks.py, 5)
                    if b.grad_slice is not None:
                        b.spare_slice = b.grad_slice
                    b.grad_slice = None
                elif b.grad_slice is not None:
                    b.grad_slice.zero_()
                for p in b.params:
                    p.grad = None
            if set_to_none:
                self._had_grad.zero_()
        self._reduced = False
        self._clip_coef = None
        self._active_cache = None

    # ---- gradient reduction -----------------------------------------------------------------------
    def _stage1_send_buffer(self, b: FlatBucket) -> Tensor:
        """The full-size buffer to reduce-scatter for bucket b (stage 1)."""
        grads = [p.grad for p in b.params]
        views = b.grad_flat is not None and all(
            g is None or g.data_ptr() == v.data_ptr() for g, v in zip(grads, b.grad_views()))
        if views:   # zero copies: regions of params without a grad are zero since zero_grad()
            return b.grad_flat if b.grad_flat.dtype == self.reduce_dtype else b.grad_flat.to(self.reduce_dtype)
        buf = torch.empty(b.spec.padded_numel, dtype=self.reduce_dtype, device=b.device)
        b.zero_missing(buf, [g is not None for g in grads])
        flatten([g for g in grads if g is not None], buf, [o for g, o in zip(grads, b.offsets) if g is not None])
        return buf

    def _launch_stage1(self, b: FlatBucket) -> None:
        send = self._stage1_send_buffer(b)
        if C.reduces_in_place(self.process_group):
            # gloo reduces the whole buffer in place: the slice is a view, no copy (stage 1 holds the
            # full gradient until the step ends anyway; freed in _finish_step).
            b.grad_slice = send[b.slice_start:b.slice_end]
        else:
            b.grad_slice = torch.empty(b.spec.shard_numel, dtype=self.reduce_dtype, device=b.device)
        b.pending = C.reduce_scatter_bucket(send, b.grad_slice, self.process_group,
                                            async_op=self.overlap_comm, tag=b.index)
        b.acc = send                                 # keep the send buffer alive until the wait

    def _wait_bucket(self, b: FlatBucket) -> None:
        if self.stage >= 2:
            self._reducer.finish(b)
        elif b.pending is not None:
            C.wait(b.pending)
            b.pending = None
            b.acc = None

    def _reduce_all(self) -> None:
        """Make every bucket's reduced gradient slice available (clip_grad_norm_ needs all)."""
        if self.stage == 1:
            if not self._reduced:
                for b in self.buckets:
                    self._launch_stage1(b)
                self._reduced = True
            for b in self.buckets:
                self._wait_bucket(b)
        else:
            self._flush_stage2()
            self._reducer.finish_all()
            self._active()                  # folds late gradients into the slices

    def _flush_stage2(self) -> None:
        r = self._reducer
        if any(b.acc_unlaunched for b in self.buckets):
            # step() after no_sync-only backwards: reduce what was accumulated (every rank alike).
            for b in self.buckets:
                if not b.launched:
                    r._launch(b)
            r._reset_backward()

    def _active(self) -> Tensor:
        """int32 [num params]: 1 where some rank has a gradient for the parameter (one collective per
        step, cached: clip_grad_norm_ and step share it)."""
        if self._active_cache is None:
            self._active_cache = self._compute_active()
        return self._active_cache

    def _compute_active(self) -> Tensor:
        if self.stage == 1:
            flags = torch.tensor([int(p.grad is not None) for b in self.buckets for p in b.params],
                                 dtype=torch.int32)
            order = [i for b in self.layout.buckets for i in b.params]
            local = torch.zeros(len(self.layout.params), dtype=torch.int32)
            local[torch.tensor(order, dtype=torch.long)] = flags
            C.all_reduce_tensor(local, op=dist.ReduceOp.MAX, group=self.process_group)
            return local
        # Stage 2: one all-reduce carries had-a-grad, arrived-this-step and late-bucket flags.
        n, r = len(self.layout.params), self._reducer
        flags = torch.cat([self._had_grad, self._arrived_step, torch.tensor(r.late, dtype=torch.int32)])
        C.all_reduce_tensor(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        active, arrived, late = flags[:n], flags[n:2 * n], flags[2 * n:]
        if bool(arrived.any()):
            # Next step's reduce-scatters wait only for parameters that got a gradient somewhere now.
            r.set_expected([[bool(arrived[i]) for i in b.spec.params] for b in self.buckets])
        self._arrived_step.zero_()
        for b in self.buckets:
            if late[b.index]:
                self._reducer.finish(b)
                buf = b.late_acc if b.late_acc is not None else torch.zeros(
                    b.spec.padded_numel, dtype=self.reduce_dtype, device=b.device)
                out = torch.empty(b.spec.shard_numel, dtype=self.reduce_dtype, device=b.device)
                C.wait(C.reduce_scatter_bucket(buf, out, self.process_group, async_op=False, tag=("late", b.index)))
                if b.grad_slice is None:
                    b.grad_slice = out
                else:
                    b.grad_slice.add_(out)
            b.late_acc = None
            r.late[b.index] = False
        return active

    # ---- clipping -----------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the global gradient norm (all ranks' slices, tied parameters once, no padding) like
        ``torch.nn.utils.clip_grad_norm_`` on the full model; returns the total norm (fp32). The clip
        coefficient is folded into the next step's grad_scale (no pass over the gradients)."""
        norm_type = float(norm_type)
        self._reduce_all()
        acc = torch.zeros((), dtype=torch.float32, device=self._device)
        for b in self.buckets:
            if b.grad_slice is None:
                continue
            s, e = b.spec.data_bounds(self.rank)
            g = b.grad_slice[: e - s].float()
            if g.numel() == 0:
                continue
            if math.isinf(norm_type):
                acc = torch.maximum(acc, g.abs().max())
            else:
                acc = acc + g.abs().pow(norm_type).sum()
        if math.isinf(norm_type):
            C.all_reduce_tensor(acc, op=dist.ReduceOp.MAX, group=self.process_group)
            total = acc
        else:
            C.all_reduce_tensor(acc, op=dist.ReduceOp.SUM, group=self.process_group)
            total = acc.pow(1.0 / norm_type)
        from .scaling import current_scale
        ls = current_scale(self)
        if ls is not None:                  # the slices hold loss-scaled gradients
            total = total / ls
        coef = float(max_norm) / (total + 1e-6)
        self._clip_coef = torch.clamp(coef, max=1.0)
        return total

    # ---- overlapped parameter all-gather -------------------------------------------------------------
    # [Note: overlapped parameter all-gather]
    # With overlap_param_gather=True (stages 1-2; Megatron's distributed optimizer has the same
    # option) step() does not wait for the parameter all-gathers: it launches them in forward order
    # (the last bucket holds the first layers) and returns. A forward pre-hook on every module that
    # registers a parameter waits for that parameter's bucket just before the module runs, so the
    # all-gather overlaps zero_grad(), data loading and the forward of earlier layers. Anything
    # else that reads the parameters must call wait_for_params() first (step(), state dicts and
    # checkpoints do): a parameter read outside the forward of a module registering it (e.g.
    # ``F.linear(x, self.emb.weight)`` in a parent's forward, or an EMA copy right after step())
    # would otherwise see its value from before the step. Default off for that reason.
    def _gather_hook(self, bucket_indices: list[int]):
        def hook(module, args):
            if self._pending_gathers:
                for bi in bucket_indices:
                    g = self._pending_gathers.pop(bi, None)
                    if g is not None:
                        C.wait(g)
        return hook

    def wait_for_params(self) -> None:
        """Wait for the parameter all-gathers step() left in flight (overlap_param_gather=True);
        a no-op otherwise. Call before reading parameters outside their modules' forward."""
        while self._pending_gathers:
            _, g = self._pending_gathers.popitem()
            C.wait(g)

    # ---- the step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        self.wait_for_params()              # the step writes the slices the gathers read
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stage == 1 and not self._reduced:
            # Launch every reduce-scatter now; they complete while earlier buckets step.
            for b in self.buckets:
                self._launch_stage1(b)
            self._reduced = True
        elif self.stage >= 2:
            self._flush_stage2()
        active = self._active()
        if not bool(active.any()):
            self._finish_step()
            return loss
        from .scaling import check_step
        skip, inv_loss_scale = check_step(self)             # [Note: non-finite gradients]
        if skip:                                            # every rank skips: nothing changes
            self._finish_step()
            return loss
        for i in active.nonzero().flatten().tolist():
            self._steps[i] += 1
        scale = torch.ones(1, dtype=torch.float32, device=self._device)   # slices are averages
        if self._clip_coef is not None:
            scale = scale * self._clip_coef.to(self._device)
        if inv_loss_scale is not None:
            scale = scale * inv_loss_scale
        gathers = []
        for b in self.buckets:
            self._wait_bucket(b)
            bucket_active = any(bool(active[i]) for i in b.spec.params)
            if not bucket_active:
                continue
            self._step_bucket(b, active, scale)
            if self._s3 is not None:        # stage 3: no all-gather, the next forward gathers
                continue
            if self.overlap_param_gather:
                gathers.append(b)
            else:
                gathers.append(C.all_gather_bucket(b.param_flat, self.rank, self.process_group,
                                                   async_op=self.overlap_comm, tag=b.index))
        if self.overlap_param_gather:       # [Note: overlapped parameter all-gather]
            for b in reversed(gathers):
                self._pending_gathers[b.index] = C.all_gather_bucket(
                    b.param_flat, self.rank, self.process_group, async_op=True, tag=b.index)
        else:
            for g in gathers:
                C.wait(g)
        if self._s3 is not None:
            self._s3.after_step()           # gathered copies (if any) are stale now
        self._finish_step()
        return loss

    def _finish_step(self) -> None:
        if self.stage == 1:
            for b in self.buckets:      # stage 1 keeps no reduced slice between steps
                b.grad_slice = None
                b.acc = None
                b.pending = None
        self._reduced = False
        self._clip_coef = None
        self._active_cache = None

    def _runs(self, b: FlatBucket, active: Tensor) -> list[tuple[int, int, int]]:
        """(start, end, step) ranges of b's slice: consecutive active pieces with one step count."""
        runs: list[list[int]] = []
        for pc in b.pieces:
            if not active[pc.param]:
                continue
            st = self._steps[pc.param]
            if runs and runs[-1][1] == pc.start and runs[-1][2] == st:
                runs[-1][1] = pc.start + pc.numel
            else:
                runs.append([pc.start, pc.start + pc.numel, st])
        return [tuple(r) for r in runs]

    def _step_bucket(self, b: FlatBucket, active: Tensor, scale: Tensor) -> None:
        runs = self._runs(b, active)
        if not runs:
            return
        g = self.param_groups[b.spec.group]
        beta1, beta2 = g["betas"]
        sl = [slice(s, e) for s, e, _ in runs]
        masters = [b.master[x] for x in sl]
        grads = [b.grad_slice[x] for x in sl]
        m = [b.exp_avg[x] for x in sl]
        v = [b.exp_avg_sq[x] for x in sl]
        vmax = [b.max_exp_avg_sq[x] for x in sl] if g["amsgrad"] else None
        p16 = None if b.master_is_param else [b.owned_params[x] for x in sl]
        steps = torch.tensor([st for _, _, st in runs], dtype=torch.float64)
        coeffs = compute_coeffs(steps, g["lr"], beta1, beta2, g["weight_decay"], self._adamw,
                                device=self._device)
        self._fused(masters, grads, m, v, vmax, p16, coeffs, beta1=beta1, beta2=beta2, eps=g["eps"],
                    weight_decay=g["weight_decay"], adamw=self._adamw, maximize=g["maximize"],
                    grad_scale=scale)

    # ---- introspection ------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """Stage 3 on CPU: return the freed gathered-parameter buffers kept for reuse to the
        system (``memory_report()["gather_cache"]``), as ``torch.cuda.empty_cache()`` does for the
        CUDA caching allocator. The next gathers allocate (and page-fault) fresh buffers."""
        from .stage3 import empty_gather_cache
        empty_gather_cache()

    def memory_report(self) -> dict[str, Any]:
        """Bytes this rank holds for model states now (call after step()), and the formula's
        prediction for this stage, world size and dtypes (zero_kernels.memory.model_state_bytes)."""
        if self._s3 is not None:            # + the gathered working set (stage3.py)
            return self._s3.memory_report()
        nb = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        rep = {"params": sum(nb(b.param_flat) for b in self.buckets), "grads": 0,
               "master_params": sum(0 if b.master_is_param else nb(b.master) for b in self.buckets),
               "exp_avg": sum(nb(b.exp_avg) for b in self.buckets),
               "exp_avg_sq": sum(nb(b.exp_avg_sq) + nb(b.max_exp_avg_sq) for b in self.buckets)}
        seen = set()
        for b in self.buckets:
            rep["grads"] += nb(b.grad_slice) + nb(b.spare_slice) + nb(b.grad_flat) + nb(b.acc)
            base = b.grad_flat.data_ptr() if b.grad_flat is not None else None
            for p in b.params:
                if p.grad is not None and id(p.grad) not in seen:
                    seen.add(id(p.grad))
                    if base is None or not (base <= p.grad.data_ptr() < base + nb(b.grad_flat)):
                        rep["grads"] += nb(p.grad)
        rep["buffers"] = sum(nb(t) for t in self.module.buffers()) + sum(nb(p.data) for p in self._frozen)
        # stage 2: recycled full-size reduce buffers kept between steps (not model states; hooks.py)
        rep["comm_buffers"] = self._reducer.pool_bytes() if self._reducer is not None else 0
        rep["total"] = sum(rep[k] for k in ("params", "grads", "master_params", "exp_avg", "exp_avg_sq"))
        psi = self.layout.numel
        pbytes = self.buckets[0].param_flat.element_size()
        gbytes = pbytes if self.stage == 1 else torch.empty((), dtype=self.reduce_dtype).element_size()
        mbytes = 0 if all(b.master_is_param for b in self.buckets) else 4
        try:
            from ..memory import model_state_bytes
            rep["predicted"] = model_state_bytes(psi, self.world_size, self.stage, param_bytes=pbytes,
                                                 grad_bytes=gbytes, master_bytes=mbytes, optim_bytes=8)
        except ImportError:  # zero_kernels.memory not available in this checkout
            rep["predicted"] = None
        rep["padding_elements"] = sum(b.spec.padded_numel - b.spec.numel for b in self.buckets)
        return rep

    @torch.no_grad()
    def full_model_state_dict(self) -> dict[str, Tensor]:
        """The full, unsharded model state dict on every rank (collective): trainable parameters as
        their fp32 masters (tied names each point at the same values), frozen parameters and
        buffers as the module holds them."""
        self.wait_for_params()
        full: dict[str, Tensor] = {}
        for b in self.buckets:
            if b.master_is_param and self._s3 is None:
                flat = b.param_flat.detach().clone()
            else:
                flat = torch.empty(b.spec.padded_numel, dtype=torch.float32, device=b.device)
                flat[b.slice_start:b.slice_end].copy_(b.master)
                C.wait(C.all_gather_bucket(flat, self.rank, self.process_group, async_op=False))
            for ps in b.param_specs:
                t = flat[ps.offset:ps.offset + ps.numel].view(ps.shape).clone()
                for n in (ps.name,) + ps.aliases:
                    full[n] = t
        return {k: full[ps.name] if ps is not None else v.detach().clone()     # [Note: state-dict keys]
                for k, ps, v in keyed_state(self.module, self.buckets)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: per bucket its fp32 slices, per parameter its step, the hyperparameters,
        and the layout (plain data) with its fingerprint."""
        groups = []
        for g in self.param_groups:
            groups.append({k: v for k, v in g.items() if k != "params"})
        return {"format": SHARD_FORMAT, "version": SHARD_VERSION, "stage": self.stage,
                "rank": self.rank, "world_size": self.world_size,
                "layout_fingerprint": self.layout.fingerprint(), "layout": self.layout.to_dict(),
                "steps": list(self._steps), "param_groups": groups,
                "state": [{k: t.detach().clone() for k, t in b.state_tensors().items()} for b in self.buckets]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a shard saved by state_dict() on the same rank of the same layout (collective: the
        working parameters are refreshed from the loaded masters by an all-gather). Raises before
        changing anything when the shard belongs to another layout or rank."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != SHARD_FORMAT:
            raise ValueError("not a ZeroAdamW shard (missing format tag); a torch.optim state dict cannot "
                             "be loaded here: use full_model_state_dict()/checkpoint tools")
        if state_dict.get("version") != SHARD_VERSION:
            raise ValueError(f"shard format version {state_dict.get('version')} is not supported "
                             f"(this build reads version {SHARD_VERSION})")
        fp, mine = state_dict.get("layout_fingerprint"), self.layout.fingerprint()
        if fp != mine or state_dict.get("world_size") != self.world_size:
            raise ValueError(
                f"this shard was saved with layout {fp} (world size {state_dict.get('world_size')}, "
                f"rank {state_dict.get('rank')}) but this optimizer's layout is {mine} (world size "
                f"{self.world_size}): the model, param groups, bucket_size, param_dtype and world size must "
                "match; to change them, reshard a full checkpoint instead")
        if state_dict.get("rank") != self.rank:
            raise ValueError(f"this shard belongs to rank {state_dict.get('rank')}, but this is rank "
                             f"{self.rank}: load each rank's own shard")
        states = state_dict["state"]
        for b, st in zip(self.buckets, states):
            for k, t in b.state_tensors().items():
                if k not in st or st[k].shape != t.shape:
                    raise ValueError(f"shard bucket {b.index}: missing or mis-shaped {k!r}")
        self.wait_for_params()
        for b, st in zip(self.buckets, states):
            for k, t in b.state_tensors().items():
                t.copy_(st[k])
            if not b.master_is_param:
                b.owned_params.copy_(b.master)
        self._steps = list(state_dict["steps"])
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in saved.items():
                g[k] = tuple(v) if k == "betas" else v
        if self._s3 is not None:
            self._s3.after_step()           # stage 3: shards loaded, the next forward gathers
            return
        for b in self.buckets:
            C.wait(C.all_gather_bucket(b.param_flat, self.rank, self.process_group, async_op=False))


    # ---- checkpoints (zero_kernels/checkpoint.py: format, atomicity, resharding) ------------------
    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss * scale`` with ``loss_scale="dynamic"`` or a float (identity otherwise); call
        ``.backward()`` on the result. The step unscales inside the fused kernel."""
        return loss if self.loss_scaler is None else loss * self.loss_scaler.scale

    def save_checkpoint(self, path) -> str:
        """Collective: every rank writes its shard of a resharding checkpoint under ``path``."""
        from ..checkpoint import save_checkpoint
        with C.timeout_scope(self._timeout, self.process_group):
            return save_checkpoint(self, path)

    def load_checkpoint(self, path, verify: bool = True) -> None:
        """Collective: load a checkpoint saved at any world size / stage / bucket size
        (``verify=False`` skips the sha256 check of the tensor files)."""
        from ..checkpoint import load_checkpoint
        with C.timeout_scope(self._timeout, self.process_group):
            load_checkpoint(self, path, verify=verify)


def _bucket_class(stage: int):
    if stage == 3:
        from .stage3 import UnitBucket      # full parameter buffer only while gathered
        return UnitBucket
    return FlatBucket


class ZeroAdam(ZeroAdamW):
    """ZeRO Adam with L2 weight decay added to the gradient (torch.optim.Adam semantics)."""
    _adamw = False


# ---- helpers ---------------------------------------------------------------------------------------
def _check_hparams(lr, betas, eps, weight_decay, where: str) -> None:
    if not isinstance(lr, (float, int)) or lr < 0:
        raise ValueError(f"invalid learning rate{where}: {lr!r} (must be a float >= 0)")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"invalid betas{where}: {betas!r} (need two floats in [0, 1))")
    if eps < 0:
        raise ValueError(f"invalid eps{where}: {eps!r} (must be >= 0)")
    if weight_decay < 0:
        raise ValueError(f"invalid weight_decay{where}: {weight_decay!r} (must be >= 0)")


def _model_error(trainable, param_dtype) -> str | None:
    devices = set()
    for n, p in trainable:
        if p.dtype not in _FLOAT:
            return (f"parameter {n!r} has dtype {p.dtype}: ZeRO shards float32/bfloat16/float16 "
                    "parameters only; set requires_grad=False on it to leave it out")
        if p.is_sparse:
            return f"parameter {n!r} is sparse; ZeRO needs dense parameters"
        devices.add(p.device)
    if len(devices) > 1:
        where = {str(d): next(n for n, p in trainable if p.device == d) for d in devices}
        return (f"trainable parameters are on several devices {where}: move the model to one device "
                "before constructing the optimizer")
    return None


def _resolve_groups(param_groups, trainable, first_name, uniq, lr, betas, eps, weight_decay, amsgrad,
                    maximize):
    """Groups as torch.optim param_group dicts of Parameters; group index per parameter id."""
    ids = {id(p): n for n, p in trainable}
    if param_groups is None:
        return [{"params": [p for _, p in trainable]}], {id(p): 0 for _, p in trainable}, None
    by_name = {n: p for n, p in uniq}
    out, group_of = [], {}
    for gi, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            return [], {}, f"param_groups[{gi}] must be a dict with a 'params' list"
        ps = []
        for x in (list(g["params"]) if not isinstance(g["params"], Tensor) else [g["params"]]):
            p = by_name.get(x) if isinstance(x, str) else x
            if p is None or (id(p) not in first_name):
                what = repr(x) if isinstance(x, str) else f"a tensor of shape {tuple(x.shape)}"
                return [], {}, f"param_groups[{gi}] holds {what}, which is not a parameter of the model"
            if id(p) not in ids:
                continue                    # frozen: silently left out, like the default group
            if id(p) in group_of:
                return [], {}, (f"parameter {ids[id(p)]!r} appears in param_groups[{group_of[id(p)]}] and "
                                f"param_groups[{gi}]; each parameter must be in exactly one group")
            group_of[id(p)] = gi
            ps.append(p)
        extra = {k: v for k, v in g.items() if k != "params"}
        unknown = set(extra) - {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"}
        if unknown:
            return [], {}, f"param_groups[{gi}] has unknown keys {sorted(unknown)}"
        try:
            _check_hparams(extra.get("lr", lr), extra.get("betas", betas), extra.get("eps", eps),
                           extra.get("weight_decay", weight_decay), where=f" in param_groups[{gi}]")
        except ValueError as e:
            return [], {}, str(e)
        if not ps:
            return [], {}, f"param_groups[{gi}] holds no trainable parameter; remove it"
        out.append({"params": ps, **extra})
    missing = [n for n, p in trainable if id(p) not in group_of]
    if missing:
        return [], {}, (f"trainable parameter {missing[0]!r} (and {len(missing) - 1} more) is in no param "
                        "group: add it to one, or set requires_grad=False on it")
    return out, group_of, None


def _join_barrier(group, timeout, world: int) -> None:
    """Fail with a clear error when a rank of the group never arrives (instead of hanging)."""
    try:
        if dist.get_backend(group) == "gloo":
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
            return
    except RuntimeError as e:
        raise C.CollectiveTimeoutError(
            f"ZeroAdamW construction: not every rank of the process group ({world} ranks) arrived within "
            f"{timeout.total_seconds():g} s: {str(e).splitlines()[0][:300]}. Likely cause: a rank died or "
            "never constructed the optimizer") from e
    with C.timeout_scope(timeout, group):
        C.all_reduce_tensor(torch.zeros(1), group=group)


def _with_timeout(fn):
    """Run a collective-issuing method inside the optimizer's timeout scope."""
    import functools

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        timeout = getattr(self, "_timeout", None)
        with C.timeout_scope(timeout, getattr(self, "process_group", None)):
            try:
                return fn(self, *args, **kwargs)
            except C.CollectiveTimeoutError:
                raise
            except RuntimeError as e:   # a peer failure surfacing when a collective is *issued*
                msg = str(e)
                if timeout is None or not any(k in msg for k in ("Connection closed", "Connection reset",
                                                                   "Timed out", "timed out")):
                    raise
                raise C.CollectiveTimeoutError(C._timeout_message(
                    f"a collective in {fn.__name__}()", None, self.process_group, timeout, 0.0, e)) from e
    return wrapper


for _name in ("step", "clip_grad_norm_", "zero_grad", "full_model_state_dict", "load_state_dict"):
    setattr(ZeroAdamW, _name, _with_timeout(ZeroAdamW.__dict__[_name]))
del _name


def _check_same_everywhere(signature: dict, group, world: int, rank: int) -> None:
    if world == 1:
        if signature["error"]:
            raise ValueError(signature["error"])
        return
    sigs: list = [None] * world
    dist.all_gather_object(sigs, signature, group=group)
    errs = [(r, s["error"]) for r, s in enumerate(sigs) if s["error"]]
    if errs:
        r, e = errs[0]
        raise ValueError(e if r == rank else f"rank {r} of the process group failed to construct: {e}")
    ref = sigs[0]
    for r, s in enumerate(sigs[1:], start=1):
        if s == ref:
            continue
        if s["config"] != ref["config"]:
            raise ValueError(f"rank {r} constructs the optimizer with (stage, bucket_size, param_dtype, "
                             f"reduce_dtype, alignment) = {s['config']} but rank 0 with {ref['config']}")
        a, b = ref["params"], s["params"]
        if len(a) != len(b):
            raise ValueError(f"the model on rank {r} has {len(b)} parameters but rank 0's has {len(a)}: "
                             "every rank of the data-parallel group must build the same model")
        for x, y in zip(a, b):
            if x != y:
                raise ValueError(f"the models differ across ranks: parameter (name, shape, dtype, "
                                 f"requires_grad) is {x} on rank 0 but {y} on rank {r}; every rank of the "
                                 "data-parallel group must build the same model")
        raise ValueError(f"param_groups differ between rank 0 and rank {r}")
