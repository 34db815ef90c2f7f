# usage: python repro_C_write_lost_while_root_gathered.py a|b   (a: root freed -> IndexError on the placeholder; b: root left gathered by model.transformer(ids) -> write used by the next forward, then silently dropped)
# Stage 3: in-place write to a root parameter outside zopt.gathered(), (a) while the root is freed, (b) while the root
# is left gathered by a unit call outside the forward (model.transformer(ids)). Is the write kept, lost, or refused?
import os, sys, socket, torch, torch.distributed as dist, torch.multiprocessing as mp
import transformers as tf, zero_kernels as zk

def run(rank, port, mode):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2); torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    zopt = zk.ZeroAdamW(model, stage=3, lr=1e-3, timeout=60)
    ids = torch.randint(3, 97, (2, 8)); model.eval()
    try:
        with torch.no_grad():
            if mode == "b":
                model.transformer(input_ids=ids)
            w = model.transformer.wte.weight
            print(f"rank{rank}: wte numel at write time {w.numel()}", flush=True)
            w[5].fill_(7.0)
            model(input_ids=ids)
        with zopt.gathered():
            v = model.transformer.wte.weight[5, :3].tolist()
        print(f"rank{rank} mode {mode}: no error; wte[5,:3] afterwards = {v} (7.0 = write kept)", flush=True)
    except Exception as e:
        print(f"rank{rank} mode {mode}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(run, args=(port, sys.argv[1]), nprocs=2)
