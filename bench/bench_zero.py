"""ZeRO-1/2 vs DDP + torch fused AdamW vs ZeroRedundancyOptimizer on 2 gloo processes (1 thread each).

    python bench/bench_zero.py [--steps 6] [--warmup 2] [--batch 64] [--variants ddp,zero_ro,...]

Model: 4 x (Linear 1024->4096, GELU, Linear 4096->1024), ~33.6M fp32 parameters; batch 64; MSE loss.
Per variant (each in fresh processes, so resident memory is its own):
  step ms      median over --steps timed iterations of forward + backward + optimizer step + zero_grad
  fwd+bwd ms   median of forward + backward alone
  opt ms       median of the optimizer step (ZeRO: includes waiting for reduce-scatters / all-gathers)
  exposed ms   communication the step waits on after backward ended: ZeRO = time blocked in
               work.wait() (reduce-scatter + all-gather); DDP = backward with sync minus backward in
               no_sync() (DDP waits for its all-reduce at the end of backward)
  rss MB       process resident memory after the timed steps (rank 0)
  states MB    model-state bytes this rank holds after step() (ZeRO: memory_report(); others: counted)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

VARIANTS = ["ddp", "zero_ro", "zero1", "zero1_copy", "zero2", "zero2_nooverlap"]


def make_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)]
    return nn.Sequential(*layers)


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(rank, world, variant, steps, warmup, batch, out_q):
    import zero_kernels as zk
    from zero_kernels.zero import collectives as C
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 1024, generator=g)
    y = torch.randn(batch, 1024, generator=g)
    waited = [0.0]
    orig_wait = C.wait

    def timed_wait(res):
        t = time.perf_counter()
        out = orig_wait(res)
        waited[0] += time.perf_counter() - t
        return out
    C.wait = timed_wait
    ddp = None
    set_to_none = True
    if variant == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        net = ddp
    elif variant == "zero_ro":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        net = ddp
    else:
        stage = 1 if variant.startswith("zero1") else 2
        set_to_none = variant != "zero1"       # zero1: .grad as bucket views (no flatten copy)
        opt = zk.ZeroAdamW(model, stage=stage, lr=1e-4, overlap_comm=variant != "zero2_nooverlap")
        net = model
    loss_fn = nn.MSELoss()
    t_step, t_fb, t_opt, t_exp = [], [], [], []
    for it in range(warmup + steps):
        dist.barrier()
        waited[0] = 0.0
        t0 = time.perf_counter()
        loss_fn(net(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=set_to_none)
        t3 = time.perf_counter()
        exposed = waited[0]
        if ddp is not None and it >= warmup:
            dist.barrier()
            with ddp.no_sync():
                s = time.perf_counter()
                loss_fn(net(x), y).backward()
                local = time.perf_counter() - s
            opt.zero_grad(set_to_none=True)
            exposed = max(0.0, (t1 - t0) - local)
        if it >= warmup:
            t_step.append(t3 - t0)
            t_fb.append(t1 - t0)
            t_opt.append(t2 - t1)
            t_exp.append(exposed)
    # states after a step (before zero_grad) for the memory columns
    loss_fn(net(x), y).backward()
    opt.step()
    if hasattr(opt, "memory_report"):
        rep = opt.memory_report()
        states = rep["total"]
        backend = opt.backend
    else:
        states = psi * 4 * 2   # params + grads
        if variant == "ddp":
            states += psi * 8
        else:
            owned = sum(p.numel() for p in opt.optim.param_groups[0]["params"]) if hasattr(opt, "optim") else psi
            states += owned * 8
        backend = "torch fused" if variant == "ddp" else "torch"
    rss = rss_mb()
    res = dict(variant=variant, step=statistics.median(t_step) * 1e3, fb=statistics.median(t_fb) * 1e3,
               opt=statistics.median(t_opt) * 1e3, exposed=statistics.median(t_exp) * 1e3, rss=rss,
               states=states / 2**20, backend=backend, psi=psi)
    if rank == 0:
        out_q.put(res)


def _entry(rank, world, port, args, q):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        worker(rank, world, *args, q)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    import torch.multiprocessing as mp
    from _dist import free_port
    ctx = mp.get_context("spawn")
    rows = []
    for v in a.variants.split(","):
        q = ctx.SimpleQueue()
        port = free_port()
        ps = [ctx.Process(target=_entry, args=(r, 2, port, (v, a.steps, a.warmup, a.batch), q)) for r in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        if any(p.exitcode != 0 for p in ps):
            print(f"{v}: failed", file=sys.stderr)
            continue
        rows.append(q.get())
        r = rows[-1]
        print(f"  {v}: step {r['step']:.0f} ms", file=sys.stderr, flush=True)
    base = {r["variant"]: r["step"] for r in rows}
    print(f"\n2 gloo ranks x 1 thread, {rows[0]['psi'] / 1e6:.1f}M params, batch {a.batch}, "
          f"median of {a.steps} steps after {a.warmup} warm-up\n")
    print("| variant | optimizer backend | step ms | vs DDP | vs ZeRO-RO | fwd+bwd ms | opt ms | exposed comm ms | RSS MB | states MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vd = f"{r['step'] / base['ddp']:.2f}x" if "ddp" in base else "-"
        vz = f"{r['step'] / base['zero_ro']:.2f}x" if "zero_ro" in base else "-"
        print(f"| {r['variant']} | {r['backend']} | {r['step']:.0f} | {vd} | {vz} | {r['fb']:.0f} | {r['opt']:.0f} | "
              f"{r['exposed']:.0f} | {r['rss']:.0f} | {r['states']:.0f} |")


if __name__ == "__main__":
    main()
