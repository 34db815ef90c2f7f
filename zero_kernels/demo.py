"""``python -m zero_kernels.demo``: FusedAdamW against torch.optim.AdamW on a small model.

Trains the same small MLP twice from the same initialization and data, once with
``torch.optim.AdamW`` and once with ``zk.FusedAdamW``, and prints both losses, the largest
parameter difference and the step-time ratio.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import zero_kernels as zk


def fused_vs_torch(steps: int = 50, width: int = 1024, seed: int = 0) -> dict[str, float]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 10))
    ref = copy.deepcopy(model)
    ours = zk.FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    theirs = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    loss_fn = torch.nn.CrossEntropyLoss()
    t_ours, t_theirs = [], []
    for _ in range(steps):
        for m, o, ts in ((model, ours, t_ours), (ref, theirs, t_theirs)):
            o.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            t0 = time.perf_counter()
            o.step()
            ts.append(time.perf_counter() - t0)
            if o is ours:
                loss_ours = loss.item()
            else:
                loss_theirs = loss.item()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return dict(loss_fused=loss_ours, loss_torch=loss_theirs, max_param_diff=diff,
                step_ms_fused=statistics.median(t_ours) * 1e3, step_ms_torch=statistics.median(t_theirs) * 1e3,
                backend=ours.backend.get("cpu", "?"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args(argv)
    r = fused_vs_torch(a.steps)
    print(f"FusedAdamW (backend={r['backend']}) vs torch.optim.AdamW, {a.steps} steps of a 3-layer MLP")
    print(f"  final loss: FusedAdamW {r['loss_fused']:.6f} | torch AdamW {r['loss_torch']:.6f}")
    print(f"  max |param difference|: {r['max_param_diff']:.2e}")
    print(f"  optimizer step (median): FusedAdamW {r['step_ms_fused']:.2f} ms | torch AdamW "
          f"{r['step_ms_torch']:.2f} ms | ratio {r['step_ms_torch'] / r['step_ms_fused']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
