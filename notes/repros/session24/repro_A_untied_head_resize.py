# Llama (untied lm_head), ZeroAdamW built, then resize_token_embeddings:
#   variant "gathered": stage 3, resize inside zopt.gathered() -> RuntimeError "... Nothing was changed ..."
#       but HF has already swapped model.lm_head for a NEW nn.Linear(64, 100) that ZeroAdamW does not manage;
#       the user catches the error and keeps training: no further error, lm_head is never updated.
#   variant "frozen_emb": embeddings frozen (requires_grad=False) before ZeroAdamW, lm_head trainable;
#       resize after ZeroAdamW at stage STAGE: no error at all, lm_head silently never trained.
#   variant "frozen_emb_gathered": frozen embeddings, stage 3, resize inside zopt.gathered(): no error either.
# usage: python repro_A_untied_head_resize.py gathered|frozen_emb|frozen_emb_gathered [STAGE]
import os, sys, socket, torch, torch.distributed as dist, torch.multiprocessing as mp
import transformers as tf, zero_kernels as zk

def run(rank, port, variant, stage):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2); torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2))
    if variant.startswith("frozen_emb"):
        model.get_input_embeddings().weight.requires_grad_(False)
    zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2, timeout=60)
    try:
        if variant in ("gathered", "frozen_emb_gathered"):
            with zopt.gathered():
                model.resize_token_embeddings(100)
        else:
            model.resize_token_embeddings(100)
        print(f"rank {rank}: resize raised nothing", flush=True)
    except RuntimeError as e:
        print(f"rank {rank}: resize raised: {str(e)[:160]}...", flush=True)
    head = model.lm_head.weight
    managed = any(head is p for g in zopt.param_groups for p in g["params"]) if hasattr(zopt, "param_groups") else "?"
    h0 = head.detach().clone()
    for s in range(3):
        ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(10 * s + rank))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); zopt.step(); zopt.zero_grad()
    print(f"rank {rank}: 3 steps ran, loss {loss.item():.4f}; lm_head {tuple(head.shape)} managed={managed} "
          f"changed by training: {(model.lm_head.weight - h0).abs().max().item():.3g}; "
          f"lm_head.grad norm left over: {None if head.grad is None else head.grad.norm().item():.3g}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(run, args=(port, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3), nprocs=2)
