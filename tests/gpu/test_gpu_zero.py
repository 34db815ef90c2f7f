"""ZeRO stages 1-3 on NCCL (world size 1, one GPU): NCCL takes only CUDA tensors, so every tensor the
ZeRO layer hands a collective (flags, step counts, norms, buckets) must live on the GPU; and the
result equals torch.optim.AdamW on the same model. Skipped with the reason without CUDA."""
import copy
import datetime
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu  # noqa: E402

pytestmark = _gpu.MARKS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def nccl_world1():
    if not dist.is_nccl_available():
        pytest.skip("torch was built without NCCL")
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_on_nccl_world1_matches_adamw(stage, nccl_world1):
    import zero_kernels as zk
    from test_collectives import _Recorder     # the recording wrapper over torch.distributed calls
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(37, 129), torch.nn.GELU(), torch.nn.Linear(129, 11)).cuda()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    rec = _Recorder()
    with rec:
        zopt = zk.ZeroAdamW(model, stage=stage, lr=1e-2, weight_decay=0.1, bucket_size=4096, timeout=60)
        for s in range(5):
            x = torch.randn(8, 37, device="cuda", generator=torch.Generator("cuda").manual_seed(s))
            for m in (model, ref):
                m(x).square().mean().backward()
            zopt.clip_grad_norm_(0.5)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            zopt.step()
            ref_opt.step()
            zopt.zero_grad()
            ref_opt.zero_grad()
        full = zopt.full_model_state_dict()
    # at world size 1 the ZeRO layer may skip collectives; whatever it does send must be on the GPU,
    # and the one place that decides the communication device must say CUDA for this NCCL group
    from zero_kernels.zero import collectives as C
    assert C.comm_device(None, torch.device("cpu")).type == "cuda"
    wrong = [(k, d) for k, d in rec.seen if d.type != "cuda"]
    assert not wrong, wrong[:5]
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6)


def coded_slices_equal_the_codec(stage: int, device: str, backend: str) -> int:
    """tests/test_zero_coded.py's slice check on ``device``: every format, 3 steps; each bucket's slice after
    ZeroAdamW.step equals codecs.adam_step_coded on the slice's snapshot, bit for bit. Returns the slices checked."""
    import test_zero_coded as T          # tests/ is on sys.path (test_collectives above)
    checked = 0
    for pdt, m, v, rem in T.FORMATS:
        model = T._model().to(device)
        z = T._zopt(model, stage, pdt, m, v, rem, backend=backend, timeout=60)
        for step in range(1, 4):
            T._loss(model, T._batch(0, step, pdt).to(device)).backward()
            z.clip_grad_norm_(1e30)                      # reduces now: the slices' gradients are readable
            snaps = T._snapshot(z)
            z.step()
            z.zero_grad()
            for b, snap in zip(z.buckets, snaps):
                if not b.pieces:
                    continue
                want, got = T._reference_step(b, snap, step), T._actual(b)
                for k in got:
                    assert got[k].device.type == device, (k, got[k].device)
                    assert T._bits_equal(got[k].cpu(), want[k].cpu()), (stage, pdt, m, v, rem, step, b.index, k)
                checked += 1
        z.remove_hooks()
    return checked


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_coded_states_on_nccl_world1_equal_the_codec(stage, nccl_world1):
    """ZeRO with coded states (8-bit, bf16, float8 moments, remainders) on CUDA over NCCL, the default backend
    (Triton): the slices equal the codec reference on CUDA bit for bit (tested on CPU in tests/test_zero_coded.py)."""
    assert coded_slices_equal_the_codec(stage, "cuda", "auto") > 0
