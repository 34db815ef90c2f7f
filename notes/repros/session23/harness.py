"""Harness: run a scenario on N gloo ranks with ZeroAdamW and compare with one-process torch AdamW."""
import os, sys, socket, traceback, time, datetime, copy
import torch, torch.distributed as dist, torch.multiprocessing as mp

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]

class Ctx:
    def __init__(self, model, opt, rank, world, ref, zopt=None):
        self.model, self.opt, self.rank, self.world, self.ref, self.zopt = model, opt, rank, world, ref, zopt
    def shard(self, t):
        """the local part of a full batch (dim 0)"""
        if self.ref: return t
        n = t.shape[0] // self.world
        return t[self.rank * n:(self.rank + 1) * n]
    def backward(self, loss):
        loss.backward()
    def step(self):
        self.opt.step()
    def zero_grad(self):
        self.opt.zero_grad()
    def clip(self, max_norm):
        if self.ref:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return self.zopt.clip_grad_norm_(max_norm)
    def full_state(self):
        if self.ref:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return {k: v.detach().clone() for k, v in self.zopt.full_model_state_dict().items()}

def _entry(rank, world, port, scenario, zkw, q, tmo):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        import zero_kernels as zk
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=tmo))
        mod = __import__(scenario)
        torch.manual_seed(0)
        model = mod.make_model()
        kw = dict(HP); kw.update(getattr(mod, "ZKW", {})); kw.update(zkw)
        kw.setdefault("timeout", tmo)
        zopt = zk.ZeroAdamW(model, **kw)
        ctx = Ctx(model, zopt, rank, world, False, zopt)
        with torch.autocast('cpu', torch.bfloat16, enabled=os.environ.get('AC') == '1'):
            out = mod.loop(ctx)
        st = ctx.full_state()
        if rank == 0:
            path = f"/tmp/_res_{os.getppid()}_{port}.pt"
            torch.save((st, out), path)
            q.put(("ok", path))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        q.put(("err", rank, traceback.format_exc()))
        q.close(); q.join_thread()
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(1)
    q.close(); q.join_thread()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)

def run_ref(scenario):
    mod = __import__(scenario)
    torch.manual_seed(0)
    model = mod.make_model()
    hp = dict(HP); hp.update({k: v for k, v in getattr(mod, "ZKW", {}).items() if k in HP})
    opt = torch.optim.AdamW(model.parameters(), **hp)
    ctx = Ctx(model, opt, 0, 1, True)
    with torch.autocast('cpu', torch.bfloat16, enabled=os.environ.get('AC') == '1'):
        out = mod.loop(ctx)
    return ctx.full_state(), out

def run_zero(scenario, world=2, timeout=150, tmo=60, **zkw):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, scenario, zkw, q, tmo)) for r in range(world)]
    for p in procs: p.start()
    t0 = time.time(); res = None; errs = []
    while time.time() - t0 < timeout:
        try:
            item = q.get(timeout=1)
            if item[0] == "ok": res = item
            else: errs.append(item)
        except Exception:
            pass
        if errs: break
        if res is not None and all(not p.is_alive() for p in procs): break
        if all(not p.is_alive() for p in procs) and q.empty():
            time.sleep(1)
            if q.empty(): break
    hung = any(p.is_alive() for p in procs) and not errs and res is None
    time.sleep(0.5)
    while not q.empty():
        item = q.get()
        if item[0] == "err": errs.append(item)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    if hung:
        return ("HANG", time.time() - t0)
    if errs:
        return ("ERR", errs)
    if res is None:
        return ("ERR", [("err", -1, "no result; exit codes %s" % [p.exitcode for p in procs])])
    return res

def compare(scenario, world=2, tol=1e-5, **zkw):
    ref_st, ref_out = run_ref(scenario)
    r = run_zero(scenario, world=world, **zkw)
    print(f"== {scenario} world={world} {zkw}")
    if r[0] == "HANG":
        print("  HANG after", r[1]); return r
    if r[0] == "ERR":
        for e in r[1]:
            print(f"  ERROR rank {e[1]}:\n" + e[2][-3000:])
        return r
    st, out = torch.load(r[1]); os.unlink(r[1])
    worst = 0.0
    import re as _re
    ign = os.environ.get("IGNORE")
    for k, v in ref_st.items():
        if ign and _re.search(ign, k): continue
        if k not in st:
            print("  missing key", k); continue
        z = st[k].float()
        d = (z - v.float()).abs().max().item()
        rel = d / max(v.float().abs().max().item(), 1e-12)
        worst = max(worst, rel)
        if rel > tol:
            print(f"  MISMATCH {k}: max abs diff {d:.3e} rel {rel:.3e}")
    print(f"  worst rel diff {worst:.3e}")
    if ref_out is not None or out is not None:
        print("  ref out:", ref_out)
        print("  zk  out:", out)
    return ("OK", worst, ref_out, out)

if __name__ == "__main__":
    sc = sys.argv[1]
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    extra = eval("dict(" + (sys.argv[3] if len(sys.argv) > 3 else "") + ")")
    compare(sc, world=world, **extra)
