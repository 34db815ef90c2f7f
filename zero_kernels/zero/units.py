"""ZeRO-3 sharding units: which modules gather and free their parameters together.

[Note: stage-3 units]
A *unit* is a module whose parameters are gathered and freed together. ``wrap=None`` (default): the
root's direct children (looking through ``nn.ModuleList`` / ``nn.ModuleDict``, which have no
forward) that hold parameters are units, and inside each of them that is not itself one of repeated
blocks the repeated blocks (two or more modules of one class in a ``ModuleList`` / ``Sequential``, as
FSDP's transformer auto-wrap policy finds them) are nested units, searched no further. A repeated block
is a leaf for what it repeats in a ``ModuleList`` / ``ModuleDict`` (an MoE layer's experts, attention
heads): that gathers with it, because a forward may call those on some ranks only (experts routed by the
data), and a unit every rank does not enter waits for the others until ``timeout=`` (DeepSpeed's ZeRO-3 asks
MoE layers to be leaves too: ``set_z3_leaf_modules``). The repeated blocks of an ``nn.Sequential`` inside it
(a ConvNeXt or U-Net stage's) are still nested units: a Sequential calls every member on every rank. An MoE
layer found as a unit that is not repeated (the root's only MoE layer, or one in a ModuleList beside blocks
of other classes) still has its experts as nested units: pass ``wrap`` with its class. ``wrap`` may instead
be a callable ``module -> bool`` or a list of module classes (every non-root module it selects is a unit;
units may nest). The root is
always unit 0 and owns every parameter not inside another unit. A parameter belongs to the
innermost unit enclosing the module that registers it. Buckets never span units
(``build_layout(unit_of=...)``, ``BucketSpec.unit``): a unit is one bucket per (param group, dtype)
or several when larger than ``bucket_size``, so the per-bucket state (``master``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``: ``shard_numel`` each), the step count per parameter, ``state_dict()``
and ``full_model_state_dict()`` are the same code for every stage.

Tied parameters: a parameter registered under modules of two different units (embedding + output
head) belongs to the ROOT unit, which is gathered at the start of forward and stays gathered until
its gradients are complete (the end of backward): both users see it. Frozen parameters
(``requires_grad=False``) are not sharded: they stay replicated, full-size, on every rank (cast to
``param_dtype`` when one is given), like in stages 1-2. A parameter used *outside* the forward of
its unit (e.g. ``F.linear(x, self.emb.weight)`` in the root while ``emb`` is a unit) is found by the
first forward, and its unit is kept with the root from then on ([Note: parameters used outside their
unit] in unit_outside.py); registering it there too (tied: root unit) or choosing the units with
``wrap`` avoids keeping the whole unit.
"""
from __future__ import annotations

from typing import Callable, Sequence

from torch import nn

__all__ = ["assign_units"]


def _unit_modules(model: nn.Module, wrap) -> list[tuple[str, nn.Module]]:
    if wrap is None:
        out, blocks = [], set()

        def visit(prefix: str, mod: nn.Module) -> None:
            # members of a container (ModuleList / ModuleDict, or a Sequential root) of two or more of one class;
            # not a plain module's children (T5's encoder and decoder are both T5Stack: searched)
            repeated = _repeated_kinds(mod) if isinstance(mod, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) else set()
            for name, child in mod.named_children():
                path = prefix + name
                if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                    visit(path + ".", child)
                elif _owns_params(child):
                    out.append((path, child))
                    if type(child) in repeated:
                        blocks.add(id(child))
        visit("", model)
        # a repeated block is a leaf for what it repeats in a ModuleList / ModuleDict (experts, heads: [Note:
        # stage-3 units]), not for the blocks of a Sequential inside it (a stage of a ConvNeXt / U-Net)
        out += [blk for n, m in list(out)
                for blk in (_sequential_blocks(n + ".", m) if id(m) in blocks else _repeated_blocks(n + ".", m))]
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


def _owns_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _repeated_kinds(container: nn.Module) -> set[type]:
    """The classes of which ``container`` holds two or more parameter-owning children."""
    kinds: dict[type, int] = {}
    for k in container.children():
        if _owns_params(k):
            kinds[type(k)] = kinds.get(type(k), 0) + 1
    return {t for t, c in kinds.items() if c >= 2}


def _repeated_blocks(prefix: str, mod: nn.Module) -> list[tuple[str, nn.Module]]:
    """Inside a default unit: the members of any ``nn.ModuleList`` / ``nn.Sequential`` holding two or more
    parameter-owning modules of one class (the transformer blocks of ``model.transformer.h``), outermost
    first; a block found is not searched further. They become nested units, so a model whose one big
    child holds every block (Hugging Face GPT-2's ``transformer``) gathers one block at a time. A unit that
    is itself such a ``Sequential`` (timm's ``blocks = nn.Sequential(*blocks)`` on the root) gives its own
    blocks (it was one unit holding every block)."""
    if isinstance(mod, nn.Sequential) and _repeated_kinds(mod):
        return _sequential_blocks(prefix, mod)
    out = []
    for name, child in mod.named_children():
        path = prefix + name
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            blocks = _blocks_of(path + ".", child)
            if blocks:
                out += blocks + [x for n, k in blocks for x in _sequential_blocks(n + ".", k)]
                continue
        out += _repeated_blocks(path + ".", child)
    return out


def _sequential_blocks(prefix: str, mod: nn.Module) -> list[tuple[str, nn.Module]]:
    """Inside a repeated block: the repeated members of the ``nn.Sequential`` containers in it (the blocks of a
    stage: a Sequential calls every member, on every rank, unlike the ModuleList of an MoE layer's experts),
    outermost first, each searched the same way; ``mod`` itself when it is such a Sequential (a ResNet layer)."""
    if isinstance(mod, nn.Sequential):
        blocks = _blocks_of(prefix, mod)
        if blocks:
            return blocks + [x for n, k in blocks for x in _sequential_blocks(n + ".", k)]
    return [x for name, child in mod.named_children() if not isinstance(child, (nn.ModuleList, nn.ModuleDict))
            for x in _sequential_blocks(prefix + name + ".", child)]


def _blocks_of(prefix: str, container: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of the members of ``container`` whose class it holds two or more of."""
    kinds = _repeated_kinds(container)
    return [(prefix + n, k) for n, k in container.named_children() if type(k) in kinds]


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
