# Linear(512 -> 64) whose inputs have one outlier feature (x[:, 7] 100x the others), as LLM activations do.
import torch, zero_kernels as zk
for fmt_name, fmt in [("fp32", {}), ("u8", dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)),
                      ("f8", dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e4m3fn))]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 64, bias=False); tgt = torch.nn.Linear(512, 64, bias=False)
    o = zk.FusedAdamW(lin.parameters(), lr=1e-3, weight_decay=0.0, backend="cpu", **fmt)
    g = torch.Generator().manual_seed(1); worst = []
    for t in range(100):
        x = torch.randn(32, 512, generator=g); x[:, 7] *= 100
        loss = (lin(x) - tgt(x).detach()).pow(2).mean(); loss.backward()
        before = lin.weight.detach().clone(); o.step(); o.zero_grad()
        worst.append(((lin.weight.detach() - before).abs() / 1e-3).max().item())
    w = torch.tensor(worst)
    print(f"{fmt_name:5s} max |step|/lr {w.max():.1f}, steps with some element > 5 lr: {(w > 5).sum().item()}/100, final loss {loss.item():.4f}")
