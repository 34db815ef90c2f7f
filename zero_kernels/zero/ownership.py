"""Which ZeroAdamW manages a parameter ([Note: one ZeroAdamW per parameter])."""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["owner_error", "claim", "release"]

# [Note: one ZeroAdamW per parameter]
# A ZeroAdamW binds the model's parameters: each becomes a view of its bucket (at stage 3 an empty tensor
# between gathers), and it registers gradient and forward hooks on them. A second ZeroAdamW built on the same
# model (a notebook cell run twice, Lightning's fit() called twice) used to bind them again without a word:
# the parameters moved to the second optimizer's buckets while the first one's hooks still fired, reducing
# gradients into buffers nobody stepped (stage 2 frees p.grad after its reduction, so the second saw none).
# Now every bound parameter carries a claim (an attribute naming its optimizer), checked while the model is
# only read ([Note: construction order] in config.py: the error is agreed by every rank) and dropped by
# remove_hooks(). After remove_hooks() at stages 1-2 the parameters keep their values and a new ZeroAdamW
# can take them; at stage 3 they stay empty (the full values live in the old buckets' shards), which the
# claim remembers so that a new optimizer says so instead of binding empty tensors.
_ATTR = "_zero_kernels_owner"


class _Claim:
    """What a parameter's attribute holds: its optimizer's description and whether it is still attached."""
    __slots__ = ("what", "stage", "active")

    def __init__(self, what: str, stage: int) -> None:
        self.what, self.stage, self.active = what, stage, True

    def __deepcopy__(self, memo: Any) -> None:
        return None                  # copy.deepcopy(model): the copy's parameters are no optimizer's


def owner_error(params: list[tuple[str, nn.Parameter]]) -> str | None:
    """Why these parameters cannot be bound by a new ZeroAdamW (None when they can)."""
    for name, p in params:
        c = getattr(p, _ATTR, None)
        if not isinstance(c, _Claim):
            continue
        if c.active:
            return (f"parameter {name!r} is already managed by a {c.what} (stage {c.stage}) built on this model: "
                    "a second one would take the parameters while the first one's hooks still fire, and the two "
                    "would train them apart without a word. Keep using the first optimizer, or call its "
                    "remove_hooks() before building another on this model")
        if c.stage == 3:
            return (f"parameter {name!r} is empty: a {c.what} at stage 3 sharded this model and its hooks were "
                    "removed, so the full values live only in that optimizer's shards. Build the new optimizer on "
                    "a model loaded from its full_model_state_dict() or a checkpoint")
    return None


def claim(params: list[nn.Parameter], what: str, stage: int) -> _Claim:
    """Mark ``params`` as bound by one optimizer; returns the claim that ``release`` drops."""
    c = _Claim(what, stage)
    for p in params:
        setattr(p, _ATTR, c)
    return c


def release(params: list[nn.Parameter], c: _Claim) -> None:
    """remove_hooks(): the parameters are free again (stages 1-2) or marked empty (stage 3)."""
    c.active = False
    if c.stage != 3:
        for p in params:
            if getattr(p, _ATTR, None) is c:
                delattr(p, _ATTR)
