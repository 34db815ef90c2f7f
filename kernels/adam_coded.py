"""Fused Adam/AdamW on coded states (issue 11) in Triton: decode in registers -> the fp32 update of
``adam.adam_update`` (the fused-Adam contract) -> encode, in one pass; no fp32 copy of any state.

[Note: the coded kernel]
The reference is ``zero_kernels.codecs.adam_step_coded`` and the kernel equals it bit for bit
(tests/test_adam_coded.py): every codec is computed on bits or with IEEE operations (kernels/_codecs.py).
A program's BLOCK_SIZE = 1024 elements are 4 rows, the 8-bit / fp8 quantization blocks (chunks start at
multiples of 1024, blocks are counted from each tensor's first element), so the new block scale is a row max in
registers, computed after the update and before the encode. With 4 warps (LAUNCH_OPTIONS) warp r holds row r,
8 elements per thread, and every array of the tile, uint8 codes to fp32, has that one register layout: no
shared memory, no barrier (tests/test_codegen.py: max_shared 0). The tile is 3-D, rows x H x L with
L = 32 * VEC (``_tile_offsets``; the axis order is _codecs.ROWS_AXIS): lane j of warp r holds VEC contiguous
elements at each of H = 256 / L steps, VEC = 8 (H = 1) unless an fp32 array is streamed, then VEC = 4 (H = 2),
as fp32 stores are at most 128-bit per thread. So the 16-byte-aligned path is all 128-bit for the widest array
(bf16 and int16 with VEC 8, fp32 with VEC 4) and 64-bit / 32-bit for the uint8 codes; the row absmax reduces a
thread's H registers, then 32 lanes by shuffles; a block scale is stored by lane 0 of its warp
(``_store_scale``). Misaligned tensors and a tensor's last block run VEC = 1 (one element per thread, the
same warp-per-row layout). Before (triton 3.9/3.6, sm_90, 8-bit states): up to 35 bar.sync, 2-4 KB of shared
memory, 118-121 registers; after: none, none, 80-90, capped at 80 for 8-bit moments (Q8_MAXNREG;
tests/test_codegen.py prints them). H200 (2026-11-26, interleaved in one process against the old kernel,
bench/gpu_coded_tune.py --base): 1.04-1.11x (llama7b-layer) and 1.15-1.20x (gpt2-xl) faster, bit for bit the
same; Nsight Compute (llama7b-layer, 8bit+rem): DRAM 49% -> 56% busy, occupancy 25% -> 29% (90 registers,
before the cap). Still latency-bound: the step moves ~2.0-2.6 TB/s of the ~4 the streaming kernels reach.
Since then the chunks inside their tensor with every address aligned run in a launch of their own whose kernel
holds the 128-bit path alone (FULL; [Note: full and rest launches] in _multi_tensor.py): 59-79 registers per
thread instead of 77-102 (sm_90, the codegen cases; H200 2026-11-28: 1.08x faster than one launch); the rest chunks (a tensor's last,
a misaligned tensor's) run the kernel with every path. The FULL launch can also run pipelined (PIPELINE,
module flag PIPELINE_FULL, off: 0.89-0.91x on the H200): its N_ITERS tiles unrolled, tile i + 1's loads (``_tile_load``,
undecoded) issued before tile i's arithmetic and stores (``_tile_step``), so a thread keeps a tile of loads in
flight through the arithmetic (the PTX order: loads i + 1, sqrt i, stores i), for 92-96 registers instead of
59-69 (sm_90), i.e. 5 programs per SM instead of 7.
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
from ..reference import m_bound, moment_coeffs
from ._codecs import (F8_MAX, QBLOCK, ROWS_AXIS, block_absmax, decode_bf16, decode_f8, decode_m8, decode_v8,
                      encode_bf16_sr, encode_f8, encode_m8, encode_v8, join_remainder, ld, per_row, scaled,
                      split_remainder, sr_key, st)
from ._multi_tensor import aligned_columns, device_guard, launch_tables, program_chunk, round_bf16_bits, typed_pointer
from .adam import adam_update

BLOCK = 1024
ITERS = 4
CHUNK = BLOCK * ITERS
_COLS = 7   # master, grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param16
# 4 warps: 4 rows of 256 at 8 elements per thread, each row in one warp ([Note: the coded kernel]). Measured on
# an H200 (old layout; bench/gpu_coded_tune.py, llama7b-layer, 2026-11-26): 1.79 ms against 2.04 with 8 warps
# (8bit), 1.94 against 2.08 (8bit+rem).
LAUNCH_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)
# Both moments 8-bit: at most 80 registers per thread (the kernel takes 88-90 with remainders), so 6 programs of
# 4 warps fit an SM instead of 5 (occupancy 37.5% instead of 31%; the kernel is latency-bound). H200,
# bench/gpu_coded_tune.py, interleaved, two leases of 2026-11-26, against no cap: 8bit+rem 1.08x / 0.95x
# (llama7b-layer) and 1.14x / 1.09x (gpt2-xl), 8bit 1.00-1.01x / 0.99-1.00x: kept for the remainder layout's
# gain on the many-tensor workload. ptxas then spills 4 B in one variant (triton 3.9, sm_90; none with 3.6):
# the codegen cases allow 8 B there. The other state formats keep no cap (at 80 their bf16 / fp8 variants spill
# 28-64 B).
Q8_MAXNREG = 80
# Full chunks (inside their tensor, aligned) in a launch of their own, FULL=True ([Note: full and rest launches]
# in _multi_tensor.py): the kernel compiled with the 128-bit path alone takes 59-79 registers per thread instead
# of 77-102 (sm_90, triton 3.9, every codegen case below; ptxas -v), 7-8 programs per SM instead of 5-6, with no
# cap. H200, 2026-11-28 (bench/gpu_coded_tune.py, llama7b-layer, interleaved): 1.390 ms against 1.517 with every
# chunk in one launch (variant suffix "n") for 8bit, 1.558 against 1.674 for 8bit+rem. False: one launch of every
# chunk (FULL=False).
SPLIT_FULL = True
# The FULL launch with its loads one tile ahead (PIPELINE): the tile's loads are in flight during the previous
# tile's arithmetic (the kernel is latency-bound, [Note: the coded kernel]) at the cost of the registers that
# hold them. H200, 2026-11-28 (bench/gpu_coded_tune.py, variant suffix "p"): slower, 1.555 against 1.390 ms (8bit,
# llama7b-layer) and 1.713 against 1.558 (8bit+rem); over 8 iterations 1.659 / 1.830. Off.
PIPELINE_FULL = False


def launch_options(m_kind: int, v_kind: int, full: bool = False) -> dict:
    """Triton launch options of the kernel for moment kinds (M_KIND, V_KIND) and FULL."""
    if m_kind == v_kind == 2 and Q8_MAXNREG and not full:
        return dict(LAUNCH_OPTIONS, maxnreg=Q8_MAXNREG)
    return LAUNCH_OPTIONS


@triton.jit
def _load_moment(ptr, scale_ptr, offs, mask, rows, numel, MASKED: tl.constexpr, KIND: tl.constexpr,
                 ALIGNED: tl.constexpr):
    """One moment of the tile as stored (KIND: see [Note: the coded kernel]): (values or codes, the blockwise
    kinds' fp32 scale per row [ROWS]; the values again for the others), decoded by _decode_moment. A blockwise
    moment's scale is loaded once per row (block) and broadcast there."""
    if KIND == 0:
        x = ld(typed_pointer(ptr, tl.float32, ALIGNED), offs, mask, MASKED)
        return x, x
    elif KIND == 1:
        x = ld(typed_pointer(ptr, tl.uint16, ALIGNED), offs, mask, MASKED)
        return x, x
    else:
        row_mask = rows * QBLOCK < numel if MASKED else None
        return (ld(typed_pointer(ptr, tl.uint8, ALIGNED), offs, mask, MASKED),
                ld(scale_ptr.to(tl.pointer_type(tl.float32)), rows, row_mask, MASKED))


@triton.jit
def _decode_moment(x, scale, KIND: tl.constexpr, SQ: tl.constexpr):
    """A moment from _load_moment to fp32 (SQ: exp_avg_sq, whose 8-bit code is the log code of sqrt(v)); the
    per-block division of the 8-bit m decode runs once per row, not per element."""
    if KIND == 0:
        return x
    elif KIND == 1:
        return decode_bf16(x)
    else:
        scale = per_row(scale, x)
        if KIND == 2:
            if SQ:
                return decode_v8(x, scale)
            else:
                return decode_m8(x, scale)
        else:
            return decode_f8(x) * scale


@triton.jit
def _store_scale(scale_ptr, scale, rows, numel, MASKED: tl.constexpr):
    """Store each row's (block's) new scale from the row's own warp: lane 0 of a 3-D pointer tile of ROWS x 32
    (lane j at scale r + j, masked off for j > 0). Contiguous along the lanes, Triton lays the 32 lanes of a
    warp on one row as in the tile, and the store takes the scale where the row reduction left it; a [ROWS]
    store would be laid out one row per lane and reach it through shared memory."""
    lane = tl.arange(0, 32)[None, None, :]
    ptr = scale_ptr.to(tl.pointer_type(tl.float32)) + per_row(rows, lane) + lane
    keep = lane == 0
    if MASKED:
        keep = keep & per_row(rows * QBLOCK < numel, lane)
    tl.store(ptr, per_row(scale, ptr), mask=keep)


@triton.jit
def _store_moment(x, root, ptr, scale_ptr, offs, mask, rows, numel, index_offset, key,
                  MASKED: tl.constexpr, KIND: tl.constexpr, SQ: tl.constexpr, ALIGNED: tl.constexpr):
    """Encode one updated moment of the tile and store it (with its new block scales). ``root``: sqrt(x),
    which the 8-bit exp_avg_sq code (SQ) encodes."""
    if KIND == 0:
        st(typed_pointer(ptr, tl.float32, ALIGNED), offs, x, mask, MASKED)
    elif KIND == 1:
        st(typed_pointer(ptr, tl.uint16, ALIGNED), offs, encode_bf16_sr(x, offs, index_offset, key), mask, MASKED)
    else:
        if KIND == 3:
            scale = block_absmax(x, mask)
            scale = tl.div_rn(scale, F8_MAX)
            y = scaled(x, scale)
            code = encode_f8(y)
            if SQ:   # codecs.encode_f8_v: a nonzero v never codes to 0
                code = tl.where((code == 0) & (y != 0), 1, code).to(tl.uint8)
        elif SQ:
            code, scale = encode_v8(root, mask)
        else:
            code, scale = encode_m8(x, offs, index_offset, key, mask)
        st(typed_pointer(ptr, tl.uint8, ALIGNED), offs, code, mask, MASKED)
        _store_scale(scale_ptr, scale, rows, numel, MASKED)


@triton.jit
def _store_param(p, a_master, a_p16, offs, mask, MASKED: tl.constexpr, P16_KIND: tl.constexpr,
                 MASTER_KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """Store the updated fp32 parameter of the tile in its layout (MASTER_KIND, P16_KIND)."""
    if MASTER_KIND == 1:
        hi, rem = split_remainder(p)
        st(typed_pointer(a_p16, tl.uint16, ALIGNED), offs, hi, mask, MASKED)
        st(typed_pointer(a_master, tl.int16, ALIGNED), offs, rem, mask, MASKED)
    else:
        st(typed_pointer(a_master, tl.float32, ALIGNED), offs, p, mask, MASKED)
        if P16_KIND == 1:
            st(typed_pointer(a_p16, tl.uint16, ALIGNED), offs, round_bf16_bits(p), mask, MASKED)
        elif P16_KIND == 2:
            st(typed_pointer(a_p16, tl.float16, ALIGNED), offs, p.to(tl.float16), mask, MASKED)


@triton.jit
def _tile_load(row, offs, mask, rows, numel, GRAD_DTYPE: tl.constexpr, MASTER_KIND: tl.constexpr,
               M_KIND: tl.constexpr, V_KIND: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
               DECODE: tl.constexpr):
    """Every load of one tile of one tensor (table row ``row``): (master or bf16 parameter bits, int16
    remainder, grad, exp_avg, its scales, exp_avg_sq, its scales) as stored, which _tile_step decodes; or,
    DECODE, each decoded right after its load (then p, g, m, v are fp32 and the other fields repeat them).
    Undecoded for the pipelined FULL launch, which issues a tile's loads before the previous tile's arithmetic
    ([Note: full and rest launches] in _multi_tensor.py); decoded in place elsewhere, the instruction order the
    register counts of the codegen cases were measured with (decoding after all loads costs the 8-bit
    fp32-master FULL case a 4-byte spill on sm_80)."""
    if MASTER_KIND == 1:
        a = ld(typed_pointer(tl.load(row + 6), tl.uint16, ALIGNED), offs, mask, MASKED)
        b = ld(typed_pointer(tl.load(row + 0), tl.int16, ALIGNED), offs, mask, MASKED)
        if DECODE:
            a = join_remainder(a, b)
            b = a
    else:
        a = ld(typed_pointer(tl.load(row + 0), tl.float32, ALIGNED), offs, mask, MASKED)
        b = a
    g = ld(typed_pointer(tl.load(row + 1), GRAD_DTYPE, ALIGNED), offs, mask, MASKED)
    if DECODE:
        g = g.to(tl.float32)
    m, ms = _load_moment(tl.load(row + 2), tl.load(row + 4), offs, mask, rows, numel, MASKED, M_KIND, ALIGNED)
    if DECODE:
        m = _decode_moment(m, ms, M_KIND, False)
        ms = m
    v, vs = _load_moment(tl.load(row + 3), tl.load(row + 5), offs, mask, rows, numel, MASKED, V_KIND, ALIGNED)
    if DECODE:
        v = _decode_moment(v, vs, V_KIND, True)
        vs = v
    return a, b, g, m, ms, v, vs


@triton.jit
def _tile_step(row, a, b, g, m, ms, v, vs, offs, mask, rows, numel, step_size, bc2_sqrt, decay, grad_scale,
               m_key, v_key, index_offset, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, m_bound,
               P16_KIND: tl.constexpr, MASTER_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
               MASKED: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr, ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr,
               ALIGNED: tl.constexpr, DECODED: tl.constexpr):
    """Decode the loads of _tile_load (unless DECODED), update, encode and store the tile."""
    if DECODED:
        p = a
    else:
        p = join_remainder(a, b) if MASTER_KIND == 1 else a
        g = g.to(tl.float32)
        m = _decode_moment(m, ms, M_KIND, False)
        v = _decode_moment(v, vs, V_KIND, True)
    p, m, v, _, root = adam_update(p, g, m, v, v, step_size, bc2_sqrt, decay, grad_scale, one_minus_beta1,
                                   beta2, one_minus_beta2, eps, weight_decay, m_bound, HAS_GRAD_SCALE, ADAMW, False,
                                   MAXIMIZE, M_KIND == 2)
    a_master, a_p16 = tl.load(row + 0), tl.load(row + 6)
    # The parameter first, its registers free before the moments' row reductions (8-bit: -8 registers); not
    # next to an fp8 moment, where triton 3.6's ptxas then spills a few bytes.
    P_FIRST: tl.constexpr = M_KIND != 3 and V_KIND != 3
    if P_FIRST:
        _store_param(p, a_master, a_p16, offs, mask, MASKED, P16_KIND, MASTER_KIND, ALIGNED)
    _store_moment(m, root, tl.load(row + 2), tl.load(row + 4), offs, mask, rows, numel, index_offset, m_key,
                  MASKED, M_KIND, False, ALIGNED)
    _store_moment(v, root, tl.load(row + 3), tl.load(row + 5), offs, mask, rows, numel, index_offset, v_key,
                  MASKED, V_KIND, True, ALIGNED)
    if not P_FIRST:
        _store_param(p, a_master, a_p16, offs, mask, MASKED, P16_KIND, MASTER_KIND, ALIGNED)


@triton.jit
def _coded_tile(row, offs, rows, numel, step_size, bc2_sqrt, decay, grad_scale, m_key, v_key, index_offset,
                one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, m_bound,
                GRAD_DTYPE: tl.constexpr, P16_KIND: tl.constexpr, MASTER_KIND: tl.constexpr,
                M_KIND: tl.constexpr, V_KIND: tl.constexpr, MASKED: tl.constexpr, HAS_GRAD_SCALE: tl.constexpr,
                ADAMW: tl.constexpr, MAXIMIZE: tl.constexpr, ALIGNED: tl.constexpr):
    """Load, decode, update, encode and store one tile of one tensor (table row ``row``): ``offs`` from
    _tile_offsets, ``rows`` [ROWS] its blocks; MASKED: only the lanes inside the tensor (a mask of None
    elsewhere: no compare is computed, block_absmax takes every lane)."""
    mask = offs < numel if MASKED else None
    a, b, g, m, ms, v, vs = _tile_load(row, offs, mask, rows, numel, GRAD_DTYPE, MASTER_KIND, M_KIND, V_KIND,
                                       MASKED, ALIGNED, True)
    _tile_step(row, a, b, g, m, ms, v, vs, offs, mask, rows, numel, step_size, bc2_sqrt, decay, grad_scale,
               m_key, v_key, index_offset, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, m_bound,
               P16_KIND, MASTER_KIND, M_KIND, V_KIND, MASKED, HAS_GRAD_SCALE, ADAMW, MAXIMIZE, ALIGNED, True)


@triton.jit
def _tile_offsets(block_start, ROWS: tl.constexpr, VEC: tl.constexpr, HINTED: tl.constexpr):
    """int64 offsets of a block, [H, ROWS, L] (ROWS_AXIS 1) or [ROWS, H, L] (H = QBLOCK // L, L = 32 * VEC):
    element (h, r, l) is element h * L + l of row (quantization block) r, so lane j of warp r holds VEC
    contiguous elements at each of the H steps of L. HINTED (the 128-bit path): contiguous runs of exactly VEC
    (the uint8 codes would be given 8 or 16, the shape's own 128 or 256), starting at multiples of VEC, so
    Triton's coalescing gives every array (uint8 to fp32) the same VEC elements per thread; unhinted (VEC 1),
    one element per thread. A 2-D [ROWS, 256] tile cannot hold 4 per thread with a row per warp: Triton would
    spread a row over 64 lanes. Call it inside the branch that uses it ([Note: hints mark the defining op])."""
    L: tl.constexpr = 32 * VEC
    h = tl.arange(0, QBLOCK // L).to(tl.int64) * L
    r = tl.arange(0, ROWS).to(tl.int64) * QBLOCK
    if ROWS_AXIS == 1:
        offs = block_start + h[:, None, None] + r[None, :, None] + tl.arange(0, L).to(tl.int64)[None, None, :]
    else:
        offs = block_start + r[:, None, None] + h[None, :, None] + tl.arange(0, L).to(tl.int64)[None, None, :]
    if HINTED:
        offs = tl.max_contiguous(tl.multiple_of(offs, [1, 1, VEC]), [1, 1, VEC])
    return offs


@triton.jit
def _tile_rows(block_start, ROWS: tl.constexpr):
    """The quantization blocks [ROWS] (int64, counted from the tensor's element 0) of the tile at block_start."""
    return block_start // QBLOCK + tl.arange(0, ROWS).to(tl.int64)


@triton.jit
def fused_adam_coded_kernel(
    ptr_table,        # int64 [T, 7]: data_ptr of master (fp32 master / fp32 param / int16 remainder), grad, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, param16 (0 = absent)
    numels,           # int64 [T]: elements in tensor t
    coeffs,           # fp32 [T, 3]: step_size, bc2_sqrt, decay (reference.compute_coeffs)
    keys,             # int64 [T, 3]: seed, step count (the moments' SR keys are codecs.sr_key of both), flat index of element 0
    chunk_tensor,     # int32 [n_programs]: the tensor program pid works on
    chunk_start,      # int64 [n_programs]: first element of program pid's chunk (a multiple of BLOCK_SIZE)
    grad_scale_ptr,   # fp32 [1]: gradient multiplier; read iff HAS_GRAD_SCALE
    found_inf_ptr,    # fp32 [1]: nonzero -> the whole step writes nothing; read iff HAS_FOUND_INF
    one_minus_beta1,  # fp32 scalar: 1 - beta1 (computed in double on the host)
    beta2,            # fp32 scalar
    one_minus_beta2,  # fp32 scalar: 1 - beta2 (computed in double on the host)
    eps,              # fp32 scalar
    weight_decay,     # fp32 scalar: L2 coefficient when not ADAMW
    m_bound,          # fp32 scalar: reference.m_bound(beta1, beta2) (double on the host); used iff M_KIND == 2
    GRAD_DTYPE: tl.constexpr,      # tl.float32 / tl.bfloat16 / tl.float16
    P16_KIND: tl.constexpr,        # 0: none, 1: bf16 (RNE bits, or the remainder's high half), 2: fp16
    MASTER_KIND: tl.constexpr,     # 0: fp32 master, 1: bf16 parameter + int16 remainder
    M_KIND: tl.constexpr,          # exp_avg format: 0 fp32, 1 bf16 SR, 2 uint8 (int8 codes), 3 float8_e4m3fn
    V_KIND: tl.constexpr,          # exp_avg_sq format, as M_KIND (2: uint8 codes of sqrt(v), rounded up)
    HAS_GRAD_SCALE: tl.constexpr,  # multiply the gradient by *grad_scale_ptr
    HAS_FOUND_INF: tl.constexpr,   # read *found_inf_ptr and skip the step when nonzero
    ADAMW: tl.constexpr,           # decoupled weight decay (p *= decay) instead of L2 (g += weight_decay * p)
    MAXIMIZE: tl.constexpr,        # ascend: the gradient is negated
    BLOCK_SIZE: tl.constexpr,      # elements per iteration: BLOCK_SIZE // 256 rows (one per warp)
    N_ITERS: tl.constexpr,         # iterations per program
    FULL: tl.constexpr,            # every chunk lies inside its tensor, every address 16-byte aligned (checked
                                   # on the host, [Note: full and rest launches]): only the 128-bit path is compiled
    PIPELINE: tl.constexpr = False,  # with FULL: iteration i + 1's loads issued before iteration i's arithmetic
):
    if HAS_FOUND_INF:
        if tl.load(found_inf_ptr) != 0:
            return
    t, start, numel = program_chunk(chunk_tensor, chunk_start, numels)
    row = ptr_table + t * 7
    step_size, bc2_sqrt, decay = tl.load(coeffs + t * 3), tl.load(coeffs + t * 3 + 1), tl.load(coeffs + t * 3 + 2)
    seed, count, index_offset = tl.load(keys + t * 3), tl.load(keys + t * 3 + 1), tl.load(keys + t * 3 + 2)
    m_key, v_key = sr_key(seed, count, 0), sr_key(seed, count, 1)
    grad_scale = tl.load(grad_scale_ptr) if HAS_GRAD_SCALE else 1.0
    ROWS: tl.constexpr = BLOCK_SIZE // QBLOCK
    # 128-bit accesses of the widest array: 4 per thread when one is fp32 (and the others follow), else 8
    VEC: tl.constexpr = 4 if (MASTER_KIND == 0 or GRAD_DTYPE == tl.float32 or M_KIND == 0 or V_KIND == 0) else 8
    if FULL and PIPELINE:
        # Unrolled; the loads of tile i + 1 are in flight during tile i's arithmetic and stores (distinct
        # addresses: other elements and blocks of the same tensor). Registers: those loads, live across a tile.
        offs = _tile_offsets(start, ROWS, VEC, True)
        rows = _tile_rows(start, ROWS)
        nxt = _tile_load(row, offs, None, rows, numel, GRAD_DTYPE, MASTER_KIND, M_KIND, V_KIND, False, True, False)
        for i in tl.static_range(N_ITERS):
            a, b, g, m, ms, v, vs = nxt
            cur_offs, cur_rows = offs, rows
            if i + 1 < N_ITERS:
                offs = _tile_offsets(start + (i + 1) * BLOCK_SIZE, ROWS, VEC, True)
                rows = _tile_rows(start + (i + 1) * BLOCK_SIZE, ROWS)
                nxt = _tile_load(row, offs, None, rows, numel, GRAD_DTYPE, MASTER_KIND, M_KIND, V_KIND, False,
                                 True, False)
            _tile_step(row, a, b, g, m, ms, v, vs, cur_offs, None, cur_rows, numel, step_size, bc2_sqrt, decay,
                       grad_scale, m_key, v_key, index_offset, one_minus_beta1, beta2, one_minus_beta2, eps,
                       weight_decay, m_bound, P16_KIND, MASTER_KIND, M_KIND, V_KIND, False, HAS_GRAD_SCALE, ADAMW,
                       MAXIMIZE, True, False)
        return
    for i in range(N_ITERS):
        block_start = start + i * BLOCK_SIZE
        rows = _tile_rows(block_start, ROWS)
        args = (rows, numel, step_size, bc2_sqrt, decay, grad_scale, m_key, v_key, index_offset,
                one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, m_bound)
        if FULL:
            _coded_tile(row, _tile_offsets(block_start, ROWS, VEC, True), *args, GRAD_DTYPE, P16_KIND,
                        MASTER_KIND, M_KIND, V_KIND, False, HAS_GRAD_SCALE, ADAMW, MAXIMIZE, True)
        elif block_start + BLOCK_SIZE <= numel:
            # tested here, not once per program: live across the loop it cost the every-path kernel up to 15
            # more registers (sm_90, triton 3.9); the row's loads hit the cache
            aligned = ((tl.load(row) | tl.load(row + 1) | tl.load(row + 2) | tl.load(row + 3) | tl.load(row + 6))
                       & 15) == 0
            if aligned:
                _coded_tile(row, _tile_offsets(block_start, ROWS, VEC, True), *args, GRAD_DTYPE, P16_KIND,
                            MASTER_KIND, M_KIND, V_KIND, False, HAS_GRAD_SCALE, ADAMW, MAXIMIZE, True)
            else:
                _coded_tile(row, _tile_offsets(block_start, ROWS, 1, False), *args, GRAD_DTYPE, P16_KIND,
                            MASTER_KIND, M_KIND, V_KIND, False, HAS_GRAD_SCALE, ADAMW, MAXIMIZE, False)
        elif block_start < numel:
            _coded_tile(row, _tile_offsets(block_start, ROWS, 1, False), *args, GRAD_DTYPE, P16_KIND,
                        MASTER_KIND, M_KIND, V_KIND, True, HAS_GRAD_SCALE, ADAMW, MAXIMIZE, False)


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


def aligned_tensors(rows: list[int]) -> tuple[bool, ...]:
    """Per tensor of a group's pointer rows: are the addresses the kernel reads and writes by vectors (master,
    grad, exp_avg, exp_avg_sq, param16; 0 = absent) 16-byte aligned? The kernel's own test, on the host."""
    return aligned_columns(rows, _COLS, (0, 1, 2, 3, 6))


def _launch(key: tuple, rows: list[int], numels: list[int], c: Tensor, k: Tensor, device: torch.device, *,
            beta1, beta2, eps, weight_decay, adamw, maximize, grad_scale, found_inf) -> None:
    """The group's chunks in two launches (full ones with FULL=True, the rest) or, without SPLIT_FULL, one."""
    grad_dtype, p16_dtype, master_kind, m_dtype, v_dtype = key
    table, numels_t, launches = launch_tables(rows, numels, CHUNK, device, aligned_tensors if SPLIT_FULL else None)
    gs = grad_scale.to(device, torch.float32) if grad_scale is not None else c
    fi = found_inf.to(device, torch.float32) if found_inf is not None else c
    one_minus_beta1, one_minus_beta2 = moment_coeffs(beta1, beta2)
    for (chunk_tensor, chunk_start), full in launches:
        with device_guard(device):
            fused_adam_coded_kernel[(chunk_tensor.numel(),)](
                table, numels_t, c, k, chunk_tensor, chunk_start, gs, fi,
                one_minus_beta1, float(beta2), one_minus_beta2, float(eps), float(weight_decay),
                m_bound(beta1, beta2), GRAD_DTYPE=_TL[grad_dtype], P16_KIND=_P16[p16_dtype], MASTER_KIND=master_kind,
                M_KIND=_KIND[m_dtype], V_KIND=_KIND[v_dtype], HAS_GRAD_SCALE=grad_scale is not None,
                HAS_FOUND_INF=found_inf is not None, ADAMW=bool(adamw), MAXIMIZE=bool(maximize),
                BLOCK_SIZE=BLOCK, N_ITERS=ITERS, FULL=full, PIPELINE=full and PIPELINE_FULL,
                **launch_options(_KIND[m_dtype], _KIND[v_dtype], full))


# Ahead-of-time codegen cases (tests/test_codegen.py, sm_80 and sm_90): every state kind of each moment, the
# remainder and fp32-master layouts, bf16, fp16 and fp32 gradients; the 8-bit moment codec (kind 2) for both
# moments together (remainder; fp32 master with fp32 or bf16 gradients), for exp_avg_sq next to an fp32 / fp8
# exp_avg, and for exp_avg next to a bf16 exp_avg_sq. Each as the FULL launch (at most 80 registers, 96 with an
# 8-bit exp_avg, no cap,
# no spill); the launch of the rest chunks (every path, FULL=False) and the pipelined FULL launch (PIPELINE:
# 92-96 registers on sm_90, 106-128 on sm_80, triton 3.9; at most 128) for the first four.
def _codegen_cases() -> list:
    sig = dict(ptr_table="*i64", numels="*i64", coeffs="*fp32", keys="*i64", chunk_tensor="*i32",
               chunk_start="*i64", grad_scale_ptr="*fp32", found_inf_ptr="*fp32", one_minus_beta1="fp32",
               beta2="fp32", one_minus_beta2="fp32", eps="fp32", weight_decay="fp32", m_bound="fp32")
    names = ["fp32", "bf16", "u8", "f8"]
    layouts = ((tl.bfloat16, 1, 1, 2, 2), (tl.bfloat16, 1, 1, 0, 0), (tl.bfloat16, 1, 0, 1, 1),
               (tl.float32, 0, 0, 3, 3), (tl.bfloat16, 1, 1, 1, 3), (tl.float16, 2, 0, 2, 1),
               (tl.float32, 0, 0, 2, 2), (tl.bfloat16, 1, 0, 0, 2), (tl.bfloat16, 1, 1, 3, 2),
               (tl.bfloat16, 1, 0, 2, 2))
    cases = []
    for full, pipe, chosen in ((True, False, layouts), (False, False, layouts[:4]), (True, True, layouts[:4])):
        for grad, p16, master, m_kind, v_kind in chosen:
            ce = dict(GRAD_DTYPE=grad, P16_KIND=p16, MASTER_KIND=master, M_KIND=m_kind, V_KIND=v_kind,
                      HAS_GRAD_SCALE=True, HAS_FOUND_INF=True, ADAMW=True, MAXIMIZE=False, BLOCK_SIZE=BLOCK,
                      N_ITERS=ITERS, FULL=full, PIPELINE=pipe)
            desc = (f"coded {'pipelined ' if pipe else ''}{'full' if full else 'rest'} grad={grad} "
                    f"p16={['none', 'bf16', 'fp16'][p16]} "
                    f"master={['fp32', 'remainder'][master]} m={names[m_kind]} v={names[v_kind]}")
            # 128-bit accesses: at least one wide load and store (fp32 arrays) when
            # an fp32 array is present, else the check below is "no wide accesses required".
            wide = int(master == 0 and p16 == 0) + (m_kind == 0) + (v_kind == 0)
            opts = dict(launch_options(m_kind, v_kind, full), streaming=True, min_wide_loads=wide,
                        min_wide_stores=wide, max_shared=0)
            if full:   # the host checked the alignment: the PTX has no test of it (the 8-bit exp_avg's
                # dither, [Note: state codecs] 2, took the fp16-gradient case from 80 to 90 registers on sm_90)
                opts.update(max_regs=128 if pipe else (96 if m_kind == 2 else 80), host_aligned=True)
            else:      # both 8-bit (the dither): 24 B of spills on sm_90 (36 / 40 B since the dither became a Weyl
                # sequence, 2026-11-29), in the launch of the rest chunks only (a tensor's last partial chunk)
                opts.update(max_spill=40 if m_kind == v_kind == 2 else 0)
            cases.append((fused_adam_coded_kernel, sig, ce, desc, opts))
    return cases


CODEGEN_CASES = _codegen_cases()
