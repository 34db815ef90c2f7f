import datetime, os, socket, sys, traceback, torch, torch.distributed as dist, torch.multiprocessing as mp
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]
def _entry(rank, world, port, fn, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc(); sys.stdout.flush(); os._exit(1)
    dist.barrier(); dist.destroy_process_group()
def run(fn, world, *args):
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
