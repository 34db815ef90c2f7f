"""ZeRO-3 default units for hierarchical models: a root child that is an nn.Sequential of repeated *stages*
(timm ConvNeXt/Swin-style `self.stages = nn.Sequential(*stages)`, each stage with `blocks = nn.Sequential(...)`;
or a ResNet `self.body = nn.Sequential(layer1, ..., layer4)`) now gives whole stages as units (leaves), so a
whole stage (all its blocks) is gathered at once. Before commit 7b0ca8e the blocks inside were the units.
Prints units and memory_report()['peak_gathered_params'] after one step, world size 2.
Run: cd /tmp/probeT/repros && PYTHONPATH=/work/main TORCH_EXTENSIONS_DIR=/tmp/torch_ext_main TRITON_INTERPRET=1 \
     nice -n 19 python r3_units_sequential_of_stages.py
"""
import os, socket, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
import zero_kernels as zk
D = 32
class Block(nn.Module):
    def __init__(self): super().__init__(); self.fc1 = nn.Linear(D, 4 * D); self.fc2 = nn.Linear(4 * D, D)
    def forward(self, x): return x + self.fc2(torch.relu(self.fc1(x)))
class Stage(nn.Module):
    def __init__(self): super().__init__(); self.down = nn.Linear(D, D); self.blocks = nn.Sequential(*[Block() for _ in range(4)])
    def forward(self, x): return self.blocks(self.down(x))
class Net(nn.Module):
    def __init__(self): super().__init__(); self.stem = nn.Linear(D, D); self.stages = nn.Sequential(*[Stage() for _ in range(3)]); self.head = nn.Linear(D, 1)
    def forward(self, x): return self.head(self.stages(self.stem(x)))
def worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)); dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0); model = Net(); total = sum(p.numel() * 4 for p in model.parameters()); blk = sum(p.numel() * 4 for p in model.stages[0].blocks[0].parameters())
    zopt = zk.ZeroAdamW(model, stage=3, lr=1e-2, backend="reference", timeout=60)
    zopt.reset_peak_memory(); model(torch.randn(4, D)).square().mean().backward(); zopt.step(); zopt.zero_grad()
    if rank == 0:
        print("units:", [n for n, _ in zopt.sharding_units()])
        print(f"peak_gathered_params={zopt.memory_report()['peak_gathered_params']} bytes; whole model={total}; one block={blk}")
    dist.destroy_process_group()
if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close(); mp.spawn(worker, args=(port,), nprocs=2)
