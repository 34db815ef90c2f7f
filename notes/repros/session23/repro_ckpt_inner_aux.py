# ZeRO-3: non-reentrant torch.utils.checkpoint INSIDE a unit's forward, and the checkpointed function also
# stores an auxiliary loss on the module (MoE load-balancing style) that the parent adds to the loss.
# Backward of the aux term triggers the checkpoint's recomputation while the unit is freed -> crash.
import os, datetime, socket, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint
import zero_kernels as zk

class Block(nn.Module):
    def __init__(s): super().__init__(); s.l1 = nn.Linear(16, 16); s.l2 = nn.Linear(16, 16)
    def _f(s, x):
        h = x + s.l2(torch.tanh(s.l1(x)))
        s.aux = s.l1.weight.pow(2).mean()          # aux term from the block's own weights, inside the region
        return h
    def forward(s, x): return checkpoint(s._f, x, use_reentrant=False)

class M(nn.Module):
    def __init__(s): super().__init__(); s.blocks = nn.ModuleList([Block(), Block()]); s.out = nn.Linear(16, 4)
    def forward(s, x):
        for b in s.blocks: x = b(x)
        return s.out(x) + 0.1 * sum(b.aux for b in s.blocks)

def run(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = M()
    zopt = zk.ZeroAdamW(model, stage=3, lr=1e-2, timeout=60)
    model(torch.randn(6, 16)).pow(2).mean().backward()   # RuntimeError: mat2 must be a matrix, got 1-D tensor
    zopt.step()
    print(rank, "ok")
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(run, args=(2, port), nprocs=2)
