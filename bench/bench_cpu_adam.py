"""Benchmark of the C++ CPU fused Adam (zero_kernels._C) against what users would otherwise run.

    python bench/bench_cpu_adam.py                 # N = 32M, 2 threads, median of 9
    python bench/bench_cpu_adam.py --n 8000000 --steps 5 --threads 2
    python bench/bench_cpu_adam.py --isa avx2      # the AVX2 path on an AVX-512 machine

One process, all implementations interleaved step by step (the machine's load drifts; ratios from
interleaved medians are much steadier than absolute times). Two workloads:

  fp32   p, g, m, v fp32.   Rows: zero_kernels cpu kernel, torch.optim.AdamW(fused=True),
         DeepSpeedCPUAdam (if deepspeed is installed).
  mixed  fp32 master/m/v, bf16 gradient in, bf16 parameter out. Rows: the zero_kernels kernel in
         one pass; the torch pipeline (master.grad.copy_(grad16) + fused AdamW + param16.copy_(master));
         the DeepSpeed pipeline (same, with DeepSpeedCPUAdam, whose step needs grads of the params'
         dtype and has no 16-bit output copy in this version).

The ceiling row is csrc's in-place streaming loop (read 4 fp32 arrays, write 3 back: Adam's access
mix), same flags, same SIMD dispatch and same torch thread pool. GB/s use the kernel's bytes per
element (zero_kernels.reference.bytes_per_element): 28 B for both workloads.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import nonnegative_int, positive_int  # noqa: E402
from zero_kernels import _ext  # noqa: E402
from zero_kernels.reference import bytes_per_element, compute_coeffs  # noqa: E402

B1, B2, EPS, LR, WD = 0.9, 0.999, 1e-8, 1e-3, 0.01


def timeit(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def make_zk(C, n, gdt, pdt):
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g = (torch.randn(n) * 1e-2).to(gdt)
    p16 = [torch.empty(n, dtype=pdt)] if pdt is not None else []
    state = {"step": 0}

    def step():
        state["step"] += 1
        co = compute_coeffs([torch.tensor(float(state["step"]))], LR, B1, B2, WD, True)
        C.fused_adam_cpu([p], [g], [m], [v], [], p16, co, B1, B2, EPS, WD, True, False, None, None)
    return step


def make_torch(n, mixed):
    master = torch.nn.Parameter(torch.randn(n))
    master.grad = torch.zeros(n)
    opt = torch.optim.AdamW([master], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True)
    if not mixed:
        master.grad.copy_(torch.randn(n) * 1e-2)
        return opt.step
    g16 = (torch.randn(n) * 1e-2).bfloat16()
    p16 = torch.empty(n, dtype=torch.bfloat16)

    def step():
        master.grad.copy_(g16)           # grad.float(), into the existing fp32 buffer
        opt.step()
        with torch.no_grad():
            p16.copy_(master)            # the bf16 working copy
    return step


def make_ds(n, mixed):
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    master = torch.nn.Parameter(torch.randn(n))
    master.grad = torch.zeros(n)
    opt = DeepSpeedCPUAdam([master], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, adamw_mode=True)
    if not mixed:
        master.grad.copy_(torch.randn(n) * 1e-2)
        return opt.step
    g16 = (torch.randn(n) * 1e-2).bfloat16()
    p16 = torch.empty(n, dtype=torch.bfloat16)

    def step():
        master.grad.copy_(g16)
        opt.step()
        with torch.no_grad():
            p16.copy_(master)
    return step


def make_ceiling(C, n):
    a, b, c, d = (torch.rand(n) for _ in range(4))
    return lambda: C.stream_ceiling(a, b, c, d)


def run(rows: dict, steps: int, warmup: int) -> dict:
    for fn in rows.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in rows}
    for _ in range(steps):
        for k, fn in rows.items():   # interleaved
            times[k].append(timeit(fn))
    return {k: statistics.median(v) for k, v in times.items()}, {k: min(v) for k, v in times.items()}


def table(title, med, best, n, bpe, ceiling_key, kernel_key, anchors):
    print(f"\n{title}  (N = {n:,}, {bpe} B/element, {torch.get_num_threads()} threads; "
          f"ms/step, rates and ratios use the median of interleaved steps, (best) is the fastest)")
    hdr = (f"{'implementation':44s} {'ms/step':>8s} {'(best)':>7s} {'Gparam/s':>9s} {'GB/s':>7s} "
           f"{'% ceil':>7s}")
    hdr += "".join(f" {'x ' + a.split()[0].split('(')[0]:>14s}" for a in anchors)
    print(hdr)
    print("-" * len(hdr))
    for k, t in med.items():
        line = f"{k:44s} {t * 1e3:8.2f} {best[k] * 1e3:7.2f} {n / t / 1e9:9.3f} {n * bpe / t / 1e9:7.1f} "
        line += f"{100 * med[ceiling_key] / t:6.1f}%"
        for a in anchors:
            line += f" {med[a] / t:14.2f}" if a in med else f" {'-':>14s}"
        print(line)
    return {a: med[a] / med[kernel_key] for a in anchors if a in med} | {
        "ceiling_pct": 100 * med[ceiling_key] / med[kernel_key]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=positive_int, default=32 * 1024 * 1024)
    ap.add_argument("--steps", type=positive_int, default=9, help="timed steps per implementation (>= 5)")
    ap.add_argument("--warmup", type=nonnegative_int, default=2)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--isa", choices=["avx512", "avx2", "scalar"], default=None,
                    help="cap the kernel's SIMD path (sets ZERO_KERNELS_CPU_ISA before first use)")
    args = ap.parse_args(argv)
    assert args.steps >= 5, "--steps must be >= 5"
    torch.set_num_threads(args.threads)
    if args.isa:
        os.environ["ZERO_KERNELS_CPU_ISA"] = args.isa   # read by the C++ code at first use
    C = _ext.cpu_module()
    if C is None:
        sys.exit(f"zero_kernels C++ extension unavailable: {_ext.load_error()}")
    n = args.n
    have_ds = False
    if not args.no_deepspeed:
        try:
            import deepspeed.ops.adam  # noqa: F401
            have_ds = True
        except Exception as e:  # noqa: BLE001
            print(f"DeepSpeedCPUAdam skipped: deepspeed unavailable ({type(e).__name__}: {e}); "
                  "pip install deepspeed")
    print(f"torch {torch.__version__}, zero_kernels SIMD path: {C.cpu_isa()}, "
          f"threads: {torch.get_num_threads()}")

    isa = C.cpu_isa()
    zk = f"zero_kernels cpu ({isa})"
    summary = {}
    for title, mixed in (("fp32 AdamW: p, g, m, v fp32", False),
                         ("mixed AdamW: fp32 master/m/v, bf16 grad in, bf16 param out", True)):
        gdt, pdt = (torch.bfloat16, torch.bfloat16) if mixed else (torch.float32, None)
        bpe = bytes_per_element(gdt, pdt)
        rows = {zk: make_zk(C, n, gdt, pdt)}
        t_name = "torch pipeline (cast g, fused AdamW, cast p)" if mixed else "torch AdamW(fused=True)"
        rows[t_name] = make_torch(n, mixed)
        anchors = [t_name]
        if have_ds:
            d_name = "DeepSpeed pipeline (cast g, CPUAdam, cast p)" if mixed else "DeepSpeedCPUAdam"
            rows[d_name] = make_ds(n, mixed)
            anchors.append(d_name)
        rows["ceiling: stream 4 read / 3 write (fp32)"] = make_ceiling(C, n)
        med, best = run(rows, args.steps, args.warmup)
        summary[title] = table(title, med, best, n, bpe, "ceiling: stream 4 read / 3 write (fp32)", zk, anchors)
        del rows

    print("\nTargets (issue 3): fp32 >= 1.0x DeepSpeedCPUAdam, >= 1.05x torch fused, >= 95% of ceiling;"
          " mixed >= 1.5x both pipelines, >= 90% of ceiling")
    for title, s in summary.items():
        print(f"  {title.split(':')[0]:6s}: " + ", ".join(
            f"{k} {v:.2f}x" if k != "ceiling_pct" else f"{v:.1f}% of ceiling" for k, v in s.items()))


if __name__ == "__main__":
    main()
