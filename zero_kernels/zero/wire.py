"""Bytes on the wire: what the collectives of this process send, per process group and link class.

[Note: bytes on the wire]
Every collective issued through collectives.py (and the qgZ all-to-all, qgz.py) records the bytes
*this rank sends*, per destination, in process-wide counters keyed by (process group, link class,
kind). ``ZeroAdamW.comm_report()`` reads the counters of its own groups (the shard group and, under
hybrid sharding, the replicate group) at the end of every step.
  * Point-to-point paths (gloo's p2p reduce-scatter and all-gather, [Note: gloo collectives]; the
    qgZ all-to-all): exact, per peer: every message is counted with its destination.
  * Native collectives (all-reduce, NCCL's reduce-scatter / all-gather, broadcast): the per-rank
    volume of the bandwidth-optimal ring algorithm (all-reduce 2(n-1)/n x the buffer, reduce-scatter
    and all-gather (n-1)/n x the full buffer, broadcast (n-1)/n x the buffer on average), spread
    evenly over the group's other ranks: a model, as in the ZeRO paper's volume accounting.
Link class of a message: ``"intra"`` when sender and receiver are on the same node, ``"inter"``
otherwise. The node of a global rank is ``rank // ranks_per_node``; ``ranks_per_node`` is torchrun's
``LOCAL_WORLD_SIZE`` (every rank on one node without it), or what :func:`set_ranks_per_node` set.
Counters are process-wide, like torch's CUDA memory statistics: two optimizers over the same group
see each other's bytes.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Iterable

import torch.distributed as dist

__all__ = ["record_sends", "record_collective", "set_ranks_per_node", "ranks_per_node", "WireMeter", "LINKS"]

LINKS = ("intra", "inter")
_COUNTS: dict[tuple[int, str, str], int] = defaultdict(int)
_RANKS: dict[int, tuple[Any, tuple[int, ...]]] = {}    # id(group) -> (the group, kept alive so its id is never
                                                        # reused by another, its global ranks)
_PER_NODE: int | None = None


def set_ranks_per_node(k: int | None) -> None:
    """Ranks per node for the link classes (None: torchrun's LOCAL_WORLD_SIZE, else one node)."""
    global _PER_NODE
    if k is not None and k < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {k}")
    _PER_NODE = k


def ranks_per_node() -> int | None:
    if _PER_NODE is not None:
        return _PER_NODE
    env = os.environ.get("LOCAL_WORLD_SIZE")
    return int(env) if env else None


def _key(group) -> int:
    return id(group if group is not None else dist.group.WORLD)


def _link(peer: int) -> str:
    k = ranks_per_node()
    return "intra" if k is None or peer // k == dist.get_rank() // k else "inter"


def record_sends(kind: str, group, sends: Iterable[tuple[int, int]]) -> None:
    """Messages this rank sends: (global rank of the destination, bytes)."""
    g = _key(group)
    for peer, nbytes in sends:
        _COUNTS[(g, _link(peer), kind)] += int(nbytes)


_RING = {"all_reduce": lambda n: 2.0 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n}


def record_collective(kind: str, group, nbytes: int, algorithm: str | None = None) -> None:
    """A native collective over a buffer of ``nbytes`` (the full buffer for reduce-scatter and
    all-gather): the ring volume of ``algorithm`` (default ``kind``; gloo's emulations of a
    reduce-scatter / all-gather by an all-reduce pass "all_reduce"), spread evenly over the group's
    other ranks."""
    g = _key(group)
    cached = _RANKS.get(g)
    if cached is None:
        pg = group if group is not None else dist.group.WORLD
        cached = _RANKS[g] = (pg, tuple(dist.get_process_group_ranks(pg)))
    ranks = cached[1]
    me = dist.get_rank()
    peers = [r for r in ranks if r != me]
    if not peers:
        return
    per_peer = _RING[algorithm or kind](len(ranks)) * nbytes / len(peers)
    record_sends(kind, group, [(p, round(per_peer)) for p in peers])


def _read(groups: list) -> dict[tuple[str, str], int]:
    keys = {_key(g) for g in groups}
    out: dict[tuple[str, str], int] = defaultdict(int)
    for (g, link, kind), n in _COUNTS.items():
        if g in keys:
            out[(link, kind)] += n
    return out


class WireMeter:
    """Bytes one optimizer's groups sent: since construction, and in the last step (between two
    ``mark()`` calls: the end of the previous step and the end of this one, so the step's backward
    is included)."""

    def __init__(self, groups: list):
        self.groups = list(groups)
        self.start = self.prev = _read(self.groups)
        self.last: dict[tuple[str, str], int] = {}

    def mark(self) -> None:
        now = _read(self.groups)
        self.last = _diff(now, self.prev)
        self.prev = now

    def report(self) -> dict[str, Any]:
        return {"last_step": _table(self.last), "total": _table(_diff(_read(self.groups), self.start)),
                "ranks_per_node": ranks_per_node()}


def _diff(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b) if a.get(k, 0) - b.get(k, 0)}


def _table(counts: dict[tuple[str, str], int]) -> dict[str, Any]:
    """{"intra": bytes, "inter": bytes, "by_kind": {kind: {"intra": .., "inter": ..}}}"""
    by_kind: dict[str, dict[str, int]] = {}
    for (link, kind), n in sorted(counts.items()):
        by_kind.setdefault(kind, dict.fromkeys(LINKS, 0))[link] += n
    return {link: sum(n for (lk, _), n in counts.items() if lk == link) for link in LINKS} | {"by_kind": by_kind}
