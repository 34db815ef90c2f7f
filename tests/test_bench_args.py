"""The benchmarks refuse counts they cannot run with (--repeats 0, --threads 0, --n -1) as usage errors naming the
value, before any work: the argparse types of bench/_timing.py. A static check keeps every numeric option on them."""
from __future__ import annotations

import argparse
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def _timing():
    sys.path.insert(0, BENCH)
    try:
        import _timing
    finally:
        sys.path.remove(BENCH)
    return _timing


@pytest.mark.parametrize("name, good, bad", [
    ("positive_int", {"1": 1, "32": 32}, ["0", "-3", "1.5", "x"]),
    ("nonnegative_int", {"0": 0, "2": 2}, ["-1", "2.0", ""]),
    ("positive_float", {"0.5": 0.5, "1e3": 1000.0}, ["0", "-1", "nan", "inf", "x"]),
])
def test_count_types(name, good, bad):
    parse = getattr(_timing(), name)
    for text, value in good.items():
        assert parse(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
            parse(text)


def test_every_numeric_option_is_checked():
    """No bench script parses a count with a bare int / float (which let --repeats 0 reach a median of nothing);
    --seed is the one plain integer (any value is a seed)."""
    bare = []
    for f in sorted(os.listdir(BENCH)):
        if f.endswith(".py"):
            with open(os.path.join(BENCH, f)) as fh:
                for m in re.finditer(r'add_argument\("(--[a-z-]+)"[^)]*?type=(int|float)\b', fh.read()):
                    if m.group(1) != "--seed":
                        bare.append(f"{f} {m.group(1)}")
    assert not bare, f"options parsed without a range check (use bench/_timing.py's types): {bare}"
    assert re.search(r'type=(int|float)\b', 'ap.add_argument("--n", type=int)')   # the pattern sees a bare int
