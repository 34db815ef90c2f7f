"""GPU kernels against the reference, bit for bit: the cuda and triton backends on fp32, bf16-master
and fp16-master tensor lists (odd sizes, a 2^31+ element tensor), with and without grad scaling and
found-inf skips. The reference runs the same contract with torch ops on the same device and the
same coefficients tensor, so any difference is the kernel's (see [Note: the fused-Adam contract])."""
import pytest
import torch

import _gpu
from zero_kernels import backends
from zero_kernels.reference import compute_coeffs, fused_adam_ref

pytestmark = _gpu.MARKS

SIZES = [1, 7, 1003, 4097, 65537, 1 << 20, 3 * 4096 + 5]
CASES = {  # name: (grad dtype, 16-bit parameter dtype)
    "fp32": (torch.float32, None),
    "bf16-master": (torch.bfloat16, torch.bfloat16),
    "fp16-master": (torch.float16, torch.float16),
}


def _state(seed, sizes, gdt, p16dt, amsgrad, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda n: torch.randn(n, generator=g, device=device)  # noqa: E731
    p = [rnd(n) for n in sizes]
    st = dict(
        masters=p,
        grads=[(rnd(n) * 3).to(gdt) for n in sizes],
        exp_avgs=[rnd(n) * 0.1 for n in sizes],
        exp_avg_sqs=[rnd(n).abs() * 0.01 for n in sizes],
        max_exp_avg_sqs=[rnd(n).abs() * 0.01 for n in sizes] if amsgrad else None,
        params16=[t.to(p16dt) for t in p] if p16dt is not None else None,
    )
    return st


def _clone(st):
    return {k: None if v is None else [t.clone() for t in v] for k, v in st.items()}


def _outputs(st):
    return [t for k in ("masters", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "params16")
            if st[k] is not None for t in st[k]]


@pytest.mark.parametrize("backend", _gpu.cuda_backends())
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("adamw", [True, False], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("scaling", ["none", "scale", "scale+found_inf=0", "found_inf=1"])
def test_kernel_equals_reference_bitwise(backend, case, amsgrad, adamw, scaling):
    gdt, p16dt = CASES[case]
    ours = _state(sum(map(ord, case)) + 2 * amsgrad + adamw, SIZES, gdt, p16dt, amsgrad)
    ref = _clone(ours)
    before = _clone(ours)
    steps = torch.tensor([1.0, 2.0, 3.0, 10.0, 100.0, 7.0, 1000.0], device="cuda")
    coeffs = compute_coeffs(list(steps), 3e-3, 0.9, 0.999, 0.1, adamw, device=torch.device("cuda"))
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=adamw, maximize=False)
    if scaling != "none":
        kw["grad_scale"] = torch.tensor([1.0 / 1024], device="cuda")
    if "found_inf" in scaling:
        kw["found_inf"] = torch.tensor([1.0 if scaling.endswith("=1") else 0.0], device="cuda")
    backends.get(backend)(**ours, coeffs=coeffs, **kw)
    fused_adam_ref(**ref, coeffs=coeffs, **kw)
    torch.cuda.synchronize()
    for i, (a, b, c) in enumerate(zip(_outputs(ours), _outputs(ref), _outputs(before))):
        assert _gpu.equal_bits(a, b), f"output {i} ({a.dtype}, {a.numel()}) differs from the reference"
        if scaling == "found_inf=1":
            assert _gpu.equal_bits(a, c), f"output {i} written although found_inf=1"
    if scaling != "found_inf=1":  # negative control: the step did change the masters
        assert not all(torch.equal(a, c) for a, c in zip(ours["masters"], before["masters"]))


@pytest.mark.parametrize("backend", _gpu.cuda_backends())
@pytest.mark.parametrize("case", ["fp32", "bf16-master"])
def test_misaligned_views_equal_reference_bitwise(backend, case):
    """Views at odd storage offsets (the ZeRO layer's shards of a flat buffer are such views) beside aligned
    tensors in one launch: each tensor takes its own path, and every one equals the reference bit for bit.
    Once the Triton kernel ran every tensor on the 128-bit path and a misaligned one faulted."""
    gdt, p16dt = CASES[case]
    sizes = [4097, 1003, 65537, 8192, 5]
    shifts = [1, 0, 3, 2, 1]                   # elements into a fresh buffer: 0 aligned, else misaligned

    def view(x, shift):
        buf = torch.empty(x.numel() + shift, dtype=x.dtype, device="cuda")
        buf[shift:].copy_(x)
        return buf[shift:]
    st = _state(11 + len(case), sizes, gdt, p16dt, amsgrad=True)
    ours = {k: None if v is None else [view(t, s) for t, s in zip(v, shifts)] for k, v in st.items()}
    ref = _clone(st)
    steps = torch.tensor([3.0, 1.0, 7.0, 2.0, 9.0], device="cuda")
    coeffs = compute_coeffs(list(steps), 1e-3, 0.9, 0.999, 0.1, True, device=torch.device("cuda"))
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw=True, maximize=False)
    backends.get(backend)(**ours, coeffs=coeffs, **kw)
    fused_adam_ref(**ref, coeffs=coeffs, **kw)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(_outputs(ours), _outputs(ref))):
        assert _gpu.equal_bits(a.contiguous(), b), f"output {i} ({a.dtype}, {a.numel()}) differs from the reference"
    assert not torch.equal(ours["masters"][0], st["masters"][0])   # negative control: the step ran


@pytest.mark.parametrize("backend", _gpu.cuda_backends())
def test_tensor_of_more_than_2_31_elements(backend):
    """int64 offsets: a bf16-master tensor of 2^31 + 4099 elements (about 34 GB of state)."""
    n = (1 << 31) + 4099
    need = n * (4 + 4 + 4 + 2 + 2) + (256 << 20)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free device memory, {free / 2**30:.1f} GiB free")
    torch.manual_seed(0)
    p = torch.randn(n, device="cuda")
    st = dict(masters=[p], grads=[torch.randn(n, device="cuda").to(torch.bfloat16)],
              exp_avgs=[torch.zeros(n, device="cuda")], exp_avg_sqs=[torch.zeros(n, device="cuda")],
              max_exp_avg_sqs=None, params16=[p.to(torch.bfloat16)])
    windows = [slice(0, 1 << 16), slice((1 << 31) - (1 << 15), (1 << 31) + (1 << 15)), slice(n - 5000, n)]
    ref = {k: None if v is None else [v[0][w].clone() for w in windows] for k, v in st.items()}
    tail_before = p[n - 5000:].clone()
    coeffs = compute_coeffs([torch.ones((), device="cuda")], 1e-3, 0.9, 0.999, 0.01, True,
                            device=torch.device("cuda"))
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True, maximize=False)
    backends.get(backend)(**st, coeffs=coeffs, **kw)
    fused_adam_ref(**ref, coeffs=coeffs.expand(len(windows), 3), **kw)
    for k in ("masters", "exp_avgs", "exp_avg_sqs", "params16"):
        for w, r in zip(windows, ref[k]):
            assert _gpu.equal_bits(st[k][0][w], r), f"{k}[{w.start}:{w.stop}] differs from the reference"
    assert not torch.equal(p[n - 5000:], tail_before), "the tail beyond 2^31 was not updated"
