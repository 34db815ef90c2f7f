"""The ZeRO layer's bucket kernels (kernels/flatten.py) on CUDA against the torch path, bit for bit, with
regions and tensors at every alignment: packed odd-sized regions and views at odd storage offsets take the
unhinted path, aligned ones the 128-bit path ([Note: hints mark the defining op] in kernels/_multi_tensor.py:
once, every tensor took the 128-bit path and a misaligned one faulted)."""
import pytest
import torch

import _gpu
from zero_kernels.zero.flat import flatten_torch, unflatten_torch

pytestmark = _gpu.MARKS

SIZES = [1, 3, 1003, 4096, 4097, 5000, 12289]


def _odd_view(n, dtype, g, shift):
    """A contiguous tensor of n elements starting ``shift`` elements into a fresh buffer (shift 1: misaligned)."""
    buf = torch.randn(n + shift, generator=g, device="cuda").to(dtype)
    return buf[shift:shift + n]


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (source, bucket, mode) as the ZeRO layer flattens: 16-bit grads into fp32 buckets, fp32 into fp32 (copy,
# scaled, accumulated), fp32 masters into a bf16 bucket
FLATTENS = [(s, F32, m) for s in (F32, BF16, F16) for m in ("copy", "scale", "accumulate")] + [
    (F32, BF16, "copy"), (F32, BF16, "scale")]


@pytest.mark.parametrize("src_dtype,dst_dtype,mode", FLATTENS,
                         ids=[f"{str(s)[6:]}-to-{str(d)[6:]}-{m}" for s, d, m in FLATTENS])
def test_flatten_at_every_alignment(src_dtype, dst_dtype, mode):
    from zero_kernels.kernels.flatten import flatten_triton
    g = torch.Generator(device="cuda").manual_seed(len(SIZES) + src_dtype.itemsize + dst_dtype.itemsize)
    srcs = [_odd_view(n, src_dtype, g, shift=i % 3) for i, n in enumerate(SIZES)]
    offsets, off = [], 5                       # packed after a 5-element head: regions at odd offsets
    for t in srcs:
        offsets.append(off)
        off += t.numel()
    out = torch.randn(off + 7, generator=g, device="cuda").to(dst_dtype)
    ref, before = out.clone(), out.clone()
    kw = dict(scale=0.37 if mode != "copy" else None, accumulate=mode == "accumulate")
    flatten_triton(srcs, out, offsets, **kw)
    flatten_torch(srcs, ref, offsets, **kw)
    torch.cuda.synchronize()
    assert _gpu.equal_bits(out, ref)
    for t, o in zip(srcs, offsets):            # negative control: every region was written
        assert not torch.equal(out[o:o + t.numel()], before[o:o + t.numel()]), f"region at {o} unchanged"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_unflatten_at_every_alignment(dtype):
    from zero_kernels.kernels.flatten import unflatten_triton
    g = torch.Generator(device="cuda").manual_seed(3 + dtype.itemsize)
    flat = torch.randn(sum(SIZES) + 9, generator=g, device="cuda").to(dtype)
    offsets, off = [], 3
    for n in SIZES:
        offsets.append(off)
        off += n
    dsts = [_odd_view(n, dtype, g, shift=(i + 1) % 3) for i, n in enumerate(SIZES)]
    refs = [t.clone() for t in dsts]
    unflatten_triton(flat, dsts, offsets)
    unflatten_torch(flat, refs, offsets)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(dsts, refs)):
        assert _gpu.equal_bits(a, b), f"destination {i} ({a.numel()} elements, offset {offsets[i]}) differs"
