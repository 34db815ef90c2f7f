# ZeRO-3 silent wrong gradient / segfault: a block computes a penalty on a SLICE of its own weight at the end of its
# forward and stores it on itself (self.aux); the model adds it to the loss. Backward reads the saved view of the
# freed/being-regathered parameter buffer before the block's pre-backward hook regathers it.
# Control: STAGE=2 python repro_aux_view.py matches torch.
# Expected (torch.optim.AdamW, one process, whole batch) == ZeRO-3 within ~1e-6. Usage: python repro_aux_view.py [prefetch]
import os, sys, datetime, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import free_port
PREFETCH = int(sys.argv[1]) if len(sys.argv) > 1 else 1
class Block(nn.Module):
    def __init__(s): super().__init__(); s.l1 = nn.Linear(16, 16); s.l2 = nn.Linear(16, 16)
    def forward(s, x):
        h = x + s.l2(torch.tanh(s.l1(x)))
        s.aux = (s.l1.weight[:, :4] ** 2).sum()      # penalty on part of the weight, computed inside the unit's forward
        return h
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.inp = nn.Linear(8, 16); s.blocks = nn.ModuleList([Block() for _ in range(3)]); s.out = nn.Linear(16, 4)
    def forward(s, x):
        h = s.inp(x)
        for b in s.blocks: h = b(h)
        return s.out(h)
def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
def loss_fn(m, x, y): return ((m(x) - y) ** 2).mean() + 1e-2 * sum(b.aux for b in m.blocks)
def main(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    import zero_kernels as zk
    torch.manual_seed(0); m = M()
    st = int(os.environ.get("STAGE", 3))
    zopt = zk.ZeroAdamW(m, stage=st, lr=1e-2, weight_decay=0.0, timeout=60, **({"prefetch": PREFETCH} if st == 3 else {}))
    for x, y in data():
        loss_fn(m, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]).backward(); zopt.step(); zopt.zero_grad()
    sd = zopt.full_model_state_dict()
    if rank == 0: torch.save(sd, "/tmp/_aux_view.pt")
    dist.barrier(); dist.destroy_process_group()
if __name__ == "__main__":
    torch.manual_seed(0); ref = M(); opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for x, y in data():
        # mean of the two half-batch losses == what ZeRO's gradient averaging computes (penalty counted once per rank)
        ((loss_fn(ref, x[:4], y[:4]) + loss_fn(ref, x[4:], y[4:])) / 2).backward(); opt.step(); opt.zero_grad()
    mp.spawn(main, args=(2, free_port(), None), nprocs=2)
    sd = torch.load("/tmp/_aux_view.pt")
    for k, v in ref.state_dict().items():
        d = (sd[k] - v).abs().max().item()
        print(f"{k:22s} max|zero3 - torch| = {d:.3e}" + ("   <-- WRONG" if d > 1e-5 else ""))
