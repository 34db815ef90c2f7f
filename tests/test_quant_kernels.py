"""The ZeRO++ wire codec kernels (kernels/quant.py, [Note: the wire codec kernels]) interpreted, against
the reference codec (zero_kernels.codecs.encode_q8 / decode_q8) bit for bit: odd sizes (partial last
block, partial last program), a size below one block, an all-zero block, NaN and inf blocks, every
midpoint of the code book below 1 at scale 1 (the ties, which take the lower code), accumulation into an
fp32 buffer; negative controls."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from zero_kernels.codecs import BLOCK, CODE_BOOKS, decode_q8, encode_q8, midpoints  # noqa: E402
from zero_kernels.kernels.quant import q8_decode_triton, q8_encode_triton  # noqa: E402
from zero_kernels.zero.qwz import QWZ_CODE  # noqa: E402

TABLE = CODE_BOOKS[QWZ_CODE]


def _values(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.linspace(0.01, 5.0, n)
    if n > 3 * BLOCK:
        x[BLOCK:2 * BLOCK] = 0.0                                      # an all-zero block
        # ties: the book spans [-1, 128/127], so every midpoint but the top one (above 1) is a tie at scale 1
        x[2 * BLOCK:2 * BLOCK + 254] = midpoints(TABLE)[:254]
        x[2 * BLOCK + 254], x[2 * BLOCK + 255] = 1.0, -1.0            # the block's absmax: scale 1, y = x
    return x


@pytest.mark.parametrize("n", [1, BLOCK - 3, 4 * BLOCK, 9 * BLOCK + 77])
def test_encode_decode_equal_the_codec(n):
    x = _values(n, seed=n)
    if n > 8 * BLOCK:
        x[5 * BLOCK + 3] = float("nan")
        x[6 * BLOCK + 9] = float("inf")
    c_ref, s_ref = encode_q8(x, TABLE)
    c, s = q8_encode_triton(x, midpoints(TABLE))
    assert torch.equal(s.nan_to_num(nan=-1.0), s_ref.nan_to_num(nan=-1.0))
    assert torch.equal(c, c_ref), int((c != c_ref).sum())
    if n > 3 * BLOCK:   # the ties are ties (scale exactly 1) and take the lower code, as torch.bucketize
        assert s_ref[2].item() == 1.0 and torch.equal(c[2 * BLOCK:2 * BLOCK + 254].long(), torch.arange(254))
    want = decode_q8(c_ref, s_ref, TABLE)
    out = q8_decode_triton(c, s, TABLE, torch.empty(n))
    assert torch.equal(out.nan_to_num(nan=-1.0), want.nan_to_num(nan=-1.0))
    acc = _values(n, seed=n + 1)
    q8_decode_triton(c, s, TABLE, acc, accumulate=True)
    assert torch.equal(acc.nan_to_num(nan=-1.0), (_values(n, seed=n + 1) + want).nan_to_num(nan=-1.0))


def test_negative_controls():
    """A wrong code book or a dropped scale fails the comparison the tests above make."""
    x = _values(4 * BLOCK, seed=5)
    c, s = q8_encode_triton(x, midpoints(TABLE))
    wrong_book = CODE_BOOKS["dynamic_signed"]
    assert not torch.equal(q8_decode_triton(c, s, wrong_book, torch.empty(x.numel())), decode_q8(c, s, TABLE))
    assert not torch.equal(q8_decode_triton(c, torch.ones_like(s), TABLE, torch.empty(x.numel())),
                           decode_q8(c, s, TABLE))
    c2, _ = q8_encode_triton(x, midpoints(wrong_book))
    assert not torch.equal(c2, encode_q8(x, TABLE)[0])
