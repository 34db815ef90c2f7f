"""GPU benchmark: one fused Adam step over realistic parameter lists, against torch and the ceiling.

    python bench/gpu.py                           # both workloads, every mode, one table
    python bench/gpu.py --workloads llama7b-layer --modes bf16-master --repeats 20 --rounds 3
    python bench/gpu.py --csv bench/gpu_results.csv
    python bench/gpu.py --modes 8bit --candidates "zero_kernels triton" --profile   # + its CUDA kernels

Workloads (parameter lists, not one tensor; every one far above the 50 MB L2 of an H100):
  gpt2-xl        GPT-2 1.5B: wte, wpe, 48 blocks of 12 tensors, ln_f (580 tensors, 1.56e9 elements)
  llama7b-layer  one Llama-7B decoder layer: q/k/v/o 4096^2, gate/up/down 4096x11008, 2 norms (202M)
Modes:
  fp32           fp32 parameters and gradients: reads p, m, v, g and writes p, m, v (28 B/param)
  bf16-master    bf16 parameters and gradients, fp32 master/m/v: reads master, m, v + bf16 grad and
                 writes master, m, v + bf16 param (28 B/param). torch has no such optimizer: its
                 candidates run what users do (cast the grads into fp32 master grads, step the fp32
                 masters, cast them back: ``_foreach_copy_`` both ways), timed as one step.
  bf16-moments   bf16 parameters and gradients, fp32 master, bf16 m and v (stochastic rounding): 20 B/param
  8bit           bf16 parameters and gradients, fp32 master, 8-bit blockwise m and v (one fp32 scale per 256
                 elements each): 16.06 B/param
  8bit+rem       8bit with store_param_remainders=True (bf16 parameter + int16 remainder, no fp32
                 master): 14.06 B/param
                 The state-format modes (issue 11) run zero_kernels only: no anchor here keeps these
                 states in one fused step (bitsandbytes / torchao are not in the GPU image). Their ceiling
                 row is the bf16-master stream mix's GB/s applied to the mode's bytes.
Candidates: zero_kernels FusedAdamW (backend triton, cuda), torch.optim.AdamW fused and foreach,
apex FusedAdam and TransformerEngine FusedAdam when importable. Each candidate owns its buffers
(freed before the next is built); candidates are interleaved by rounds (A B C .. A B C ..) and each
reports the median over all its timed steps.
Before timing, each candidate's first step is checked against ``zero_kernels.reference`` on three
sample tensors (the first, a middle and the last): max relative error in the table; a candidate
beyond 1e-5 is marked FAILED and not timed.
Ceiling: a streaming Triton kernel with the same access mix as the step (fp32: 4 fp32 reads, 3 fp32
writes; bf16-master: 3 fp32 + 1 bf16 reads, 3 fp32 + 1 bf16 writes) over flat buffers of the same
element count: the best GB/s this device reaches for that traffic. Device ms: CUDA events around
``repeats`` steps enqueued back to back, per step (the step's device throughput: in training the step is
enqueued behind the backward pass, so the host's work overlaps the GPU's); synced ms: CUDA events around one
``step()`` started on an idle GPU (device time plus the host's latency to the first launch); host ms: wall
time of the ``step()`` call itself (enqueueing, before any sync).
GB/s = ``reference.bytes_per_element`` x parameters / device time (the bytes the task needs, so a
pipeline that moves more shows as lower GB/s).

Without a CUDA GPU it says so and exits 0.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import positive_int  # noqa: E402

LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1


def gpt2_xl_shapes(layers: int = 48, d: int = 1600, vocab: int = 50257, ctx: int = 1024) -> list:
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (ctx, d)] + block * layers + [(d,), (d,)]


def llama7b_layer_shapes(d: int = 4096, ffn: int = 11008) -> list:
    return [(d, d)] * 4 + [(ffn, d), (ffn, d), (d, ffn), (d,), (d,)]


WORKLOADS = {"gpt2-xl": gpt2_xl_shapes, "llama7b-layer": llama7b_layer_shapes}
MODES = ("fp32", "bf16-master", "bf16-moments", "8bit", "8bit+rem")
# state-format modes: FusedAdamW keyword arguments (bf16 parameters and gradients)
STATE_FORMATS = {
    "bf16-moments": dict(exp_avg_dtype="bfloat16", exp_avg_sq_dtype="bfloat16"),
    "8bit": dict(exp_avg_dtype="uint8", exp_avg_sq_dtype="uint8"),
    "8bit+rem": dict(exp_avg_dtype="uint8", exp_avg_sq_dtype="uint8", store_param_remainders=True),
}


def mode_bytes_per_element(mode: str) -> float:
    """Bytes one step moves per parameter in ``mode`` (each array read and written once): the grad (read),
    the parameter or master and the moments (read and written), the bf16 parameter copy (written)."""
    import torch
    from zero_kernels.reference import bytes_per_element
    if mode in ("fp32", "bf16-master"):
        return float(bytes_per_element(torch.float32 if mode == "fp32" else torch.bfloat16,
                                       None if mode == "fp32" else torch.bfloat16))
    fmt = STATE_FORMATS[mode]
    moment = {"bfloat16": 2 * 2, "uint8": 2 * 1 + 2 * 4 / 256}      # codes r+w, + one fp32 scale r+w per 256
    master = 2 * 2 + 2 * 2 if fmt.get("store_param_remainders") else 2 * 4 + 2   # bf16 p + rem r+w | master r+w + p w
    return 2 + master + moment[fmt["exp_avg_dtype"]] + moment[fmt["exp_avg_sq_dtype"]]


# ---- candidates ---------------------------------------------------------------------------------
class Candidate:
    """Owns its tensors. ``step()`` is what is timed; ``masters()`` are the fp32 results checked."""

    def __init__(self, name, shapes, mode, seed=0):
        import torch
        self.name, self.mode = name, mode
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.init = lambda s: torch.randn(s, generator=g, device="cuda").mul_(0.02)  # noqa: E731
        self.grad = lambda s: torch.randn(s, generator=g, device="cuda").mul_(1e-3)  # noqa: E731
        self.shapes = shapes


def _zk(backend):
    def build(shapes, mode):
        import torch
        import zero_kernels as zk
        c = Candidate(f"zero_kernels {backend}", shapes, mode)
        from zero_kernels import codecs
        dt = torch.float32 if mode == "fp32" else torch.bfloat16
        ps = [torch.nn.Parameter(c.init(s).to(dt)) for s in shapes]
        for p in ps:
            p.grad = c.grad(p.shape).to(dt)
        fmt = {k: getattr(torch, v) if isinstance(v, str) else v for k, v in STATE_FORMATS.get(mode, {}).items()}
        opt = zk.FusedAdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, backend=backend, **fmt)
        c.step = opt.step

        def masters():
            if mode == "fp32":
                return ps
            st = [opt.state[p] for p in ps]
            return [s["master_param"] if "master_param" in s else
                    codecs.join_remainder(p.detach(), s["master_remainder"]) if "master_remainder" in s else
                    p.detach().float() for p, s in zip(ps, st)]
        c.masters = masters
        c.first = lambda picks: ([ps[i].detach().float().clone() for i in picks],
                                 [ps[i].grad.float().clone() for i in picks])
        c.keep = (ps, opt)
        return c
    return build


def _master_pipeline(name, make_opt):
    """torch-style candidates: fp32 masters with fp32 grads; for bf16-master the casts users run."""
    def build(shapes, mode):
        import torch
        c = Candidate(name, shapes, mode)
        masters = [torch.nn.Parameter(c.init(s)) for s in shapes]
        opt = make_opt(masters)
        if mode == "fp32":
            for p in masters:
                p.grad = c.grad(p.shape)
            c.step = opt.step
            c.first = lambda picks: ([masters[i].detach().clone() for i in picks],
                                     [masters[i].grad.clone() for i in picks])
        else:
            model = [p.detach().to(torch.bfloat16) for p in masters]
            grads16 = [c.grad(p.shape).to(torch.bfloat16) for p in masters]
            for p in masters:
                p.grad = torch.empty_like(p)

            def step():
                torch._foreach_copy_([p.grad for p in masters], grads16)
                opt.step()
                torch._foreach_copy_(model, [p.detach() for p in masters])
            c.step = step
            c.first = lambda picks: ([masters[i].detach().clone() for i in picks],
                                     [grads16[i].float() for i in picks])
            c.keep = (model, grads16)
        c.masters = lambda: masters
        c.opt = opt
        return c
    return build


def candidate_builders() -> dict:
    """name -> (builder, None) or (None, why it is unavailable)."""
    import torch
    from zero_kernels import backends
    out = {}
    for b in ("triton", "cuda"):
        why = backends.why_unavailable(b, torch.device("cuda"))
        out[f"zero_kernels {b}"] = (None, why) if why else (_zk(b), None)
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    # torch-style candidates run fp32 / bf16-master only: none of them keeps low-precision states
    out["torch AdamW fused"] = (_master_pipeline("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, fused=True, **kw)), None)
    out["torch AdamW foreach"] = (_master_pipeline("torch AdamW foreach", lambda ps: torch.optim.AdamW(ps, foreach=True, **kw)), None)
    try:
        from apex.optimizers import FusedAdam as ApexAdam  # type: ignore
        out["apex FusedAdam"] = (_master_pipeline("apex FusedAdam", lambda ps: ApexAdam(ps, adam_w_mode=True, **kw)), None)
    except Exception as e:  # noqa: BLE001 - not installed or broken
        out["apex FusedAdam"] = (None, f"apex not importable ({type(e).__name__})")
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam as TEAdam  # type: ignore
        out["TE FusedAdam"] = (_master_pipeline("TE FusedAdam", lambda ps: TEAdam(ps, adam_w_mode=True, **kw)), None)
    except Exception as e:  # noqa: BLE001
        out["TE FusedAdam"] = (None, f"transformer_engine not importable ({type(e).__name__})")
    return out


# ---- checking and timing -----------------------------------------------------------------------
def max_rel_error(c: Candidate, before: tuple, picks: list) -> float:
    """One step of ``c`` (already taken) against the reference from ``before`` = (params, grads)
    of the sample tensors ``picks``, as they were before that step."""
    import torch
    from zero_kernels.reference import compute_coeffs, fused_adam_ref
    p0, g0 = before
    m, v = [torch.zeros_like(t) for t in p0], [torch.zeros_like(t) for t in p0]
    coeffs = compute_coeffs([torch.ones((), device="cuda")] * len(picks), LR, *BETAS, WD, True,
                            device=torch.device("cuda"))
    fused_adam_ref(p0, g0, m, v, None, None, coeffs, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                   weight_decay=WD, adamw=True, maximize=False)
    out = c.masters()
    err = 0.0
    for i, r in zip(picks, p0):
        d = (out[i].detach().float() - r).abs().max() / r.abs().max().clamp_min(1e-30)
        err = max(err, float(d))
    return err


def time_steps(step, repeats: int, warmup: int = 2) -> tuple[list, list]:
    """Device ms (CUDA events) and host ms (the call itself) of ``repeats`` steps."""
    import torch
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        dev.append(a.elapsed_time(b))
    return dev, host


def time_queued(step, repeats: int) -> float:
    """Device ms per step with ``repeats`` steps enqueued back to back (CUDA events around all of them, the
    GPU busy from the first step on): the step's device throughput, what a training loop sees once the step is
    enqueued behind the backward pass. ``time_steps``' per-step events start on an idle GPU, so they also
    count the host's latency to the step's first launch."""
    import torch
    step()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeats):
        step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / repeats


def ceiling_ms(numel: int, mode: str, repeats: int) -> float | None:
    """Median ms of the streaming kernel with the step's access mix over ``numel`` elements."""
    import torch
    try:
        from _stream_ceiling import stream_mix
    except Exception:  # noqa: BLE001 - no triton
        return None
    a, b, c = (torch.rand(numel, device="cuda") for _ in range(3))
    gdt = torch.float32 if mode == "fp32" else torch.bfloat16
    d = torch.rand(numel, device="cuda").to(gdt)
    e = torch.empty(numel, device="cuda", dtype=torch.bfloat16) if mode != "fp32" else None
    run = lambda: stream_mix(a, b, c, d, e)  # noqa: E731
    time_steps(run, 1)
    queued = [time_queued(run, repeats) for _ in range(3)]
    del a, b, c, d, e
    torch.cuda.empty_cache()
    return statistics.median(queued)


def profile_step(label: str, step, top: int = 8) -> None:
    """Print the CUDA kernels of 3 steps (torch.profiler): where the device time of one step goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    print(f"  profile {label}: per step, CUDA kernels by device time", flush=True)
    for e in rows[:top]:
        print(f"    {e.device_time_total / 3e3:9.3f} ms  {e.count // 3:5d} launches  {e.key[:110]}", flush=True)


def run_workload(name: str, mode: str, builders: dict, rounds: int, repeats: int, profile: bool = False) -> list[dict]:
    import torch
    shapes = WORKLOADS[name]()
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    bpe = mode_bytes_per_element(mode)
    gb = numel * bpe / 1e9
    coded = mode in STATE_FORMATS
    ceil = ceiling_ms(numel, "bf16-master" if coded else mode, repeats)
    if coded and ceil:       # the bf16-master mix's bandwidth over this mode's bytes
        ceil *= bpe / mode_bytes_per_element("bf16-master")
    rows = [dict(workload=name, mode=mode, candidate="ceiling (bf16-master mix's GB/s)" if coded else
                 "ceiling (same stream mix)", params=numel, device_ms=ceil, synced_ms=None, host_ms=None, err=None,
                 note="" if ceil else "triton unavailable")]
    results = {k: dict(dev=[], queued=[], host=[], err=None, note=why or "") for k, (_, why) in builders.items()
               if not coded or k.startswith("zero_kernels")}
    picks = [0, len(shapes) // 2, len(shapes) - 1]
    for r in range(rounds):
        for k, (build, _) in builders.items():
            if k not in results or results[k]["note"]:          # unavailable, failed its check, or out of memory
                continue
            c = None
            try:
                c = build(shapes, mode)
                if r == 0:
                    before = c.first(picks)
                    c.step()
                    results[k]["err"] = max_rel_error(c, before, picks)
                    del before
                    if results[k]["err"] > 1e-5:
                        results[k]["note"] = f"FAILED: max rel err {results[k]['err']:.2e} vs the reference"
                        continue
                dev, host = time_steps(c.step, repeats)
                results[k]["dev"] += dev
                results[k]["host"] += host
                results[k]["queued"].append(time_queued(c.step, repeats))
                if profile and r == rounds - 1:
                    profile_step(f"{name} {mode} {k}", c.step)
            except torch.cuda.OutOfMemoryError:
                results[k]["note"] = "out of memory"
            finally:
                del c
                torch.cuda.empty_cache()
    for k, res in results.items():
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        rows.append(dict(workload=name, mode=mode, candidate=k, params=numel, device_ms=med(res["queued"]),
                         synced_ms=med(res["dev"]), host_ms=statistics.median(res["host"]) if res["host"] else None,
                         err=res["err"], note=res["note"]))
    for row in rows:
        row["bpe"] = bpe
        ms = row["device_ms"]
        row["gbs"] = gb / (ms * 1e-3) if ms else None
        row["pct"] = 100.0 * ceil / ms if (ms and ceil) else None
    return rows


def print_table(rows: list[dict], flush: bool = False) -> None:
    from _timing import table
    fmt = lambda x, f: "" if x is None else format(x, f)  # noqa: E731
    print(table([[r["workload"], r["mode"], r["candidate"], f"{r['params'] / 1e6:.0f}M", f"{r['bpe']:.2f}",
                  fmt(r["device_ms"], ".3f"), fmt(r["synced_ms"], ".3f"),
                  fmt(r["host_ms"], ".3f"), fmt(r["gbs"], ".0f"), fmt(r["pct"], ".1f"), fmt(r["err"], ".1e"), r["note"]]
                 for r in rows],
                ["workload", "mode", "candidate", "params", "B/param", "device ms", "synced ms", "host ms", "GB/s", "% of ceiling",
                 "max rel err", "note"]), flush=flush)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds over the candidates")
    ap.add_argument("--repeats", type=positive_int, default=10, help="timed steps per candidate per round")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    ap.add_argument("--profile", action="store_true", help="also print each candidate's CUDA kernels (torch.profiler)")
    ap.add_argument("--candidates", default=None, help="comma-separated substrings: run only matching candidates")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch is not installed: no GPU benchmark to run.")
        return 0
    if not torch.cuda.is_available():
        why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        print(f"No CUDA GPU on this machine ({why}; torch {torch.__version__}): bench/gpu.py has nothing "
              "to measure. Exiting.")
        return 0
    os.environ.setdefault("TRITON_INTERPRET", "0")
    props = torch.cuda.get_device_properties(0)
    print(f"{torch.cuda.get_device_name(0)} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
          f"L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB), torch {torch.__version__}, "
          f"{datetime.date.today().isoformat()}; medians of {args.rounds} rounds x {args.repeats} steps")
    builders = candidate_builders()
    if args.candidates:
        builders = {k: v for k, v in builders.items() if any(c in k for c in args.candidates.split(","))}
    rows = []
    for w in args.workloads.split(","):
        for m in args.modes.split(","):
            new = run_workload(w, m, builders, args.rounds, args.repeats, profile=args.profile)
            rows += new
            print_table(new, flush=True)        # each part as it ends: a run cut short keeps what it measured
            if args.csv:
                with open(args.csv, "w", newline="") as f:
                    wr = csv.DictWriter(f, fieldnames=list(rows[0]))
                    wr.writeheader()
                    wr.writerows(rows)
    print("\nAll rows:")
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
