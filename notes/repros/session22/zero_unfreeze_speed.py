"""ZeroAdamW coded states: step time before a freeze, and after the frozen parameter is trained again (its step count
now differs from the rest of its bucket's, so param_runs gives several runs and every later step takes
step_decoded_slice: decode the whole slice, fp32 step, encode again)."""
import sys, time, statistics, warnings, torch, torch.nn as nn, zero_kernels as zk
from zero_kernels.zero import step as zstep
import dist_util
warnings.simplefilter("ignore")
def job(rank, world, stage, fmt):
    kw = {"u8": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8), "fp32": {},
          "bf16": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)}[fmt]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))
    zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-3, **kw)
    calls = {"decoded": 0}
    orig = zstep.step_decoded_slice
    def counting(*a, **k):
        calls["decoded"] += 1; return orig(*a, **k)
    zstep.step_decoded_slice = counting
    x = torch.randn(8, 1024); y = torch.randn(8, 8)
    def timed(n):
        ts = []
        for _ in range(n):
            ((model(x) - y) ** 2).mean().backward()
            torch.distributed.barrier(); t0 = time.perf_counter(); zopt.step(); ts.append(time.perf_counter() - t0)
            zopt.zero_grad()
        return statistics.median(ts) * 1e3
    a = timed(8); c0 = calls["decoded"]
    model[2].bias.requires_grad_(False); timed(3)
    model[2].bias.requires_grad_(True)
    b = timed(8); c1 = calls["decoded"]
    if rank == 0:
        print(f"stage{stage} {fmt}: step {a:.1f} ms before the freeze (decoded-path calls {c0}); {b:.1f} ms after the "
              f"unfreeze (decoded-path calls during those 8 steps: {c1 - c0}); steps now {sorted(set(zopt.steps))}", flush=True)
if __name__ == "__main__":
    dist_util.run(job, 2, int(sys.argv[1]), sys.argv[2])
