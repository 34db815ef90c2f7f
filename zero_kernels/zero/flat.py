"""Bucket copies: flatten (tensors -> flat bucket region, cast + scale) and unflatten (flat -> tensors).

[Note: views vs copies]
Most of the time no copy runs at all, because parameters and gradients are *views* of buckets:
  * parameters are always views into their bucket's flat working buffer (``p.data`` is set to the
    view at construction), so the all-gather writes straight into the model: unflatten is only
    used when a caller holds separate tensors (e.g. ``full_model_state_dict`` or a stage-3 unit
    gathering into a scratch buffer).
  * stage 1, after ``zero_grad(set_to_none=False)``: each ``.grad`` is a view into a flat gradient
    buffer and autograd accumulates into it in place: the reduce-scatter reads the buffer directly
    (fp32 grads) or after one cast of the whole bucket (16-bit grads, reduced in fp32).
  * stage 1 with ``set_to_none=True`` (torch's default): autograd allocates fresh ``.grad``
    tensors, which flatten copies (with cast) into a transient fp32 bucket at ``step()``.
  * stage 2: the gradient hook hands each ``.grad`` over and frees it; flatten copies a bucket's
    gradients in one call (cast to the fp32 reduce dtype, or accumulated under ``no_sync()``).

Which implementation runs (:func:`flatten` / :func:`unflatten` dispatch):
  * Triton (``zero_kernels.kernels.flatten``, one launch per source dtype through a pointer table)
    when the tensors are CUDA tensors;
  * otherwise the torch path below: ``copy_`` / ``add_`` on views of the bucket (one op per tensor;
    on CPU this is as fast as a memcpy and needs no compilation). CPU tensors take it even with
    TRITON_INTERPRET=1 (which used to send them through the interpreted kernel: a ZeRO-1 step 30-100x
    slower for whoever had the variable set for ``backend="triton"``); the Triton kernels are tested
    on CPU tensors directly (tests/test_numerics.py, test_alignment_paths.py, test_host_path.py).
Both round fp32 -> bf16 to nearest even, so the paths agree bitwise with ``tensor.bfloat16()``.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["flatten", "unflatten", "flatten_torch", "unflatten_torch", "flatten_reference",
           "unflatten_reference", "use_triton"]


# Test hook: True routes CPU tensors through the Triton kernels too (under TRITON_INTERPRET=1), so a
# CPU-only test runs the ZeRO flow with the kernels a GPU uses (tests/test_zero.py).
TRITON_ON_CPU = False


def use_triton(t: Tensor) -> bool:
    """Triton when the data is on CUDA (CPU tensors: the torch path, interpreter or not)."""
    return t.is_cuda or (TRITON_ON_CPU and t.device.type == "cpu")


def flatten(tensors: Sequence[Tensor | None], out: Tensor, offsets: Sequence[int],
            scale: float | None = None, accumulate: bool = False) -> None:
    """out[offsets[i] : offsets[i] + tensors[i].numel()] (=, or += if accumulate) tensors[i] * scale.

    ``out`` is 1-D contiguous; tensors may be any float dtype (math in fp32, one rounding at the
    store). ``None`` entries are skipped (callers zero-fill the bucket first when some are missing).
    """
    if not tensors:
        return
    if use_triton(out):
        from zero_kernels.kernels.flatten import flatten_triton
        flatten_triton(tensors, out, offsets, scale=scale, accumulate=accumulate)
    else:
        flatten_torch(tensors, out, offsets, scale=scale, accumulate=accumulate)


def unflatten(flat: Tensor, tensors: Sequence[Tensor], offsets: Sequence[int]) -> None:
    """tensors[i].copy_(flat[offsets[i] : offsets[i] + numel]) (same dtype: a bit copy)."""
    if not tensors:
        return
    if use_triton(flat):
        from zero_kernels.kernels.flatten import unflatten_triton
        unflatten_triton(flat, tensors, offsets)
    else:
        unflatten_torch(flat, tensors, offsets)


# ---- the torch path (CPU default) ------------------------------------------------------------
def flatten_torch(tensors, out, offsets, scale=None, accumulate=False) -> None:
    for t, off in zip(tensors, offsets):
        if t is None:
            continue
        dst = out[off:off + t.numel()].view(t.shape)
        if accumulate:
            if scale is None or scale == 1.0:
                dst.add_(t)
            elif out.dtype == torch.float32:
                dst.add_(t.float() * scale)       # round(t*scale) then add, like the kernel
            else:
                dst.copy_(dst.float() + t.float() * scale)
        elif scale is None or scale == 1.0:
            dst.copy_(t)                           # cast with round-to-nearest-even
        elif out.dtype == torch.float32:
            torch.mul(t.float() if t.dtype != torch.float32 else t, scale, out=dst)
        else:
            dst.copy_(t.float() * scale)


def unflatten_torch(flat, tensors, offsets) -> None:
    for t, off in zip(tensors, offsets):
        t.copy_(flat[off:off + t.numel()].view(t.shape))


# ---- the reference (oracle for the kernels) ----------------------------------------------------
def flatten_reference(tensors, out, offsets, scale=None, accumulate=False) -> Tensor:
    """Returns a new tensor: what ``out`` must hold after flatten (fp32 math, RNE rounding)."""
    res = out.clone().float()
    for t, off in zip(tensors, offsets):
        if t is None:
            continue
        v = t.reshape(-1).float()
        if scale is not None:
            v = v * torch.tensor(scale, dtype=torch.float32)
        if accumulate:
            v = res[off:off + t.numel()] + v
        res[off:off + t.numel()] = v
    return res.to(out.dtype)


def unflatten_reference(flat, tensors, offsets) -> list[Tensor]:
    return [flat[off:off + t.numel()].clone().view(t.shape) for t, off in zip(tensors, offsets)]
