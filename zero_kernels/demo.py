"""``python -m zero_kernels.demo``: the whole product on a laptop, in one table.

Trains a small GPT-style model (character-level, on text shipped inside this package: no
downloads) on ``--nproc`` CPU processes (gloo, spawned here) with ZeRO stages 1, 2 and 3, against
one process running plain ``torch.optim.AdamW`` on the whole batch (the reference every stage must
match), and times DDP + ``torch.optim.AdamW(fused=True)`` for comparison. Prints:

    stage | final loss | max |param - reference| | memory/rank measured vs formula | step time vs DDP

and writes a PNG beside it (``--plot``, default ``zk_demo.png``): the loss curves of every run and the
reference, and each rank's model-state memory by stage against the formula.

    python -m zero_kernels.demo                       # 2 processes, 50 steps, stages 1 2 3
    python -m zero_kernels.demo --nproc 3 --steps 20 --stage 2 --plot demo.png
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import math
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from .plan_chart import plot_path_problem

TEXT = """ZeRO removes the memory redundancies across data-parallel processes by partitioning the
model states (parameters, gradients and optimizer state) instead of replicating them. Each rank
keeps one slice of the fp32 master weights and of the two Adam moments, updates only that slice,
and the updated sixteen-bit parameters are gathered back before the next forward pass. Stage one
shards the optimizer states, stage two the gradients as well, and stage three the parameters
themselves, which are gathered just in time for each layer and freed right after it is used.
The step that every rank runs on its slice reads the master weights, both moments and the
gradient once, and writes the master, both moments and the sixteen-bit copy once: twenty-eight
bytes per parameter, the floor for a mixed-precision Adam step. """ * 4

SEQ, DIM, HEADS, LAYERS, MICRO_BATCH, LR = 64, 96, 4, 2, 8, 1e-2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        # no qkv bias: the key bias has an exactly-zero gradient (softmax ignores it), which Adam
        # would turn into lr-sized steps driven by rounding noise, differing between any two runs
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, vocab, bias=False)
        self.head.weight = self.tok.weight          # tied embedding / output head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def corpus() -> tuple[torch.Tensor, int]:
    chars = sorted(set(TEXT))
    return torch.tensor([chars.index(c) for c in TEXT]), len(chars)


def batch(data: torch.Tensor, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch at `step`: deterministic, so the reference can rebuild all of them."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    starts = torch.randint(0, len(data) - SEQ - 1, (MICRO_BATCH,), generator=g)
    x = torch.stack([data[s:s + SEQ] for s in starts])
    y = torch.stack([data[s + 1:s + SEQ + 1] for s in starts])
    return x, y


def new_model(vocab: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def reference_run(steps: int, nproc: int) -> tuple[list[torch.Tensor], list[float]]:
    """One process, torch.optim.AdamW, the union of every rank's micro-batch each step."""
    data, vocab = corpus()
    model = new_model(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for s in range(steps):
        xs, ys = zip(*(batch(data, s, r) for r in range(nproc)))
        opt.zero_grad()
        loss = loss_of(model, torch.cat(xs), torch.cat(ys))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def _progress(label: str, i: int, n: int) -> None:
    width = 30
    done = int(width * i / n)
    bar = f"  {label:<24} [{'#' * done}{'.' * (width - done)}] {i}/{n}"
    if sys.stdout.isatty():
        sys.stdout.write("\r" + bar + ("\n" if i == n else ""))
    elif i == n or i % max(1, n // 4) == 0:   # logs and pipes: a few lines, not a carriage-return smear
        sys.stdout.write(bar + "\n")
    sys.stdout.flush()


def _worker(rank: int, nproc: int, port: int, steps: int, stages: list[int], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc, timeout=datetime.timedelta(seconds=120))
    import zero_kernels as zk
    from zero_kernels.memory import model_state_bytes
    data, vocab = corpus()
    results = {}
    runs = [("DDP + torch AdamW(fused)", None)] + [(f"ZeRO-{s}", s) for s in stages]
    for label, stage in runs:
        model = new_model(vocab)
        if stage is None:
            net = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
        else:
            net = model
            opt = zk.ZeroAdamW(model, stage=stage, lr=LR, weight_decay=0.1)
        times, step_losses = [], []
        for s in range(steps):
            x, y = batch(data, s, rank)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_of(net, x, y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            step_losses.append(loss.item())
            if rank == 0:
                _progress(label, s + 1, steps)
        losses = torch.tensor(step_losses, dtype=torch.float64)
        dist.all_reduce(losses)            # mean over ranks = the loss of the whole batch, per step
        curve = (losses / nproc).tolist()
        row = {"loss": curve[-1], "curve": curve, "step_ms": statistics.median(times[2:] or times) * 1e3}
        if stage is None:
            row["params"] = [p.detach().clone() for p in model.parameters()]
        else:
            full = opt.full_model_state_dict()
            row["params"] = [full[n] for n, _ in model.named_parameters()]
            rep = opt.memory_report()
            pred = rep["predicted"]
            row["mem_measured"] = rep["total"]
            row["mem_formula"] = pred["total"] if pred else float("nan")
            per_rank = [torch.zeros((), dtype=torch.float64) for _ in range(nproc)]
            dist.all_gather(per_rank, torch.tensor(float(rep["total"]), dtype=torch.float64))
            row["mem_per_rank"] = [float(m) for m in per_rank]
        results[label] = row
        del net, opt, model       # DDP reducers and ZeRO hooks hold the group: release them first
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    gc.collect()
    dist.barrier()               # no rank closes its gloo pairs while a peer is still communicating
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fmt_bytes(n: float) -> str:
    return "-" if n is None or (isinstance(n, float) and math.isnan(n)) else f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zero_kernels.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="data-parallel processes (gloo, this machine)")
    ap.add_argument("--steps", type=int, default=50, help="training steps per run")
    ap.add_argument("--stage", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3],
                    help="ZeRO stages to run")
    ap.add_argument("--plot", default="zk_demo.png", metavar="PNG",
                    help="write the loss curves and per-rank memory here ('' to skip; needs matplotlib)")
    a = ap.parse_args(argv)
    if a.nproc < 1:
        ap.error("--nproc must be >= 1")
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    if a.plot and importlib.util.find_spec("matplotlib") is not None:   # without it: a note at the end
        why = plot_path_problem(a.plot)
        if why is not None:
            ap.error(f"--plot {a.plot}: {why}")
    t_start = time.perf_counter()
    _, vocab = corpus()
    psi = sum(p.numel() for p in new_model(vocab).parameters())
    print(f"TinyGPT: {LAYERS} blocks, width {DIM}, vocab {vocab}, {psi:,} parameters (embedding tied "
          f"to the head); {a.nproc} processes x micro-batch {MICRO_BATCH} x seq {SEQ}; {a.steps} steps")
    print("  reference: one process, torch.optim.AdamW on the whole batch ...")
    ref_params, ref_losses = reference_run(a.steps, a.nproc)
    ref_loss = ref_losses[-1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(a.nproc, _free_port(), a.steps, a.stage, out_dir),
                           nprocs=a.nproc, start_method="spawn")
        results = torch.load(os.path.join(out_dir, "results.pt"), weights_only=False)
    ddp_ms = results["DDP + torch AdamW(fused)"]["step_ms"]
    header = ["stage", "final loss", "max |Δparam| vs reference", "memory/rank measured",
              "formula", "step ms", "vs DDP"]
    rows = [["reference (1 proc, AdamW)", f"{ref_loss:.4f}", "0", "-", "-", "-", "-"]]
    for label, r in results.items():
        diff = max((p - q).abs().max().item() for p, q in zip(r["params"], ref_params))
        rows.append([label, f"{r['loss']:.4f}", f"{diff:.2e}", _fmt_bytes(r.get("mem_measured")),
                     _fmt_bytes(r.get("mem_formula")), f"{r['step_ms']:.1f}", f"{r['step_ms'] / ddp_ms:.2f}x"])
    w = [max(len(str(x[i])) for x in [header] + rows) for i in range(len(header))]
    print()
    print(" | ".join(h.ljust(w[i]) for i, h in enumerate(header)))
    print("-+-".join("-" * x for x in w))
    for r in rows:
        print(" | ".join(str(c).ljust(w[i]) for i, c in enumerate(r)))
    print(f"\nmemory: model states one rank holds after step() (params, grads, fp32 master, Adam m, v), "
          f"measured from its tensors; formula: zero_kernels.memory.model_state_bytes. "
          f"Total time {time.perf_counter() - t_start:.0f} s.")
    if a.plot:
        try:
            _plot(a.plot, results, ref_losses, a.nproc)
            print(f"wrote {a.plot} (loss curves by stage, memory per rank)")
        except ImportError:
            print(f"not writing {a.plot}: matplotlib is missing (pip install 'zero_kernels[plot]')")
    return 0


def _plot(path: str, results: dict, ref_losses: list[float], nproc: int) -> None:
    """Loss per step of every run beside the reference; each rank's model-state memory by stage."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg

    fig = Figure(figsize=(12, 4.6), dpi=110, layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    steps = range(1, len(ref_losses) + 1)
    ax1.plot(steps, ref_losses, color="black", lw=2.5, alpha=0.35, label="reference (1 process, AdamW)")
    for label, r in results.items():
        ax1.plot(steps, r["curve"], lw=1.2, ls="--" if label.startswith("DDP") else "-", label=label)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (whole batch)")
    ax1.set_title(f"Loss by stage, {nproc} processes: the curves lie on the reference")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8.5)
    zero = [(label, r) for label, r in results.items() if "mem_per_rank" in r]
    width = 0.8 / max(1, nproc)
    for k in range(nproc):
        xs = [i + (k - (nproc - 1) / 2) * width for i in range(len(zero))]
        ax2.bar(xs, [r["mem_per_rank"][k] / 2**20 for _, r in zero], width=width * 0.95, label=f"rank {k}")
    for i, (_, r) in enumerate(zero):
        ax2.plot([i - 0.45, i + 0.45], [r["mem_formula"] / 2**20] * 2, color="black", lw=1.5,
                 label="formula" if i == 0 else None)
    ax2.set_xticks(range(len(zero)), [label for label, _ in zero])
    ax2.set_ylabel("model states per rank (MiB)")
    ax2.set_title("Memory per rank, measured from its tensors")
    ax2.grid(True, axis="y", alpha=0.3)
    ax2.legend(fontsize=8.5)
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
