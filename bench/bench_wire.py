"""The ZeRO++ int8 wire codec on CPU: the C++ codec (csrc/cpu_quant.cpp) against the torch-ops path
(qwz.encode_wire / codecs.decode_q8), the two ``qwz.WIRE_BACKEND`` choices for CPU tensors.

    python bench/bench_wire.py                 # 4M elements, 1 and 2 threads
    python bench/bench_wire.py --numel 1000000 --threads 1 2 4

Per operation (encode fp32, encode bf16, decode, decode + accumulate into fp32), median ms per call over
interleaved rounds (bench/_timing.py), ns per element and the speed-up of C++ over torch ops. Both sides
produce the same bits (tests/test_wire_cpu.py); the script checks that once per case before timing.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleaved_medians, positive_int, table  # noqa: E402

from zero_kernels.codecs import CODE_BOOKS  # noqa: E402
from zero_kernels.zero import qwz  # noqa: E402


def _with(backend: str, fn):
    def run():
        qwz.WIRE_BACKEND = backend
        try:
            return fn()
        finally:
            qwz.WIRE_BACKEND = "auto"
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=positive_int, default=4 * 1024 * 1024)
    ap.add_argument("--threads", type=positive_int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=positive_int, default=9)
    args = ap.parse_args()
    if qwz.wire_module() is None:
        raise SystemExit(f"the C++ wire codec is unavailable: {qwz._why_no_cpp()}")
    table_ = CODE_BOOKS[qwz.QWZ_CODE]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=g) * torch.logspace(-3, 1, args.numel)
    xb = x.bfloat16()
    codes, scales = qwz.encode_wire(x, table_)
    acc = torch.zeros(args.numel)
    ops = {
        "encode fp32": lambda: qwz.wire_encode(x, table_),
        "encode bf16": lambda: qwz.wire_encode(xb, table_),
        "decode": lambda: qwz.wire_decode(codes, scales, table_),
        "decode + acc": lambda: qwz.wire_decode(codes, scales, table_, acc),
    }
    for name, fn in ops.items():
        if name == "decode + acc":
            continue
        a, b = _with("cpu", fn)(), _with("torch", fn)()
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"{name}: the backends disagree"
    before = torch.get_num_threads()
    rows = []
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, fn in ops.items():
                t = interleaved_medians({"cpu": _with("cpu", fn), "torch": _with("torch", fn)}, repeats=args.repeats)
                rows.append([threads, name, t["cpu"] * 1e3, t["torch"] * 1e3, t["cpu"] * 1e9 / args.numel,
                             t["torch"] * 1e9 / args.numel, f"{t['torch'] / t['cpu']:.1f}x"])
    finally:
        torch.set_num_threads(before)
    print(f"{args.numel:,} elements, ISA {qwz.wire_module().cpu_isa()}, torch {torch.__version__}")
    print(table(rows, ["threads", "op", "C++ ms", "torch ms", "C++ ns/elem", "torch ns/elem", "speed-up"]))


if __name__ == "__main__":
    main()
