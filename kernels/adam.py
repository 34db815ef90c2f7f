"""Fused Adam/AdamW step in Triton: kernel -> launcher -> wrapper (Liger-Kernel's layout).

The math and the contract are those of [Note: the fused-Adam contract] in
``zero_kernels/reference.py``; this file only decides how to stream memory.

[Note: why a pointer table, not flat buffers]
The drop-in optimizer updates the user's parameters, whose ``.grad`` tensors are separate
allocations made by autograd. Two multi-tensor designs were measured (``bench/bench_fused_adam.py
--design``): (a) keep optimizer state in flat buffers whose views are the per-parameter state, and
flatten the gradients into one buffer before a single flat launch; (b) pass a table of pointers
and sizes and let each program find its tensor. (a) pays an extra read+write of every gradient
(the flatten copy: +4..8 B on a 28 B/element step, 15-30% more traffic) and needs parameters and
grads to live in flat storage to avoid it, which the drop-in optimizer cannot impose on a user's
model. (b) moves exactly 28 B/element, costs one small host->device copy of the table per step,
and handles flat ZeRO shards as a table of one entry. So (b) is the only kernel: one launch per
(grad dtype, 16-bit param dtype, amsgrad) group, whatever the number of tensors.

Grid and vectorization: see [Note: chunk map] and [Note: 128-bit accesses] in _multi_tensor.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from ..reference import moment_coeffs
from ._multi_tensor import (aligned_columns, block_offsets, device_guard, launch_tables, program_chunk,
                            round_bf16_bits, scalar_offsets, typed_pointer, upload)

# Elements per program: BLOCK per iteration x ITERS iterations. Large chunks keep the grid small
# (and the interpreter fast). BLOCK=1024 with 8 warps gives each thread 4 elements per iteration:
# one 128-bit access per fp32 array and one 64-bit access per 16-bit array (a warp still covers
# 256 contiguous bytes). Four fp32 elements per thread is the widest that every array shares: with
# 8 per thread the 16-bit arrays would load 128 bits (8 elements) while fp32 stores are capped at
# 128 bits (4 elements), and Triton converts between the two layouts through 4 KB of shared
# memory per block (tests/test_codegen.py asserts shared == 0).
BLOCK = 1024
ITERS = 4
CHUNK = BLOCK * ITERS
# Every launch (and every CODEGEN_CASES compile) uses these options; enable_fp_fusion=False: see
# [Note: interpreter bits are GPU bits] in _multi_tensor.py.
LAUNCH_OPTIONS = dict(num_warps=8, enable_fp_fusion=False)
# Full chunks (inside their tensor, all six addresses 16-byte aligned) in a launch of their own, FULL=True
# ([Note: full and rest launches] in _multi_tensor.py): the kernel with the 128-bit path alone takes 48-52
# registers per thread instead of 74-80 (amsgrad 57-64 instead of 96-106; sm_80 / sm_90, triton 3.9, ptxas -v),
# 4 programs of 8 warps per SM instead of 3 (amsgrad 4 instead of 2). Timed on the H200 (2026-11-28, bench/gpu_coded_tune.py --modes fp32,bf16-master,
# variant suffix "s"): within 1-2% of one launch on both workloads, as are the launch shapes 4x512x4/x8,
# 8x1024x2/x8 and 4x1024x4 against this 8x1024x4 (variants "f..."; 16x2048x2/x4 up to 16% slower with bf16
# parameters): the step runs at 97-99% of the streaming ceiling there. Off. False: one launch of every chunk.
SPLIT_FULL = False

# Columns of the pointer table.
_MASTER, _GRAD, _EXP_AVG, _EXP_AVG_SQ, _MAX_SQ, _P16 = range(6)


@triton.jit
def adam_update(p, g, m, v, vmax, step_size, bc2_sqrt, decay, grad_scale,
                 one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, m_bound,
                 HAS_GRAD_SCALE: tl.constexpr, ADAMW: tl.constexpr, AMSGRAD: tl.constexpr,
                 MAXIMIZE: tl.constexpr, BOUND_M: tl.constexpr):
    """One element's Adam/AdamW update in fp32: the operations of reference.fused_adam_ref, in
    its order, each rounded once ([Note: interpreter bits are GPU bits] in _multi_tensor.py).
    Returns (p, m, v, vmax, root): root = sqrt(v) (sqrt(vmax) under AMSGRAD), the denominator's
    square root, which the coded kernel reuses to encode an 8-bit exp_avg_sq. BOUND_M (the coded step of
    an 8-bit exp_avg): m capped at m_bound * root, reference.bounded_m ([Note: the bound on 8-bit m])."""
    if HAS_GRAD_SCALE:
        g = g * grad_scale
    if MAXIMIZE:
        g = -g
    if ADAMW:
        p = p * decay
    else:
        if weight_decay != 0.0:   # as the reference: no 0 * p term (0 * inf would be NaN)
            g = g + weight_decay * p
    m = m + one_minus_beta1 * (g - m)
    v = beta2 * v + one_minus_beta2 * g * g
    if AMSGRAD:
        vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)   # torch.maximum
        root = tl.sqrt_rn(vmax)
    else:
        root = tl.sqrt_rn(v)
    if BOUND_M:
        bound = m_bound * root
        m = tl.where(tl.abs(m) > bound, tl.where(m < 0.0, -bound, bound), m)
    denom = tl.div_rn(root, bc2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denom)
    return p, m, v, vmax, root


@triton.jit
def _adam_block(master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16_ptr, offs, mask,
                step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2, one_minus_beta2,
                eps, weight_decay,
                MASKED: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, ADAMW: tl.constexpr,
                AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, P16_KIND: tl.constexpr):
    """Load, update and store one BLOCK. MASKED=False with 16-byte-hinted pointers compiles to
    unpredicated 128-bit accesses."""
    if MASKED:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        vmax = tl.load(vmax_ptr + offs, mask=mask, other=0.0) if AMSGRAD else v
    else:
        p = tl.load(master_ptr + offs)
        g = tl.load(grad_ptr + offs).to(tl.float32)
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
        vmax = tl.load(vmax_ptr + offs) if AMSGRAD else v
    p, m, v, vmax, _ = adam_update(p, g, m, v, vmax, step_size, bc2_sqrt, decay, grad_scale,
                                    one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, 0.0,
                                    HAS_GRAD_SCALE, ADAMW, AMSGRAD, MAXIMIZE, False)
    if P16_KIND == 1:
        p16 = round_bf16_bits(p)
    else:
        p16 = p.to(tl.float16)   # fp16 casts round to nearest even in the interpreter and on GPU
    if MASKED:
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if AMSGRAD:
            tl.store(vmax_ptr + offs, vmax, mask=mask)
        if P16_KIND != 0:
            tl.store(p16_ptr + offs, p16, mask=mask)
    else:
        tl.store(master_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        if AMSGRAD:
            tl.store(vmax_ptr + offs, vmax)
        if P16_KIND != 0:
            tl.store(p16_ptr + offs, p16)


@triton.jit
def _scalars(coeffs, row, grad_scale_ptr, HAS_GRAD_SCALE: tl.constexpr):
    """(step_size, bc2_sqrt, decay, grad_scale) of the tensor at row ``row`` of coeffs."""
    step_size = tl.load(coeffs + row * 3 + 0)
    bc2_sqrt = tl.load(coeffs + row * 3 + 1)
    decay = tl.load(coeffs + row * 3 + 2)
    grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0
    return step_size, bc2_sqrt, decay, grad_scale


@triton.jit
def _adam_unhinted(master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16_ptr, block_start, offs, numel,
                   step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2, one_minus_beta2,
                   eps, weight_decay, HAS_GRAD_SCALE: tl.constexpr, ADAMW: tl.constexpr,
                   AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, P16_KIND: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr):
    """One block with the pointers as they are: unmasked when it lies inside the tensor, masked
    on the tensor's last block, nothing past it."""
    if block_start + BLOCK_SIZE <= numel:
        _adam_block(master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16_ptr, offs, None,
                    step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2,
                    one_minus_beta2, eps, weight_decay,
                    False, HAS_GRAD_SCALE, ADAMW, AMSGRAD, MAXIMIZE, P16_KIND)
    elif block_start < numel:
        _adam_block(master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16_ptr, offs, offs < numel,
                    step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2,
                    one_minus_beta2, eps, weight_decay,
                    True, HAS_GRAD_SCALE, ADAMW, AMSGRAD, MAXIMIZE, P16_KIND)


@triton.jit
def _table_pointers(a_master, a_grad, a_m, a_v, a_vmax, a_p16, GRAD_DTYPE: tl.constexpr, P16_KIND: tl.constexpr,
                    ALIGNED: tl.constexpr):
    """The six typed pointers of one table row, hinted 16-byte aligned iff ALIGNED."""
    if P16_KIND == 1:
        p16_ptr = typed_pointer(a_p16, tl.uint16, ALIGNED)
    else:
        p16_ptr = typed_pointer(a_p16, tl.float16, ALIGNED)
    return (typed_pointer(a_master, tl.float32, ALIGNED), typed_pointer(a_grad, GRAD_DTYPE, ALIGNED),
            typed_pointer(a_m, tl.float32, ALIGNED), typed_pointer(a_v, tl.float32, ALIGNED),
            typed_pointer(a_vmax, tl.float32, ALIGNED), p16_ptr)


@triton.jit
def fused_adam_kernel(
    ptr_table,        # int64 [T, 6]: data_ptr of master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, param16 (0 = absent)
    numels,           # int64 [T]: elements in tensor t
    coeffs,           # fp32 [T, 3]: step_size = lr/(1-beta1^t), bc2_sqrt = sqrt(1-beta2^t), decay = 1-lr*wd (AdamW) or 1
    chunk_tensor,     # int32 [n_programs]: the tensor program pid works on
    chunk_start,      # int64 [n_programs]: first element of program pid's chunk inside its tensor
    grad_scale_ptr,   # fp32 [1]: gradient multiplier (1/loss_scale x clip coefficient); read iff HAS_GRAD_SCALE
    found_inf_ptr,    # fp32 [1]: nonzero -> the whole step writes nothing; read iff HAS_FOUND_INF
    one_minus_beta1,  # fp32 scalar: 1 - beta1, computed in double on the host (reference.moment_coeffs)
    beta2,            # fp32 scalar: second-moment decay rate
    one_minus_beta2,  # fp32 scalar: 1 - beta2, computed in double on the host
    eps,              # fp32 scalar: denominator epsilon (added after the bias-corrected sqrt, as torch)
    weight_decay,     # fp32 scalar: L2 coefficient added to the gradient when not ADAMW (skipped if 0)
    GRAD_DTYPE: tl.constexpr,      # tl.float32 / tl.bfloat16 / tl.float16
    P16_KIND: tl.constexpr,        # 0: no 16-bit copy, 1: bf16 (stored as RNE bits), 2: fp16
    HAS_GRAD_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ADAMW: tl.constexpr,           # decoupled weight decay (AdamW) vs L2 (Adam)
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,      # elements per iteration
    N_ITERS: tl.constexpr,         # iterations per program (chunk = BLOCK_SIZE * N_ITERS)
    FULL: tl.constexpr = False,    # every chunk lies inside its tensor and all six addresses are 16-byte aligned
                                   # (checked on the host, SPLIT_FULL): only the 128-bit path is compiled
):
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    t, start, numel = program_chunk(chunk_tensor, chunk_start, numels)
    row = ptr_table + t * 6
    a_master, a_grad, a_m = tl.load(row + 0), tl.load(row + 1), tl.load(row + 2)
    a_v, a_vmax, a_p16 = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
    # Per tensor, as the CUDA kernel per block: 128-bit accesses iff all its pointers (absent = 0)
    # are 16-byte aligned. Chunk starts are multiples of BLOCK_SIZE, so every full block is too.
    # Each branch makes its own pointers ([Note: hints mark the defining op] in _multi_tensor.py).
    aligned = ((a_master | a_grad | a_m | a_v | a_vmax | a_p16) & 15) == 0
    step_size, bc2_sqrt, decay, grad_scale = _scalars(coeffs, t, grad_scale_ptr, HAS_GRAD_SCALE)
    for i in range(N_ITERS):
        block_start = start + i * BLOCK_SIZE
        if FULL or (aligned and block_start + BLOCK_SIZE <= numel):
            _, offs = block_offsets(start, i, BLOCK_SIZE)     # per branch: each has its own register layout
            master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16_ptr = _table_pointers(
                a_master, a_grad, a_m, a_v, a_vmax, a_p16, GRAD_DTYPE, P16_KIND, True)
            _adam_block(master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16_ptr, offs, None,
                        step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2,
                        one_minus_beta2, eps, weight_decay,
                        False, HAS_GRAD_SCALE, ADAMW, AMSGRAD, MAXIMIZE, P16_KIND)
        else:
            soffs = scalar_offsets(start, i, BLOCK_SIZE)
            master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16_ptr = _table_pointers(
                a_master, a_grad, a_m, a_v, a_vmax, a_p16, GRAD_DTYPE, P16_KIND, False)
            _adam_unhinted(master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16_ptr, block_start, soffs, numel,
                           step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2, one_minus_beta2,
                           eps, weight_decay, HAS_GRAD_SCALE, ADAMW, AMSGRAD, MAXIMIZE, P16_KIND, BLOCK_SIZE)



@triton.jit
def fused_adam_tensor_kernel(
    master_ptr,       # fp32 [numel]: master (or fp32 parameter), updated in place
    grad_ptr,         # fp32/bf16/fp16 [numel]: gradient, read only
    m_ptr,            # fp32 [numel]: exp_avg, updated in place
    v_ptr,            # fp32 [numel]: exp_avg_sq, updated in place
    vmax_ptr,         # fp32 [numel]: max_exp_avg_sq, updated iff AMSGRAD (else any fp32 tensor, untouched)
    p16_ptr,          # bf16/fp16 [numel]: 16-bit parameter copy, written iff P16_KIND != 0 (else untouched)
    coeffs,           # fp32 [T, 3]: (step_size, bc2_sqrt, decay) per tensor, as in fused_adam_kernel
    row,              # int: this tensor's row of coeffs
    numel,            # int: elements of this tensor
    grad_scale_ptr,   # fp32 [1]: gradient multiplier; read iff HAS_GRAD_SCALE
    found_inf_ptr,    # fp32 [1]: nonzero -> write nothing; read iff HAS_FOUND_INF
    one_minus_beta1,  # fp32 scalar: 1 - beta1, computed in double on the host
    beta2,            # fp32 scalar: second-moment decay rate
    one_minus_beta2,  # fp32 scalar: 1 - beta2, computed in double on the host
    eps,              # fp32 scalar: denominator epsilon
    weight_decay,     # fp32 scalar: L2 coefficient when not ADAMW (skipped if 0)
    # The compile-time flags and sizes of fused_adam_kernel, same meanings:
    P16_KIND: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, HAS_FOUND_INF: tl.constexpr, ADAMW: tl.constexpr,
    AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_ITERS: tl.constexpr,
):
    """The update of fused_adam_kernel over ONE tensor passed as kernel arguments (no pointer
    table): the form a compiler can trace ([Note: the traced triton op] in zero_kernels/ops.py).
    Same block body, so the same bits. Triton specializes pointer arguments on 16-byte alignment
    by itself, so full blocks get 128-bit accesses without hints."""
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    start = tl.program_id(0).to(tl.int64) * (BLOCK_SIZE * N_ITERS)
    if P16_KIND == 1:
        p16 = p16_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
    else:
        p16 = p16_ptr.to(tl.pointer_type(tl.float16), bitcast=True)
    step_size, bc2_sqrt, decay, grad_scale = _scalars(coeffs, row, grad_scale_ptr, HAS_GRAD_SCALE)
    for i in range(N_ITERS):
        block_start, offs = block_offsets(start, i, BLOCK_SIZE)
        _adam_unhinted(master_ptr, grad_ptr, m_ptr, v_ptr, vmax_ptr, p16, block_start, offs, numel,
                       step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1, beta2, one_minus_beta2,
                       eps, weight_decay, HAS_GRAD_SCALE, ADAMW, AMSGRAD, MAXIMIZE, P16_KIND, BLOCK_SIZE)


_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_P16_KIND = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def _launch_group(masters, grads, exp_avgs, exp_avg_sqs, max_sqs, params16, coeffs, *, beta1, beta2,
                  eps, weight_decay, adamw, maximize, grad_scale, found_inf) -> int:
    """One kernel launch (two with SPLIT_FULL: the full chunks, the rest) for tensors sharing (device, grad
    dtype, param16 dtype). Returns launches.

    Host work per step: the data pointers (one flat list, 6 per tensor) and two cache lookups
    ([Note: device tables]); nothing is uploaded and nothing waits for the device unless a
    pointer or a size changed. Empty tensors stay in the table: they own no chunk."""
    device = masters[0].device
    zeros = [0] * len(masters)
    vmax_ptrs = zeros if max_sqs is None else [t.data_ptr() for t in max_sqs]
    p16_ptrs = zeros if params16 is None else [t.data_ptr() for t in params16]
    ptrs = [x for row in zip([t.data_ptr() for t in masters], [t.data_ptr() for t in grads],
                             [t.data_ptr() for t in exp_avgs], [t.data_ptr() for t in exp_avg_sqs],
                             vmax_ptrs, p16_ptrs) for x in row]
    table, numels, launches = launch_tables(ptrs, [t.numel() for t in masters], CHUNK, device,
                                            aligned_tensors if SPLIT_FULL else None)
    if not launches:
        return 0
    c = coeffs if coeffs.dtype == torch.float32 and coeffs.device == device else coeffs.to(device, torch.float32)
    c = c.contiguous()
    dummy = c  # any fp32 tensor: never read when the flag is off
    gs = grad_scale.to(device=device, dtype=torch.float32) if grad_scale is not None else dummy
    fi = found_inf.to(device=device, dtype=torch.float32) if found_inf is not None else dummy
    one_minus_beta1, one_minus_beta2 = moment_coeffs(beta1, beta2)
    with device_guard(device):
        for (chunk_tensor, chunk_start), full in launches:
            fused_adam_kernel[(chunk_tensor.numel(),)](
                table, numels, c, chunk_tensor, chunk_start, gs, fi,
                one_minus_beta1, float(beta2), one_minus_beta2, float(eps), float(weight_decay),
                GRAD_DTYPE=_TL_DTYPE[grads[0].dtype],
                P16_KIND=_P16_KIND[params16[0].dtype if params16 is not None else None],
                HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
                ADAMW=bool(adamw), AMSGRAD=max_sqs is not None, MAXIMIZE=bool(maximize),
                BLOCK_SIZE=BLOCK, N_ITERS=ITERS, FULL=full, **LAUNCH_OPTIONS,
            )
    return len(launches)


def aligned_tensors(rows: list[int]) -> tuple[bool, ...]:
    """Per tensor of a group's pointer rows: are all six addresses 16-byte aligned? The kernel's own test, on
    the host (SPLIT_FULL)."""
    return aligned_columns(rows, 6, (_MASTER, _GRAD, _EXP_AVG, _EXP_AVG_SQ, _MAX_SQ, _P16))


# Launch counter for tests: "a 100-parameter model launches a handful of kernels".
launch_count = 0


def _check_tensors(masters: list[Tensor], grads: list[Tensor]) -> None:
    """The Triton front end's checks, naming the first offending tensor."""
    for i, (p, g) in enumerate(zip(masters, grads)):
        if p.dtype != torch.float32 or not p.is_contiguous() or not g.is_contiguous():
            raise ValueError(f"triton fused Adam needs contiguous fp32 masters and contiguous grads "
                             f"(tensor {i}: master {p.dtype}, contiguous={p.is_contiguous()}, "
                             f"grad contiguous={g.is_contiguous()})")
        if g.numel() != p.numel():
            raise ValueError(f"tensor {i}: grad has {g.numel()} elements, master {p.numel()}")
        if g.device != p.device:
            raise ValueError(f"tensor {i}: grad on {g.device}, master on {p.device}")


def fused_adam_triton(
    masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor] | None, params16: list[Tensor] | None, coeffs: Tensor, *,
    beta1: float, beta2: float, eps: float, weight_decay: float, adamw: bool, maximize: bool,
    grad_scale: Tensor | None = None, found_inf: Tensor | None = None,
) -> None:
    """The fused-Adam contract on Triton. Tensors are grouped by (device, grad dtype, param16
    dtype) and each group is one launch, under the group's device guard; callers (the optimizer)
    usually pass a single group already, which takes the fast path (no regrouping)."""
    global launch_count
    if not masters:
        return
    ok = (all([p.dtype == torch.float32 for p in masters])
          and all([p.is_contiguous() for p in masters]) and all([g.is_contiguous() for g in grads])
          and [p.numel() for p in masters] == [g.numel() for g in grads])
    if not ok:
        _check_tensors(masters, grads)
    one_group = (len({g.dtype for g in grads}) == 1 and len({t.device for t in masters + grads}) == 1
                 and (params16 is None or len({t.dtype for t in params16}) == 1))
    if one_group:
        launch_count += _launch_group(
            masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, params16, coeffs,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
            maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)
        return
    _check_tensors(masters, grads)
    groups: dict[tuple, list[int]] = {}
    for i, (p, g) in enumerate(zip(masters, grads)):
        groups.setdefault((p.device, g.dtype, params16[i].dtype if params16 is not None else None), []).append(i)
    for idx in groups.values():
        pick = (lambda xs: None if xs is None else [xs[i] for i in idx])
        index = upload(idx, torch.int64, coeffs.device)
        launch_count += _launch_group(
            pick(masters), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(max_exp_avg_sqs),
            pick(params16), coeffs.index_select(0, index),
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw=adamw,
            maximize=maximize, grad_scale=grad_scale, found_inf=found_inf)



def fused_adam_per_tensor(
    masters: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor], params16: list[Tensor], coeffs: Tensor, beta1: float, beta2: float,
    eps: float, weight_decay: float, adamw: bool, maximize: bool, grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """The fused-Adam contract as one ``fused_adam_tensor_kernel`` launch per tensor, every tensor a
    kernel argument: the body of the ``zero_kernels::fused_adam_triton`` operator, which tracers
    (make_fx, AOTAutograd, Inductor) can follow. Positional schema of the operator: empty
    ``max_exp_avg_sqs`` / ``params16`` lists stand for None. The callers (the operator's users)
    pass checked tensors on one device, as for :func:`fused_adam_triton`."""
    if not masters:
        return
    dummy = coeffs.new_empty(1)   # stands for an absent tensor argument; never read or written
    one_minus_beta1, one_minus_beta2 = moment_coeffs(beta1, beta2)
    flags = dict(P16_KIND=_P16_KIND[params16[0].dtype if params16 else None],
                 HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
                 ADAMW=bool(adamw), AMSGRAD=bool(max_exp_avg_sqs), MAXIMIZE=bool(maximize),
                 BLOCK_SIZE=BLOCK, N_ITERS=ITERS, **LAUNCH_OPTIONS)
    gs = dummy if grad_scale is None else grad_scale
    fi = dummy if found_inf is None else found_inf
    with device_guard(masters[0].device):
        for i, (p, g, m, v) in enumerate(zip(masters, grads, exp_avgs, exp_avg_sqs)):
            if p.numel() == 0:
                continue
            wrap_triton(fused_adam_tensor_kernel)[(triton.cdiv(p.numel(), CHUNK),)](
                p, g, m, v, max_exp_avg_sqs[i] if max_exp_avg_sqs else dummy,
                params16[i] if params16 else dummy, coeffs, i, p.numel(), gs, fi,
                one_minus_beta1, float(beta2), one_minus_beta2, float(eps), float(weight_decay), **flags)


# Ahead-of-time codegen cases (tests/test_codegen.py compiles each for sm_80 and sm_90 and checks
# the PTX for IEEE numerics, 128-bit accesses and no shared memory, and the cubin for spills):
# (kernel, signature, constexprs, description, options). Every dtype combination fused_adam_triton
# launches with; alignment is a run-time branch per tensor, so each variant has both paths.
def _codegen_cases() -> list:
    table_sig = dict(ptr_table="*i64", numels="*i64", chunk_tensor="*i32", chunk_start="*i64")
    scalars = dict(coeffs="*fp32", grad_scale_ptr="*fp32", found_inf_ptr="*fp32", one_minus_beta1="fp32",
                   beta2="fp32", one_minus_beta2="fp32", eps="fp32", weight_decay="fp32")
    per_thread = BLOCK // (32 * LAUNCH_OPTIONS["num_warps"])   # elements per thread per block
    words = lambda nbytes: per_thread * nbytes // 16           # noqa: E731 - 128-bit accesses per array
    names = {tl.float32: "fp32", tl.bfloat16: "bf16", tl.float16: "fp16"}
    cases = []
    for grad, p16 in ((tl.float32, 0), (tl.bfloat16, 1), (tl.float16, 2), (tl.float32, 1)):
        for ams in (False, True):
            for adamw in (True, False):
                ce = dict(P16_KIND=p16, HAS_GRAD_SCALE=True, HAS_FOUND_INF=True,
                          ADAMW=adamw, AMSGRAD=ams, MAXIMIZE=True, BLOCK_SIZE=BLOCK, N_ITERS=ITERS)
                g_bytes = 4 if grad == tl.float32 else 2
                desc = (f"grad={names[grad]} p16={['none', 'bf16', 'fp16'][p16]}"
                        f"{' amsgrad' if ams else ''}{'' if adamw else ' adam-l2'}")
                # 16-bit arrays move 64 bits per thread (see BLOCK above): not counted as wide.
                opts = dict(LAUNCH_OPTIONS, streaming=True,
                            min_wide_loads=(3 + ams) * words(4) + words(g_bytes),
                            min_wide_stores=(3 + ams) * words(4))
                cases.append((fused_adam_kernel, dict(table_sig, **scalars), dict(ce, GRAD_DTYPE=grad, FULL=False),
                              desc, opts))
                if adamw:
                    # the FULL launch of SPLIT_FULL: the 128-bit path alone, no alignment test
                    cases.append((fused_adam_kernel, dict(table_sig, **scalars), dict(ce, GRAD_DTYPE=grad, FULL=True),
                                  f"full {desc}", dict(opts, host_aligned=True, max_regs=64)))
                    # the per-tensor kernel of the traced op: its tensors' dtypes are its signature
                    tensors = dict(master_ptr="*fp32", grad_ptr=f"*{names[grad]}", m_ptr="*fp32", v_ptr="*fp32",
                                   vmax_ptr="*fp32", p16_ptr=f"*{['fp32', 'bf16', 'fp16'][p16]}")
                    cases.append((fused_adam_tensor_kernel, dict(tensors, row="i32", numel="i32", **scalars),
                                  ce, f"per-tensor {desc}", opts))
    return cases


CODEGEN_CASES = _codegen_cases()
