"""qgZ (ZeRO++ quantized gradient communication): the gradient reduce-scatter sends int8 codes.

[Note: quantized gradient reduce-scatter]
With ``ZeroAdamW(quantize_grads=True)`` (any stage) each rank encodes slice ``j`` of its flat gradient
bucket (the part rank ``j`` owns) with the 8-bit blockwise codec of zero_kernels/codecs.py
(``encode_q8``, blocks of ``BLOCK`` = 256 counted from the slice's first element, one fp32 scale =
max |x| per block, the ``linear_signed`` code book) and sends it to rank ``j`` with one all-to-all of
the codes and one of the scales (1 + 4/256 bytes per element instead of 4 for fp32). The receiver
decodes every peer's codes to fp32 and accumulates in fp32, its own contribution exact, in rank order
(own, then ranks 0, 1, ... skipping itself), and divides by the group size. Per element the result
differs from the exact average by at most ``sum over peers j of scale_j / 254, divided by n`` (half a
code step of each peer's block) plus fp32 rounding; tests/test_qwz.py checks that bound and the codec
reference bit for bit. Under hybrid sharding the replica all-reduce of the reduced slice stays exact
fp32 (ZeRO++'s hierarchical int4 scheme across nodes is not implemented).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..codecs import BLOCK, CODE_BOOKS, decode_q8, encode_q8
from . import collectives as C
from .qwz import QWZ_CODE, Both

__all__ = ["quantized_reduce_scatter", "quantized_average_reference"]


def _encode_slices(flat: Tensor, n: int, table: Tensor) -> tuple[Tensor, Tensor]:
    sn = flat.numel() // n
    pairs = [encode_q8(flat[j * sn:(j + 1) * sn], table) for j in range(n)]
    return torch.cat([c for c, _ in pairs]), torch.cat([s for _, s in pairs])


def _accumulate(own: Tensor, codes: Tensor, scales: Tensor, rank: int, n: int, table: Tensor) -> Tensor:
    """fp32: own (exact) + the decoded peers in rank order, divided by n."""
    sn, nb = own.numel(), scales.numel() // n
    acc = own.float().clone()
    for j in range(n):
        if j != rank:
            acc += decode_q8(codes[j * sn:(j + 1) * sn], scales[j * nb:(j + 1) * nb], table)
    return acc.div_(n)


def quantized_average_reference(flats: list[Tensor], rank: int) -> Tensor:
    """What rank ``rank`` receives from ranks holding ``flats`` (one process, for tests)."""
    n, table = len(flats), CODE_BOOKS[QWZ_CODE]
    sn = flats[0].numel() // n
    sl = slice(rank * sn, (rank + 1) * sn)
    pairs = [encode_q8(f[sl], table) if j != rank else (torch.zeros(sn, dtype=torch.uint8),
                                                       torch.zeros(-(-sn // BLOCK))) for j, f in enumerate(flats)]
    return _accumulate(flats[rank][sl], torch.cat([c for c, _ in pairs]), torch.cat([s for _, s in pairs]),
                       rank, n, table)


def quantized_reduce_scatter(flat: Tensor, output: Tensor, group=None, async_op: bool = True, tag: Any = None,
                             scratch: Tensor | None = None) -> C.ReduceScatterResult:
    """``collectives.reduce_scatter_bucket`` with int8 codes on the wire ([Note: quantized gradient
    reduce-scatter]); ``scratch`` is unused (the codes need their own buffers)."""
    n = C.group_size(group)
    if n == 1:
        return C.reduce_scatter_bucket(flat, output, group, async_op, tag)
    r = C.group_rank(group)
    sn = flat.numel() // n
    table = CODE_BOOKS[QWZ_CODE].to(flat.device)
    send_codes, send_scales = _encode_slices(flat, n, table)
    recv_codes, recv_scales = torch.empty_like(send_codes), torch.empty_like(send_scales)
    w1 = dist.all_to_all_single(recv_codes, send_codes, group=group, async_op=True)
    w2 = dist.all_to_all_single(recv_scales, send_scales, group=group, async_op=True)

    def finalize():
        output.copy_(_accumulate(flat[r * sn:(r + 1) * sn], recv_codes, recv_scales, r, n, table))
    res = C.ReduceScatterResult(output, Both(w1, w2), tag, finalize)
    if not async_op:
        C.wait(res)
        return res._replace(work=None, finalize=None)
    return res
