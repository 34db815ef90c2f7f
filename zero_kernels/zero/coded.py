"""Coded (low-precision) optimizer states of a ZeRO bucket slice (issue 11).

[Note: coded ZeRO states]
``ZeroAdamW(..., exp_avg_dtype=, exp_avg_sq_dtype=, store_param_remainders=)`` keeps each rank's slice
of each bucket in the codecs of zero_kernels/codecs.py ([Note: state codecs]), as flat tensors of the
slice's ``shard_numel`` elements:

    exp_avg, exp_avg_sq            fp32 | bf16 (stochastic rounding) | uint8 codes | float8_e4m3fn codes
    exp_avg_scale, exp_avg_sq_scale fp32 [shard_numel / 256], blockwise formats only
    master                         fp32 master slice (16-bit parameters), or
    master_remainder               int16 (store_param_remainders: the master is the bf16 slice's bits + it)

* Blocks: 256 elements counted from the slice's first element. With a blockwise format the layout
  aligns every bucket to ``world * 256`` elements (``ZeroConfig.layout_alignment``), so every slice
  holds whole blocks and no block straddles two ranks. (Blocks are per slice, not per parameter as in
  FusedAdam: the same model at another world size quantizes other groups of elements.)
* Stochastic rounding (bf16 moments): seed = the bucket index, flat index = the element's position in
  its bucket (``slice_start + i``).
* The step: when every piece of the slice is active with one step count (the normal case) the coded
  kernel runs once over the whole slice (its padding is zero and stays zero: a zero gradient on zero
  states changes nothing, and zeros never raise a block's absmax). Otherwise the slice is decoded to
  fp32, the active runs take the fp32 step of step.py, and the slice is encoded again: the elements
  of inactive pieces keep their masters, step counts and codes (their block keeps its scale while the
  active elements fit under it; only when it must grow are they coded again, one rounding each time), so a
  long freeze no longer drifts with the block scale (``codecs.encode_moment_keeping``).
* Everything that is not the step (checkpoints, DCP, full state dicts) reads and writes fp32 through
  :func:`decode_slice` / :func:`encode_slice`; ``state_dict()`` holds the coded tensors themselves.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from .. import codecs, optim_coded
from ..hparams import CODED_AMSGRAD, StateFormat

__all__ = ["format_error", "new_moments", "remainder_of", "join_master", "decode_slice", "encode_slice",
           "saved_problem", "decode_saved", "step_coded_slice", "step_decoded_slice", "MOMENT_KEYS"]

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


def format_error(cfg, trainable, groups: Sequence[dict]) -> str | None:
    """Why the model or the param groups cannot hold ``cfg.state_format``, or None."""
    fmt: StateFormat = cfg.state_format
    if not fmt.coded:
        return None
    if any(g.get("amsgrad", False) for g in groups):
        return CODED_AMSGRAD
    if fmt.store_param_remainders:
        for n, p in trainable:
            if (cfg.param_dtype or p.dtype) != torch.bfloat16:
                return (f"store_param_remainders=True needs bf16 working parameters, but {n!r} would be "
                        f"{cfg.param_dtype or p.dtype}: pass param_dtype=torch.bfloat16 (or drop store_param_remainders)")
    return None


def new_moments(numel: int, device: torch.device, fmt: StateFormat) -> dict[str, Tensor]:
    """Zero moments of one slice in ``fmt`` (codes + scales for blockwise formats), no master, no step."""
    st = codecs.init_coded_state(torch.empty(numel, dtype=torch.float32, device=device),
                                 exp_avg_dtype=fmt.exp_avg_dtype, exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
                                 min_8bit_size=0)
    st.pop("step")
    return st


def remainder_of(master: Tensor) -> Tensor:
    """The int16 remainder of an fp32 master slice whose bf16 rounding the working slice holds."""
    return codecs.split_remainder(master)[1]


def join_master(params16: Tensor, remainder: Tensor | None, master: Tensor | None) -> Tensor:
    """The fp32 master slice: joined from (bf16 slice, remainder), else ``master`` itself."""
    return codecs.join_remainder(params16, remainder) if remainder is not None else master


def decode_slice(moments: dict[str, Tensor]) -> dict[str, Tensor]:
    """fp32 copies of a slice's coded moments."""
    return {k: codecs.decode_moment(moments, k).float().clone() for k in MOMENT_KEYS}


def encode_slice(moments: dict[str, Tensor], fp32: dict[str, Tensor], seed: int, step: int,
                 index_offset: int) -> None:
    """Encode fp32 moments into the slice's coded tensors, in place (bf16: stochastic rounding keyed as the step)."""
    for stream, k in enumerate(MOMENT_KEYS):
        sr = dict(seed=seed, step=step, stream=stream, index_offset=index_offset)
        codecs.encode_moment(moments, k, fp32[k].to(moments[k].device, torch.float32), "stochastic", sr)


def saved_problem(st: dict, numel: int, amsgrad: bool) -> str | None:
    """Why a saved slice (fp32 or coded, [Note: shard state dict]) cannot be decoded to ``numel`` fp32
    elements, or None."""
    if not isinstance(st, dict):
        return f"a slice's state is a {type(st).__name__}, not a dict"
    need = ["exp_avg", "exp_avg_sq"] + (["master"] if "master" in st else ["master_remainder", "params16"])
    if amsgrad:
        need.append("max_exp_avg_sq")
    for k in need:
        t = st.get(k)
        if not isinstance(t, Tensor) or t.shape != (numel,):
            return (f"state {k!r} is missing or not a [{numel}] tensor (got "
                    f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}); was it saved for another layout?")
    for k in MOMENT_KEYS:
        if st[k].dtype in codecs.BLOCKWISE:
            s = st.get(k + "_scale")
            if not isinstance(s, Tensor) or s.shape != (-(-numel // codecs.BLOCK),):
                return f"state {k!r} holds {st[k].dtype} codes but no [{-(-numel // codecs.BLOCK)}] {k}_scale"
        elif st[k].dtype not in codecs.MOMENT_DTYPES:
            return f"state {k!r} has dtype {st[k].dtype}, not a moment format {list(codecs.MOMENT_DTYPES)}"
    return None


def decode_saved(st: dict, amsgrad: bool) -> dict[str, Tensor]:
    """A checked saved slice (:func:`saved_problem`) as fp32 ``master``, ``exp_avg``, ``exp_avg_sq``
    (and ``max_exp_avg_sq`` with amsgrad)."""
    master = st["master"].float() if "master" in st else codecs.join_remainder(st["params16"], st["master_remainder"])
    return {"master": master, **decode_slice(st), **({"max_exp_avg_sq": st["max_exp_avg_sq"].float()} if amsgrad else {})}


def _views(b, lo: int, hi: int) -> dict[str, Tensor]:
    """The moments (and block scales) of elements [lo, hi) of b's slice, as views (lo a multiple of 256)."""
    return {k: t[lo // codecs.BLOCK:-(-hi // codecs.BLOCK)] if k.endswith("_scale") else t[lo:hi]
            for k, t in b.optim.tensors.items()}


def step_coded_slice(b, lo: int, hi: int, group: dict, step: int, scale: Tensor, backend: str,
                     adamw: bool) -> None:
    """One coded step of elements [lo, hi) of bucket ``b``'s slice (lo a multiple of 256: whole blocks of the
    slice), every parameter piece there active with step count ``step``. The padding after ``hi`` is not touched
    (its blocks start at a multiple of 256, so the blocks of the pieces are the slice's own)."""
    st = _views(b, lo, hi)
    st["step"] = torch.full((), float(step - 1), dtype=torch.float32, device=b.device)
    if b.remainder is not None:
        st["master_remainder"], param = b.remainder[lo:hi], b.owned_params[lo:hi]
    elif b.master_is_param:
        param = b.master[lo:hi]
    else:
        st["master_param"], param = b.master[lo:hi], b.owned_params[lo:hi]
    optim_coded.run_coded(backend, [param], [b.reduce.grad_slice[lo:hi]], [st], [b.index], [b.slice_start + lo],
                          optim_coded.group_hparams(group, adamw), grad_scale=scale, found_inf=None)


def step_decoded_slice(b, fused_step, step: int, runs: Sequence[tuple[int, int, int]], lo: int, hi: int) -> None:
    """The mixed case of the Note over elements [lo, hi) of the slice (whole blocks): decode them,
    ``fused_step(master, exp_avg, exp_avg_sq, params16)`` (views of [lo, hi)) runs the fp32 step on the ``runs``
    ((start, end, step) of the active pieces, relative to ``lo``), encode again keeping the codes of the pieces
    that took no step (``codecs.encode_moment_keeping``; the remainder re-split from the new master)."""
    mom = _views(b, lo, hi)
    fp32 = decode_slice(mom)
    if b.remainder is not None:
        master = codecs.join_remainder(b.owned_params[lo:hi], b.remainder[lo:hi])
    else:
        master = b.master[lo:hi]
    fused_step(master, fp32["exp_avg"], fp32["exp_avg_sq"], None if b.master_is_param else b.owned_params[lo:hi])
    keep = torch.zeros(hi - lo, dtype=torch.bool, device=fp32["exp_avg"].device)
    for pc in b.pieces:
        a, e = max(pc.start, lo), min(pc.start + pc.numel, hi)
        if a < e:
            keep[a - lo:e - lo] = True
    for start, end, _ in runs:
        keep[start:end] = False
    for stream, k in enumerate(MOMENT_KEYS):
        sr = dict(seed=b.index, step=step, stream=stream, index_offset=b.slice_start + lo)
        t = mom[k]
        codecs.encode_moment_keeping(mom, k, fp32[k].to(t.device, torch.float32), keep.to(t.device), sr)
    if b.remainder is not None:
        p16, rem = codecs.split_remainder(master)
        b.owned_params[lo:hi].copy_(p16)
        b.remainder[lo:hi].copy_(rem)


def block_segments(pieces, runs: Sequence[tuple[int, int, int]], end: int) -> list[tuple[int, int, int | None]]:
    """Elements [0, end) of a slice cut into runs of whole 256-element blocks (the last one may stop at ``end``):
    (lo, hi, step) where every piece overlapping those blocks is active with one step count ``step`` (the coded
    kernel steps them), (lo, hi, None) where the blocks mix pieces without a step or with other counts (the
    decoded path, keeping the codes of the ones without a step)."""
    nb = -(-end // codecs.BLOCK)
    steps: list[set] = [set() for _ in range(nb)]
    for pc in pieces:                                   # None: a piece that takes no step this time
        st = next((s for a, e, s in runs if a <= pc.start < e), None)
        for k in range(pc.start // codecs.BLOCK, -(-(pc.start + pc.numel) // codecs.BLOCK)):
            steps[k].add(st)
    out: list[tuple[int, int, int | None]] = []
    for k in range(nb):
        kind = next(iter(steps[k])) if len(steps[k]) == 1 and None not in steps[k] else None
        lo, hi = k * codecs.BLOCK, min((k + 1) * codecs.BLOCK, end)
        if out and out[-1][2] == kind and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi, kind)
        else:
            out.append((lo, hi, kind))
    return out
