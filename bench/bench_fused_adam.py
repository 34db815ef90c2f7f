"""FusedAdamW step time and effective GB/s against torch.optim.AdamW (for-loop, foreach, fused),
measured in the same run, fp32 and mixed precision, 1M..64M parameters.

    python bench/bench_fused_adam.py                 # sizes 1M 4M 16M 64M, 2 threads
    python bench/bench_fused_adam.py --sizes 1 4 --threads 1 --repeats 5
    python bench/bench_fused_adam.py --design        # pointer table vs flatten-then-flat launch

GB/s = bytes_per_element(...) x N / median step time, with bytes_per_element from
zero_kernels.reference (28 B/element for fp32 and for bf16-grad + bf16-param mixed precision).
The model is 16 tensors of N/16 elements (a step always spans many tensors).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved_medians, positive_float, positive_int, table  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels.reference import bytes_per_element  # noqa: E402

N_TENSORS = 16


def make(n: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    per = n // N_TENSORS
    ps = [torch.nn.Parameter(torch.randn(per).to(dtype)) for _ in range(N_TENSORS)]
    for p in ps:
        p.grad = torch.randn(per).to(dtype) * 1e-3
    return ps


def fp32_rows(n: int, repeats: int) -> list[list[object]]:
    opts = {}
    opts["zk FusedAdamW (auto)"] = zk.FusedAdamW(make(n, torch.float32), lr=1e-4)
    opts["zk FusedAdamW (reference)"] = zk.FusedAdamW(make(n, torch.float32), lr=1e-4, backend="reference")
    for name, kw in (("torch AdamW for-loop", dict(foreach=False)), ("torch AdamW foreach", dict(foreach=True)),
                     ("torch AdamW fused", dict(fused=True))):
        opts[name] = torch.optim.AdamW(make(n, torch.float32), lr=1e-4, **kw)
    med = interleaved_medians({k: o.step for k, o in opts.items()}, repeats)
    bpe = bytes_per_element(torch.float32, None)
    fused = med["torch AdamW fused"]
    label = {k: k + (f" [{o.backend['cpu']}]" if isinstance(o, zk.FusedAdam) else "") for k, o in opts.items()}
    return [[f"{n / 2**20:.3g}M", "fp32", label[k], t * 1e3, n * bpe / t / 1e9, fused / t] for k, t in med.items()]


def mixed_rows(n: int, repeats: int) -> list[list[object]]:
    """bf16 params and grads. zk keeps fp32 masters and writes bf16 in the same pass; the torch
    pipeline users run today keeps fp32 masters: cast grads up, fused AdamW, copy masters down."""
    zk_opt = zk.FusedAdamW(make(n, torch.bfloat16), lr=1e-4)
    params16 = make(n, torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params16]
    t_opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def torch_pipeline():
        for p, m in zip(params16, masters):
            m.grad = p.grad.float()
        t_opt.step()
        with torch.no_grad():
            for p, m in zip(params16, masters):
                p.copy_(m)
    med = interleaved_medians({"zk FusedAdamW bf16 (fp32 master)": zk_opt.step,
                               "torch: grad.float + fused AdamW + copy": torch_pipeline}, repeats)
    bpe = bytes_per_element(torch.bfloat16, torch.bfloat16)
    base = med["torch: grad.float + fused AdamW + copy"]
    return [[f"{n / 2**20:.3g}M", "bf16 mixed", k, t * 1e3, n * bpe / t / 1e9, base / t] for k, t in med.items()]


def design_rows(n: int, repeats: int) -> list[list[object]]:
    """The multi-tensor design question of kernels/adam.py, measured on the CPU kernel: one launch
    over a table of 200 separate tensors vs flattening the grads into one buffer + one flat launch."""
    from zero_kernels import backends
    fn = backends.get(backends.resolve("auto", torch.device("cpu")))
    k = 200
    per = n // k
    P = [torch.randn(per) for _ in range(k)]
    G = [torch.randn(per) for _ in range(k)]
    M = [torch.zeros(per) for _ in range(k)]
    V = [torch.zeros(per) for _ in range(k)]
    flatP, flatM, flatV = torch.randn(per * k), torch.zeros(per * k), torch.zeros(per * k)
    flatG = torch.empty(per * k)
    co = zk.compute_coeffs([torch.tensor(1.0)] * k, 1e-4, 0.9, 0.999, 0.0, True)
    co1 = co[:1]
    hp = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True, maximize=False)

    def table_launch():
        fn(P, G, M, V, None, None, co, **hp)

    def flatten_then_flat():
        torch.cat(G, out=flatG)
        fn([flatP], [flatG], [flatM], [flatV], None, None, co1, **hp)
    med = interleaved_medians({"pointer table (200 tensors, 1 call)": table_launch,
                               "flatten grads + 1 flat call": flatten_then_flat}, repeats)
    return [[f"{n / 2**20:.3g}M", "fp32 design", k2, t * 1e3, n * 28 / t / 1e9, med["flatten grads + 1 flat call"] / t]
            for k2, t in med.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=positive_float, nargs="+", default=[1, 4, 16, 64], help="millions (2^20) of parameters")
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--repeats", type=positive_int, default=9)
    ap.add_argument("--design", action="store_true", help="only the pointer-table vs flat-buffer comparison")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    header = ["N", "workload", "implementation", "ms/step", "GB/s", "speedup vs torch fused"]
    rows = []
    for s in a.sizes:
        n = int(s * 2**20) // N_TENSORS * N_TENSORS
        if a.design:
            rows += design_rows(n, a.repeats)
            continue
        rows += fp32_rows(n, a.repeats)
        rows += mixed_rows(n, a.repeats)
    print(f"torch {torch.__version__}, {a.threads} threads, median of {a.repeats} interleaved steps; "
          f"GB/s at 28 B/element")
    print(table(rows, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
