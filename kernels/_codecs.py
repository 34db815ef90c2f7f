"""The state codecs of zero_kernels/codecs.py ([Note: state codecs]) as Triton device functions.

Every rule is computed on integer bits or with IEEE operations (``tl.div_rn``, one fp32 multiply or add),
never with a float cast whose rounding differs between the interpreter (numpy truncates fp32 -> bf16)
and a GPU: the interpreter's bits are the GPU's, and both are the reference's.
Element ``x`` of a tile is element ``offs`` of its tensor. A tile is [rows, 256] (kernels/quant.py) or 3-D
(kernels/adam_coded.py, [Note: the coded kernel]): [H, rows, 256 // H] or [rows, H, 256 // H] (``ROWS_AXIS``);
either way its rows are the 256-element quantization blocks (``QBLOCK``), so a row reduction is a block's
absmax, and ``per_row`` broadcasts a per-block value against the tile.
Two 8-bit codecs live here: the arithmetic moment codec of the coded-state kernel (``encode_m8`` /
``decode_m8``, ``encode_v8`` / ``decode_v8``, [Note: state codecs] 2) and the table codec of the ZeRO++
wire (``encode_q8`` / ``decode_q8``, kernels/quant.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

QBLOCK = tl.constexpr(256)      # codecs.BLOCK: elements per block scale
F8_MAX = tl.constexpr(448.0)    # codecs.F8_MAX: largest finite float8_e4m3fn
M8_LEVELS = tl.constexpr(127.0)     # codecs.M8_LEVELS: exp_avg codes -127..127
V8_STEP_BITS = tl.constexpr(19)         # codecs.V8_STEP_BITS: one exp_avg_sq code = 2^19 in the bits of sqrt(v)
V8_TOP_BITS = tl.constexpr(255 << 19)   # the top code (codecs.V8_LEVELS = 255) in those bits
V8_HALF_STEP = tl.constexpr(1 << 18)    # rounds to the nearest code
M8_DITHER_BITS = tl.constexpr(15)        # codecs.M8_DITHER_BITS: the m code's stochastic rounding
M8_INV_LEVELS = tl.constexpr(4161536.0)  # 127 * 2^M8_DITHER_BITS: the inverse of the m code, scaled
RNE_MAGIC = tl.constexpr(12582912.0)    # 1.5 * 2^23: y + RNE_MAGIC lies in [2^23, 2^24) for |y| <= 2^22
RNE_MAGIC_BITS = tl.constexpr(0x4B400000)   # its fp32 bits
# Axis of the rows in a 3-D tile. Triton's coalescing lays a warp's lanes along the contiguous axis, then its
# warps along the next axis of its order, where the two strided axes tie: Triton 3.9 takes axis 1 first, 3.6
# axis 0 (seen in their TTGIR), and the rows must be where the warps go. Versions in between are untested: a
# wrong guess costs layout conversions through shared memory (tests/test_codegen.py fails), never a bit.
ROWS_AXIS = tl.constexpr(1 if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9) else 0)


@triton.jit
def ld(ptr, offs, mask, MASKED: tl.constexpr):
    """tl.load with the mask only when MASKED (an unmasked load can be 128-bit); masked lanes read 0."""
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0)
    return tl.load(ptr + offs)


@triton.jit
def st(ptr, offs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        tl.store(ptr + offs, x)


@triton.jit
def fmix32(h):
    """MurmurHash3's 32-bit finalizer on uint32 (multiplications wrap mod 2^32)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def sr_key(seed, step, STREAM: tl.constexpr):
    """codecs.sr_key: the stochastic-rounding key of a tensor (int64 ``seed``), step (int64 count) and moment
    (STREAM 0: exp_avg, 1: exp_avg_sq), all mod 2^32."""
    return fmix32(seed.to(tl.uint32) ^ fmix32(step.to(tl.uint32) * 2 + STREAM))


@triton.jit
def encode_bf16_sr(x, offs, index_offset, key):
    """fp32 -> bf16 bits (uint16), stochastic rounding keyed by the flat index ([Note: state codecs] 1)."""
    idx = ((offs + index_offset) & 0xFFFFFFFF).to(tl.uint32)
    r = fmix32(idx ^ key) >> 16
    hi = (x.to(tl.uint32, bitcast=True) + r) >> 16
    return tl.where(x != x, 0x7FC0, hi).to(tl.uint16)


@triton.jit
def decode_bf16(h):
    """bf16 bits (uint16) -> fp32, exactly."""
    return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def per_row(s, x):
    """A per-block value ``s`` [rows] broadcastable against the tile ``x`` (2-D or 3-D). 3-D: expanded on axis 1,
    then on the H axis: the reverse of block_absmax's reductions, so that the result has the reduction's own
    layout (another order is a layout conversion)."""
    if len(x.shape) == 3:
        b = tl.expand_dims(tl.expand_dims(s, 1), 1 - ROWS_AXIS)
    else:
        b = s[:, None]
    return b


@triton.jit
def block_absmax(x, mask):
    """Per row (quantization block): max |x| over the unmasked lanes (``mask`` None: every lane), NaN if one is
    NaN (torch.amax). On the bits: |x| as int32 orders like the floats, and every NaN is above +inf; a NaN
    result is torch.amax's canonical 0x7FC00000 whatever the payloads (a decoded fp8 NaN is 0x7FF00000).
    A 3-D tile reduces its H axis (a thread's own registers) before the row's lanes."""
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if mask is not None:
        a = tl.where(mask, a, 0)
    if len(x.shape) == 3:
        a = tl.max(a, axis=1 - ROWS_AXIS)
    m = tl.max(a, axis=1)
    return tl.where(m > 0x7F800000, 0x7FC00000, m).to(tl.float32, bitcast=True)


@triton.jit
def scaled(x, scale):
    """x / scale per row (IEEE division), 0 where the block's scale is 0 (codecs.encode_q8 / encode_f8)."""
    s = per_row(scale, x)
    return tl.where(s == 0.0, 0.0, tl.div_rn(x, s))


@triton.jit
def _inverse(scale, LEVELS: tl.constexpr):
    """LEVELS / scale per row (IEEE division), 0 unless finite (codecs._inverse: scale 0, inf, NaN, tiny).
    The test is on the bits (exponent not all ones), so no fp32 constant is involved."""
    inv = tl.div_rn(tl.full(scale.shape, LEVELS, tl.float32), scale)
    finite = (inv.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000
    return tl.where(finite, inv, 0.0)


@triton.jit
def encode_m8(x, offs, index_offset, key, mask):
    """exp_avg tile -> (uint8 tile of int8 codes, fp32 scale per row): codecs.encode_m8. The scale is the
    row's absmax over the unmasked lanes; q = round_half_even(x * (127 * 2^15 / scale)) (0 where that
    inverse is not finite), code = clamp((q + 15 random bits) >> 15, -127, 127): stochastic rounding
    ([Note: state codecs] 2). Rounding: y + 1.5 * 2^23 lands in [2^23, 2^24), where the fp32 ulp is 1, so the
    IEEE add rounds y to the nearest integer, ties to even (torch.round), and the integer is the bits minus
    the magic's bits (|y| <= 127 * 2^15 + a rounding < 2^22; masked lanes hold whatever the update made of 0)."""
    scale = block_absmax(x, mask)
    inv = per_row(_inverse(scale, M8_INV_LEVELS), x)
    y = tl.where(inv == 0.0, 0.0, x * inv)       # no NaN / inf reaches the rounding
    q = (y + RNE_MAGIC).to(tl.int32, bitcast=True) - RNE_MAGIC_BITS
    idx = ((index_offset + offs) & 0xFFFFFFFF).to(tl.uint32)
    r = (idx * 0x9E3779B1 + key).to(tl.uint32) >> (32 - M8_DITHER_BITS)   # codecs.m8_dither (mod 2^32)
    code = (q + r.to(tl.int32)) >> M8_DITHER_BITS
    code = tl.minimum(tl.maximum(code, -127), 127)
    return (code & 0xFF).to(tl.uint8), scale


@triton.jit
def decode_m8(code, scale):
    """(uint8 tile of int8 codes, fp32 scale of each element's block, same shape or broadcastable) -> fp32
    exp_avg: float(int8 code) * (scale / 127), IEEE division, then one multiply (codecs.decode_m8)."""
    return code.to(tl.int8, bitcast=True).to(tl.float32) * tl.div_rn(scale, M8_LEVELS)


@triton.jit
def encode_v8(s, mask):
    """sqrt(exp_avg_sq) tile (the update's own IEEE square root) -> (uint8 log codes, fp32 scale = max s per
    row): codecs.encode_v8. code = max(((bits(s) - bits(scale)) + 255 * 2^19 + 2^18) >> 19, 1) on the int32
    bits (the difference first: no int32 overflow; <= 255 as s <= scale), 0 where s == 0 (tested on the
    bits, so no flush-to-zero compare is involved) or the scale is not finite."""
    scale = block_absmax(s, mask)
    sb = per_row(scale.to(tl.int32, bitcast=True), s)
    bits = s.to(tl.int32, bitcast=True)
    code = tl.maximum(((bits - sb) + (V8_TOP_BITS + V8_HALF_STEP)) >> V8_STEP_BITS, 1)
    keep = ((bits & 0x7FFFFFFF) != 0) & (sb < 0x7F800000)
    return tl.where(keep, code, 0).to(tl.uint8), scale


@triton.jit
def decode_v8(code, scale):
    """(uint8 log codes, fp32 scale = max sqrt(v) of each element's block) -> fp32 exp_avg_sq = s * s with
    s = bits((code << 19) + bits(scale) - 255 * 2^19), 0 where code == 0, NaN where the scale is not finite
    (codecs.decode_v8)."""
    sb = scale.to(tl.int32, bitcast=True)
    c = code.to(tl.int32)
    s = tl.where(c == 0, 0, (c << V8_STEP_BITS) + (sb - V8_TOP_BITS)).to(tl.float32, bitcast=True)
    s = tl.where((sb & 0x7FFFFFFF) < 0x7F800000, s, float("nan"))
    return s * s


@triton.jit
def encode_q8(y, mid_ptr):
    """Wire codec (kernels/quant.py; codecs.encode_q8). Code of y (already divided by its scale): the number
    of the 255 midpoints strictly below y (an 8-step branchless binary search), 255 for NaN (torch.bucketize)."""
    code = tl.zeros(y.shape, dtype=tl.int32)
    for b in tl.static_range(7, -1, -1):
        step = 1 << b
        mid = tl.load(mid_ptr + (code + (step - 1)))
        code = tl.where(mid < y, code + step, code)
    return tl.where(y != y, 255, code).to(tl.uint8)


@triton.jit
def decode_q8(code, scale, table_ptr):
    """Wire codec decode: table[code] * scale (one fp32 multiply; codecs.decode_q8)."""
    return tl.load(table_ptr + code.to(tl.int32)) * scale


@triton.jit
def encode_f8(y):
    """fp32 -> float8_e4m3fn bits (uint8) of clamp(y, -448, 448), round to nearest even (codecs.encode_f8):
    NaN -> 0x7F, |y| >= 448 (inf included) -> 0x7E, saturated ([Note: state codecs] 3); below 2^-6 through an
    fp32 add of 2^14."""
    b = y.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    small = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.uint32, bitcast=True) - (141 << 23)
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20      # rebias 127 -> 7; wraps only off this path
    code = tl.where(a > 0x7F800000, 0x7F, tl.where(a >= 0x43E00000, 0x7E, tl.where(a < (121 << 23), small, normal)))
    return ((code & 0xFF) | sign).to(tl.uint8)


@triton.jit
def decode_f8(c):
    """float8_e4m3fn bits (uint8) -> fp32, exactly (subnormals m * 2^-9, 0x7F / 0xFF NaN)."""
    c = c.to(tl.uint32)
    e = (c >> 3) & 0xF
    mant = c & 7
    normal = (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, mant.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((c & 0x7F) == 0x7F, (mag.to(tl.uint32, bitcast=True) | 0x7FC00000).to(tl.float32, bitcast=True), mag)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def join_remainder(hi, rem):
    """(bf16 bits uint16, int16 remainder) -> the fp32 master ([Note: state codecs] 4; a negative remainder
    under +-0 and a positive one under +-inf count as 0: written parameters keep old remainders, and the join
    must not make them NaN)."""
    h = hi.to(tl.uint32)
    r = rem.to(tl.int32)
    mag = h & 0x7FFF
    r = tl.where(((mag == 0) & (r < 0)) | ((mag == 0x7F80) & (r > 0)), 0, r)
    b = (h << 16) + r.to(tl.uint32, bitcast=True)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def split_remainder(p):
    """fp32 master -> (bf16 bits = round-to-nearest-even, int16 remainder; the tie 0x8000 kept as 0x7FFF)."""
    b = p.to(tl.uint32, bitcast=True)
    hi = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    rem = tl.minimum((b - (hi << 16)).to(tl.int32, bitcast=True), 0x7FFF)
    nan = p != p
    return tl.where(nan, 0x7FC0, hi).to(tl.uint16), tl.where(nan, 0, rem).to(tl.int16)
