"""ZeRO-3: units kept gathered after a forward for its backward, and given back when none follows.

[Note: forward without backward]
After a forward whose output needs a gradient, the root unit and the last unit of the forward stay
gathered: they are the first ones backward needs ([Note: stage-3 hooks] in stage3.py). A forward
that no backward follows (evaluation with grad mode on, a forward whose loss is only logged) would
leave them gathered until the next backward. They are given back:
  * at the end of the forward, when no backward is expected: grad mode off, no output requiring a
    gradient, or the root module in eval mode (``model.eval()``; a backward after an eval-mode
    forward is still exact: its pre-backward hooks gather the root and the last unit again, one
    more all-gather each);
  * when the forward's autograd graph is freed without a backward (the output and everything
    computed from it dropped): every pre-backward hook registered in a forward holds that forward's
    token (:meth:`BackwardHold.start_forward`); autograd keeps the hooks while the graph lives, so
    the token dies with the graph, and its finalizer frees the units if that forward's backward
    never started and no later forward began;
  * at the start of the next forward (a forward whose graph is still alive, e.g. kept in a list of
    outputs): the units held for the earlier forward, except the root, are freed; if its backward
    comes after all, its pre-backward hooks gather them again.
Freeing is local (a storage resize, no collective), so a finalizer may run wherever Python drops
the graph.
"""
from __future__ import annotations

import weakref
from typing import Callable

__all__ = ["BackwardHold"]


class _Token:
    """Held by the pre-backward hooks of one forward; dies with that forward's autograd graph."""


class BackwardHold:
    """Which forward, if any, the gathered units are held for ([Note: forward without backward])."""

    def __init__(self, release: Callable[[], None]):
        self._release = release     # frees every gathered unit (the runtime's free_all)
        self.generation = 0         # forwards started so far
        self.held: int | None = None    # generation whose units are held for its backward
        self.token: _Token | None = None    # the current forward's token, until its end

    def start_forward(self) -> bool:
        """A new forward begins: returns whether units were still held for an earlier forward."""
        stale = self.held is not None
        self.held = None
        self.generation += 1
        self.token = _Token()
        weakref.finalize(self.token, self._graph_freed, self.generation).atexit = False   # not at exit
        return stale

    def end_forward(self, hold: bool) -> None:
        """The forward ended; ``hold``: units stay gathered for its backward."""
        self.held = self.generation if hold else None
        self.token = None           # now held only by the hooks in the graph (if any)

    def clear(self) -> None:
        self.held = None            # a backward started (its end frees the units), or all were freed

    def _graph_freed(self, generation: int) -> None:
        if self.held == generation:
            self.held = None
            self._release()
