"""The optimizer step as ``torch.compile`` traces it (a mixin of ``FusedAdam``).

[Note: the traced step]
Dynamo traces ``opt.step()`` into the caller's graph when every call in it is an operator: the
kernels are (``zero_kernels.ops``, [Note: kernels as operators]), but the eager host path is
not traceable as it is: launch plans are cached by identity, built with dataclasses, step counters
are views of packed buffers found through ``Tensor._base``. torch.optim solves the same problem
with ``_init_group``: Dynamo special-cases a method of that name on any ``torch.optim.Optimizer``
(``torch/_dynamo/variables/optimizer.py``, ``OptimizerVariable``): it runs it eagerly, on the real
tensors, at compile time, installs guards on ``param_groups`` and ``state``, and gives each tensor
the method appended to its list a source (a parameter, its ``.grad``, a state entry) so that it
becomes a graph input. So, under compilation:

* ``_init_group(group, masters, grads, ...)`` is the eager plan lookup (``FusedAdam._prepare``:
  every group checked first, states created, plans cached and shared with eager steps); it appends
  each launch's tensors to the flat lists and returns a constant, per launch: (tensor count,
  backend, whether it writes a 16-bit copy). A launch's step buffer (whose views are the states'
  ``step``) is appended too: the graph adds to it, so eager and compiled steps count together.
* ``_traced_step`` then does per launch what the eager step does (``FusedAdam._launch``: counters,
  coefficients, grad scale) and calls the backend's operator (``ops.traceable``): one graph,
  no break. Guards recompile when a gradient appears or vanishes, or changes dtype or shape.

lr may be a float (a constant of the graph: a new value recompiles, as with torch.optim) or a
tensor (a graph input: schedulers change it freely). Not traced, with an error that says so:
tensor betas, parameters whose update needs a contiguous temporary (non-contiguous parameters)
and DTensor (FSDP2) parameters.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import ops


class TracedStep:
    """``_init_group`` / ``_traced_step`` of :class:`zero_kernels.FusedAdam` ([Note: the traced step])."""

    def _init_group(self, group: dict[str, Any], masters: list[Tensor], grads: list[Tensor],
                    exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], max_exp_avg_sqs: list[Tensor],
                    params16: list[Tensor], steps: list[Tensor]) -> tuple:
        """Run eagerly by Dynamo at compile time: fills the lists with group ``group``'s launches
        and returns ((count, backend, writes_16bit), ...) per launch."""
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        where = f"{type(self).__name__}.step() under torch.compile: param_groups"
        if gi == 0:   # once per trace, before the first group: the eager step's checks and plans
            for i, g in enumerate(self.param_groups):
                if any(isinstance(b, Tensor) for b in g["betas"]):
                    raise RuntimeError(f"{where}[{i}] has tensor betas; pass Python floats (a tensor lr "
                                       "is fine). Nothing was updated.")
            self._traced_work = self._prepare()
        _, group_grads, plan = self._traced_work[gi]
        self._traced_work[gi] = None   # holds the gradients of this compile: do not keep them alive
        if plan.writebacks or plan.dtensor:
            raise RuntimeError(f"{where}[{gi}] has non-contiguous or DTensor parameters, which the traced "
                               "step does not support; make them contiguous, or call step() outside the "
                               "compiled function")
        launches = []
        for L in plan.launches:
            masters += L.masters
            grads += plan.grads_for(L, group_grads)
            exp_avgs += L.exp_avgs
            exp_avg_sqs += L.exp_avg_sqs
            max_exp_avg_sqs += L.max_exp_avg_sqs
            params16 += L.params16
            steps += [self.state[group["params"][pi]]["step"] for pi in L.index]
            name = "reference" if L.ref_only else self._resolved.get(L.device) or self._resolve(L.device)
            launches.append((len(L.masters), name, L.p16_dtype is not None))
        return tuple(launches)

    def _traced_step(self, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """The step Dynamo records: per group, ``_init_group`` then one operator call per launch."""
        for group in self.param_groups:
            masters, grads, exp_avgs, exp_avg_sqs, max_sqs, params16, steps = [], [], [], [], [], [], []
            launches = self._init_group(group, masters, grads, exp_avgs, exp_avg_sqs, max_sqs, params16, steps)
            lo = lo16 = 0
            for n, backend, writes16 in launches:
                hi, hi16 = lo + n, lo16 + (n if writes16 else 0)
                self._launch(group, ops.traceable(backend), _advance(steps[lo:hi], found_inf), masters[lo:hi],
                             grads[lo:hi], exp_avgs[lo:hi], exp_avg_sqs[lo:hi], max_sqs[lo:hi] if max_sqs else [],
                             params16[lo16:hi16] if writes16 else None, grad_scale, found_inf)
                lo, lo16 = hi, hi16


def _advance(steps: list[Tensor], found_inf: Tensor | None) -> Tensor:
    """The launch's step counters advanced in place (by 1 - found_inf), as one 1-D tensor."""
    if found_inf is None:
        torch._foreach_add_(steps, 1.0)
    else:   # a list of 0-d tensors: a 0-d CPU tensor alone would be read back as a Python scalar
        inc = 1.0 - found_inf.to(steps[0].device, torch.float32).reshape(())
        torch._foreach_add_(steps, [inc] * len(steps))
    return torch.stack(steps)
