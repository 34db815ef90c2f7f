"""What the command-line tools (``python -m zero_kernels.plan / .checkpoint / .report``) share."""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Callable, Sequence

# A negative number as a value: '-7e9', '-7B', '-1.5e3', '-inf'. argparse takes such a token for an option
# (its own rule covers only '-7' and '-.5') and says "expected one argument", hiding the option's own check.
_NEGATIVE_VALUE = re.compile(r"-(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?[a-zA-Z]?|inf|nan)", re.IGNORECASE)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``--opt -7e9`` read as ``--opt=-7e9`` (no option of ours looks like a
    negative number), so that the option's own check names what is wrong with the value."""
    args = list(sys.argv[1:] if argv is None else argv)
    joined: list[str] = []
    for tok in args:
        if (joined and _NEGATIVE_VALUE.fullmatch(tok) and joined[-1].startswith("--") and "=" not in joined[-1]
                and joined[-1] != "--"):
            joined[-1] = f"{joined[-1]}={tok}"
        else:
            joined.append(tok)
    return parser.parse_args(joined)


def until_reader_leaves(run: Callable[[], int]) -> int:
    """``run()``'s exit status; when the reader of stdout left (``... | head``), 0 and nothing more printed
    (Python's advice for SIGPIPE: stdout pointed at devnull so that the interpreter's exit flush cannot fail)."""
    try:
        status = run()
        sys.stdout.flush()   # inside the try: a reader that left fails this flush, not the interpreter's exit
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
