"""ZeRO-3 runtime: forward/backward module hooks that gather, prefetch and free units
([Note: stage-3 hooks] in stage3.py).

[Note: stage 3 under torch.compile]
``torch.compile(model)`` traces a module's forward *and* its module hooks. Traced by Dynamo, the
hooks' ``p.data = ...`` swaps (gather: views of the unit's flat buffer; free: the 0-element
placeholder) ran as graph code, and the first backward failed with "modified by an inplace
operation" (a parameter's autograd version counter had advanced); collectives and storage resizes
do not belong in a graph either. So the forward hooks are ``torch.compiler.disable``-d (FSDP2
does the same with its hooks, ``torch._dynamo.config.skip_fsdp_hooks``): Dynamo breaks the graph at each unit's hooks, they run
eagerly, and the compiled regions between them only ever see gathered parameters, so their guards
(shape, stride, dtype) hold from step to step (no recompilation). Eagerly, ``p.data = x`` keeps the
Parameter's own version counter (``set_data``), the all-gather writes the flat buffer under
``no_grad``, and tensors a compiled forward saved for backward (parameters, or views of them) point
at the buffer's storage, which is resized, never replaced ([Note: stage-3 storage]), so they are
valid again once the pre-backward hook re-gathers. The parameters keep their 0-element placeholder
while freed (FSDP2 keeps the full shape over a 0-byte storage instead: a stray read of a freed
parameter there reads a null pointer; here it is an empty tensor, and ``model.to(dtype)`` on a
freed model is caught by the bound-parameter check).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from .grad_guard import UNWRAPPED
from .timeouts import scoped
from .unit_bucket import FREE, GATHERED, UnitBucket, cache_module, copied_placeholder, copied_placeholder_error
from .unit_hold import BackwardHold
from .unit_outside import OutsideUseProbe, entry_modules, freed_units_note, placeholder_error, under_torch_compile
from .unit_saved import SavedUnitTensors

__all__ = ["UnitRuntime"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Unit:
    def __init__(self, index: int, name: str, module: nn.Module, buckets: list[UnitBucket]):
        self.index, self.name, self.module, self.buckets = index, name, module, buckets
        self.bwd_seen = False                 # pre-backward ran in the current backward
        self.bwd_started = False              # on_unit_backward called in the current backward
        self.hooked = False                   # a forward since the last backward left a pre-backward hook
        self.outside = False                  # parameters used outside its forward: kept like the root's


class UnitRuntime:
    """The module hooks of stage 3 over its units (see [Note: stage-3 hooks] in stage3.py)."""

    def __init__(self, units: list[tuple[str, nn.Module]], buckets: list[UnitBucket], group, rank: int,
                 prefetch: int, reshard_after_forward: bool, end_backward: Callable[[], None], timeout=None,
                 on_forward_order: Callable[[list[int]], None] = lambda seq: None,
                 on_unit_backward: Callable[[int], None] = lambda ui: None):
        self.group = group
        self.timeout = timeout                # every wait in these hooks is bounded by ZeroAdamW(timeout=)
        self.rank = rank
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.end_backward = end_backward      # the reducer's end-of-backward work
        self.on_forward_order = on_forward_order  # gets the unit order recorded in the first forward
        self.on_unit_backward = on_unit_backward  # a unit's first pre-backward, before its gather (stage3.py)
        self.units = [_Unit(i, n, m, [b for b in buckets if b.spec.unit == i])
                      for i, (n, m) in enumerate(units)]
        # Gather cache limit: the gathered working set (root + current + prefetched + the unit
        # kept for backward), so every gather of a step can reuse a block and nothing more is kept.
        unit_bytes = [sum(b.full_bytes for b in u.buckets) for u in self.units]
        largest = max(unit_bytes[1:], default=0)
        self.cache_limit = unit_bytes[0] + (2 + prefetch) * largest
        mod = cache_module() if any(b.use_gather_cache for b in buckets) else None
        if mod is not None:
            mod.cache_set_limit(max(self.cache_limit, mod.cache_stats()["limit_bytes"]))
        self.handles = []
        for u in self.units:
            if u.buckets or u.index == 0:
                # eager even inside torch.compile (see [Note: stage 3 under torch.compile]); first of the unit's
                # pre-hooks, as FSDP2's: a user's pre-hook (or weight_norm's) registered earlier reads the
                # gathered parameters, not the 0-element placeholders
                self.handles.append(u.module.register_forward_pre_hook(torch.compiler.disable(
                    scoped(self.timeout, self.group, self._quiet(self._pre_forward_hook(u)))), prepend=True))
                self.handles.append(u.module.register_forward_hook(
                    torch.compiler.disable(self._quiet(self._post_forward_hook(u)))))
        # [Note: tensors saved from a unit] in unit_saved.py: pushed by the root's pre-hook (or a unit's entered
        # outside the root's forward), popped by that forward's exit hook, also when it raised (always_call)
        self._need_bucket = scoped(self.timeout, self.group, self._bucket_needed)
        self.saved = SavedUnitTensors(self.units, self._need_bucket)
        for u in self.units:
            if u.buckets or u.index == 0:
                self.handles.append(u.module.register_forward_hook(
                    torch.compiler.disable(self._quiet(self._forward_exit(u))), always_call=True))
        # [Note: modules entered outside the root's forward] in unit_outside.py
        self._entered: dict[int, list[list[_Unit]]] = {}     # id(module) -> the units each open call gathered
        owner_of = {id(p): u.index for u in self.units for b in u.buckets for p in b.params}
        hooked = [u.module if u.buckets or u.index == 0 else None for u in self.units]
        for m, owners in entry_modules(self.units[0].module, hooked, owner_of):
            self.handles.append(m.register_forward_pre_hook(self._entry_pre_hook(m, owners), prepend=True))
            self.handles.append(m.register_forward_hook(self._entry_exit_hook(m), always_call=True))
        # [Note: parameters used outside their unit] in unit_outside.py: the first forward's probe
        self.hooks_running = 0                # > 0 while one of these hooks runs (the probe ignores them)
        self.probe: OutsideUseProbe | None = None
        self.probed: set[tuple[bool, bool]] = set()     # (training, grad enabled) of the forwards probed so far
        self._probe_mode: tuple[bool, bool] | None = None
        for u in self.units:            # a gradient reaching a parameter of a unit no hook gathered (same Note)
            for b in u.buckets:
                for p in b.params:
                    if p.requires_grad:
                        self.handles.append(p.register_hook(self._param_grad_hook(u, b)))
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
        self.hold = BackwardHold(self.free_all)   # [Note: forward without backward] in unit_hold.py
        self.gathered_bytes = 0
        self.pinned = 0                       # zopt.gathered() blocks open: nothing is freed (Stage3.gathered)
        self.peak_gathered_bytes = 0
        self.peak_gathered_units = 0
        self.num_gathers = 0

    # ---- gather / free ----------------------------------------------------------------------------
    def _start(self, u: _Unit, async_op: bool = True, buckets: list[UnitBucket] | None = None) -> None:
        for b in u.buckets if buckets is None else buckets:
            if b.start_gather(self.rank, self.group, async_op, ("unit", u.index, b.index)):
                self.num_gathers += 1
                self.gathered_bytes += b.full_bytes
        if self.gathered_bytes > self.peak_gathered_bytes:
            self.peak_gathered_bytes = self.gathered_bytes
        n = sum(1 for x in self.units if any(b.gather_state != FREE for b in x.buckets))
        self.peak_gathered_units = max(self.peak_gathered_units, n)

    def _ensure(self, u: _Unit, buckets: list[UnitBucket] | None = None) -> None:
        self._start(u, buckets=buckets)
        for b in u.buckets if buckets is None else buckets:
            b.finish_gather()

    def free(self, b: UnitBucket) -> None:
        if self.pinned:                         # inside zopt.gathered(): a forward there keeps every unit
            return
        if b.gather_state != FREE:
            b.free()
            self.gathered_bytes -= b.full_bytes

    def _free_unit(self, u: _Unit) -> None:
        for b in u.buckets:
            self.free(b)

    def free_all(self) -> None:
        self.hold.clear()
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
            if module is not u.module:                # a copy.deepcopy of the model: its hooks are these functions,
                name = copied_placeholder(module, u.module, u.buckets)     # but it is no optimizer's (it owns its
                if name is not None:                                     # own tensors: full when copied inside
                    raise copied_placeholder_error(f"{u.name}.{name}" if u.name else name)   # zopt.gathered(),
                return None                                              # else placeholders)
            if _in_backward():                        # checkpoint recomputation
                if not u.hooked:                      # reentrant: the forward left no pre-backward hook
                    self._unit_backward(u)
                self._ensure(u)
                return None
            if u.index == 0:
                _refuse_ddp(module)
                self.saved.enter(u)
                if self.hold.start_forward():         # held for a backward that never came
                    for x in self.units[1:]:
                        self._free_unit(x)
                self._in_forward = True
                self._fwd_pos = 0
                self._rec_fwd, self._rec_post = [], []
                for x in self.units[1:]:              # used outside their own forward: gathered with the root
                    if x.outside:
                        self._ensure(x)
                self._start_probe()
            if self._in_forward:
                self._rec_fwd.append(u.index)
                j = self._advance(self.fwd_seq, self._fwd_pos, u.index)
                self._ensure(u)
                if j >= 0:
                    self._prefetch(self.fwd_seq, j)
                    self._fwd_pos = j + 1
            else:
                if u.index != 0:                      # a unit called outside the root's forward: the caller may
                    self._ensure(self.units[0])       # use the root's parameters (unit_outside.py), and
                    self.saved.enter(u)               # its saved tensors need the hooks as the root's do
                self._ensure(u)
            return None
        return hook

    def _post_forward_hook(self, u: _Unit):
        def hook(module, args, output):
            if module is not u.module or _in_backward():    # a deepcopy's forward, or checkpoint recomputation
                return None
            needs_grad = False
            if torch.is_grad_enabled():
                for t in _grad_tensors(output):
                    t.register_hook(scoped(self.timeout, self.group, self._pre_backward_hook(u, self.hold.token)))
                    needs_grad = u.hooked = True
            if self._in_forward:
                self._rec_post.append(u.index)
            keep_last = needs_grad and self._in_forward and u.index == self._last_unit
            if u.index == 0:
                self._in_forward = False
                if self.fwd_seq is None:
                    self.fwd_seq, self.fwd_post_seq = self._rec_fwd, self._rec_post
                    rest = [i for i in self._rec_post if i != 0]
                    self._last_unit = rest[-1] if rest else None
                    self.on_forward_order(self.fwd_seq)
                hold = needs_grad and module.training   # a backward is expected
                if self.reshard_after_forward or not hold:
                    for x in self.units[1:]:          # also prefetched units that did not run
                        if not (hold and (x.index == self._last_unit or x.outside)):
                            self._free_unit(x)
                    if not hold:
                        self._free_unit(u)
                self.hold.end_forward(hold)
            elif self.reshard_after_forward and not keep_last and not (u.outside and self._in_forward):
                self._free_unit(u)
            return None
        return hook

    def _entry_pre_hook(self, m: nn.Module, owners: list[int]):
        """[Note: modules entered outside the root's forward]: inside the root's forward, nothing."""
        units = [self.units[i] for i in dict.fromkeys([0, *owners])]
        enter = torch.compiler.disable(scoped(self.timeout, self.group, self._quiet(self._entry_gather)))

        def hook(module, args):
            if self._in_forward or module is not m:
                return None
            enter(m, units)
            return None
        return hook

    def _entry_gather(self, m: nn.Module, units: list[_Unit]) -> None:
        took = [u for u in units if any(b.gather_state == FREE for b in u.buckets)]
        for u in units:
            self._ensure(u)
        if _in_backward():                      # checkpoint recomputation: kept as the units' own hooks keep them
            took = []
        self._entered.setdefault(id(m), []).append(took)
        if self.saved.owner is None:
            self.saved.enter(m)

    def _entry_exit_hook(self, m: nn.Module):
        leave = torch.compiler.disable(self._quiet(self._entry_free))

        def hook(module, args, output):
            if self._in_forward or module is not m or id(m) not in self._entered:
                return None
            leave(m)
            return None
        return hook

    def _entry_free(self, m: nn.Module) -> None:
        if self.saved.owner is m:
            self.saved.exit()
        calls = self._entered[id(m)]
        took = calls.pop()
        if not calls:
            del self._entered[id(m)]
        for u in took:
            self._free_unit(u)

    def _quiet(self, fn):
        """``fn`` with ``hooks_running`` raised while it runs (the probe leaves the runtime's own calls alone)."""
        def run(*args, **kwargs):
            self.hooks_running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.hooks_running -= 1
        return run

    def _start_probe(self) -> None:
        """The root's first forward in each mode (training or not, grad on or off) runs under the probe ([Note:
        parameters used outside their unit]): a training-only branch is missed by a first eval forward."""
        mode = (self.units[0].module.training, torch.is_grad_enabled())
        if mode in self.probed or self.probe is not None or self.pinned:     # inside zopt.gathered() every unit
            return                                                              # is gathered: nothing to find
        unit_of = {id(p): u for u in self.units[1:] for b in u.buckets for p in b.params}
        if not unit_of or under_torch_compile():
            self.probed.add(mode)
            return
        self._probe_mode = mode

        def found(u: _Unit) -> None:
            u.outside = True
            self._ensure(u)
        self.probe = OutsideUseProbe(unit_of, _gathered,
                                     lambda: self.hooks_running > 0, scoped(self.timeout, self.group, found))
        self.probe.__enter__()

    def _forward_exit(self, u: _Unit):
        """After the forward of ``u`` (also when it raised: always_call): the root's pops the probe, the forward
        that pushed the saved-tensor hooks (the root's, or a unit's entered outside it) pops them, and an error
        of the root's forward that looks like a read of a placeholder gets a note naming the freed units."""
        def hook(module, args, output):
            if module is not u.module:
                return
            err = sys.exc_info()[1]
            if u.index == 0 and self.probe is not None:
                probe, self.probe = self.probe, None
                probe.__exit__(None, None, None)
                if err is None:             # a forward that raised probes again next time
                    self.probed.add(self._probe_mode)
            if self.saved.owner is u:
                self.saved.exit()
            if isinstance(err, RuntimeError) and self.saved.refused_by(err):
                err.add_note(self.saved.refusal_note())
            elif u.index == 0 and placeholder_error(err):
                freed = [x.name for x in self.units[1:] if x.buckets and any(b.gather_state == FREE for b in x.buckets)]
                if freed:
                    err.add_note(freed_units_note(freed))
        return hook

    # ---- backward -----------------------------------------------------------------------------------
    def ensure_final_callback(self) -> None:
        if not self._final_queued:
            self._final_queued = True
            self.hold.clear()
            self._bwd_pos = 0
            self._rec_bwd = []
            Variable._execution_engine.queue_callback(scoped(self.timeout, self.group, self._post_backward))

    # [Note: buckets done in a backward]
    # A bucket is freed in backward once every one of its parameters delivered its gradient (Stage3Reducer.on_grad),
    # which depends on the rank when a parameter is unused there (an MoE expert no row of this rank was routed
    # to: the bucket stays gathered on that rank, is freed on the others). A pre-backward hook that fires later
    # for the same unit (an output whose gradient completes late: T5's position_bias, passed through every block
    # and hooked by each) re-gathered the freed bucket on the ranks that freed it only: an all-gather the other
    # ranks never issued (a deadlock until timeout=). So the hook leaves a bucket that is done in this backward
    # freed on every rank; what backward still reads from it is gathered on demand, bucket by bucket (a tensor
    # saved from it, a gradient into it: [Note: tensors saved from a unit]), as after any other free.
    def _pre_backward_hook(self, u: _Unit, token):
        def hook(grad, _token=token):    # the forward's token lives as long as this hook (unit_hold.py)
            with torch.no_grad():
                self.ensure_final_callback()
                self._unit_backward(u)
                self._ensure(u, [b for b in u.buckets if not b.s3_done])
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

    def _bucket_needed(self, u: _Unit, b: UnitBucket) -> None:
        """Backward reads a tensor saved from bucket ``b`` of ``u``, or accumulates a gradient into one of its
        parameters, while ``b`` is not gathered ([Note: tensors saved from a unit]): that bucket alone is
        gathered (the unit's others may have been freed already, at a point that depends on the rank)."""
        if b.gather_state == GATHERED:
            return
        if not _in_backward():          # a saved tensor read by hand (grad_fn._saved_*): no collective here
            raise RuntimeError(
                f"a tensor autograd saved from the parameters of ZeRO-3 unit {u.name or '<root>'!r} was read "
                "outside backward while the unit is freed; read it inside `with zopt.gathered():`")
        with torch.no_grad():
            self.ensure_final_callback()
            self._start(u, buckets=[b])
            b.finish_gather()

    def _param_grad_hook(self, u: _Unit, b: UnitBucket):
        def hook(grad):
            if b.gather_state != GATHERED:
                self._need_bucket(u, b)
            return None
        return hook

    def _unit_backward(self, u: _Unit) -> None:
        """The backward of ``u`` starts: once per backward ([Note: stage-3 launch points] in stage3.py)."""
        if not u.bwd_started:
            u.bwd_started = True
            self.on_unit_backward(u.index)

    def _post_backward(self) -> None:
        # a backward with create_graph=True (a gradient penalty: autograd.grad(..., create_graph=True)) built nodes
        # that saved views of the gathered parameters; no saved-tensor hooks run inside backward, so the units stay
        # gathered for the backward of that graph, which frees them at its end (or the next forward or step())
        keep = torch.is_grad_enabled()
        with torch.no_grad():
            self.end_backward()
            self._final_queued = False
            if self.bwd_seq is None and self._rec_bwd:
                self.bwd_seq = self._rec_bwd
            for u in self.units:
                u.bwd_seen = u.bwd_started = u.hooked = False
                for b in u.buckets:
                    b.s3_arrived.clear()
                    b.s3_done = False
            if keep:
                self.hold.clear()
            else:
                self.free_all()

    def gather_all(self) -> None:
        """Gather every unit (collective: all-gathers issued for all, then waited)."""
        for u in self.units:
            self._start(u, async_op=True)
        for u in self.units:
            for b in u.buckets:
                b.finish_gather()

    def reset_peak(self) -> None:
        self.peak_gathered_bytes = self.gathered_bytes
        self.peak_gathered_units = sum(1 for x in self.units if any(b.gather_state != FREE for b in x.buckets))

    def remove(self) -> None:
        self.saved.exit()
        for h in self.handles:
            h.remove()
        self.handles = []


def _gathered(u: _Unit) -> bool:
    return all(b.gather_state == GATHERED for b in u.buckets)


def _refuse_ddp(root: nn.Module) -> None:
    """A stage-3 model run by DistributedDataParallel (accelerate's ``prepare(model)``, a plain Trainer): DDP
    would reduce gradients ZeroAdamW reduces itself, over parameters that are freed placeholders outside
    forward (its backward then fails on a 0-element gradient, far from the cause). Raised in forward."""
    active = getattr(nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
    ddp = active() if active is not None else None
    if ddp is not None and ddp.module is root:
        raise RuntimeError(
            "a ZeRO-3 model is running inside DistributedDataParallel: ZeroAdamW reduces the gradients and "
            f"gathers the parameters itself: {UNWRAPPED}")


def _grad_tensors(output) -> list[Tensor]:
    """The tensors in ``output`` (nested lists, tuples, dicts, dataclass instances) that require grad, in
    order. Iterative: a recursive closure would be a reference cycle holding the outputs (and their
    autograd graph) until the garbage collector runs ([Note: forward without backward] in unit_hold.py).
    Tensors in containers not listed here get no pre-backward hook; their unit is gathered when backward
    first reads one of its saved tensors instead ([Note: tensors saved from a unit] in unit_saved.py)."""
    out, todo = [], [output]
    while todo:
        x = todo.pop()
        if isinstance(x, Tensor):
            if x.requires_grad:
                out.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(reversed(x))
        elif isinstance(x, dict):
            todo.extend(reversed(list(x.values())))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            todo.extend(reversed([getattr(x, f.name, None) for f in dataclasses.fields(x)]))
    return out
