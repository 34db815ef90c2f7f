# MoE: top-1 router, experts used differently on each rank (data-dependent), load-balancing aux loss stored on the
# module (self.aux_loss) and added by the model; z-loss from router weights. Experts inside the MoE unit (ModuleList of
# >=2 same-class -> nested units!).
import os
from common import *
ZKW = dict(stage=3)
E = 4
class Expert(nn.Module):
    def __init__(s): super().__init__(); s.w1 = nn.Linear(16, 32); s.w2 = nn.Linear(32, 16)
    def forward(s, x): return s.w2(F.gelu(s.w1(x)))
class MoE(nn.Module):
    def __init__(s): super().__init__(); s.router = nn.Linear(16, E, bias=False); s.experts = nn.ModuleList([Expert() for _ in range(E)])
    def forward(s, x):
        logits = s.router(x); p = logits.softmax(-1); top = p.argmax(-1)
        out = torch.zeros_like(x)
        for e in range(E):
            m = top == e
            if m.any(): out[m] = s.experts[e](x[m]) * p[m, e:e+1]
        frac = torch.stack([(top == e).float().mean() for e in range(E)])
        s.aux_loss = E * (frac * p.mean(0)).sum() + 1e-3 * s.router.weight.pow(2).sum()
        return x + out
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.inp = nn.Linear(8, 16); s.moes = nn.ModuleList([MoE(), MoE()]); s.out = nn.Linear(16, 4)
    def forward(s, x):
        h = s.inp(x)
        for m in s.moes: h = m(h)
        return s.out(h), sum(m.aux_loss for m in s.moes)
def make_model(): return M()
def loop(ctx):
    # per-sample losses only (aux computed per rank is not batch-linear, so give each rank the whole batch for aux?)
    # -> use identical batches on every rank (world-replicated data): rank-mean == whole-batch loss exactly
    for i, (x, y) in enumerate(batches(4)):
        o, aux = ctx.model(x)
        loss = ((o - y) ** 2).mean() + 0.01 * aux
        ctx.backward(loss); ctx.step(); ctx.zero_grad()
