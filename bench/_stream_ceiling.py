"""The bandwidth ceiling for an optimizer step's memory traffic: a Triton kernel that streams the
same mix of reads and writes as the fused Adam step and does nothing else (one add per element).

    fp32 mix:        reads a, b, c (fp32) and d (fp32); writes a, b, c          (28 B/element)
    bf16-master mix: reads a, b, c (fp32) and d (bf16); writes a, b, c and e (bf16) (28 B/element)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _stream_mix_kernel(
    a_ptr, b_ptr, c_ptr,     # *fp32 [n]: read and written (the master, exp_avg, exp_avg_sq streams)
    d_ptr,                   # *fp32 / *bf16 [n]: read only (the gradient stream)
    e_ptr,                   # *bf16 [n]: written iff HAS_E (the 16-bit parameter stream)
    n,                       # elements in every stream
    HAS_E: tl.constexpr,     # write the bf16 stream
    BLOCK_SIZE: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    x = tl.load(d_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0) + x
    b = tl.load(b_ptr + offs, mask=mask, other=0.0) + x
    c = tl.load(c_ptr + offs, mask=mask, other=0.0) + x
    tl.store(a_ptr + offs, a, mask=mask)
    tl.store(b_ptr + offs, b, mask=mask)
    tl.store(c_ptr + offs, c, mask=mask)
    if HAS_E:
        tl.store(e_ptr + offs, a.to(tl.bfloat16), mask=mask)


def stream_mix(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, e: torch.Tensor | None) -> None:
    n = a.numel()
    with torch.cuda.device(a.device):
        _stream_mix_kernel[(triton.cdiv(n, BLOCK),)](a, b, c, d, a if e is None else e, n,
                                                    HAS_E=e is not None, BLOCK_SIZE=BLOCK, num_warps=8)
