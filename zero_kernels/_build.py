"""One list of C++/CUDA sources and flags, used by ``setup.py`` (ahead of time, ninja) and by the
JIT fallback in :mod:`zero_kernels._ext` (``torch.utils.cpp_extension.load``).

Kept free of package imports so that ``setup.py`` can execute it with ``runpy``.
"""
from __future__ import annotations

import glob
import os

EXT_NAME = "zero_kernels._C"        # module built by setup.py
JIT_NAME = "zero_kernels_C_jit"     # module name used by the JIT fallback


def csrc_dir(root: str | None = None) -> str:
    """``csrc/`` of a source checkout, or the copy shipped inside the installed package."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in ([os.path.join(root, "csrc")] if root else []) + [
        os.path.join(here, "csrc"), os.path.join(os.path.dirname(here), "csrc")]:
        if os.path.isdir(cand):
            return cand
    return os.path.join(here, "csrc")


def cpu_sources(root: str | None = None) -> list[str]:
    return sorted(glob.glob(os.path.join(csrc_dir(root), "*.cpp")))


def cuda_sources(root: str | None = None) -> list[str]:
    return sorted(glob.glob(os.path.join(csrc_dir(root), "*.cu")))


# No -march=native: the binary must run on any x86-64. SIMD paths are selected at run time
# (function-level target attributes + a CPU feature check in csrc/).
# -std is left to torch.utils.cpp_extension (c++20 for torch 2.13: its headers need it).
# -ffp-contract=off: the compiler must not fuse a*b+c on its own; every FMA in csrc/ is explicit,
# so the vector body and the scalar tail round identically (bitwise equal results at any size).
CXX_FLAGS = ["-O3", "-g0", "-fno-math-errno", "-ffp-contract=off", "-Wall", "-Wno-unused-function"]
NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo",
              "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
