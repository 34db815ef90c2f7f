"""Quality of ZeRO++'s quantized collectives (issue 12 item 3): the loss curve of hybrid ZeRO-3 with
qwZ + qgZ beside the exact collectives, on the same model, data and initialisation.

    python bench/quality_zeropp.py                          # 300 steps, 4 gloo processes as a 2 x 2 mesh
    python bench/quality_zeropp.py --steps 500 --plot quality_zeropp.png

Model and data are bench/quality_states.py's: a GPT-2-shaped model (~0.41M parameters, tied head)
on an order-2 Markov chain over 256 tokens, linear warm-up then cosine decay. Each of the 4 ranks
trains on its own rows of every batch (global batch 4 x --batch). Rows: ZeRO-3 on the 2 x 2 mesh with
exact collectives (the anchor), with qwZ (int8 weight all-gathers), with qwZ + qgZ (int8 gradient
reduce-scatter, hierarchical across the replicas); final loss = mean cross-entropy on fixed held-out
batches, and the largest relative gap of the 20-step mean train loss to the anchor's over the run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import positive_float, positive_int  # noqa: E402
from _harness import spawn_pair  # noqa: E402
from quality_states import GPT, Block, GPTConfig, Markov2, lr_at  # noqa: E402

ROWS = {"exact": {}, "qwZ": dict(quantize_weights=True), "qwZ + qgZ": dict(quantize_weights=True, quantize_grads=True)}


def run_row(options: dict, args, data: Markov2, evals: list) -> dict:
    import zero_kernels as zk
    from torch.distributed.device_mesh import init_device_mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    cfg = GPTConfig()
    torch.manual_seed(0)
    model = GPT(cfg)
    zopt = zk.ZeroAdamW(model, stage=3, mesh=mesh, wrap=[Block], lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                        weight_decay=0.1, backend="reference", timeout=300, **options)
    loss_of = lambda xy: F.cross_entropy(model(xy[:, :-1]).reshape(-1, cfg.vocab), xy[:, 1:].reshape(-1))
    losses, t0 = [], time.perf_counter()
    for s in range(args.steps):
        xy = data.batch(world * args.batch, cfg.seq, seed=10_000 + s)[rank * args.batch:(rank + 1) * args.batch]
        for g in zopt.param_groups:
            g["lr"] = lr_at(s, args.steps, args.lr)
        loss = loss_of(xy)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    with torch.no_grad():
        final = sum(float(loss_of(xy)) for xy in evals) / len(evals)
    zopt.remove_hooks()
    return dict(losses=losses, final=final, secs=time.perf_counter() - t0)


def worker(rank, world, args, q):
    torch.manual_seed(0)
    data = Markov2(GPTConfig().vocab)
    evals = [data.batch(32, GPTConfig().seq, seed=99 + i) for i in range(4)]
    results = {name: run_row(opts, args, data, evals) for name, opts in ROWS.items()}
    if rank == 0:
        q.put(results)


def smooth(xs: list[float], k: int = 20) -> torch.Tensor:
    return F.avg_pool1d(torch.tensor(xs)[None, None], k, 1, k // 2, count_include_pad=False)[0, 0][:len(xs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--steps", type=positive_int, default=300)
    ap.add_argument("--batch", type=positive_int, default=8, help="rows per rank")
    ap.add_argument("--lr", type=positive_float, default=3e-3)
    ap.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    args = ap.parse_args(argv)
    results = spawn_pair(worker, (args,), world=4)
    if results is None:
        print("a worker failed")
        return 1
    anchor = results["exact"]
    base = smooth(anchor["losses"])
    print(f"\n`python bench/quality_zeropp.py --steps {args.steps}`: ZeRO-3 on a 2 x 2 gloo mesh, GPT {GPTConfig()}, "
          f"order-2 Markov data, {args.steps} steps x 4 ranks x {args.batch} rows\n")
    print("| collectives | final held-out loss | ratio to exact | max gap of the 20-step mean loss | s |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        gap = float(((smooth(r["losses"]) - base) / base).abs().max())
        print(f"| {name} | {r['final']:.4f} | {r['final'] / anchor['final']:.4f} | {100 * gap:.2f}% | {r['secs']:.0f} |")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax, dx) = plt.subplots(1, 2, figsize=(13, 5))
        for name, r in results.items():
            ax.plot(smooth(r["losses"]), label=f"{name} ({r['final']:.4f})", lw=1.1)
            dx.plot(smooth(r["losses"]) - base, lw=1.1, label=name)
        ax.set(xlabel="step", ylabel="train loss (20-step mean)", title="ZeRO-3, 2 x 2 mesh: exact vs quantized collectives")
        dx.set(xlabel="step", ylabel="minus the exact run", title="difference to the exact collectives")
        dx.axhline(0, color="k", lw=0.5)
        ax.legend()
        dx.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
