"""bench/gpu.py is ready for the first user with a GPU and runs cleanly on a machine without one."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: bench/gpu.py would run the full benchmark")
def test_gpu_bench_exits_cleanly_without_gpu():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU" in r.stdout
