"""ZeRO-1/2 vs DDP + torch fused AdamW vs ZeroRedundancyOptimizer on 2 gloo processes (1 thread each).

    python bench/bench_zero.py [--rounds 12] [--warmup 2] [--batch 64] [--variants ddp,zero_ro,...] [--no-rss]

Model: 4 x (Linear 1024->4096, GELU, Linear 4096->1024), ~33.6M fp32 parameters; batch 64; MSE loss.
Timing is INTERLEAVED (the machine is shared, so load drifts): one pair of processes builds every
variant (its own model copy and optimizer), then each round runs one iteration of every variant,
in a rotated order; the ratio columns are the median over rounds of the per-round ratio (the
variants of one round ran within a few seconds of each other). A variant ``name:mode`` runs with
``collectives.GLOO_MODE = mode`` (default "p2p", see [Note: gloo collectives]).
  step ms      median over rounds of forward + backward + optimizer step + zero_grad
  fwd+bwd ms   median of forward + backward alone
  opt ms       median of the optimizer step (ZeRO: includes waiting for reduce-scatters / all-gathers)
  exposed ms   communication the step waits on after backward ended: ZeRO = time blocked in
               work.wait() (reduce-scatter + all-gather); DDP = backward with sync minus backward in
               no_sync() (DDP waits for its all-reduce at the end of backward)
  faults/iter  median minor page faults per iteration on rank 0 (4 KiB pages first touched: fresh
               allocations the kernel must zero; glibc returns large freed blocks to the system)
  RSS MB       process resident memory after a few steps, each variant alone in fresh processes
               (rank 0; skipped with --no-rss)
  states MB    model-state bytes this rank holds after step() (ZeRO: memory_report(); others: counted)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import nonnegative_int, positive_int  # noqa: E402

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
import torch  # noqa: E402

from _harness import (WaitTimer, loadavg, make_mlp, median_ms, minflt, ratio, rss_mb,  # noqa: E402
                      spawn_pair, states_bytes)
from zero_kernels.zero import collectives as C  # noqa: E402

# zero1: .grad as bucket views; zero1_copy: flatten copies; zero2_nooverlap: overlap_comm=False;
# *_opg: overlap_param_gather=True (the all-gathers finish in the next forward's module pre-hooks)
VARIANTS = ["ddp", "zero_ro", "zero1", "zero1_opg", "zero1_copy", "zero2", "zero2_opg", "zero2_nooverlap"]


class Runner:
    """One variant: its own model copy and optimizer; ``iteration()`` times one training step."""

    def __init__(self, variant, rank, batch, timer):
        import zero_kernels as zk
        self.variant = variant
        variant, *opts = variant.split("+")          # e.g. zero2:p2p+pool=0+inflight=8
        base, _, self.mode = variant.partition(":")
        self.mode = self.mode or "p2p"
        self.model = model = make_mlp()
        self.psi = sum(p.numel() for p in model.parameters())
        g = torch.Generator().manual_seed(rank)
        self.x = torch.randn(batch, 1024, generator=g)
        self.y = torch.randn(batch, 1024, generator=g)
        self.timer = timer
        self.ddp = None
        self.set_to_none = True
        if base == "ddp":
            self.ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            self.net = self.ddp
        elif base == "zero_ro":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            self.ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
            self.opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
            self.net = self.ddp
        else:
            stage = 1 if base.startswith("zero1") else 2
            self.set_to_none = base not in ("zero1", "zero1_opg")   # .grad as bucket views (no flatten copy)
            self.opt = zk.ZeroAdamW(model, stage=stage, lr=1e-4, overlap_comm=base != "zero2_nooverlap",
                                    overlap_param_gather=base.endswith("_opg"))
            self.net = model
            if opts:
                raise ValueError(f"{variant}: reducer knobs (+pool=, +inflight=) are no longer settable")
        self.loss_fn = nn.MSELoss()
        self.t_step, self.t_fb, self.t_opt, self.t_exp = [], [], [], []
        self.faults = []                              # minor page faults per iteration (rank-local)

    def iteration(self, record: bool):
        C.GLOO_MODE = self.mode
        dist.barrier()
        self.timer.waited = 0.0
        f0 = minflt()
        t0 = time.perf_counter()
        self.loss_fn(self.net(self.x), self.y).backward()
        t1 = time.perf_counter()
        self.opt.step()
        t2 = time.perf_counter()
        self.opt.zero_grad(set_to_none=self.set_to_none)
        t3 = time.perf_counter()
        f1 = minflt()
        exposed = self.timer.waited
        if self.ddp is not None and record:
            dist.barrier()
            with self.ddp.no_sync():
                s = time.perf_counter()
                self.loss_fn(self.net(self.x), self.y).backward()
                local = time.perf_counter() - s
            self.opt.zero_grad(set_to_none=True)
            exposed = max(0.0, (t1 - t0) - local)
        if record:
            self.t_step.append(t3 - t0)
            self.t_fb.append(t1 - t0)
            self.t_opt.append(t2 - t1)
            self.t_exp.append(exposed)
            self.faults.append(f1 - f0)

    def states(self):
        """Model-state bytes after a step (call after step(), before zero_grad)."""
        opt = self.opt
        if hasattr(opt, "memory_report"):
            return opt.memory_report()["total"], opt.backend
        if not hasattr(opt, "optim"):                  # DDP + torch fused AdamW
            return states_bytes(self.psi, dist.get_world_size(), 0), "torch fused"
        return states_bytes(self.psi, dist.get_world_size(), 1), "torch"


def timing_worker(rank, world, variants, rounds, warmup, batch, out_q):
    timer = WaitTimer()
    runners = [Runner(v, rank, batch, timer) for v in variants]
    for r in range(warmup + rounds):
        k = r % len(runners)
        for run in runners[k:] + runners[:k]:          # rotate the order every round
            run.iteration(record=r >= warmup)
    res = {}
    for run in runners:
        run.loss_fn(run.net(run.x), run.y).backward()
        run.opt.step()
        states, backend = run.states()
        run.opt.zero_grad(set_to_none=True)
        res[run.variant] = dict(variant=run.variant, step=run.t_step, fb=run.t_fb, opt=run.t_opt,
                                exposed=run.t_exp, states=states / 2**20, backend=backend, psi=run.psi,
                                faults=run.faults)
    if rank == 0:
        out_q.put(res)


def rss_worker(rank, world, variant, batch, out_q):
    run = Runner(variant, rank, batch, WaitTimer())
    for _ in range(3):
        run.iteration(record=False)
    if rank == 0:
        out_q.put(rss_mb())


def _spawn(fn, args):
    res = spawn_pair(fn, args)
    if res is None:
        raise RuntimeError(f"{fn.__name__}{args[:1]}: a worker failed")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=positive_int, default=12)
    ap.add_argument("--warmup", type=nonnegative_int, default=2)
    ap.add_argument("--batch", type=positive_int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-rss", action="store_true")
    a = ap.parse_args()
    variants = a.variants.split(",")
    for v in variants:                              # name[:gloo mode]; an unknown name ran as ZeRO-2
        base, _, mode = v.partition(":")
        if base.split("+")[0] not in VARIANTS or mode not in ("", "p2p", "allreduce", "native"):
            ap.error(f"--variants: {v!r} is not NAME[:MODE] with NAME one of {', '.join(VARIANTS)} and MODE one "
                     "of p2p, allreduce, native")
    load0 = loadavg()
    res = _spawn(timing_worker, (variants, a.rounds, a.warmup, a.batch))
    load1 = loadavg()
    rss = {}
    if not a.no_rss:
        for v in variants:
            if ":" not in v and "+" not in v:          # comparison variants: timing only
                rss[v] = _spawn(rss_worker, (v, a.batch))
    med = statistics.median
    psi = next(iter(res.values()))["psi"]
    print(f"\n`python {' '.join(sys.argv)}`: 2 gloo ranks x 1 thread, {psi / 1e6:.1f}M params, batch {a.batch}, "
          f"{a.rounds} interleaved rounds after {a.warmup} warm-up; load average before {load0}, "
          f"after {load1}\n")
    print("| variant | optimizer backend | step ms | vs DDP | vs ZeRO-RO | fwd+bwd ms | opt ms | exposed comm ms "
          "| faults/iter | RSS MB | states MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        r = res[v]
        vd = f"{ratio(r['step'], res['ddp']['step']):.2f}x" if "ddp" in res else "-"
        vz = f"{ratio(r['step'], res['zero_ro']['step']):.2f}x" if "zero_ro" in res else "-"
        rs = f"{rss[v]:.0f}" if v in rss else "-"
        print(f"| {v} | {r['backend']} | {median_ms(r['step']):.0f} | {vd} | {vz} | {median_ms(r['fb']):.0f} | "
              f"{median_ms(r['opt']):.0f} | {median_ms(r['exposed']):.0f} | {med(r['faults']):.0f} | {rs} | "
              f"{r['states']:.0f} |")
    print("\nratios: median over rounds of (variant step / reference step) in the same round. Targets: "
          "ZeRO-2 <= 1.0x DDP; ZeRO-1 <= 0.9x ZeRO-RO (defaults: zero1/zero2; with overlap_param_gather: *_opg).")


if __name__ == "__main__":
    main()
