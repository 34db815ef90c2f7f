"""qwZ (ZeRO++ quantized weight communication): the parameter all-gathers send int8 codes.

[Note: quantized weight all-gather]
With ``ZeroAdamW(quantize_weights=True)`` (stage 3's gathers in forward and backward, unit_bucket.py;
stages 1-2's gathers after each bucket's step, gather.py) each rank encodes its parameter shard with the
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
as one handle; the decode runs in the handle's finalize.
Stages 1-2 keep their full parameters between steps, so there the model *holds* the decoded copies
of the other ranks' slices until the next gather: ``model.state_dict()``, ``save_pretrained`` and an
evaluation between steps read values within the bound above (the construction warns once, naming
the fix). They do not drift: every step's gather re-encodes the owner's exact current slice, and a
bucket that did not step keeps the decode of an unchanged slice. The exact paths: the state dicts and
checkpoints of the optimizer read the masters (``full_model_state_dict`` gathers them with the exact
all-gather, fp32 parameters included), and ``ZeroAdamW.sync_exact_params()`` (collective) overwrites
the model's parameters with an exact all-gather of the owners' working values, until the next step.
Who computes the codes is ``WIRE_BACKEND`` below: the Triton kernels of kernels/quant.py for CUDA
tensors, the C++ codec of csrc/cpu_quant.cpp for CPU tensors (the exact 8-step midpoint search of the
coded-state kernel, SIMD per block, threaded over blocks), torch ops (:func:`encode_wire`, ``decode_q8``)
where the extension lacks it; all give ``encode_q8``'s bits (tests/test_wire_cpu.py, test_zeropp.py).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from .. import _ext
from ..codecs import BLOCK, CODE_BOOKS, decode_q8, midpoints, scaled_blocks
from . import collectives as C

__all__ = ["QWZ_CODE", "quantized_all_gather", "qwz_bytes", "encode_wire", "wire_encode", "wire_decode",
           "WIRE_BACKEND", "WIRE_BACKENDS", "wire_module", "wire_backend"]

QWZ_CODE = "linear_signed"
_MID_EXT: dict = {}             # device -> [-inf, the 255 midpoints of the book, +inf]
# Who encodes and decodes the wire codes: "auto" = the Triton kernels of kernels/quant.py for CUDA
# tensors ([Note: the wire codec kernels]), the C++ codec of csrc/cpu_quant.cpp for CPU tensors when
# the extension has it, else (a warning, once) torch ops (encode_wire / codecs.decode_q8);
# "triton" / "cpu" / "torch" force one (tests run the Triton kernels interpreted on CPU tensors;
# "cpu" is an error without the extension). Same bits every way.
WIRE_BACKEND = "auto"
WIRE_BACKENDS = ("auto", "triton", "cpu", "torch")
_warned = False


def wire_module():
    """The C++ extension when it has the wire codec (csrc/cpu_quant.cpp), else None."""
    mod = _ext.cpu_module()
    return mod if mod is not None and hasattr(mod, "q8_encode_cpu") else None


def _why_no_cpp() -> str:
    return _ext.load_error() or "the loaded extension was built without q8_encode_cpu (rebuild it)"


def wire_backend(t: Tensor) -> str:
    """The codec that encodes / decodes ``t`` under ``WIRE_BACKEND``: "triton", "cpu" or "torch"."""
    global _warned
    b = WIRE_BACKEND
    if b not in WIRE_BACKENDS:
        raise ValueError(f"qwz.WIRE_BACKEND={b!r}; expected one of {WIRE_BACKENDS}")
    if b == "cpu" and wire_module() is None:
        raise RuntimeError(f"qwz.WIRE_BACKEND='cpu' but the C++ wire codec is unavailable: {_why_no_cpp()}")
    if b != "auto":
        return b
    if t.is_cuda:
        return "triton"
    if t.device.type != "cpu":
        return "torch"
    if wire_module() is not None:
        return "cpu"
    if not _warned:
        _warned = True
        warnings.warn("zero_kernels: the C++ wire codec is unavailable, so qwZ/qgZ encode and decode CPU "
                      f"tensors with (slower) torch ops, the same bits. Reason: {_why_no_cpp()}",
                      RuntimeWarning, stacklevel=3)
    return "torch"


def _mid_ext(device) -> Tensor:
    mid = _MID_EXT.get(device)
    if mid is None:
        inf = torch.full((1,), float("inf"), device=device)
        mid = _MID_EXT[device] = torch.cat([-inf, midpoints(CODE_BOOKS[QWZ_CODE].to(device)), inf])
    return mid


def wire_encode(x: Tensor, table: Tensor, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """(uint8 codes shaped like x, fp32 block scales) of x with the qwZ/qgZ book ``QWZ_CODE``
    (``codecs.encode_q8``'s bits; ``table`` must be that book, whose midpoints are cached per device).
    With ``out`` = (codes, scales) the results are written there (flat, numel and ceil(numel / BLOCK))."""
    backend = wire_backend(x)
    if backend == "cpu":
        x = x.contiguous()
        codes, scales = out if out is not None else (
            torch.empty(x.shape, dtype=torch.uint8, device=x.device),
            torch.empty(-(-x.numel() // BLOCK), dtype=torch.float32, device=x.device))
        wire_module().q8_encode_cpu(x, _mid_ext(x.device)[1:-1], codes, scales)
        return codes, scales
    if backend == "triton":
        from ..kernels.quant import q8_encode_triton      # triton is imported only where it runs
        codes, scales = q8_encode_triton(x.float().contiguous(), _mid_ext(x.device)[1:-1])
    else:
        codes, scales = encode_wire(x, table)
    if out is None:
        return codes, scales
    out[0].copy_(codes.reshape(out[0].shape))
    out[1].copy_(scales)
    return out


def wire_decode(codes: Tensor, scales: Tensor, table: Tensor, acc: Tensor | None = None) -> Tensor:
    """``codecs.decode_q8`` (fp32), or ``acc += it`` in place when ``acc`` (fp32, contiguous) is given
    (the decode rounded to fp32, then the add)."""
    backend = wire_backend(codes)
    if backend == "cpu":
        out = acc if acc is not None else torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
        wire_module().q8_decode_cpu(codes.contiguous(), scales.contiguous(), table, out, acc is not None)
        return out
    if backend == "triton":
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
    wire_encode(flat[rank * sn:(rank + 1) * sn], table, out=(codes[rank * sn:(rank + 1) * sn],
                                                           scales[rank * nb:(rank + 1) * nb]))
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
