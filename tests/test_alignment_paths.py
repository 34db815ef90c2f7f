"""The unhinted paths of the pointer-table Triton kernels, interpreted: tensors and regions at addresses that
are not 16-byte aligned take them for whole blocks (not only for a tensor's last block), and must compute
the same bits as the reference. On a GPU these paths are the only ones that may touch such memory
([Note: hints mark the defining op] in kernels/_multi_tensor.py; tests/gpu runs the same checks on CUDA)."""
import pytest
import torch

from zero_kernels import backends
from zero_kernels.reference import compute_coeffs, fused_adam_ref
from zero_kernels.zero.flat import flatten_torch, unflatten_torch

SIZES = [4097, 1003, 2048, 5]
SHIFTS = [1, 0, 3, 2]          # elements into a fresh buffer: 0 aligned, else misaligned


def _view(x, shift):
    buf = torch.empty(x.numel() + shift, dtype=x.dtype)
    buf[shift:].copy_(x)
    return buf[shift:]


def _bits(t):
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split-full"])
def test_adam_table_kernel_on_misaligned_views(split, monkeypatch):
    """Also with SPLIT_FULL (kernels/adam.py): the whole chunks of an aligned tensor (tensor 4) in the FULL
    launch, every other chunk in the other (tensor 5: only its bf16 copy misaligned); the launches are
    recorded, as the interpreter would not fault on a misaligned 128-bit access."""
    from zero_kernels.kernels import adam as A
    kernel, launches = A.fused_adam_kernel, []
    whole = {(4, 0), (4, A.CHUNK)}           # the only chunks the 128-bit-only kernel may run

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                chunks = list(zip(args[3].tolist(), args[4].tolist()))
                launches.append((kw["FULL"], chunks))
                # before the kernel runs: a tail or misaligned chunk there reads past the tensor (the
                # interpreter may crash instead of failing)
                assert not kw["FULL"] or set(chunks) <= whole, f"FULL launch of {chunks}"
                return kernel[grid](*args, **kw)
            return launch
    monkeypatch.setattr(A, "fused_adam_kernel", Spy())
    monkeypatch.setattr(A, "SPLIT_FULL", split)
    sizes, shifts = SIZES + [2 * A.CHUNK + 5, A.CHUNK], SHIFTS + [0, 0]
    g = torch.Generator().manual_seed(7)
    rnd = lambda n: torch.randn(n, generator=g)  # noqa: E731
    st = dict(masters=[rnd(n) for n in sizes], grads=[rnd(n).bfloat16() for n in sizes],
              exp_avgs=[rnd(n) * 0.1 for n in sizes], exp_avg_sqs=[rnd(n).abs() * 0.01 for n in sizes],
              max_exp_avg_sqs=[rnd(n).abs() * 0.01 for n in sizes])
    st["params16"] = [t.bfloat16() for t in st["masters"]]
    ours = {k: [_view(t, s) for t, s in zip(v, shifts)] for k, v in st.items()}
    ours["params16"][5] = _view(st["params16"][5], 1)
    ref = {k: [t.clone() for t in v] for k, v in st.items()}
    coeffs = compute_coeffs([torch.tensor(float(s)) for s in (3, 1, 7, 2, 5, 4)], 1e-3, 0.9, 0.999, 0.1, True)
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, maximize=False)
    backends.get("triton")(**ours, coeffs=coeffs, **kw)
    fused_adam_ref(**ref, coeffs=coeffs, **kw)
    for k in st:
        for i, (a, b) in enumerate(zip(ours[k], ref[k])):
            assert torch.equal(_bits(a), _bits(b)), f"{k}[{i}] ({a.numel()} elements, shift {shifts[i]}) differs"
    assert not torch.equal(ours["masters"][0], st["masters"][0])      # negative control: the step ran
    C_ = A.CHUNK
    rest = [(0, 0), (0, C_), (1, 0), (2, 0), (3, 0)]
    if split:
        assert launches == [(True, [(4, 0), (4, C_)]), (False, rest + [(4, 2 * C_), (5, 0)])]
    else:
        assert launches == [(False, rest + [(4, 0), (4, C_), (4, 2 * C_), (5, 0)])]


def test_flatten_and_unflatten_at_odd_offsets():
    from zero_kernels.kernels.flatten import flatten_triton, unflatten_triton
    g = torch.Generator().manual_seed(8)
    srcs = [_view(torch.randn(n, generator=g).bfloat16(), s) for n, s in zip(SIZES, SHIFTS)]
    offsets = [5 + sum(SIZES[:i]) for i in range(len(SIZES))]          # packed after 5 elements: odd offsets
    out = torch.randn(5 + sum(SIZES) + 3, generator=g)
    ref = out.clone()
    flatten_triton(srcs, out, offsets, scale=0.37, accumulate=True)
    flatten_torch(srcs, ref, offsets, scale=0.37, accumulate=True)
    assert torch.equal(_bits(out), _bits(ref))
    dsts = [_view(torch.zeros(n), (s + 1) % 4) for n, s in zip(SIZES, SHIFTS)]
    refs = [torch.zeros(n) for n in SIZES]
    unflatten_triton(out, dsts, offsets)
    unflatten_torch(out, refs, offsets)
    for i, (a, b) in enumerate(zip(dsts, refs)):
        assert torch.equal(_bits(a), _bits(b)) and a.abs().sum() > 0, f"destination {i} differs or was not written"
