"""The shared harness of the ZeRO benchmarks (bench_zero.py, bench_zero3.py): the benchmark model,
two gloo processes, collective-wait timing, page-fault and resident-memory probes, the load
average, and model-state bytes from ``zero_kernels.memory`` (no formula written here). Nothing
is imported from tests/.

Timing discipline (after Liger-Kernel's BENCHMARK_GUIDELINES, see _timing.py): warm up, interleave
the candidates so drift in the machine's load hits all alike, report medians and ratios measured in
the same run.
"""
from __future__ import annotations

import os
import resource
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from zero_kernels.memory import model_state_bytes
from zero_kernels.zero import collectives as C

__all__ = ["make_mlp", "rss_mb", "minflt", "loadavg", "spawn_pair", "WaitTimer", "states_bytes", "ratio",
           "median_ms"]


def make_mlp(blocks: bool = False) -> nn.Module:
    """4 x (Linear 1024->4096, GELU, Linear 4096->1024), ~33.6M fp32 parameters; ``blocks=True``
    groups each triple into an nn.Sequential (one FSDP2 / ZeRO-3 unit per block)."""
    torch.manual_seed(0)
    layers = [[nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)] for _ in range(4)]
    if blocks:
        return nn.Sequential(*[nn.Sequential(*b) for b in layers])
    return nn.Sequential(*[m for b in layers for m in b])


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def minflt() -> int:
    """Minor page faults of this process so far (4 KiB pages first touched)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, q):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args, q)
    finally:
        dist.destroy_process_group()


def spawn_pair(fn: Callable, args: tuple, world: int = 2):
    """Run ``fn(rank, world, *args, out_queue)`` on ``world`` fresh gloo processes (1 thread each);
    returns what rank 0 put on the queue, or None when a worker failed."""
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = _free_port()
    ps = [ctx.Process(target=_entry, args=(r, world, port, fn, args, q)) for r in range(world)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    if any(p.exitcode != 0 for p in ps):
        return None
    return q.get()


class WaitTimer:
    """Seconds blocked in ``collectives.wait()`` (reset per iteration by the caller)."""

    def __init__(self):
        self.waited = 0.0
        orig = C.wait

        def timed_wait(res):
            t = time.perf_counter()
            try:
                return orig(res)
            finally:
                self.waited += time.perf_counter() - t
        C.wait = timed_wait


def states_bytes(psi: int, world: int, stage: int, param_bytes: int = 4, grad_bytes: int = 4,
                 master_bytes: int = 0) -> float:
    """Per-rank model-state bytes of a torch baseline (DDP = 0, ZeroRedundancyOptimizer = 1,
    FSDP2 = 3) from zero_kernels.memory (fp32 parameters are their own masters)."""
    return model_state_bytes(psi, world, stage, param_bytes=param_bytes, grad_bytes=grad_bytes,
                             master_bytes=master_bytes, optim_bytes=8)["total"]


def ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of the per-round ratio (the candidates of a round ran back to back)."""
    return statistics.median(a / b for a, b in zip(num, den))


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3
