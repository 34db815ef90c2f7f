"""ZeRO-3: a block applied twice in one forward (weight sharing), each call under torch.utils.checkpoint
(use_reentrant=True), with a parameter of that block unused on rank 1 only -> collective timeout (hang) in
the first backward. use_reentrant=False, or no sharing, or every rank using the parameter: matches torch.
Run: cd /tmp/probeT/repros && PYTHONPATH=/work/main TORCH_EXTENSIONS_DIR=/tmp/torch_ext_main TRITON_INTERPRET=1 \
     nice -n 19 python r1_ckpt_shared_rank_unused_hang.py [reentrant|nonreentrant]
"""
import os, sys, socket, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
from torch.utils.checkpoint import checkpoint
import zero_kernels as zk
D = 16
REENTRANT = "nonreentrant" not in sys.argv

class Blk(nn.Module):
    def __init__(self):
        super().__init__(); self.a = nn.Linear(D, D); self.extra = nn.Linear(D, D)
    def forward(self, x, use_extra):
        h = torch.tanh(self.a(x))
        return x + (h + self.extra(h) if use_extra else h)

class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.inp = nn.Linear(D, D); self.blocks = nn.ModuleList(Blk() for _ in range(2)); self.use_extra = True
    def forward(self, x):
        x = self.inp(x)
        for i in [0, 1, 0]:                # blocks[0] shared: applied twice
            x = checkpoint(self.blocks[i], x, self.use_extra, use_reentrant=REENTRANT)
        return x

def worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0); model = Net(); model.use_extra = rank == 0    # rank 1 never uses blocks[*].extra
    zopt = zk.ZeroAdamW(model, stage=3, lr=1e-2, timeout=20, backend="reference")
    print(rank, "units", [n for n, _ in zopt.sharding_units()], flush=True)
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank))
    try:
        model(x).square().mean().backward(); zopt.step(); zopt.zero_grad()
        print(rank, "step ok", flush=True)
    except Exception as e:
        print(rank, type(e).__name__, str(e)[:300], flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(port,), nprocs=2)
