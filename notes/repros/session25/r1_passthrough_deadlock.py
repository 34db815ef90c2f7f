"""ZeRO-3 default units: a repeated block (leaf unit) whose MoE experts are routed differently by rank and
which returns a tensor it received (T5/Switch-style position_bias pass-through) deadlocks in the first backward
until timeout=. Stages 1/2, and stage 3 with wrap=[MoE] or wrap=lambda m: False, match torch (~2e-7).
Run: cd /tmp/probeS/repros && PYTHONPATH=/work/main TORCH_EXTENSIONS_DIR=/tmp/torch_ext_main TRITON_INTERPRET=1 \
     nice -n 19 python r1_passthrough_deadlock.py           # add 'nopass' to drop the pass-through: then it works
"""
import os, sys, socket, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist, torch.multiprocessing as mp
import zero_kernels as zk
D, E = 16, 4
PASS = "nopass" not in sys.argv

class Expert(nn.Module):
    def __init__(self): super().__init__(); self.fc = nn.Linear(D, D)
    def forward(self, x): return self.fc(x)

class MoE(nn.Module):
    def __init__(self): super().__init__(); self.experts = nn.ModuleList(Expert() for _ in range(E))
    def forward(self, x, route):             # route[i] = expert of row i (top-1, chosen by the data)
        out = torch.zeros_like(x)
        for e in range(E):
            rows = (route == e).nonzero(as_tuple=True)[0]
            if rows.numel(): out = out.index_add(0, rows, self.experts[e](x[rows]))
        return out

class Block(nn.Module):
    def __init__(self): super().__init__(); self.lin = nn.Linear(D, D); self.moe = MoE()
    def forward(self, x, route, pb):
        h = self.lin(x) + pb
        return h + self.moe(h, route), (pb if PASS else None)   # returns pb unchanged, like T5's position_bias

class Model(nn.Module):
    def __init__(self):
        super().__init__(); self.pb = nn.Linear(D, D); self.blocks = nn.ModuleList(Block() for _ in range(2))
    def forward(self, x, route):
        pb = self.pb(x)
        for b in self.blocks:
            x, pb2 = b(x, route, pb)
        return x

def worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0); model = Model()
    zopt = zk.ZeroAdamW(model, stage=3, lr=1e-2, timeout=15, backend="reference")
    print(rank, "units", [n for n, _ in zopt.sharding_units()], flush=True)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(rank))
    route = torch.arange(8) % (E if rank == 0 else E - 1)      # rank 1 never routes to expert 3
    try:
        model(x, route).square().mean().backward(); zopt.step(); zopt.zero_grad()
        print(rank, "step ok", flush=True)
    except Exception as e:
        print(rank, type(e).__name__, str(e)[:700], flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(port,), nprocs=2)
