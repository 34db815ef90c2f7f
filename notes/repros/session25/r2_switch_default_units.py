"""HF SwitchTransformersForConditionalGeneration (tiny, random init) under ZeroAdamW(stage=3), default units,
world size 2, different data per rank: step 1 ok, step 2's backward times out (CollectiveTimeoutError whose
hint says to wrap the MoE layer, which is already inside its block's unit). stage=1/2 or wrap=lambda m: False match torch.
Run: cd /tmp/probeS/repros && PYTHONPATH=/work/main TORCH_EXTENSIONS_DIR=/tmp/torch_ext_main TRITON_INTERPRET=1 \
     nice -n 19 python r2_switch_default_units.py        # [stage] as argv[1], default 3
"""
import os, sys, socket, copy, torch, torch.distributed as dist, torch.multiprocessing as mp, transformers as T
import zero_kernels as zk
STAGE = int(sys.argv[1]) if len(sys.argv) > 1 else 3
def build():
    torch.manual_seed(0)
    return T.SwitchTransformersForConditionalGeneration(T.SwitchTransformersConfig(
        vocab_size=128, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2,
        num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, num_experts=4, dropout_rate=0.0,
        router_jitter_noise=0.0, expert_capacity=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
def data(s, r): return torch.randint(3, 128, (4, 16), generator=torch.Generator().manual_seed(1000 * s + r))
def loss(m, x): return m(input_ids=x, labels=x.flip(1), output_router_logits=True).loss
def worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = build(); ref = copy.deepcopy(model); ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    zopt = zk.ZeroAdamW(model, stage=STAGE, lr=1e-2, timeout=20, backend="reference")
    try:
        for s in range(3):
            loss(model, data(s, rank)).backward(); zopt.step(); zopt.zero_grad()
            ropt.zero_grad(); (sum(loss(ref, data(s, r)) for r in range(2)) / 2).backward(); ropt.step()
            print(rank, "step", s, "ok", flush=True)
        full = zopt.full_model_state_dict()
        print(rank, "max|diff| vs torch:", max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()), flush=True)
    except Exception as e:
        print(rank, type(e).__name__, str(e), flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(port,), nprocs=2)
