"""``python -m zero_kernels.plan --simulate``: the step-time model's table and scaling chart.

The model itself is :mod:`zero_kernels.step_time`; this module only chooses the configurations to
compare, formats them, and draws tokens/s against the number of GPUs.
"""
from __future__ import annotations

import argparse

from .step_time import Cluster, Options, StepEstimate, estimate, paper_volume

__all__ = ["add_arguments", "configurations", "simulate", "report", "plot"]


OPTION_DESTS = ("gpus_per_node", "intra_bw", "inter_bw", "tflops", "shard_size", "tokens")   # only --simulate reads


def add_arguments(p: argparse.ArgumentParser, pos_int, pos_float) -> None:
    s = p.add_argument_group("step-time model (--simulate)")
    s.add_argument("--simulate", action="store_true",
                   help="print communication volume per link class, step time and tokens/s per configuration")
    s.add_argument("--gpus-per-node", type=pos_int, default=8, help="GPUs per node")
    s.add_argument("--intra-bw", type=pos_float, default=300.0, metavar="GB/s",
                   help="per-GPU bandwidth inside a node (NVLink)")
    s.add_argument("--inter-bw", type=pos_float, default=25.0, metavar="GB/s",
                   help="per-GPU bandwidth across nodes (InfiniBand: 200 Gb/s = 25 GB/s)")
    s.add_argument("--tflops", type=pos_float, default=150.0, help="achieved TFLOP/s per GPU")
    s.add_argument("--shard-size", type=pos_int, metavar="S",
                   help="hybrid sharding: ranks per shard group, the S of a (replicate, shard) = (R, S) mesh "
                        "(default: --gpus-per-node)")
    s.add_argument("--tokens", type=pos_int, metavar="N",
                   help="tokens per GPU per step (default: --batch x --seq, else 4096)")


def configurations(args) -> list[Options]:
    ck = bool(getattr(args, "checkpointing", None))
    opts = [Options(0, checkpointing=ck), Options(1, checkpointing=ck), Options(2, checkpointing=ck),
            Options(3, checkpointing=ck)]
    if args.gpus > args.gpus_per_node:   # the multi-node options only matter across nodes
        shard = getattr(args, "shard_size", None)
        opts += [Options(2, hybrid=True, shard_size=shard, checkpointing=ck),
                 Options(3, hybrid=True, shard_size=shard, checkpointing=ck), Options(3, hpz=True, checkpointing=ck),
                 Options(3, quantize_weights=True, checkpointing=ck),
                 Options(3, quantize_grads=True, checkpointing=ck),
                 Options(3, hpz=True, quantize_weights=True, quantize_grads=True, checkpointing=ck)]
    return opts


def _cluster(args, gpus: int) -> Cluster:
    return Cluster(gpus=gpus, gpus_per_node=args.gpus_per_node, intra_gbps=args.intra_bw,
                   inter_gbps=args.inter_bw, tflops=args.tflops)


def _tokens(args) -> int:
    if args.tokens:
        return args.tokens
    if args.batch and args.seq:
        return args.batch * args.seq
    return 4096


def simulate(psi: float, args, gpus: int | None = None) -> list[StepEstimate]:
    cluster = _cluster(args, gpus or args.gpus)
    return [estimate(psi, _tokens(args), cluster, o) for o in configurations(args)]


def report(psi: float, args) -> str:
    rows = simulate(psi, args)
    base = next(r for r in rows if r.options.stage == 3 and r.options.name == "ZeRO-3")
    cl = _cluster(args, args.gpus)
    lines = [f"step-time model: {cl.gpus} GPU(s), {cl.nodes} node(s) x {cl.node_size}, intra {cl.intra_gbps:g} GB/s, "
             f"inter {cl.inter_gbps:g} GB/s per GPU, {cl.tflops:g} TFLOP/s, {_tokens(args)} tokens/GPU/step",
             ""]
    hdr = (f"{'configuration':<34}{'paper vol':>10}{'intra GB':>10}{'inter GB':>10}{'compute ms':>12}"
           f"{'exposed ms':>12}{'step ms':>10}{'tokens/s':>12}{'vs ZeRO-3':>11}")
    lines += [hdr, "-" * len(hdr)]
    for r in rows:
        try:
            vol = f"{paper_volume(r.options):g}Ψ"
        except ValueError:
            vol = "-"
        lines.append(f"{r.options.name:<34}{vol:>10}{r.bytes_by_link['intra'] / 1e9:>10.2f}"
                     f"{r.bytes_by_link['inter'] / 1e9:>10.2f}{r.compute_s * 1e3:>12.1f}{r.exposed_s * 1e3:>12.1f}"
                     f"{r.step_s * 1e3:>10.1f}{r.tokens_per_s:>12,.0f}{r.tokens_per_s / base.tokens_per_s:>10.2f}x")
    lines.append("GB: bytes one GPU sends per step by link class; model and sources: zero_kernels/step_time.py")
    return "\n".join(lines)


def plot(path: str, psi: float, args) -> None:
    """tokens/s per GPU against GPUs (one node up to 1024 GPUs) for each configuration."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg

    fig = Figure(figsize=(8.5, 5.2), dpi=110, layout="constrained")
    ax = fig.subplots()
    xs = sorted({args.gpus_per_node * 2 ** i for i in range(0, 12) if args.gpus_per_node * 2 ** i <= 1024}
                | {args.gpus})
    wide = argparse.Namespace(**{**vars(args), "gpus": max(xs)})   # every configuration, multi-node ones too
    for o in configurations(wide):
        ys = [estimate(psi, _tokens(args), _cluster(args, g), o).tokens_per_s / g for g in xs]
        ax.plot(xs, ys, marker="o", ms=3, label=o.name)
    ax.axvline(args.gpus, color="black", ls=":", lw=1, label=f"requested: {args.gpus} GPUs")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"GPUs ({args.gpus_per_node} per node)")
    ax.set_ylabel("tokens / s per GPU (flat = linear scaling)")
    ax.set_title(f"Step-time model: {psi / 1e9:.3g}B params, inter-node {args.inter_bw:g} GB/s per GPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.savefig(path)
