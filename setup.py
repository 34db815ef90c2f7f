"""Build: ``pip install --no-build-isolation .`` (or ``-e .``, or ``pip wheel --no-build-isolation .``) with torch
already installed (torch==2.13.0 for CPU, or your CUDA build).

The C++ (and, when torch has CUDA and nvcc is found, the CUDA) extension ``zero_kernels._C`` is built with
ninja from the source list in ``zero_kernels/_build.py``, without debug info. A build that cannot happen or
fails stops the install with a message naming the missing piece: it never passes silently. To install
without the extension on purpose set ``ZERO_KERNELS_SKIP_EXT=1``: the package then JIT-builds the same
sources on first use, or falls back to the reference path with a warning (``zero_kernels/_ext.py``).
``python -m zero_kernels.report`` says afterwards what was built and which backends run.
"""
import os
import runpy
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _check_wheel_command() -> None:
    """pip builds a wheel (bdist_wheel), which setuptools has from 70.1 on and older ones take from the `wheel`
    package. --no-build-isolation uses this environment's setuptools, not pyproject's requirements: a venv made by
    Python 3.11 has setuptools 65 and no `wheel`, and distutils said only "invalid command 'bdist_wheel'"."""
    try:
        from setuptools.command.bdist_wheel import bdist_wheel  # noqa: F401  (setuptools >= 70.1)
        return
    except ImportError:
        pass
    try:
        import wheel  # noqa: F401
    except ImportError:
        import setuptools
        raise SystemExit(f"zero_kernels: cannot build a wheel here: setuptools {setuptools.__version__} has no "
                         "bdist_wheel command and the `wheel` package is missing (pip install --no-build-isolation "
                         "builds with this environment's own setuptools).\n  Fix: pip install -U 'setuptools>=70.1' "
                         "(or pip install wheel), then install again.")


if any(a.startswith(("bdist_wheel", "dist_info", "editable_wheel")) for a in sys.argv[1:]):
    _check_wheel_command()
cfg = runpy.run_path(os.path.join(ROOT, "zero_kernels", "_build.py"))
try:
    SKIP_EXT = runpy.run_path(os.path.join(ROOT, "zero_kernels", "_env.py"))["flag"]("ZERO_KERNELS_SKIP_EXT")
except ValueError as e:
    raise SystemExit(f"zero_kernels: {e}")
OPT_OUT = "or set ZERO_KERNELS_SKIP_EXT=1 to install without it (JIT-built on first use)"


def _fail(what: str, fix: str) -> None:
    raise SystemExit(f"zero_kernels: cannot build the C++ extension: {what}.\n  Fix: {fix},\n  {OPT_OUT}.")


def _extension_modules():
    """The extension to build, and the build_ext command; ([], {}) when skipped on request."""
    if SKIP_EXT:
        print("zero_kernels: ZERO_KERNELS_SKIP_EXT=1, not building the C++ extension", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as e:
        _fail(f"torch cannot be imported in the build environment ({e})",
              "pip install torch==2.13.0 (or your CUDA build) first, then pip install --no-build-isolation .")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        _fail(f"no C++ compiler ({cxx!r} is not on PATH)", "install one (Debian/Ubuntu: apt-get install g++)")
    cpu = [os.path.relpath(p, ROOT) for p in cfg["cpu_sources"](ROOT)]
    cu = [os.path.relpath(p, ROOT) for p in cfg["cuda_sources"](ROOT)]
    if not cpu:
        _fail(f"no C++ sources under {os.path.join(ROOT, 'csrc')}", "build from a complete checkout")
    with_cuda = bool(cu) and torch.version.cuda is not None and CUDA_HOME is not None
    try:
        import ninja  # noqa: F401  (the build runs its jobs in parallel through ninja)
    except ImportError:
        if shutil.which("ninja") is None:
            _fail("ninja is missing (without it the build is serial and takes several times longer)",
                  "pip install ninja")
    print(f"zero_kernels: building {cfg['EXT_NAME']} from {len(cpu)} C++"
          + (f" + {len(cu)} CUDA sources" if with_cuda else " sources (no CUDA)")
          + " with ninja, no debug info", file=sys.stderr)
    if with_cuda:
        ext = CUDAExtension(cfg["EXT_NAME"], cpu + cu, define_macros=[("ZK_WITH_CUDA", "1")],
                            extra_compile_args={"cxx": cfg["CXX_FLAGS"], "nvcc": cfg["NVCC_FLAGS"]})
    else:
        ext = CppExtension(cfg["EXT_NAME"], cpu, extra_compile_args={"cxx": cfg["CXX_FLAGS"]})

    class LoudBuildExt(BuildExtension):
        """A failed build stops the install with the compiler's reason and the way out."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - re-raised as an actionable SystemExit
                _fail(f"compiling {ext.name} failed ({type(e).__name__}: {e}); the compiler output is above "
                      "(pip install -v shows it)", "install the missing headers/toolchain it names")

    return [ext], {"build_ext": LoudBuildExt.with_options(use_ninja=True)}


ext_modules, cmdclass = _extension_modules()

# Metadata (name, version, dependencies, extras) lives in pyproject.toml; this file adds what needs code:
# the package map (kernels/ and csrc/ install as zero_kernels.kernels and zero_kernels.csrc) and the extension.
setup(
    # Every subpackage of zero_kernels/ is found (a hand-written list once left out zero_kernels.zero).
    packages=["zero_kernels", "zero_kernels.kernels", "zero_kernels.csrc"]
    + [f"zero_kernels.{p}" for p in find_packages("zero_kernels")],
    package_dir={"zero_kernels": "zero_kernels", "zero_kernels.kernels": "kernels",
                 "zero_kernels.csrc": "csrc"},
    # the C++ sources ship so the JIT fallback can rebuild them after install
    package_data={"zero_kernels": ["py.typed"], "zero_kernels.csrc": ["*.cpp", "*.cu", "*.h", "*.cuh"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
