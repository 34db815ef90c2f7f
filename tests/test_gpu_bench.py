"""bench/gpu.py is ready for the first user with a GPU and runs cleanly on a machine without one."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: bench/gpu.py would run the full benchmark")
def test_gpu_bench_exits_cleanly_without_gpu():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU" in r.stdout


def _bench_module(name):
    import importlib
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_gpu_bench_workloads_are_the_real_shapes():
    gpu = _bench_module("gpu")
    numel = lambda shapes: sum(int(torch.Size(s).numel()) for s in shapes)  # noqa: E731
    assert len(gpu.gpt2_xl_shapes()) == 580 and abs(numel(gpu.gpt2_xl_shapes()) - 1.5576e9) < 1e5
    assert len(gpu.llama7b_layer_shapes()) == 9 and numel(gpu.llama7b_layer_shapes()) == 202_383_360


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-master"])
def test_stream_ceiling_kernel_moves_the_adam_mix(mixed):
    """The ceiling kernel (interpreted here) reads a, b, c, d and writes a, b, c (+ e): its traffic
    is the step's, element for element."""
    sc = _bench_module("_stream_ceiling")
    n = 3 * sc.BLOCK + 5
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(n, generator=g) for _ in range(3))
    d = torch.randn(n, generator=g).to(torch.bfloat16 if mixed else torch.float32)
    e = torch.zeros(n, dtype=torch.bfloat16) if mixed else None
    want = [t + d.float() for t in (a, b, c)]
    sc._stream_mix_kernel[(-(-n // sc.BLOCK),)](a, b, c, d, a if e is None else e, n, HAS_E=mixed,
                                              BLOCK_SIZE=sc.BLOCK)
    for got, w in zip((a, b, c), want):
        assert torch.equal(got, w)
    if mixed:   # the value does not matter to a ceiling (the interpreter truncates to bf16): the write does
        torch.testing.assert_close(e.float(), want[0], rtol=2 ** -7, atol=0)


def test_coded_tune_variants_parse_and_set_the_kernel_module():
    """bench/gpu_coded_tune.py's variants (run only on a GPU) name the launch shapes they set."""
    tune = _bench_module("gpu_coded_tune")
    from zero_kernels.kernels import adam as A
    from zero_kernels.kernels import adam_coded as AC
    assert tune.parse_variant("4x1024x4r80", None) == (4, 1024, 4, None, 80, True, False, False, False)
    assert tune.parse_variant("4x1024x4r80n", None) == (4, 1024, 4, None, 80, False, False, False, False)
    assert tune.parse_variant("8x2048x2p", None) == (8, 2048, 2, None, 0, True, True, False, False)
    assert tune.parse_variant("4x1024x4s", None) == (4, 1024, 4, None, 0, True, False, True, False)
    assert tune.parse_variant("f16x2048x2s", None) == (16, 2048, 2, None, 0, True, False, True, True)
    for v in tune.DEFAULT_VARIANTS.split(","):
        tune.parse_variant(v, None)
    before = (AC.BLOCK, AC.ITERS, AC.CHUNK, AC.LAUNCH_OPTIONS, AC.Q8_MAXNREG, AC.SPLIT_FULL, AC.PIPELINE_FULL,
              AC.fused_adam_coded_kernel, A.SPLIT_FULL, A.BLOCK, A.ITERS, A.CHUNK, A.LAUNCH_OPTIONS)
    try:
        tune.set_variant(*tune.parse_variant("8x2048x2r72p", None))
        assert (AC.BLOCK, AC.ITERS, AC.CHUNK, AC.LAUNCH_OPTIONS["num_warps"], AC.Q8_MAXNREG, AC.SPLIT_FULL,
                AC.PIPELINE_FULL, A.SPLIT_FULL) == (2048, 2, 4096, 8, 72, True, True, False)
        fp32_shape = (A.BLOCK, A.ITERS, A.LAUNCH_OPTIONS["num_warps"])
        tune.set_variant(*tune.parse_variant("4x1024x4s", None))
        assert A.SPLIT_FULL and not AC.PIPELINE_FULL
        assert (A.BLOCK, A.ITERS, A.LAUNCH_OPTIONS["num_warps"]) == fp32_shape     # without "f": its own shape
        tune.set_variant(*tune.parse_variant("f16x2048x2", None))
        assert (A.BLOCK, A.ITERS, A.CHUNK, A.LAUNCH_OPTIONS["num_warps"], A.SPLIT_FULL) == (2048, 2, 4096, 16, False)
        tune.set_variant(*tune.parse_variant("4x1024x4", None))
        assert (A.BLOCK, A.ITERS, A.LAUNCH_OPTIONS["num_warps"]) == fp32_shape     # restored
    finally:
        (AC.BLOCK, AC.ITERS, AC.CHUNK, AC.LAUNCH_OPTIONS, AC.Q8_MAXNREG, AC.SPLIT_FULL, AC.PIPELINE_FULL,
         AC.fused_adam_coded_kernel, A.SPLIT_FULL, A.BLOCK, A.ITERS, A.CHUNK, A.LAUNCH_OPTIONS) = before


@pytest.mark.parametrize("mode", ["8bit+rem", "fp32"])
def test_coded_tune_variants_compute_the_same_bits(mode):
    """What bench/gpu_coded_tune.py checks on the GPU before it times anything, here on CPU tensors in the
    interpreter over small shapes (whole chunks, a tail, a tensor below one block): every default variant
    (the split, one launch, the pipelined FULL launch over 4 and 8 tiles) and the fp32-state kernel's split
    give the first variant's bits after a step."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels interpreted (TRITON_INTERPRET=1, as the suite sets)")
    tune = _bench_module("gpu_coded_tune")
    from zero_kernels.kernels import adam as A
    from zero_kernels.kernels import adam_coded as AC
    before = (AC.BLOCK, AC.ITERS, AC.CHUNK, AC.LAUNCH_OPTIONS, AC.Q8_MAXNREG, AC.SPLIT_FULL, AC.PIPELINE_FULL,
              AC.fused_adam_coded_kernel, A.SPLIT_FULL, A.BLOCK, A.ITERS, A.CHUNK, A.LAUNCH_OPTIONS)
    names = tune.DEFAULT_VARIANTS.split(",") if mode != "fp32" else ["4x1024x4", "4x1024x4s", "f4x512x8", "f16x2048x2s"]
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        want = None
        for name in names:
            tune.set_variant(*tune.parse_variant(name, None))
            ps, opt = tune.build([(2 * 8192 + 5,), (300,), (3, 1024)], mode, seed=3, device="cpu")
            opt.step()
            got = tune.snapshot(ps, opt)
            if want is None:
                want = got
                assert not torch.equal(ps[0].detach(), tune.build([(2 * 8192 + 5,)], mode, seed=3, device="cpu")[0][0])
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), name
    finally:
        sys.path.pop(0)
        (AC.BLOCK, AC.ITERS, AC.CHUNK, AC.LAUNCH_OPTIONS, AC.Q8_MAXNREG, AC.SPLIT_FULL, AC.PIPELINE_FULL,
         AC.fused_adam_coded_kernel, A.SPLIT_FULL, A.BLOCK, A.ITERS, A.CHUNK, A.LAUNCH_OPTIONS) = before
