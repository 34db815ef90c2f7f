# unit outputs real code produces: a dataclass (not dict/tuple) output (OUT=dc), in-place ops on unit outputs (OUT=inplace),
# a tensor subclass container (OUT=obj)
import os, dataclasses
from common import *
ZKW = dict(stage=int(os.environ.get("ST", 3)))
OUT = os.environ.get("OUT", "dc")
@dataclasses.dataclass
class BOut:
    h: torch.Tensor
    aux: torch.Tensor
class DBlock(Block):
    def forward(s, x):
        h = super().forward(x)
        if OUT == "dc": return BOut(h, h.pow(2).mean())
        return h
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.inp = nn.Linear(8, 16); s.blocks = nn.ModuleList([DBlock(), DBlock(), DBlock()]); s.out = nn.Linear(16, 4)
    def forward(s, x):
        h = s.inp(x); aux = 0
        for b in s.blocks:
            o = b(h)
            if OUT == "dc": h, aux = o.h, aux + o.aux
            elif OUT == "inplace":
                h = o; h.mul_(0.9); h += 0.01
            else: h = o
        return s.out(h) + 0.01 * aux
def make_model(): return M()
def loop(ctx): mse_loop(ctx, n=4)
