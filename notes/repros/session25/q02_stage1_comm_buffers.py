import torch, torch.distributed as dist, zero_kernels as zk
dist.init_process_group("gloo"); rank = dist.get_rank()
for stn in (True, False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
    P = sum(p.numel() for p in model.parameters())
    z = zk.ZeroAdamW(model, stage=1)
    for _ in range(3):
        model(torch.randn(4, 1024)).pow(2).mean().backward()
        gr = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
        z.step(); z.zero_grad(set_to_none=stn)
    r = z.memory_report()
    if rank == 0:
        print(f"stage 1 fp32 params, zero_grad(set_to_none={stn}): report total {r['total']/P:.2f} B/param, predicted {r['predicted']['total']/P:.2f}, "
              f"comm_buffers {r['comm_buffers']/P:.2f} B/param, p.grad held before step {gr/P:.2f} B/param -> sum {(r['total']+r['comm_buffers']+ (gr if r['grads']==0 else 0))/P:.2f} (DDP: 16)")
    z.remove_hooks()
dist.destroy_process_group()
