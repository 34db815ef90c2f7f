"""Triton bucket kernels: flatten (many tensors -> one flat bucket, cast + scale) and unflatten.

One launch covers a whole list of tensors through a *pointer table*: an int64 tensor of data
pointers that the kernel turns back into typed pointers (``tl.load(table + i).to(
tl.pointer_type(DTYPE))``). Sources of one launch share a dtype (the wrapper groups by dtype).
Grid: one program per CHUNK of every tensor ([Note: chunk map] in _multi_tensor.py); full blocks
run unmasked, with 128-bit accesses when aligned ([Note: 128-bit accesses]).

Numerics: math in fp32, one rounding at the store. bf16 stores are rounded to nearest even on the
fp32 bits explicitly (the interpreter truncates fp32 -> bf16 casts while a GPU rounds RNE), so the
interpreter, a GPU and torch's ``.bfloat16()`` agree bitwise. fp16 stores use the cast (RNE on
both). All offsets are int64 (buckets can exceed 2**31 elements).

Bytes moved per element: flatten reads the source (2 or 4 B) and writes the bucket (2 or 4 B;
+ a read of it when accumulating); unflatten reads and writes one element width each.

Used by :mod:`zero_kernels.zero.flat` on CUDA tensors, or on CPU when TRITON_INTERPRET=1; the
torch path there is the CPU default (see [Note: views vs copies] in that file).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._multi_tensor import (block_offsets, chunk_map, device_guard, offset_pointer, pointer_table, program_chunk,
                            round_bf16_bits, scalar_offsets, typed_pointer)

__all__ = ["flatten_triton", "unflatten_triton", "flatten_kernel", "unflatten_kernel", "CODEGEN_CASES"]

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_BITS = {1: tl.uint8, 2: tl.uint16, 4: tl.uint32, 8: tl.uint64}
_TORCH_BITS = {tl.uint8: torch.uint8, tl.uint16: torch.int16, tl.uint32: torch.int32, tl.uint64: torch.int64}
BLOCK = 1024              # elements per iteration
ITERS = 4                 # iterations per program
CHUNK = BLOCK * ITERS     # elements per program
# Launch options (shared with CODEGEN_CASES; enable_fp_fusion=False: [Note: interpreter bits are
# GPU bits] in _multi_tensor.py). flatten casts between widths: 8 warps give 4 elements per thread,
# one 128-bit access per fp32 array and 64 bits per 16-bit one, so loads and stores share one
# register layout (8 per thread would convert layouts through shared memory). unflatten copies
# bits of one width: 4 warps, 8 elements per thread, 128-bit accesses for 16-bit data too.
FLATTEN_LAUNCH = dict(num_warps=8, enable_fp_fusion=False)
UNFLATTEN_LAUNCH = dict(num_warps=4, enable_fp_fusion=False)


@triton.jit
def _flatten_block(src, d, offs, mask, scale, MASKED: tl.constexpr, ACCUMULATE: tl.constexpr,
                   DST_BF16: tl.constexpr):
    """dst[offs] (+)= src[offs] * scale for one BLOCK, rounded once at the store."""
    if MASKED:
        x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32) * scale
        if ACCUMULATE:
            x = x + tl.load(d + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(src + offs).to(tl.float32) * scale
        if ACCUMULATE:
            x = x + tl.load(d + offs).to(tl.float32)
    if DST_BF16:
        y = round_bf16_bits(x).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(d.dtype.element_ty)
    if MASKED:
        tl.store(d + offs, y, mask=mask)
    else:
        tl.store(d + offs, y)


@triton.jit
def flatten_kernel(
    src_table,                  # *int64 [T]: data pointers of the T source tensors (dtype SRC_DTYPE)
    numels,                     # *int64 [T]: element count of each source tensor
    dst_offsets,                # *int64 [T]: first element of each source's region in dst
    chunk_tensor,               # *int32 [n_programs]: the source tensor program pid copies
    chunk_start,                # *int64 [n_programs]: first element of program pid's chunk in it
    dst,                        # *fp32 / *bf16 / *fp16: the flat bucket (1-D, contiguous)
    scale,                      # fp32 scalar: every source element is multiplied by it (1.0: copy)
    SRC_DTYPE: tl.constexpr,    # tl.float32 / tl.bfloat16 / tl.float16: dtype of every source
    ACCUMULATE: tl.constexpr,   # True: dst += src * scale; False: dst = src * scale
    DST_BF16: tl.constexpr,     # True when dst is bf16 (explicit round-to-nearest-even store)
    BLOCK_SIZE: tl.constexpr,   # elements per iteration
    N_ITERS: tl.constexpr,      # iterations per program
):
    t, start, n = program_chunk(chunk_tensor, chunk_start, numels)
    src_addr = tl.load(src_table + t)
    d_off = tl.load(dst_offsets + t)
    # Per tensor ([Note: 128-bit accesses]): vector accesses iff its source and its region are
    # 16-byte aligned; a misaligned region (an odd-sized neighbour) costs only this tensor. Each
    # branch makes its own pointers ([Note: hints mark the defining op]).
    aligned = ((src_addr | (dst + d_off).to(tl.int64)) & 15) == 0
    for i in range(N_ITERS):
        block_start = start + i * BLOCK_SIZE
        if block_start + BLOCK_SIZE <= n:
            if aligned:       # offsets per branch too: each branch has its own register layout
                _, offs = block_offsets(start, i, BLOCK_SIZE)
                _flatten_block(typed_pointer(src_addr, SRC_DTYPE, True), offset_pointer(dst, d_off, True), offs,
                               None, scale, False, ACCUMULATE, DST_BF16)
            else:
                soffs = scalar_offsets(start, i, BLOCK_SIZE)
                _flatten_block(typed_pointer(src_addr, SRC_DTYPE, False), offset_pointer(dst, d_off, False), soffs,
                               None, scale, False, ACCUMULATE, DST_BF16)
        elif block_start < n:
            toffs = scalar_offsets(start, i, BLOCK_SIZE)
            _flatten_block(typed_pointer(src_addr, SRC_DTYPE, False), offset_pointer(dst, d_off, False), toffs,
                           toffs < n, scale, True, ACCUMULATE, DST_BF16)


@triton.jit
def unflatten_kernel(
    src,                        # *uintN: the flat bucket, viewed as raw bits of its element width
    dst_table,                  # *int64 [T]: data pointers of the T destination tensors
    numels,                     # *int64 [T]: element count of each destination
    src_offsets,                # *int64 [T]: first element of each destination's region in src
    chunk_tensor,               # *int32 [n_programs]: the destination tensor program pid fills
    chunk_start,                # *int64 [n_programs]: first element of program pid's chunk in it
    BITS_DTYPE: tl.constexpr,   # tl.uint16 / tl.uint32: element width (a bit copy, no rounding)
    BLOCK_SIZE: tl.constexpr,   # elements per iteration
    N_ITERS: tl.constexpr,      # iterations per program
):
    t, start, n = program_chunk(chunk_tensor, chunk_start, numels)
    s_off = tl.load(src_offsets + t)
    dst_addr = tl.load(dst_table + t)
    aligned = ((dst_addr | (src + s_off).to(tl.int64)) & 15) == 0   # per tensor, as flatten_kernel
    for i in range(N_ITERS):
        block_start = start + i * BLOCK_SIZE
        if block_start + BLOCK_SIZE <= n:
            if aligned:       # pointers and offsets per branch, as flatten_kernel
                _, offs = block_offsets(start, i, BLOCK_SIZE)
                da = typed_pointer(dst_addr, BITS_DTYPE, True)
                tl.store(da + offs, tl.load(offset_pointer(src, s_off, True) + offs))
            else:
                soffs = scalar_offsets(start, i, BLOCK_SIZE)
                du = typed_pointer(dst_addr, BITS_DTYPE, False)
                tl.store(du + soffs, tl.load(offset_pointer(src, s_off, False) + soffs))
        elif block_start < n:
            toffs = scalar_offsets(start, i, BLOCK_SIZE)
            mask = toffs < n
            dm = typed_pointer(dst_addr, BITS_DTYPE, False)
            tl.store(dm + toffs, tl.load(offset_pointer(src, s_off, False) + toffs, mask=mask), mask=mask)


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
        numels, chunk_tensor, chunk_start = chunk_map(tuple(t.numel() for t in srcs), CHUNK, out.device)
        src_table = pointer_table([t.data_ptr() for t in srcs], out.device)
        offsets_table = pointer_table([o for _, o in items], out.device)
        with device_guard(out.device):
            flatten_kernel[(chunk_tensor.numel(),)](
                src_table, numels, offsets_table, chunk_tensor, chunk_start, out,
                1.0 if scale is None else float(scale),
                SRC_DTYPE=_TL[dt], ACCUMULATE=accumulate, DST_BF16=out.dtype == torch.bfloat16,
                BLOCK_SIZE=BLOCK, N_ITERS=ITERS, **FLATTEN_LAUNCH)
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
    numels, chunk_tensor, chunk_start = chunk_map(tuple(t.numel() for t, _ in items), CHUNK, flat.device)
    dst_table = pointer_table([t.data_ptr() for t, _ in items], flat.device)
    offsets_table = pointer_table([o for _, o in items], flat.device)
    with device_guard(flat.device):
        unflatten_kernel[(chunk_tensor.numel(),)](
            flat.view(_TORCH_BITS[bits]), dst_table, numels, offsets_table, chunk_tensor, chunk_start,
            BITS_DTYPE=bits, BLOCK_SIZE=BLOCK, N_ITERS=ITERS, **UNFLATTEN_LAUNCH)


# Ahead-of-time codegen cases (format: kernels/adam.py). Every case must compile to 128-bit global
# accesses (alignment is a run-time branch per tensor), IEEE fp32 math and no shared memory.
def _codegen_cases() -> list:
    flat_sig = dict(src_table="*i64", numels="*i64", dst_offsets="*i64", chunk_tensor="*i32",
                    chunk_start="*i64", scale="fp32")
    unflat_sig = dict(dst_table="*i64", numels="*i64", src_offsets="*i64", chunk_tensor="*i32",
                      chunk_start="*i64")
    names = {tl.float32: "fp32", tl.bfloat16: "bf16", tl.float16: "fp16"}
    cases = []
    for src, dst, acc in ((tl.bfloat16, "*fp32", False), (tl.float16, "*fp32", False),
                          (tl.float32, "*fp32", True), (tl.float32, "*fp32", False),
                          (tl.float32, "*bf16", False)):
        ce = dict(SRC_DTYPE=src, ACCUMULATE=acc, DST_BF16=dst == "*bf16", BLOCK_SIZE=BLOCK, N_ITERS=ITERS)
        desc = f"flatten {names[src]} -> {dst[1:]}{' accumulate' if acc else ''}"
        # 128-bit on the fp32 side; a 16-bit side moves 64 bits per thread (see FLATTEN_LAUNCH).
        opts = dict(FLATTEN_LAUNCH, streaming=True, min_wide_loads=int(src == tl.float32),
                    min_wide_stores=int(dst == "*fp32"))
        cases.append((flatten_kernel, dict(flat_sig, dst=dst), ce, desc, opts))
    for bits, sig in ((tl.uint16, "*u16"), (tl.uint32, "*u32")):
        ce = dict(BITS_DTYPE=bits, BLOCK_SIZE=BLOCK, N_ITERS=ITERS)
        cases.append((unflatten_kernel, dict(unflat_sig, src=sig), ce, f"unflatten {sig[1:]}",
                      dict(UNFLATTEN_LAUNCH, streaming=True)))
    return cases


CODEGEN_CASES = _codegen_cases()
