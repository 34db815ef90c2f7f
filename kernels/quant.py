"""ZeRO++ wire codec in Triton (qwZ / qgZ, zero_kernels/zero/qwz.py and qgz.py): 8-bit blockwise
encode of a flat fp32 tensor, and decode (optionally accumulated into an fp32 buffer).

[Note: the wire codec kernels]
The rule is ``zero_kernels.codecs.encode_q8`` / ``decode_q8`` (the reference, torch ops): blocks of
256 elements counted from the tensor's first element, one fp32 scale = max |x| per block (NaN if the
block holds a NaN), code = the number of the code book's 255 midpoints strictly below x / scale (255
for NaN), decode = table[code] * scale. The device functions are kernels/_codecs.py's, shared with the
coded Adam kernel, so the interpreter's bits are the GPU's and both are the reference's
(tests/test_quant_kernels.py). A program handles ``ROWS`` blocks as a [ROWS, 256] tile: the scale is a
row max in registers. Bytes moved per element: encode reads 4 and writes 1 (+ 4/256 for the scale);
decode reads 1 (+ 4/256) and writes 4 (8 when accumulating: read + write).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._codecs import QBLOCK, block_absmax, decode_q8, encode_q8, ld, scaled, st
from ._multi_tensor import device_guard
from .adam import LAUNCH_OPTIONS

ROWS = 4                        # quantization blocks per program


@triton.jit
def _encode_tile(x_ptr, codes_ptr, scales_ptr, mid_ptr, rows, numel, MASKED: tl.constexpr):
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK).to(tl.int64)[None, :]
    offs = tl.max_contiguous(tl.multiple_of(offs, [QBLOCK, QBLOCK]), [1, QBLOCK])
    mask = offs < numel
    x = ld(x_ptr, offs, mask, MASKED)
    scale = block_absmax(x, mask)
    st(codes_ptr, offs, encode_q8(scaled(x, scale), mid_ptr), mask, MASKED)
    st(scales_ptr, rows, scale, rows * QBLOCK < numel, MASKED)


@triton.jit
def q8_encode_kernel(
    x_ptr,          # fp32 [numel]: values to encode
    codes_ptr,      # uint8 [numel]: codes out
    scales_ptr,     # fp32 [ceil(numel / 256)]: block scales out
    mid_ptr,        # fp32 [255]: the code book's midpoints (codecs.midpoints)
    numel,          # int64: elements
    ROWS_: tl.constexpr,   # blocks per program
):
    row0 = tl.program_id(0).to(tl.int64) * ROWS_
    rows = row0 + tl.arange(0, ROWS_).to(tl.int64)
    if (row0 + ROWS_) * QBLOCK <= numel:        # whole tile: unmasked, 128-bit accesses
        _encode_tile(x_ptr, codes_ptr, scales_ptr, mid_ptr, rows, numel, False)
    else:
        _encode_tile(x_ptr, codes_ptr, scales_ptr, mid_ptr, rows, numel, True)


@triton.jit
def _decode_tile(codes_ptr, scales_ptr, table_ptr, out_ptr, rows, numel, ACCUMULATE: tl.constexpr,
                 MASKED: tl.constexpr):
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK).to(tl.int64)[None, :]
    offs = tl.max_contiguous(tl.multiple_of(offs, [QBLOCK, QBLOCK]), [1, QBLOCK])
    mask = offs < numel
    scale = ld(scales_ptr, rows, rows * QBLOCK < numel, MASKED)
    y = decode_q8(ld(codes_ptr, offs, mask, MASKED), scale[:, None], table_ptr)
    if ACCUMULATE:
        y = ld(out_ptr, offs, mask, MASKED) + y
    st(out_ptr, offs, y, mask, MASKED)


@triton.jit
def q8_decode_kernel(
    codes_ptr,      # uint8 [numel]: codes
    scales_ptr,     # fp32 [ceil(numel / 256)]: block scales
    table_ptr,      # fp32 [256]: the code book
    out_ptr,        # fp32 [numel]: decoded values (written, or added to when ACCUMULATE)
    numel,          # int64: elements
    ACCUMULATE: tl.constexpr,   # out += decoded (qgZ's fp32 accumulation) instead of out = decoded
    ROWS_: tl.constexpr,        # blocks per program
):
    row0 = tl.program_id(0).to(tl.int64) * ROWS_
    rows = row0 + tl.arange(0, ROWS_).to(tl.int64)
    if (row0 + ROWS_) * QBLOCK <= numel:
        _decode_tile(codes_ptr, scales_ptr, table_ptr, out_ptr, rows, numel, ACCUMULATE, False)
    else:
        _decode_tile(codes_ptr, scales_ptr, table_ptr, out_ptr, rows, numel, ACCUMULATE, True)


def _grid(numel: int) -> tuple[int]:
    return (max(1, -(-numel // (QBLOCK * ROWS))),)


def q8_encode_triton(x: Tensor, mid: Tensor) -> tuple[Tensor, Tensor]:
    """(uint8 codes shaped like x, fp32 scales [ceil(numel / 256)]) of the contiguous fp32 tensor x."""
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(-(-n // QBLOCK), dtype=torch.float32, device=x.device)
    if n:
        with device_guard(x.device):
            q8_encode_kernel[_grid(n)](x, codes, scales, mid, n, ROWS_=ROWS, **LAUNCH_OPTIONS)
    return codes, scales


def q8_decode_triton(codes: Tensor, scales: Tensor, table: Tensor, out: Tensor, accumulate: bool = False) -> Tensor:
    """out (fp32, contiguous, numel of codes) = table[codes] * scale, or += it when ``accumulate``."""
    n = codes.numel()
    if n:
        with device_guard(codes.device):
            q8_decode_kernel[_grid(n)](codes, scales, table, out, n, ACCUMULATE=accumulate, ROWS_=ROWS,
                                       **LAUNCH_OPTIONS)
    return out


# Ahead-of-time codegen cases (tests/test_codegen.py, sm_80 and sm_90).
CODEGEN_CASES = [      # fp32 data 128-bit; uint8 codes are 4 per thread (32-bit stores). Encode's row max
    # crosses warps through a 128-byte reduction scratch (measured: 8 warps x 4 rows x 4 B), no layout
    # conversion; decode has no reduction and no shared memory.
    (q8_encode_kernel, dict(x_ptr="*fp32", codes_ptr="*u8", scales_ptr="*fp32", mid_ptr="*fp32", numel="i64"),
     dict(ROWS_=ROWS), "wire codec encode", dict(LAUNCH_OPTIONS, min_wide_stores=0, max_shared=128)),
    (q8_decode_kernel, dict(codes_ptr="*u8", scales_ptr="*fp32", table_ptr="*fp32", out_ptr="*fp32", numel="i64"),
     dict(ACCUMULATE=True, ROWS_=ROWS), "wire codec decode (accumulate)", dict(LAUNCH_OPTIONS)),
    (q8_decode_kernel, dict(codes_ptr="*u8", scales_ptr="*fp32", table_ptr="*fp32", out_ptr="*fp32", numel="i64"),
     dict(ACCUMULATE=False, ROWS_=ROWS), "wire codec decode", dict(LAUNCH_OPTIONS, min_wide_loads=0)),
]
