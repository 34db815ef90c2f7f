"""Stage-1 gradient reduction (the stage-2/3 reducer, which runs during backward, is in hooks.py).

[Note: stage-1 reduction]
Stage 1 keeps full gradients in ``p.grad`` until ``step()`` (or ``clip_grad_norm_``), which
reduce-scatters every bucket at once (average, ``reduce_dtype``) and waits bucket by bucket, so
later buckets' collectives overlap earlier buckets' steps. The send buffer of a bucket is:
  * its flat gradient buffer itself when every ``.grad`` is a view of it (after
    ``zero_grad(set_to_none=False)``, see [Note: views vs copies] in flat.py) and it has the
    reduce dtype: no copy at all;
  * otherwise a full-size buffer the reducer keeps between steps (the gradients are copied in,
    cast, with zeros for parameters without a gradient).
The gloo point-to-point reduce-scatter receives the peers' copies of this rank's slice into a
per-bucket scratch the reducer also keeps ((Nd-1) * shard_numel elements). Both kept buffers are
reported as ``comm_buffers`` by ``memory_report()``, apart from the model states of the formula (the
ZeRO paper's temporary buffers): allocating them every step page-faulted every page in again (16K
faults per iteration on the 33.6M-parameter bench at 2 ranks). On the copy path they are a full-size
copy of the gradients in ``reduce_dtype`` plus the scratch: 6 B/param with fp32 gradients at Nd = 2,
beside the 4 B/param of ``p.grad``; on the views path only the scratch (the copy buffer of an earlier
step is released when the views path is taken).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import collectives as C
from .buckets import FlatBucket
from .flat import flatten
from .grad_guard import local_grad
from .mesh import ZeroMesh, reduce_scatter

__all__ = ["Stage1Reducer"]


class Stage1Reducer:
    def __init__(self, buckets: list[FlatBucket], group, reduce_dtype: torch.dtype, overlap_comm: bool,
                 mesh: ZeroMesh | None = None):
        self.buckets, self.group, self.reduce_dtype, self.overlap_comm = buckets, group, reduce_dtype, overlap_comm
        self.mesh = mesh if mesh is not None else ZeroMesh(group, None)     # [Note: hybrid sharding]
        self.world = C.group_size(group)
        self.in_place = C.reduces_in_place(group)
        self.launched = False                   # reductions of this step issued
        self._send: dict[int, Tensor] = {}      # kept full-size send buffers (copy path)
        self._slice: dict[int, Tensor] = {}     # kept output slices (backends that do not reduce in place)
        self._scratch: dict[int, Tensor] = {}   # kept receive scratch (gloo point-to-point)

    def _kept(self, store: dict[int, Tensor], b: FlatBucket, numel: int) -> Tensor:
        t = store.get(b.index)
        if t is None:
            t = store[b.index] = torch.empty(numel, dtype=self.reduce_dtype, device=b.device)
        return t

    def _send_buffer(self, b: FlatBucket) -> Tensor:
        grads = [local_grad(p) for p in b.params]      # [Note: gradient placeholders]
        flat = b.reduce.grad_flat
        views = flat is not None and all(
            g is None or g.data_ptr() == v.data_ptr() for g, v in zip(grads, b.grad_views()))
        if views and flat.dtype == self.reduce_dtype:
            self._send.pop(b.index, None)      # a copy buffer of an earlier step is not needed any more
            return flat             # zero copies: regions without a grad are zero since zero_grad()
        buf = self._kept(self._send, b, b.spec.padded_numel)
        if views:
            return buf.copy_(flat)
        b.zero_missing(buf, [g is not None for g in grads])
        flatten([g for g in grads if g is not None], buf, [o for g, o in zip(grads, b.offsets) if g is not None])
        return buf

    def launch_all(self) -> None:
        """Issue every bucket's reduce-scatter (once per step)."""
        if self.launched:
            return
        for b in self.buckets:
            send = self._send_buffer(b)
            if self.in_place:       # the slice is a view of the send buffer: no copy
                out = send[b.slice_start:b.slice_end]
            else:
                out = self._kept(self._slice, b, b.spec.shard_numel)
            scratch = self._kept(self._scratch, b, (self.world - 1) * b.spec.shard_numel) \
                if self.world > 1 else None
            b.reduce.grad_slice = out
            b.reduce.pending = reduce_scatter(send, out, self.mesh, async_op=self.overlap_comm, tag=b.index,
                                              scratch=scratch)
            b.reduce.acc = send
        self.launched = True

    def wait(self, b: FlatBucket) -> None:
        if b.reduce.pending is not None:
            C.wait(b.reduce.pending)
            b.reduce.pending = None

    def wait_all(self) -> None:
        self.launch_all()
        for b in self.buckets:
            self.wait(b)

    def local_flags(self) -> list[int]:
        """Per parameter of the layout (layout order): 1 if it has a gradient on this rank."""
        flags = {}
        for b in self.buckets:
            for li, p in enumerate(b.params):
                flags[b.spec.params[li]] = int(p.grad is not None)
        return [flags[i] for i in range(len(flags))]

    def finish_step(self) -> None:
        for b in self.buckets:      # stage 1 keeps no reduced slice between steps
            self.wait(b)
            b.reduce.grad_slice = None
            b.reduce.acc = None
        self.launched = False

    def zero_grad(self, set_to_none: bool) -> None:
        for b in self.buckets:
            if set_to_none:
                b.reduce.grad_flat = None
                for p in b.params:
                    p.grad = None
                continue
            # The views path: .grad become views of one flat buffer per bucket; autograd then
            # accumulates into it in place and step() reduce-scatters it without a copy.
            if b.reduce.grad_flat is None:
                b.reduce.grad_flat = torch.zeros(b.spec.padded_numel, dtype=b.dtype, device=b.device)
            else:
                b.reduce.grad_flat.zero_()
            for p, v in zip(b.params, b.grad_views()):
                if p.grad is not None:
                    p.grad = v

    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self._send, self._slice, self._scratch)
                   for t in d.values())
