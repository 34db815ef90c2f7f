"""Stage 3 on CPU: give the heap memory a step freed back to the system.

[Note: resident memory at stage 3]
Measured from outside (``VmRSS`` in ``/proc/self/status``), a 52.6M-parameter GPT (bf16 parameters,
fp32 gradient slices: 18 Psi / Nd = 473 MB of states per rank at world 2) grew each rank's resident
memory by 790-819 MB (1.70x) while ``memory_report()`` matched the formula. Where the rest went:
  * ~200 MB: every block's full-size fp32 gradient buffer waited for the end of backward (the
    reduce-scatter order, fixed by [Note: stage-3 reduce order] in stage3.py);
  * ~100 MB per step: memory freed during the step (autograd's full-size gradients, the gradient
    buffers beyond the reducer's pool, gathered buffers beyond the gather cache, activations) stays
    in glibc's heap. glibc serves blocks below its mmap threshold from the heap and returns freed
    heap memory only from its top; the threshold rises (up to 32 MB) each time a larger mmapped
    block is freed, and constructing ZeroAdamW frees the whole original fp32 model, so afterwards
    every multi-MB buffer of a step comes from the heap and stays resident once freed;
  * 63 MB kept on purpose: the reducer's pool of full-size buffers (``comm_buffers``) and the
    gather cache (``gather_cache``), both listed by memory_report().
So at the end of each stage-3 ``step()`` on CPU the free heap memory is given back
(glibc ``malloc_trim(0)``, all arenas): the steady state is the states plus the two deliberate
caches (515 MB, 1.09x). The memory it returns is touched again by the next step (page faults);
the pool and the gather cache, which hold the large per-step buffers, are not affected. A no-op
without glibc (musl, macOS, Windows).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["release_free_heap"]


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):     # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Return the allocator's free heap memory to the system; True if anything was released."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
