"""Quality of low-precision Adam states (issue 11): one small GPT-2-shaped model, one data stream, one
initialisation; only the optimizer's state format changes between runs.

    python bench/quality_states.py                     # default run, 400 steps (about 15 minutes on 2 cores)
    python bench/quality_states.py --plot docs/quality_states.png     # the README's table and plot
    python bench/quality_states.py --tiny --steps 150  # the short version (tests/test_quality_states.py)

Model: pre-LayerNorm GPT-2 block stack (token + position embeddings, causal attention, GELU MLP, tied
head), ``GPTConfig`` below (~0.41M parameters), randomly initialised from a fixed seed. Data: a
Markov chain over a 256-token vocabulary (order-1 plus order-2 structure, ``Markov2``), generated
here from a fixed seed; the table also prints the chain's entropy (the best reachable loss).
Schedule: linear warm-up then cosine decay, AdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1).

Rows: torch.optim.AdamW (fp32, the anchor); "ours ..." rows are the product, zero_kernels.FusedAdamW with
its state-format arguments (``--backend``: the C++ ``cpu`` kernel where it runs the format, else the
pure-torch ``reference``; the table says which ran), fp32 parameters with fp32, bf16 (stochastic rounding),
8-bit blockwise and float8_e4m3fn blockwise moments; bf16 parameters with an fp32 master and fp32 moments
(their own anchor), with bf16 moments, with 8-bit moments, and with 8-bit moments + int16 remainders.
"codecs ..." rows call zero_kernels.codecs.adam_step_coded directly, for what the optimizer does not expose:
bf16 round-to-nearest (the control that freezes v).
bitsandbytes.optim.AdamW8bit and torchao.optim.AdamW8bit run on the same run with their defaults, once on
fp32 parameters and once on the bf16 parameters themselves (no master: their usual use with bf16 models;
the 8-bit rows of each parameter dtype are compared with the anchors of that dtype; rows say why when missing; ``pip install bitsandbytes==0.50.2 torchao==0.18.0``, the versions
of the README's table, or ``python bench/bench_states.py --setup``).
Final loss = mean cross-entropy on fixed held-out batches after the last step.

Targets (issue 11.6), checked by ``--check`` and, at a shorter scale, by tests/test_quality_states.py:
final loss within 1% of torch AdamW fp32 with bf16 moments, within 2% with 8-bit moments, and no worse
than bitsandbytes / torchao AdamW8bit on the same run.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import positive_float, positive_int  # noqa: E402

from zero_kernels import codecs  # noqa: E402

BETAS, EPS, WD = (0.9, 0.999), 1e-8, 0.1


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4


TINY = GPTConfig(vocab=64, seq=32, d_model=64, n_layer=1, n_head=2)   # --tiny: the short version


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.qkv, self.proj = nn.Linear(c.d_model, 3 * c.d_model), nn.Linear(c.d_model, c.d_model)
        self.fc, self.out = nn.Linear(c.d_model, 4 * c.d_model), nn.Linear(4 * c.d_model, c.d_model)
        self.n_head = c.n_head

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab, c.d_model), nn.Embedding(c.seq, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        for name, p in self.named_parameters():       # GPT-2 init: N(0, 0.02), residual projections scaled
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.ln_f(x), self.wte.weight)      # tied head


class Markov2:
    """Next-token distribution given the (previous, current) tokens: 0.7 x T1[current] + 0.3 x T2[previous],
    rows sparse (Dirichlet 0.05) over a 256-token vocabulary. T1 is a bigram table (learnt through the
    embeddings and the tied head), T2 needs attention to the previous position; 2 x 256^2 transition
    probabilities to fit keep the loss falling for hundreds of steps, and rare tokens give the sparse,
    slowly varying gradients that expose low-precision second moments."""

    def __init__(self, vocab: int, seed: int = 1234):
        torch.manual_seed(seed)
        dirichlet = lambda *shape: torch.distributions.Dirichlet(torch.full((vocab,), 0.05)).sample(shape)
        self.P = 0.7 * dirichlet(vocab)[None, :, :] + 0.3 * dirichlet(vocab)[:, None, :]
        self.cdf = self.P.cumsum(-1)
        self.vocab = vocab

    def batch(self, b: int, t: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x = torch.empty(b, t + 1, dtype=torch.long)
        x[:, :2] = torch.randint(self.vocab, (b, 2), generator=g)
        for i in range(2, t + 1):
            u = torch.rand(b, 1, generator=g) * self.cdf[x[:, i - 2], x[:, i - 1], -1:]
            x[:, i] = torch.searchsorted(self.cdf[x[:, i - 2], x[:, i - 1]], u).squeeze(1).clamp_(max=self.vocab - 1)
        return x

    def entropy(self) -> float:
        """Mean next-token entropy (nats) over uniform context pairs: roughly the best reachable loss."""
        p = self.P
        return float(-(p * torch.log(p.clamp_min(1e-30))).sum(-1).mean())


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 15)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))


def coded_stepper(params: list[nn.Parameter], **fmt) -> Callable[[float], None]:
    rounding = fmt.pop("bf16_rounding", "stochastic")
    states = [codecs.init_coded_state(p.data, **fmt) for p in params]

    def step(lr: float) -> None:
        for i, (p, s) in enumerate(zip(params, states)):
            codecs.adam_step_coded(p.data, p.grad, s, lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                   weight_decay=WD, adamw=True, seed=i, bf16_rounding=rounding)
    step.states = states
    return step


def torch_stepper(opt: torch.optim.Optimizer) -> Callable[[float], None]:
    def step(lr: float) -> None:
        for grp in opt.param_groups:
            if isinstance(grp["lr"], torch.Tensor):      # torchao keeps lr as a tensor
                grp["lr"].fill_(lr)
            else:
                grp["lr"] = lr
        opt.step()
    return step


U8, BF = torch.uint8, torch.bfloat16
# "ours" rows: zk.FusedAdamW's state-format arguments (the product)
OURS = {
    "ours fp32": {}, "ours bf16 SR": dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF),
    "ours 8-bit": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8),
    "ours fp8 e4m3": dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn),
    "ours bf16 params, fp32 master": {},
    "ours bf16 params, bf16 moments": dict(exp_avg_dtype=BF, exp_avg_sq_dtype=BF),
    "ours bf16 params, 8-bit moments": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8),
    "ours bf16 params, 8-bit + remainders": dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8, store_param_remainders=True),
}
# rows held to the targets: (row, largest final-loss ratio to torch AdamW fp32)
TARGETS = {"ours bf16 SR": 1.01, "ours bf16 params, bf16 moments": 1.01, "ours 8-bit": 1.02,
           "ours bf16 params, 8-bit moments": 1.02, "ours bf16 params, 8-bit + remainders": 1.02}
EIGHT_BIT_ANCHORS = ("bitsandbytes AdamW8bit", "torchao AdamW8bit")                  # on fp32 parameters
BF16_ANCHORS = ("bitsandbytes AdamW8bit, bf16 params", "torchao AdamW8bit, bf16 params")  # on the bf16 ones


def zk_stepper(params: list[nn.Parameter], fmt: dict, backend: str) -> Callable[[float], None]:
    """zk.FusedAdamW on ``backend``; "auto" = the C++ cpu kernel, or the reference where the kernel does not
    run this format (NotImplementedError). ``step.backend`` says which ran."""
    import zero_kernels as zk
    make = lambda b: zk.FusedAdamW(params, lr=0.0, betas=BETAS, eps=EPS, weight_decay=WD, backend=b, **fmt)
    if backend != "auto":
        opt, used = make(backend), backend
    else:
        try:
            opt, used = make("cpu"), "cpu"
        except NotImplementedError:
            opt, used = make("reference"), "reference"
    step = torch_stepper(opt)
    step.backend = used
    return step


def make_run(kind: str, params: list[nn.Parameter], backend: str = "auto") -> Callable[[float], None]:
    bf = BF
    if kind in OURS:
        return zk_stepper(params, dict(OURS[kind]), backend)
    if kind == "torch AdamW fp32":
        return torch_stepper(torch.optim.AdamW(params, lr=0.0, betas=BETAS, eps=EPS, weight_decay=WD))
    if kind.startswith("bitsandbytes AdamW8bit"):
        import bitsandbytes as bnb
        return torch_stepper(bnb.optim.AdamW8bit(params, lr=0.0, betas=BETAS, eps=EPS, weight_decay=WD))
    if kind.startswith("torchao AdamW8bit"):
        import torchao.optim
        return torch_stepper(torchao.optim.AdamW8bit(params, lr=0.0, betas=BETAS, eps=EPS, weight_decay=WD))
    if kind == "codecs bf16 RNE (control)":
        return coded_stepper(params, exp_avg_dtype=bf, exp_avg_sq_dtype=bf, bf16_rounding="nearest")
    raise ValueError(f"unknown row {kind!r}")


def train(kind: str, args, init: dict, data: Markov2, evals: list) -> dict:
    model = GPT(args.cfg)
    bf16 = "bf16 params" in kind
    params = {k: nn.Parameter(v.to(torch.bfloat16 if bf16 else torch.float32).clone()) for k, v in init.items()}
    step = make_run(kind, list(params.values()), args.backend)
    fwd = lambda x: torch.func.functional_call(model, {k: p.float() for k, p in params.items()}, (x,))
    loss_of = lambda xy: F.cross_entropy(fwd(xy[:, :-1]).reshape(-1, args.cfg.vocab), xy[:, 1:].reshape(-1))
    losses, t0 = [], time.perf_counter()
    for s in range(args.steps):
        loss = loss_of(data.batch(args.batch, args.cfg.seq, seed=10_000 + s + data.offset))
        loss.backward()
        step(lr_at(s, args.steps, args.lr))
        for p in params.values():
            p.grad = None
        losses.append(float(loss.detach()))
    with torch.no_grad():
        final = sum(float(loss_of(xy)) for xy in evals) / len(evals)
    return dict(losses=losses, final=final, secs=time.perf_counter() - t0,
                backend=getattr(step, "backend", "codecs" if kind.startswith("codecs") else "-"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--steps", type=positive_int, default=400)
    ap.add_argument("--batch", type=positive_int, default=16)
    ap.add_argument("--lr", type=positive_float, default=3e-3)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--only", default=None, help="comma-separated substrings: run only matching rows")
    ap.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    ap.add_argument("--backend", default="auto", choices=["auto", "cpu", "reference", "triton"],
                    help="zk.FusedAdamW backend of the 'ours' rows (auto: cpu where it runs the format, else "
                         "reference)")
    ap.add_argument("--seed", type=int, default=0, help="offsets the initialisation, chain and batch seeds "
                    "(0: the README's run)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every quality target is met")
    ap.add_argument("--tiny", action="store_true", help="the short version: TINY's model and vocabulary "
                    "(tests/test_quality_states.py)")
    args = ap.parse_args(argv)
    args.cfg = TINY if args.tiny else GPTConfig()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    init = {k: v.detach().clone() for k, v in GPT(args.cfg).named_parameters()}
    data = Markov2(args.cfg.vocab, seed=1234 + args.seed)
    data.offset = 100_000 * args.seed
    evals = [data.batch(32, args.cfg.seq, seed=99 + i + data.offset) for i in range(4)]
    kinds = ["torch AdamW fp32", *OURS, "codecs bf16 RNE (control)", *EIGHT_BIT_ANCHORS, *BF16_ANCHORS]
    if args.only:
        kinds = [k for k in kinds if k == "torch AdamW fp32" or any(w in k for w in args.only.split(","))]
    n = sum(v.numel() for v in init.values())
    print(f"GPT {args.cfg}: {n:,} params; order-2 Markov, entropy floor {data.entropy():.4f} nats; "
          f"{args.steps} steps x batch {args.batch} x seq {args.cfg.seq}, peak lr {args.lr}, "
          f"betas {BETAS}, wd {WD}", flush=True)
    results = {}
    for kind in kinds:
        try:
            results[kind] = train(kind, args, init, data, evals)
        except Exception as e:  # noqa: BLE001 - a missing anchor is reported in its row, never hidden
            results[kind] = dict(error=f"{type(e).__name__}: {e}"[:120])
        r = results[kind]
        print(f"  {kind}: " + (f"final {r['final']:.4f} ({r['secs']:.0f} s)" if "final" in r else r["error"]), flush=True)
    base = results["torch AdamW fp32"]["final"]
    print("\n| state format | backend | final loss | ratio to torch AdamW fp32 |\n|---|---|---|---|")
    for kind, r in results.items():
        print(f"| {kind} | " + (f"{r['backend']} | {r['final']:.4f} | {r['final'] / base:.4f} |" if "final" in r
                                 else f"- | - | {r['error']} |"))
    if args.plot:
        plot(results, args.plot)
    verdicts = check(results)
    print("\nTargets (issue 11.6):")
    for line, ok in verdicts:
        print(f"  {'MET   ' if ok else 'MISSED'} {line}")
    if args.check and not verdicts:
        print("  no target was evaluated (--only selected none of the rows held to targets): --check fails")
        raise SystemExit(1)
    if args.check and not all(ok for _, ok in verdicts):
        raise SystemExit(1)
    return results


def check(results: dict) -> list[tuple[str, bool]]:
    """[(description, met)] for every target whose rows ran: the ratio bound of TARGETS, and no worse
    than each 8-bit anchor that ran on the same parameter dtype (fp32 rows against bitsandbytes' and
    torchao's AdamW8bit on fp32 parameters, bf16-parameter rows against the same on bf16 parameters, their
    usual use; a missing anchor is reported, not counted as met)."""
    base = results["torch AdamW fp32"]["final"]
    out, missing = [], {}
    for kind, bound in TARGETS.items():
        r = results.get(kind)
        if r is None or "final" not in r:
            continue
        ratio = r["final"] / base
        out.append((f"{kind}: {ratio:.4f} x torch AdamW fp32 (target <= {bound})", ratio <= bound))
        if "8-bit" in kind:
            for a in BF16_ANCHORS if "bf16 params" in kind else EIGHT_BIT_ANCHORS:
                ra = results.get(a)
                if ra is None or "final" not in ra:
                    missing[a] = ra["error"] if ra else "not run"
                    continue
                out.append((f"{kind}: {r['final']:.4f} vs {a} {ra['final']:.4f} (target: no worse)",
                            r["final"] <= ra["final"]))
    for a, why in missing.items():
        print(f"  (8-bit rows not compared with {a}: {why})")
    return out


def plot(results: dict, path: str) -> None:
    """Left: the loss curves (9-step means). Right: each minus the torch AdamW fp32 curve."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    smooth = lambda l: F.avg_pool1d(torch.tensor(l)[None, None], 9, 1, 4, count_include_pad=False)[0, 0]
    base = smooth(results["torch AdamW fp32"]["losses"])
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(14, 5.5))
    tab = plt.get_cmap("tab20").colors
    own = iter([tab[j] for j in (0, 2, 4, 10, 12, 14, 16, 18, 1, 3, 5, 11, 13, 15, 17, 19)] * 2)
    anchors = {"torch AdamW fp32": ("k", "--"), "bitsandbytes AdamW8bit": ("tab:red", "--"),
               "torchao AdamW8bit": ("tab:purple", "-.")}
    for kind, r in results.items():                   # the project's rows solid, the anchors dashed
        if "losses" in r:
            c, ls = anchors.get(kind) or (next(own), "-" if kind.startswith("ours") else ":")
            style = dict(color=c, lw=1.1, ls=ls)
            ax.plot(smooth(r["losses"]), label=f"{kind} ({r['final']:.4f})", **style)
            dx.plot(smooth(r["losses"]) - base, **style)
    ax.set(xlabel="step", ylabel="train loss (9-step mean)", title="AdamW state formats: GPT-2-shaped model, Markov data")
    dx.set(xlabel="step", ylabel="train loss minus torch AdamW fp32", title="difference to the fp32 anchor")
    dx.axhline(0, color="k", lw=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
