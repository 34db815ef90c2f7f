"""Loader of the C++/CUDA extension ``zero_kernels._C`` (sources and flags: :mod:`zero_kernels._build`).

Order of attempts, done once per process and cached (module or error):

1. ``import zero_kernels._C``: built by ``setup.py`` at install.
2. JIT build of the same sources with the same flags (``torch.utils.cpp_extension.load``), when the
   installed module is missing or broken. Takes about a minute the first time; the result is cached
   in torch's extension directory (``TORCH_EXTENSIONS_DIR``) for later processes.
3. Neither: :func:`cpu_module` returns None, :func:`load_error` says why, and
   :func:`zero_kernels.backends.resolve` falls back to the reference path after
   :func:`warn_fallback_once` has said so (never silently).

Environment:
    ZERO_KERNELS_NO_JIT=1      never JIT-build (step 2 is skipped).
    ZERO_KERNELS_FORCE_JIT=1   ignore the installed module (step 1 is skipped); tests use it.
    ZERO_KERNELS_CPU_ISA=avx512|avx2|scalar   cap the CPU kernel's SIMD path (read by the C++ code).
    ZERO_KERNELS_CPU_NT=<a><b> non-temporal stores for the 16-bit parameter copy (a) and the fp32
                               outputs (b), e.g. "10" (the default: measured best here).
    ZERO_KERNELS_VERBOSE_BUILD=1  show the JIT compiler output (without it, a build with nothing cached yet
                                  prints one line on stderr: it takes minutes).
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from types import ModuleType

import torch
from torch import Tensor

from . import _build
from ._env import check_extension_env, flag

__all__ = ["cpu_module", "load_error", "warn_fallback_once", "fused_adam_cpu", "fused_adam_cuda",
           "fused_adam_coded_cpu", "fused_adam_coded_cuda"]

_lock = threading.Lock()
_tried = False
_module: ModuleType | None = None
_error: str | None = None
_warned = False


def _jit_build() -> ModuleType:
    from torch.utils.cpp_extension import load

    sources = _build.cpu_sources()
    if not sources:
        raise RuntimeError(f"no C++ sources found (looked in {_build.csrc_dir()})")
    kwargs = {}
    cu = _build.cuda_sources()
    with_cuda = False
    if cu and torch.version.cuda is not None:
        from torch.utils.cpp_extension import CUDA_HOME
        with_cuda = CUDA_HOME is not None
    if with_cuda:
        sources = sources + cu
        kwargs["extra_cuda_cflags"] = list(_build.NVCC_FLAGS) + ["-DZK_WITH_CUDA=1"]
    cflags = list(_build.CXX_FLAGS) + (["-DZK_WITH_CUDA=1"] if with_cuda else [])
    _say_first_build(_build.jit_name())
    return load(name=_build.jit_name(), sources=sources, extra_cflags=cflags,
                with_cuda=with_cuda, verbose=flag("ZERO_KERNELS_VERBOSE_BUILD"), **kwargs)


def _say_first_build(name: str) -> None:
    """One line on stderr when the JIT build has no cached module yet: it compiles for minutes, silently."""
    try:
        from torch.utils.cpp_extension import _get_build_directory    # torch's own rule for the cache folder
        where = _get_build_directory(name, False)
    except Exception:  # noqa: BLE001 - a torch without it: no message, the build goes on
        return
    if not os.path.exists(os.path.join(where, name + ".so")) and not flag("ZERO_KERNELS_VERBOSE_BUILD"):
        print(f"zero_kernels: building the C++ extension for this machine (first use here: about 1-3 minutes; "
              f"cached in {where}; ZERO_KERNELS_VERBOSE_BUILD=1 shows the compiler)", file=sys.stderr, flush=True)


def _load() -> None:
    global _tried, _module, _error
    reasons = []
    if flag("ZERO_KERNELS_FORCE_JIT"):
        reasons.append("the installed zero_kernels._C was skipped (ZERO_KERNELS_FORCE_JIT=1)")
    else:
        try:
            from . import _C  # type: ignore[attr-defined]
            _module = _C
            return
        except Exception as e:  # noqa: BLE001 - missing or broken (ABI mismatch, bad .so, ...)
            reasons.append(f"import zero_kernels._C failed ({type(e).__name__}: {e})")
    if flag("ZERO_KERNELS_NO_JIT"):
        reasons.append("the JIT build is disabled (ZERO_KERNELS_NO_JIT=1)")
    else:
        try:
            _module = _jit_build()
            return
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, compile error, ...
            msg = str(e).strip().splitlines()
            reasons.append(f"the JIT build failed ({type(e).__name__}: {msg[-1] if msg else ''})")
    _error = "; ".join(reasons)


def cpu_module() -> ModuleType | None:
    """The compiled extension (installed or JIT-built), or None when neither works. Cached. Raises
    ValueError, every call, while a variable the kernel reads itself is not understood (``_env``)."""
    global _tried
    check_extension_env()
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _load()
                finally:
                    _tried = True
    return _module


def load_error() -> str:
    """Why :func:`cpu_module` is None ("" when the extension loaded)."""
    cpu_module()
    return _error or ""


def warn_fallback_once() -> None:
    """One warning per process that the C++ kernel is unavailable and the reference path runs."""
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        "zero_kernels: the C++ CPU kernel is unavailable, so the (slower) pure-torch reference "
        f"path is used for CPU tensors. Reason: {load_error() or 'unknown'}. Reinstall with "
        "`pip install --no-build-isolation .` (needs a C++ compiler and ninja) or unset "
        "ZERO_KERNELS_NO_JIT to allow the JIT build.",
        RuntimeWarning, stacklevel=3)


def _module_or_raise(fn: str) -> ModuleType:
    mod = cpu_module()
    if mod is None:
        raise RuntimeError(f"zero_kernels.{fn}: the C++ extension is unavailable: {load_error()}")
    return mod


def _entry(fn: str):
    mod = _module_or_raise(fn)
    if not hasattr(mod, fn):
        raise RuntimeError(f"zero_kernels.{fn}: the extension was built without it "
                           "(CUDA kernels need torch with CUDA and nvcc at build time)")
    return getattr(mod, fn)


def _call(fn: str, masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs,
          beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf) -> None:
    _entry(fn)(
        list(masters), list(grads), list(exp_avgs), list(exp_avg_sqs),
        [] if max_exp_avg_sqs is None else list(max_exp_avg_sqs),
        [] if params16 is None else list(params16), coeffs,
        float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw), bool(maximize),
        grad_scale, found_inf)


def _backend(name: str, doc: str):
    """The Python entry point of the extension's ``name``: the contract's keyword signature."""
    def fn(
        masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
        max_exp_avg_sqs: list[Tensor] | None, params16: list[Tensor] | None, coeffs: Tensor, *,
        beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool, maximize: bool,
        grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
    ) -> None:
        _call(name, masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16,
              coeffs, beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


fused_adam_cpu = _backend(
    "fused_adam_cpu",
    """The ``"cpu"`` backend: signature and semantics of :func:`zero_kernels.reference.fused_adam_ref`
    (fp32 states, contiguous CPU tensors; the C++ front end checks and refuses anything else).""")
fused_adam_cuda = _backend(
    "fused_adam_cuda", """The ``"cuda"`` backend: same contract as :func:`fused_adam_cpu`, CUDA tensors.""")


def _coded_backend(name: str, doc: str):
    """The Python entry point of the extension's coded-state ``name`` (csrc/fused_adam.h ZK_CODED_ADAM_ARGS)."""
    def fn(
        masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
        exp_avg_scales: list[Tensor], exp_avg_sq_scales: list[Tensor], params16: list[Tensor], coeffs: Tensor,
        keys: Tensor, *, beta1: float,
        beta2: float, eps: float, weight_decay: float, adamw: bool, maximize: bool,
        grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
    ) -> None:
        _entry(name)(list(masters), list(grads), list(exp_avgs), list(exp_avg_sqs), list(exp_avg_scales),
                     list(exp_avg_sq_scales), list(params16), coeffs, keys,
                     float(beta1), float(beta2), float(eps), float(weight_decay), bool(adamw), bool(maximize),
                     grad_scale, found_inf)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


fused_adam_coded_cpu = _coded_backend(
    "fused_adam_coded_cpu",
    """Coded-state Adam on CPU tensors of ONE layout (csrc/fused_adam.h, ZK_CODED_ADAM_ARGS): bit for bit
    :func:`zero_kernels.codecs.adam_step_coded`; ``zero_kernels._coded_host.run_extension`` builds the
    arguments. Empty lists stand for absent scales / 16-bit parameters.""")
fused_adam_coded_cuda = _coded_backend(
    "fused_adam_coded_cuda", """The CUDA twin of :func:`fused_adam_coded_cpu` (CUDA tensors).""")
