"""Build: ``pip install --no-build-isolation .`` (or ``-e .``) with torch==2.13.0 already installed.

The C++ (and, when torch has CUDA, the CUDA) extension ``zero_kernels._C`` is built with ninja from
the source list in ``zero_kernels/_build.py``. A failed or impossible build does not fail the
install: the package JIT-builds the same sources on first use, or falls back to the reference path
with a warning (see ``zero_kernels/_ext.py``).
"""
import os
import runpy
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
cfg = runpy.run_path(os.path.join(ROOT, "zero_kernels", "_build.py"))

ext_modules, cmdclass = [], {}
try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME

    cpu = [os.path.relpath(p, ROOT) for p in cfg["cpu_sources"](ROOT)]
    cu = [os.path.relpath(p, ROOT) for p in cfg["cuda_sources"](ROOT)]
    with_cuda = bool(cu) and torch.version.cuda is not None and CUDA_HOME is not None
    if cpu or (with_cuda and cu):
        if with_cuda:
            ext_modules.append(CUDAExtension(
                cfg["EXT_NAME"], cpu + cu, define_macros=[("ZK_WITH_CUDA", "1")],
                extra_compile_args={"cxx": cfg["CXX_FLAGS"], "nvcc": cfg["NVCC_FLAGS"]}))
        else:
            ext_modules.append(CppExtension(cfg["EXT_NAME"], cpu,
                                            extra_compile_args={"cxx": cfg["CXX_FLAGS"]}))

    class TolerantBuildExt(BuildExtension):
        """Never fail the install over the extension: the JIT fallback will retry at first use."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # noqa: BLE001
                print(f"WARNING: zero_kernels C++ extension not built ({e}); "
                      "it will be JIT-built on first use.", file=sys.stderr)

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001
                print(f"WARNING: building {ext.name} failed ({e}); "
                      "it will be JIT-built on first use.", file=sys.stderr)

    cmdclass = {"build_ext": TolerantBuildExt.with_options(use_ninja=True)}
except ImportError:
    print("WARNING: torch is not installed in the build environment; skipping the C++ extension. "
          "Install torch==2.13.0 first and use --no-build-isolation.", file=sys.stderr)

setup(
    name="zero_kernels",
    version="0.1.0",
    description="Fused mixed-precision Adam kernels (Triton, C++, CUDA) and a ZeRO-1/2/3 layer for PyTorch",
    python_requires=">=3.10",
    # kernels/ and csrc/ live at the top of the checkout but install as zero_kernels.kernels and
    # zero_kernels.csrc (the C++ sources ship so the JIT fallback can build them after install).
    # Every subpackage of zero_kernels/ is found (a hand-written list once left out zero_kernels.zero).
    packages=["zero_kernels", "zero_kernels.kernels", "zero_kernels.csrc"]
    + [f"zero_kernels.{p}" for p in find_packages("zero_kernels")],
    package_dir={"zero_kernels": "zero_kernels", "zero_kernels.kernels": "kernels",
                 "zero_kernels.csrc": "csrc"},
    package_data={"zero_kernels": ["py.typed"], "zero_kernels.csrc": ["*.cpp", "*.cu", "*.h", "*.cuh"]},
    # torch is deliberately not an install requirement: an open `torch` pin makes pip fetch a
    # multi-GB CUDA build. Install `torch==2.13.0` (CPU) or your CUDA build first.
    install_requires=["numpy"],
    extras_require={"triton": ["triton>=3.0"], "test": ["pytest", "pytest-benchmark"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
