"""Machinery shared by the multi-tensor Triton kernels (adam.py, flatten.py).

[Note: chunk map]
One launch covers T tensors of any sizes: the grid is the total number of CHUNK-element chunks,
and program ``pid`` reads ``chunk_tensor[pid]`` (which tensor) and ``chunk_start[pid]`` (first
element inside it). A (T, max_blocks) grid would idle most programs when sizes are skewed (an
embedding of 50M elements next to a hundred biases). The map depends only on the sizes, so it is
cached per shape tuple.

[Note: 128-bit accesses]
A GPU load is 128-bit only when the compiler can prove 16-byte alignment and the access is
unmasked. Alignment is decided per tensor inside the kernel, as the CUDA kernel does per block:
each program ORs its tensor's addresses (table entries, region starts) and, when they are 16-byte
aligned, runs its full blocks through a copy of the block body whose pointers carry
``tl.multiple_of(ptr, 16)`` hints; a misaligned tensor (a view at an odd offset, a region after an
odd-sized parameter) takes the unhinted copy, and only that tensor does. Blocks run unmasked when
they lie entirely inside their tensor (chunk starts are multiples of the block), masked only on a
tensor's last block. Every variant therefore compiles to 128-bit accesses (tests/test_codegen.py).
All of a kernel's loads and stores must also share one register layout, or Triton converts between
them through shared memory: each launcher picks num_warps so that one thread's elements per
access fit in 128 bits for every dtype it touches.

[Note: interpreter bits are GPU bits]
Under TRITON_INTERPRET=1 each fp32 operation is computed by numpy, correctly rounded, and Python
float kernel arguments stay doubles; compiled for a GPU, Triton 3.9 contracts a*b+c into ``fma``
(unless launched with ``enable_fp_fusion=False``), lowers ``/`` to ``div.full.f32`` and
``tl.sqrt`` to ``sqrt.approx.ftz.f32``, ``tl.maximum`` to the NaN-dropping ``max.f32``, and
computes scalar arithmetic on fp32 arguments in fp32. So the kernels: are launched with
``enable_fp_fusion=False``; divide and take square roots with ``tl.div_rn`` / ``tl.sqrt_rn``;
take maxima with ``propagate_nan=tl.PropagateNan.ALL`` (torch.maximum); and compute no
coefficient from their scalar arguments (they receive 1 - beta etc. computed in double on the
host, [Note: coefficients are computed once, in double] in reference.py). Then the interpreter's
result is the GPU's, bit for bit; tests/test_codegen.py checks the PTX, tests/test_numerics.py
runs the kernels with fp32 scalar arguments.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

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
