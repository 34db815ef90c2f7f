"""The memory model of mixed-precision Adam training under DDP and ZeRO-1/2/3: one implementation.

Pure Python (no torch). Used by ``python -m zero_kernels.plan`` and by the ZeRO layer's
``memory_report()["predicted"]``. All sizes are bytes; 1 GB = 1e9 bytes (as in ``background.md``).
Symbols: Ψ (``psi``) parameters, Nd the data-parallel world size, P/G/M/O the bytes per parameter of
the working parameters, gradients, fp32 master and optimizer states (m + v).

[Note: model states per rank]  (:func:`model_state_bytes`)
    =========  ===========  ==========  ===========  ===========  =======================
    stage      params       grads       master       m, v         mixed precision (2,2,4,8)
    =========  ===========  ==========  ===========  ===========  =======================
    0 (DDP)    PΨ           GΨ          MΨ           OΨ           16Ψ
    1          PΨ           GΨ          MΨ/Nd        OΨ/Nd        2Ψ + 2Ψ + 12Ψ/Nd
    2          PΨ           GΨ/Nd       MΨ/Nd        OΨ/Nd        2Ψ + 14Ψ/Nd
    3          PΨ/Nd        GΨ/Nd       MΨ/Nd        OΨ/Nd        16Ψ/Nd
    =========  ===========  ==========  ===========  ===========  =======================
    fp32 training without a separate master (``param_bytes=4, grad_bytes=4, master_bytes=0``): the
    fp32 parameter *is* the master. Forward/backward need the whole parameter, so stages 1 and 2
    keep it unsharded on every rank (4Ψ) and shard only m and v (8Ψ/Nd); each rank updates its slice
    of the parameter in place and all-gathers it. Stage 0: 16Ψ; stage 1: 8Ψ + 8Ψ/Nd; stage 2:
    4Ψ + 12Ψ/Nd; stage 3: 16Ψ/Nd. ``master_params`` is 0 in that case.

[Note: the stage-3 gather buffer]  (:func:`gather_buffer_bytes`)
    ZeRO-3 / FSDP shard the parameters but must materialize, unsharded, the 16-bit parameters of the
    block being computed, its 16-bit gradients until they are reduce-scattered, and the parameters of
    the next block (prefetched): (2P + G) x block_params bytes, 6 bytes per block parameter in mixed
    precision. Stages 0-2 need no such buffer (their parameters and gradients are already whole).
    The block is 12·h² parameters (one transformer layer) when the width h is known; otherwise it
    is estimated as Ψ/32 (LLaMA-7B has 32 layers, GPT-2 XL 48, GPT-3 96), capped at one GPT-3 175B
    block (12·12288² ≈ 1.81e9: 10.9 GB of buffer). This term is why a single "fraction of memory kept
    free" cannot reproduce both capacity reference points (see :func:`max_trainable_params`).

[Note: capacity]  (:func:`max_trainable_params`)
    The largest Ψ with  model_states(Ψ / (TP·PP), DP, stage) + gather_buffer  <=  (1 - reserve) x
    gpu_mem, where DP = gpus / (TP·PP). The default ``reserve = 0.30`` is the "buffer kept for
    activations" of background.md: 24 GB of an 80 GB A100, about the ~20 GB GPT-2-style activations
    need at a realistic micro-batch, plus allocator fragmentation. It gives, on 80 GB:
      DDP:     16Ψ <= 56 GB  ->  Ψ = 3.5e9 for any number of GPUs       (reference: near 3.5B, flat)
      ZeRO-3:  16Ψ/64 + 10.9 GB <= 56 GB  ->  Ψ ≈ 180e9 at 64 GPUs       (reference: near 175B)
    and ZeRO-3 capacity grows linearly with the GPUs (about 2.8e9 per GPU) once the gather buffer is
    capped. Without the gather buffer, the same reserve would claim 224B at 64 GPUs (+28 %), and no
    single reserve fraction is within 10 % of both references (3.5B needs 50-62 GB of states per
    GPU, 175B/64 needs 39-48 GB).

[Note: activations]  (:func:`activation_bytes`)
    Without checkpointing, the ZeRO paper's estimate (Rajbhandari et al. 2020, §3.2 and its
    footnote): a GPT-style layer keeps about 12 tensors of [batch, seq, hidden], so
        full = 12 · batch · seq · hidden · layers · bytes_per
    GPT-2 1.5B (48 layers, h 1600), seq 1024, batch 32, 16-bit: 60.4 GB (reference: about 60 GB).
    The s² attention scores are left out (fused / flash attention never stores them); pass
    ``heads`` to add them (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models": two 16-bit heads·seq² maps and a 1-byte dropout mask per layer and sample).
    With checkpointing, n = 12·layers unit tensors u = batch·seq·hidden·bytes_per form a chain;
    Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost") keep a checkpoint every
    k = √n units and recompute one segment at a time in backward. We count the √n checkpoints plus
    the recomputed segment twice (its activations and their gradients / recompute temporaries):
        checkpointed ("sqrt") = (n/k + 2k) · u = 3 · √(12 · layers) · u
    GPT-2 1.5B as above: 7.55 GB (reference: about 8 GB, "roughly the square root of the total");
    a 100B GPT (125 layers, h 8192) at batch 32: 62.4 GB (reference: about 60 GB). The bare Chen
    bound 2√n·u would give 5.0 GB and 41.6 GB. ``checkpointing="layer"`` models what Megatron and
    Hugging Face do (one checkpoint per transformer layer, one layer recomputed at a time):
    layers·u + 2·12·u.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = [
    "GB", "DTYPE_BYTES", "STATE_FORMATS", "GPT3_BLOCK_PARAMS", "DEFAULT_RESERVE", "STAGE_NAMES", "CATEGORIES",
    "dtype_bytes", "bytes_per_param", "model_state_bytes", "gather_buffer_bytes", "estimate_block_params",
    "activation_bytes", "count_params", "data_parallel_size", "max_trainable_params",
    "PlanResult", "plan",
]

GB = 1e9
"""Decimal gigabyte: the unit of every figure in background.md."""

#: Bytes per parameter (params, grads, master, m + v) for each training precision.
DTYPE_BYTES: dict[str, dict[str, int]] = {
    "bf16": dict(param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8),
    "fp16": dict(param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8),
    "fp32": dict(param_bytes=4, grad_bytes=4, master_bytes=0, optim_bytes=8),
}

#: Bytes per element of each Adam-moment format (issue #11): ``8bit`` is one code byte plus one fp32
#: scale per block of 256 elements (bitsandbytes' blockwise layout).
STATE_FORMATS: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "8bit": 1 + 4 / 256}

GPT3_BLOCK_PARAMS = 12 * 12288 ** 2
"""One GPT-3 175B transformer block (12·h², h = 12288): ≈ 1.81e9 parameters."""

DEFAULT_RESERVE = 0.30
"""Fraction of GPU memory kept for activations and fragmentation in capacity estimates."""

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}

#: Per-rank model-state categories, in display order.
CATEGORIES = ("params", "grads", "master_params", "exp_avg", "exp_avg_sq")

_BLOCKS_IF_UNKNOWN = 32


def dtype_bytes(name: str, states: str = "fp32", remainders: bool = False,
                reduce: str | None = None) -> dict[str, float]:
    """``{"param_bytes", "grad_bytes", "master_bytes", "optim_bytes"}`` for ``bf16``/``fp16``/``fp32``
    parameters, Adam moments in ``states`` format (:data:`STATE_FORMATS`), and with ``remainders`` the
    fp32 master kept as the bf16 parameter plus an int16 remainder (2 bytes instead of 4). ``reduce``
    (``bf16``/``fp16``/``fp32``: ZeroAdamW's ``reduce_dtype``) adds ``reduce_bytes``, the bytes of a
    stage-2/3 gradient shard element (not a per-parameter byte: :func:`bytes_per_param` leaves it out).

    The optimizer-state multiplier K = master_bytes + optim_bytes: 12 (fp32), 8 (bf16 moments),
    ~6.03 (8-bit moments), ~4.03 (8-bit moments + remainders).
    """
    try:
        d: dict[str, float] = dict(DTYPE_BYTES[name])
    except KeyError:
        raise ValueError(f"unknown param dtype {name!r}; expected one of {sorted(DTYPE_BYTES)}") from None
    if states not in STATE_FORMATS:
        raise ValueError(f"unknown state format {states!r}; expected one of {sorted(STATE_FORMATS)}")
    d["optim_bytes"] = 2 * STATE_FORMATS[states]
    if remainders:
        if name != "bf16":
            raise ValueError(f"remainders (store_param_remainders) need bf16 parameters, got {name!r}: the "
                             "master is the bf16 parameter's bits plus an int16 remainder")
        d["master_bytes"] = 2
    if reduce is not None:
        if reduce not in DTYPE_BYTES:
            raise ValueError(f"unknown reduce dtype {reduce!r}; expected one of {sorted(DTYPE_BYTES)}")
        d["reduce_bytes"] = DTYPE_BYTES[reduce]["param_bytes"]
    return d


def bytes_per_param(nbytes: dict[str, float]) -> float:
    """Unsharded bytes per parameter of :func:`dtype_bytes`' figures (params, grads, master, moments)."""
    return sum(nbytes[k] for k in ("param_bytes", "grad_bytes", "master_bytes", "optim_bytes"))


def _check_stage(stage: int) -> int:
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    return stage


def _check_pos_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_nonneg(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0 \
            or math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def model_state_bytes(psi: int, world_size: int, stage: int, *, param_bytes: int = 2,
                      grad_bytes: int = 2, master_bytes: int = 4,
                      optim_bytes: int = 8, reduce_bytes: float | None = None) -> dict[str, float]:
    """Per-rank bytes of model states for DDP (stage 0) and ZeRO stages 1-3.

    Args:
        psi: number of parameters Ψ held by this data-parallel group (the whole model, or the
            model's Ψ / (TP·PP) under tensor/pipeline parallelism).
        world_size: data-parallel size Nd the states are sharded over (>= 1).
        stage: 0 (DDP: nothing sharded), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters).
        param_bytes, grad_bytes: bytes per working parameter / gradient (2 for bf16/fp16).
        master_bytes: bytes per fp32 master parameter (4), or 0 when the parameter itself is the
            fp32 master (fp32 training; see the module note for what each stage then holds).
        optim_bytes: bytes per parameter of optimizer state, split evenly into m and v (8 for Adam).
        reduce_bytes: bytes per element of the sharded gradient at stages 2-3 (ZeroAdamW's
            ``reduce_dtype``: fp32 by default, 4; the paper's figures reduce in the parameter dtype);
            None: ``grad_bytes``.

    Returns:
        ``{"params", "grads", "master_params", "exp_avg", "exp_avg_sq", "total"}`` in bytes
        (floats: shards are Ψ/Nd, not rounded up to whole elements). Defaults give 16Ψ, 4Ψ + 12Ψ/Nd,
        2Ψ + 14Ψ/Nd, 16Ψ/Nd for stages 0-3.
    """
    _check_nonneg("psi", psi)
    nd = _check_pos_int("world_size", world_size)
    _check_stage(stage)
    for k, v in dict(param_bytes=param_bytes, grad_bytes=grad_bytes, master_bytes=master_bytes,
                     optim_bytes=optim_bytes, reduce_bytes=reduce_bytes or 0).items():
        _check_nonneg(k, v)
    shard_optim = nd if stage >= 1 else 1
    shard_grads = nd if stage >= 2 else 1
    shard_params = nd if stage >= 3 else 1
    out = {
        "params": param_bytes * psi / shard_params,
        "grads": (grad_bytes if reduce_bytes is None or stage < 2 else reduce_bytes) * psi / shard_grads,
        "master_params": master_bytes * psi / shard_optim,
        "exp_avg": optim_bytes / 2 * psi / shard_optim,
        "exp_avg_sq": optim_bytes / 2 * psi / shard_optim,
    }
    out["total"] = sum(out.values())
    return out


def estimate_block_params(psi: float, hidden: int | None = None) -> float:
    """Parameters in one transformer block: 12·h² if ``hidden`` is known, else min(Ψ/32, GPT-3 block)."""
    if hidden is not None:
        return float(12 * _check_pos_int("hidden", hidden) ** 2)
    return min(_check_nonneg("psi", psi) / _BLOCKS_IF_UNKNOWN, float(GPT3_BLOCK_PARAMS))


def gather_buffer_bytes(stage: int, block_params: float, *, param_bytes: int = 2,
                        grad_bytes: int = 2) -> float:
    """Unsharded working set per rank: (2P + G)·block_params for stage 3, 0 for stages 0-2.

    The current block's parameters and gradients plus the prefetched next block's parameters
    (``block_params`` already divided by TP, if any). See the module note.
    """
    _check_stage(stage)
    _check_nonneg("block_params", block_params)
    return float((2 * param_bytes + grad_bytes) * block_params) if stage == 3 else 0.0


def activation_bytes(batch: int, seq: int, hidden: int, layers: int, *, bytes_per: int = 2,
                     checkpointing: bool | Literal["sqrt", "layer"] = False,
                     heads: int | None = None) -> float:
    """Activation bytes kept for backward by one rank's micro-batch of a GPT-style model.

    Args:
        batch: sequences per rank per micro-batch. seq: tokens per sequence. hidden: model width.
        layers: transformer layers. bytes_per: bytes per activation element (2 for bf16/fp16).
        checkpointing: False (keep everything: 12·b·s·h·L·bytes), True or ``"sqrt"`` (√n
            checkpointing, 3·√(12L)·b·s·h·bytes), or ``"layer"`` (one checkpoint per layer,
            (L + 24)·b·s·h·bytes). Never more than the uncheckpointed figure.
        heads: if given, also count the materialized attention scores (2 x 16-bit + 1-byte mask
            per heads·seq² per sample and layer). None (default) for fused/flash attention and to
            match the ZeRO paper's estimate.

    GPT-2 1.5B (b 32, s 1024, h 1600, L 48): 60.4 GB, 7.55 GB with checkpointing. See module note.
    """
    for name, v in dict(batch=batch, seq=seq, hidden=hidden, layers=layers,
                        bytes_per=bytes_per).items():
        _check_pos_int(name, v)
    if checkpointing is True:
        checkpointing = "sqrt"
    if checkpointing not in (False, "sqrt", "layer"):
        raise ValueError(f"checkpointing must be False, True, 'sqrt' or 'layer', got {checkpointing!r}")
    unit = float(batch) * seq * hidden * bytes_per          # one [b, s, h] tensor
    per_layer = 12.0                                          # units kept per layer (ZeRO §3.2)
    if heads is not None:
        _check_pos_int("heads", heads)
        per_layer += heads * seq * (2 * bytes_per + 1) / (hidden * bytes_per)
    full = per_layer * layers * unit
    if checkpointing is False:
        return full
    if checkpointing == "sqrt":
        n = per_layer * layers
        return min(full, 3.0 * math.sqrt(n) * unit)
    return min(full, (layers + 2 * per_layer) * unit)


def count_params(layers: int, hidden: int, vocab: int, *, seq: int | None = None,
                 heads: int | None = None) -> int:
    """Parameters of a GPT-2-style decoder: 12·L·h² + 13·L·h + vocab·h (+ seq·h) + 2·h.

    Per layer: attention 4h² + 4h (QKV and output, with biases), MLP 8h² + 5h (4h wide), two
    LayerNorms 4h; tied token embedding vocab·h; learned positions seq·h when ``seq`` is given;
    final LayerNorm 2h. GPT-2 XL (48, 1600, 50257, seq 1024) -> 1,557,611,200. ``heads`` does not
    change the count; it is only checked to divide ``hidden``.
    """
    for name, v in dict(layers=layers, hidden=hidden, vocab=vocab).items():
        _check_pos_int(name, v)
    if heads is not None and hidden % _check_pos_int("heads", heads):
        raise ValueError(f"hidden={hidden} is not divisible by heads={heads}")
    positions = 0 if seq is None else _check_pos_int("seq", seq) * hidden
    return 12 * layers * hidden ** 2 + 13 * layers * hidden + vocab * hidden + positions + 2 * hidden


def data_parallel_size(gpus: int, tp: int = 1, pp: int = 1) -> int:
    """DP = gpus / (TP·PP): the group ZeRO shards over. Raises ValueError if it is not whole."""
    for name, v in dict(gpus=gpus, tp=tp, pp=pp).items():
        _check_pos_int(name, v)
    if gpus % (tp * pp):
        raise ValueError(f"gpus={gpus} is not divisible by tp*pp={tp * pp} (tp={tp}, pp={pp}); "
                         f"use a multiple of {tp * pp} GPUs or smaller tp/pp")
    return gpus // (tp * pp)


def _per_rank_need(psi: float, dp: int, stage: int, tp: int, pp: int, hidden: int | None,
                   block_params: float | None, nbytes: dict[str, int]) -> tuple[dict, float]:
    states = model_state_bytes(psi / (tp * pp), dp, stage, **nbytes)
    block = estimate_block_params(psi, hidden) if block_params is None else block_params
    block = min(block / tp, psi / (tp * pp))       # TP splits each block; no block exceeds the model
    buf = gather_buffer_bytes(stage, block, param_bytes=nbytes["param_bytes"],
                              grad_bytes=nbytes["grad_bytes"])
    return states, buf


def max_trainable_params(gpus: int, gpu_mem_bytes: float, stage: int, *, tp: int = 1, pp: int = 1,
                         reserve: float = DEFAULT_RESERVE, extra_bytes: float = 0.0,
                         hidden: int | None = None, block_params: float | None = None,
                         param_bytes: int = 2, grad_bytes: int = 2, master_bytes: int = 4,
                         optim_bytes: int = 8, reduce_bytes: float | None = None) -> int:
    """Largest Ψ whose per-rank model states (+ stage-3 gather buffer) fit in the budget.

    Budget per GPU = gpu_mem_bytes·(1 - reserve) - extra_bytes (e.g. activations you computed).
    Model states divide by TP·PP (they split the model) and ZeRO shards over DP = gpus/(TP·PP).
    The block size for the gather buffer comes from ``block_params``, else 12·hidden², else the
    Ψ-based estimate (see :func:`estimate_block_params`). Returns 0 if nothing fits.

    80 GB, defaults: DDP 3.5e9 at any GPU count; ZeRO-3 ≈ 1.80e11 at 64 GPUs.
    """
    dp = data_parallel_size(gpus, tp, pp)
    _check_stage(stage)
    _check_nonneg("gpu_mem_bytes", gpu_mem_bytes)
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve must be a fraction in [0, 1), got {reserve!r}")
    _check_nonneg("extra_bytes", extra_bytes)
    nbytes = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, master_bytes=master_bytes,
                  optim_bytes=optim_bytes, reduce_bytes=reduce_bytes)
    budget = gpu_mem_bytes * (1 - reserve) - extra_bytes
    if budget <= 0:
        return 0

    def need(psi: float) -> float:
        states, buf = _per_rank_need(psi, dp, stage, tp, pp, hidden, block_params, nbytes)
        return states["total"] + buf

    # need() is increasing and piecewise linear in psi: bracket, then bisect to the integer.
    lo, hi = 0.0, 1.0
    while need(hi) <= budget:
        lo, hi = hi, hi * 2
        if hi > 1e30:
            raise ValueError("no memory is used per parameter: capacity is unbounded")
    lo_i, hi_i = int(lo), int(math.ceil(hi))
    while hi_i - lo_i > 1:
        mid = (lo_i + hi_i) // 2
        if need(mid) <= budget:
            lo_i = mid
        else:
            hi_i = mid
    return lo_i


@dataclass
class PlanResult:
    """Per-rank memory of one configuration. All sizes are bytes per GPU.

    ``fits`` compares ``total`` with ``budget``: the whole GPU when activations are modelled
    (``activations_modelled``), else the GPU minus the reserve kept for activations.
    """
    stage: int
    psi: int
    gpus: int
    tp: int
    pp: int
    dp: int
    gpu_mem: float
    params: float
    grads: float
    master_params: float
    exp_avg: float
    exp_avg_sq: float
    gather_buffer: float
    activations: float
    activations_modelled: bool
    budget: float
    model_states: float = field(init=False)
    total: float = field(init=False)
    fits: bool = field(init=False)

    def __post_init__(self) -> None:
        self.model_states = (self.params + self.grads + self.master_params + self.exp_avg
                             + self.exp_avg_sq)
        self.total = self.model_states + self.gather_buffer + self.activations
        self.fits = self.total <= self.budget

    @property
    def name(self) -> str:
        return STAGE_NAMES[self.stage]

    def categories(self) -> dict[str, float]:
        """Bytes by category, display order: model states, gather buffer, activations."""
        d = {k: getattr(self, k) for k in CATEGORIES}
        d["gather_buffer"] = self.gather_buffer
        d["activations"] = self.activations
        return d

    def as_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


def plan(psi: int, gpus: int, stage: int, *, gpu_mem_bytes: float = 80 * GB, tp: int = 1,
         pp: int = 1, param_dtype: str = "bf16", activations: float | None = None,
         hidden: int | None = None, block_params: float | None = None,
         reserve: float = DEFAULT_RESERVE, states: str = "fp32", remainders: bool = False,
         reduce_dtype: str | None = None) -> PlanResult:
    """Per-rank memory of training a Ψ-parameter model on ``gpus`` GPUs at one stage.

    ``activations``: bytes of activations for the whole model's micro-batch (from
    :func:`activation_bytes`); divided by TP (assumes Megatron sequence parallelism; under PP the
    first stage holds PP micro-batches of L/PP layers, about L layers' worth). If None, activations
    are not modelled and ``reserve`` of the GPU is kept for them instead.
    """
    _check_nonneg("psi", psi)
    dp = data_parallel_size(gpus, tp, pp)
    _check_stage(stage)
    nbytes = dtype_bytes(param_dtype, states, remainders, reduce_dtype)
    states, buf = _per_rank_need(psi, dp, stage, tp, pp, hidden, block_params, nbytes)
    if activations is None:
        act, budget = 0.0, gpu_mem_bytes * (1 - reserve)
    else:
        act, budget = _check_nonneg("activations", activations) / tp, float(gpu_mem_bytes)
    return PlanResult(stage=stage, psi=int(psi), gpus=gpus, tp=tp, pp=pp, dp=dp,
                      gpu_mem=float(gpu_mem_bytes), params=states["params"], grads=states["grads"],
                      master_params=states["master_params"], exp_avg=states["exp_avg"],
                      exp_avg_sq=states["exp_avg_sq"], gather_buffer=buf, activations=act,
                      activations_modelled=activations is not None, budget=budget)
