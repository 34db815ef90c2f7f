# parent uses a child's weight directly: F.linear(h, self.emb.weight) (untied head built from child weight)
import os
from common import *
ZKW = dict(stage=int(os.environ.get("ST", 3)))
V, D = 20, 16
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.emb = nn.Embedding(V, D); s.blocks = nn.ModuleList([Block(D), Block(D)]); s.ln = nn.LayerNorm(D)
    def forward(s, x):
        h = s.emb(x)
        for b in s.blocks: h = b(h)
        return F.linear(s.ln(h), s.emb.weight)
def make_model(): return M()
def loop(ctx):
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randint(0, V, (12, 6), generator=g); y = torch.randint(0, V, (12, 6), generator=g)
        logits = ctx.model(ctx.shard(x))
        loss = F.cross_entropy(logits.reshape(-1, V), ctx.shard(y).reshape(-1))
        ctx.backward(loss); ctx.step(); ctx.zero_grad()
