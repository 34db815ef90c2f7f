# MoE / regularizer style: each block computes an auxiliary loss from its own weights inside its forward
# (as the README advises for penalties) and stores it on self; the model sums them into the loss.
# POS=end: computed after the block output; POS=start: before.
import os
from common import *
ZKW = dict(stage=int(os.environ.get("ST", 3)))
POS = os.environ.get("POS", "end")
class ABlock(Block):
    def forward(s, x):
        if POS == "start": s.aux = s.l1.weight.pow(2).sum()
        h = super().forward(x)
        if POS == "end": s.aux = s.l1.weight.pow(2).sum()
        return h
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.inp = nn.Linear(8, 16); s.blocks = nn.ModuleList([ABlock(), ABlock(), ABlock()]); s.out = nn.Linear(16, 4)
    def forward(s, x):
        h = s.inp(x)
        for b in s.blocks: h = b(h)
        return s.out(h) + 1e-3 * sum(b.aux for b in s.blocks)
def make_model(): return M()
def loop(ctx): mse_loop(ctx, n=4)
