"""One list of C++/CUDA sources and flags, used by ``setup.py`` (ahead of time, ninja) and by the
JIT fallback in :mod:`zero_kernels._ext` (``torch.utils.cpp_extension.load``).

Kept free of package imports so that ``setup.py`` can execute it with ``runpy``.
"""
from __future__ import annotations

import glob
import hashlib
import os

EXT_NAME = "zero_kernels._C"        # module built by setup.py
JIT_PREFIX = "zero_kernels_C_jit"   # the JIT fallback's module name, before its location tag (jit_name)


def csrc_dir(root: str | None = None) -> str:
    """``csrc/`` of a source checkout, or the copy shipped inside the installed package."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in ([os.path.join(root, "csrc")] if root else []) + [
        os.path.join(here, "csrc"), os.path.join(os.path.dirname(here), "csrc")]:
        if os.path.isdir(cand):
            return cand
    return os.path.join(here, "csrc")


def jit_name(root: str | None = None) -> str:
    """The JIT fallback's module (and build directory) name: one per ``csrc/`` location.

    [Note: one JIT build per checkout]
    torch.utils.cpp_extension.load keeps one build directory per name under TORCH_EXTENSIONS_DIR
    (default ~/.cache/torch_extensions). Two checkouts or environments sharing one name would take
    turns rebuilding it (ninja sees the other's source paths) and wait on each other's build lock.
    The name carries a tag of the real path of the sources it builds (symlinks resolved), so each
    location keeps its own build and a second one neither rebuilds nor blocks the first.
    """
    where = os.path.realpath(csrc_dir(root))
    return f"{JIT_PREFIX}_{hashlib.sha256(where.encode()).hexdigest()[:12]}"


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
# [Note: CUDA architectures]
# SASS (machine code) for every architecture of TORCH_CUDA_ARCH_LIST (torch's variable, same
# syntax: "8.0;8.6;9.0+PTX", spaces or ';' between entries, "9.0a" for arch-specific features,
# names such as "Ampere"), default 8.0 and 9.0; plus PTX for the newest one listed (and for any
# entry marked +PTX), which the driver JIT-compiles on GPUs newer than every listed SASS. Our
# -gencode flags also stop torch.utils.cpp_extension from adding its own. No --use_fast_math: the
# kernels compute with IEEE fp32 operations (csrc/cuda_adam_kernel.cuh, [Note: bitwise agreement
# with the reference]), and nothing else in the build should approximate either.
DEFAULT_CUDA_ARCHS = "8.0;9.0"
_NAMED_ARCHS = {"ampere": "8.0;8.6", "ada": "8.9", "hopper": "9.0", "blackwell": "10.0;12.0"}
_MIN_ARCH = 70   # __grid_constant__ kernel parameters need compute_70


def _parse_arch(entry: str, arch_list: str | None) -> tuple[int, str, bool]:
    """'9.0a+PTX' -> (90, 'a', True). Raises ValueError naming TORCH_CUDA_ARCH_LIST."""
    base, ptx = (entry[:-4], True) if entry.upper().endswith("+PTX") else (entry, False)
    major, dot, minor = base.partition(".")
    suffix = minor[1:]
    if not (dot and major.isdigit() and minor[:1].isdigit() and suffix in ("", "a", "f")):
        raise ValueError(f"TORCH_CUDA_ARCH_LIST: cannot parse {entry!r} in {arch_list!r}; use compute "
                         f"capabilities such as '8.0;9.0' (optionally '+PTX', '9.0a') or names like 'Hopper'")
    number = int(major) * 10 + int(minor[0])
    if number < _MIN_ARCH:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST: {entry!r} is below compute capability "
                         f"{_MIN_ARCH // 10}.{_MIN_ARCH % 10}, the oldest the CUDA kernels support")
    return number, suffix, ptx


def cuda_arch_flags(arch_list: str | None = None) -> list[str]:
    """nvcc -gencode flags for ``arch_list`` (TORCH_CUDA_ARCH_LIST syntax; None or blank: the
    default): SASS for each entry, PTX for the newest (and for each '+PTX' entry)."""
    words = ((arch_list or "").strip() or DEFAULT_CUDA_ARCHS).replace(";", " ").replace(",", " ").split()
    entries = [e for w in words for e in _NAMED_ARCHS.get(w.lower(), w).split(";")]
    archs = sorted({_parse_arch(e, arch_list) for e in entries})
    ptx = {f"{n}{s}" for n, s, p in archs if p} | {str(max(n for n, _, _ in archs))}
    sass = dict.fromkeys(f"{n}{s}" for n, s, _ in archs)
    return ([f"-gencode=arch=compute_{a},code=sm_{a}" for a in sass]
            + [f"-gencode=arch=compute_{a},code=compute_{a}" for a in sorted(ptx)])


NVCC_BASE_FLAGS = ["-O3", "-lineinfo"]
NVCC_FLAGS = NVCC_BASE_FLAGS + cuda_arch_flags(os.environ.get("TORCH_CUDA_ARCH_LIST"))
