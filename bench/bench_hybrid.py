"""Beyond one node on one machine: ZeRO-2, ZeRO-3, hybrid ZeRO-3 (+ qwZ, + qgZ) and FSDP2 HSDP on
4 gloo processes as 2 "nodes" x 2 (issue 12 item 5).

    python bench/bench_hybrid.py                      # both nodes on loopback (no slow link)
    sudo python bench/bench_hybrid.py --link-mbit 200 # nodes in two network namespaces joined by a
                                                      # veth pair rate-limited to 200 Mbit/s (tc tbf)

The two "nodes" are two ``torchrun`` launchers (c10d rendezvous), 2 processes each, exactly as on two
machines. With ``--link-mbit`` the benchmark builds two network namespaces joined by a veth pair with
a token-bucket rate limit on both ends, runs one launcher in each, and removes them afterwards; traffic
inside a node stays on that namespace's loopback (unlimited), traffic between nodes crosses the
limited link. Without root (or without ``ip``/``tc``) it says so and runs on loopback.

Per variant: cross-node and total bytes this rank sent per step (``zopt.comm_report()``, [Note: bytes
on the wire]; FSDP2's collectives are not ours, so its bytes are not counted), and the step time
(slowest rank per step, median over interleaved rounds, ratios per round).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import nonnegative_int, positive_float, positive_int  # noqa: E402

VARIANTS = ["zero2", "zero3", "zero3_hybrid", "zero3_hybrid_qwz", "zero3_hybrid_qwz_qgz", "fsdp2_hsdp"]
NS = ("zkbench0", "zkbench1")
ADDR = ("10.77.0.1", "10.77.0.2")
DEV = ("zkbv0", "zkbv1")


# ---- the launcher side ------------------------------------------------------------------------------
def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def _refuse_existing() -> None:
    """Never touch namespaces of these names that this run did not create (a leftover of a killed
    run included: the message says how to remove it)."""
    existing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    taken = [ns for ns in NS if ns in existing]
    if taken:
        raise RuntimeError(f"network namespaces {taken} already exist and this benchmark did not create them; "
                           f"remove them (`ip netns del NAME`) if they are a leftover of an earlier run")


def _link_up(mbit: float) -> None:
    """Two namespaces joined by a veth pair, rate-limited to ``mbit`` in both directions."""
    for ns in NS:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
    _sh("ip", "link", "add", DEV[0], "netns", NS[0], "type", "veth", "peer", "name", DEV[1], "netns", NS[1])
    for ns, dev, addr in zip(NS, DEV, ADDR):
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
            "burst", "256kb", "latency", "200ms")


def _link_down() -> None:
    for ns in NS:                                   # deleting a namespace removes its veth end too
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _can_shape() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "`ip` / `tc` not installed"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    shaped = args.link_mbit is not None
    why = _can_shape() if shaped else None
    if why is not None:
        print(f"--link-mbit needs network namespaces ({why}): running both nodes on loopback instead")
        shaped = False
    port = _free_port()
    out = os.path.abspath(args.out)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = []
    made = False
    try:
        if shaped:
            _refuse_existing()
            made = True                             # from here on the namespaces are ours to remove
            _link_up(args.link_mbit)
        for node in range(2):
            host = ADDR[0] if shaped else "127.0.0.1"
            local = ADDR[node] if shaped else "127.0.0.1"
            e = dict(env, GLOO_SOCKET_IFNAME=DEV[node] if shaped else "lo")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}", "--rdzv-id", f"zkb{port}",
                   "--rdzv-conf", f"is_host={int(node == 0)}",   # 10.77.0.1 is no hostname torchrun knows
                   "--local-addr", local, "--max-restarts", "0", os.path.abspath(__file__), "--worker",
                   "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--width", str(args.width),
                   "--batch", str(args.batch), "--variants", args.variants, "--out", out]
            if shaped:
                cmd = ["ip", "netns", "exec", NS[node]] + cmd
            procs.append(subprocess.Popen(cmd, env=e, start_new_session=True))
        deadline = time.monotonic() + args.timeout
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        if made:
            _link_down()
    if any(p.returncode != 0 for p in procs):
        print("a launcher failed:", [p.returncode for p in procs])
        return 1
    import torch
    res = torch.load(out, weights_only=False)
    link = f"{args.link_mbit:g} Mbit/s veth between two network namespaces" if shaped else "loopback (no rate limit)"
    print_table(res, args, link)
    return 0


def print_table(res: dict, args, link: str) -> None:
    steps = res["steps"]
    base = {b: steps[b] for b in ("zero3", "fsdp2_hsdp") if b in steps}
    print(f"\n`python bench/bench_hybrid.py{'' if args.link_mbit is None else f' --link-mbit {args.link_mbit:g}'}"
          f" --rounds {args.rounds} --width {args.width} --batch {args.batch}`: 4 gloo processes as 2 nodes x 2 (two torchrun launchers), cross-node link: "
          f"{link}; MLP 4 x ({args.width}->{4 * args.width}->{args.width}), {res['psi'] / 1e6:.1f}M fp32 params, batch "
          f"{args.batch} per rank; {args.rounds} interleaved rounds after {args.warmup} warm-up; load average "
          f"{res['load']}\n")
    print("| variant | cross-node MB/step | total MB/step | step ms | vs ZeRO-3 | vs FSDP2 HSDP |")
    print("|---|---|---|---|---|---|")
    for v, ts in steps.items():
        wire = res["wire"].get(v)
        inter = "-" if wire is None else f"{wire['inter'] / 1e6:.2f}"
        total = "-" if wire is None else f"{(wire['inter'] + wire['intra']) / 1e6:.2f}"
        rel = [f"{statistics.median(a / b for a, b in zip(ts, base[k])):.2f}x" if k in base else "-"
               for k in ("zero3", "fsdp2_hsdp")]
        print(f"| {v} | {inter} | {total} | {statistics.median(ts) * 1e3:.0f} | {rel[0]} | {rel[1]} |")
    print("\nbytes: what rank 0 sent in one step (backward + step), from zopt.comm_report(); FSDP2's "
          "collectives are torch's own, not counted. step: slowest rank per step, median over rounds; "
          "ratios: median of per-round ratios. Targets (issue 12): hybrid ZeRO-3 + qwZ + qgZ <= 0.7x "
          "ZeRO-3 and <= 0.6x FSDP2 HSDP.")


# ---- the worker side (one per rank, under torchrun) ----------------------------------------------
def make_model(width: int):
    import torch
    from torch import nn
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(4)])


def build(variant: str, width: int, shape: tuple[int, int]):
    """(model, optimizer, ZeroAdamW or None) of one variant, on process groups of its own: the byte
    counters are per group ([Note: bytes on the wire]), and the variants share one process."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import zero_kernels as zk
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = make_model(width)
    if variant == "fsdp2_hsdp":
        from torch.distributed.fsdp import fully_shard
        for blk in model:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), None
    kw = dict(lr=1e-4, timeout=300)
    if "hybrid" in variant:
        kw["mesh"] = mesh
    else:
        kw["process_group"] = dist.new_group()
    if "qwz" in variant:
        kw["quantize_weights"] = True
    if "qgz" in variant:
        kw["quantize_grads"] = True
    zopt = zk.ZeroAdamW(model, stage=2 if variant == "zero2" else 3, **kw)
    return model, zopt, zopt


def worker(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    variants = [v for v in args.variants.split(",") if v]
    runs = {v: build(v, args.width, (world // per_node, per_node)) for v in variants}
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    loss_fn = torch.nn.MSELoss()
    steps = {v: [] for v in variants}
    for it in range(args.warmup + args.rounds):
        for v in variants:                          # interleaved: machine drift hits every variant alike
            model, opt, _ = runs[v]
            dist.barrier()
            t0 = time.perf_counter()
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            t = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)     # the slowest rank sets the step time
            if it >= args.warmup:
                steps[v].append(float(t))
    wire = {v: runs[v][2].comm_report()["last_step"] for v in variants if runs[v][2] is not None}
    if rank == 0:
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        torch.save({"steps": steps, "wire": wire, "load": load,
                    "psi": sum(p.numel() for p in make_model(args.width).parameters())}, args.out)
    for _, _, zopt in runs.values():
        if zopt is not None:
            zopt.remove_hooks()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--link-mbit", type=positive_float, default=None, help="rate-limit the cross-node link (needs root)")
    ap.add_argument("--rounds", type=positive_int, default=8)
    ap.add_argument("--warmup", type=nonnegative_int, default=2)
    ap.add_argument("--width", type=positive_int, default=512, help="MLP width (4 blocks of width -> 4 width -> width)")
    ap.add_argument("--batch", type=positive_int, default=32)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--timeout", type=positive_float, default=1800, help="seconds for the whole run")
    ap.add_argument("--out", default="/tmp/zk_bench_hybrid.pt")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = [v for v in args.variants.split(",") if v and v not in VARIANTS]
    if unknown:                                     # an unknown name ran as ZeRO-3
        ap.error(f"--variants: {', '.join(unknown)} not among {', '.join(VARIANTS)}")
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
