"""What the command-line tools (``python -m zero_kernels.plan / .checkpoint / .report``) share."""
from __future__ import annotations

import os
import sys
from typing import Callable


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
