"""Long compiles of the suite run in the background at the lowest CPU priority.

[Note: background compiles]
Three tests wait on compilers: tests/test_nvcc.py (every CUDA source through nvcc, ~100 s of CPU),
tests/test_codegen.py (every Triton kernel compiled to PTX for sm_80 / sm_90 by a worker process) and
tests/test_cpu_kernel.py's test_jit_build_slow (the C++ extension JIT-built, ~110 s of CPU). Much of the
suite is one Python process busy on one of the machine's two cores (the Triton interpreter, the
reference path), so the compiles start right after collection, under ``nice 19``: they take the idle
core's time and yield to the tests whenever both cores are busy; a test that needs a result waits for it
(by then usually done). A test module opts in by defining ``start_background(selected)`` (``selected``: the
names of its tests that were collected and selected); tests/conftest.py calls it once after collection,
runs the tests marked ``background`` (those that wait) after all others, so the compiles have the whole
suite's idle time, and kills whatever still runs at the end of the session. Output goes to files, not pipes (nvcc's ptxas
report could fill a pipe nobody reads yet).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import NamedTuple


class Result(NamedTuple):
    returncode: int
    output: str       # stdout and stderr together
    seconds: float    # from the start until the result was collected


class _Job(NamedTuple):
    proc: subprocess.Popen
    log: str
    started: float


_jobs: dict[str, _Job] = {}
_results: dict[str, Result] = {}
_dirs: list[str] = []


def tempdir(prefix: str) -> str:
    """A directory removed at the end of the session (stop_all)."""
    d = tempfile.mkdtemp(prefix=prefix)
    _dirs.append(d)
    return d


def _lowest_priority() -> None:
    os.nice(19)


def start(key: str, argv: list[str], env: dict | None = None, cwd: str | None = None) -> None:
    """Start ``argv`` as job ``key`` at nice 19 (nothing if ``key`` was started already)."""
    if started(key):
        return
    log = os.path.join(tempdir("zk_bg_"), "output.txt")
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, text=True,
                                preexec_fn=_lowest_priority)
    _jobs[key] = _Job(proc, log, time.time())


def started(key: str) -> bool:
    """Whether job ``key`` was started (running or collected)."""
    return key in _jobs or key in _results


def result(key: str, timeout: float) -> Result:
    """Wait (at most ``timeout`` seconds from now) for job ``key``; a job still running then is killed and
    its result says TIMEOUT (returncode -9)."""
    if key not in _results:
        job = _jobs.pop(key)
        try:
            rc = job.proc.wait(timeout=timeout)
            prefix = ""
        except subprocess.TimeoutExpired:
            job.proc.kill()
            rc = job.proc.wait(timeout=30)
            prefix = f"TIMEOUT: still running {timeout:.0f} s after the test began to wait\n"
        with open(job.log) as f:
            _results[key] = Result(rc, prefix + f.read(), time.time() - job.started)
    return _results[key]


def stop_all() -> None:
    """Kill every job still running and remove the directories (end of the session)."""
    for job in _jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait(timeout=30)
    _jobs.clear()
    for d in _dirs:
        shutil.rmtree(d, ignore_errors=True)
    _dirs.clear()
