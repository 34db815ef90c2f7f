"""``python -m zero_kernels.plan``: how much memory per GPU, at which ZeRO stage, does a model need?

Examples::

    python -m zero_kernels.plan --params 7e9 --gpus 8
    python -m zero_kernels.plan --model gpt2-xl --gpus 16 --batch 32 --checkpointing
    python -m zero_kernels.plan --model --layers 96 --hidden 12288 --heads 96 --gpus 128 --tp 8 --pp 8
    python -m zero_kernels.plan --params 175B --gpus 64 --stage 3 --plot plan.png
    python -m zero_kernels.plan --model gpt2-xl --gpus 384 --gpus-per-node 8 --stage 3 --simulate

Prints per-rank bytes by category (bf16/fp16 params and grads, fp32 master, Adam m and v, the
ZeRO-3 gather buffer, activations) for DDP and ZeRO-1/2/3, whether each fits, and the largest
model that would. ``--plot`` draws the capacity chart (largest trainable model vs GPUs, 1-1024)
and the per-category stacked bars. The formulas live in :mod:`zero_kernels.memory` (also the
``predicted`` side of the ZeRO layer's ``memory_report()``); 1 GB = 1e9 bytes throughout.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Sequence

from . import memory as M
from ._cli import parse_args, until_reader_leaves
from . import simulate as S
from .plan_chart import capacity, capacity_series, fmt_params, nbytes_of, plot_memory, plot_path_problem

__all__ = ["main", "build_parser", "capacity_series", "MODEL_PRESETS"]

#: --model presets: GPT-2 XL (the ZeRO paper's 1.5B example) and GPT-3 175B.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "gpt2-xl": dict(layers=48, hidden=1600, heads=25, vocab=50257, seq=1024),
    "gpt3-175b": dict(layers=96, hidden=12288, heads=96, vocab=50257, seq=2048),
}
_CUSTOM = "custom"
_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_ROWS = [("params", "params"), ("grads", "grads"), ("master_params", "master params (fp32)"),
         ("exp_avg", "Adam m (exp_avg)"), ("exp_avg_sq", "Adam v (exp_avg_sq)")]


def _param_count(text: str) -> int:
    """'7e9', '7B', '1.5b', '350M', '1T' -> int."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if not m and text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"parameter count must be >= 1, got {text!r}")
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid parameter count {text!r}: use a number like 7e9, 7000000000, 7B or 350M")
    value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"parameter count must be >= 1, got {text!r}")
    if abs(value - round(value)) > 1e-9 * value:   # '1.5' parameters: a slip (1.5B meant?), not a count
        raise argparse.ArgumentTypeError(
            f"parameter count {text!r} is not a whole number of parameters ({value:g}); did you mean "
            f"{text.strip()}B or {text.strip()}M?")
    return int(round(value))


def _pos_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _pos_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _stage(text: str) -> str:
    if text.lower() == "all" or text in ("0", "1", "2", "3"):
        return text.lower()
    raise argparse.ArgumentTypeError(f"expected 0 (DDP), 1, 2, 3 or 'all', got {text!r}")


class _DefaultsFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter without "(default: None)" and without a second default where the
    help already states one."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in h or not action.option_strings:
            return h
        return h + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zero_kernels.plan",
        description="Per-GPU memory of mixed-precision Adam training under DDP and ZeRO-1/2/3 "
                    "(model states by category, ZeRO-3 gather buffer, activations), whether it "
                    "fits, and the largest model that would. 1 GB = 1e9 bytes.",
        formatter_class=_DefaultsFormatter)
    m = p.add_argument_group("model (one of --params / --model)")
    m.add_argument("--params", type=_param_count, metavar="N",
                   help="number of parameters Ψ: 7e9, 7B, 350M ...")
    m.add_argument("--model", nargs="?", const=_CUSTOM, metavar="PRESET",
                   help="count Ψ of a GPT-style model from --layers/--hidden/--vocab (and --seq for "
                        f"learned positions); PRESET fills them in: {', '.join(MODEL_PRESETS)}")
    m.add_argument("--layers", type=_pos_int, help="transformer layers")
    m.add_argument("--hidden", type=_pos_int, help="model width h")
    m.add_argument("--heads", type=_pos_int, help="attention heads (must divide --hidden)")
    m.add_argument("--vocab", type=_pos_int, help="vocabulary size (--model default 50257)")
    h = p.add_argument_group("hardware and parallelism")
    h.add_argument("--gpus", type=_pos_int, default=8, help="total GPUs")
    h.add_argument("--gpu-mem", type=_pos_float, default=80.0, metavar="GB",
                   help="memory per GPU in GB (1e9 bytes)")
    h.add_argument("--tp", type=_pos_int, default=1, help="tensor-parallel degree")
    h.add_argument("--pp", type=_pos_int, default=1, help="pipeline-parallel degree")
    h.add_argument("--stage", type=_stage, default="all", help="0 (DDP), 1, 2, 3 or all")
    h.add_argument("--param-dtype", choices=sorted(M.DTYPE_BYTES), default="bf16",
                   help="bf16/fp16: 16-bit params and grads + fp32 master, m, v (16 B/param); "
                        "fp32: fp32 params and grads, no separate master (16 B/param)")
    h.add_argument("--states", choices=sorted(M.STATE_FORMATS), default="fp32",
                   help="Adam moment format: fp32 (K = 12), bf16 (K = 8), 8bit (blockwise, K ~ 6)")
    h.add_argument("--remainders", action="store_true",
                   help="bf16 params only: the fp32 master kept as bf16 param + int16 remainder (K - 2)")
    h.add_argument("--reduce-dtype", choices=sorted(M.DTYPE_BYTES), default="fp32",
                   help="dtype of the stage-2/3 gradient shards (ZeroAdamW's reduce_dtype, default fp32: "
                        "2Ψ + 16Ψ/Nd at stage 2 with bf16 params; bf16 gives the paper's 2Ψ + 14Ψ/Nd)")
    h.add_argument("--reserve", type=float, default=M.DEFAULT_RESERVE, metavar="FRACTION",
                   help="fraction of each GPU kept for activations when --batch is not given, "
                        "and in the capacity chart")
    a = p.add_argument_group("activations (modelled when --batch is given)")
    a.add_argument("--batch", type=_pos_int, help="sequences per GPU per micro-batch")
    a.add_argument("--seq", type=_pos_int, help="sequence length (also counts learned positions)")
    a.add_argument("--checkpointing", nargs="?", const="sqrt", choices=["sqrt", "layer"],
                   help="activation checkpointing: sqrt (default when given; √n checkpoints) or "
                        "layer (one checkpoint per transformer layer)")
    a.add_argument("--attn-scores", action="store_true",
                   help="also count materialized heads·seq² attention scores (no flash "
                        "attention); needs --heads")
    S.add_arguments(p, _pos_int, _pos_float)
    p.add_argument("--plot", metavar="FILE.png",
                   help="write the capacity chart and the per-category bar chart to this image "
                        "(with --simulate also the scaling chart, to FILE-scaling.png)")
    return p


def _resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """Validate the flags together; return the derived configuration. parser.error() on bad input."""
    err = parser.error
    if args.remainders and args.param_dtype != "bf16":
        err(f"--remainders needs --param-dtype bf16 (got {args.param_dtype}): the fp32 master is kept as the "
            "bf16 parameter plus an int16 remainder")
    if (args.params is None) == (args.model is None):
        err("give exactly one of --params N (e.g. --params 7e9) or --model "
            f"[{'|'.join(MODEL_PRESETS)}] with --layers/--hidden/--vocab")
    shape = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                 seq=args.seq)
    if args.model not in (None, _CUSTOM):
        if args.model not in MODEL_PRESETS:
            err(f"unknown --model preset {args.model!r}; choose one of {', '.join(MODEL_PRESETS)} "
                "or give --model alone with --layers/--hidden/--vocab")
        shape = {k: (v if v is not None else MODEL_PRESETS[args.model][k]) for k, v in shape.items()}
    if shape["heads"] is not None and shape["hidden"] is not None and shape["hidden"] % shape["heads"]:
        err(f"--hidden {shape['hidden']} is not divisible by --heads {shape['heads']}")
    if args.model is not None:
        missing = [f"--{k}" for k in ("layers", "hidden") if shape[k] is None]
        if missing:
            err(f"--model needs {' and '.join(missing)} (or a preset: --model gpt2-xl)")
        vocab = shape["vocab"] if shape["vocab"] is not None else 50257
        psi = M.count_params(shape["layers"], shape["hidden"], vocab, seq=shape["seq"],
                             heads=shape["heads"])
    else:
        psi = args.params
    if args.gpus % (args.tp * args.pp):
        k = args.tp * args.pp
        lo, hi = max(k, args.gpus // k * k), (args.gpus // k + 1) * k
        near = f"{lo} or {hi}" if lo != hi and lo < args.gpus else f"{hi}"
        err(f"--gpus {args.gpus} is not divisible by --tp {args.tp} x --pp {args.pp} = {k}: "
            f"DP = gpus / (TP x PP) must be whole; use --gpus {near}, or lower --tp/--pp")
    if not 0 <= args.reserve < 1:
        err(f"--reserve must be a fraction in [0, 1), got {args.reserve}")
    act = None
    if args.batch is not None:
        missing = [f"--{k}" for k in ("seq", "hidden", "layers") if shape[k] is None]
        if missing:
            err(f"activations (--batch) also need {', '.join(missing)} "
                "(or --model gpt2-xl / gpt3-175b)")
        if args.attn_scores and shape["heads"] is None:
            err("--attn-scores needs --heads")
        act = M.activation_bytes(args.batch, shape["seq"], shape["hidden"], shape["layers"],
                                 bytes_per=nbytes_of(args)["param_bytes"],
                                 checkpointing=args.checkpointing or False,
                                 heads=shape["heads"] if args.attn_scores else None)
    elif args.checkpointing or args.attn_scores:
        err(f"{'--checkpointing' if args.checkpointing else '--attn-scores'} only affects "
            "activations: add --batch (and --seq/--hidden/--layers or a --model preset)")
    if args.plot:
        why = plot_path_problem(args.plot)
        if why is not None:
            err(f"--plot {args.plot}: {why}")
    if not args.simulate:
        given = [f"--{d.replace('_', '-')}" for d in S.OPTION_DESTS if getattr(args, d) != parser.get_default(d)]
        if given:
            err(f"{', '.join(given)} only affect{'s' if len(given) == 1 else ''} the step-time model: add "
                "--simulate (or leave them out)")
    if args.simulate:
        if args.tp * args.pp != 1:
            err("--simulate models data parallelism only: leave --tp and --pp at 1")
        if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
            err(f"--simulate: --gpus {args.gpus} is not a whole number of nodes of --gpus-per-node "
                f"{args.gpus_per_node}")
        if args.shard_size is not None and args.gpus % args.shard_size:
            err(f"--simulate: --shard-size {args.shard_size} must divide --gpus {args.gpus} (a (replicate, shard) "
                f"mesh of shape ({args.gpus} / S, S))")
    stages = [0, 1, 2, 3] if args.stage == "all" else [int(args.stage)]
    return dict(psi=psi, shape=shape, activations=act, stages=stages,
                dp=args.gpus // (args.tp * args.pp), gpu_mem=args.gpu_mem * M.GB)


def _plans(args, cfg) -> list[M.PlanResult]:
    return [M.plan(cfg["psi"], args.gpus, s, gpu_mem_bytes=cfg["gpu_mem"], tp=args.tp, pp=args.pp,
                   param_dtype=args.param_dtype, activations=cfg["activations"],
                   states=args.states, remainders=args.remainders, reduce_dtype=args.reduce_dtype,
                   hidden=cfg["shape"]["hidden"], reserve=args.reserve) for s in cfg["stages"]]


def _report(args, cfg, plans: list[M.PlanResult]) -> str:
    nb = nbytes_of(args)
    p16 = args.param_dtype
    master = "bf16 + int16 remainder master" if args.remainders else "fp32 master"
    prec = (f"{p16} params and grads, {master} + {args.states} Adam m, v" if nb["master_bytes"]
            else f"fp32 params (= master) and grads + {args.states} Adam m, v")
    k = nb["master_bytes"] + nb["optim_bytes"]
    lines = [f"Ψ = {cfg['psi']:,} parameters ({fmt_params(cfg['psi'])}); {prec}: "
             f"{M.bytes_per_param(nb):g} bytes/param (optimizer states K = {k:.3g}), "
             f"{M.bytes_per_param(nb) * cfg['psi'] / M.GB:,.1f} GB of model states in all; stage-2/3 "
             f"gradient shards in {args.reduce_dtype} (--reduce-dtype)"]
    shape = cfg["shape"]
    if args.model is not None:
        lines.append(f"  counted from {args.model if args.model != _CUSTOM else 'a GPT'} shape: "
                     f"{shape['layers']} layers, hidden {shape['hidden']}, vocab "
                     f"{shape['vocab'] or 50257}" + (f", seq {shape['seq']}" if shape['seq'] else ""))
    lines.append(f"{args.gpus} GPU(s) x {args.gpu_mem:g} GB = DP {cfg['dp']} x TP {args.tp} x "
                 f"PP {args.pp}; each rank holds Ψ/(TP·PP) = {fmt_params(cfg['psi'] / (args.tp * args.pp))}"
                 f" parameters; ZeRO shards over DP = {cfg['dp']}")
    if cfg["dp"] == 1:
        lines.append("  DP = 1: nothing for ZeRO to shard, every stage equals DDP")
    if cfg["activations"] is None:
        lines.append(f"activations: not modelled (add --batch); {args.reserve:.0%} of each GPU is "
                     f"kept for them, so the budget is {plans[0].budget / M.GB:.1f} GB")
    else:
        ck = args.checkpointing or "none"
        lines.append(f"activations: batch {args.batch} x seq {shape['seq']} x hidden "
                     f"{shape['hidden']} x {shape['layers']} layers, checkpointing {ck}"
                     + (", attention scores counted" if args.attn_scores else "")
                     + f": {cfg['activations'] / M.GB:.2f} GB per replica"
                     + (f", / TP {args.tp} per rank" if args.tp > 1 else "")
                     + f"; budget = the whole {args.gpu_mem:g} GB")
    lines.append("")
    w0, w = 28, 11
    header = "per-GPU memory, GB".ljust(w0) + "".join(p.name.rjust(w) for p in plans)
    lines += [header, "-" * len(header)]
    work = p16 if nb["master_bytes"] else "fp32"
    dt = {"params": work, "grads": work if args.reduce_dtype == work else f"{work}; {args.reduce_dtype} at 2-3"}

    def row(label, vals):
        lines.append(label.ljust(w0) + "".join(v.rjust(w) for v in vals))

    for key, label in _ROWS:
        if key == "master_params" and not nb["master_bytes"]:
            continue
        label = f"{label} ({dt[key]})" if key in dt else label
        if key == "master_params" and args.remainders:
            label = "master remainders (int16)"
        row(label, [f"{getattr(p, key) / M.GB:,.2f}" for p in plans])
    row("= model states", [f"{p.model_states / M.GB:,.2f}" for p in plans])
    row("gather buffer (ZeRO-3)", [f"{p.gather_buffer / M.GB:,.2f}" for p in plans])
    row("activations", [f"{p.activations / M.GB:,.2f}" if p.activations_modelled else "-"
                        for p in plans])
    lines.append("-" * len(header))
    row("total", [f"{p.total / M.GB:,.2f}" for p in plans])
    row("budget", [f"{p.budget / M.GB:,.2f}" for p in plans])
    row("fits", ["yes" if p.fits else "NO" for p in plans])
    caps = [capacity(args.gpus, p.stage, args, cfg, cfg["activations"]) for p in plans]
    row(f"largest model on {args.gpus} GPU(s)", [fmt_params(c) if c else "none" for c in caps])
    lines.append("")
    fitting = [p for p in plans if p.fits]
    if fitting:
        lines.append(f"fits with: {', '.join(p.name for p in fitting)} "
                     f"(least sharding that fits: {fitting[0].name})")
    else:
        lines.append("fits with: none of these; add GPUs, raise --tp/--pp, lower --batch, "
                     "or use --checkpointing")
    lines.append("formulas: zero_kernels/memory.py (ZeRO paper, Rajbhandari et al. SC'20); "
                 "the ZeRO-3 gather buffer is the unsharded current block (params + grads) and the "
                 "prefetched next block")
    return "\n".join(lines)


def scaling_path(plot: str) -> str:
    stem, ext = os.path.splitext(plot)
    return f"{stem}-scaling{ext}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner; returns the exit status (0 ok, 2 bad input) instead of exiting."""
    parser = build_parser()
    try:
        args = parse_args(parser, argv)
        cfg = _resolve(args, parser)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), message already printed
        return e.code if isinstance(e.code, int) else 2
    return until_reader_leaves(lambda: _run(parser, args, cfg))     # `plan ... | head`


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict) -> int:
    plans = _plans(args, cfg)
    print(_report(args, cfg, plans))
    if args.simulate:
        print()
        print(S.report(cfg["psi"], args))
    if args.plot:
        try:
            plot_memory(args.plot, args, cfg, plans)
            if args.simulate:
                S.plot(scaling_path(args.plot), cfg["psi"], args)
        except ValueError as e:  # e.g. an image format matplotlib does not know
            print(f"{parser.prog}: error: --plot {args.plot}: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}" + (f" and {scaling_path(args.plot)}" if args.simulate else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
