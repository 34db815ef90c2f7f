"""The memory model (zero_kernels.memory) and ``python -m zero_kernels.plan`` against background.md.

Every reference figure of ../shared/background.md that the model covers is asserted here. Pure
Python + matplotlib; no torch work, no GPU. 1 GB = 1e9 bytes.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zero_kernels import memory as M
from zero_kernels.plan import main

GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------- model states (the stage table)

def test_sixteen_bytes_per_param_reference_figures():
    ddp_15 = M.model_state_bytes(int(1.5e9), 1, 0)
    assert ddp_15["total"] == pytest.approx(24 * GB)       # GPT-2 1.5B: 16 x 1.5e9 = 24 GB
    assert ddp_15["params"] == pytest.approx(3 * GB)       # ... against 3 GB of fp16 weights
    assert M.model_state_bytes(int(7e9), 1, 0)["total"] == pytest.approx(112 * GB)  # 7B: 112 GB
    assert M.model_state_bytes(int(7e9), 1, 0)["total"] > 80 * GB                  # > one A100
    # per category: 2 + 2 + 4 + 4 + 4
    psi = 1000
    d = M.model_state_bytes(psi, 1, 0)
    assert [d[k] for k in M.CATEGORIES] == [2 * psi, 2 * psi, 4 * psi, 4 * psi, 4 * psi]
    assert set(d) == {*M.CATEGORIES, "total"}


def test_ddp_replicates_everything():
    # 16 GPUs training a 1B model hold 16 x 16 GB = 256 GB, of which only 16 GB is unique.
    per_rank = [M.model_state_bytes(int(1e9), nd, 0)["total"] for nd in (1, 2, 16, 1024)]
    assert per_rank == [16 * GB] * 4
    assert 16 * per_rank[2] == pytest.approx(256 * GB)
    assert 16 * M.model_state_bytes(int(1e9), 16, 3)["total"] == pytest.approx(16 * GB)


@pytest.mark.parametrize("nd", [1, 2, 8, 64, 1000])
def test_stage_formulas(nd):
    psi = 3_000_000_007
    s = {st: M.model_state_bytes(psi, nd, st) for st in range(4)}
    assert s[0]["total"] == pytest.approx(16 * psi)
    assert s[1]["total"] == pytest.approx(2 * psi + 2 * psi + 12 * psi / nd)
    assert s[2]["total"] == pytest.approx(2 * psi + 14 * psi / nd)
    assert s[3]["total"] == pytest.approx(16 * psi / nd)
    # what is sharded at each stage
    assert s[1]["params"] == s[1]["grads"] == 2 * psi
    assert s[1]["master_params"] == pytest.approx(4 * psi / nd)
    assert s[2]["grads"] == pytest.approx(2 * psi / nd) and s[2]["params"] == 2 * psi
    assert s[3]["params"] == pytest.approx(2 * psi / nd)
    for st in range(4):
        assert s[st]["total"] == pytest.approx(sum(s[st][k] for k in M.CATEGORIES))


def test_fp32_without_master():
    psi, nd = 10 ** 9, 4
    fp32 = M.dtype_bytes("fp32")
    s = {st: M.model_state_bytes(psi, nd, st, **fp32) for st in range(4)}
    assert s[0]["total"] == 16 * psi
    assert s[1]["params"] == 4 * psi and s[1]["master_params"] == 0    # the param is the master
    assert s[1]["total"] == pytest.approx(8 * psi + 8 * psi / nd)
    assert s[2]["total"] == pytest.approx(4 * psi + 12 * psi / nd)
    assert s[3]["total"] == pytest.approx(16 * psi / nd)


def test_model_state_bad_input():
    with pytest.raises(ValueError, match="stage"):
        M.model_state_bytes(10, 2, 4)
    with pytest.raises(ValueError, match="world_size"):
        M.model_state_bytes(10, 0, 1)
    with pytest.raises(ValueError, match="psi"):
        M.model_state_bytes(-1, 2, 1)


# ---------------------------------------------------------------- capacity chart

def test_ddp_capacity_flat_near_3_5b():
    caps = [M.max_trainable_params(g, 80 * GB, 0) for g in (1, 2, 4, 8, 64, 256, 1024)]
    assert len(set(caps)) == 1, caps                        # does not grow with GPUs
    assert rel(caps[0], 3.5e9) < 0.05


def test_zero3_capacity_near_175b_at_64_and_linear():
    c64 = M.max_trainable_params(64, 80 * GB, 3)
    assert rel(c64, 175e9) < 0.10, c64
    c = {g: M.max_trainable_params(g, 80 * GB, 3) for g in (16, 32, 64, 128, 256, 512, 1024)}
    for g in (64, 128, 256, 512, 1024):      # doubling GPUs doubles capacity (block buffer capped)
        assert c[g] / c[g // 2] == pytest.approx(2.0, rel=0.02), (g, c)
    # stages 1 and 2 saturate at 56 GB / 4 B and / 2 B: the unsharded params (+ grads)
    assert rel(M.max_trainable_params(1024, 80 * GB, 1), 14e9) < 0.01
    assert rel(M.max_trainable_params(1024, 80 * GB, 2), 28e9) < 0.01
    # ordering at scale
    caps = [M.max_trainable_params(64, 80 * GB, s) for s in range(4)]
    assert caps == sorted(caps)


def test_capacity_is_the_largest_that_fits():
    for stage in range(4):
        cap = M.max_trainable_params(8, 80 * GB, stage)
        assert M.plan(cap, 8, stage).fits
        assert not M.plan(int(cap * 1.001) + 1, 8, stage).fits


# ---------------------------------------------------------------- activations

def test_activations_gpt2_15b():
    full = M.activation_bytes(32, 1024, 1600, 48)
    assert rel(full, 60 * GB) < 0.05                        # about 60 GB
    ckpt = M.activation_bytes(32, 1024, 1600, 48, checkpointing=True)
    assert rel(ckpt, 8 * GB) < 0.15                         # about 8 GB
    assert ckpt == M.activation_bytes(32, 1024, 1600, 48, checkpointing="sqrt")
    # activations grow as batch x seq x hidden x layers
    assert M.activation_bytes(64, 1024, 1600, 48) == pytest.approx(2 * full)
    assert M.activation_bytes(32, 1024, 1600, 96) == pytest.approx(2 * full)


def test_activations_100b_with_checkpointing():
    # A 100B model (ZeRO paper: 125 layers, hidden 8192) at batch 32 still needs ~60 GB.
    assert rel(M.count_params(125, 8192, 50257), 100e9) < 0.02
    ckpt = M.activation_bytes(32, 1024, 8192, 125, checkpointing=True)
    assert rel(ckpt, 60 * GB) < 0.15


def test_activation_options():
    base = M.activation_bytes(32, 1024, 1600, 48)
    assert M.activation_bytes(32, 1024, 1600, 48, heads=25) > base       # + attention scores
    layer = M.activation_bytes(32, 1024, 1600, 48, checkpointing="layer")
    assert layer < base
    assert M.activation_bytes(1, 8, 16, 1, checkpointing=True) <= M.activation_bytes(1, 8, 16, 1)
    with pytest.raises(ValueError, match="checkpointing"):
        M.activation_bytes(1, 8, 16, 1, checkpointing="all")
    with pytest.raises(ValueError, match="batch"):
        M.activation_bytes(0, 8, 16, 1)


def test_count_params_gpt2_xl():
    n = M.count_params(48, 1600, 50257, seq=1024, heads=25)
    assert n == 1_557_611_200                                # GPT-2 XL, exactly
    assert rel(M.count_params(48, 1600, 50257), 1.5e9) < 0.05
    assert rel(M.count_params(96, 12288, 50257, seq=2048), 175e9) < 0.01    # GPT-3
    with pytest.raises(ValueError, match="heads"):
        M.count_params(48, 1600, 50257, heads=7)


# ---------------------------------------------------------------- 3D parallelism

def test_3d_parallel_dp_size():
    assert M.data_parallel_size(64, tp=8, pp=8) == 1       # nothing for ZeRO to shard
    assert M.data_parallel_size(128, tp=8, pp=8) == 2
    with pytest.raises(ValueError, match="divisible"):
        M.data_parallel_size(100, tp=8, pp=8)
    psi = int(175e9)
    # DP = 1: every stage holds the same as DDP, each GPU Ψ/64 of the model
    at64 = [M.plan(psi, 64, s, tp=8, pp=8) for s in range(4)]
    assert all(p.dp == 1 for p in at64)
    assert len({p.model_states for p in at64}) == 1
    assert at64[0].model_states == pytest.approx(16 * psi / 64)
    # DP = 2: ZeRO-3 halves the model states of one TP x PP slice
    at128 = M.plan(psi, 128, 3, tp=8, pp=8)
    assert at128.dp == 2 and at128.model_states == pytest.approx(16 * psi / 64 / 2)
    assert M.plan(psi, 128, 1, tp=8, pp=8).model_states == pytest.approx(4 * psi / 64 + 12 * psi / 128)


def test_plan_result():
    p = M.plan(int(7e9), 8, 2, activations=10 * GB)
    assert p.total == pytest.approx(p.model_states + p.gather_buffer + p.activations)
    assert p.model_states == pytest.approx(2 * 7e9 + 14 * 7e9 / 8)
    assert p.activations == 10 * GB and p.budget == 80 * GB and p.fits
    assert p.gather_buffer == 0 and p.name == "ZeRO-2"
    assert not M.plan(int(7e9), 1, 0).fits                   # 112 GB on one 80 GB GPU
    assert set(p.categories()) == {*M.CATEGORIES, "gather_buffer", "activations"}


# ---------------------------------------------------------------- the CLI

def test_main_table(capsys):
    assert main(["--params", "7e9", "--gpus", "8", "--gpu-mem", "80"]) == 0
    out = capsys.readouterr().out
    for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "112.00", "fits", "NO", "yes"):
        assert s in out, s
    assert main(["--model", "gpt2-xl", "--gpus", "16", "--batch", "32", "--checkpointing",
                 "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "1,557,611,200" in out and "7.55" in out and "ZeRO-1" not in out
    assert main(["--model", "--layers", "96", "--hidden", "12288", "--heads", "96",
                 "--gpus", "128", "--tp", "8", "--pp", "8", "--param-dtype", "fp32"]) == 0
    assert "DP 2 x TP 8 x PP 8" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--params", "7e9", "--gpus", "100", "--tp", "8", "--pp", "8"], "--gpus 100 is not divisible"),
    (["--gpus", "8"], "exactly one of --params"),
    (["--params", "7e9", "--model", "gpt2-xl"], "exactly one of --params"),
    (["--params", "lots"], "invalid parameter count"),
    (["--params", "7e9", "--stage", "4"], "--stage"),
    (["--params", "7e9", "--batch", "8"], "--seq"),
    (["--params", "7e9", "--checkpointing"], "add --batch"),
    (["--model", "--hidden", "1600"], "--layers"),
    (["--params", "7e9", "--plot", "out.txt"], ".png"),
    (["--params", "7e9", "--param-dtype", "int8"], "--param-dtype"),
    (["--params", "1.5"], "not a whole number of parameters"),
    (["--params", "7e9", "--inter-bw", "50"], "--inter-bw only affects the step-time model: add --simulate"),
    (["--params", "7e9", "--gpus-per-node", "4", "--tokens", "8"], "--gpus-per-node, --tokens only affect"),
])
def test_main_bad_flags(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err, err


def test_plot_png(tmp_path):
    import matplotlib.image

    out = tmp_path / "plan.png"
    assert main(["--model", "gpt2-xl", "--gpus", "64", "--batch", "32", "--checkpointing",
                 "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert len(data) > 10_000 and data[:8] == PNG_MAGIC
    img = matplotlib.image.imread(str(out))
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 600


def test_reduce_dtype_is_zero_adamw_default(capsys):
    """The planner's default gradient-shard dtype is ZeroAdamW's reduce_dtype default (fp32): 2Ψ + 16Ψ/Nd at
    stage 2, 18Ψ/Nd at stage 3 with bf16 parameters (memory_report measures the same, tests/test_zero3.py);
    --reduce-dtype bf16 gives the paper's 2Ψ + 14Ψ/Nd and 16Ψ/Nd. The planner said 26.25 / 14.00 GB for 7B
    on 8 GPUs where ZeroAdamW at its defaults holds 28.00 / 15.75."""
    from zero_kernels.zero.config import ZeroConfig
    import torch
    assert ZeroConfig.__dataclass_fields__["reduce_dtype"].default == torch.float32
    psi, nd = 8192, 2
    fp32 = M.dtype_bytes("bf16", reduce="fp32")
    assert M.model_state_bytes(psi, nd, 2, **fp32)["total"] == 2 * psi + 16 * psi / nd
    assert M.model_state_bytes(psi, nd, 3, **fp32)["total"] == 18 * psi / nd
    assert M.model_state_bytes(psi, nd, 1, **fp32)["grads"] == 2 * psi        # stage 1: full bf16 gradients
    bf16 = M.dtype_bytes("bf16", reduce="bf16")
    assert M.model_state_bytes(psi, nd, 2, **bf16)["total"] == 2 * psi + 14 * psi / nd
    assert M.bytes_per_param(fp32) == 16
    assert main(["--params", "7e9", "--gpus", "8", "--stage", "2"]) == 0
    out = capsys.readouterr().out
    assert "28.00" in out and "grads (bf16; fp32 at 2-3)" in out
    assert main(["--params", "7e9", "--gpus", "8", "--stage", "3", "--reduce-dtype", "bf16"]) == 0
    assert "14.00" in capsys.readouterr().out


def test_subprocess_cli(tmp_path):
    # One subprocess only: `python -m zero_kernels.plan` imports the package, hence torch (slow).
    out = tmp_path / "cap.png"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "-m", "zero_kernels.plan", "--params", "175B", "--gpus",
                        "64", "--stage", "3", "--plot", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ZeRO-3" in r.stdout and "DDP" not in r.stdout and out.read_bytes()[:8] == PNG_MAGIC


def test_tp_pp_error_names_flags_and_fix(capsys):
    assert main(["--params", "7e9", "--gpus", "100", "--tp", "8", "--pp", "8"]) == 2
    err = capsys.readouterr().err
    assert "--tp 8 x --pp 8 = 64" in err and "64 or 128" in err


@pytest.mark.parametrize("argv, says", [
    (["--params", "-7e9"], "argument --params: parameter count must be >= 1, got '-7e9'"),
    (["--params", "-7B"], "argument --params: parameter count must be >= 1, got '-7B'"),
    (["--params", "7e9", "--gpu-mem", "-1e3"], "argument --gpu-mem: expected a positive number, got '-1e3'"),
    (["--params", "7e9", "--reserve", "-0.5"], "--reserve must be a fraction in [0, 1), got -0.5"),
])
def test_negative_values_get_the_options_own_message(argv, says, capsys):
    # argparse reads '-7e9' after an option as another option ("expected one argument"); _cli.parse_args
    # hands it to the option, whose check names the value
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "expected one argument" not in err


def _table_capacities(out: str) -> list[str]:
    row = next(ln for ln in out.splitlines() if ln.startswith("largest model on"))
    return row.split()[-4:]


def test_chart_uses_the_tables_activation_model(capsys, tmp_path):
    # gpt2-xl on 16 GPUs, batch 32: the chart's capacity at the requested GPU count is the table's
    # "largest model" (it once assumed a 30% reserve instead of the modelled batch: 3.5B vs 4.53B)
    import argparse
    from zero_kernels import plan as P
    argv = ["--model", "gpt2-xl", "--gpus", "16", "--batch", "32"]
    assert main(argv) == 0
    table = _table_capacities(capsys.readouterr().out)
    args = P.build_parser().parse_args(argv)
    cfg = P._resolve(args, P.build_parser())
    series = P.capacity_series(args, cfg)
    at16 = [P.fmt_params(dict(series[s])[16]) for s in range(4)]
    assert at16 == table
    # negative control: the reserve-only model (what the chart used before) disagrees with the table
    reserve_only = P.capacity(16, 0, args, cfg, None)
    assert P.fmt_params(reserve_only) != table[0]
    assert isinstance(args, argparse.Namespace)


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    # a subprocess where importing matplotlib fails: the error names the extra to install, no traceback
    code = ("import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.backend_bases'] = None\n"
            "from zero_kernels.plan import main\n"
            f"sys.exit(main(['--params', '7e9', '--gpus', '8', '--plot', {str(tmp_path / 'p.png')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "zero_kernels[plot]" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("states,remainders,k", [("fp32", False, 12), ("bf16", False, 8),
                                                  ("8bit", False, 4 + 2 * (1 + 4 / 256)),
                                                  ("8bit", True, 2 + 2 * (1 + 4 / 256))])
def test_state_formats_k(states, remainders, k, capsys):
    nb = M.dtype_bytes("bf16", states, remainders)
    assert nb["master_bytes"] + nb["optim_bytes"] == pytest.approx(k)
    # issue #11's targets: 8-bit moments <= 6.1, + remainders <= 4.1 bytes of state per parameter
    assert nb["master_bytes"] + nb["optim_bytes"] <= {12: 12, 8: 8}.get(round(k), 6.1 if not remainders else 4.1)
    argv = ["--params", "7e9", "--gpus", "8", "--states", states] + (["--remainders"] if remainders else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"K = {k:.3g}" in out
    # the master's row names what it holds
    assert ("master remainders (int16)" in out) == remainders and ("master params (fp32)" in out) != remainders
    # ZeRO-3 per-rank states follow K: 2Ψ params + 2Ψ grads + KΨ, over 8 ranks
    p = M.plan(7_000_000_000, 8, 3, states=states, remainders=remainders)
    assert p.model_states == pytest.approx((4 + k) * 7e9 / 8)


def test_remainders_need_bf16(capsys):
    with pytest.raises(ValueError, match="need bf16"):
        M.dtype_bytes("fp16", "fp32", True)
    assert main(["--params", "7e9", "--param-dtype", "fp32", "--remainders"]) == 2
    assert "--remainders needs --param-dtype bf16" in capsys.readouterr().err


def test_simulate_options_list_matches_the_parser():
    """simulate.OPTION_DESTS (what plan refuses without --simulate) is exactly the step-time group's options."""
    import argparse
    from zero_kernels import simulate as S
    p = argparse.ArgumentParser()
    S.add_arguments(p, int, float)
    dests = {a.dest for a in p._actions} - {"help", "simulate"}
    assert dests == set(S.OPTION_DESTS)
    assert main(["--params", "7e9", "--gpus", "16", "--inter-bw", "50", "--simulate"]) == 0   # with it: fine


@pytest.mark.parametrize("tool", ["plan", "report", "checkpoint"])
def test_closed_stdout_is_not_a_traceback(monkeypatch, tmp_path, tool):
    """`python -m zero_kernels.plan ... | head -1` (and `.report`, `.checkpoint inspect`): the reader leaves, the
    write fails with BrokenPipeError; the tool stops quietly (was a traceback and 'Exception ignored' at exit)."""
    from zero_kernels import checkpoint_tools, report
    sink = open(tmp_path / "fd", "w")

    class Gone:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            return sink.fileno()

    if tool == "checkpoint":     # inspect prints the metadata first; this stand-in prints like it
        monkeypatch.setattr(checkpoint_tools, "inspect", lambda path: print("checkpoint", path))
    monkeypatch.setattr(sys, "stdout", Gone())
    run = {"plan": lambda: main(["--params", "7e9"]), "report": lambda: report.main(["--no-compile"]),
           "checkpoint": lambda: checkpoint_tools.main(["inspect", str(tmp_path)])}[tool]
    assert run() == 0
    sink.close()
