"""Host time of one optimizer step (the Python and dispatch work around the kernel), against
torch.optim.AdamW(fused=True), for 10, 100 and 1,000 parameters.

    python bench/bench_host_overhead.py                   # 10,100,1000 parameters, 41 repeats
    python bench/bench_host_overhead.py --params 1000 --repeats 101
    python bench/bench_host_overhead.py --states 8bit          # zk with 8-bit moments (the coded path)

Method (CPU; fair to both sides): each optimizer's *kernel call* is replaced by a no-op, and
everything around it runs as in training:
  * torch: ``torch._fused_adamw_`` (the fused C++ op: its argument checks and the kernel) is a no-op;
    torch's Python step (``_init_group``, grouping by device/dtype, the ``_foreach_add_`` of the
    step counters) runs as usual.
  * zero_kernels, backend "cpu": the extension's ``fused_adam_cpu`` (its C++ argument checks and the
    kernel) is a no-op; the plan lookup, gradient checks, counters, coefficients and the call run.
  * zero_kernels, backend "triton" (the GPU path, interpreted here): the ``@triton.jit`` kernel's
    launch is a no-op; the wrapper's checks, the pointer table and chunk map lookups run. Triton's
    own launch cost (~10-20 us on a GPU, once per launch, not per parameter) is not included.
Parameters hold 64 fp32 elements each, gradients are static (``zero_grad(set_to_none=False)``, as in
CUDA-graph training; the plan cache is keyed on them either way). Candidates are timed round-robin
(interleaved) and the medians compared; the ratio is ours / torch's (lower is better).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved_medians, positive_int, table  # noqa: E402

os.environ.setdefault("TRITON_INTERPRET", "1")   # the triton row needs CPU tensors in the interpreter


def _params(n: int, numel: int = 64) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(n)
    ps = [torch.nn.Parameter(torch.randn(numel, generator=g)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(numel, generator=g)
    return ps


class _NoKernel:
    """The extension module with its fused kernels replaced by no-ops (everything else passes)."""

    def __init__(self, mod):
        self._mod = mod

    def __getattr__(self, name):
        if name.startswith("fused_adam"):
            return lambda *args, **kwargs: None
        return getattr(self._mod, name)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> list[str]:
    """Replace the three kernel calls by no-ops; returns the backends that can be measured."""
    import zero_kernels as zk  # noqa: F401
    from zero_kernels import _ext, backends
    from zero_kernels.kernels import adam, adam_coded

    torch._fused_adamw_ = lambda *args, **kwargs: None
    adam.fused_adam_kernel = _NoLaunch()
    adam_coded.fused_adam_coded_kernel = _NoLaunch()
    ours = []
    if _ext.cpu_module() is not None:
        _ext._module = _NoKernel(_ext.cpu_module())
        ours.append("cpu")
    if backends.why_unavailable("triton", torch.device("cpu")) is None:
        ours.append("triton")
    return ours


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="10,100,1000")
    ap.add_argument("--repeats", type=positive_int, default=41)
    ap.add_argument("--states", default="fp32", choices=["fp32", "bf16", "8bit"],
                    help="zk's moment format (torch's row keeps fp32 states); coded ones on every tensor")
    args = ap.parse_args(argv)
    fmt = {} if args.states == "fp32" else dict(
        exp_avg_dtype=torch.uint8 if args.states == "8bit" else torch.bfloat16,
        exp_avg_sq_dtype=torch.uint8 if args.states == "8bit" else torch.bfloat16, min_8bit_size=1)
    import zero_kernels as zk
    ours = stub_kernels()
    torch.set_num_threads(1)
    rows = []
    for n in [int(x) for x in args.params.split(",")]:
        fns = {"torch fused": torch.optim.AdamW(_params(n), lr=1e-3, weight_decay=0.01, fused=True).step}
        for b in ours:
            fns[f"zk {b}"] = zk.FusedAdamW(_params(n), lr=1e-3, weight_decay=0.01, backend=b, **fmt).step
        med = interleaved_medians(fns, repeats=args.repeats, warmup=3)
        t = med["torch fused"]
        rows.append([n, t * 1e6] + [x for b in ours for x in (med[f"zk {b}"] * 1e6, f"{med[f'zk {b}'] / t:.2f}x")])
    header = ["params", "torch AdamW(fused) us"] + [x for b in ours for x in (f"zk {b} us", f"{b} / torch")]
    print(f"host time per step, kernels stubbed (median of {args.repeats} interleaved runs, "
          f"torch {torch.__version__}, 1 thread; zk states: {args.states})")
    print(table(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
