"""Bytes on the wire (issue 12 item 5, [Note: bytes on the wire] in zero_kernels/zero/wire.py):
``zopt.comm_report()`` counts what this rank sent per link class after each step. 4 gloo processes
as 2 "nodes" of 2 ranks (``set_ranks_per_node(2)``); the gloo point-to-point reduce-scatter and
all-gather are counted per message, so the counts are checked exactly against the bucket sizes:
a 1-D group of 4 sends each slice to 1 peer on its node and 2 on the other; under hybrid sharding
(mesh 2 x 2) reduce-scatters and all-gathers never cross nodes and only the replica all-reduce of
the gradient slice (2 (R-1)/R x slice bytes) does."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402
from test_hybrid import mesh_2d  # noqa: E402
from test_zero import B, batch, loss_fn, make_model  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels.zero.wire import set_ranks_per_node  # noqa: E402


def _train(steps=2, **kw):
    world, r = dist.get_world_size(), dist.get_rank()
    model = make_model()
    zopt = zk.ZeroAdamW(model, lr=1e-3, backend="reference", timeout=60, **kw)
    assert zopt.comm_report()["last_step"]["intra"] == 0          # construction is not a step
    for s in range(steps):
        idx, tgt = batch(s, world)
        loss_fn(model, idx[r * B:(r + 1) * B], tgt[r * B:(r + 1) * B]).backward()
        zopt.step()
        zopt.zero_grad()
    rep = zopt.comm_report()
    zopt.remove_hooks()
    return zopt, rep


def _bucket_bytes(zopt, dtype_size):
    return sum(b.spec.padded_numel for b in zopt.buckets) * dtype_size


def _case(rank, world):
    set_ranks_per_node(2)
    # 1-D group of 4 over two nodes: each slice goes to 1 peer on this node, 2 on the other
    zopt, rep = _train(stage=2, bucket_size=64)
    g = _bucket_bytes(zopt, 4)                      # fp32 gradients (reduce_dtype) and fp32 parameters
    k = rep["last_step"]["by_kind"]
    assert k["reduce_scatter"] == {"intra": g // 4, "inter": g // 2}, (k, g)
    assert k["all_gather"] == {"intra": g // 4, "inter": g // 2}, (k, g)
    assert rep["total"]["by_kind"]["reduce_scatter"]["inter"] == 2 * (g // 2)      # two steps
    flat = rep["last_step"]
    assert flat["inter"] == sum(v["inter"] for v in k.values()) and rep["ranks_per_node"] == 2
    # hybrid 2 x 2: reduce-scatter and all-gather inside the node; the slice all-reduce crosses
    zopt, rep = _train(stage=2, bucket_size=64, mesh=mesh_2d(2, 2))
    g = _bucket_bytes(zopt, 4)
    k = rep["last_step"]["by_kind"]
    assert k["reduce_scatter"] == {"intra": g // 2, "inter": 0}, (k, g)
    assert k["all_gather"] == {"intra": g // 2, "inter": 0}, (k, g)
    slice_allreduce = g // 2                        # 2 (R-1)/R x (g / S) with R = S = 2
    flags = k["all_reduce"]["intra"]                # the step's flag all-reduces: once per group, same size
    assert 0 < flags < 1024 and k["all_reduce"]["inter"] == slice_allreduce + flags, (k, g)
    # stage 3: cross-node bytes, plain vs hybrid vs hybrid + qwZ + qgZ
    inter = {}
    for name, kw in [("plain", {}), ("hybrid", dict(mesh=mesh_2d(2, 2))),
                     ("hybrid+qwZ+qgZ", dict(mesh=mesh_2d(2, 2), quantize_weights=True, quantize_grads=True))]:
        zopt, rep = _train(stage=3, **kw)
        inter[name] = rep["last_step"]["inter"]
        if name == "hybrid":                        # only the replica all-reduce of the slices crosses
            k = rep["last_step"]["by_kind"]
            assert k["all_gather"]["inter"] == 0 and k["reduce_scatter"]["inter"] == 0, k
    # the target: hybrid stage 3 with qwZ + qgZ (int8 across nodes, [Note: hierarchical qgZ])
    # sends <= 0.25x the cross-node bytes of plain stage 3
    assert inter["hybrid"] < inter["plain"] and inter["hybrid+qwZ+qgZ"] <= 0.25 * inter["plain"], inter
    if rank == 0:
        print("stage-3 cross-node bytes per step:", inter)
    set_ranks_per_node(None)


def test_comm_report_counts_bytes_per_link_world4():
    run_world(_case, 4, timeout=300)


def test_comm_report_without_a_group():
    """One process, no process group: nothing is sent, the report says so."""
    model = make_model()
    zopt = zk.ZeroAdamW(model, stage=2, lr=1e-3, backend="reference")
    idx, tgt = batch(0, 1)
    loss_fn(model, idx[:B], tgt[:B]).backward()
    zopt.step()
    rep = zopt.comm_report()
    assert rep["last_step"]["intra"] == rep["last_step"]["inter"] == 0 and rep["last_step"]["by_kind"] == {}
    zopt.remove_hooks()
