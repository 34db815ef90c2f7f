"""Speed and memory of low-precision Adam states on CPU (issue 11.5): zero_kernels' state formats beside
bitsandbytes' and torchao's 8-bit AdamW and torch's fused AdamW, in one process, one run.

    python bench/bench_states.py --setup            # pip install the pinned anchors (below), then exit
    python bench/bench_states.py                    # N = 32M, 2 threads, 9 interleaved rounds, medians
    python bench/bench_states.py --n 1000000 --rounds 5 --warmup 1     # small mode (the smoke test)
    python bench/bench_states.py --backend reference    # the coded rows on the pure-torch definition

Anchors are installed by ``--setup`` only, never as package dependencies:
``pip install bitsandbytes==0.50.2 torchao==0.18.0`` (the versions measured in the README). A row whose
implementation cannot run here (anchor not installed, or the C++ extension unavailable)
prints the reason in place of its numbers.

Workload: one flat parameter of N elements, bf16 gradient in, bf16 parameter out (the mixed-precision
step of ZeRO training), AdamW(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01). Rows:

  zk fp32 states           zk.FusedAdamW on the bf16 parameter: fp32 master + fp32 m, v (the baseline)
  zk bf16 moments          exp_avg_dtype = exp_avg_sq_dtype = bf16 (stochastic rounding), fp32 master
  zk 8-bit moments         uint8 blockwise codes + one fp32 scale per 256, fp32 master
  zk 8-bit + remainders    8-bit moments, store_param_remainders=True (bf16 param + int16 remainder)
  torch fused, fp32 master the torch pipeline: grad.float() into the master's fp32 grad buffer,
                           torch.optim.AdamW(fused=True) on the fp32 master, bf16 copy out
  torch fused, bf16 params torch.optim.AdamW(fused=True) on the bf16 parameter itself: torch keeps bf16
                           m, v and no master (updates below half a bf16 ulp are lost)
  bnb / torchao 8-bit, fp32 master     the same pipeline as torch's with AdamW8bit on the fp32 master
                                       (the state of zk 8-bit moments: 8-bit m, v + fp32 master)
  bnb / torchao 8-bit, bf16 params     AdamW8bit on the bf16 parameter itself (their usual use; no master)

Columns: B/elem is the traffic of the step's arrays, each read and written once, written beside the row
(g grad, p master or parameter, m/v moments, s blockwise scales: 2 x 4 B per 256 elements per moment);
it is the floor of what the implementation moves, not a count of its temporaries. GB/s = B/elem x N /
median time. "x fp32" is the median over rounds of (zk fp32 states' time / the row's time) in the same
round (> 1: faster). State B/param is MEASURED: the bytes of the optimizer's own state tensors after a
step (opt.state, codes + scales of torchao's subclass tensors, bnb's qmaps) plus the fp32 master where
the pipeline keeps one, over N. Step counters are not counted, nor the pipeline's fp32 grad buffer (another
4 B/param it needs that the one-pass zk step does not). N is rounded up to a multiple of 256: torchao keeps
plain bf16/fp32 states for a tensor whose size is not a multiple of its 256-element block.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import nonnegative_int, positive_int  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _harness import loadavg, ratio  # noqa: E402

ANCHORS = ("bitsandbytes==0.50.2", "torchao==0.18.0")
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
BF, U8 = torch.bfloat16, torch.uint8
SCALES = 2 * 2 * 4 / 256          # m and v: one fp32 scale per 256 elements, read and written


class Row:
    """One implementation: ``step`` (None when it cannot run, ``why`` says why), bytes per element moved,
    the formula, and the state tensors whose bytes are measured."""

    def __init__(self, name: str, bpe: float, formula: str, build: Callable[[int], tuple]):
        self.name, self.bpe, self.formula, self.build = name, bpe, formula, build
        self.step = self.why = None
        self.state_bytes = float("nan")


def _tensors(obj) -> list[torch.Tensor]:
    """Every plain tensor inside ``obj`` (a tensor subclass' inner tensors: torchao's codes, scale, qmap)."""
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return [t for k in names for t in _tensors(getattr(obj, k))]
        return [obj]
    return []


def state_nbytes(opt: torch.optim.Optimizer, extra: tuple = ()) -> int:
    """Bytes of every state tensor of ``opt`` except step counters, plus ``extra`` (a pipeline's master)."""
    total = sum(t.numel() * t.element_size() for t in extra)
    for st in opt.state.values():
        total += sum(t.numel() * t.element_size() for k, v in st.items() if k != "step" for t in _tensors(v))
    return total


def _bf16_param(n: int) -> nn.Parameter:
    g = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(n, generator=g).to(BF))
    p.grad = (torch.randn(n, generator=g) * 1e-2).to(BF)
    return p


START_STEP = 0   # --step: every row's step counters are set to it after its first step (0: left as they are)


def _start_at(opt: torch.optim.Optimizer) -> None:
    """The step counters of ``opt``'s states set to START_STEP (a run resumed mid-training: the bias corrections
    near 1; past beta2^t < 2^-24 the C++ coded steps multiply instead of dividing by bc2, [Note: a power-of-two
    bias correction divides by multiplying] in csrc/cpu_adam_coded_simd.h)."""
    if not START_STEP:
        return
    for st in opt.state.values():
        if isinstance(st.get("step"), torch.Tensor):
            st["step"].fill_(START_STEP)
        elif "step" in st:
            st["step"] = START_STEP


def zk_row(fmt: dict, backend: str):
    def build(n):
        import zero_kernels as zk
        p = _bf16_param(n)
        opt = zk.FusedAdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend=backend, **fmt)
        opt.step()                       # creates the state (and raises if the backend cannot run it)
        _start_at(opt)
        return opt.step, state_nbytes(opt)
    return build


def pipeline_row(make_opt: Callable):
    """fp32 master with an fp32 grad buffer: cast the bf16 grad in, step the master, cast the bf16 param out."""
    def build(n):
        p16 = _bf16_param(n)
        master = nn.Parameter(p16.detach().float())
        master.grad = torch.empty(n)
        opt = make_opt([master])

        def step():
            master.grad.copy_(p16.grad)
            opt.step()
            with torch.no_grad():
                p16.copy_(master)
        step()
        _start_at(opt)
        return step, state_nbytes(opt, extra=(master,))
    return build


def direct_row(make_opt: Callable):
    """The optimizer on the bf16 parameter itself (no master)."""
    def build(n):
        p = _bf16_param(n)
        opt = make_opt([p])
        opt.step()
        _start_at(opt)
        return opt.step, state_nbytes(opt)
    return build


def torch_fused(ps):
    return torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)


def bnb_8bit(ps):
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def ao_8bit(ps):
    import torchao.optim
    return torchao.optim.AdamW8bit(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def rows(backend: str) -> list[Row]:
    zk_fmt = {"zk fp32 states": ({}, 28, "g 2 + p 4+4 + m 4+4 + v 4+4 + p16 2"),
              "zk bf16 moments": (dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF), 20, "g 2 + p 8 + m 2+2 + v 2+2 + p16 2"),
              "zk 8-bit moments": (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8), 16 + SCALES,
                                   "g 2 + p 8 + m 1+1 + v 1+1 + s + p16 2"),
              "zk 8-bit + remainders": (dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=True),
                                        14 + SCALES, "g 2 + p16 2+2 + rem 2+2 + m 1+1 + v 1+1 + s")}
    out = [Row(f"{k} ({backend})", bpe, f, zk_row(fmt, backend)) for k, (fmt, bpe, f) in zk_fmt.items()]
    pipe = "cast g 2+4 + g 4 + p 8 + m {m} + v {m} + p16 4+2{s}"
    out += [Row("torch fused, fp32 master", 40, pipe.format(m="4+4", s=""), pipeline_row(torch_fused)),
            Row("torch fused, bf16 params (bf16 m, v)", 14, "g 2 + p16 2+2 + m 2+2 + v 2+2", direct_row(torch_fused))]
    for name, make in (("bnb AdamW8bit", bnb_8bit), ("torchao AdamW8bit", ao_8bit)):
        out += [Row(f"{name}, fp32 master", 28 + SCALES, pipe.format(m="1+1", s=" + s"), pipeline_row(make)),
                Row(f"{name}, bf16 params", 10 + SCALES, "g 2 + p16 2+2 + m 1+1 + v 1+1 + s", direct_row(make))]
    return out


def setup() -> int:
    cmd = [sys.executable, "-m", "pip", "install", *ANCHORS]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def measure(rs: list[Row], rounds: int, warmup: int) -> dict[str, list[float]]:
    live = [r for r in rs if r.step is not None]
    for _ in range(warmup):
        for r in live:
            r.step()
    times = {r.name: [] for r in live}
    for _ in range(rounds):
        for r in live:                   # interleaved: drift in the machine's load hits every row alike
            t = time.perf_counter()
            r.step()
            times[r.name].append(time.perf_counter() - t)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=positive_int, default=32 * 1024 * 1024)
    ap.add_argument("--rounds", type=positive_int, default=9, help="interleaved timed rounds (medians)")
    ap.add_argument("--warmup", type=nonnegative_int, default=2)
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "reference", "triton"],
                    help="zero_kernels backend of the zk rows (the product on CPU is 'cpu')")
    ap.add_argument("--step", type=nonnegative_int, default=0,
                    help="time the steps after this one (every row's step counters set to it after its first step; "
                         "0: from step 2 on, a run's start)")
    ap.add_argument("--setup", action="store_true", help="pip install the pinned anchors and exit")
    ap.add_argument("--only", default=None, help="comma-separated substrings: run only matching rows "
                    "(the zk fp32 states baseline always runs)")
    args = ap.parse_args(argv)
    if args.setup:
        sys.exit(setup())
    torch.set_num_threads(args.threads)
    global START_STEP
    START_STEP = args.step
    n = -(-args.n // 256) * 256
    versions = [f"torch {torch.__version__}"]
    for mod in ("bitsandbytes", "torchao"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except Exception as e:  # noqa: BLE001 - reported in the rows too
            versions.append(f"{mod} not importable ({type(e).__name__})")
    print(f"{cpu_model()}, {args.threads} threads, {time.strftime('%Y-%m-%d')}, load average {loadavg()}; "
          f"{', '.join(versions)}")
    print(f"N = {n:,}, bf16 grad in, bf16 param out; {args.rounds} interleaved rounds after {args.warmup} warm-up, "
          f"medians" + (f"; steps after step {args.step}" if args.step else ""), flush=True)
    rs = rows(args.backend)
    if args.only:
        rs = rs[:1] + [r for r in rs[1:] if any(w in r.name for w in args.only.split(","))]
    for r in rs:
        try:
            r.step, nbytes = r.build(n)
            r.state_bytes = nbytes / n
        except Exception as e:  # noqa: BLE001 - a row that cannot run says why, never disappears
            r.why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
    times = measure(rs, args.rounds, args.warmup)
    base = rs[0].name
    med = {k: statistics.median(v) for k, v in times.items()}
    speedup = {k: ratio(times[base], v) for k, v in times.items()} if base in times else {}

    print("\n| implementation | B/elem (formula) | ms | GB/s | x fp32 | state B/param |")
    print("|---|---|---|---|---|---|")
    for r in rs:
        if r.name not in med:
            print(f"| {r.name} | {r.bpe:.2f} ({r.formula}) | - | - | - | not run: {r.why} |")
            continue
        t = med[r.name]
        sp = f"{speedup[r.name]:.2f}x" if speedup else "-"
        print(f"| {r.name} | {r.bpe:.2f} ({r.formula}) | {t * 1e3:.1f} | {r.bpe * n / t / 1e9:.1f} | {sp} | "
              f"{r.state_bytes:.2f} |")
    print(f"(load average at the end: {loadavg()})")
    summary(rs, med, speedup, args.backend)


def summary(rs: list[Row], med: dict, speedup: dict, backend: str = "cpu") -> None:
    """The issue's targets, each MET / MISSED / PENDING (a row that did not run)."""
    by = {r.name.split(" (")[0]: r for r in rs}
    missing = Row("", 0, "", None)
    missing.why = "not selected (--only)"
    print("\nTargets (issue 11.5):")
    for key, want in (("zk fp32 states", 12), ("zk bf16 moments", 8), ("zk 8-bit moments", 6.1),
                      ("zk 8-bit + remainders", 4.1)):
        r = by.get(key, missing)
        got = r.state_bytes
        verdict = f"PENDING ({r.why})" if got != got else ("MET" if got <= want + 1e-9 else "MISSED")
        print(f"  state B/param {key}: {got:.2f} (target {'<= ' if want % 1 else ''}{want}) {verdict}")
    for key, want in (("zk 8-bit moments", 1.4), ("zk 8-bit + remainders", 1.6)):
        r = by.get(key, missing)
        if r.name not in med:
            print(f"  speed-up {key} over zk fp32 states: PENDING ({r.why})")
            continue
        verdict = ("MET" if speedup[r.name] >= want else "MISSED") if backend == "cpu" else \
            f"(no verdict: backend {backend!r} is not the product on CPU)"
        print(f"  speed-up {key} over zk fp32 states: {speedup[r.name]:.2f}x (target >= {want}x) {verdict}")
        for a in ("bnb AdamW8bit, fp32 master", "bnb AdamW8bit, bf16 params", "torchao AdamW8bit, fp32 master",
                  "torchao AdamW8bit, bf16 params"):
            ar = by.get(a, missing)
            if ar.name not in med:
                print(f"    vs {a}: not run ({ar.why})")
            else:
                x = med[a] / med[r.name]
                print(f"    vs {a}: {x:.2f}x ({'faster' if x > 1 else 'slower'})")


if __name__ == "__main__":
    main()
