"""Shared benchmark discipline (after Liger-Kernel's BENCHMARK_GUIDELINES): warm up, interleave the
candidates round-robin so drift in the machine's load hits all of them alike, report medians."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable


def _number(kind: type, what: str, ok: Callable[[float], bool]) -> Callable[[str], object]:
    """argparse type: a ``kind`` for which ``ok`` holds, else a usage error naming the value (not a traceback
    from deep inside the run: a --repeats 0 median of nothing, a --threads 0 error from torch)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    parse.__name__ = what.replace(" ", "_")   # argparse names the type in its message
    return parse


positive_int = _number(int, "a positive integer", lambda v: v >= 1)
nonnegative_int = _number(int, "a non-negative integer", lambda v: v >= 0)
positive_float = _number(float, "a positive number", lambda v: 0 < v < float("inf"))


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int = 9, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each fn, measured round-robin."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def table(rows: list[list[object]], header: list[str]) -> str:
    cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.rjust(w[i]) for i, c in enumerate(r)) + " |"
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in cells[1:]])
