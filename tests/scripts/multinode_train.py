"""Hybrid-sharded training as a user launches it on two machines (issue 12 item 4), run by
tests/test_multinode.py as two torchrun launchers on this machine (loopback):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
        multinode_train.py STAGE OUT [--shard-only]     # once on each node

The mesh is (nodes, processes per node) = ("replicate", "shard"): states are sharded inside a node and
replicated across nodes. Every global rank trains on its own rows of tests/test_zero.py's batches;
rank 0 writes the full model and where each rank ran (node, local rank, its shard group) to OUT.
``--shard-only`` (the test's negative control) gives ZeroAdamW the shard group alone (process_group=):
no replica all-reduce, so each node trains on its own half of the data.
"""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_zero import B, STEPS, batch, loss_fn, make_model  # noqa: E402

import zero_kernels as zk  # noqa: E402


def main():
    stage, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    where_ = dict(process_group=mesh.get_group("shard")) if "--shard-only" in sys.argv else dict(mesh=mesh)
    zopt = zk.ZeroAdamW(model, stage=stage, **where_, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                        backend="reference", timeout=60)
    for s in range(STEPS):
        idx, tgt = batch(s, world)
        rows = slice(rank * B, (rank + 1) * B)
        loss_fn(model, idx[rows], tgt[rows]).backward()
        zopt.step()
        zopt.zero_grad()
    full = zopt.full_model_state_dict()
    where = (rank, int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]),
             dist.get_process_group_ranks(mesh.get_group("shard")), zopt.world_size)
    everyone = [None] * world
    dist.all_gather_object(everyone, where)
    if rank == 0:
        torch.save({"full": full, "where": everyone}, out)
    zopt.remove_hooks()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
