# torch.autograd.graph.save_on_cpu: WHERE=whole (around the model call) | inner (inside each block's forward); AUX=1 aux terms
import os
from common import *
from torch.autograd.graph import save_on_cpu
ZKW = dict(stage=3)
WHERE = os.environ.get("WHERE", "whole"); AUX = os.environ.get("AUX", "0") == "1"
class SBlock(Block):
    def forward(s, x):
        if WHERE == "inner":
            with save_on_cpu(pin_memory=False):
                h = x + s.l2(torch.tanh(s.l1(x)))
                if AUX: s.aux = s.l1.weight.pow(2).mean()
        else:
            h = x + s.l2(torch.tanh(s.l1(x)))
            if AUX: s.aux = s.l1.weight.pow(2).mean()
        return h
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.inp = nn.Linear(8, 16); s.blocks = nn.ModuleList([SBlock(), SBlock(), SBlock()]); s.out = nn.Linear(16, 4)
    def forward(s, x):
        h = s.inp(x)
        for b in s.blocks: h = b(h)
        o = s.out(h)
        if AUX: o = o + 0.1 * sum(b.aux for b in s.blocks)
        return o
def make_model(): return M()
def loop(ctx):
    for i, (x, y) in enumerate(batches(4)):
        if WHERE == "whole":
            with save_on_cpu(pin_memory=False): out = ctx.model(ctx.shard(x))
        else: out = ctx.model(ctx.shard(x))
        loss = ((out - ctx.shard(y)) ** 2).mean()
        ctx.backward(loss); ctx.step(); ctx.zero_grad()
