# torch.distributed.checkpoint.state_dict get/set_optimizer_state_dict round trip with uint8 moments.
import torch, torch.nn as nn, zero_kernels as zk
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
def mk():
    torch.manual_seed(0); m = nn.Linear(64, 64)
    return m, zk.FusedAdamW(m.parameters(), lr=1e-3, backend="cpu",
                            exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
m, o = mk()
m(torch.randn(4, 64)).sum().backward(); o.step()
osd = get_optimizer_state_dict(m, o)          # FQN-keyed; torch keeps only "state" and "param_groups"
print("top-level keys:", list(osd), "| plain state_dict keys:", list(o.state_dict()))
m2, o2 = mk()
set_optimizer_state_dict(m2, o2, osd)          # ValueError: "... carry no code tag (saved by a zero_kernels build before the tag) ..."
print("loaded OK")
