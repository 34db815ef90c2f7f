"""The planner's numbers shared by its table and its charts (one activation model for both), and the
memory chart of ``python -m zero_kernels.plan --plot`` (capacity against GPUs, per-category bars)."""
from __future__ import annotations

import os

from . import memory as M

__all__ = ["fmt_params", "nbytes_of", "capacity", "capacity_series", "plot_memory", "plot_path_problem"]


def plot_path_problem(path: str) -> str | None:
    """Why a chart cannot be written to ``path`` (checked before any work: the planner's and the demo's
    ``--plot``), or None: its folder must exist, matplotlib be installed, the extension an image format."""
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        return f"directory {d} does not exist"
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return ("drawing needs matplotlib, which is not installed: pip install 'zero_kernels[plot]' (or pip install "
                "matplotlib), or leave out --plot")
    if os.path.splitext(path)[1].lstrip(".").lower() not in FigureCanvasBase.get_supported_filetypes():
        return "use an image file name ending in .png (or .svg, .pdf)"
    return None


def fmt_params(n: float) -> str:
    for div, s in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{s}" if n / div < 100 else f"{n / div:.0f}{s}"
    return f"{n:.0f}"


def nbytes_of(args, states: str | None = None, remainders: bool | None = None) -> dict[str, float]:
    return M.dtype_bytes(args.param_dtype, args.states if states is None else states,
                         args.remainders if remainders is None else remainders, args.reduce_dtype)


def capacity(gpus: int, stage: int, args, cfg, activations: float | None, nb: dict | None = None) -> int:
    nb = nbytes_of(args) if nb is None else nb
    if activations is None:
        reserve, extra = args.reserve, 0.0
    else:
        reserve, extra = 0.0, activations / args.tp
    # hidden=None: the largest model is not this model, so its block size is estimated from its Ψ.
    return M.max_trainable_params(gpus, cfg["gpu_mem"], stage, tp=args.tp, pp=args.pp,
                                  reserve=reserve, extra_bytes=extra, **nb)


def capacity_series(args, cfg) -> dict[int, list[tuple[int, int]]]:
    """{stage: [(gpus, largest trainable Ψ)]} for the capacity chart: the same memory model as the
    table's "largest model" row (activations of --batch when given, else the --reserve fraction)."""
    k = args.tp * args.pp
    xs = sorted({g for g in (2 ** i for i in range(11)) if g % k == 0} | {args.gpus})
    return {s: [(g, capacity(g, s, args, cfg, cfg["activations"])) for g in xs] for s in range(4)}


def plot_memory(path: str, args, cfg, plans: list[M.PlanResult]) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend, renders with Agg
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(13, 5.2), dpi=110, layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[1.15, 1])
    k = args.tp * args.pp
    series = capacity_series(args, cfg)
    xs = [g for g, _ in series[0]]
    colors = {0: "#7f7f7f", 1: "#1f77b4", 2: "#2ca02c", 3: "#d62728"}
    for s in range(4):
        ys = [c / 1e9 for _, c in series[s]]
        ax1.plot(xs, ys, marker="o", ms=3.5, color=colors[s], label=M.STAGE_NAMES[s])
    for fmt, rem, ls in (("fp32", False, (0, (1, 1))), ("bf16", False, (0, (4, 2))), ("8bit", False, (0, (6, 2, 1, 2))),
                         ("8bit", True, (0, (2, 2, 2, 2, 6, 2)))):
        if (fmt, rem) == (args.states, args.remainders) or (rem and args.param_dtype != "bf16"):
            continue
        nb = nbytes_of(args, fmt, rem)
        ys = [capacity(g, 3, args, cfg, cfg["activations"], nb) / 1e9 for g in xs]
        ax1.plot(xs, ys, color=colors[3], ls=ls, lw=1, alpha=0.8,
                 label=f"ZeRO-3, K = {nb['master_bytes'] + nb['optim_bytes']:.3g} ({fmt} m, v{' + remainders' if rem else ''})")
    asked = [c / 1e9 for s in range(4) for g, c in series[s] if g == args.gpus]
    ax1.plot([args.gpus] * 4, asked, marker="D", ms=7, ls="none", mfc="none", mec="black",
             label=f"requested: {args.gpus} GPU(s), as in the table")
    ref = cfg["activations"] is None and args.states == "fp32" and not args.remainders and args.gpu_mem == 80 and args.tp == 1 and args.pp == 1 and args.param_dtype != "fp32"
    if ref:
        ax1.plot([64], [175], marker="*", ms=13, color="black", ls="none",
                 label="reference: DDP ≈3.5B flat, ZeRO-3 ≈175B @ 64")
        ax1.plot([1, 1024], [3.5, 3.5], ls=":", color="black", lw=1)
    ax1.axhline(cfg["psi"] / 1e9, color="#9467bd", ls="--", lw=1.2,
                label=f"this model: {fmt_params(cfg['psi'])}")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xticks(xs, [str(x) for x in xs])
    ax1.set_xlabel("GPUs" + (f" (TP {args.tp} x PP {args.pp}; DP = GPUs / {k})" if k > 1 else ""))
    ax1.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_params(v * 1e9)))
    ax1.yaxis.set_minor_formatter(NullFormatter())
    ax1.set_ylabel("largest trainable model (parameters)")
    act = (f"{args.reserve:.0%} kept for activations" if cfg["activations"] is None
           else f"activations of batch {args.batch} ({cfg['activations'] / M.GB:.1f} GB)")
    k = nbytes_of(args)
    ax1.set_title(f"Capacity: {args.gpu_mem:g} GB GPUs, {args.param_dtype}, K = "
                  f"{k['master_bytes'] + k['optim_bytes']:.3g}, {act}", fontsize=10)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(loc="upper left", fontsize=8.5)

    cats = [("params", "params"), ("grads", "grads"),
            ("master_params", "int16 master remainder" if args.remainders else "fp32 master"),
            ("exp_avg", "Adam m"), ("exp_avg_sq", "Adam v"),
            ("gather_buffer", "ZeRO-3 gather buffer"), ("activations", "activations")]
    ccol = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22"]
    names = [p.name for p in plans]
    bottom = [0.0] * len(plans)
    for (key, label), c in zip(cats, ccol):
        vals = [p.categories()[key] / M.GB for p in plans]
        if not any(vals):
            continue
        ax2.bar(names, vals, bottom=bottom, color=c, label=label, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, p in enumerate(plans):
        ax2.text(i, p.total / M.GB, f"{p.total / M.GB:,.1f} GB\n{'fits' if p.fits else 'does not fit'}",
                 ha="center", va="bottom", fontsize=8.5)
    ax2.axhline(args.gpu_mem, color="black", lw=1.2, label=f"GPU memory ({args.gpu_mem:g} GB)")
    if plans[0].budget < plans[0].gpu_mem:
        ax2.axhline(plans[0].budget / M.GB, color="black", ls="--", lw=1,
                    label=f"budget ({plans[0].budget / M.GB:.0f} GB)")
    ax2.set_ylim(0, max(max(bottom), args.gpu_mem) * 1.18)
    ax2.set_ylabel("GB per GPU")
    ax2.set_title(f"{fmt_params(cfg['psi'])} params on {args.gpus} GPU(s) "
                  f"(DP {cfg['dp']}, TP {args.tp}, PP {args.pp})")
    ax2.legend(loc="upper right", fontsize=8.5)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.savefig(path)
