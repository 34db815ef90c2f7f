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
reference bit for bit.

[Note: hierarchical qgZ]
Under hybrid sharding ([Note: hybrid sharding] in mesh.py) the reduced slice is then averaged across
the replicas, the only traffic that crosses nodes. With qgZ that exchange is int8 too
(:func:`quantized_average`, ZeRO++'s hierarchical scheme with int8 codes instead of int4): the slice is
cut into R pieces, a quantized reduce-scatter over the replicate group leaves each replica the average
of its piece (as above), which it encodes once more; an all-gather of those codes and scales gives every
replica every piece, and every replica (the piece's owner too) decodes all of them, so the replicas
hold bit-identical slices, as the exact path does. Bytes sent per element across nodes:
2 (R-1)/R x (1 + 4/256) instead of 2 (R-1)/R x 4. Error per element: the reduce-scatter's bound
plus half a code step of the piece's block (scale/254).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..codecs import BLOCK, CODE_BOOKS, encode_q8
from . import collectives as C
from .qwz import QWZ_CODE, Both, quantized_all_gather, wire_decode, wire_encode
from .wire import record_sends

__all__ = ["quantized_reduce_scatter", "quantized_average_reference", "quantized_average"]


def _encode_slices(flat: Tensor, n: int, table: Tensor) -> tuple[Tensor, Tensor]:
    sn = flat.numel() // n
    nb = -(-sn // BLOCK)
    codes = torch.empty(n * sn, dtype=torch.uint8, device=flat.device)
    scales = torch.empty(n * nb, dtype=torch.float32, device=flat.device)
    for j in range(n):
        wire_encode(flat[j * sn:(j + 1) * sn], table, out=(codes[j * sn:(j + 1) * sn], scales[j * nb:(j + 1) * nb]))
    return codes, scales


def _accumulate(own: Tensor, codes: Tensor, scales: Tensor, rank: int, n: int, table: Tensor) -> Tensor:
    """fp32: own (exact) + the decoded peers in rank order, divided by n."""
    sn, nb = own.numel(), scales.numel() // n
    acc = own.float().clone()
    for j in range(n):
        if j != rank:
            wire_decode(codes[j * sn:(j + 1) * sn], scales[j * nb:(j + 1) * nb], table, acc)
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
    nb = send_scales.numel() // n                   # [Note: bytes on the wire]: slice j goes to rank j only
    record_sends("reduce_scatter", group, [(dist.get_global_rank(group, j) if group is not None else j,
                                            sn * send_codes.element_size() + nb * send_scales.element_size())
                                           for j in range(n) if j != r])
    w1 = dist.all_to_all_single(recv_codes, send_codes, group=group, async_op=True)
    w2 = dist.all_to_all_single(recv_scales, send_scales, group=group, async_op=True)

    def finalize():
        output.copy_(_accumulate(flat[r * sn:(r + 1) * sn], recv_codes, recv_scales, r, n, table))
    res = C.ReduceScatterResult(output, Both(w1, w2), tag, finalize)
    if not async_op:
        C.wait(res)
        return res._replace(work=None, finalize=None)
    return res


@torch.no_grad()
def quantized_average(t: Tensor, group) -> None:
    """Average the fp32 tensor ``t`` in place across ``group`` with int8 codes on the wire both ways,
    leaving bit-identical values on every rank ([Note: hierarchical qgZ]). Synchronous (bounded by
    the enclosing timeout scope)."""
    n = C.group_size(group)
    if n == 1:
        return
    r = C.group_rank(group)
    sn = -(-t.numel() // n)
    flat = torch.zeros(n * sn, dtype=torch.float32, device=t.device)
    flat[:t.numel()].copy_(t.reshape(-1))
    piece = torch.empty(sn, dtype=torch.float32, device=t.device)
    C.wait(quantized_reduce_scatter(flat, piece, group, True, "qgZ replica"))
    flat[r * sn:(r + 1) * sn].copy_(piece)
    C.wait(quantized_all_gather(flat, r, group, True, "qgZ replica", own_exact=False))
    t.copy_(flat[:t.numel()].view_as(t))
