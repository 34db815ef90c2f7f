"""Fused Adam/AdamW on coded states (issue 11) in Triton: decode in registers -> the fp32 update of
``adam.adam_update`` (the fused-Adam contract) -> encode, in one pass; no fp32 copy of any state.

[Note: the coded kernel]
The reference is ``zero_kernels.codecs.adam_step_coded`` and the kernel equals it bit for bit
(tests/test_adam_coded.py): every codec is computed on bits or with IEEE operations (kernels/_codecs.py).
A program's BLOCK_SIZE = 1024 elements are a [4, 256] tile whose rows are the 8-bit / fp8 quantization
blocks (chunks start at multiples of 1024, blocks are counted from each tensor's first element), so
the new block scale is a row max in registers, computed after the update and before the encode. With 4
warps (LAUNCH_OPTIONS) a row is one warp's 8 elements per thread; the compiled variants still convert some
arrays between the tile's layout and their access layout through shared memory (up to 4 KB, bounded by
tests/test_codegen.py's max_shared), with barriers between. On an H200 the kernel moves ~45% of the
memory bandwidth (Nsight Compute, llama7b-layer, 8-bit: 2.3 TB/s, 37% occupancy limited by registers,
stalls on global-load latency): removing the conversions and barriers is open work, as is wider access
to the uint8 codes.
State kinds (constexprs): MASTER_KIND 0 = an fp32 master (or the fp32 parameter), 1 = bf16 parameter +
int16 remainder; M_KIND / V_KIND 0 = fp32, 1 = bf16 stochastic rounding, 2 = uint8 (the arithmetic 8-bit
moment codec: int8 codes of m rounded to nearest, log codes of sqrt(v) on its bits; no table, no search),
3 = float8_e4m3fn; both blockwise kinds read and write an fp32 scale per block. An 8-bit exp_avg_sq is
encoded from the update's own sqrt(v) (adam.adam_update returns it, ``tl.sqrt_rn``): codecs.encode_v8
takes the same correctly rounded square root of the new v (reference.sqrt_rn).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._coded_host import CodedEntry, group_arrays, prepare
from ..reference import moment_coeffs
from ._codecs import (F8_MAX, QBLOCK, block_absmax, decode_bf16, decode_f8, decode_m8, decode_v8, encode_bf16_sr,
                      encode_f8, encode_m8, encode_v8, join_remainder, ld, scaled, split_remainder, st)
from ._multi_tensor import chunk_map, device_guard, pointer_table, program_chunk, round_bf16_bits, typed_pointer
from .adam import adam_update

BLOCK = 1024
ITERS = 4
CHUNK = BLOCK * ITERS
_COLS = 7   # master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param16
# 4 warps: a [4, 256] tile at 8 elements per thread, each 256-element row in one warp. Measured on an H200
# (bench/gpu_coded_tune.py, llama7b-layer, 2026-11-26): 1.79 ms against 2.04 with 8 warps (8bit), 1.94 against
# 2.08 (8bit+rem); both far from the 0.81 / 0.71 ms the bytes allow (see [Note: the coded kernel]).
LAUNCH_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)


@triton.jit
def _load_moment(ptr, scale_ptr, offs, mask, rows, MASKED: tl.constexpr, KIND: tl.constexpr, SQ: tl.constexpr,
                 ALIGNED: tl.constexpr):
    """Decode one moment of the tile to fp32 (KIND: see [Note: the coded kernel]; SQ: exp_avg_sq, whose
    8-bit code is the log code of sqrt(v)). A blockwise moment's scale is loaded once per row (block) and broadcast,
    so the per-block division of the decode runs once per row, not per element."""
    if KIND == 0:
        return ld(typed_pointer(ptr, tl.float32, ALIGNED), offs, mask, MASKED)
    elif KIND == 1:
        return decode_bf16(ld(typed_pointer(ptr, tl.uint16, ALIGNED), offs, mask, MASKED))
    else:
        code = ld(typed_pointer(ptr, tl.uint8, ALIGNED), offs, mask, MASKED)
        row_mask = tl.max(mask.to(tl.int32), axis=1) > 0
        scale = ld(scale_ptr.to(tl.pointer_type(tl.float32)), rows, row_mask, MASKED)[:, None]
        if KIND == 2:
            if SQ:
                return decode_v8(code, scale)
            else:
                return decode_m8(code, scale)
        else:
            return decode_f8(code) * scale


@triton.jit
def _store_moment(x, root, ptr, scale_ptr, offs, mask, rows, index_offset, key,
                  MASKED: tl.constexpr, KIND: tl.constexpr, SQ: tl.constexpr, ALIGNED: tl.constexpr):
    """Encode one updated moment of the tile and store it (with its new block scales). ``root``: sqrt(x),
    which the 8-bit exp_avg_sq code (SQ) encodes."""
    if KIND == 0:
        st(typed_pointer(ptr, tl.float32, ALIGNED), offs, x, mask, MASKED)
    elif KIND == 1:
        st(typed_pointer(ptr, tl.uint16, ALIGNED), offs, encode_bf16_sr(x, offs, index_offset, key), mask, MASKED)
    else:
        if KIND == 3:
            scale = tl.div_rn(block_absmax(x, mask), F8_MAX)
            code = encode_f8(scaled(x, scale))
        elif SQ:
            code, scale = encode_v8(root, mask)
        else:
            code, scale = encode_m8(x, mask)
        st(typed_pointer(ptr, tl.uint8, ALIGNED), offs, code, mask, MASKED)
        row_mask = tl.max(mask.to(tl.int32), axis=1) > 0
        st(scale_ptr.to(tl.pointer_type(tl.float32)), rows, scale, row_mask, MASKED)


@triton.jit
def _coded_tile(row, offs, mask, rows, step_size, bc2_sqrt, decay, grad_scale, m_key, v_key, index_offset,
                one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
                GRAD_DTYPE: tl.constexpr, P16_KIND: tl.constexpr, MASTER_KIND: tl.constexpr,
                M_KIND: tl.constexpr, V_KIND: tl.constexpr, MASKED: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
                ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr):
    """Load, decode, update, encode and store one [rows, 256] tile of one tensor (table row ``row``)."""
    a_master, a_p16 = tl.load(row + 0), tl.load(row + 6)
    p16_ptr = typed_pointer(a_p16, tl.uint16, ALIGNED)
    master_ptr = typed_pointer(a_master, tl.float32, ALIGNED)
    grad_ptr = typed_pointer(tl.load(row + 1), GRAD_DTYPE, ALIGNED)
    if MASTER_KIND == 1:
        rem_ptr = typed_pointer(a_master, tl.int16, ALIGNED)
        p = join_remainder(ld(p16_ptr, offs, mask, MASKED), ld(rem_ptr, offs, mask, MASKED))
    else:
        p = ld(master_ptr, offs, mask, MASKED)
    g = ld(grad_ptr, offs, mask, MASKED).to(tl.float32)
    m = _load_moment(tl.load(row + 2), tl.load(row + 4), offs, mask, rows, MASKED, M_KIND, False, ALIGNED)
    v = _load_moment(tl.load(row + 3), tl.load(row + 5), offs, mask, rows, MASKED, V_KIND, True, ALIGNED)
    p, m, v, _, root = adam_update(p, g, m, v, v, step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1,
                                   beta2, one_minus_beta2, eps, weight_decay, HAS_GRAD_SCALE, ADAMW, False,
                                   MAXIMIZE)
    _store_moment(m, root, tl.load(row + 2), tl.load(row + 4), offs, mask, rows, index_offset, m_key, MASKED,
                  M_KIND, False, ALIGNED)
    _store_moment(v, root, tl.load(row + 3), tl.load(row + 5), offs, mask, rows, index_offset, v_key, MASKED,
                  V_KIND, True, ALIGNED)
    if MASTER_KIND == 1:
        hi, rem = split_remainder(p)
        st(p16_ptr, offs, hi, mask, MASKED)
        st(rem_ptr, offs, rem, mask, MASKED)
    else:
        st(master_ptr, offs, p, mask, MASKED)
        if P16_KIND == 1:
            st(p16_ptr, offs, round_bf16_bits(p), mask, MASKED)
        elif P16_KIND == 2:
            st(typed_pointer(a_p16, tl.float16, ALIGNED), offs, p.to(tl.float16), mask, MASKED)


@triton.jit
def fused_adam_coded_kernel(
    ptr_table,        # int64 [T, 7]: data_ptr of master (fp32 master / fp32 param / int16 remainder), grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param16 (0 = absent)
    numels,           # int64 [T]: elements in tensor t
    coeffs,           # fp32 [T, 3]: step_size, bc2_sqrt, decay (reference.compute_coeffs)
    keys,             # int64 [T, 3]: SR key of exp_avg, SR key of exp_avg_sq (codecs.sr_key, uint32), flat index of element 0
    chunk_tensor,     # int32 [n_programs]: the tensor program pid works on
    chunk_start,      # int64 [n_programs]: first element of program pid's chunk (a multiple of BLOCK_SIZE)
    grad_scale_ptr,   # fp32 [1]: gradient multiplier; read iff HAS_GRAD_SCALE
    found_inf_ptr,    # fp32 [1]: nonzero -> the whole step writes nothing; read iff HAS_FOUND_INF
    one_minus_beta1,  # fp32 scalar: 1 - beta1 (computed in double on the host)
    beta2,            # fp32 scalar
    one_minus_beta2,  # fp32 scalar: 1 - beta2 (computed in double on the host)
    eps,              # fp32 scalar
    weight_decay,     # fp32 scalar: L2 coefficient when not ADAMW
    GRAD_DTYPE: tl.constexpr,      # tl.float32 / tl.bfloat16 / tl.float16
    P16_KIND: tl.constexpr,        # 0: none, 1: bf16 (RNE bits, or the remainder's high half), 2: fp16
    MASTER_KIND: tl.constexpr,     # 0: fp32 master, 1: bf16 parameter + int16 remainder
    M_KIND: tl.constexpr,          # exp_avg format: 0 fp32, 1 bf16 SR, 2 uint8 (int8 codes), 3 float8_e4m3fn
    V_KIND: tl.constexpr,          # exp_avg_sq format, as M_KIND (2: uint8 codes of sqrt(v), rounded up)
    HAS_GRAD_SCALE: tl.constexpr,  # multiply the gradient by *grad_scale_ptr
    HAS_FOUND_INF: tl.constexpr,   # read *found_inf_ptr and skip the step when nonzero
    ADAMW: tl.constexpr,           # decoupled weight decay (p *= decay) instead of L2 (g += weight_decay * p)
    MAXIMIZE: tl.constexpr,        # ascend: the gradient is negated
    BLOCK_SIZE: tl.constexpr,      # elements per iteration: a [BLOCK_SIZE // 256, 256] tile
    N_ITERS: tl.constexpr,         # iterations per program
):
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    t, start, numel = program_chunk(chunk_tensor, chunk_start, numels)
    row = ptr_table + t * 7
    aligned = ((tl.load(row) | tl.load(row + 1) | tl.load(row + 2) | tl.load(row + 3) | tl.load(row + 6)) & 15) == 0
    step_size, bc2_sqrt, decay = tl.load(coeffs + t * 3), tl.load(coeffs + t * 3 + 1), tl.load(coeffs + t * 3 + 2)
    m_key, v_key = tl.load(keys + t * 3).to(tl.uint32), tl.load(keys + t * 3 + 1).to(tl.uint32)
    index_offset = tl.load(keys + t * 3 + 2)
    grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0
    tile = tl.arange(0, BLOCK_SIZE // QBLOCK).to(tl.int64)[:, None] * QBLOCK + tl.arange(0, QBLOCK).to(tl.int64)[None, :]
    for i in range(N_ITERS):
        block_start = start + i * BLOCK_SIZE
        offs = tl.max_contiguous(tl.multiple_of(block_start + tile, [QBLOCK, QBLOCK]), [1, QBLOCK])
        rows = block_start // QBLOCK + tl.arange(0, BLOCK_SIZE // QBLOCK).to(tl.int64)
        args = (row, offs, offs < numel, rows, step_size, bc2_sqrt, decay, grad_scale, m_key, v_key, index_offset,
                one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay)
        if block_start + BLOCK_SIZE <= numel:
            if aligned:
                _coded_tile(*args, GRAD_DTYPE, P16_KIND, MASTER_KIND, M_KIND, V_KIND, False, HAS_GRAD_SCALE, ADAMW,
                            MAXIMIZE, True)
            else:
                _coded_tile(*args, GRAD_DTYPE, P16_KIND, MASTER_KIND, M_KIND, V_KIND, False, HAS_GRAD_SCALE, ADAMW,
                            MAXIMIZE, False)
        elif block_start < numel:
            _coded_tile(*args, GRAD_DTYPE, P16_KIND, MASTER_KIND, M_KIND, V_KIND, True, HAS_GRAD_SCALE, ADAMW,
                        MAXIMIZE, False)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2, torch.float8_e4m3fn: 3}
_P16 = {None: 0, torch.bfloat16: 1, torch.float16: 2}


def _row(e: CodedEntry) -> list[int]:
    """Pointer-table row of one tensor and its coded state (0 = absent)."""
    return [e.master.data_ptr(), e.grad.data_ptr(), e.exp_avg.data_ptr(), e.exp_avg_sq.data_ptr(),
            0 if e.exp_avg_scale is None else e.exp_avg_scale.data_ptr(),
            0 if e.exp_avg_sq_scale is None else e.exp_avg_sq_scale.data_ptr(),
            0 if e.param16 is None else e.param16.data_ptr()]


def adam_step_coded_triton(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
                           seeds: list[int], *, lr, beta1: float, beta2: float, eps: float, weight_decay: float,
                           adamw: bool, maximize: bool = False, grad_scale: Tensor | None = None,
                           found_inf: Tensor | None = None, index_offsets: list[int] | None = None,
                           step_buffer: Tensor | None = None, cache: dict | None = None) -> None:
    """``codecs.adam_step_coded`` for every (param, grad, state, seed[, index offset]), in place: one launch per
    (grad dtype, param dtype, state kinds). ``grad_scale`` multiplies the gradient; a nonzero ``found_inf``
    changes nothing but is still counted as torch counts it (the step is incremented by 1 - found_inf). The
    host side (steps, coefficients, keys, grouping) is ``zero_kernels._coded_host.prepare``, shared with the
    C++ kernels; ``cache`` (a launch plan's) also keeps each group's pointer rows, whose gradient and
    parameter columns alone are refilled per step."""
    if not params:
        return
    device = params[0].device
    step = prepare(params, grads, states, seeds, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                   adamw=adamw, found_inf=found_inf, index_offsets=index_offsets, step_buffer=step_buffer,
                   cache=cache)
    for key, idx in step.groups.items():
        rows = None if cache is None or step.writebacks else cache.get(("rows", key))
        if rows is None:
            rows = [x for i in idx for x in _row(step.entries[i])]
            if cache is not None and not step.writebacks:
                cache[("rows", key)] = rows
        else:                                  # this step's gradients and parameters (see prepare)
            es = [step.entries[i] for i in idx]
            rows[1::_COLS] = [e.grad.data_ptr() for e in es]
            for j, e in enumerate(es):
                if e.param16 is None:
                    rows[_COLS * j] = e.master.data_ptr()
                else:
                    rows[_COLS * j + 6] = e.param16.data_ptr()
        c, k = group_arrays(step, key, idx, cache)
        _launch(key, rows, [params[i].numel() for i in idx], c, k, device, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, adamw=adamw, maximize=maximize, grad_scale=grad_scale,
                found_inf=found_inf)
    step.finish()


def _launch(key: tuple, rows: list[int], numels: list[int], c: Tensor, k: Tensor, device: torch.device, *,
            beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf) -> None:
    grad_dtype, p16_dtype, master_kind, m_dtype, v_dtype = key
    table = pointer_table(rows, device)
    numels_t, chunk_tensor, chunk_start = chunk_map(tuple(numels), CHUNK, device)
    if chunk_tensor.numel() == 0:
        return
    gs = grad_scale.to(device, torch.float32) if grad_scale is not None else c
    fi = found_inf.to(device, torch.float32) if found_inf is not None else c
    one_minus_beta1, one_minus_beta2 = moment_coeffs(beta1, beta2)
    with device_guard(device):
        fused_adam_coded_kernel[(chunk_tensor.numel(),)](
            table, numels_t, c, k, chunk_tensor, chunk_start, gs, fi,
            one_minus_beta1, float(beta2), one_minus_beta2, float(eps), float(weight_decay),
            GRAD_DTYPE=_TL[grad_dtype], P16_KIND=_P16[p16_dtype], MASTER_KIND=master_kind, M_KIND=_KIND[m_dtype],
            V_KIND=_KIND[v_dtype], HAS_GRAD_SCALE=grad_scale is not None, HAS_FOUND_INF=found_inf is not None,
            ADAMW=bool(adamw), MAXIMIZE=bool(maximize), BLOCK_SIZE=BLOCK, N_ITERS=ITERS, **LAUNCH_OPTIONS)


# Ahead-of-time codegen cases (tests/test_codegen.py, sm_80 and sm_90): every state kind of each moment, the
# remainder and fp32-master layouts, bf16, fp16 and fp32 gradients; the 8-bit moment codec (kind 2) for both
# moments together, for exp_avg_sq next to an fp32 / fp8 exp_avg, and for exp_avg next to a bf16 exp_avg_sq.
def _codegen_cases() -> list:
    sig = dict(ptr_table="*i64", numels="*i64", coeffs="*fp32", keys="*i64", chunk_tensor="*i32",
               chunk_start="*i64", grad_scale_ptr="*fp32", found_inf_ptr="*fp32", one_minus_beta1="fp32",
               beta2="fp32", one_minus_beta2="fp32", eps="fp32", weight_decay="fp32")
    names = ["fp32", "bf16", "u8", "f8"]
    cases = []
    for grad, p16, master, m_kind, v_kind in ((tl.bfloat16, 1, 1, 2, 2), (tl.bfloat16, 1, 1, 0, 0),
                                              (tl.bfloat16, 1, 0, 1, 1), (tl.float32, 0, 0, 3, 3),
                                              (tl.bfloat16, 1, 1, 1, 3), (tl.float16, 2, 0, 2, 1),
                                              (tl.float32, 0, 0, 2, 2), (tl.bfloat16, 1, 0, 0, 2),
                                              (tl.bfloat16, 1, 1, 3, 2)):
        ce = dict(GRAD_DTYPE=grad, P16_KIND=p16, MASTER_KIND=master, M_KIND=m_kind, V_KIND=v_kind,
                  HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, ADAMW=True, MAXIMIZE=False, BLOCK_SIZE=BLOCK,
                  N_ITERS=ITERS)
        desc = (f"coded grad={grad} p16={['none', 'bf16', 'fp16'][p16]} master={['fp32', 'remainder'][master]} "
                f"m={names[m_kind]} v={names[v_kind]}")
        # 128-bit accesses: at least one wide load and store (fp32 arrays) when
        # an fp32 array is present, else the check below is "no wide accesses required".
        wide = int(master == 0 and p16 == 0) + (m_kind == 0) + (v_kind == 0)
        opts = dict(LAUNCH_OPTIONS, streaming=True, min_wide_loads=wide, min_wide_stores=wide, max_shared=4096)
        cases.append((fused_adam_coded_kernel, sig, ce, desc, opts))
    return cases


CODEGEN_CASES = _codegen_cases()
