"""GPU benchmark: achieved memory bandwidth of every kernel, as a fraction of the device's own.

    python bench/gpu.py                      # 1M .. 1B elements (as memory allows), CSV to bench/gpu_results.csv
    python bench/gpu.py --sizes 1M,64M --repeats 20 --csv out.csv
    python bench/gpu.py --no-zero            # skip the multi-GPU ZeRO step

What it measures (CUDA events, median of --repeats after warm-up, candidates interleaved):
  * copy:     device-to-device ``copy_`` of fp32: the bandwidth ceiling (GB/s = read + write bytes);
  * adam:     one fused step for fp32 (fp32 grad, no 16-bit copy) and mixed precision (bf16 grad in,
              bf16 parameter out), for ``zero_kernels.backends.get("triton")`` and ``get("cuda")``,
              against torch.optim.AdamW(fused=True) (mixed: cast grad to fp32, fused step, copy the
              master to bf16: what users run today) and apex FusedAdam if importable. GB/s uses
              ``zero_kernels.reference.bytes_per_element`` for every candidate of a workload, i.e.
              the bytes the task needs, so slower pipelines show as lower GB/s;
  * flatten / unflatten (if ``zero_kernels.kernels.flatten`` exists): 64 bf16 tensors -> an fp32
              bucket with a scale, and a 16-bit bucket back to 64 tensors, against per-tensor
              ``copy_`` loops;
  * zero:     with several GPUs, a training step (forward, backward, optimizer) of a stack of
              Linear layers under ZeroAdamW stage 1/2/3 (stages the class accepts) on NCCL, against
              DDP + torch fused AdamW.
Every row goes to a CSV with the device name, versions and the git commit.

On a machine without a CUDA GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import subprocess
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SIZES = "1M,4M,16M,64M,256M,1B"


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "B": 2**30}.get(s[-1], 1)
    return int(float(s[:-1] if s[-1] in "KMGB" else s) * mult)


def fmt_size(n: int) -> str:
    for unit, m in (("B", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def versions() -> dict:
    import torch
    v = {"torch": torch.__version__, "cuda": torch.version.cuda or "", "python": platform.python_version()}
    try:
        import triton
        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        v["triton"] = "not installed"
    try:
        import zero_kernels
        v["zero_kernels"] = zero_kernels.__version__
    except Exception:  # noqa: BLE001
        v["zero_kernels"] = "not importable"
    return v


# ---- timing -----------------------------------------------------------------------------------
def gpu_medians(fns: dict, repeats: int, warmup: int = 3) -> dict:
    """Median milliseconds per call of each fn, CUDA-event timed, candidates interleaved."""
    import torch
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b))
    return {k: statistics.median(v) for k, v in times.items()}


class Results:
    def __init__(self, meta: dict):
        self.meta, self.rows, self.copy_gbs = meta, [], None

    def add(self, bench: str, impl: str, workload: str, numel: int, ms: float, bytes_per_elem: float,
            note: str = "") -> None:
        gbs = numel * bytes_per_elem / (ms * 1e-3) / 1e9
        pct = 100.0 * gbs / self.copy_gbs if self.copy_gbs else float("nan")
        self.rows.append(dict(bench=bench, impl=impl, workload=workload, numel=numel, ms=round(ms, 4),
                              bytes_per_elem=bytes_per_elem, gbs=round(gbs, 1), pct_of_copy=round(pct, 1),
                              note=note))
        print(f"  {bench:9s} {workload:22s} {fmt_size(numel):>5s} {impl:28s} {ms:9.3f} ms "
              f"{gbs:8.1f} GB/s {pct:6.1f}% {note}", flush=True)

    def skip(self, bench: str, impl: str, why: str) -> None:
        self.rows.append(dict(bench=bench, impl=impl, workload="", numel="", ms="", bytes_per_elem="",
                              gbs="", pct_of_copy="", note=f"skipped: {why}"))
        print(f"  {bench:9s} {impl:28s} skipped: {why}", flush=True)

    def write(self, path: str) -> None:
        fields = list(self.meta) + ["bench", "impl", "workload", "numel", "ms", "bytes_per_elem", "gbs",
                                    "pct_of_copy", "note"]
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            for r in self.rows:
                w.writerow({**self.meta, **r})
        print(f"\nwrote {len(self.rows)} rows to {path}")


def fits(numel: int, bytes_resident_per_elem: int, headroom: float = 0.8) -> bool:
    import torch
    free, _ = torch.cuda.mem_get_info()
    return numel * bytes_resident_per_elem <= headroom * free


# ---- benchmarks -------------------------------------------------------------------------------
def bench_copy(res: Results, numel: int, repeats: int) -> None:
    import torch
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    ms = gpu_medians({"copy": lambda: dst.copy_(src)}, repeats)["copy"]
    res.copy_gbs = 2 * 4 * numel / (ms * 1e-3) / 1e9
    res.add("copy", "torch copy_ fp32", "d2d", numel, ms, 8)
    del src, dst
    torch.cuda.empty_cache()


def bench_adam(res: Results, numel: int, repeats: int, mixed: bool) -> None:
    import torch
    from zero_kernels import backends
    from zero_kernels.reference import bytes_per_element, compute_coeffs

    gdt = torch.bfloat16 if mixed else torch.float32
    p16dt = torch.bfloat16 if mixed else None
    bpe = bytes_per_element(gdt, p16dt)
    workload = "mixed bf16 grad/param" if mixed else "fp32"
    lr, b1, b2, eps, wd = 1e-4, 0.9, 0.999, 1e-8, 0.01
    dev = torch.device("cuda")
    # Resident: our state (p, m, v fp32 + grad + p16) plus torch's copy of the same for the anchor.
    resident = 2 * (12 + gdt.itemsize + (2 if mixed else 0)) + (4 if mixed else 0)
    if not fits(numel, resident):
        res.skip("adam", f"{workload} {fmt_size(numel)}", "not enough device memory")
        return

    p = torch.randn(numel, device=dev)
    g = torch.randn(numel, device=dev).to(gdt)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    p16 = p.to(torch.bfloat16) if mixed else None
    coeffs = compute_coeffs(torch.ones(1, device=dev), lr, b1, b2, wd, True)
    fns = {}
    for name in ("triton", "cuda"):
        why = backends.why_unavailable(name, dev)
        if why is not None:
            res.skip("adam", f"zero_kernels {name}", why)
            continue
        fn = backends.get(name)
        fns[f"zero_kernels {name}"] = (lambda fn=fn: fn(
            [p], [g], [m], [v], None, [p16] if mixed else None, coeffs, beta1=b1, beta2=b2, eps=eps,
            weight_decay=wd, adamw=True, maximize=False))

    tp = torch.nn.Parameter(torch.randn(numel, device=dev))
    tp.grad = torch.empty_like(tp)
    topt = torch.optim.AdamW([tp], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, fused=True)
    tp16 = tp.detach().to(torch.bfloat16) if mixed else None

    def torch_step():
        tp.grad.copy_(g)            # mixed: the bf16 -> fp32 cast users do today; fp32: a no-op copy
        topt.step()
        if mixed:
            tp16.copy_(tp.detach())

    if not mixed:
        tp.grad = g.clone()

        def torch_step():  # noqa: F811  (fp32: gradient already in place)
            topt.step()
    fns["torch AdamW(fused=True)" + (" +casts" if mixed else "")] = torch_step

    try:
        from apex.optimizers import FusedAdam  # type: ignore
        ap = torch.nn.Parameter(torch.randn(numel, device=dev))
        ap.grad = g.float() if mixed else g.clone()
        aopt = FusedAdam([ap], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, adam_w_mode=True)
        ap16 = ap.detach().to(torch.bfloat16) if mixed else None

        def apex_step():
            if mixed:
                ap.grad.copy_(g)
            aopt.step()
            if mixed:
                ap16.copy_(ap.detach())
        fns["apex FusedAdam" + (" +casts" if mixed else "")] = apex_step
    except ImportError:
        res.skip("adam", "apex FusedAdam", "apex is not installed")
    except Exception as e:  # noqa: BLE001
        res.skip("adam", "apex FusedAdam", f"{type(e).__name__}: {e}")

    for k, ms in gpu_medians(fns, repeats).items():
        res.add("adam", k, workload, numel, ms, bpe)
    del p, g, m, v, p16, tp, topt, fns
    torch.cuda.empty_cache()


def bench_flatten(res: Results, numel: int, repeats: int, ntensors: int = 64) -> None:
    import torch
    try:
        from zero_kernels.kernels import flatten as fl
    except Exception as e:  # noqa: BLE001
        res.skip("flatten", "zero_kernels.kernels.flatten", f"not importable ({type(e).__name__}: {e})")
        return
    if not fits(numel, 2 + 4 + 2 + 2):
        res.skip("flatten", fmt_size(numel), "not enough device memory")
        return
    per = max(1, numel // ntensors)
    sizes = [per] * (numel // per) + ([numel % per] if numel % per else [])
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    srcs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for n in sizes]
    bucket = torch.empty(numel, device="cuda", dtype=torch.float32)

    def torch_flatten():
        for t, o in zip(srcs, offsets):
            bucket[o:o + t.numel()].copy_(t).mul_(0.5)

    def torch_flatten_fused():
        torch.mul(torch.cat(srcs), 0.5, out=bucket)

    fns = {"zero_kernels triton": lambda: fl.flatten_triton(srcs, bucket, offsets, scale=0.5),
           "torch copy_+mul_ loop": torch_flatten, "torch cat+mul": torch_flatten_fused}
    for k, ms in gpu_medians(fns, repeats).items():
        res.add("flatten", k, "bf16->fp32 scaled", numel, ms, 2 + 4)

    flat16 = torch.randn(numel, device="cuda").to(torch.bfloat16)
    dsts = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for n in sizes]

    def torch_unflatten():
        for t, o in zip(dsts, offsets):
            t.copy_(flat16[o:o + t.numel()])

    def torch_unflatten_foreach():
        torch._foreach_copy_(dsts, list(flat16.split(sizes)))

    fns = {"zero_kernels triton": lambda: fl.unflatten_triton(flat16, dsts, offsets),
           "torch copy_ loop": torch_unflatten, "torch _foreach_copy_": torch_unflatten_foreach}
    for k, ms in gpu_medians(fns, repeats).items():
        res.add("unflatten", k, "bf16 bucket->tensors", numel, ms, 2 + 2)
    del srcs, bucket, flat16, dsts
    torch.cuda.empty_cache()


# ---- multi-GPU ZeRO step ----------------------------------------------------------------------
def _zero_worker(rank: int, world: int, port: int, hidden: int, layers: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows = []
    try:
        from zero_kernels import ZeroAdamW

        def make_model():
            torch.manual_seed(0)
            return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden, bias=False) for _ in range(layers)]).cuda()

        x = torch.randn(32, hidden, device="cuda")

        def timed(model, opt):
            def step():
                opt.zero_grad(set_to_none=False)
                model(x).square().mean().backward()
                opt.step()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            ts = []
            for _ in range(repeats):
                dist.barrier()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            return statistics.median(ts)

        model = make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
        ms = timed(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=True))
        rows.append(("DDP + torch AdamW(fused=True)", ms, torch.cuda.max_memory_allocated()))
        del ddp, model
        for stage in (1, 2, 3):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                model = make_model()
                opt = ZeroAdamW(model, stage=stage, lr=1e-4)
            except Exception as e:  # noqa: BLE001
                rows.append((f"ZeroAdamW stage {stage}", None, f"{type(e).__name__}: {e}"))
                continue
            ms = timed(model, opt)
            rows.append((f"ZeroAdamW stage {stage}", ms, torch.cuda.max_memory_allocated()))
            del model, opt
    except Exception:  # noqa: BLE001
        rows.append(("error", None, traceback.format_exc()))
    finally:
        if rank == 0:
            import json
            with open(out, "w") as f:
                json.dump(rows, f)
        dist.destroy_process_group()


def bench_zero(res: Results, repeats: int, hidden: int = 4096, layers: int = 16) -> None:
    import json
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp
    world = torch.cuda.device_count()
    if world < 2:
        res.skip("zero", "ZeroAdamW", f"needs >= 2 GPUs, found {world}")
        return
    try:
        from zero_kernels import ZeroAdamW  # noqa: F401
    except Exception as e:  # noqa: BLE001
        res.skip("zero", "ZeroAdamW", f"not importable ({type(e).__name__}: {e})")
        return
    if not torch.distributed.is_nccl_available():
        res.skip("zero", "ZeroAdamW", "torch was built without NCCL")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "zero.json")
        mp.spawn(_zero_worker, args=(world, port, hidden, layers, repeats, out), nprocs=world, join=True)
        rows = json.load(open(out)) if os.path.exists(out) else [("error", None, "no result from rank 0")]
    nparams = hidden * hidden * layers
    for impl, ms, extra in rows:
        if ms is None:
            res.skip("zero", impl, str(extra).strip().splitlines()[-1] if extra else "failed")
            continue
        # GB/s of the optimizer traffic alone is not separable here: report the step's time and the
        # per-rank peak memory; bytes_per_elem=0 leaves GB/s at 0 by design.
        res.add("zero", impl, f"{world} GPUs, {layers}x{hidden}^2", nparams, ms, 0,
                note=f"peak mem/rank {extra / 2**30:.2f} GiB")


# ---- main -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"element counts (default {DEFAULT_SIZES})")
    ap.add_argument("--repeats", type=int, default=10, help="timed repetitions per candidate (median)")
    ap.add_argument("--csv", default=os.path.join(ROOT, "bench", "gpu_results.csv"))
    ap.add_argument("--no-zero", action="store_true", help="skip the multi-GPU ZeRO step")
    args = ap.parse_args(argv)

    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to benchmark.")
        return 0
    if not torch.cuda.is_available():
        why = ("torch was built without CUDA" if torch.version.cuda is None
               else "no CUDA device is visible")
        print(f"No CUDA GPU on this machine ({why}; torch {torch.__version__}): "
              "bench/gpu.py has nothing to measure. Exiting.")
        return 0

    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    props = torch.cuda.get_device_properties(0)
    meta = dict(device=torch.cuda.get_device_name(0), sm=f"{props.major}{props.minor}",
                mem_gib=round(props.total_memory / 2**30, 1), **versions(), commit=git_commit(),
                date=datetime.datetime.now().isoformat(timespec="seconds"))
    print("  ".join(f"{k}={v}" for k, v in meta.items()))
    res = Results(meta)
    torch.backends.cuda.matmul.allow_tf32 = True

    ceiling_n = max(n for n in sizes if fits(n, 8)) if any(fits(n, 8) for n in sizes) else min(sizes)
    bench_copy(res, ceiling_n, args.repeats)
    print(f"copy ceiling: {res.copy_gbs:.1f} GB/s ({fmt_size(ceiling_n)} fp32)\n")
    for n in sizes:
        for mixed in (False, True):
            try:
                bench_adam(res, n, args.repeats, mixed)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                res.skip("adam", fmt_size(n), "out of memory")
        try:
            bench_flatten(res, n, args.repeats)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            res.skip("flatten", fmt_size(n), "out of memory")
    if not args.no_zero:
        try:
            bench_zero(res, args.repeats)
        except Exception as e:  # noqa: BLE001
            res.skip("zero", "ZeroAdamW", f"{type(e).__name__}: {e}")
    res.write(args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
