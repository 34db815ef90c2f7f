"""Reading the model without changing it: parameter names, tied parameters, trainable/frozen,
param groups (see [Note: construction order] in config.py)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..hparams import validate_hparams
from ..optim_checks import LAZY_FIX, OVERLAP_FIX, internal_overlap, overlapping_pair
from .config import FLOAT_DTYPES

__all__ = ["ModelParams", "read_model", "model_error", "resolve_groups", "check_frozen", "HPARAM_KEYS",
           "sparse_message", "sparse_module_error"]

HPARAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


class ModelParams(NamedTuple):
    uniq: list[tuple[str, nn.Parameter]]       # each Parameter once, under its first name
    trainable: list[tuple[str, nn.Parameter]]
    frozen: list[tuple[str, nn.Parameter]]
    first_name: dict[int, str]                 # id(p) -> first name
    aliases: dict[int, list[str]]              # id(p) -> its other names (tied weights)


def read_model(model: nn.Module) -> ModelParams:
    first_name: dict[int, str] = {}
    aliases: dict[int, list[str]] = {}
    uniq: list[tuple[str, nn.Parameter]] = []
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first_name:
            aliases[id(p)].append(n)
        else:
            first_name[id(p)] = n
            aliases[id(p)] = []
            uniq.append((n, p))
    trainable = [(n, p) for n, p in uniq if p.requires_grad]
    frozen = [(n, p) for n, p in uniq if not p.requires_grad]
    return ModelParams(uniq, trainable, frozen, first_name, aliases)


def model_error(trainable, param_dtype) -> str | None:
    devices = set()
    for n, p in trainable:
        if isinstance(p, nn.parameter.UninitializedParameter):
            return f"parameter {n!r} {LAZY_FIX}"
        if p.dtype not in FLOAT_DTYPES:
            return (f"parameter {n!r} has dtype {p.dtype}: ZeRO shards float32/bfloat16/float16 "
                    "parameters only; set requires_grad=False on it to leave it out")
        if p.is_sparse:
            return f"parameter {n!r} is sparse; ZeRO needs dense parameters"
        if internal_overlap(p):
            return f"parameter {n!r} {OVERLAP_FIX}"
        devices.add(p.device)
    if len(devices) > 1:
        where = {str(d): next(n for n, p in trainable if p.device == d) for d in devices}
        return (f"trainable parameters are on several devices {where}: move the model to one device "
                "before constructing the optimizer")
    if not trainable:
        return "the model has no trainable parameters (all have requires_grad=False)"
    pair = overlapping_pair([p for _, p in trainable])
    if pair is not None:
        a, b = trainable[pair[0]][0], trainable[pair[1]][0]
        return (f"parameters {a!r} and {b!r} share memory (one is a view of the other, e.g. "
                "nn.Parameter(w.data.t())): ZeRO keeps each parameter in its own place of a flat buffer, so "
                "they would stop sharing it and train apart without a word; tie them instead (the same "
                "Parameter in both modules) or make them separate tensors")
    return None


def sparse_message(name: str) -> str:
    return (f"parameter {name!r} has a sparse gradient (nn.Embedding(sparse=True), nn.EmbeddingBag(sparse=True) or "
            "F.embedding(..., sparse=True)): ZeRO reduces and shards dense gradients only; build the module "
            "with sparse=False, or train that parameter with torch.optim.SparseAdam outside ZeroAdamW "
            "(requires_grad=False on it when ZeroAdamW is built)")


def sparse_module_error(model: nn.Module, mp: ModelParams) -> str | None:
    """The message for a trainable parameter of a module that makes sparse gradients, else None."""
    for mod in model.modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse and mod.weight.requires_grad:
            return sparse_message(mp.first_name.get(id(mod.weight), "weight"))
    return None


def check_frozen(frozen: list[tuple[str, nn.Parameter]]) -> None:
    """ValueError when a parameter frozen at construction is trainable now and got a gradient: it was unfrozen
    (``requires_grad_(True)``), but it has no shard, state or bucket, so the step would leave it untrained
    without a word (torch.optim.AdamW over ``model.parameters()`` would train it)."""
    for n, p in frozen:
        if p.grad is not None and p.requires_grad:    # frozen again: a stale gradient is inert (torch ignores it)
            raise ValueError(
                f"parameter {n!r} was frozen (requires_grad=False) when the ZeRO optimizer was built, so it "
                "has no shard, optimizer state or gradient bucket, and it has a gradient now (unfrozen since): "
                "step() would leave it untrained. Build the optimizer after unfreezing it (the layout is fixed "
                "at construction), or build it with the parameter trainable and freeze it with "
                "requires_grad_(False) until it should train: a parameter without a gradient is skipped by the "
                "step (as by torch.optim.AdamW) and trains again once unfrozen. If it was unfrozen by mistake, "
                "freeze it again (its leftover gradient is then ignored). Nothing was changed.")


def check_added(model: nn.Module, known: set[int]) -> None:
    """ValueError when a trainable parameter of the model that was not the model's at construction (``known``: the
    ids of its parameters then) has a gradient: it was added or replaced since (Hugging Face's
    ``resize_token_embeddings`` replaces an untied output head with a new module), so the step would leave it
    untrained without a word, as torch.optim.AdamW built before the change would."""
    for n, p in model.named_parameters():
        if id(p) not in known and p.requires_grad and p.grad is not None:
            raise ValueError(
                f"parameter {n!r} is not one of the ZeRO optimizer's: it was added to the model or replaced (a new "
                "module or nn.Parameter; model.resize_token_embeddings() replaces an untied output head) after the "
                "optimizer was built, and it has a gradient now: step() would leave it untrained. Build the "
                "optimizer after changing the model (the layout is fixed at construction). Nothing was changed.")


def _group_params(gi: int, g: dict, mp: ModelParams, group_of: dict[int, int]):
    """(trainable Parameters of param_groups[gi], error)."""
    by_name = {n: p for n, p in mp.uniq}
    trainable = {id(p): n for n, p in mp.trainable}
    ps = []
    for x in (list(g["params"]) if not isinstance(g["params"], Tensor) else [g["params"]]):
        p = by_name.get(x) if isinstance(x, str) else x
        if p is None or (id(p) not in mp.first_name):
            what = repr(x) if isinstance(x, str) else f"a tensor of shape {tuple(x.shape)}"
            return None, f"param_groups[{gi}] holds {what}, which is not a parameter of the model"
        if id(p) not in trainable:
            continue                    # frozen: silently left out, like the default group
        if id(p) in group_of:
            return None, (f"parameter {trainable[id(p)]!r} appears in param_groups[{group_of[id(p)]}] and "
                          f"param_groups[{gi}]; each parameter must be in exactly one group")
        group_of[id(p)] = gi
        ps.append(p)
    return ps, None


def _plain_data(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, str)) or (
        isinstance(v, (list, tuple)) and all(_plain_data(x) for x in v))


def resolve_groups(param_groups, mp: ModelParams, defaults: dict, optimizer_wide: tuple[str, ...] = ()):
    """(groups as torch.optim param_group dicts of Parameters, group index per parameter id, error).
    Keys besides the hyper-parameters are kept, as torch.optim keeps them (a group's ``"name"``, timm's
    ``"lr_scale"`` read by its scheduler), if they are plain data (checkpoints save them as JSON) and not one of
    ``optimizer_wide`` (ZeroAdamW's own options, which hold for every group)."""
    if param_groups is None:
        return [{"params": [p for _, p in mp.trainable]}], {id(p): 0 for _, p in mp.trainable}, None
    out, group_of = [], {}
    for gi, g in enumerate(param_groups):
        if not isinstance(g, dict) or "params" not in g:
            return [], {}, f"param_groups[{gi}] must be a dict with a 'params' list"
        ps, err = _group_params(gi, g, mp, group_of)
        if err:
            return [], {}, err
        extra = {k: v for k, v in g.items() if k != "params"}
        others = sorted(set(extra) - set(HPARAM_KEYS))
        wide = [k for k in others if k in optimizer_wide]
        if wide:
            return [], {}, (f"param_groups[{gi}] sets {wide[0]!r}, which holds for the whole optimizer, not per "
                            "group: pass it to ZeroAdamW(...) itself")
        odd = [k for k in others if not _plain_data(extra[k])]
        if odd:
            return [], {}, (f"param_groups[{gi}][{odd[0]!r}] is a {type(extra[odd[0]]).__name__}: keys besides the "
                            "hyper-parameters are kept as torch.optim keeps them, but must be plain data (numbers, "
                            "strings, lists of them) for checkpoints to save them")
        h = {**defaults, **extra}
        try:
            validate_hparams(h["lr"], h["betas"], h["eps"], h["weight_decay"], where=f" in param_groups[{gi}]")
        except ValueError as e:
            return [], {}, str(e)
        if not ps:
            return [], {}, f"param_groups[{gi}] holds no trainable parameter; remove it"
        out.append({"params": ps, **extra})
    missing = [n for n, p in mp.trainable if id(p) not in group_of]
    if missing:
        return [], {}, (f"trainable parameter {missing[0]!r} (and {len(missing) - 1} more) is in no param "
                        "group: add it to one, or set requires_grad=False on it")
    return out, group_of, None


def plain(v):
    """A hyper-parameter as plain data (a one-element Tensor as a float; tuples as lists)."""
    if isinstance(v, torch.Tensor):
        return float(v.reshape(()).item())
    if isinstance(v, (tuple, list)):
        return [plain(x) for x in v]
    return v
