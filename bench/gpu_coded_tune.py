"""Launch shapes of the Triton coded-state kernel (kernels/adam_coded.py) on a GPU: one table, one run.

    python bench/gpu_coded_tune.py                      # llama7b-layer, 8bit and 8bit+rem, every variant
    python bench/gpu_coded_tune.py --modes 8bit --variants 8x1024x4,8x1024x1
    python bench/gpu_coded_tune.py --base zero_kernels._kernels_base --variants 4x1024x4,base:4x1024x4
    python bench/gpu_coded_tune.py --modes fp32,bf16-master --variants 4x1024x4,4x1024x4s   # fp32 states

A variant is WARPSxBLOCKxITERS[rMAXNREG][n|p|s] (num_warps, elements per iteration = BLOCK // 256 quantization
blocks, iterations per program, optionally a register cap per thread of the rest launch's 8-bit kernel, and
``n``: every chunk in one launch of the kernel with every path instead of the full chunks in a FULL launch of
their own, [Note: full and rest launches]; ``p``: the FULL launch pipelined, each tile's loads issued before the
previous tile's arithmetic, PIPELINE_FULL; ``s``: the fp32-state kernel's own full-chunk launch,
kernels/adam.py SPLIT_FULL, for the modes fp32 and bf16-master, whose kernel ignores the other fields unless the
variant starts with ``f``: ``f8x1024x4`` launches kernels/adam.py with 8 warps, BLOCK 1024, 4 iterations); ``base:WARPSxBLOCKxITERS`` runs the kernel of
another copy of kernels/ instead (``--base``: a module path, e.g. a baseline kernels/ copied to
zero_kernels/_kernels_base), interleaved with the others in the same process: an A/B of a kernel change on one
warm GPU. Each variant's first step is checked bit for bit against the first variant's on the same inputs (a
variant that differs is marked FAILED and not timed); then device time per step, median over rounds (CUDA events
around ``repeats`` steps enqueued back to back, bench/gpu.py's ``time_queued``; states and gradients fixed). GB/s from bench/gpu.py's byte counts. The kernel's module
globals are set per variant (BLOCK, ITERS, CHUNK, LAUNCH_OPTIONS, Q8_MAXNREG, SPLIT_FULL, PIPELINE_FULL, the kernel
itself; kernels/adam.py's SPLIT_FULL): a tuning tool, not a way to run the optimizer. Without a CUDA GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import positive_int  # noqa: E402

DEFAULT_VARIANTS = "4x1024x4r80,4x1024x4r80n,4x1024x4r80p,4x1024x8r80p,4x1024x4"   # the kernel's own first


_OWN_KERNEL = []
_FP32_DEFAULT = []


class _WithoutFull:
    """A baseline kernel (no FULL argument) launched as the module launches its own: FULL and PIPELINE dropped
    (the baseline's every-path kernel computes the full chunks' bits as well)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, FULL, PIPELINE=False, **kwargs):
            return self.kernel[grid](*args, **kwargs)
        return launch


def set_variant(warps: int, block: int, iters: int, kernel=None, maxnreg: int = 0, split: bool = True,
                pipeline: bool = False, fp32_split: bool = False, fp32_shape: bool = False) -> None:
    """Module constants of kernels/adam_coded.py for one variant; ``kernel``: another jit kernel (a baseline's)
    launched in place of the module's own, None for the module's own; ``maxnreg``: the register cap per thread
    of the 8-bit-moment rest launches (Q8_MAXNREG; 0: none); ``split``: SPLIT_FULL; ``pipeline``: PIPELINE_FULL;
    ``fp32_split``: kernels/adam.py's SPLIT_FULL; ``fp32_shape``: kernels/adam.py's BLOCK, ITERS and num_warps from
    ``warps, block, iters`` too (else the module's own)."""
    from zero_kernels.kernels import adam as A
    from zero_kernels.kernels import adam_coded as AC
    A.SPLIT_FULL = fp32_split
    if not _FP32_DEFAULT:
        _FP32_DEFAULT.append((A.BLOCK, A.ITERS, dict(A.LAUNCH_OPTIONS)))
    if fp32_shape:      # the fp32-state kernel's launch shape from the variant's fields, else its own
        A.BLOCK, A.ITERS, A.CHUNK = block, iters, block * iters
        A.LAUNCH_OPTIONS = dict(num_warps=warps, enable_fp_fusion=False)
    else:
        b, i, opts = _FP32_DEFAULT[0]
        A.BLOCK, A.ITERS, A.CHUNK, A.LAUNCH_OPTIONS = b, i, b * i, dict(opts)
    if not _OWN_KERNEL:
        _OWN_KERNEL.append(AC.fused_adam_coded_kernel)
    AC.fused_adam_coded_kernel = _WithoutFull(kernel) if kernel is not None else _OWN_KERNEL[0]
    AC.BLOCK, AC.ITERS, AC.CHUNK = block, iters, block * iters
    AC.LAUNCH_OPTIONS = dict(num_warps=warps, enable_fp_fusion=False)
    AC.Q8_MAXNREG = maxnreg
    AC.SPLIT_FULL = split
    AC.PIPELINE_FULL = pipeline


def parse_variant(v: str, base) -> tuple:
    """'4x1024x4', 'base:4x1024x4', '4x1024x4r80' (at most 80 registers per thread), '4x1024x4r80n' (one
    launch), '4x1024x4r80p' (the FULL launch pipelined) or '4x1024x4s' (the fp32-state kernel's split) ->
    (warps, block, iters, kernel or None, maxnreg, split, pipeline, fp32_split)."""
    kernel = None
    if v.startswith("base:"):
        if base is None:
            raise SystemExit(f"variant {v!r} needs --base")
        kernel, v = base.fused_adam_coded_kernel, v[len("base:"):]
    fp32_shape = v.startswith("f")
    v = v.removeprefix("f")
    split, pipeline, fp32_split = not v.endswith("n"), v.endswith("p"), v.endswith("s")
    if pipeline and kernel is not None:
        raise SystemExit(f"variant {v!r}: a --base kernel has no pipelined FULL launch")
    v, _, reg = v.rstrip("nps").partition("r")
    return (*(int(x) for x in v.split("x")), kernel, int(reg or 0), split, pipeline, fp32_split, fp32_shape)


def build(shapes, mode, seed=0, device="cuda"):
    import torch
    import zero_kernels as zk
    from gpu import BETAS, EPS, LR, STATE_FORMATS, WD
    g = torch.Generator(device=device).manual_seed(seed)
    dt = torch.float32 if mode == "fp32" else torch.bfloat16      # bf16-master: bf16 params, fp32 states
    ps = [torch.nn.Parameter((torch.randn(s, generator=g, device=device) * 0.02).to(dt)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g, device=device) * 1e-3).to(dt)
    fmt = {k: getattr(torch, v) if isinstance(v, str) else v for k, v in STATE_FORMATS.get(mode, {}).items()}
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
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--repeats", type=positive_int, default=10)
    ap.add_argument("--base", default=None, help="module holding a baseline adam_coded.py (variants 'base:...')")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("No CUDA GPU on this machine: bench/gpu_coded_tune.py has nothing to measure. Exiting.")
        return 0
    os.environ.setdefault("TRITON_INTERPRET", "0")
    from _timing import table
    from gpu import WORKLOADS, mode_bytes_per_element, time_queued, time_steps
    shapes = WORKLOADS[args.workload]()
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    import importlib
    base = importlib.import_module(args.base + ".adam_coded") if args.base else None
    names = args.variants.split(",")
    variants = [parse_variant(v, base) for v in names]
    from zero_kernels.kernels import adam as A
    from zero_kernels.kernels import adam_coded as AC
    default = (AC.LAUNCH_OPTIONS["num_warps"], AC.BLOCK, AC.ITERS, None, AC.Q8_MAXNREG, AC.SPLIT_FULL,
               AC.PIPELINE_FULL, A.SPLIT_FULL, False)
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
                time_steps(opt.step, 1)                         # warm-up, synchronized
                times[v].append(time_queued(opt.step, args.repeats))
                del ps, opt
                torch.cuda.empty_cache()
        first = statistics.median(times[variants[0]]) if times[variants[0]] else None
        for v in variants:
            ms = statistics.median(times[v]) if times[v] else None
            rows.append([mode, names[variants.index(v)], "" if ms is None else f"{ms:.3f}",
                         "" if ms is None else f"{gb / (ms * 1e-3):.0f}",
                         "" if not (ms and first) else f"{first / ms:.2f}x", notes[v]])
        print(table(rows[-len(variants):], ["mode", "warps x block x iters", "device ms", "GB/s", "x first", "note"]),
              flush=True)
    set_variant(*default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
