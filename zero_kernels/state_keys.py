"""Joining a module's ``state_dict()`` keys to the optimizer's parameters, and wrapper-free names.

[Note: state-dict keys]
``module.state_dict()`` keys and ``module.named_parameters()`` names are not the same strings under
common wrappers: torch's activation-checkpoint wrapper registers its inner module as
``_checkpoint_wrapped_module`` and strips that component from ``state_dict()`` keys only;
``torch.compile`` prefixes both with ``_orig_mod.``, DDP with ``module.``. Joining the two by *name*
therefore misses parameters (and at stage 3 falls back to the freed, 0-element parameter). The join
is by parameter IDENTITY instead: ``state_dict(keep_vars=True)`` returns the Parameter objects
themselves. Names that must match across models (a checkpoint saved without a wrapper and loaded
with one) are compared in *canonical* form: wrapper components removed, and a ``module.`` prefix
shared by every name (DDP) dropped.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

__all__ = ["keyed_state", "canonical_names", "WRAPPER_COMPONENTS"]

WRAPPER_COMPONENTS = ("_checkpoint_wrapped_module", "_orig_mod")


def keyed_state(module: nn.Module, buckets: Iterable) -> list[tuple[str, Any, torch.Tensor]]:
    """(state_dict key, ParamSpec of the parameter it holds or None, the tensor) for every entry of
    ``module.state_dict()``, joined by parameter identity to the buckets' ``params`` /
    ``param_specs`` (None: a frozen parameter, a buffer, or a tensor no bucket manages)."""
    spec_of = {id(p): ps for b in buckets for p, ps in zip(b.params, b.param_specs)}
    return [(k, spec_of.get(id(v)), v) for k, v in module.state_dict(keep_vars=True).items()]


def canonical_names(names: Iterable[str]) -> dict[str, str]:
    """{name: canonical name}: wrapper components dropped, then a ``module.`` prefix shared by all
    names (DDP) dropped. Raises ValueError when two names collapse to one."""
    names = list(names)
    out = {n: ".".join(c for c in n.split(".") if c not in WRAPPER_COMPONENTS) for n in names}
    if out and all(c.startswith("module.") for c in out.values()):
        out = {n: c[len("module."):] for n, c in out.items()}
    seen: dict[str, str] = {}
    for n, c in out.items():
        if c in seen:
            raise ValueError(f"state names {seen[c]!r} and {n!r} are the same without wrapper prefixes")
        seen[c] = n
    return out
