"""tools/mutation_check.py's fault table stays pointed at the code it mutates: every fault's original
substring occurs exactly once in its file and names a known suite. The tool itself is not run by CI (20-30
minutes); without this check a kernel edit that moves a line leaves its faults stale until somebody runs
the tool (six Triton faults went stale that way when the Adam math got its `root` line)."""
from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("zk_mutation_check", os.path.join(ROOT, "tools", "mutation_check.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_every_fault_points_at_exactly_one_place():
    mc = _tool()
    faults = [mc.Fault(*row) for row in mc.FAULTS]
    assert len({f.id for f in faults}) == len(faults), "duplicate fault ids"
    assert not [f.id for f in faults if f.suite not in mc.SUITES], "a fault names an unknown suite"
    stale = {f.id: mc.occurrences(f) for f in faults if mc.occurrences(f) != 1}
    assert not stale, f"faults whose original text does not occur exactly once (re-point them): {stale}"


def test_a_stale_fault_is_reported():
    """Negative control: a fault whose text is absent counts 0 occurrences."""
    mc = _tool()
    row = list(mc.FAULTS[0])
    row[2] = "this text is in no kernel " + row[2]
    assert mc.occurrences(mc.Fault(*row)) == 0
