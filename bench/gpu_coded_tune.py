"""Launch shapes of the Triton coded-state kernel (kernels/adam_coded.py) on a GPU: one table, one run.

    python bench/gpu_coded_tune.py                      # llama7b-layer, 8bit and 8bit+rem, every variant
    python bench/gpu_coded_tune.py --modes 8bit --variants 8x1024x4,8x1024x1

A variant is WARPSxBLOCKxITERS (num_warps, elements per iteration = a [BLOCK // 256, 256] tile, iterations per
program). Each variant's first step is checked bit for bit against the default variant's on the same inputs
(a variant that differs is marked FAILED and not timed); then device time per step, median over rounds
(CUDA events around FusedAdamW.step, states and gradients fixed). GB/s from bench/gpu.py's byte counts.
The kernel's module constants are set per variant (BLOCK, ITERS, CHUNK, LAUNCH_OPTIONS): a tuning tool,
not a way to run the optimizer. Without a CUDA GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT_VARIANTS = "4x1024x4,8x1024x4,8x1024x1,4x512x8,16x2048x2"   # the kernel's own first


def set_variant(warps: int, block: int, iters: int) -> None:
    from zero_kernels.kernels import adam_coded as AC
    AC.BLOCK, AC.ITERS, AC.CHUNK = block, iters, block * iters
    AC.LAUNCH_OPTIONS = dict(num_warps=warps, enable_fp_fusion=False)


def build(shapes, mode, seed=0, device="cuda"):
    import torch
    import zero_kernels as zk
    from gpu import BETAS, EPS, LR, STATE_FORMATS, WD
    g = torch.Generator(device=device).manual_seed(seed)
    ps = [torch.nn.Parameter((torch.randn(s, generator=g, device=device) * 0.02).to(torch.bfloat16)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g, device=device) * 1e-3).to(torch.bfloat16)
    fmt = {k: getattr(torch, v) if isinstance(v, str) else v for k, v in STATE_FORMATS[mode].items()}
    opt = zk.FusedAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend="triton", **fmt)
    return ps, opt


def snapshot(ps, opt):
    """Every parameter and state tensor after a step, as raw bytes."""
    return [t.detach().reshape(-1).contiguous().view(torch_uint8()).clone() for p in ps for t in [p, *opt.state[p].values()]]


def torch_uint8():
    import torch
    return torch.uint8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="llama7b-layer")
    ap.add_argument("--modes", default="8bit,8bit+rem")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("No CUDA GPU on this machine: bench/gpu_coded_tune.py has nothing to measure. Exiting.")
        return 0
    os.environ.setdefault("TRITON_INTERPRET", "0")
    from _timing import table
    from gpu import WORKLOADS, mode_bytes_per_element, time_steps
    shapes = WORKLOADS[args.workload]()
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    variants = [tuple(int(x) for x in v.split("x")) for v in args.variants.split(",")]
    from zero_kernels.kernels import adam_coded as AC
    default = (AC.LAUNCH_OPTIONS["num_warps"], AC.BLOCK, AC.ITERS)
    print(f"{torch.cuda.get_device_name(0)}, {args.workload} ({numel / 1e6:.0f}M), medians of {args.rounds} rounds "
          f"x {args.repeats} steps", flush=True)
    rows = []
    for mode in args.modes.split(","):
        gb = numel * mode_bytes_per_element(mode) / 1e9
        want, times = None, {v: [] for v in variants}
        notes = {v: "" for v in variants}
        for r in range(args.rounds):
            for v in variants:
                if notes[v]:
                    continue
                set_variant(*v)
                ps, opt = build(shapes, mode)
                if r == 0:
                    opt.step()
                    got = snapshot(ps, opt)
                    if want is None:
                        want = got
                    elif not all(torch.equal(a, b) for a, b in zip(got, want)):
                        notes[v] = "FAILED: differs from the first variant"
                        continue
                dev, _ = time_steps(opt.step, args.repeats)
                times[v] += dev
                del ps, opt
                torch.cuda.empty_cache()
        base = statistics.median(times[variants[0]]) if times[variants[0]] else None
        for v in variants:
            ms = statistics.median(times[v]) if times[v] else None
            rows.append([mode, "x".join(map(str, v)), "" if ms is None else f"{ms:.3f}",
                         "" if ms is None else f"{gb / (ms * 1e-3):.0f}",
                         "" if not (ms and base) else f"{base / ms:.2f}x", notes[v]])
        print(table(rows[-len(variants):], ["mode", "warps x block x iters", "device ms", "GB/s", "x first", "note"]),
              flush=True)
    set_variant(*default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
