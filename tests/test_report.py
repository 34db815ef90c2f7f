"""``python -m zero_kernels.report``: the environment report says what runs here and why the rest does not."""
import json
import os
import subprocess
import sys


def _report(*args, **env):
    e = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-m", "zero_kernels.report", "--json", *args], env=e,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_report_names_backends_and_simd_path():
    d = _report()
    ext = d["extension"]
    assert ext["loaded"] is True
    assert ext["cpu_simd_path"] in ("avx512", "avx2", "scalar")
    cpu = d["backends"]["cpu"]
    assert cpu["auto"] == "cpu" and "reference" in cpu["available"]
    assert "cuda" in cpu["unavailable"] and "CUDA tensors" in cpu["unavailable"]["cuda"]
    assert d["distributed"]["backends"]["gloo"] is True
    # the Triton probe compiles ahead of time for both GPU targets without a GPU
    assert d["triton"]["compiles_for"] == {"sm_80": "ok", "sm_90": "ok"}


def test_report_explains_a_missing_extension():
    # negative control: with the extension made unavailable the report says so and why, and auto falls back
    d = _report("--no-compile", ZERO_KERNELS_FORCE_JIT="1", ZERO_KERNELS_NO_JIT="1")
    assert d["extension"]["loaded"] is False
    assert "ZERO_KERNELS_NO_JIT" in d["extension"]["why"]
    assert d["backends"]["cpu"]["auto"] == "reference"
    assert "compiles_for" not in d["triton"]


def test_report_isa_cap_is_visible():
    d = _report("--no-compile", ZERO_KERNELS_CPU_ISA="scalar")
    assert d["extension"]["cpu_simd_path"] == "scalar"


def test_report_names_a_mis_set_variable_instead_of_failing():
    """The tool a bug report starts from reports a mis-set variable as a finding (it died with a traceback)."""
    d = _report("--no-compile", ZERO_KERNELS_CPU_ISA="AVX2")
    assert d["extension"]["loaded"] is False and "ZERO_KERNELS_CPU_ISA='AVX2'" in d["extension"]["why"]
    assert "ZERO_KERNELS_CPU_ISA" in d["backends"]["cpu"]["error"]


def test_report_help_gives_the_whole_first_paragraph():
    r = subprocess.run([sys.executable, "-m", "zero_kernels.report", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "Paste its output into a bug report." in " ".join(r.stdout.split())
    assert "``" not in r.stdout
