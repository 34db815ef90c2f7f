"""The per-step checks of ``FusedAdam``/``FusedAdamW``: every bad hyper-parameter value or gradient
of a group is reported, naming it, before any state changes (the optimizer runs them before it builds
a plan or advances a step counter)."""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from .hparams import validate_hparams

_FP32_MAX = torch.finfo(torch.float32).max


# Constructor arguments that hold for the whole optimizer (its state formats, master weights, backend): a
# param group naming one would be ignored without a word, so it is refused.
OPTIMIZER_WIDE = ("exp_avg_dtype", "exp_avg_sq_dtype", "store_param_remainders", "min_8bit_size",
                  "master_weights", "backend")


def check_group_keys(gi: int, group: dict[str, Any]) -> None:
    """ValueError naming the key when param group ``gi`` sets an optimizer-wide argument."""
    wide = [k for k in OPTIMIZER_WIDE if k in group]
    if wide:
        raise ValueError(f"param_groups[{gi}] sets {wide[0]!r}, which holds for the whole optimizer, not per "
                         f"group (state formats, master weights and backend: {list(OPTIMIZER_WIDE)}); pass it "
                         "to the constructor, and give parameters that need other settings their own "
                         "optimizer")


def check_distinct(gi: int, tensors: list[Any]) -> None:
    """ValueError naming both places when param group ``gi`` lists one tensor twice (a tied weight taken from
    two modules' ``parameters()``): torch.optim warns and updates it twice per step (and says it will refuse
    it); a fused launch would update it twice in one pass with one step counter, which is neither."""
    first: dict[int, int] = {}
    for i, t in enumerate(tensors):
        j = first.setdefault(id(t), i)
        if j != i and isinstance(t, Tensor):
            raise ValueError(f"param_groups[{gi}]['params'][{i}] is param_groups[{gi}]['params'][{j}] again (one "
                             "parameter listed twice, e.g. a tied weight taken from two modules); list each "
                             "parameter once, e.g. list(dict.fromkeys(params)), or model.parameters(), which "
                             "lists a tied weight once")


def _elements_overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors viewing one storage share an element (exact, from their strides)."""
    if a.element_size() != b.element_size():
        return True                                 # different element sizes over one storage: say so
    n = a.untyped_storage().nbytes() // a.element_size()
    mark = torch.zeros(n, dtype=torch.int8)
    mark.as_strided(a.shape, a.stride(), a.storage_offset()).fill_(1)
    return bool(mark.as_strided(b.shape, b.stride(), b.storage_offset()).any())


def internal_overlap(t: Tensor) -> bool:
    """Whether two elements of ``t`` are one memory location (an expanded / stride-0 view): no in-place
    update can step them as separate elements (torch's own in-place ops refuse such a tensor)."""
    if t.numel() <= 1 or t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return False
    dims = sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1)
    extent = 1                                      # elements spanned by the smaller-stride dims
    for st, n in dims:
        if st < extent:                             # stride 0, or dims interleaving: count exactly
            offsets = torch.arange(t.storage_offset() + extent + sum((n2 - 1) * s2 for s2, n2 in dims))
            return offsets.as_strided(t.shape, t.stride(), t.storage_offset()).unique().numel() < t.numel()
        extent = st * (n - 1) + extent
    return False


def storage_key(t: Any) -> tuple | None:
    """(device, storage address) of a tensor that has memory to share, else None (meta, sparse, empty, a subclass
    without storage)."""
    if not isinstance(t, Tensor) or t.numel() == 0 or t.device.type == "meta" or t.is_sparse:
        return None
    try:
        return t.device, t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def overlapping_pair(tensors: list[Tensor]) -> tuple[int, int] | None:
    """Indices (i, j), i < j, of two distinct tensors that share memory (one a view of the other, e.g.
    ``Parameter(a.data.t())``), else None. One pass over data pointers; exact only where two tensors of
    one storage have overlapping byte ranges."""
    spans: dict[tuple, list[tuple[int, int, int]]] = {}
    for i, t in enumerate(tensors):
        key = storage_key(t)
        if key is None:
            continue
        lo = t.data_ptr()
        hi = lo + t.element_size() * (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())))
        spans.setdefault(key, []).append((lo, hi, i))
    for group in spans.values():
        group.sort()
        for k, (lo, hi, i) in enumerate(group):
            for lo2, _, j in group[k + 1:]:
                if lo2 >= hi:
                    break
                if tensors[i] is not tensors[j] and _elements_overlap(tensors[i], tensors[j]):
                    return min(i, j), max(i, j)
    return None


def check_no_shared_memory(gi: int, tensors: list[Any], others: list[tuple[int, int, Tensor]]) -> None:
    """ValueError naming both when a parameter of new group ``gi`` shares memory with another parameter (of
    the group, or ``others``: (group, index, tensor) of the groups before) without being it: a fused step
    updates every parameter from its value before the step, where torch.optim.AdamW updates one after the
    other, each seeing the other's write (so the result would differ without a word)."""
    earlier = {id(t): (g, i) for g, i, t in others}
    for i, t in enumerate(tensors):
        if id(t) in earlier:        # torch's own message names no parameter
            g, j = earlier[id(t)]
            raise ValueError(f"param_groups[{gi}]['params'][{i}] is param_groups[{g}]['params'][{j}] too: a parameter "
                             "belongs to one group (torch.optim refuses it as well); remove it from one of them")
    where = [(gi, i, t) for i, t in enumerate(tensors) if isinstance(t, Tensor)] + list(others)
    pair = overlapping_pair([t for _, _, t in where])
    if pair is None:
        return
    (ga, ia, _), (gb, ib, _) = sorted([where[pair[0]], where[pair[1]]], key=lambda w: w[:2])
    raise ValueError(f"param_groups[{ga}]['params'][{ia}] and param_groups[{gb}]['params'][{ib}] share memory (one "
                     "is a view of the other, e.g. nn.Parameter(a.data.t())): torch.optim.AdamW updates them one "
                     "after the other, each seeing the other's write, while a fused step updates each from its "
                     "value before the step. Tie them instead (the same Parameter in both places) or give the "
                     "optimizer one of them")


OVERLAP_FIX = ("has internally overlapping memory (an expanded or stride-0 view, e.g. nn.Parameter(x.expand(4))): "
               "several of its elements are one memory location, which no in-place update can step as separate "
               "elements; make it a tensor of its own (.clone())")


LAZY_FIX = ("is an uninitialized parameter of a lazy module (nn.LazyLinear, ...): it has no shape or dtype yet; run "
            "one forward pass (a dry run) before building the optimizer")


def param_dtype_problem(t: Tensor, optimizer: str) -> str | None:
    """Why parameter ``t`` cannot be stepped by the fp32 kernels (its dtype, or none yet), with the fix; None if
    it can."""
    if isinstance(t, torch.nn.parameter.UninitializedParameter):
        return LAZY_FIX
    if t.is_complex():
        return (f"is complex ({t.dtype}); {optimizer} supports real floating-point parameters only: keep a real "
                "Parameter of shape (..., 2) and use torch.view_as_complex(p) in the forward")
    if not t.is_floating_point():
        return f"has dtype {t.dtype}; optimizers need floating-point parameters (integer tensors have no gradient)"
    if t.dtype == torch.float64:
        return (f"has dtype torch.float64; {optimizer} computes in fp32 (every backend, and the fp32 reference), "
                "which would round each float64 update to fp32 without a word; use torch.optim.AdamW for "
                "float64 parameters, or cast them to float32 / bfloat16 / float16")
    return None


def check_scalars(gi: int, group: dict[str, Any]) -> None:
    """Hyper-parameters the kernels take as fp32 must fit in fp32 (torch.optim.AdamW raises too); no
    optimizer-wide argument set on the group since (check_group_keys); the rules of construction
    (hparams.validate_hparams) still hold for the number-valued ones, whatever set them since
    (``param_groups[i]["betas"] = ...``, ``load_state_dict``, a scheduler): checked at every step before
    anything changes, as the kernels would refuse them only after earlier groups were stepped. Tensor
    values (lr, betas) are not read back (no device sync)."""
    check_group_keys(gi, group)
    for k in ("lr", "eps", "weight_decay"):
        v = group[k]
        if not isinstance(v, Tensor) and abs(float(v)) > _FP32_MAX:
            raise RuntimeError(f"param_groups[{gi}]['{k}'] = {v!r} cannot be converted to float32 "
                               "without overflow (the kernels compute in fp32; torch.optim.AdamW "
                               "raises the same); use a finite fp32 value")
    lr, betas = group["lr"], group["betas"]
    if isinstance(betas, (tuple, list)):
        # a one-element Tensor beta is not read back; a (float, Tensor) pair is fine here: OneCycleLR / CyclicLR
        # (cycle_momentum) write a float beta1 beside a Tensor beta2, and torch.optim.AdamW steps on
        betas = tuple(0.0 if isinstance(b, Tensor) and b.numel() == 1 else b for b in betas)
    hp = (0.0 if isinstance(lr, Tensor) and lr.numel() == 1 else lr,
          tuple(betas) if isinstance(betas, list) else betas, group["eps"], group["weight_decay"])
    if not (all(type(x) in (int, float) for x in (hp[0], hp[2], hp[3])) and isinstance(hp[1], tuple)
            and all(type(b) in (int, float) for b in hp[1]) and _valid_numbers(*hp)):
        validate_hparams(*hp, where=f" in param_groups[{gi}] (nothing was changed)")


@functools.lru_cache(maxsize=256)
def _valid_numbers(lr: float, betas: tuple, eps: float, weight_decay: float) -> bool:
    """validate_hparams' verdict on plain numbers, remembered (check_scalars runs every step, per group)."""
    try:
        validate_hparams(lr, betas, eps, weight_decay)
    except ValueError:
        return False
    return True

def check_grads(optimizer: str, gi: int, group: dict[str, Any], grads: list[Tensor | None]) -> None:
    """Every bad gradient of group ``gi`` is reported, naming it, before any state changes."""
    for pi, (p, g) in enumerate(zip(group["params"], grads)):
        if g is None:
            continue
        where = f"param_groups[{gi}]['params'][{pi}]"
        why = param_dtype_problem(p, optimizer)
        if why:   # cast since construction (model.double())
            raise ValueError(f"{where} {why}. Nothing was changed.")
        if g.is_sparse:
            raise RuntimeError(f"{where} has a sparse gradient; {optimizer} does not "
                               "support sparse gradients, please consider SparseAdam instead")
        if g.shape != p.shape:
            raise RuntimeError(f"{where}: gradient shape {tuple(g.shape)} does not match the "
                               f"parameter's {tuple(p.shape)}")
        if g.dtype != p.dtype:
            raise RuntimeError(f"{where}: gradient dtype {g.dtype} does not match the "
                               f"parameter's {p.dtype}")
        if g.device != p.device:
            raise RuntimeError(f"{where}: gradient on {g.device}, parameter on {p.device}")


def check_amp_args(grad_scale: Any, found_inf: Any) -> None:
    """``step(grad_scale=, found_inf=)`` (or GradScaler's attributes of the same names): one-element Tensors, as
    torch's fused optimizers take them; refused before anything changes (a float used to fail after the step
    counters had moved)."""
    for name, v, meaning, example in (
            ("grad_scale", grad_scale, "the loss scale the gradients are divided by", "1024.0"),
            ("found_inf", found_inf, "nonzero: skip the step", "1.0")):
        if v is None or (isinstance(v, Tensor) and v.numel() == 1 and v.dtype not in (torch.complex64,
                                                                                       torch.complex128)):
            continue
        got = f"a Tensor of shape {tuple(v.shape)}, dtype {v.dtype}" if isinstance(v, Tensor) else repr(v)
        raise TypeError(f"step({name}=...) takes a one-element Tensor ({meaning}; GradScaler sets it) or None, got "
                        f"{got}: pass e.g. torch.tensor([{example}]). Nothing was changed.")
