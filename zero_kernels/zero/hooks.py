"""Stage-2 gradient hooks: hand each gradient to its bucket, reduce-scatter buckets as they fill.

[Note: stage-2 gradient flow]
1. ``register_post_accumulate_grad_hook`` fires once per parameter per backward (tied parameters
   are one Parameter, so once). The hook takes ``p.grad`` (and leaves an empty placeholder, [Note: gradient
   placeholders] in grad_guard.py: the full-size gradient is never kept).
2. The hook copies it at once into its region of the bucket's full-size accumulation buffer
   (one ``copy_``/``add_`` on a view, cast to ``reduce_dtype``, fp32 by default: no flatten
   launch and no host-to-device copy of pointer tables per gradient), so autograd's gradient is freed right away, as DDP frees
   its own. (Holding a bucket's gradients until all arrived and freeing them together left large
   free blocks that glibc returned to the system: every backward then page-faulted its gradients
   in again, 25-32K faults per backward on the 33.6M-param bench vs ~4K.) When the bucket's round
   ends (its launch, or the end of a backward under ``no_sync()``) the regions no gradient wrote
   are zeroed; later micro-batches accumulate into the kept buffer.
3. Buckets are reduce-scattered *in bucket order* (as DDP does; stage 3 in the order its units
   finish backward, ``launch_order``, see [Note: stage-3 reduce order] in stage3.py): a ready bucket
   waits for the buckets before it. Every rank therefore issues the same collectives in the same order even
   when ranks use different parameters. (Stage 3 also all-gathers during backward: there a bucket leaves at
   a unit's backward, not when ready, [Note: stage-3 launch points] in stage3.py.) ``overlap_comm=True`` launches them asynchronously from
   the hook, while backward continues; ``False`` defers them all to the end of backward.
4. A bucket is ready when its *expected* parameters have arrived: those that got a gradient on
   some rank in the previous step (all of them in the first step; the set is all-reduced at step(),
   so every rank expects the same). A parameter unused in forward thus delays its bucket once, not
   every step. A gradient that arrives after its bucket was launched ("late") is flattened into a
   side buffer; step() reduce-scatters the side buffers of buckets that were late on any rank (the
   flag rides on the step's flag all-reduce, so all ranks agree) and adds them in.
   A callback queued on the autograd engine runs when backward ends: buckets with parameters that
   got no gradient on this rank are completed with zeros and launched.
5. The reduced (averaged) slice is added into the bucket's ``grad_slice`` (accumulation over backwards
   without ``no_sync`` works too); the full-size buffer is freed once its collective completes.
   ``zero_grad()`` drops the gradient but keeps the slice's storage (``spare_slice``) for the next
   backward: the slice is part of stage 2's persistent 4 Psi / Nd anyway, and a fresh multi-MB
   slice would be page-faulted in (and its old one unmapped) on every step.
6. Full-size buffers are recycled (``pool_keep``, 2 for ZeroAdamW's stages 2 and 3; 0 = allocate and
   free every time, as stage 3 does): a fresh multi-MB buffer is page-faulted in (the kernel zeroes
   every page) on every backward, which made the flatten copy several times slower than a copy into
   warm memory (2 gloo ranks, 33.6M-param MLP: copy_ 115 -> ~40 ms per backward; step 1.46x -> 1.20x
   DDP in the same run). At most
   ``pool_keep`` buffers of the largest bucket's size are kept between steps, and never more than
   the gradient slice's own size (so a one-bucket model keeps none); memory_report() lists them
   as ``comm_buffers``. At most ``max_inflight`` reduce-scatters stay in flight during backward
   (see ``_reap``), so few buffers are live at once.
7. [Note: dropped gradients] The reduced gradient lives in the slices, so ``model.zero_grad()`` or
   ``p.grad = None`` between backward and step cannot drop it (torch's step would then skip the
   parameter; ours would still apply it, silently). The reducer remembers which parameters'
   gradients it holds (``holding``, cleared by ``zero_grad()`` and by the step that consumes them)
   and ``step()`` raises ShardedGradError, before anything changes, when one of them no longer has
   its placeholder in p.grad, or had it dropped and refilled by a later backward (``dropped``).
"""
from __future__ import annotations

from contextlib import nullcontext as _nullcontext
from typing import Callable

import torch
from torch.autograd import Variable

from . import collectives as C
from .buckets import FlatBucket
from .grad_guard import ShardedGrad, ShardedGradError, take_grad
from .params import sparse_message
from .mesh import ZeroMesh, reduce_scatter

__all__ = ["Stage2Reducer"]


def _region(b: FlatBucket, buf: torch.Tensor, li: int) -> torch.Tensor:
    ps = b.param_specs[li]
    return buf[ps.offset:ps.offset + ps.numel].view(ps.shape)


class Stage2Reducer:
    stage = 2                               # named by the p.grad placeholders ([Note: gradient placeholders])

    def __init__(self, buckets: list[FlatBucket], group, reduce_dtype: torch.dtype, overlap_comm: bool,
                 mark_grad: Callable[[int, int], None], pool_keep: int = 0, timeout=None,
                 mesh: ZeroMesh | None = None):
        self.buckets = buckets
        self.group = group
        self.mesh = mesh if mesh is not None else ZeroMesh(group, None)     # [Note: hybrid sharding]
        self.reduce_dtype = reduce_dtype
        self.overlap_comm = overlap_comm
        self.mark_grad = mark_grad          # (bucket, local index) -> records "this param had a grad"
        self.sync = True                    # False inside no_sync()
        self.launch_order = list(buckets)   # buckets in reduce-scatter order (stage 3 sets it, note 3)
        self.launch_when_ready = True       # stage 3 launches at its units' backward instead (note 3)
        self.next_launch = 0                # first bucket of launch_order not yet launched
        self.in_backward = False
        self.handles = []
        self.inflight: list[FlatBucket] = []
        # expected[b][li]: param li of bucket b is awaited before b launches (see note, point 4)
        self.expected = [[True] * len(b.params) for b in buckets]
        self.expected_count = [len(b.params) for b in buckets]
        self.arrived_expected = [0] * len(buckets)
        self.late = [False] * len(buckets)
        self.pool: list[torch.Tensor] = []  # free full-size buffers (see note, point 6)
        self.pool_keep = pool_keep          # see note, point 6 (ZeroAdamW uses 2)
        self.timeout = timeout              # ZeroAdamW(timeout=...): bounded waits during backward too
        self._pool_numel = max((b.spec.padded_numel for b in buckets), default=0)
        self._placeholders: dict[tuple[int, int], ShardedGrad] = {}   # p.grad after its gradient arrived
        # [Note: dropped gradients] parameters whose gradient arrived since the last zero_grad()/step
        # (their placeholder must still be p.grad at step()), and the first one found dropped
        self.holding: dict[tuple[int, int], torch.nn.Parameter] = {}
        self.dropped: str | None = None

    def set_expected(self, flags_per_bucket: list[list[bool]]) -> None:
        self.expected = flags_per_bucket
        self.expected_count = [sum(f) for f in flags_per_bucket]

    def register(self) -> None:
        for b in self.buckets:
            for li, p in enumerate(b.params):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(b, li)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _take(self, b: FlatBucket) -> torch.Tensor:
        """A full-size buffer for bucket b (recycled when possible, contents undefined)."""
        if self.pool_keep > 0:
            buf = self.pool.pop() if self.pool else torch.empty(self._pool_numel, dtype=self.reduce_dtype,
                                                                  device=b.device)
            return buf[:b.spec.padded_numel]
        return torch.empty(b.spec.padded_numel, dtype=self.reduce_dtype, device=b.device)

    def _give(self, buf: torch.Tensor | None) -> None:
        """Return a full-size buffer taken by _take (kept if the pool has room, else freed)."""
        if buf is None or self.pool_keep <= 0 or buf._base is None or buf._base.numel() != self._pool_numel:
            return
        slice_numel = sum(b.spec.shard_numel for b in self.buckets)
        if len(self.pool) < self.pool_keep and (len(self.pool) + 1) * self._pool_numel <= slice_numel:
            self.pool.append(buf._base)

    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pool)

    def _hook(self, bucket: FlatBucket, li: int):
        def hook(p: torch.nn.Parameter) -> None:
            self.on_grad(bucket, li, p)
        return hook

    # ---- during backward ------------------------------------------------------------------------
    @torch.no_grad()
    def on_grad(self, b: FlatBucket, li: int, p: torch.nn.Parameter) -> None:
        if b.recast(p) or b.reshaped(p, li):   # cast or resized after construction: say so before torch's error
            raise b.moved_error(b.param_specs[li].name, p)
        if not self.in_backward:
            self.in_backward = True
            Variable._execution_engine.queue_callback(self.post_backward)
        key = (b.index, li)
        if key in self.holding and self.dropped is None and not self._held(key, p):
            self.dropped = b.param_specs[li].name       # p.grad was dropped, then a backward refilled it
        g = take_grad(p)
        if g is None:
            return
        if g.is_sparse:                            # a functional sparse embedding (modules: refused when built)
            raise RuntimeError(sparse_message(b.param_specs[li].name))
        self.mark_grad(b.index, li)
        p.grad = self._placeholder(b, li, p)
        self.holding[key] = p
        if b.reduce.launched:                      # late: its bucket already left (see note, point 4)
            if b.reduce.late_acc is None:
                b.reduce.late_acc = torch.zeros(b.spec.padded_numel, dtype=self.reduce_dtype, device=b.device)
            _region(b, b.reduce.late_acc, li).add_(g)
            self.late[b.index] = True
            return
        self._add_grad(b, li, g)            # at once: the gradient is freed now (see note, point 2)
        b.reduce.arrived += 1
        if self.expected[b.index][li]:
            self.arrived_expected[b.index] += 1
        if self.arrived_expected[b.index] >= self.expected_count[b.index] or b.reduce.arrived == len(b.params):
            if self.sync and self.overlap_comm and self.launch_when_ready:
                self._launch_ready()

    def _placeholder(self, b: FlatBucket, li: int, p: torch.nn.Parameter) -> ShardedGrad:
        """p.grad from now until the step: use by torch raises ([Note: gradient placeholders])."""
        ph = self._placeholders.get((b.index, li))
        if ph is None:
            ph = self._placeholders[(b.index, li)] = ShardedGrad(p, b.param_specs[li].name, self.stage)
        ph.replaced = False
        return ph

    def _held(self, key: tuple[int, int], p: torch.nn.Parameter) -> bool:
        """p.grad still stands for the gradient the slices hold: it is the placeholder, or autograd
        replaced it by ``placeholder + new`` (a ``create_graph=True`` backward, grad_guard._add)."""
        ph = self._placeholders.get(key)
        return ph is not None and (p.grad is ph or ph.replaced)

    def check_held(self) -> None:
        """step(): refuse, before anything changes, to apply a gradient the caller dropped from p.grad
        ([Note: dropped gradients])."""
        name = self.dropped
        if name is None:
            for key, p in self.holding.items():
                if not (p.grad is self._placeholders[key]):
                    name = self._placeholders[key].param_name
                    break
        if name is None:
            for b in self.buckets:
                for li, p in enumerate(b.params):
                    if p.grad is not None and not self._held((b.index, li), p):
                        raise ShardedGradError(
                            f"p.grad of parameter {b.param_specs[li].name!r} holds a gradient that did not come "
                            f"from backward (set by hand: p.grad = g, or p.grad.data = g): on a ZeRO-{self.stage} "
                            "model gradients reach ZeroAdamW's sharded slices only through backward's hooks, so "
                            "this step would ignore it. Nothing was changed. Produce it with backward() (e.g. "
                            "torch.autograd.backward(params, grads)), or use stage 1, which reduces p.grad at "
                            "step(); zopt.zero_grad() clears it.")
        if name is not None:
            raise ShardedGradError(
                f"p.grad of parameter {name!r} was set to None (model.zero_grad(), another optimizer's "
                f"zero_grad() or p.grad = None) between backward and step() on a ZeRO-{self.stage} model, "
                f"but its gradient had already been reduced into ZeroAdamW's sharded slices, which that "
                f"cannot reach: this step would still apply it. Nothing was changed. Drop gradients with "
                f"zopt.zero_grad() (it clears the slices), or call model.zero_grad() only after step() "
                f"(step() consumes the gradients); call zopt.zero_grad() now to continue.")

    def _add_grad(self, b: FlatBucket, li: int, g: torch.Tensor) -> None:
        """Put parameter li's gradient into b's accumulation buffer: copied when it is li's first
        in a fresh buffer, else added. Regions no gradient wrote are zeroed by _seal."""
        if b.reduce.pending is not None:           # the previous backward's reduction still owns b.reduce.acc
            self.finish(b)
        if b.reduce.acc is None:
            b.reduce.acc = self._take(b)
            b.reduce.acc_fresh = True
            b.reduce.acc_written = set()
        dst = _region(b, b.reduce.acc, li)       # one copy_/add_, cast included (issue 10.6)
        if b.reduce.acc_fresh and li not in b.reduce.acc_written:
            dst.copy_(g)
            b.reduce.acc_written.add(li)
        else:
            dst.add_(g)
        b.reduce.acc_unlaunched = True

    @staticmethod
    def _seal(b: FlatBucket) -> None:
        """End of a round of a fresh buffer: zero the regions no gradient wrote (and the padding);
        later gradients (no_sync micro-batches) accumulate into it."""
        if b.reduce.acc is not None and b.reduce.acc_fresh:
            b.zero_missing(b.reduce.acc, [li in b.reduce.acc_written for li in range(len(b.params))])
            b.reduce.acc_fresh = False

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.launch_order):
            b = self.launch_order[self.next_launch]
            i = b.index
            if b.reduce.launched or (self.arrived_expected[i] < self.expected_count[i] and b.reduce.arrived < len(b.params)):
                break
            self._launch(b)
            self.next_launch += 1
        self._reap()

    def launch_unlaunched(self) -> None:
        """step() after no_sync-only backwards: reduce what was accumulated (every rank alike)."""
        if any(b.reduce.acc_unlaunched for b in self.buckets):
            for b in self.buckets:
                if not b.reduce.launched:
                    self._launch(b)
            self._reset_backward()

    def reduce_late(self, late_flags) -> None:
        """Reduce-scatter the side buffers of buckets that got a gradient after their launch on
        some rank (``late_flags[b]``, agreed over the group) and add them into the slices."""
        for b in self.buckets:
            if late_flags[b.index]:
                self.finish(b)
                buf = b.reduce.late_acc if b.reduce.late_acc is not None else torch.zeros(
                    b.spec.padded_numel, dtype=self.reduce_dtype, device=b.device)
                out = torch.empty(b.spec.shard_numel, dtype=self.reduce_dtype, device=b.device)
                C.wait(reduce_scatter(buf, out, self.mesh, async_op=False, tag=("late", b.index)))
                if b.reduce.grad_slice is None:
                    b.reduce.grad_slice = out
                else:
                    b.reduce.grad_slice.add_(out)
            b.reduce.late_acc = None
            self.late[b.index] = False

    def zero_grad(self, set_to_none: bool) -> None:
        """Drop the reduced gradients (the slice storage is kept for the next backward, note 5)."""
        self.clear()
        self.holding.clear()
        self.dropped = None
        for b in self.buckets:
            r = b.reduce
            if set_to_none:
                if r.grad_slice is not None:
                    r.spare_slice = r.grad_slice
                r.grad_slice = None
            elif r.grad_slice is not None:
                r.grad_slice.zero_()
            elif r.spare_slice is not None:     # consumed by the last step: zeros, which the next step applies
                r.grad_slice, r.spare_slice = r.spare_slice.zero_(), None   # (HookReduced.zero_grad: as torch's)
            for p in b.params:
                p.grad = None

    def _launch(self, b: FlatBucket) -> None:
        if b.reduce.pending is not None:
            self.finish(b)
        if b.reduce.acc is None:                   # nothing arrived on this rank: contribute zeros
            b.reduce.acc = self._take(b).zero_()
            b.reduce.acc_fresh = False
        self._seal(b)
        if b.reduce.grad_slice is None:            # reuse the storage zero_grad() kept (see note, point 5)
            b.reduce.grad_slice = b.reduce.spare_slice if b.reduce.spare_slice is not None else torch.empty(
                b.spec.shard_numel, dtype=self.reduce_dtype, device=b.device)
            b.reduce.spare_slice = None
            out, b.reduce.pending_add = b.reduce.grad_slice, None
        else:                               # accumulate over backwards: reduce, then add on wait
            out = torch.empty_like(b.reduce.grad_slice)
            b.reduce.pending_add = out
        b.reduce.pending = reduce_scatter(b.reduce.acc, out, self.mesh, async_op=True, tag=b.index)
        b.reduce.launched = True
        b.reduce.acc_unlaunched = False
        self.inflight.append(b)

    # Reduce-scatters kept in flight during backward (see _reap). 1: launching bucket k waits for
    # bucket k-1's, which had bucket k's whole backward to finish; then at most 2 full-size buffers
    # are live, both recycled by the pool (2 gloo ranks, 33.6M-param MLP, bench_zero.py: 2 in flight
    # allocated a third buffer every backward, ~8K page faults, and stepped 1.08-1.12x DDP vs
    # 0.98-1.02x with 1, same runs).
    max_inflight = 1

    def _reap(self) -> None:
        """Free full-size buffers of collectives that already completed (no waiting); beyond
        ``max_inflight``, wait for the oldest (gloo point-to-point handles cannot report completion
        without a wait, see [Note: gloo collectives]; the oldest has usually finished by then), so
        stage 2 holds at most a few full-size buckets during backward."""
        keep = []
        for b in self.inflight:
            w = b.reduce.pending.work if b.reduce.pending is not None else None
            if w is None or w.is_completed():
                self.finish(b)
            else:
                keep.append(b)
        while len(keep) > self.max_inflight:
            self.finish(keep.pop(0))
        self.inflight = keep

    def post_backward(self) -> None:
        """End of a backward: complete partial buckets and launch everything not yet launched."""
        with torch.no_grad():
            self.in_backward = False
            for b in self.buckets:
                self._seal(b)
            if self.sync:
                for b in self.launch_order[self.next_launch:]:
                    if not b.reduce.launched:
                        self._launch(b)
                self.next_launch = len(self.launch_order)
            self._reset_backward()

    def _reset_backward(self) -> None:
        for b in self.buckets:
            b.reduce.arrived = 0
            self.arrived_expected[b.index] = 0
            if self.sync:
                b.reduce.launched = False
        if self.sync:
            self.next_launch = 0

    # ---- at step() -------------------------------------------------------------------------
    def finish(self, b: FlatBucket) -> None:
        """Wait for b's reduce-scatter, fold it into grad_slice, free the full-size buffer."""
        if b.reduce.pending is None:
            return
        with C.timeout_scope(self.timeout, self.group) if C.current_timeout() is None else _nullcontext():
            C.wait(b.reduce.pending)
        if b.reduce.pending_add is not None:
            b.reduce.grad_slice.add_(b.reduce.pending_add)
        b.reduce.pending = None
        b.reduce.pending_add = None
        self._give(b.reduce.acc)
        b.reduce.acc = None

    def finish_all(self) -> None:
        for b in self.inflight:
            self.finish(b)
        self.inflight = []

    def clear(self) -> None:
        """Drop everything (zero_grad): pending collectives are waited for first."""
        self.finish_all()
        for b in self.buckets:
            self._give(b.reduce.acc)
            b.reduce.acc = None
            b.reduce.acc_unlaunched = False
            b.reduce.late_acc = None
            self.late[b.index] = False
            self.arrived_expected[b.index] = 0
            b.reduce.arrived = 0
            b.reduce.launched = False
        self.next_launch = 0
