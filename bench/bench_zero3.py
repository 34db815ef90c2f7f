"""ZeRO-3 (prefetch 0/1/2) vs FSDP2 (fully_shard per block + torch AdamW) vs this project's ZeRO-2,
on 2 gloo processes with 1 thread each.

    python bench/bench_zero3.py [--steps 8] [--warmup 3] [--batch 64] [--repeats 2] [--variants ...]

Model: 4 blocks of (Linear 1024->4096, GELU, Linear 4096->1024), ~33.6M fp32 parameters (the model
of bench_zero.py, grouped into 4 nn.Sequential blocks so that a block is one FSDP2 / ZeRO-3 unit);
batch 64 per rank; MSE loss; fp32 parameters (like bench_zero.py).
Each variant runs in fresh processes (so resident memory is its own); the variant list is run
``--repeats`` times, interleaved (the machine is shared), and the table quotes medians over repeats.
Columns:
  step ms     median over --steps timed iterations of forward + backward + step + zero_grad
  fwd+bwd ms  median of forward + backward
  opt ms      median of the optimizer step
  waited ms   ZeRO: time blocked in collectives' wait() during the whole iteration (forward
              all-gathers included); FSDP2: n/a
  exposed ms  step ms minus the same iteration run locally without any communication (plain model,
              torch AdamW foreach, 1 process): the communication the iteration did not hide
  RSS MB      resident memory of rank 0 after the timed steps and one more step (before zero_grad)
  states MB   model-state bytes per rank after step (ZeRO: memory_report()["total"]; FSDP2: local
              shards of params + grads + AdamW m, v)
  peak units  ZeRO-3: peak gathered working set (memory_report()["peak_gathered_params"], MB)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import nonnegative_int, positive_int  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from _harness import WaitTimer, loadavg, make_mlp, rss_mb, spawn_pair, states_bytes  # noqa: E402

# zero3_pK: prefetch K with the gather cache (default); zero3_pK_nocache: gather_cache=False
VARIANTS = ["fsdp2", "zero2", "zero3_p0", "zero3_p1", "zero3_p2", "zero3_p1_nocache"]


def local_compute_ms(batch, steps):
    """The same iteration without communication (one process, plain model, torch AdamW)."""
    model = make_mlp(blocks=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x, y = torch.randn(batch, 1024), torch.randn(batch, 1024)
    ts = []
    for it in range(steps + 1):
        t0 = time.perf_counter()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if it:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def worker(rank, world, variant, steps, warmup, batch, out_q):
    import zero_kernels as zk
    model = make_mlp(blocks=True)
    psi = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 1024, generator=g)
    y = torch.randn(batch, 1024, generator=g)
    timer = WaitTimer()
    zopt = None
    if variant == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for blk in model:
            fully_shard(blk)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    elif variant == "zero2":
        opt = zopt = zk.ZeroAdamW(model, stage=2, lr=1e-4)
    else:
        pf = int(variant.split("_p")[1].split("_")[0])      # zero3_p1, zero3_p1_nocache
        opt = zopt = zk.ZeroAdamW(model, stage=3, lr=1e-4, prefetch=pf,
                                  gather_cache=not variant.endswith("_nocache"))
    loss_fn = nn.MSELoss()
    t_step, t_fb, t_opt, t_wait = [], [], [], []
    for it in range(warmup + steps):
        dist.barrier()
        timer.waited = 0.0
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad()
        t3 = time.perf_counter()
        if it >= warmup:
            t_step.append(t3 - t0)
            t_fb.append(t1 - t0)
            t_opt.append(t2 - t1)
            t_wait.append(timer.waited)
    if zopt is not None and zopt.stage == 3:
        zopt.reset_peak_memory()
    loss_fn(model(x), y).backward()
    opt.step()
    peak = float("nan")
    if zopt is not None:
        rep = zopt.memory_report()
        states = rep["total"]
        if zopt.stage == 3:
            peak = rep["peak_gathered_params"] / 2**20
    else:
        states = states_bytes(psi, world, 3)            # FSDP2: every state sharded
    rss = rss_mb()
    opt.zero_grad()
    dist.barrier()
    local_ms = local_compute_ms(batch, 3) if rank == 0 else 0.0
    dist.barrier()
    res = dict(variant=variant, step=statistics.median(t_step) * 1e3, fb=statistics.median(t_fb) * 1e3,
               opt=statistics.median(t_opt) * 1e3, waited=statistics.median(t_wait) * 1e3, rss=rss,
               states=states / 2**20, psi=psi, local=local_ms, peak=peak)
    if rank == 0:
        out_q.put(res)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=positive_int, default=8)
    ap.add_argument("--warmup", type=nonnegative_int, default=3)
    ap.add_argument("--batch", type=positive_int, default=64)
    ap.add_argument("--repeats", type=positive_int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--malloc-cache", action="store_true",
                    help="for every variant: glibc keeps freed large blocks (MALLOC_MMAP_THRESHOLD_ / "
                         "MALLOC_TRIM_THRESHOLD_ = 1 GiB), i.e. a caching allocator: re-allocated "
                         "multi-MB buffers are not page-faulted in again")
    a = ap.parse_args()
    if a.malloc_cache:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**30)
        os.environ["MALLOC_TRIM_THRESHOLD_"] = str(2**30)
    runs: dict[str, list[dict]] = {}
    variants = list(dict.fromkeys(a.variants.split(",")))
    load0 = loadavg()
    for rep in range(a.repeats):
        for v in (variants if rep % 2 == 0 else variants[::-1]):      # interleaved, alternating order
            r = spawn_pair(worker, (v, a.steps, a.warmup, a.batch))
            if r is None:
                print(f"{v}: failed", file=sys.stderr)
                continue
            runs.setdefault(v, []).append(r)
            print(f"  [{rep}] {v}: step {r['step']:.0f} ms (local compute {r['local']:.0f} ms)",
                  file=sys.stderr, flush=True)
    rows = []
    for v in variants:
        if v not in runs:
            continue
        rs = runs[v]
        med = {k: statistics.median(r[k] for r in rs) for k in ("step", "fb", "opt", "waited", "rss", "states",
                                                                   "local", "peak")}
        med["variant"] = v
        med["n"] = len(rs)
        med["all"] = [round(r["step"]) for r in rs]
        med["psi"] = rs[0]["psi"]
        rows.append(med)
    base = {r["variant"]: r["step"] for r in rows}
    print(f"\n2 gloo ranks x 1 thread, {rows[0]['psi'] / 1e6:.1f}M fp32 params, batch {a.batch}/rank, "
          f"median of {a.steps} steps after {a.warmup} warm-up, median over {a.repeats} interleaved repeats"
          f"{', malloc cache' if a.malloc_cache else ', default glibc malloc'}; load average before {load0}, "
          f"after {loadavg()}\n")
    print("| variant | step ms (runs) | vs FSDP2 | vs ZeRO-2 | fwd+bwd ms | opt ms | waited ms | exposed ms | "
          "RSS MB | states MB | peak gathered MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vf = f"{r['step'] / base['fsdp2']:.2f}x" if "fsdp2" in base else "-"
        vz = f"{r['step'] / base['zero2']:.2f}x" if "zero2" in base else "-"
        w = "n/a" if r["variant"] == "fsdp2" else f"{r['waited']:.0f}"
        pk = "-" if r["peak"] != r["peak"] else f"{r['peak']:.0f}"
        print(f"| {r['variant']} | {r['step']:.0f} ({', '.join(map(str, r['all']))}) | {vf} | {vz} | {r['fb']:.0f} | "
              f"{r['opt']:.0f} | {w} | {max(0.0, r['step'] - r['local']):.0f} | {r['rss']:.0f} | "
              f"{r['states']:.0f} | {pk} |")


if __name__ == "__main__":
    main()
