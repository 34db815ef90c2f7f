"""The README's demo command runs end to end (a short version) and every ZeRO stage matches the
one-process torch.optim.AdamW reference in its table."""
import os
import re
import subprocess
import sys


def test_demo_table_all_stages_match_reference(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the demo runs the C++ path
    png = tmp_path / "demo.png"
    r = subprocess.run([sys.executable, "-m", "zero_kernels.demo", "--steps", "4", "--nproc", "2",
                        "--plot", str(png)], capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {m.group(1): m for m in re.finditer(r"^(ZeRO-\d|DDP[^|]*?)\s*\| (\S+)\s*\| (\S+)", r.stdout, re.M)}
    assert {"ZeRO-1", "ZeRO-2", "ZeRO-3"} <= set(rows), r.stdout
    for stage in ("ZeRO-1", "ZeRO-2", "ZeRO-3"):
        assert float(rows[stage].group(3)) < 1e-4, f"{stage} drifted from the reference:\n{r.stdout}"
    # the PNG beside the table: loss curves by stage and memory per rank
    import matplotlib.image
    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 300 and img.shape[1] > 600
    assert img[..., :3].std() > 0.05        # not a blank canvas
    assert f"wrote {png}" in r.stdout


def test_demo_refuses_a_bad_plot_path_before_training(tmp_path):
    """--plot into a missing folder or with a non-image name failed with a PIL traceback after the whole run."""
    for bad, msg in ((tmp_path / "no" / "demo.png", "does not exist"), (tmp_path / "demo.txt", "image file name")):
        r = subprocess.run([sys.executable, "-m", "zero_kernels.demo", "--plot", str(bad)], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and msg in r.stderr and "reference:" not in r.stdout, (r.stdout, r.stderr)
