"""Multi-node launch, for real (issue 12 item 4): two ``torchrun`` launchers on this machine act as two
nodes (c10d rendezvous on loopback, 2 processes each) and train test_zero's TinyLM with hybrid sharding
(mesh (2 nodes, 2 per node)) through tests/scripts/multinode_train.py. The result must equal one process
running torch.optim.AdamW on the whole batch (test_zero's tolerances), and each shard group must lie
inside one node (the replicate dimension is the only one crossing nodes). Negative control: the same
launch with ZeroAdamW over the shard group alone (no replica all-reduce) must fail the comparison."""
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_zero import reference  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "multinode_train.py")
TIMEOUT = 300


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_nodes(tmp_path, stage, *extra):
    out = tmp_path / f"stage{stage}{''.join(extra)}.pt"
    port = _port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["GLOO_SOCKET_IFNAME"] = "lo"            # loopback only
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"zk{port}",
           "--local-addr", "127.0.0.1", "--max-restarts", "0", SCRIPT, str(stage), str(out), *extra]
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for _ in range(2)]
    logs = []
    try:
        for p in nodes:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in nodes:                             # never leave a launcher (or its workers) behind
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    for p, log in zip(nodes, logs):
        assert p.returncode == 0, log[-4000:]
    return torch.load(out, weights_only=False)


def _matches(full, ref):
    for k, v in ref.state_dict().items():
        if k != "pos":
            torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("stage", [3])
def test_two_torchrun_launchers_train_hybrid(tmp_path, stage):
    res = _launch_two_nodes(tmp_path, stage)
    where = res["where"]
    assert sorted(w[0] for w in where) == [0, 1, 2, 3]
    assert sorted(w[1] for w in where) == [0, 0, 1, 1]                  # two nodes, two processes each
    node_of = {w[0]: w[1] for w in where}
    for rank, node, local, shard, shard_world in where:
        assert shard_world == 2 and rank in shard
        assert {node_of[r] for r in shard} == {node}, f"rank {rank}'s shard group {shard} crosses nodes"
    ref, _ = reference({}, 4)
    _matches(res["full"], ref)
    control = _launch_two_nodes(tmp_path, stage, "--shard-only")      # no replica all-reduce
    with pytest.raises(AssertionError):
        _matches(control["full"], ref)
