"""ZeRO stage 3: parameters sharded too, gathered just in time per sharding unit, freed after use.

[Note: stage-3 units]
A *unit* is a module whose parameters are gathered and freed together. ``wrap=None`` (default): the
root's direct children (looking through ``nn.ModuleList`` / ``nn.ModuleDict``, which have no
forward) that hold parameters are units; ``wrap`` may instead be a callable ``module -> bool`` or a
list of module classes (every non-root module it selects is a unit; units may nest). The root is
always unit 0 and owns every parameter not inside another unit. A parameter belongs to the
innermost unit enclosing the module that registers it. Buckets never span units
(``build_layout(unit_of=...)``, ``BucketSpec.unit``): a unit is one bucket per (param group, dtype)
or several when larger than ``bucket_size``, so the per-bucket state (``master``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``: ``shard_numel`` each), ``_steps`` per parameter, ``state_dict()``
and ``full_model_state_dict()`` are the same code for every stage.

Tied parameters: a parameter registered under modules of two different units (embedding + output
head) belongs to the ROOT unit, which is gathered at the start of forward and stays gathered until
its gradients are complete (the end of backward): both users see it. Frozen parameters
(``requires_grad=False``) are not sharded: they stay replicated, full-size, on every rank (cast to
``param_dtype`` when one is given), like in stages 1-2. A parameter used *outside* the forward of
its unit (e.g. ``F.linear(x, self.emb.weight)`` in the root while ``emb`` is a unit) must be
registered there too (then it is tied: root unit) or the unit chosen with ``wrap``.

[Note: stage-3 storage]
Per bucket, persistently: ``shard`` (this rank's ``shard_numel`` slice of the working parameters:
the fused step writes it; for fp32 parameters it *is* the master) and the fp32 optimizer slices.
The full flat buffer ``param_flat`` keeps one storage for the life of the optimizer; freeing
resizes that storage to 0 bytes (``untyped_storage().resize_(0)``) AND points every parameter's
``.data`` at an empty tensor (so the module holds no full storage and a stray read fails with a
shape error instead of reading freed memory). Gathering resizes the storage back, copies the shard
into its slice, all-gathers, and points ``.data`` back at views of the buffer. The Parameter
objects never change. Resizing the *same* storage (as FSDP2 does) matters for autograd: tensors
saved in forward that are views of a parameter (``weight.t()`` in ``F.linear``) point into that
storage; they do not keep the memory alive while freed, and are valid again once re-gathered.
On CPU with ``gather_cache=True`` that storage allocates from the gather cache ([Note: the gather
cache] in csrc/block_cache.cpp): the freed block is kept for the next gather instead of being
page-faulted in again (at most ``Stage3.cache_limit`` bytes: the gathered working set).

[Note: stage-3 hooks]
Forward (module hooks on each unit): the pre-hook waits for the unit's all-gather (issuing it if
no prefetch did) and issues the async all-gathers of the next ``prefetch`` units of the forward
call sequence recorded in the first forward; the post-hook frees the unit (``reshard_after_forward``)
and registers a pre-backward hook (``Tensor.register_hook``) on every output that requires grad.
The root unit, and the last unit of the recorded forward order, are not freed after a forward
that needs a backward: they are the first to get gradients (FSDP2 keeps its root the same way);
this saves one all-gather per step. A forward that runs *inside* backward (activation
checkpointing recomputation, ``torch._C._current_graph_task_id() != -1``) gathers and never frees:
the unit is freed when its gradients are complete.
Backward: the first output gradient of a unit (per call: a unit called twice has hooks on both
calls' outputs; the hook is idempotent) re-gathers it and prefetches the next ``prefetch`` units of
the backward sequence (the reverse forward post-order in the first backward, the recorded order
afterwards). Gradients go through the stage-2 reducer (``hooks.py``: post-accumulate-grad hooks,
fp32 flatten, async reduce-scatter into ``grad_slice``, no_sync accumulation, late gradients):
a bucket's parameters are freed as soon as *every* parameter of the bucket delivered its
gradient in this backward. AccumulateGrad runs once per backward after all uses of a parameter,
so a unit called twice is reduced after its last use; with reentrant checkpointing a parameter
can deliver twice (one nested backward per region): the second is a "late" gradient, still
correct. One end-of-backward callback (queued on the outermost backward) completes the reducer
and frees whatever is still gathered (parameters without gradients).

Every rank must call the same units in the same order (as with FSDP): the all-gathers are
collectives issued from forward hooks.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from . import collectives as C
from .buckets import FlatBucket
from .flat import flatten
from .hooks import Stage2Reducer
from .layout import Layout

__all__ = ["assign_units", "UnitBucket", "Stage3", "Stage3Reducer"]

FREE, GATHERING, GATHERED = 0, 1, 2


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _cache_module():
    """The C++ extension when it has the gather cache ([Note: the gather cache] in
    csrc/block_cache.cpp), else None (then gathered buffers come from torch's allocator)."""
    from .. import _ext
    mod = _ext.cpu_module()
    return mod if mod is not None and hasattr(mod, "cached_empty") else None


def _full_buffer(numel: int, dtype: torch.dtype, device: torch.device, cached: bool) -> Tensor:
    """A unit bucket's full parameter buffer. On CPU with ``cached``, its storage allocates from the
    gather cache, so the resize_(0) / resize_(n) of every free / gather reuses a block instead of
    page-faulting a fresh one in (GPUs get the same from the CUDA caching allocator)."""
    if cached and device.type == "cpu":
        mod = _cache_module()
        if mod is not None:
            return mod.cached_empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def gather_cache_stats() -> dict[str, int]:
    """Process-wide gather cache counters (all zero when the extension is unavailable)."""
    mod = _cache_module()
    if mod is None:
        return {"cached_bytes": 0, "live_bytes": 0, "limit_bytes": 0, "hits": 0, "misses": 0}
    return dict(mod.cache_stats())


def empty_gather_cache() -> None:
    mod = _cache_module()
    if mod is not None:
        mod.cache_empty()


# ---- unit policy --------------------------------------------------------------------------------
def _unit_modules(model: nn.Module, wrap) -> list[tuple[str, nn.Module]]:
    if wrap is None:
        out = []

        def visit(prefix: str, mod: nn.Module) -> None:
            for name, child in mod.named_children():
                path = prefix + name
                if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                    visit(path + ".", child)
                elif any(True for _ in child.parameters()):
                    out.append((path, child))
        visit("", model)
        seen, uniq = set(), []
        for n, m in out:
            if id(m) not in seen:
                seen.add(id(m))
                uniq.append((n, m))
        return uniq
    if isinstance(wrap, (list, tuple, set)):
        classes = tuple(wrap)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"wrap must be None, a callable module -> bool or a list of nn.Module classes, "
                            f"got {wrap!r}")
        pred: Callable[[nn.Module], bool] = lambda m: isinstance(m, classes)  # noqa: E731
    elif callable(wrap):
        pred = wrap
    else:
        raise TypeError(f"wrap must be None, a callable module -> bool or a list of nn.Module classes, got {wrap!r}")
    out = []
    for n, m in model.named_modules():
        if n and pred(m):
            if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
                raise ValueError(f"wrap selected {n!r}, a {type(m).__name__}: it has no forward, so it cannot "
                                 "gather its parameters; select its children instead")
            out.append((n, m))
    return out


def assign_units(model: nn.Module, trainable: Sequence[tuple[str, nn.Parameter]], wrap=None):
    """Returns (units, unit_of): units = [(name, module)] with the root first ("" , model);
    unit_of[i] = unit of trainable[i] (see [Note: stage-3 units])."""
    units = [("", model)] + _unit_modules(model, wrap)
    ids = {id(m): i for i, (_, m) in enumerate(units)}
    unit_paths: dict[str, int] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        if path and id(m) in ids:
            unit_paths[path] = ids[id(m)]
    owners: dict[int, set[int]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        best, best_len = 0, -1
        for up, ui in unit_paths.items():
            if (path == up or path.startswith(up + ".")) and len(up) > best_len:
                best, best_len = ui, len(up)
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(best)
    unit_of = []
    for _, p in trainable:
        o = owners.get(id(p), {0})
        unit_of.append(next(iter(o)) if len(o) == 1 else 0)   # tied across units -> root
    return units, unit_of


# ---- storage ---------------------------------------------------------------------------------------
class UnitBucket(FlatBucket):
    """A FlatBucket whose full parameter buffer exists only while gathered ([Note: stage-3 storage])."""

    use_gather_cache = False          # set by ZeroAdamW(gather_cache=...) before bind()

    def bind(self, originals: Sequence[Tensor]) -> None:
        spec = self.spec
        flat = _full_buffer(spec.padded_numel, self.dtype, self.device, self.use_gather_cache).zero_()
        flatten(list(originals), flat, self.offsets)
        self.shard = flat[self.slice_start:self.slice_end].clone()
        if self.dtype == torch.float32:
            master = self.shard                              # the fp32 parameter slice IS the master
        else:
            master = torch.zeros(spec.shard_numel, dtype=torch.float32, device=self.device)
            for pc in self.pieces:
                src = originals[spec.params.index(pc.param)].reshape(-1)
                master[pc.start:pc.start + pc.numel].copy_(src[pc.param_start:pc.param_start + pc.numel])
        self.param_flat = flat
        self.master = master
        self.exp_avg = torch.zeros(spec.shard_numel, dtype=torch.float32, device=self.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        if self.amsgrad:
            self.max_exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.state = GATHERED
        self.ag = None                                       # AllGatherResult in flight
        self.s3_arrived: set[int] = set()                    # params with a gradient this backward
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.free()

    @property
    def owned_params(self) -> Tensor:
        return self.shard

    @property
    def full_bytes(self) -> int:
        return self.spec.padded_numel * self.param_flat.element_size()

    def held_bytes(self) -> int:
        return self.param_flat.untyped_storage().nbytes()

    def start_gather(self, rank: int, group, async_op: bool, tag: Any) -> bool:
        if self.state != FREE:
            return False
        flat = self.param_flat
        flat.untyped_storage().resize_(self.full_bytes)
        flat[self.slice_start:self.slice_end].copy_(self.shard)
        self.ag = C.all_gather_bucket(flat, rank, group, async_op=async_op, tag=tag)
        self.state = GATHERING
        return True

    def finish_gather(self) -> None:
        if self.state == GATHERING:
            C.wait(self.ag)
            self.ag = None
            flat = self.param_flat
            for p, ps in zip(self.params, self.param_specs):
                p.data = flat[ps.offset:ps.offset + ps.numel].view(ps.shape)
            self.state = GATHERED

    def free(self) -> None:
        if self.state == FREE:
            return
        if self.state == GATHERING:
            C.wait(self.ag)
            self.ag = None
        for p in self.params:
            p.data = self._empty
        self.param_flat.untyped_storage().resize_(0)
        self.state = FREE


# ---- the reducer: stage 2's, plus "free a bucket once all its gradients arrived" ---------------------
class Stage3Reducer(Stage2Reducer):
    def __init__(self, owner: "Stage3", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.owner = owner

    @torch.no_grad()
    def on_grad(self, b: FlatBucket, li: int, p: nn.Parameter) -> None:
        if not self.in_backward:
            # The end-of-backward work is queued once, on the outermost backward (see note).
            self.in_backward = True
            self.owner._ensure_final_callback()
        super().on_grad(b, li, p)
        if li in b.s3_arrived:
            # A second delivery in one backward (reentrant checkpoint regions run one nested backward
            # each): count a new round, else the bucket would be freed while its other parameters
            # still expect AccumulateGrad (which needs their full shape).
            b.s3_arrived.clear()
        b.s3_arrived.add(li)
        if len(b.s3_arrived) == len(b.params):
            self.owner._free(b)


# ---- the runtime --------------------------------------------------------------------------------------
class _Unit:
    def __init__(self, index: int, name: str, module: nn.Module, buckets: list[UnitBucket]):
        self.index, self.name, self.module, self.buckets = index, name, module, buckets
        self.bwd_seen = False                 # pre-backward ran in the current backward


class Stage3:
    def __init__(self, opt, units: list[tuple[str, nn.Module]], prefetch: int, reshard_after_forward: bool):
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
        self.opt = opt
        self.group = opt.process_group
        self.rank = opt.rank
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.units = [_Unit(i, n, m, [b for b in opt.buckets if b.spec.unit == i])
                      for i, (n, m) in enumerate(units)]
        self.reducer = Stage3Reducer(self, opt.buckets, opt.process_group, opt.reduce_dtype, True,
                                     opt._mark_grad)
        # Recycle up to 2 full-size fp32 gradient buffers between backwards (hooks.py note, point 6:
        # a fresh multi-MB buffer is page-faulted in on every use); never more than the gradient
        # slice's own size; reported as comm_buffers.
        self.reducer.pool_keep = 2
        self.reducer.register()
        # Gather cache limit: the gathered working set (root + current + prefetched + the unit
        # kept for backward), so every gather of a step can reuse a block and nothing more is kept.
        unit_bytes = [sum(b.full_bytes for b in u.buckets) for u in self.units]
        largest = max(unit_bytes[1:], default=0)
        self.cache_limit = unit_bytes[0] + (2 + prefetch) * largest
        mod = _cache_module() if any(b.use_gather_cache for b in opt.buckets) else None
        if mod is not None:
            mod.cache_set_limit(max(self.cache_limit, mod.cache_stats()["limit_bytes"]))
        self.handles = []
        for u in self.units:
            if u.buckets or u.index == 0:
                self.handles.append(u.module.register_forward_pre_hook(self._pre_forward_hook(u)))
                self.handles.append(u.module.register_forward_hook(self._post_forward_hook(u)))
        # sequences (unit indices, with repeats) recorded in the first forward / backward
        self.fwd_seq: list[int] | None = None
        self.fwd_post_seq: list[int] | None = None
        self.bwd_seq: list[int] | None = None
        self._rec_fwd: list[int] = []
        self._rec_post: list[int] = []
        self._rec_bwd: list[int] = []
        self._fwd_pos = 0
        self._bwd_pos = 0
        self._last_unit: int | None = None    # last unit of the forward: kept for backward
        self._in_forward = False
        self._final_queued = False
        self.gathered_bytes = 0
        self.peak_gathered_bytes = 0
        self.peak_gathered_units = 0
        self.num_gathers = 0

    # ---- gather / free ----------------------------------------------------------------------------
    def _start(self, u: _Unit, async_op: bool = True) -> None:
        for b in u.buckets:
            if b.start_gather(self.rank, self.group, async_op, ("unit", u.index, b.index)):
                self.num_gathers += 1
                self.gathered_bytes += b.full_bytes
        if self.gathered_bytes > self.peak_gathered_bytes:
            self.peak_gathered_bytes = self.gathered_bytes
        n = sum(1 for x in self.units if any(b.state != FREE for b in x.buckets))
        self.peak_gathered_units = max(self.peak_gathered_units, n)

    def _ensure(self, u: _Unit) -> None:
        self._start(u)
        for b in u.buckets:
            b.finish_gather()

    def _free(self, b: UnitBucket) -> None:
        if b.state != FREE:
            b.free()
            self.gathered_bytes -= b.full_bytes

    def _free_unit(self, u: _Unit) -> None:
        for b in u.buckets:
            self._free(b)

    def free_all(self) -> None:
        for u in self.units:
            self._free_unit(u)

    def _prefetch(self, seq: list[int] | None, pos: int) -> None:
        if not seq or self.prefetch <= 0:
            return
        issued, seen = 0, set()
        for ui in seq[pos + 1:]:
            if issued >= self.prefetch:
                break
            if ui in seen:
                continue
            seen.add(ui)
            u = self.units[ui]
            if not u.buckets:
                continue
            self._start(u)
            issued += 1

    @staticmethod
    def _advance(seq: list[int] | None, pos: int, ui: int) -> int:
        """Position of unit ui in seq at or after pos (resynchronise), or -1."""
        if not seq:
            return -1
        for j in range(pos, len(seq)):
            if seq[j] == ui:
                return j
        return -1

    # ---- forward hooks ----------------------------------------------------------------------------
    def _pre_forward_hook(self, u: _Unit):
        def hook(module, args):
            if _in_backward():                        # checkpoint recomputation
                self._ensure(u)
                return None
            if u.index == 0:
                self._in_forward = True
                self._fwd_pos = 0
                self._rec_fwd, self._rec_post = [], []
            if self._in_forward:
                self._rec_fwd.append(u.index)
                j = self._advance(self.fwd_seq, self._fwd_pos, u.index)
                self._ensure(u)
                if j >= 0:
                    self._prefetch(self.fwd_seq, j)
                    self._fwd_pos = j + 1
            else:
                self._ensure(u)
            return None
        return hook

    def _post_forward_hook(self, u: _Unit):
        def hook(module, args, output):
            if _in_backward():
                return None
            needs_grad = False
            if torch.is_grad_enabled():
                for t in _grad_tensors(output):
                    t.register_hook(self._pre_backward_hook(u))
                    needs_grad = True
            if self._in_forward:
                self._rec_post.append(u.index)
            keep_last = needs_grad and self._in_forward and u.index == self._last_unit
            if u.index == 0:
                self._in_forward = False
                if self.fwd_seq is None:
                    self.fwd_seq, self.fwd_post_seq = self._rec_fwd, self._rec_post
                    rest = [i for i in self._rec_post if i != 0]
                    self._last_unit = rest[-1] if rest else None
                if self.reshard_after_forward:
                    for x in self.units[1:]:          # also prefetched units that did not run
                        if not (needs_grad and x.index == self._last_unit):
                            self._free_unit(x)
                    if not needs_grad:
                        self._free_unit(u)
            elif self.reshard_after_forward and not keep_last:
                self._free_unit(u)
            return None
        return hook

    # ---- backward -----------------------------------------------------------------------------------
    def _ensure_final_callback(self) -> None:
        if not self._final_queued:
            self._final_queued = True
            self._bwd_pos = 0
            self._rec_bwd = []
            Variable._execution_engine.queue_callback(self._post_backward)

    def _pre_backward_hook(self, u: _Unit):
        def hook(grad):
            with torch.no_grad():
                self._ensure_final_callback()
                self._ensure(u)
                if not u.bwd_seen:
                    u.bwd_seen = True
                    self._rec_bwd.append(u.index)
                    seq = self.bwd_seq
                    if seq is None and self.fwd_post_seq:
                        seq = self.fwd_post_seq[::-1]
                    j = self._advance(seq, self._bwd_pos, u.index)
                    if j >= 0:
                        self._prefetch(seq, j)
                        self._bwd_pos = j + 1
            return None
        return hook

    def _post_backward(self) -> None:
        with torch.no_grad():
            r = self.reducer
            if r.in_backward:
                r.post_backward()
            self._final_queued = False
            if self.bwd_seq is None and self._rec_bwd:
                self.bwd_seq = self._rec_bwd
            for u in self.units:
                u.bwd_seen = False
                for b in u.buckets:
                    b.s3_arrived.clear()
            self.free_all()

    # ---- step / introspection --------------------------------------------------------------------------
    def after_step(self) -> None:
        """The shards changed: any gathered copy is stale."""
        self.free_all()

    @contextlib.contextmanager
    def gathered(self):
        """Gather every unit (collective), yield, free them again (read-only use: writes to the
        parameters are not propagated to the shards)."""
        with torch.no_grad():
            for u in self.units:
                self._start(u, async_op=True)
            for u in self.units:
                for b in u.buckets:
                    b.finish_gather()
        try:
            yield
        finally:
            self.free_all()

    def memory_report(self) -> dict[str, Any]:
        opt = self.opt
        nb = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        bs = opt.buckets
        rep = {"params": sum(nb(b.shard) + b.held_bytes() for b in bs),
               "grads": sum(nb(b.grad_slice) + nb(b.spare_slice) + nb(b.acc) + nb(b.late_acc) for b in bs),
               "master_params": sum(0 if b.master_is_param else nb(b.master) for b in bs),
               "exp_avg": sum(nb(b.exp_avg) for b in bs),
               "exp_avg_sq": sum(nb(b.exp_avg_sq) + nb(b.max_exp_avg_sq) for b in bs)}
        for b in bs:
            for p in b.params:
                if p.grad is not None:
                    rep["grads"] += nb(p.grad)
        rep["buffers"] = sum(nb(t) for t in opt.module.buffers()) + sum(nb(p.data) for p in opt._frozen)
        rep["total"] = sum(rep[k] for k in ("params", "grads", "master_params", "exp_avg", "exp_avg_sq"))
        rep["comm_buffers"] = self.reducer.pool_bytes()
        # freed gathered buffers kept for reuse (process-wide; ZeroAdamW.empty_cache() releases them)
        rep["gather_cache"] = gather_cache_stats()["cached_bytes"]
        rep["gathered_params"] = sum(b.held_bytes() for b in bs)
        rep["peak_gathered_params"] = self.peak_gathered_bytes
        rep["peak_gathered_units"] = self.peak_gathered_units
        rep["largest_unit_bytes"] = max((sum(b.full_bytes for b in u.buckets) for u in self.units), default=0)
        rep["num_units"] = sum(1 for u in self.units if u.buckets)
        psi = opt.layout.numel
        pbytes = bs[0].param_flat.element_size()
        gbytes = torch.empty((), dtype=opt.reduce_dtype).element_size()
        mbytes = 0 if all(b.master_is_param for b in bs) else 4
        from ..memory import model_state_bytes
        rep["predicted"] = model_state_bytes(psi, opt.world_size, 3, param_bytes=pbytes, grad_bytes=gbytes,
                                             master_bytes=mbytes, optim_bytes=8)
        rep["padding_elements"] = sum(b.spec.padded_numel - b.spec.numel for b in bs)
        return rep

    def reset_peak(self) -> None:
        self.peak_gathered_bytes = self.gathered_bytes
        self.peak_gathered_units = sum(1 for x in self.units if any(b.state != FREE for b in x.buckets))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.reducer.remove()


def _grad_tensors(output) -> list[Tensor]:
    out = []

    def visit(x):
        if isinstance(x, Tensor):
            if x.requires_grad:
                out.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)
    visit(output)
    return out
