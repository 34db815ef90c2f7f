"""Triton bucket kernels: flatten (many tensors -> one flat bucket, cast + scale) and unflatten.

One launch covers a whole list of tensors through a *pointer table*: an int64 tensor of data
pointers that the kernel turns back into typed pointers (``tl.load(table + i).to(
tl.pointer_type(DTYPE))``). Sources of one launch share a dtype (the wrapper groups by dtype).
Grid: (number of tensors, blocks of the largest tensor); programs past a tensor's end are masked.

Numerics: math in fp32, one rounding at the store. bf16 stores are rounded to nearest even on the
fp32 bits explicitly (the interpreter truncates fp32 -> bf16 casts while a GPU rounds RNE), so the
interpreter, a GPU and torch's ``.bfloat16()`` agree bitwise. fp16 stores use the cast (RNE on
both). All offsets are int64 (buckets can exceed 2**31 elements).

Used by :mod:`zero_kernels.zero.flat` on CUDA tensors, or on CPU when TRITON_INTERPRET=1; the
torch path there is the CPU default (see [Note: views vs copies] in that file).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["flatten_triton", "unflatten_triton", "flatten_kernel", "unflatten_kernel", "CODEGEN_CASES"]

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_BITS = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}
BLOCK = 1024


@triton.jit
def _round_to_bf16(x):
    """fp32 -> bf16, round-to-nearest-even on the bits; NaN stays a (quiet) NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def flatten_kernel(
    src_table,                # *int64 [T]: data pointers of the T source tensors (dtype SRC_DTYPE)
    numels,                   # *int64 [T]: element count of each source tensor
    dst_offsets,              # *int64 [T]: first element of each source's region in dst
    dst,                      # *fp32 / *bf16 / *fp16: the flat bucket (1-D, contiguous)
    scale,                    # fp32 scalar: every source element is multiplied by it (1.0: copy)
    SRC_DTYPE: tl.constexpr,  # tl.float32 / tl.bfloat16 / tl.float16: dtype of every source
    ACCUMULATE: tl.constexpr, # True: dst += src * scale; False: dst = src * scale
    DST_BF16: tl.constexpr,   # True when dst is bf16 (explicit round-to-nearest-even store)
    BLOCK: tl.constexpr,      # elements handled by one program
):
    t = tl.program_id(0).to(tl.int64)            # which source tensor
    blk = tl.program_id(1).to(tl.int64)          # which block of it
    n = tl.load(numels + t)
    offs = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    src = tl.load(src_table + t).to(tl.pointer_type(SRC_DTYPE))
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32) * scale
    d = dst + tl.load(dst_offsets + t) + offs
    if ACCUMULATE:
        x = x + tl.load(d, mask=mask, other=0.0).to(tl.float32)
    if DST_BF16:
        tl.store(d, _round_to_bf16(x), mask=mask)
    else:
        tl.store(d, x.to(d.dtype.element_ty), mask=mask)


@triton.jit
def unflatten_kernel(
    src,                      # *uintN: the flat bucket, viewed as raw bits of its element width
    dst_table,                # *int64 [T]: data pointers of the T destination tensors
    numels,                   # *int64 [T]: element count of each destination
    src_offsets,              # *int64 [T]: first element of each destination's region in src
    BITS_DTYPE: tl.constexpr, # tl.uint16 / tl.uint32: element width (a bit copy, no rounding)
    BLOCK: tl.constexpr,      # elements handled by one program
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1).to(tl.int64)
    n = tl.load(numels + t)
    offs = blk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    x = tl.load(src + tl.load(src_offsets + t) + offs, mask=mask)
    dst = tl.load(dst_table + t).to(tl.pointer_type(BITS_DTYPE))
    tl.store(dst + offs, x, mask=mask)


def _table(values: Sequence[int], device) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def flatten_triton(tensors: Sequence[Tensor | None], out: Tensor, offsets: Sequence[int],
                   scale: float | None = None, accumulate: bool = False) -> None:
    """See :func:`zero_kernels.zero.flat.flatten`; one launch per source dtype."""
    if out.dtype not in _TL or not out.is_contiguous():
        raise ValueError(f"flatten: out must be a contiguous fp32/bf16/fp16 tensor, got {out.dtype}")
    by_dtype: dict[torch.dtype, list[tuple[Tensor, int]]] = {}
    for t, off in zip(tensors, offsets):
        if t is None or t.numel() == 0:
            continue
        if t.dtype not in _TL:
            raise ValueError(f"flatten: unsupported source dtype {t.dtype}")
        by_dtype.setdefault(t.dtype, []).append((t.contiguous(), off))
    for dt, items in by_dtype.items():
        srcs = [t for t, _ in items]
        numels = [t.numel() for t in srcs]
        grid = (len(srcs), triton.cdiv(max(numels), BLOCK))
        flatten_kernel[grid](
            _table([t.data_ptr() for t in srcs], out.device), _table(numels, out.device),
            _table([o for _, o in items], out.device), out,
            1.0 if scale is None else float(scale),
            SRC_DTYPE=_TL[dt], ACCUMULATE=accumulate, DST_BF16=out.dtype == torch.bfloat16, BLOCK=BLOCK)
        del srcs  # keep the contiguous copies alive until the launch is queued


def unflatten_triton(flat: Tensor, tensors: Sequence[Tensor], offsets: Sequence[int]) -> None:
    """See :func:`zero_kernels.zero.flat.unflatten`; destinations must be contiguous, flat's dtype."""
    items = [(t, off) for t, off in zip(tensors, offsets) if t.numel()]
    if not items:
        return
    for t, _ in items:
        if t.dtype != flat.dtype or not t.is_contiguous():
            raise ValueError(f"unflatten: destinations must be contiguous {flat.dtype}, got {t.dtype}")
    bits = _BITS[flat.element_size()]
    tbits = {tl.uint16: torch.int16, tl.uint32: torch.int32, tl.uint8: torch.uint8, tl.uint64: torch.int64}[bits]
    numels = [t.numel() for t, _ in items]
    grid = (len(items), triton.cdiv(max(numels), BLOCK))
    unflatten_kernel[grid](flat.view(tbits), _table([t.data_ptr() for t, _ in items], flat.device),
                           _table(numels, flat.device), _table([o for _, o in items], flat.device),
                           BITS_DTYPE=bits, BLOCK=BLOCK)


# (kernel, description) entries for the AOT codegen test; its owner adapts the format.
CODEGEN_CASES = [
    (flatten_kernel, "flatten bf16 grads -> fp32 bucket, copy, scale (SRC_DTYPE=bf16, ACCUMULATE=False, DST_BF16=False)"),
    (flatten_kernel, "flatten fp32 grads -> fp32 bucket, accumulate (SRC_DTYPE=fp32, ACCUMULATE=True, DST_BF16=False)"),
    (flatten_kernel, "flatten fp32 -> bf16 bucket, copy, RNE store (SRC_DTYPE=fp32, ACCUMULATE=False, DST_BF16=True)"),
    (unflatten_kernel, "unflatten a 16-bit bucket (BITS_DTYPE=uint16)"),
    (unflatten_kernel, "unflatten an fp32 bucket (BITS_DTYPE=uint32)"),
]
