# Stage 3: calling a sub-module that IS a sharding unit (GPT-2's model.transformer, T5/BART get_encoder(), BERT's
# model.bert) outside the model's forward leaves the ROOT unit gathered afterwards (here the tied embedding / LM head,
# usually the largest tensor of an HF model); a non-unit entry module (model.get_input_embeddings()) frees it.
# usage: python repro_B_root_left_gathered.py
import os, socket, torch, torch.distributed as dist, torch.multiprocessing as mp
import transformers as tf, zero_kernels as zk

def run(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2); torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    zopt = zk.ZeroAdamW(model, stage=3, lr=1e-3, timeout=60)
    g = lambda: zopt.memory_report()["gathered_params"]
    ids = torch.randint(3, 97, (2, 8)); model.eval()
    rep = [f"start {g()}"]
    with torch.no_grad():
        model.get_input_embeddings()(ids); rep.append(f"after wte(ids) {g()}")
        for _ in range(50):
            model.transformer(input_ids=ids)
        rep.append(f"after 50x model.transformer(ids) {g()}")
        rep.append(f"(root unit bytes: wte 97*64*4 = {97*64*4})")
        model(input_ids=ids); rep.append(f"after a full model forward {g()}")
    if rank == 0:
        print("; ".join(rep), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(run, args=(port,), nprocs=2)
