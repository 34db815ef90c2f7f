import torch, torch.nn as nn, torch.nn.functional as F
B = 12
def batches(n, din=8, dout=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, din, generator=g), torch.randn(B, dout, generator=g)) for _ in range(n)]
def mse_loop(ctx, n=5, after_step=None, before_step=None):
    for i, (x, y) in enumerate(batches(n)):
        loss = ((ctx.model(ctx.shard(x)) - ctx.shard(y)) ** 2).mean()
        ctx.backward(loss)
        if before_step: before_step(ctx, i)
        ctx.step(); ctx.zero_grad()
        if after_step: after_step(ctx, i)
class Block(nn.Module):
    def __init__(s, d=16): super().__init__(); s.l1 = nn.Linear(d, d); s.l2 = nn.Linear(d, d)
    def forward(s, x): return x + s.l2(torch.tanh(s.l1(x)))
def wrap_none(m): return False
def wrap_all(m): return not isinstance(m, (nn.ModuleList, nn.ModuleDict))
def wrap_leaf(m): return len(list(m.children())) == 0
