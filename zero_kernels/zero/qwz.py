"""qwZ (ZeRO++ quantized weight communication): the stage-3 parameter all-gather sends int8 codes.

[Note: quantized weight all-gather]
With ``ZeroAdamW(stage=3, quantize_weights=True)`` each rank encodes its parameter shard with the
8-bit blockwise codec of zero_kernels/codecs.py (``encode_q8``: blocks of ``BLOCK`` = 256 elements
counted from the shard's first element, one fp32 scale = max |x| per block, the ``linear_signed`` code
book (k - 127) / 127, nearest code) and the group all-gathers the uint8 codes and the fp32 scales
(1 + 4/256 bytes per element instead of 2 for bf16 or 4 for fp32). Every rank decodes the other ranks'
shards (``decode_q8``, then one cast to the parameter dtype) and keeps its own shard exact. So:
  * a gathered parameter differs from the owner's exact one by at most half a code step,
    scale / 254, plus the cast to the parameter dtype (one rounding);
  * the masters, the moments and every state dict / checkpoint (they gather the fp32 masters with
    the exact all-gather) are exact; only what forward and backward compute with is quantized;
  * all-zero blocks (padding) decode to exact zeros (the code book holds 0 at k = 127).
The codes and scales travel as two all-gathers of the collectives module (their own tags), waited for
as one handle; the decode runs in the handle's finalize. Stages 1-2 keep exact parameter all-gathers:
their gathered parameters persist across steps, so a quantized copy would drift from its owner's.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..codecs import BLOCK, CODE_BOOKS, decode_q8, midpoints, scaled_blocks
from . import collectives as C

__all__ = ["QWZ_CODE", "quantized_all_gather", "qwz_bytes", "encode_wire", "wire_encode", "wire_decode",
           "WIRE_BACKEND"]

QWZ_CODE = "linear_signed"
_MID_EXT: dict = {}             # device -> [-inf, the 255 midpoints of the book, +inf]
# Who encodes and decodes the wire codes: "auto" = the Triton kernels of kernels/quant.py for CUDA
# tensors ([Note: the wire codec kernels]), torch ops (encode_wire / codecs.decode_q8) on CPU;
# "triton" / "torch" force one (tests run the kernels interpreted on CPU tensors). Same bits either way.
WIRE_BACKEND = "auto"


def _mid_ext(device) -> Tensor:
    mid = _MID_EXT.get(device)
    if mid is None:
        inf = torch.full((1,), float("inf"), device=device)
        mid = _MID_EXT[device] = torch.cat([-inf, midpoints(CODE_BOOKS[QWZ_CODE].to(device)), inf])
    return mid


def _triton(t: Tensor) -> bool:
    return WIRE_BACKEND == "triton" or (WIRE_BACKEND == "auto" and t.is_cuda)


def wire_encode(x: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    """(uint8 codes, fp32 block scales) of x with the qwZ/qgZ book (``codecs.encode_q8``'s bits)."""
    if _triton(x):
        from ..kernels.quant import q8_encode_triton      # triton is imported only where it runs
        return q8_encode_triton(x.float().contiguous(), _mid_ext(x.device)[1:-1])
    return encode_wire(x, table)


def wire_decode(codes: Tensor, scales: Tensor, table: Tensor, acc: Tensor | None = None) -> Tensor:
    """``codecs.decode_q8`` (fp32), or ``acc += it`` in place when ``acc`` (fp32, contiguous) is given."""
    if _triton(codes):
        from ..kernels.quant import q8_decode_triton
        if acc is not None:
            return q8_decode_triton(codes, scales, table, acc, accumulate=True)
        return q8_decode_triton(codes, scales, table, torch.empty(codes.shape, dtype=torch.float32,
                                                                 device=codes.device))
    out = decode_q8(codes, scales, table)
    return out if acc is None else acc.add_(out)


def encode_wire(x: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    """``codecs.encode_q8(x, table)`` for the linear book ``QWZ_CODE``, bit for bit (tests/test_zeropp.py),
    without ``torch.bucketize`` (a binary search per element: 4x slower on CPU, most of a qwZ/qgZ step).
    The book is (k - 127) / 127, so the code is ``floor(127 y + 127.5)`` up to one step; comparing y
    with the two midpoints around that guess gives the exact count of midpoints strictly below y."""
    y, scale = scaled_blocks(x)
    mid = _mid_ext(y.device)
    # NaN -> 255 (torch.bucketize puts NaN after every boundary; NaN compares false below)
    c = torch.floor(y * 127.0 + 127.5).nan_to_num_(255.0).clamp_(0, 255).long()
    c -= (mid[c] >= y).long()                   # mid[c] is the book's midpoint c - 1 (below the guess)
    c += (mid[c + 1] < y).long()                # mid[c + 1] is midpoint c (above it)
    return c.reshape(-1)[:x.numel()].to(torch.uint8).view(x.shape), scale


class Both:
    """Two handles waited for as one (``wait(timeout)`` bounds each)."""
    __slots__ = ("works",)

    def __init__(self, *works):
        self.works = [w for w in works if w is not None]

    def wait(self, timeout=None) -> bool:
        return all((w.wait() if timeout is None else w.wait(timeout)) is not False for w in self.works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def qwz_bytes(shard_numel: int) -> int:
    """Bytes one rank's shard occupies on the wire under qwZ (codes + scales)."""
    return shard_numel + 4 * -(-shard_numel // BLOCK)


def quantized_all_gather(flat: Tensor, rank: int, group=None, async_op: bool = True,
                         tag: Any = None, own_exact: bool = True) -> C.AllGatherResult:
    """``collectives.all_gather_bucket`` with the other ranks' slices sent as int8 codes ([Note:
    quantized weight all-gather]); this rank's slice of ``flat`` is the input and stays exact, or,
    with ``own_exact=False``, is replaced by the decode of its own codes too, so that every rank holds
    the same bits ([Note: hierarchical qgZ] in qgz.py)."""
    n = C.group_size(group)
    if n == 1:
        return C.all_gather_bucket(flat, rank, group, async_op, tag)
    sn = flat.numel() // n
    nb = -(-sn // BLOCK)
    table = CODE_BOOKS[QWZ_CODE].to(flat.device)
    codes = torch.empty(n * sn, dtype=torch.uint8, device=flat.device)
    scales = torch.empty(n * nb, dtype=torch.float32, device=flat.device)
    own_codes, own_scales = wire_encode(flat[rank * sn:(rank + 1) * sn], table)
    codes[rank * sn:(rank + 1) * sn].copy_(own_codes)
    scales[rank * nb:(rank + 1) * nb].copy_(own_scales)
    g_codes = C.all_gather_bucket(codes, rank, group, True, ("qwZ codes", tag))
    g_scales = C.all_gather_bucket(scales, rank, group, True, ("qwZ scales", tag))

    def decode():
        for j in range(n):
            if j != rank or not own_exact:
                flat[j * sn:(j + 1) * sn].copy_(wire_decode(codes[j * sn:(j + 1) * sn],
                                                          scales[j * nb:(j + 1) * nb], table))
    res = C.AllGatherResult(flat, Both(g_codes.work, g_scales.work), tag, decode)
    if not async_op:
        C.wait(res)
        return res._replace(work=None, finalize=None)
    return res
