"""Repro (finding): ZeroAdamW coded moments of a parameter frozen for many steps drift with their block's scale.
Same model, data and seeds, once with fp32 states and once with coded states; '2.bias' (40 elements, sharing
its 256-element block with trained weights) is frozen from step 20 to step N-1 and then trained again.
Printed: the frozen piece's decoded exp_avg_sq / exp_avg relative to its value at the freeze (torch.optim.AdamW
leaves both untouched), and the size of the first update after unfreezing (coded vs fp32 states)."""
import sys, warnings, torch, torch.nn as nn, zero_kernels as zk
from zero_kernels.zero.coded import decode_slice
import dist_util
warnings.simplefilter("ignore")
FMTS = {"u8": torch.uint8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}

def job(rank, world, stage, N, fmt):
    res = {}
    for name in ("fp32", fmt):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 40), nn.Tanh(), nn.Linear(40, 4))
        zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-3, weight_decay=0.0,
                            exp_avg_dtype=FMTS[name], exp_avg_sq_dtype=FMTS[name])
        fi = [ps.name for ps in zopt.layout.params].index("2.bias")
        fp = dict(model.named_parameters())["2.bias"]
        def mom():
            out = {"exp_avg": [], "exp_avg_sq": []}
            for b in zopt.buckets:
                dec = decode_slice(b.optim.tensors)
                for pc in b.pieces:
                    if pc.param == fi:
                        for k in out:
                            out[k].append(dec[k][pc.start:pc.start + pc.numel])
            return {k: torch.cat(v) if v else torch.zeros(0) for k, v in out.items()}
        g = torch.Generator().manual_seed(100 + rank)
        for i in range(N + 1):
            if i == 20:
                fp.requires_grad_(False)
            if i == N:
                fp.requires_grad_(True)
                full_before = zopt.full_model_state_dict()["2.bias"].clone() if stage == 3 else fp.detach().clone()
                m_end = mom()
            x = torch.randn(16, 32, generator=g); y = torch.randn(16, 4, generator=g)
            ((model(x) - y) ** 2).mean().backward(); zopt.step(); zopt.zero_grad()
            if i == 20:
                m0 = mom()
        after = zopt.full_model_state_dict()["2.bias"] if stage == 3 else fp.detach()
        res[name] = dict(m0=m0, m_end=m_end, upd=(after.float() - full_before.float()))
    for name, r in res.items():
        if r["m0"]["exp_avg_sq"].numel() == 0:
            continue
        v0, v1 = r["m0"]["exp_avg_sq"], r["m_end"]["exp_avg_sq"]
        a0, a1 = r["m0"]["exp_avg"], r["m_end"]["exp_avg"]
        print(f"rank{rank} stage{stage} {name:5s} after {N-21} frozen steps: exp_avg_sq ratio now/at-freeze "
              f"median {torch.median(v1 / v0).item():.3f} [min {(v1/v0).min().item():.3f}, max {(v1/v0).max().item():.3f}]; "
              f"exp_avg max|Δ|/max|m0| {((a1-a0).abs().max()/a0.abs().max()).item():.3f}", flush=True)
    if rank == 0:
        u32, uc = res["fp32"]["upd"], res[fmt]["upd"]
        print(f"stage{stage} first update after unfreezing: |Δp| mean fp32-states {u32.abs().mean():.3e}, {fmt}-states "
              f"{uc.abs().mean():.3e} (ratio {uc.abs().mean()/u32.abs().mean():.3f})", flush=True)

if __name__ == "__main__":
    stage, N, fmt, world = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 2
    dist_util.run(job, world, stage, N, fmt)
