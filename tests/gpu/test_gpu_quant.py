"""The ZeRO++ wire codec kernels (kernels/quant.py) on CUDA against the reference codec run on the
host, bit for bit: odd sizes, NaN / zero blocks, decode with accumulation (qgZ's fp32 sum)."""
import pytest
import torch

import _gpu
from zero_kernels.codecs import CODE_BOOKS, decode_q8, encode_q8, midpoints
from zero_kernels.zero.qwz import QWZ_CODE

pytestmark = _gpu.MARKS


@pytest.mark.parametrize("n", [1, 253, 1024, 9 * 256 + 77, (1 << 22) + 5])
def test_wire_codec_kernels_equal_the_reference(n):
    from zero_kernels.kernels.quant import q8_decode_triton, q8_encode_triton
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.linspace(0.01, 5.0, n)
    if n > 4 * 256:
        x[256:512] = 0.0
        x[700] = float("nan")
    table = CODE_BOOKS[QWZ_CODE]
    c_ref, s_ref = encode_q8(x, table)
    c, s = q8_encode_triton(x.cuda(), midpoints(table).cuda())
    assert torch.equal(c.cpu(), c_ref)
    assert torch.equal(s.cpu().nan_to_num(nan=-1.0), s_ref.nan_to_num(nan=-1.0))
    acc = torch.randn(n, generator=g)
    want = (acc + decode_q8(c_ref, s_ref, table)).nan_to_num(nan=-1.0)
    got = q8_decode_triton(c, s, table.cuda(), acc.cuda(), accumulate=True)
    assert torch.equal(got.cpu().nan_to_num(nan=-1.0), want)
