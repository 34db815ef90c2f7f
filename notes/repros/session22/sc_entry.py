# CLIP-style: the model is never called as a whole; training calls model.encode_a / encode_b (methods using child units)
# and a root parameter (logit_scale) in the loss. ROOTP=0 drops the root parameter.
import os
from common import *
ZKW = dict(stage=int(os.environ.get("ST", 3)))
ROOTP = os.environ.get("ROOTP", "1") == "1"
class Tower(nn.Module):
    def __init__(s): super().__init__(); s.inp = nn.Linear(8, 16); s.blk = Block(); s.proj = nn.Linear(16, 8)
    def forward(s, x): return F.normalize(s.proj(s.blk(s.inp(x))), dim=-1)
class Clip(nn.Module):
    def __init__(s):
        super().__init__(); s.a = Tower(); s.b = Tower()
        if ROOTP: s.logit_scale = nn.Parameter(torch.tensor(2.0))
    def encode_a(s, x): return s.a(x)
    def encode_b(s, x): return s.b(x)
def make_model(): return Clip()
def loop(ctx):
    g = torch.Generator().manual_seed(3)
    m = ctx.model
    for i in range(4):
        x1 = torch.randn(12, 8, generator=g); x2 = x1 + 0.1 * torch.randn(12, 8, generator=g)
        def closs(x1, x2):
            za, zb = m.encode_a(x1), m.encode_b(x2)
            scale = m.logit_scale.exp() if ROOTP else 5.0
            logits = scale * za @ zb.t()
            lab = torch.arange(logits.shape[0])
            return (F.cross_entropy(logits, lab) + F.cross_entropy(logits.t(), lab)) / 2
        if ctx.ref: loss = (closs(x1[:6], x2[:6]) + closs(x1[6:], x2[6:])) / 2
        else: loss = closs(ctx.shard(x1), ctx.shard(x2))
        loss.backward(); ctx.step(); ctx.zero_grad()
