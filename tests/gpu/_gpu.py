"""Shared by the GPU suite (tests/gpu/test_*.py): runs on CUDA, skipped with the reason otherwise.

    TRITON_INTERPRET=0 python -m pytest tests/gpu -q -rs

tests/conftest.py turns the Triton interpreter on for the CPU suite; on a GPU that would run the
Triton kernels on the host, so this suite refuses to run interpreted (it says so) and expects
``TRITON_INTERPRET=0`` in the environment. Every test module sets ``pytestmark = _gpu.MARKS``: the
``gpu`` marker and the skip. (No conftest.py here: a second ``conftest`` module would shadow
tests/conftest.py for the CPU suite's ``from conftest import ...``.)
"""
import os

import pytest
import torch


def why_no_gpu():
    """None when the GPU suite can run, else why not."""
    if not torch.cuda.is_available():
        return ("no CUDA device: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return ("TRITON_INTERPRET=1 would run the Triton kernels in the interpreter; run the GPU suite as "
                "`TRITON_INTERPRET=0 python -m pytest tests/gpu`")
    return None


def cuda_backends():
    """pytest params for the backends that run CUDA tensors, each skipped with its reason."""
    out = []
    reason = why_no_gpu()
    for name in ("triton", "cuda"):
        why = reason
        if why is None:
            from zero_kernels import backends
            why = backends.why_unavailable(name, torch.device("cuda"))
        out.append(pytest.param(name, id=name, marks=[pytest.mark.skip(reason=f"{name}: {why}")] if why else []))
    return out


MARKS = [pytest.mark.gpu, pytest.mark.skipif(why_no_gpu() is not None, reason=str(why_no_gpu()))]

# GPT-2 small's parameter list (124M): embeddings, 12 blocks, final norm. Shapes, not values.
def gpt2_shapes(layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> list:
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]


def equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs with the same payload compare equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))
