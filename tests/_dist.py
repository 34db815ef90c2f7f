"""Helpers to run a function on N gloo processes (torch.multiprocessing, spawn) with a timeout.

    run_world(fn, world_size, *args, timeout=180)   # fn(rank, world_size, *args) in each process

Each process gets a fresh free port, one intra-op thread, and an initialized gloo default group
(with a collective timeout, so a mismatch fails instead of blocking). Processes start from a fork
server that has imported torch once (see ``_context``), or are spawned where the environment changed.
Exceptions in a child are re-raised in the parent with the child's traceback; if the processes do not
all finish within ``timeout`` seconds they are killed and TimeoutError is raised, so a hang fails CI
instead of blocking it.
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _package_file() -> str:
    import zero_kernels
    return os.path.abspath(zero_kernels.__file__)


def _entry(rank, world_size, port, fn, args, err_q, collective_timeout, parent_package, side_env):
    # Everything imported before the fork (the fork server's preload) is never garbage: out of the collector's
    # sight, the teardown's gc.collect() takes ~10 ms instead of ~0.3 s.
    gc.freeze()
    for k in [k for k in os.environ if k.startswith(_SIDE_EFFECT)]:
        del os.environ[k]
    os.environ.update(side_env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        # A spawned child rebuilds sys.path from the parent's current one: a test module that put the
        # checkout first would make the children test the source tree while the parent tests the wheel.
        if _package_file() != parent_package:
            raise RuntimeError(f"rank {rank} imported zero_kernels from {_package_file()}, the parent from "
                               f"{parent_package}: something put another copy first on sys.path")
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        fn(rank, world_size, *args)
        # Orderly teardown: every rank is past its last collective before any rank closes its
        # gloo pairs, and objects holding the group (DDP reducers, pending works) are gone first.
        gc.collect()
        if dist.is_initialized():
            try:                            # bounded: a test may have made a peer exit on purpose
                dist.barrier(async_op=True).wait(timeout=datetime.timedelta(seconds=20))
            except Exception:  # noqa: BLE001
                pass
            dist.destroy_process_group()
    except BaseException:
        err_q.put((rank, traceback.format_exc()))
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    # The test passed (its result is in the parent's hands through err_q/exit code). Skip the
    # interpreter's finalizers: C++ statics of torch/gloo torn down in arbitrary order after
    # Python finalization occasionally abort ("terminate called without an active exception",
    # seen once in CI on the DDP test), which would fail a test whose checks all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_world(fn, world_size: int, *args, timeout: float = 180.0, collective_timeout: float = 60.0) -> None:
    """Run fn on a fresh world; retried once when the free port was taken in between (a race of
    free_port(), not a failure of the code under test)."""
    try:
        _run_world(fn, world_size, *args, timeout=timeout, collective_timeout=collective_timeout)
    except RuntimeError as e:
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        _run_world(fn, world_size, *args, timeout=timeout, collective_timeout=collective_timeout)


# Imported once by the fork server instead of by every rank (~2 s of CPU each): an empty world of 4 starts in
# ~1 s instead of ~3.5 s on 2 cores; tests/test_zeropp.py + test_zero_safety.py 145-153 s instead of 170-173.
# torch._dynamo: torch.optim.Optimizer.add_param_group is wrapped by torch._disable_dynamo, which imports
# torch._dynamo at its first call: every rank's first optimizer paid ~2-3 s of CPU (most of a small world's time).
# zero_kernels.zero (imported by a rank's first ZeroAdamW): ~0.3 s of every world.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "triton", "zero_kernels", "zero_kernels.zero"]
_server_env: dict | None = None
# Variables torch sets in this process as a side effect of torch.compile (the inductor's cache directory, its
# compile-pool switches). Read when used, not when a process starts or imports: a change of them keeps the fork
# server (it made every world after the first compile a spawned one, ~3 s more each: two fresh interpreters
# importing torch), and each rank gets this process's current values (_entry).
_SIDE_EFFECT = ("TORCHINDUCTOR_", "_TORCHINDUCTOR_", "TORCH_WARM_POOL")


def _env() -> dict:
    """os.environ as a rank must see it at its start (pytest's PYTEST_CURRENT_TEST and _SIDE_EFFECT aside)."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST" and not k.startswith(_SIDE_EFFECT)}


def _side_env() -> dict:
    """The _SIDE_EFFECT variables of os.environ: each rank sets them as they are here (_entry)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_SIDE_EFFECT)}


def _context():
    """The "forkserver" context (its server started with this process's environment at the first world, and
    the imports of _PRELOAD done there), while the environment is still that one; "spawn" once a test has
    changed it (malloc tuning and TRITON_INTERPRET are read when a process starts or imports: a forked rank
    would not see the change)."""
    global _server_env
    if _server_env is None:
        _server_env = _env()
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    env = _env()
    if env == _server_env:
        return mp.get_context("forkserver")
    changed = sorted(k for k in set(env) | set(_server_env) if env.get(k) != _server_env.get(k))
    SPAWNED.append((os.environ.get("PYTEST_CURRENT_TEST", "?"), changed))
    return mp.get_context("spawn")


# (test, changed variables) of every world spawned instead of forked: ~3 s more each; conftest prints them at
# the end of a run, so a variable set as a side effect (see _SIDE_EFFECT) shows instead of slowing CI silently.
SPAWNED: list[tuple[str, list[str]]] = []


def _run_world(fn, world_size: int, *args, timeout: float = 180.0, collective_timeout: float = 60.0) -> None:
    ctx = _context()
    err_q = ctx.SimpleQueue()
    port = free_port()
    procs = []
    package, side_env = _package_file(), _side_env()
    for r in range(world_size):
        p = ctx.Process(target=_entry, daemon=True,
                        args=(r, world_size, port, fn, args, err_q, collective_timeout, package, side_env))
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            if not err_q.empty():
                break                   # one rank failed: the others may be stuck in a collective
            if time.monotonic() > deadline:
                raise TimeoutError(f"world of {world_size} processes did not finish within {timeout:.0f} s")
            time.sleep(0.05)
        if any(p.is_alive() for p in procs):
            time.sleep(0.2)             # a rank failed: the others' reports may follow
        if not err_q.empty():
            rank, tb = err_q.get()
            raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (0, None)]
        if bad:
            raise RuntimeError(f"processes exited abnormally (rank, exit code): {bad}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)


class Cases:
    """The cases of one rank's world function, each run even when an earlier one failed; ``check()`` raises one
    AssertionError naming every failed case (with the tail of its traceback) after the last."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.failures = rank, world, []

    def run(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # collect all, report together
            self.failures.append(f"[{name}] {type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}")

    def check(self) -> None:
        if self.failures:
            raise AssertionError(f"rank {self.rank}/{self.world}: {len(self.failures)} case(s) failed:\n"
                                 + "\n".join(self.failures))
