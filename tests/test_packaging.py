"""Packaging: what a regular install (or the wheel) contains, the version, and a loud C++ build failure.

In CI the suite runs against the built wheel installed in a fresh venv (ZK_REQUIRE_INSTALLED=1, see
conftest.py); here the checks compare the importable package with the source tree, so a subpackage
that the wheel leaves out (as zero_kernels.zero once was) fails a test instead of an import at a user's.
"""
import importlib
import importlib.metadata
import os
import subprocess
import sys

import pytest

import zero_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source_subpackages() -> list[str]:
    """Every package of the source tree, as importable names (kernels/ and csrc/ map into zero_kernels)."""
    names = ["zero_kernels", "zero_kernels.kernels", "zero_kernels.csrc"]
    base = os.path.join(ROOT, "zero_kernels")
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and not os.path.islink(os.path.join(dirpath, d))]
        if "__init__.py" in filenames and dirpath != base:
            names.append("zero_kernels." + os.path.relpath(dirpath, base).replace(os.sep, "."))
    return names


@pytest.mark.parametrize("name", _source_subpackages())
def test_every_subpackage_is_importable(name):
    mod = importlib.import_module(name)
    assert mod.__file__ is not None


def test_subpackage_scan_sees_zero_layer():
    # negative control for the scan above: it must list the ZeRO layer, the package a wheel once left out
    assert "zero_kernels.zero" in _source_subpackages()


def test_public_names_and_version():
    for name in ("FusedAdam", "FusedAdamW", "ZeroAdam", "ZeroAdamW", "fused_adam_ref", "compute_coeffs"):
        assert getattr(zero_kernels, name) is not None
    try:
        installed = importlib.metadata.version("zero_kernels")
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("ZK_REQUIRE_INSTALLED") == "1":
            raise
        pytest.skip("zero_kernels is not installed here (source tree on PYTHONPATH): no metadata to compare")
    assert zero_kernels.__version__ == installed


def test_csrc_ships_for_the_jit_fallback():
    from zero_kernels import _build
    assert _build.cpu_sources(), "the C++ sources must ship inside the package for the JIT fallback"


def _setup_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "ZERO_KERNELS_SKIP_EXT"}
    env.update(extra)
    return env


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "setup.py")), reason="no source checkout beside the tests")
def test_build_without_compiler_fails_with_the_missing_piece(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "--name"], cwd=ROOT,
                       env=_setup_env(CXX="zk-no-such-compiler"), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "no C++ compiler" in r.stderr and "zk-no-such-compiler" in r.stderr
    assert "ZERO_KERNELS_SKIP_EXT=1" in r.stderr


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "setup.py")), reason="no source checkout beside the tests")
def test_skip_ext_opt_out_is_explicit():
    # negative control of the test above: the same command with the opt-out goes through and says so
    r = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "--name"], cwd=ROOT,
                       env=_setup_env(CXX="zk-no-such-compiler", ZERO_KERNELS_SKIP_EXT="1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "not building the C++ extension" in r.stderr
    assert r.stdout.strip() == "zero_kernels"


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "setup.py")), reason="no source checkout beside the tests")
@pytest.mark.parametrize("value,skips", [("false", False), ("off", False), ("maybe", None)])
def test_skip_ext_reads_yes_no_values(value, skips):
    """ZERO_KERNELS_SKIP_EXT=false skipped the build (anything but "" and "0" counted as on)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "--name"], cwd=ROOT,
                       env=_setup_env(CXX="zk-no-such-compiler", ZERO_KERNELS_SKIP_EXT=value),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stderr                      # false/off: builds (and needs the compiler)
    want = "no C++ compiler" if skips is False else "ZERO_KERNELS_SKIP_EXT='maybe' is not a yes/no value"
    assert want in r.stderr, r.stderr


def test_environment_variables_are_checked(monkeypatch):
    """A value the package does not understand raises naming the variable (an unknown ZERO_KERNELS_CPU_ISA left the
    kernel uncapped while `report` printed the cap; ZK_GLOO_MODE=bogus ran gloo's native collectives). The
    extension's variables are checked at every use (in this process); ZK_GLOO_MODE at import (a subprocess)."""
    import torch
    import zero_kernels as zk
    from zero_kernels import _env, _ext
    for k in [k for k in os.environ if k.startswith(("ZERO_KERNELS_", "ZK_GLOO"))]:
        monkeypatch.delenv(k)
    for var, value, use, msg in [
            ("ZERO_KERNELS_CPU_ISA", "AVX2", lambda: zk.FusedAdamW([torch.nn.Parameter(torch.ones(3))], backend="cpu"),
             "ZERO_KERNELS_CPU_ISA='AVX2' is not one of scalar, avx2, avx512"),
            ("ZERO_KERNELS_CPU_NT", "2", lambda: zk.FusedAdamW([torch.nn.Parameter(torch.ones(3))]),
             "ZERO_KERNELS_CPU_NT='2' is not one or two 0/1 digits"),
            ("ZERO_KERNELS_NO_JIT", "n", _ext.cpu_module, "ZERO_KERNELS_NO_JIT='n' is not a yes/no"),
            ("ZERO_KERNELS_CPU_ISA", "avx2",                                             # negative control
             lambda: zk.FusedAdamW([torch.nn.Parameter(torch.ones(3))], backend="cpu"), None)]:
        monkeypatch.setenv(var, value)
        if msg is None:
            assert use() is not None
        else:
            with pytest.raises(ValueError) as e:
                use()
            assert msg in str(e.value), (var, value, str(e.value))
        monkeypatch.delenv(var)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_KERNELS_", "ZK_GLOO"))}
    r = subprocess.run([sys.executable, "-c", "import zero_kernels.zero"], env=dict(env, ZK_GLOO_MODE="bogus"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "ZK_GLOO_MODE='bogus' is not one of p2p, allreduce, native" in r.stderr, r.stderr
    for value, want in (("1", True), ("TRUE", True), (" on ", True), ("", False), ("0", False), ("No", False)):
        monkeypatch.setenv("ZK_TEST_FLAG", value)
        assert _env.flag("ZK_TEST_FLAG") is want, value


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, ".ci", "run")), reason="no source checkout beside the tests")
def test_ci_runs_exactly_the_readme_test_command():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = [ln.strip() for ln in f if ln.strip().startswith("pip install torch==") and "pytest" in ln]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [ln.strip() for ln in f if ln.strip().startswith("pip install torch==")]
    assert len(readme) == 1 and len(ci) == 1
    assert readme[0] == ci[0]


_NO_WHEEL_COMMAND = """
import runpy, sys
class _Block:      # an environment whose setuptools predates bdist_wheel (< 70.1) and has no `wheel` package
    def find_spec(self, name, path=None, target=None):
        if name == "wheel" or name.startswith(("wheel.", "setuptools.command.bdist_wheel")):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, _Block())
sys.argv = ["setup.py"] + sys.argv[1:]
runpy.run_path({setup!r}, run_name="__main__")
"""


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "setup.py")), reason="no source checkout beside the tests")
def test_build_without_a_wheel_command_names_the_fix(tmp_path):
    """`pip install --no-build-isolation .` in a fresh venv of Python 3.11 (setuptools 65, no `wheel`) stopped at
    "invalid command 'bdist_wheel'" (a user probe): setup.py names the missing piece and the fix first."""
    code = _NO_WHEEL_COMMAND.replace("{setup!r}", repr(os.path.join(ROOT, "setup.py")))
    r = subprocess.run([sys.executable, "-c", code, "dist_info"], cwd=tmp_path, env=_setup_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no bdist_wheel command" in r.stderr and "setuptools>=70.1" in r.stderr, r.stderr
    # negative control: a command that builds no wheel does not ask for it
    r = subprocess.run([sys.executable, "-c", code, "--name"], cwd=ROOT,
                       env=_setup_env(ZERO_KERNELS_SKIP_EXT="1"), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "zero_kernels", r.stderr
