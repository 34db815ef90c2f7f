"""Gloo point-to-point reduce-scatter / all-gather (collectives.GLOO_MODE = "p2p") against the native
gloo collectives and the all-reduce emulation: bitwise (integer-valued floats, so every summation
order gives the same result), world sizes 2 and 3, the world group and a subgroup, sync and async,
output separate from or aliasing the bucket's own slice, several collectives in flight at once."""
from __future__ import annotations

import torch
import torch.distributed as dist
import pytest

from _dist import run_world
from zero_kernels.zero import collectives as C


def _check_group(g, rank):
    n, r = C.group_size(g), C.group_rank(g)
    for per in (1, 5, 1000):
        gen = torch.Generator().manual_seed(100 * rank + per)
        base = (torch.randint(-50, 50, (per * n,), generator=gen) * n).float()   # sums / n stay exact
        full = base.clone()
        dist.all_reduce(full, group=g)
        want_rs = full[r * per:(r + 1) * per] / n
        parts = [torch.empty(per) for _ in range(n)]
        dist.all_gather(parts, base[r * per:(r + 1) * per].clone(), group=g)
        want_ag = torch.cat(parts)
        for mode in ("p2p", "allreduce", "native"):
            C.GLOO_MODE = mode
            for async_op in (True, False):
                flat, out = base.clone(), torch.full((per,), float("nan"))
                got = C.wait(C.reduce_scatter_bucket(flat, out, g, async_op=async_op, tag=("rs", per)))
                assert got is out and torch.equal(out, want_rs), (mode, async_op, per)
                if mode != "native":             # output = this rank's slice of the bucket (no copy)
                    flat = base.clone()
                    own = flat[r * per:(r + 1) * per]
                    C.wait(C.reduce_scatter_bucket(flat, own, g, async_op=async_op, tag=("rs", per)))
                    assert torch.equal(own, want_rs), (mode, async_op, per, "in place")
                flat = base.clone()
                flat[:r * per] = float("nan")    # the other slices must be overwritten
                flat[(r + 1) * per:] = float("nan")
                got = C.wait(C.all_gather_bucket(flat, r, g, async_op=async_op, tag=("ag", per)))
                assert torch.equal(got, want_ag), (mode, async_op, per)
    C.GLOO_MODE = "p2p"
    # several buckets in flight at once (distinct and repeated tags), waited out of order
    flats = [torch.full((n * 7,), float(rank + 10 * b)) for b in range(4)]
    outs = [torch.empty(7) for _ in range(4)]
    res = [C.reduce_scatter_bucket(f, o, g, tag=b % 2) for b, (f, o) in enumerate(zip(flats, outs))]
    ags = [C.all_gather_bucket(torch.full((n * 3,), float(rank + b)), r, g, tag=b) for b in range(3)]
    members = [rank_ for rank_ in range(dist.get_world_size())
               if g is None or rank_ in dist.get_process_group_ranks(g)]
    for x in reversed(res):
        C.wait(x)
    for b, o in enumerate(outs):
        assert torch.equal(o, torch.full((7,), sum(m + 10 * b for m in members) / n)), (b, o)
    for b, a in enumerate(ags):
        got = C.wait(a)
        assert torch.equal(got, torch.tensor([float(m + b) for m in members]).repeat_interleave(3)), (b, got)


def _worker(rank, world):
    _check_group(None, rank)
    sub = dist.new_group([1, 2]) if world >= 3 else None    # every rank creates the group
    if world >= 3 and rank in (1, 2):
        _check_group(sub, rank)
    dist.barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_p2p_collectives_match_native(world):
    run_world(_worker, world, timeout=120)
