"""Machinery shared by the multi-tensor Triton kernels (adam.py, flatten.py).

[Note: chunk map]
One launch covers T tensors of any sizes: the grid is the total number of CHUNK-element chunks,
and program ``pid`` reads ``chunk_tensor[pid]`` (which tensor) and ``chunk_start[pid]`` (first
element inside it). A (T, max_blocks) grid would idle most programs when sizes are skewed (an
embedding of 50M elements next to a hundred biases). The map depends only on the sizes, so it is
cached per shape tuple.

[Note: 128-bit accesses]
A GPU load is 128-bit only when the compiler can prove 16-byte alignment and the access is
unmasked. Launchers check the pointers on the host (``aligned``) and pass a constexpr that adds
``tl.multiple_of`` hints; kernels run a block unmasked when it lies entirely inside its tensor and
masked only on a tensor's last block.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def round_bf16_bits(x):
    """fp32 -> bf16 bit pattern (uint16), round to nearest even; NaN stays a quiet NaN.

    Explicit on the bits because the interpreter truncates fp32->bf16 casts while a GPU rounds;
    this way both agree bitwise with torch's ``.bfloat16()``.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return tl.where(x != x, quiet_nan, rounded).to(tl.uint16)


@lru_cache(maxsize=128)
def chunk_map(numels: tuple[int, ...], chunk: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(numels, chunk_tensor, chunk_start) device tensors for a tuple of tensor sizes."""
    counts = [(n + chunk - 1) // chunk for n in numels]
    tensor_idx = [t for t, c in enumerate(counts) for _ in range(c)]
    starts = [j * chunk for c in counts for j in range(c)]
    return (torch.tensor(numels, dtype=torch.int64).to(device),
            torch.tensor(tensor_idx, dtype=torch.int32).to(device),
            torch.tensor(starts, dtype=torch.int64).to(device))


def pointer_table(rows: Sequence[Sequence[int]] | Sequence[int], device: torch.device) -> Tensor:
    """An int64 device tensor of data pointers (one H2D copy, non-blocking)."""
    return torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)


def aligned(addresses: Iterable[int], boundary: int = 16) -> bool:
    """True when every address (or byte offset) is a multiple of ``boundary``."""
    return all(a % boundary == 0 for a in addresses)
