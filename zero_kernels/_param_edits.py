"""Parameters written outside the optimizer while it keeps their master ([Note: parameters edited outside
the optimizer]): found by their version counters, adopted element by element before the next update."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import codecs
from ._launch_plan import local

# [Note: parameters edited outside the optimizer]
# A 16-bit parameter with master weights is the rounding of a master the optimizer keeps (``master_param``:
# fp32; ``master_remainder``: the bf16 bits plus an int16 remainder) and the update starts from the master.
# torch.optim.AdamW starts from the parameter, so a write to it between steps (``model.load_state_dict``,
# ``torch.nn.init.*_``, pruning ``with torch.no_grad(): p.mul_(mask)``, weight surgery) is what the next step
# continues from. Here such a write would be lost (an fp32 master overwrites it at the next step); with
# remainders the master joined from the written bf16 bits and the old remainder rounds back to the written
# value (the join saturates at +-0: [Note: state codecs] 4) but carries a stale fraction of a bf16 ulp.
# So every step records the version counter (``p._version``, bumped by every in-place write through torch) and
# the data pointer (moved by ``p.data = x``: ``torch.nn.utils.vector_to_parameters`` writes so) of each
# parameter whose state holds a master, and the next step, before any update, ADOPTS the parameter of every
# changed one, element by element: a master that still rounds (to nearest even) to the parameter is
# kept, extra bits and all (so unchanged elements, and a consistent checkpoint loaded in either order, lose
# nothing); any other becomes the parameter's value (fp32 master), or loses its remainder. A remainder keeps
# no copy of the old bf16 value, so it cannot tell a written element from an unchanged one, and (the join
# rounding back to any written value but an exact tie) nearly every remainder is kept: a written element's
# master is the written value plus its old remainder, less than half a bf16 ulp off, where an fp32 master
# would be the written value itself. The runs agree on the written value, not bit for bit after it (the
# price of 2 bytes instead of 4; zeroing every remainder of a changed tensor instead would cost a
# consistent checkpoint loaded optimizer-first its exact resume). The same adoption, of
# every master, is ``refresh_fp32_params()`` (DeepSpeed's name): for in-place writes through ``p.data``
# (``p.data.mul_(mask)``), which neither the version counter nor the pointer sees, and nothing else does. ``load_state_dict`` counts every parameter as written
# (``all_written``): its masters are adopted by the next step, so a write made after the load (pruning a resumed
# model) stands, and parameters that do not match the loaded states (another model's, or none loaded) are what
# the run continues from, as torch.optim.AdamW's load leaves them; a consistent checkpoint loaded in either
# order keeps every master. Not under torch.compile (the traced step reads no counter).
# ZeroAdamW stages 1-2 do the same per bucket (``FlatBucket.adopt_edits``: this rank's master slice brought to
# its slice of the working parameters); stage 3 keeps no parameters between steps (the model holds empty
# placeholders: writes there raise, writes inside ``zopt.gathered()`` are written back: [Note: writes to
# stage-3 parameters] in zero/unit_bucket.py).
MASTER_KEYS = ("master_param", "master_remainder")


class Watch(NamedTuple):
    """The parameters whose states hold a master, their version counters after the last step and their data
    pointers as last seen (the step itself moves no pointer: ``edited`` reads them, ``renew`` keeps them)."""
    params: list[Tensor]
    versions: list[int]
    ptrs: list[int]


NOTHING = Watch([], [], [])


def watch(state: dict[Tensor, dict]) -> Watch:
    """The parameters of ``state`` (an optimizer's ``state``) that have a master, with their marks now."""
    params = [p for p, st in state.items() if any(k in st for k in MASTER_KEYS)]
    return Watch(params, [p._version for p in params], [p.data_ptr() for p in params])


def all_written(state: dict[Tensor, dict]) -> Watch:
    """``watch(state)`` with every parameter counted as written since (no version counter is negative)."""
    w = watch(state)
    return w._replace(versions=[-1] * len(w.params))


def renew(w: Watch) -> Watch:
    """``w`` with the versions now (after each step; ``watch`` again only when states were made)."""
    return w._replace(versions=[p._version for p in w.params])


def edited(w: Watch) -> tuple[list[Tensor], Watch]:
    """The watched parameters written since ``w`` was taken (one list comparison each for versions and pointers
    when none was), and ``w`` with the pointers now."""
    versions, ptrs = [p._version for p in w.params], [p.data_ptr() for p in w.params]
    if versions == w.versions and ptrs == w.ptrs:
        return [], w
    changed = [p for p, a, b, c, d in zip(w.params, w.versions, versions, w.ptrs, ptrs) if a != b or c != d]
    return changed, w._replace(ptrs=ptrs)


@torch.no_grad()
def adopt_master(p16: Tensor, master: Tensor | None = None, remainder: Tensor | None = None) -> None:
    """The rule of the Note, in place: ``master`` (fp32) or ``remainder`` (int16, of a bf16 ``p16``) brought to
    the 16-bit values ``p16`` (same shape), keeping every master that rounds to its parameter."""
    if remainder is not None:
        back = codecs.join_remainder(p16, remainder).to(torch.bfloat16)
        remainder.masked_fill_(back.view(torch.int16) != p16.contiguous().view(torch.int16), 0)
    elif master is not None:
        keep = master.to(p16.dtype) == p16
        master.copy_(torch.where(keep, master, p16.to(torch.float32)))


def adopt(p: Tensor, state: dict) -> None:
    """Bring the master in an optimizer ``state`` to the 16-bit parameter ``p`` (see the Note)."""
    adopt_master(local(p), local(state.get("master_param")), local(state.get("master_remainder")))
