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


# ---- [Note: communication device] (issue 10.1) ---------------------------------------------------------
def test_device_for_backend():
    """One place decides where collective tensors live: CUDA for NCCL, CPU for gloo/MPI."""
    assert C.device_for_backend("nccl").type == "cuda"
    assert C.device_for_backend("NCCL").type == "cuda"
    assert C.device_for_backend("gloo") == torch.device("cpu")
    assert C.device_for_backend("mpi") == torch.device("cpu")
    assert C.device_for_backend("custom", torch.device("meta")) == torch.device("meta")
    assert C.comm_device(None, torch.device("meta")) == torch.device("meta")    # no process group


_TENSOR_CALLS = ("all_reduce", "isend", "irecv", "send", "recv", "broadcast", "all_gather",
                 "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single")


class _Recorder:
    """Wraps the torch.distributed calls (and collectives' bound aliases) and records the device
    of every tensor they receive."""

    def __init__(self):
        self.seen: list[tuple[str, torch.device]] = []
        self.saved = []

    def _wrap(self, owner, name, label):
        orig = getattr(owner, name)

        def rec(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else [a]):
                    if isinstance(t, torch.Tensor):
                        self.seen.append((label, t.device))
            return orig(*args, **kwargs)
        self.saved.append((owner, name, orig))
        setattr(owner, name, rec)

    def __enter__(self):
        for n in _TENSOR_CALLS:
            if hasattr(dist, n):
                self._wrap(dist, n, n)
        self._wrap(C, "_rs", "reduce_scatter(single)")
        self._wrap(C, "_ag", "all_gather(single)")
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self.saved):
            setattr(owner, name, orig)

    def wrong(self, want: torch.device):
        return [(k, d) for k, d in self.seen if d != want]


def _device_worker(rank, world):
    import zero_kernels as zk
    from torch import nn
    want = C.device_for_backend(dist.get_backend())
    rec = _Recorder()
    rec.seen.append(("self-test", torch.device("meta")))          # the check can fail
    assert rec.wrong(want) == [("self-test", torch.device("meta"))]
    rec.seen.clear()
    with rec:
        for stage in (1, 2, 3):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5))
            opt = zk.ZeroAdamW(model, stage=stage, bucket_size=64, backend="reference", timeout=60,
                               loss_scale="dynamic" if stage == 2 else None)
            for s in range(2):
                x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * rank + s))
                with opt.no_sync() if s == 0 else _nullcontext():
                    opt.scale_loss(model(x).pow(2).mean()).backward()
                opt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()
            opt.full_model_state_dict()
    kinds = {k for k, _ in rec.seen}
    assert {"all_reduce", "isend", "irecv"} <= kinds, kinds
    assert rec.wrong(want) == [], rec.wrong(want)[:5]
    # Hyper-parameters are part of the cross-rank agreement (issue 13.14).
    with pytest.raises(ValueError, match="hyper-parameters differ"):
        zk.ZeroAdamW(nn.Linear(3, 3), lr=1e-3 * (rank + 1), backend="reference")


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


def test_collectives_get_tensors_on_the_group_device_world2():
    run_world(_device_worker, 2, timeout=180)
