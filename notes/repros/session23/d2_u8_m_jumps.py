# One block: one element with a large gradient, the others with small steady gradients.
import torch, zero_kernels as zk
torch.manual_seed(0)
n = 256
ratio = torch.logspace(0, -5, n)          # element i's gradient magnitude relative to the block max
for fmt_name, fmt in [("fp32", {}), ("u8", dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
                      ("u8 m only", dict(exp_avg_dtype=torch.uint8)), ("u8 v only", dict(exp_avg_sq_dtype=torch.uint8)),
                      ("f8", dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn))]:
    p = torch.nn.Parameter(torch.zeros(n))
    o = zk.FusedAdamW([p], lr=1e-2, weight_decay=0.0, backend="cpu", **fmt)
    worst = []
    for t in range(30):
        p.grad = ratio.clone()                  # constant gradient: fp32 Adam moves every element by exactly lr
        before = p.detach().clone(); o.step()
        worst.append(((p.detach() - before).abs() / 1e-2).max().item())
    print(f"{fmt_name:10s} max |step|/lr per step over 30 steps: max {max(worst):.1f}, per step {[round(w, 1) for w in worst[:10]]}")
    print(f"{'':10s} total movement / (30*lr): min {(p.detach().abs()/0.3).min():.3f} max {(p.detach().abs()/0.3).max():.3f}")
