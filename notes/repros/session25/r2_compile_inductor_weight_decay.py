# torch.compile (default inductor backend) of opt.step with a float lr that a scheduler changes:
# from the 3rd call on, zk.FusedAdamW applies a stale weight-decay factor (1 - lr*wd) instead of the current one.
import torch, zero_kernels as zk
for name in ["torch", "zk"]:
    torch._dynamo.reset()
    p = torch.nn.Parameter(torch.ones(1000))
    Opt = torch.optim.AdamW if name == "torch" else zk.FusedAdamW
    o = Opt([p], lr=0.1, weight_decay=0.5, **({"backend": "cpu"} if name == "zk" else {}))
    step = torch.compile(o.step)          # inductor
    print(name)
    for lr in [0.1, 0.2, 0.3, 0.4, 0.5]:
        o.param_groups[0]["lr"] = lr      # what every LR scheduler does (float lr)
        p.grad = torch.zeros(1000)        # zero grad: the whole step is p *= (1 - lr*wd)
        before = p.detach().clone(); step()
        print(f"  lr={lr}: expected decay {1 - lr * 0.5:.4f}, applied {(p.detach() / before)[0].item():.4f}")
