"""FusedAdamW as the optimizer of an FSDP2 model (DTensor parameters: the step runs on the local
shards) and of a DDP model, on gloo: it must end where torch.optim.AdamW ends."""
import copy

import pytest
import torch
import torch.distributed as dist

from _dist import run_world


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 37),
                               torch.nn.GELU(), torch.nn.Linear(37, 5))


def _train(model, opt, rank, steps=6):
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 13, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _fsdp2_worker(rank, world, backend):
    import zero_kernels as zk
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    runs = {}
    for name in ("zk", "torch"):
        m = _model()
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        before = [p.full_tensor().clone() for p in m.parameters()]
        opt = (zk.FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, backend=backend) if name == "zk"
               else torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
        _train(m, opt, rank)
        assert all(type(p).__name__ == "DTensor" for p in m.parameters())
        if name == "zk":
            st = opt.state[next(iter(m.parameters()))]
            assert type(st["exp_avg"]).__name__ == "DTensor", "states must be sharded like the params"
        runs[name] = [p.full_tensor() for p in m.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(before, runs[name])), "params did not move"
    for a, b in zip(runs["zk"], runs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Coded states on DTensor parameters are refused at construction (they crashed the C++ / Triton kernels,
    # or raised after the step counters moved): per-tensor blocks that DCP could not reshard.
    for fmt in (dict(exp_avg_dtype=torch.uint8), dict(exp_avg_dtype=torch.bfloat16)):
        with pytest.raises(ValueError,
                           match=r"param_groups\[0\]\['params'\]\[0\] is a DTensor .*keep fp32 states"):
            zk.FusedAdamW(m.parameters(), backend=backend, **fmt)


def _ddp_worker(rank, world, backend):
    import zero_kernels as zk
    from torch.nn.parallel import DistributedDataParallel as DDP
    runs = {}
    for name in ("zk", "torch"):
        m = DDP(_model())
        opt = (zk.FusedAdamW(m.parameters(), lr=1e-2, backend=backend) if name == "zk"
               else torch.optim.AdamW(m.parameters(), lr=1e-2))
        _train(m, opt, rank)
        runs[name] = [p.detach().clone() for p in m.parameters()]
    for a, b in zip(runs["zk"], runs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # replicas stay identical across ranks
    flat = torch.cat([p.reshape(-1) for p in runs["zk"]])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], t) for t in gathered)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_fused_adamw_under_fsdp2(backend):
    run_world(_fsdp2_worker, 2, backend)


def test_fused_adamw_under_ddp():
    run_world(_ddp_worker, 2, "auto")
