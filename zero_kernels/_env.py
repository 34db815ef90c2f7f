"""The package's environment variables, parsed and checked in one place (setup.py loads this file too).

A value that is not understood raises ValueError naming the variable and what it accepts: an unknown
``ZERO_KERNELS_CPU_ISA`` used to leave the CPU kernel uncapped while ``report`` printed the cap, and
``ZERO_KERNELS_SKIP_EXT=false`` skipped the build.
"""
from __future__ import annotations

import os
import re

__all__ = ["flag", "choice", "check_extension_env"]

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def flag(name: str) -> bool:
    """A yes/no variable: 1/true/yes/on, or 0/false/no/off/unset (case-insensitive)."""
    raw = os.environ.get(name, "")
    v = raw.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not a yes/no value: set it to 1 (or true/yes/on) "
                     "to switch it on, 0 (or false/no/off, or unset it) for off")


def choice(name: str, allowed: tuple[str, ...], default: str | None) -> str | None:
    """One of ``allowed`` (exactly as written), ``default`` when unset or empty."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    if raw not in allowed:
        raise ValueError(f"environment variable {name}={raw!r} is not one of {', '.join(allowed)} (lowercase, "
                         "exactly); unset it for the default")
    return raw


def check_extension_env() -> None:
    """The extension's variables, checked at every use whether or not the path reading them runs: the
    loader's yes/no switches (ZERO_KERNELS_FORCE_JIT, _NO_JIT, _VERBOSE_BUILD) and those the C++ CPU kernel
    reads itself (csrc/cpu_adam.cpp): ZERO_KERNELS_CPU_ISA caps the SIMD path; ZERO_KERNELS_CPU_NT is two 0/1
    digits (nt16, nt32)."""
    for name in ("ZERO_KERNELS_FORCE_JIT", "ZERO_KERNELS_NO_JIT", "ZERO_KERNELS_VERBOSE_BUILD"):
        flag(name)
    choice("ZERO_KERNELS_CPU_ISA", ("scalar", "avx2", "avx512"), None)
    raw = os.environ.get("ZERO_KERNELS_CPU_NT", "")
    if raw != "" and not re.fullmatch(r"[01]{1,2}", raw):
        raise ValueError(f"environment variable ZERO_KERNELS_CPU_NT={raw!r} is not one or two 0/1 digits "
                         "(<nt16><nt32>, e.g. 10: streaming stores for the 16-bit parameter copy only)")
