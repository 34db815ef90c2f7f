"""The end of a training script's ranks (tests/scripts/*_train.py)."""
import os
import sys
from datetime import timedelta

import torch.distributed as dist


def exit_cleanly() -> None:
    """Every rank waits for the others (bounded), then leaves without the interpreter's finalizers: C++
    statics of torch/gloo torn down in arbitrary order after Python finalization occasionally abort
    ("terminate called without an active exception", seen in CI on the plain DDP run after training
    and the result file were done), as tests/_dist.py does for its ranks."""
    if dist.is_initialized():
        dist.monitored_barrier(timeout=timedelta(seconds=120))
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
