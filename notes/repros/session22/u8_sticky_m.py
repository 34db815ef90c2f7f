"""Minimal repro: FusedAdamW(exp_avg_dtype=torch.uint8): an element whose gradient is exactly 0 while another element
of its 256-block keeps a large gradient never lets its exp_avg decay (int8 code k with round(0.9k) == k for k <= 4),
so it keeps being updated by ~lr * m / sqrt(v) every step, forever. torch.optim.AdamW: m -> 0.9^t m, the update dies."""
import torch, zero_kernels as zk
torch.set_num_threads(1)
for name, mk in (("torch.optim.AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.0)),
                 ("zk u8 (backend=cpu)", lambda ps: zk.FusedAdamW(ps, lr=1e-3, weight_decay=0.0, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
                 ("zk u8 (backend=reference)", lambda ps: zk.FusedAdamW(ps, lr=1e-3, weight_decay=0.0, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, backend="reference"))):
    p = torch.nn.Parameter(torch.zeros(256)); opt = mk([p])
    hist = []
    for i in range(3000):
        g = torch.zeros(256)
        g[0] = 1.0 if i % 2 else -0.5            # element 0 keeps training (holds the block's absmax)
        if i < 20:
            g[1:] = 0.1                          # every other element: a gradient for 20 steps, then exactly 0
        p.grad = g
        opt.step()
        if i in (19, 100, 1000, 2000, 2999):
            hist.append((i, p[1].item()))
    st = opt.state[p]
    m1 = (st["exp_avg"].view(torch.int8)[1].item(), st["exp_avg_scale"][0].item()) if st["exp_avg"].dtype == torch.uint8 else st["exp_avg"][1].item()
    print(f"{name:26s} p[1] at steps {[h[0] for h in hist]}: {[round(h[1], 5) for h in hist]}   exp_avg[1] at the end: {m1}")
