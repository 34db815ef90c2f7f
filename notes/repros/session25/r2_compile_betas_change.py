"""FusedAdamW under torch.compile(opt.step) (default Inductor): changing param_groups[i]['betas'] between steps
(a beta scheduler, e.g. beta2 warm-up) is silently ignored/mis-applied: the compiled step drifts from eager
FusedAdamW and from torch.optim.AdamW (eager or compiled). Changing lr or weight_decay the same way is fine.
Run: cd /tmp/probeT/repros && PYTHONPATH=/work/main TORCH_EXTENSIONS_DIR=/tmp/torch_ext_main TRITON_INTERPRET=1 \
     nice -n 19 python r2_compile_betas_change.py
"""
import torch, zero_kernels as zk
torch.manual_seed(0)
p0 = torch.randn(64); grads = [torch.randn(64) for _ in range(6)]
BETAS = [(0.9, 0.999), (0.9, 0.999), (0.8, 0.99), (0.95, 0.95), (0.85, 0.98), (0.9, 0.9)]
def run(make, compiled):
    p = p0.clone().requires_grad_(True); opt = make([p]); step = torch.compile(opt.step) if compiled else opt.step
    for i in range(6):
        p.grad = grads[i].clone(); opt.param_groups[0]["betas"] = BETAS[i]; step()
    return p.detach()
fused = lambda ps: zk.FusedAdamW(ps, lr=1e-2, weight_decay=0.1, backend="reference")
ref = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
e, c, t, tc = run(fused, False), run(fused, True), run(ref, False), run(ref, True)
print("eager FusedAdamW vs torch AdamW     :", (e - t).abs().max().item())
print("compiled torch AdamW vs torch AdamW :", (tc - t).abs().max().item())
print("compiled FusedAdamW vs eager Fused  :", (c - e).abs().max().item(), "(expected 0)")
