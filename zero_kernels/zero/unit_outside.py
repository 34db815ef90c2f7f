"""ZeRO-3: parameters a forward uses outside their unit's own forward, found in the first forward.

[Note: parameters used outside their unit]
A unit's parameters are gathered for its own forward and freed after it ([Note: stage-3 hooks] in
stage3.py); outside, they are 0-element placeholders ([Note: stage-3 storage]). Models do use a
child's parameter elsewhere: an output head computed from the embedding in the parent
(``F.linear(h, self.emb.weight)``, untied but shared), a norm of a block's weight in the root's
forward. With the default units (the root's children are units) the parent then read a placeholder:
a bare shape error, or, for a reduction (``w.norm()``, ``w.sum()``), silently 0.

So the root's first forward in each mode (training or eval, grad on or off: Lightning's sanity check
is an eval forward without grad, before any training branch runs) runs under a ``TorchFunctionMode``
(:class:`OutsideUseProbe`) that
looks at every torch call's arguments for a parameter of a non-root unit that is not gathered at
that moment. One found is gathered on the spot (every rank runs the same forward, so the all-gather
is the same collective on each) before the call runs, and its unit is marked ``outside``: from then
on it is gathered with the root at the start of every forward and kept, like the root, until its
gradients are complete (or the end of backward; freed at the end of a forward that needs no
backward). The probe ignores the runtime's own hooks (they handle placeholders on purpose) and calls
that read metadata only (``p.dtype``, ``p.numel()``: HF models read ``self.dtype`` in forward). It costs
one Python call per torch call, in the first forward only; a use that first appears in a later
forward (another code path) is not seen: the root's forward then fails, and the error gets a note
naming the units that were freed at that point (:func:`freed_units_note`). Under ``torch.compile`` the
probe does not run (:func:`under_torch_compile`; FSDP2 has no such probe at all).
A unit's forward entered outside the root's forward (CLIP's ``model.encode_image(x)`` while the model
itself is never called) gathers the root too: its parameters (``logit_scale``) are used by the caller.

[Note: modules entered outside the root's forward]
Outside the root's forward, a module that is not a unit but registers parameters of one runs on
placeholders unless something gathers them: Hugging Face's ``model.get_input_embeddings()(ids)``
(``inputs_embeds``, prompt tuning) and BART's ``generate()``, which calls ``model.get_encoder()(...)``
(the encoder is not a unit: its embedding is the root's, tied to the head; its positions are the
``model`` unit's) before any forward of the model. Such modules (:func:`entry_modules`: those that
register parameters of the root or of a unit holding other units; a transformer block's insides are
entered through the block) get a pre-hook that, outside the root's forward, gathers the root and the
units whose parameters the module registers, pushes the saved-tensor hooks when none are active
([Note: tensors saved from a unit]), and frees after the module's forward exactly the units it
gathered (FSDP2's unshard / reshard around a module; a backward through the output gathers again by
those hooks and by the per-parameter gradient hooks). Inside the root's forward the hook returns at
once (under ``torch.compile`` it is traced as that check).
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["OutsideUseProbe", "entry_modules", "freed_units_note", "placeholder_error", "under_torch_compile"]


# Calls that read a tensor's metadata, not its values (HF's ``self.dtype`` reads ``next(parameters()).dtype``):
# not a use. Attribute getters (``p.dtype``, ``p.shape``, ``p.data``) are ``__get__`` of their descriptor.
_METADATA = frozenset({torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.size, torch.Tensor.dim,
                       torch.Tensor.ndimension, torch.Tensor.element_size, torch.Tensor.is_floating_point,
                       torch.Tensor.is_complex, torch.Tensor.data_ptr, torch.Tensor.untyped_storage,
                       torch.Tensor.__hash__, torch.Tensor.__format__, torch.Tensor.__repr__, torch.Tensor.__len__,
                       torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.get_device,
                       torch.Tensor.storage_offset, torch.Tensor.is_inference, torch.Tensor.is_shared,
                       torch.Tensor.is_pinned, torch.Tensor.dim_order, torch.numel, torch.is_floating_point,
                       torch.is_complex, torch.is_tensor, torch.is_inference})


class OutsideUseProbe(TorchFunctionMode):
    """The first forward's probe ([Note: parameters used outside their unit])."""

    def __init__(self, unit_of: dict[int, Any], gathered: Callable[[Any], bool], quiet: Callable[[], bool],
                 found: Callable[[Any], None]):
        super().__init__()
        self._unit_of = unit_of         # id(parameter) -> its (non-root) unit
        self._gathered = gathered       # unit -> whether its parameters are full views now
        self._quiet = quiet             # True while one of the runtime's own hooks runs
        self._found = found             # gathers the unit and marks it ``outside``

    def _units_needed(self, args, kwargs) -> list:
        out = []
        for seq in (args, kwargs.values() if kwargs else ()):
            for x in seq:
                for y in (x if isinstance(x, (list, tuple)) else (x,)):
                    if isinstance(y, nn.Parameter):
                        u = self._unit_of.get(id(y))
                        if u is not None and u not in out and not self._gathered(u):
                            out.append(u)
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self._quiet() and func not in _METADATA and getattr(func, "__name__", "") != "__get__":
            for u in self._units_needed(args, kwargs):
                self._found(u)
        return func(*args, **(kwargs or {}))


def under_torch_compile() -> bool:
    """Whether this call comes from a ``torch.compile``-d function or module (whose hooks run eagerly at graph
    breaks): a frame of Dynamo's eval_frame.py other than the ``torch.compiler.disable`` wrapper (``_fn``) that
    every one of the runtime's hooks runs in. The probe stays off there: Dynamo guards on the torch-function-mode
    stack, so a probe in the first forward would recompile every region of the second."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.endswith(_EVAL_FRAME) and f.f_code.co_name != "_fn":
            return True
        f = f.f_back
    return False


_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")


_PLACEHOLDER_SHAPES = re.compile(r"\(0\)|\[0\]|\b0x\d|\dx0\b|got 1-D|size 0\b|0 elements|empty")


def placeholder_error(err: BaseException | None) -> bool:
    """Whether ``err`` (raised in a forward) reads like torch's error for a 0-element placeholder (a size (0), a
    [0] shape, a 1-D tensor where a matrix was due); not a collective timeout or a dtype mismatch, which the note
    would only misdirect."""
    return (isinstance(err, (RuntimeError, IndexError, ValueError)) and type(err).__name__ != "CollectiveTimeoutError"
            and _PLACEHOLDER_SHAPES.search(str(err)) is not None)


def freed_units_note(names: list[str]) -> str:
    """The note added to an error raised in a forward while ``names`` were freed units."""
    shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return (f"ZeroAdamW(stage=3): when this error was raised, the parameters of units {shown} were freed "
            "(0-element placeholders outside their unit's forward). If it concerns one of them, it is used "
            "outside its unit in a way the first forward did not show ([Note: parameters used outside their "
            "unit]): run that code path in the first forward, or choose the units with `wrap=` so that the "
            "parameter's module is not a unit of its own (its parameters then belong to the root).")


def entry_modules(model: nn.Module, unit_modules: list[nn.Module | None], unit_of: dict[int, int]
                  ) -> list[tuple[nn.Module, list[int]]]:
    """[Note: modules entered outside the root's forward]: (module, indices of the units whose parameters it
    registers) for every module that is not a unit with hooks and registers a parameter of the root (unit 0) or
    of a unit enclosing another unit. ``unit_modules[i]``: unit i's module, None for a unit without parameters of
    its own (a head tied to the embedding: no hooks); ``unit_of``: id(parameter) -> its unit."""
    is_unit = {id(m) for m in unit_modules if m is not None}
    containers = {0}
    for i, m in enumerate(unit_modules[1:], start=1):
        if m is not None and any(id(d) in is_unit for d in m.modules() if d is not m):
            containers.add(i)
    out = []
    for m in model.modules():           # each module once (a shared one too)
        if id(m) in is_unit:
            continue
        owners = sorted({unit_of[id(p)] for p in m._parameters.values() if p is not None and id(p) in unit_of})
        if any(i in containers for i in owners):
            out.append((m, owners))
    return out
