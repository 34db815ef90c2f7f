"""Low-precision Adam-state codecs (issue 11): the pure-torch definition every kernel reproduces.

[Note: state codecs]
A *codec* stores an fp32 quantity in fewer bytes. Kernels decode to fp32 in registers, run the fp32
update of ``fused_adam_ref`` and encode again in the same pass; no fp32 copy lives between steps.
Integer arithmetic below is on uint32 (wrapping); here it runs on int64 tensors masked to 32 bits.

1. **bf16, stochastic rounding** (``encode_bf16_sr``; decode is ``.float()``). For element ``i`` (its
   flat index in the FULL tensor, mod 2^32: a ZeRO shard passes its offset as ``index_offset``, so the
   bits do not depend on the world size), step ``t`` (the incremented step count), per-tensor ``seed``
   and ``stream`` (0 for exp_avg, 1 for exp_avg_sq):

       fmix32(h):  h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
       key  = fmix32(seed ^ fmix32(2*t + stream))          # one scalar per tensor, step and moment (the
                                                             # kernels derive it from seed and t themselves)
       r    = fmix32(i ^ key) >> 16                          # 16 uniform random bits per element
       bf16 = (bits(x) + r) >> 16                            # carry = round up with P = low16(x) / 2^16
       NaN  -> 0x7FC0 (torch's canonical bf16 NaN); +-inf stay inf (their low bits are 0).

   P(round away from zero) = low16 / 65536 exactly over the 2^16 values of r: E[bf16] = x (unbiased),
   so beta2 = 0.999 updates (0.1%, below half a bf16 ulp) accumulate instead of freezing as with
   round-to-nearest (``encode_bf16_rne``, kept as the negative control and for comparison).

2. **8-bit blockwise moments** (``encode_m8`` / ``decode_m8`` for exp_avg, ``encode_v8`` / ``decode_v8``
   for exp_avg_sq): blocks of ``BLOCK`` = 256 consecutive elements of the state buffer, counted from its
   first element (the last block may be partial; ZeRO pads shards to whole blocks so no block straddles
   ranks). Both codes are arithmetic (m: a multiply and a rounding per element; v: an add and a shift on
   the bits; no table, no search); all operations are IEEE fp32 (no FMA) or integer:

       m (signed, rounded stochastically):
                    scale = max |m| over the block
                    inv   = 127 * 2^15 / scale, replaced by 0 unless finite (scale 0, inf, NaN, below 1.2e-32)
                    q     = round_half_even(m * inv)          (an int32: |q| <= 127 * 2^15 + a rounding)
                    r     = ((i * 0x9E3779B1 + key) mod 2^32) >> 17      (``m8_dither``: 15 random bits, a Weyl
                            sequence over the element's flat index i shifted by key = sr_key(seed, t, 0) as in 1:
                            uniform per element over steps, evenly spread over a block, one add per vector in a
                            kernel; ``(i ^ key) * 0x9E3779B1`` until 2026-11-29 took a 32-bit multiply per vector,
                            ~3% of the CPU 8-bit step)
                    code  = clamp((q + r) >> 15, -127, 127) (arithmetic shift: floor((q + r) / 2^15)), stored
                            as int8 bits; 0 where inv == 0
                    m'    = float(code) * (scale / 127)
                    The code is floor(m * 127 / scale + u), u uniform in [0, 1) (to 2^-15): E[code] = m * 127 /
                    scale, so an m that decays (its gradient stopped: m <- 0.9 m) decays in its codes too. Rounded
                    to nearest, a code of 1-4 decayed back to itself (0.9 * 4 = 3.6 -> 4): m stayed at k/127 of
                    its block's scale while the block's other elements kept the scale up, and the element moved by
                    the same step forever (7% of lr per step; tests/test_optim_coded.py). v's code below does not
                    need it: a v stuck at its code only makes the (decaying) update smaller.
                    [Note: the bound on 8-bit m] A linear code has no relative precision for |m| << scale / 127:
                    such an m decodes as 0 or +-scale / 127 (right on average), while v's log code keeps sqrt(v)
                    accurate, so m / sqrt(v) was unbounded: an element with small gradients in a block with a
                    large one took single steps of 20-400 lr (an outlier input feature, 100x the others: final
                    loss +54% over fp32 states, a user probe). The coded step of an 8-bit exp_avg therefore caps
                    m after the moment update at Adam's own bound, m_bound(beta1, beta2) * sqrt(v) with
                    m_bound = (1 - beta1) / sqrt((1 - beta2) (1 - beta1^2 / beta2)) (Cauchy-Schwarz over the
                    exponential sums, for states that start at 0; 7.27 at (0.9, 0.999); inf unless
                    beta1^2 < beta2 < 1), before the parameter update and the encoding
                    (``reference.bounded_m``). Exact Adam states never exceed it, so it changes nothing but the
                    code's excursions: the probe's block moves at most ~2 lr per step (8.2 lr without it), the
                    outlier run ends at 0.391 (fp32 0.355, round-to-nearest 0.435, bitsandbytes' dynamic map
                    0.367). ZeroAdamW's decoded path (a block mixing pieces with and without a step) takes
                    the cap through ``fused_adam_ref(bound_m=True)`` (zero/step.py).
       v (unsigned, a log code of s = sqrt(v) on its float bits, 16 steps per octave):
                    s     = sqrt(v)   (correctly rounded: the step's own square root, nothing more)
                    scale = max s over the block
                    code  = ((bits(s) + 255 * 2^19 + 2^18 - bits(scale)) >> 19, arithmetic), at least 1,
                            in [1, 255] (255 at s = scale); 0 where s == 0 or scale is not finite
                    s'    = float_from_bits((code << 19) + bits(scale) - 255 * 2^19), 0 where code == 0,
                            NaN everywhere if scale is not finite
                    v'    = s' * s'
                    (integer arithmetic on the int32 bit patterns; code 255 - 16k is scale / 2^k exactly)

   The scale is the absmax of the bits (every NaN above +inf; a NaN scale is the canonical 0x7FC00000),
   so a block holding a NaN or inf decodes to NaN everywhere, as the fp32 state would be poisoned.
   Why these codes (bench/quality_states.py, final loss at 400 steps, seeds 0 / 1): a linear code for
   v diverges (small v quantize to 0, then m / (0 + eps) explodes). A linear code of sqrt(v) (4.8
   decades of v) lost small-v elements (4.4763 / 4.4770 against fp32 AdamW's 4.4762 / 4.4753); a linear
   code of v^(1/4) (9.6 decades, the previous code: 4.4754 / 4.4760) needed a second square root per
   element, the costliest operation of the CPU step after the update's own sqrt and divisions. The log
   code spans the same 9.6 decades of v (16 octaves of s; below them a nonzero v takes code 1) with a
   rounding error of at most 1/32 of s everywhere (a linear code is finer only near the top of its block),
   costs an add, a shift and a clamp, and trains better: 4.4743 / 4.4693 (bitsandbytes 4.4758 / 4.4746,
   torchao 4.4756 / 4.4735).
   A nonzero v never decodes to 0 (short of fp32 underflow of s' * s', below 1e-45), so no Adam
   denominator collapses to eps. Rounding UP (a decoded v
   never below the true one) looked safer but slowed training (+0.9%): the bias shrinks every small-v
   element's step. The
   table codes of bitsandbytes / torchao (their dynamic map) reach the same final loss but cost a
   256-entry lookup and an 8-step search per element: they remain the wire codec (below). Tensors with
   fewer than ``min_8bit_size`` (default one block) elements keep fp32 states.

   **The 8-bit table codec** (``encode_q8`` / ``decode_q8``; the ZeRO++ wire codec of zero/qwz.py and
   zero/qgz.py): the same blocks, ``scale`` = max |x| over the block; with a code book ``table`` (256
   increasing fp32 values in [-1, 1], data passed to the kernel) and its fp32 ``midpoints``
   ``(table[k] + table[k+1]) / 2``:

       y    = x / scale  (IEEE round-to-nearest division; y = 0 where scale == 0)
       code = number of midpoints strictly below y     (nearest entry; a tie takes the lower code)
       x'   = table[code] * scale                       (one fp32 multiply)

   A kernel computes ``code`` with an 8-step branchless binary search over ``midpoints``; a NaN ``y``
   takes code 255, as ``torch.bucketize`` places NaN after every boundary. ``CODE_BOOKS``:
   ``dynamic_signed`` / ``dynamic_unsigned`` (bitsandbytes' ``create_dynamic_map``, bit for bit),
   ``linear_signed`` ((k - 127) / 127), ``linear_unsigned`` (k / 255), ``sqrt_unsigned`` ((k / 255)^2).

3. **float8_e4m3fn blockwise** (``encode_f8`` / ``decode_f8``): the same 256-element blocks, one fp32
   ``scale = absmax / 448`` per block (448 = e4m3fn's largest finite value), ``y = x / scale`` (IEEE
   division; y = 0 where scale == 0), ``code = e4m3fn(clamp(y, -448, 448))`` (round to nearest even, NaN to
   NaN), ``x' = float(code) * scale``. The clamp SATURATES: a subnormal scale (absmax < 448 * 2^-126, a
   moment decayed towards 0) is rounded by up to half its few bits, so y can pass 464, where an unclamped cast
   (c10's scalar conversion, the kernels' before it) gives the NaN code 0x7F, and the block's next scale and
   parameter turn NaN; torch 2.13's CPU cast saturates, so the clamp also keeps the codec off torch's
   choice. Signed for both moments (e4m3fn has a sign bit). exp_avg_sq
   (``encode_f8_v``): a code 0 of a nonzero ``y`` is stored as 1 (the smallest subnormal, ``scale * 2^-9``),
   so a nonzero v never decodes to 0 (short of an underflowing scale, absmax < 448 * 2^-149). e4m3fn spans
   only 448 / 2^-9 = 2.3e5 under its block's largest v; a v further below it coded as 0 made the next
   step with a small gradient m / (0 + eps), a parameter jump of ~10^4 lr (an embedding row missing from a
   batch). With the floor such a v decodes too large, which shrinks that element's step instead.

4. **bf16 parameter + int16 remainder** (``split_remainder`` / ``join_remainder``) for
   ``store_param_remainders``: with ``b`` = the master's fp32 bits,

       hi  = (b + 0x7FFF + ((b >> 16) & 1)) >> 16       # round-to-nearest-even: torch's .bfloat16()
       rem = b - (hi << 16)                              # in [-0x8000, 0x8000], stored as int16
       join: b = (hi << 16) + rem   (int32 wrap), rem taken as 0 where it is < 0 and hi is +-0,
                                      and where it is > 0 and hi is +-inf

   ``hi`` is exactly the bf16 parameter an fp32-master run writes. By counting, no int16 can hold all
   of it: an even ``hi`` is the nearest-even rounding of 65537 fp32 patterns (both ties), so one case
   is lossy. Rule: ``rem = +0x8000`` (a tie rounded DOWN to an even ``hi``) is stored as ``0x7FFF``,
   i.e. that master loses one fp32 ulp towards ``hi`` (``hi`` itself stays correct). Every other
   pattern round-trips bit for bit (normals, subnormals, +-0, +-inf, the other tie); NaN masters become
   ``hi = 0x7FC0, rem = 0`` (NaN in, canonical NaN out). apex/TransformerEngine round ties up instead,
   so their bf16 parameter differs from round-to-nearest-even at half the ties. Measured on the
   quality-run model (437,760 bf16 params), about 1 in 10^5 element-steps hits the lossy tie; the bf16
   parameters of the two runs stayed identical for 37 steps, then a nudged master rounded differently.
   The join saturates at +-0 and +-inf: a split never pairs ``hi = +-0`` with a negative ``rem`` (a master
   that rounds to +-0 lies above it in magnitude) nor ``hi = +-inf`` with a positive one (that master would
   be NaN; finite masters above the largest bf16 do round to +-inf, with a negative ``rem``), but a
   parameter written outside the optimizer (``p.data``, which no version counter sees) keeps its old
   remainder, and ``(0 << 16) - 1`` or ``(0x7F80 << 16) + 1`` would make a NaN master. With the rule the
   join of any written bf16 value is within half a bf16 ulp of it (+-0 at most 0x7FFF fp32 subnormal ulps
   from it, +-inf exactly itself or a finite master that still rounds to it) and rounds back to it (but for
   an exact tie, -0x8000 under an odd value): such writes stand even without ``refresh_fp32_params()``, and
   every split pattern still joins bit for bit.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch
from torch import Tensor

from .reference import compute_coeffs, fused_adam_ref, sqrt_rn

__all__ = [
    "BLOCK", "M32", "fmix32", "sr_key", "sr_bits", "encode_bf16_sr", "encode_bf16_rne",
    "dynamic_map", "CODE_BOOKS", "midpoints", "scaled_blocks", "encode_q8", "decode_q8",
    "M8_LEVELS", "M8_DITHER_BITS", "M8_DITHER_MUL", "m8_dither", "rounds_stochastically", "V8_LEVELS", "V8_STEP_BITS", "block_absmax", "encode_m8", "decode_m8", "encode_v8", "decode_v8",
    "F8_MAX", "encode_f8", "encode_f8_v", "decode_f8",
    "split_remainder", "join_remainder", "remainder_is_lossy",
    "U8_CODE", "holds_u8_moments", "u8_code_problem",
    "state_layout", "init_coded_state", "state_nbytes", "decode_moment", "encode_moment", "encode_moment_keeping", "adam_step_coded", "MOMENT_DTYPES",
    "BLOCKWISE",
]

BLOCK = 256
M32 = 0xFFFFFFFF
_GOLDEN = (0x85EBCA6B, 0xC2B2AE35)


# ---------------------------------------------------------------- uint32 hash (ints or int64 tensors)
def _mul32(a, c: int):
    """(a * c) mod 2^32 without int64 overflow: a < 2^32, c a 32-bit constant, split in 16-bit halves."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & M32


def fmix32(h):
    """MurmurHash3's 32-bit finalizer on a Python int or an int64 tensor holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, _GOLDEN[0])
    h = h ^ (h >> 13)
    h = _mul32(h, _GOLDEN[1])
    return h ^ (h >> 16)


def sr_key(seed: int, step: int, stream: int) -> int:
    """The per-(tensor, step, moment) scalar key of [Note: state codecs] 1."""
    return fmix32((seed & M32) ^ fmix32((2 * step + stream) & M32))


def sr_bits(numel: int, key: int, index_offset: int = 0, device=None) -> Tensor:
    """16 random bits per element (int64 in [0, 2^16)) for flat indices index_offset .. + numel."""
    idx = (torch.arange(numel, dtype=torch.int64, device=device) + index_offset) & M32
    return fmix32(idx ^ key) >> 16


# ---------------------------------------------------------------- bf16
def _bits(x: Tensor) -> Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & M32


def _as_bf16(hi: Tensor) -> Tensor:
    """int64 holding uint16 bf16 bit patterns -> bfloat16 tensor."""
    return (hi - ((hi & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)


def encode_bf16_sr(x: Tensor, *, seed: int, step: int, stream: int, index_offset: int = 0) -> Tensor:
    """fp32 -> bf16 with the deterministic stochastic rounding of [Note: state codecs] 1."""
    x = x.float()
    r = sr_bits(x.numel(), sr_key(seed, step, stream), index_offset, x.device).view(x.shape)
    hi = ((_bits(x) + r) >> 16) & 0xFFFF
    return _as_bf16(torch.where(torch.isnan(x), 0x7FC0, hi))


def encode_bf16_rne(x: Tensor, **_unused) -> Tensor:
    """fp32 -> bf16 round-to-nearest-even (torch's cast): loses updates below half an ulp."""
    return x.float().bfloat16()


# ---------------------------------------------------------------- 8-bit blockwise
def dynamic_map(signed: bool) -> Tensor:
    """bitsandbytes' ``create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)``, reproduced:
    for exponent e = 0..6, linear fractions in [0.1, 1] times 10^(e-6) (more fraction bits at larger
    exponents), plus 0 and 1; sorted; 256 fp32 values."""
    data: list[float] = []
    for e in range(7):
        n = 2 ** e + 1 if signed else 2 ** (e + 1) + 1
        bounds = torch.linspace(0.1, 1, n, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (e - 6)) * means).tolist()          # an fp32 tensor op, as bitsandbytes does
        if signed:
            data += (-(10 ** (e - 6)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


_K = torch.arange(256, dtype=torch.float32)
CODE_BOOKS: dict[str, Tensor] = {
    "dynamic_signed": dynamic_map(True),
    "dynamic_unsigned": dynamic_map(False),
    "linear_signed": (_K - 127) / 127,
    "linear_unsigned": _K / 255,
    "sqrt_unsigned": (_K / 255) ** 2,
}


def midpoints(table: Tensor) -> Tensor:
    """The 255 fp32 decision boundaries of a code book."""
    return (table[:-1] + table[1:]) / 2


def _blocks(x: Tensor) -> Tensor:
    n = x.numel()
    nb = -(-n // BLOCK)
    return torch.nn.functional.pad(x.reshape(-1).float(), (0, nb * BLOCK - n)).view(nb, BLOCK)


def scaled_blocks(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x / its block's absmax as [blocks, BLOCK] fp32, zero-padded and 0 where the scale is 0; the
    scales [ceil(numel / BLOCK)]): what the 8-bit code of every element is taken of."""
    xb = _blocks(x)
    scale = xb.abs().amax(dim=1)
    return torch.where(scale[:, None] == 0, 0.0, xb / scale[:, None]), scale


def encode_q8(x: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 -> (uint8 codes shaped like x, fp32 scales [ceil(numel / BLOCK)])."""
    y, scale = scaled_blocks(x)
    codes = torch.bucketize(y, midpoints(table.to(y.device)), right=False)
    return codes.reshape(-1)[: x.numel()].to(torch.uint8).view(x.shape), scale


def decode_q8(codes: Tensor, scale: Tensor, table: Tensor) -> Tensor:
    """(uint8 codes, fp32 block scales) -> fp32 shaped like codes."""
    n = codes.numel()
    block_scale = scale.repeat_interleave(BLOCK)[:n]
    return (table.to(codes.device)[codes.reshape(-1).long()] * block_scale).view(codes.shape)


# ---------------------------------------------------------------- 8-bit blockwise moments (Note 2)
M8_LEVELS = 127.0      # exp_avg: codes -127..127 (int8 bits)
V8_LEVELS = 255.0      # exp_avg_sq: codes 0..255 (the log code of sqrt(v): 255 at the block's max)
_FLT_MAX = 3.4028234663852886e38


def block_absmax(x: Tensor) -> tuple[Tensor, Tensor]:
    """(x as [blocks, BLOCK] fp32, zero-padded; the fp32 absmax of every block, a NaN block's the
    canonical NaN 0x7FC00000 whatever its NaNs' payloads)."""
    xb = _blocks(x)
    scale = xb.abs().amax(dim=1)
    return xb, torch.where(torch.isnan(scale), float("nan"), scale)


def _inverse(scale: Tensor, levels: float) -> Tensor:
    """levels / scale per block (IEEE fp32 division), 0 where that is not finite."""
    inv = torch.tensor(levels, dtype=torch.float32, device=scale.device) / scale
    return torch.where(inv <= _FLT_MAX, inv, 0.0)


def _div_const(x: Tensor, c: float) -> Tensor:
    """x / c, IEEE fp32 division on every device. The divisor is a tensor on x's device: on CUDA, torch
    turns a division by a Python number (or a CPU scalar tensor) into a multiplication by its rounded
    reciprocal, which is 1 ulp off for some x (seen on an H200: absmax / 448)."""
    return x / torch.tensor(c, dtype=torch.float32, device=x.device)


def _step(scale: Tensor, levels: float, n: int) -> Tensor:
    """scale / levels per block (IEEE fp32 division), repeated over each block's elements, first n."""
    return _div_const(scale, levels).repeat_interleave(BLOCK)[:n]


M8_DITHER_BITS = 15                          # [Note: state codecs] 2: the m code's stochastic rounding
M8_DITHER_MUL = 0x9E3779B1                   # odd (2^32 / golden ratio): i * it spreads consecutive i (Weyl)


def m8_dither(numel: int, key: int, index_offset: int = 0, device=None) -> Tensor:
    """The m code's 15 random bits per element (int64 in [0, 2^15)) for flat indices index_offset .. + numel:
    ((i * M8_DITHER_MUL + key) mod 2^32) >> 17."""
    idx = (torch.arange(numel, dtype=torch.int64, device=device) + index_offset) & M32
    return ((_mul32(idx, M8_DITHER_MUL) + key) & M32) >> (32 - M8_DITHER_BITS)


def encode_m8(x: Tensor, *, seed: int = 0, step: int = 0, stream: int = 0,
              index_offset: int = 0) -> tuple[Tensor, Tensor]:
    """exp_avg fp32 -> (uint8 tensor of int8 codes shaped like x, fp32 scales [ceil(numel / BLOCK)]), rounded
    stochastically with the bits of ``m8_dither`` (key: sr_key(seed, step, stream))."""
    xb, scale = block_absmax(x)
    inv = _inverse(scale, M8_LEVELS * 2 ** M8_DITHER_BITS)[:, None]
    q = torch.round(xb * inv).to(torch.int64)                     # |q| <= 127 * 2^15 + a rounding: < 2^22
    r = m8_dither(xb.numel(), sr_key(seed, step, stream), index_offset, x.device).view(xb.shape)
    code = torch.clamp((q + r) >> M8_DITHER_BITS, -int(M8_LEVELS), int(M8_LEVELS))
    code = torch.where(inv == 0, 0, code).to(torch.int8)
    return code.reshape(-1)[: x.numel()].view(torch.uint8).view(x.shape), scale


def decode_m8(codes: Tensor, scale: Tensor) -> Tensor:
    """(int8 codes in a uint8 tensor, fp32 block scales) -> fp32 exp_avg shaped like codes."""
    n = codes.numel()
    return (codes.reshape(-1).view(torch.int8).float() * _step(scale, M8_LEVELS, n)).view(codes.shape)


V8_STEP_BITS = 19          # one v code step = 2^19 in the bits of sqrt(v): 16 steps per octave
_V8_TOP = int(V8_LEVELS)   # the top code


def _v8_bits(x: Tensor) -> Tensor:
    """fp32 bit patterns as int64 (signed int32 values)."""
    return x.contiguous().view(torch.int32).to(torch.int64)


def encode_v8(x: Tensor) -> tuple[Tensor, Tensor]:
    """exp_avg_sq fp32 -> (uint8 log codes of sqrt(v), shaped like x; fp32 block scales = max sqrt(v))."""
    sb, scale = block_absmax(sqrt_rn(x.float()))                  # correctly rounded: the step's own sqrt
    finite = (scale.abs() <= _FLT_MAX)[:, None]
    k = (_V8_TOP << V8_STEP_BITS) + (1 << (V8_STEP_BITS - 1)) - _v8_bits(scale)[:, None]
    code = torch.clamp((_v8_bits(sb) + k) >> V8_STEP_BITS, min=1)    # <= 255: s <= scale
    code = torch.where(finite & (sb != 0), code, 0).to(torch.uint8)
    return code.reshape(-1)[: x.numel()].view(x.shape), scale


def decode_v8(codes: Tensor, scale: Tensor) -> Tensor:
    """(uint8 log codes, fp32 block scales = max sqrt(v)) -> fp32 exp_avg_sq shaped like codes."""
    n = codes.numel()
    c = codes.reshape(-1).to(torch.int64)
    base = (_v8_bits(scale) - (_V8_TOP << V8_STEP_BITS)).repeat_interleave(BLOCK)[:n]
    s = torch.where(c == 0, 0, (c << V8_STEP_BITS) + base).to(torch.int32).view(torch.float32)
    s = torch.where((scale.abs() <= _FLT_MAX).repeat_interleave(BLOCK)[:n], s, float("nan"))
    return (s * s).view(codes.shape)


F8_MAX = 448.0


def _encode_f8(x: Tensor, floor: bool) -> tuple[Tensor, Tensor]:
    xb = _blocks(x)
    scale = _div_const(xb.abs().amax(dim=1), F8_MAX)
    y = torch.where(scale[:, None] == 0, 0.0, xb / scale[:, None]).reshape(-1)[: x.numel()]
    codes = torch.clamp(y, -F8_MAX, F8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)   # saturate (Note, 3)
    if floor:
        codes = torch.where((codes == 0) & (y != 0), 1, codes).to(torch.uint8)
    return codes.view(torch.float8_e4m3fn).view(x.shape), scale


def encode_f8(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 -> (float8_e4m3fn codes shaped like x, fp32 scales [ceil(numel / BLOCK)]); exp_avg's code."""
    return _encode_f8(x, floor=False)


def encode_f8_v(x: Tensor) -> tuple[Tensor, Tensor]:
    """exp_avg_sq's float8 code: :func:`encode_f8`, but a code 0 of a nonzero ``x / scale`` becomes 1 (the
    smallest subnormal, scale * 2^-9): a nonzero v never decodes to 0 (see the Note, 3)."""
    return _encode_f8(x, floor=True)


def decode_f8(codes: Tensor, scale: Tensor) -> Tensor:
    """(float8_e4m3fn codes, fp32 block scales) -> fp32 shaped like codes."""
    return (codes.reshape(-1).float() * scale.repeat_interleave(BLOCK)[: codes.numel()]).view(codes.shape)


# ---------------------------------------------------------------- bf16 param + int16 remainder
def split_remainder(master: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 master -> (bf16 = round-to-nearest-even(master), int16 remainder); see the Note, 4."""
    b = _bits(master.float())
    nan = torch.isnan(master)
    hi = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    rem = torch.clamp(b - (hi << 16), max=0x7FFF)
    return _as_bf16(torch.where(nan, 0x7FC0, hi)), torch.where(nan, 0, rem).to(torch.int16)


def join_remainder(param: Tensor, rem: Tensor) -> Tensor:
    """(bf16 parameter, int16 remainder) -> the fp32 master, exactly."""
    hi = param.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    r = rem.to(torch.int64)
    mag = hi & 0x7FFF
    r = torch.where(((mag == 0) & (r < 0)) | ((mag == 0x7F80) & (r > 0)), 0, r)   # saturate (see the Note, 4)
    b = ((hi << 16) + r) & M32
    return (b - ((b & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def remainder_is_lossy(master: Tensor) -> Tensor:
    """Where :func:`split_remainder` drops one ulp: low 16 bits exactly 0x8000 above an even bf16."""
    b = _bits(master.float())
    return ((b & 0xFFFF) == 0x8000) & (((b >> 16) & 1) == 0) & ~torch.isnan(master)


# ---------------------------------------------------------------- coded Adam state and the reference step
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn)

# The 8-bit codes of Note 2 by name, saved beside every state dict and checkpoint that holds uint8 moments
# (``"u8_code"``) and checked before any is decoded: uint8 codes carry no trace of the code that made them,
# and an earlier build's (untagged: v^(1/4) in 255 linear steps) would decode to wrong moments silently.
U8_CODE = "m8-linear127/v8-log16"


def holds_u8_moments(states) -> bool:
    """Whether any state dict in ``states`` (an iterable of {key: tensor}) holds uint8 moment codes."""
    return any(isinstance(st.get(k), Tensor) and st[k].dtype == torch.uint8
               for st in states for k in ("exp_avg", "exp_avg_sq"))


def u8_code_problem(tag) -> str | None:
    """None if ``tag`` (the saved ``"u8_code"``, None when absent) names this build's 8-bit codes, else why
    the saved codes cannot be decoded here and what to do."""
    if tag == U8_CODE:
        return None
    what = "carry no code tag (saved by a zero_kernels build before the tag)" if tag is None else f"are {tag!r}"
    return (f"its uint8 moment codes {what}, but this build decodes {U8_CODE!r} ([Note: state codecs] 2) and would "
            "read them as wrong moments; load it with the build that saved it into an optimizer with fp32 states "
            "(exp_avg_dtype=exp_avg_sq_dtype=torch.float32) and save again, which this build loads and converts")
BLOCKWISE = (torch.uint8, torch.float8_e4m3fn)
_ROUNDINGS = {"stochastic": encode_bf16_sr, "nearest": encode_bf16_rne}


@functools.lru_cache(maxsize=4096)
def state_layout(shape: tuple[int, ...], param_dtype: torch.dtype, *, exp_avg_dtype: torch.dtype = torch.float32,
                 exp_avg_sq_dtype: torch.dtype = torch.float32, store_param_remainders: bool = False,
                 master_weights: bool = True, min_8bit_size: int = BLOCK) -> dict[str, tuple[torch.dtype, tuple]]:
    """{state key: (dtype, shape)} of the coded state of a parameter (the rule :func:`init_coded_state` fills
    and optimizers check states against): ``step``, ``exp_avg`` / ``exp_avg_sq`` in their stored dtype (+
    ``exp_avg_scale`` / ``exp_avg_sq_scale`` for uint8 / float8_e4m3fn), and ``master_param`` (fp32) or
    ``master_remainder`` (int16) for 16-bit parameters. Blockwise formats fall back to fp32 below
    min_8bit_size elements. Raises ValueError on unsupported arguments."""
    for name, dt in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dt not in MOMENT_DTYPES:
            raise ValueError(f"{name}={dt} is not supported; use one of {list(MOMENT_DTYPES)}")
    if store_param_remainders and param_dtype != torch.bfloat16:
        raise ValueError(f"store_param_remainders=True needs bf16 parameters, got {param_dtype}: the fp32 "
                         "master is kept as the bf16 parameter's bits plus an int16 remainder")
    numel = math.prod(shape)
    layout = {"step": (torch.float32, ())}
    for key, dt in (("exp_avg", exp_avg_dtype), ("exp_avg_sq", exp_avg_sq_dtype)):
        if dt in BLOCKWISE and numel >= min_8bit_size:
            layout[key], layout[key + "_scale"] = (dt, shape), (torch.float32, (-(-numel // BLOCK),))
        else:
            layout[key] = (torch.bfloat16 if dt == torch.bfloat16 else torch.float32, shape)
    if store_param_remainders:
        layout["master_remainder"] = (torch.int16, shape)
    elif param_dtype != torch.float32 and master_weights:
        layout["master_param"] = (torch.float32, shape)
    return layout


def init_coded_state(param: Tensor, *, exp_avg_dtype: torch.dtype = torch.float32,
                     exp_avg_sq_dtype: torch.dtype = torch.float32, store_param_remainders: bool = False,
                     master_weights: bool = True, min_8bit_size: int = BLOCK) -> dict[str, Tensor]:
    """A fresh state dict of plain tensors laid out by :func:`state_layout`: zero moments (every code of
    zero is 0 with scale 0), the step on the CPU, ``master_param`` a copy of the parameter."""
    layout = state_layout(tuple(param.shape), param.dtype, exp_avg_dtype=exp_avg_dtype,
                          exp_avg_sq_dtype=exp_avg_sq_dtype, store_param_remainders=store_param_remainders,
                          master_weights=master_weights, min_8bit_size=min_8bit_size)
    state = {k: torch.zeros(shape, dtype=dt, device=None if k == "step" else param.device)
             for k, (dt, shape) in layout.items() if k not in ("exp_avg", "exp_avg_sq")}
    state.update(_moment_codes(layout, param.device))
    if "master_param" in state:
        state["master_param"].copy_(param.detach())
    return state


# [Note: staggered code arrays]
# The CPU kernel reads and writes exp_avg's and exp_avg_sq's 1-byte codes at the same element index, in step.
# Allocated separately, two large arrays lie a multiple of 4 KB apart (the allocator maps them page by page),
# and at some of those distances the step is much slower: on a Zen 4 VM (2026-11-26) an 8-bit step of 32M
# elements took 13.6-14.2 ms instead of 10.1-10.8 with the codes 128 MB + 4 KB apart (a second optimizer in
# the process landed there), reproduced in a C++ harness at chosen addresses: 0x8001000 and 0xC001000 apart
# slow, 0x8000000 or 0x8001040 apart fast, every tried distance whose low 12 bits are 0x840 fast. So a large
# tensor's two 1-byte code arrays are two views of one buffer, exp_avg_sq starting CODE_STAGGER bytes past a
# 4 KB boundary after exp_avg's end (at most ~6 KB of padding per tensor, counted by no state_nbytes: under
# 0.6% at CODE_PACK_MIN elements; smaller tensors are cache-resident and keep separate arrays). Each view is a
# plain contiguous tensor (state dicts save the shared storage once); a loaded state keeps whatever layout
# it is given (correct either way).
CODE_STAGGER = 0x840
CODE_PACK_MIN = 1 << 20


def _moment_codes(layout: dict, device) -> dict[str, Tensor]:
    """Fresh zero exp_avg / exp_avg_sq of ``layout``: staggered views of one buffer for large 1-byte codes on
    CPU ([Note: staggered code arrays]), separate tensors otherwise."""
    (dm, shape), (dv, _) = layout["exp_avg"], layout["exp_avg_sq"]
    n = math.prod(shape)
    if not (torch.device(device).type == "cpu" and dm.itemsize == dv.itemsize == 1 and n >= CODE_PACK_MIN):
        return {k: torch.zeros(layout[k][1], dtype=layout[k][0], device=device) for k in ("exp_avg", "exp_avg_sq")}
    start = -(-n // 4096) * 4096 + CODE_STAGGER
    buf = torch.zeros(start + n, dtype=torch.uint8, device=device)
    return {"exp_avg": buf[:n].view(dm).view(shape), "exp_avg_sq": buf[start:].view(dv).view(shape)}


def state_nbytes(state: dict[str, Tensor]) -> int:
    """Bytes of optimizer state (master or remainder, moments, scales), the step counter excluded."""
    return sum(t.numel() * t.element_size() for k, t in state.items() if k != "step")


_ENCODERS = {("exp_avg", torch.uint8): encode_m8, ("exp_avg_sq", torch.uint8): encode_v8,
             ("exp_avg", torch.float8_e4m3fn): encode_f8, ("exp_avg_sq", torch.float8_e4m3fn): encode_f8_v}
_ROUNDED = {("exp_avg", torch.uint8)}        # the blockwise encoders that round stochastically (take ``sr``)


def _blockwise_encoder(key: str, dtype: torch.dtype, sr: dict | None) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """x -> (codes, block scales) of state ``key`` stored as blockwise ``dtype``, with the step's stochastic-
    rounding keys ``sr`` where that code rounds stochastically."""
    enc, kw = _ENCODERS[key, dtype], (sr or {}) if (key, dtype) in _ROUNDED else {}
    return lambda x: enc(x, **kw)


def rounds_stochastically(key: str, dtype: torch.dtype) -> bool:
    """Whether state ``key`` stored as ``dtype`` is encoded with the step's stochastic-rounding key (bf16
    moments, [Note: state codecs] 1; the 8-bit exp_avg, 2)."""
    return dtype == torch.bfloat16 or (key, dtype) in _ROUNDED
_DECODERS = {("exp_avg", torch.uint8): decode_m8, ("exp_avg_sq", torch.uint8): decode_v8,
             ("exp_avg", torch.float8_e4m3fn): decode_f8, ("exp_avg_sq", torch.float8_e4m3fn): decode_f8}


def decode_moment(state: dict[str, Tensor], key: str) -> Tensor:
    """State ``key`` (``exp_avg`` / ``exp_avg_sq``, with its ``_scale`` if blockwise) decoded to fp32."""
    s = state[key]
    if s.dtype in BLOCKWISE:
        return _DECODERS[key, s.dtype](s, state[key + "_scale"])
    return s.float()


def encode_moment(state: dict[str, Tensor], key: str, x: Tensor, rounding: str = "stochastic",
                  sr: dict | None = None) -> None:
    """fp32 ``x`` encoded in place into state ``key`` in its stored format (``sr``: the keyword arguments of
    :func:`encode_bf16_sr`: seed, step, stream, index_offset)."""
    s = state[key]
    if s.dtype in BLOCKWISE:
        codes, scale = _blockwise_encoder(key, s.dtype, sr)(x)
        s.copy_(codes)
        state[key + "_scale"].copy_(scale)
    elif s.dtype == torch.bfloat16:
        s.copy_(_ROUNDINGS[rounding](x, **(sr or {})))
    else:
        s.copy_(x)


def _sentinel(key: str, dtype: torch.dtype, scale: Tensor) -> Tensor:
    """A value whose block, coded by the encoder of (key, dtype), gets ``scale`` when it is the block's largest:
    the absmax itself (m), its square (v: the correctly rounded sqrt of a rounded square is the number),
    scale * 448 (float8). Callers check that the encoder gave ``scale`` back."""
    if dtype == torch.float8_e4m3fn:
        return scale * F8_MAX
    return scale * scale if key == "exp_avg_sq" else scale


def _grown_scale(key: str, dtype: torch.dtype, old: Tensor, need: Tensor) -> Tensor:
    """The scale a block whose stored scale ``old`` must grow to at least ``need`` takes, chosen so that the values
    of its kept elements code again exactly: v's log code in whole code steps (the bits of sqrt(v)'s scale grow by
    a multiple of 2^19: every code moves down by that many), float8 by a power of two (every code's exponent moves);
    the linear m code has no such scale (its codes move by a stochastic rounding each time: unbiased)."""
    if key == "exp_avg_sq" and dtype == torch.uint8:
        ob, nb = _v8_bits(old), _v8_bits(need)
        k = (nb - ob + (1 << V8_STEP_BITS) - 1) >> V8_STEP_BITS
        return (ob + k * (1 << V8_STEP_BITS)).to(torch.int32).view(torch.float32)
    if dtype == torch.float8_e4m3fn:
        k = torch.ceil(torch.log2(need.double() / old.double())).clamp(min=0)
        grown = (old.double() * torch.pow(2.0, k)).float()
        return torch.where(grown >= need, grown, need)
    return need


def encode_moment_keeping(state: dict[str, Tensor], key: str, x: Tensor, keep: Tensor,
                          sr: dict | None = None) -> None:
    """:func:`encode_moment` of a 1-D ``x``, for the moments of a ZeRO slice whose ``keep`` elements (bool, like x:
    pieces that took no step, their ``x`` the decoded stored values) must keep their values ([Note: coded ZeRO
    states]). Blocks without kept elements code as encode_moment does. A block holding kept elements keeps its
    stored scale while the other elements fit under it (kept codes unchanged); when it must grow it takes
    ``_grown_scale`` (kept values then code again exactly for 8-bit v and float8, with one unbiased stochastic
    rounding for 8-bit m). Re-coding them at every step with the block's new scale made them follow it: a small
    change of scale keeps a code, so the value moved with the scale (a user probe: exp_avg_sq 12.9x after 579
    frozen steps)."""
    s = state[key]
    if s.dtype not in BLOCKWISE or not bool(keep.any()):
        encode_moment(state, key, x, "stochastic", sr)
        return
    enc = _blockwise_encoder(key, s.dtype, sr)
    n, flat, k = x.numel(), x.reshape(-1), keep.reshape(-1)
    old_codes, old_scale = s.reshape(-1).view(torch.uint8).clone(), state[key + "_scale"].clone()
    codes, scale = enc(flat)
    codes = codes.reshape(-1).view(torch.uint8)
    kb = _blocks(k.float()).amax(dim=1) > 0                                    # blocks holding kept elements
    need = enc(flat.masked_fill(k, 0.0))[1]                             # the other elements' own scale
    ok = kb & torch.isfinite(old_scale) & torch.isfinite(need) & (old_scale > 0)
    held = ok & (need <= old_scale)
    target = torch.where(held, old_scale, _grown_scale(key, s.dtype, old_scale, torch.maximum(need, old_scale)))
    if bool(ok.any()):
        # Code every element of those blocks with `target`: a sentinel value at one position of each block makes
        # the encoder take it (two runs, the sentinel at another position in the second, so that every position
        # gets its code from a run where it is not the sentinel; codes do not depend on the sentinel otherwise).
        idx = torch.arange(kb.numel(), device=x.device) * BLOCK
        first = _blocks(k.float()).argmax(dim=1) + idx
        other = torch.where(first % BLOCK == 0, first + 1, first - 1).clamp(max=n - 1)
        ok = ok & (other != first)                              # a one-element block has no second position
        runs = []
        for pos in (first, other):
            y = flat.clone()
            y[pos[ok]] = _sentinel(key, s.dtype, target[ok])
            c, sc = enc(y)
            runs.append((c.reshape(-1).view(torch.uint8), sc))
        ok = ok & (runs[0][1] == target) & (runs[1][1] == target)              # the sentinels gave `target`
        pos_first = torch.zeros(n, dtype=torch.bool, device=x.device)
        pos_first[first[ok]] = True
        mine = torch.where(pos_first, runs[1][0], runs[0][0])
        in_ok = ok.repeat_interleave(BLOCK)[:n]
        in_held = (ok & held).repeat_interleave(BLOCK)[:n]
        codes = torch.where(in_held & k, old_codes, torch.where(in_ok, mine, codes))
        scale = torch.where(ok, target, scale)
    s.copy_(codes.view(s.dtype).view(s.shape))
    state[key + "_scale"].copy_(scale)


def adam_step_coded(param: Tensor, grad: Tensor, state: dict[str, Tensor], *, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, adamw: bool, maximize: bool = False,
                    seed: int = 0, index_offset: int = 0, bf16_rounding: str = "stochastic",
                    grad_scale: Tensor | None = None,
                    found_inf: Tensor | None = None) -> None:
    """One Adam/AdamW step of one tensor on coded states (from :func:`init_coded_state`), in place:
    decode to fp32, the update of :func:`fused_adam_ref` (same formula and order), encode. With
    ``master_remainder`` the master is joined from / split into (param, remainder); bf16 moments use
    stochastic rounding (``seed``, ``index_offset``: [Note: state codecs] 1) or ``"nearest"``."""
    if bf16_rounding not in _ROUNDINGS:
        raise ValueError(f"bf16_rounding={bf16_rounding!r}; expected one of {sorted(_ROUNDINGS)}")
    if grad.shape != param.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} != param shape {tuple(param.shape)}")
    if found_inf is not None and bool(found_inf.reshape(()) != 0):
        return                                   # an inf/NaN gradient step changes nothing
    state["step"] += 1
    t = int(state["step"])
    coeffs = compute_coeffs([state["step"]], lr, beta1, beta2, weight_decay, adamw)
    rem = state.get("master_remainder")
    master = join_remainder(param, rem) if rem is not None else state.get("master_param", param)
    params16 = [param] if "master_param" in state else None
    m, v = decode_moment(state, "exp_avg"), decode_moment(state, "exp_avg_sq")
    fused_adam_ref([master], [grad], [m], [v], None, params16, coeffs, beta1=beta1, beta2=beta2, eps=eps,
                   weight_decay=weight_decay, adamw=adamw, maximize=maximize, grad_scale=grad_scale,
                   bound_m=state["exp_avg"].dtype == torch.uint8)
    for key, x, stream in (("exp_avg", m, 0), ("exp_avg_sq", v, 1)):
        sr = dict(seed=seed, step=t, stream=stream, index_offset=index_offset)
        encode_moment(state, key, x, bf16_rounding, sr)
    if rem is not None:
        hi, low = split_remainder(master)
        param.copy_(hi)
        rem.copy_(low)
