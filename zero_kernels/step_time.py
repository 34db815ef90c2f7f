"""The step-time model: communication volume per link class, compute, overlap, step time and tokens/s
of one data-parallel training step under DDP, ZeRO-1/2/3, hybrid sharding and ZeRO++ (qwZ, hpZ, qgZ).

Beside :mod:`zero_kernels.memory` (bytes held) this module says bytes moved and how long they take;
``python -m zero_kernels.plan --simulate`` prints it and draws the scaling chart. Pure Python, no torch.

[Note: collectives of one step]
Ψ parameters of ``b`` bytes (2 for bf16), a data-parallel group of ``n`` ranks. A collective over a group
of ``k`` ranks on a tensor of V bytes sends ``V (k-1)/k`` bytes per rank (ring all-gather or
reduce-scatter; all-reduce twice that). Per step:

    stage   collectives                                             paper volume
    DDP     all-reduce(grads)                                       2Ψ
    1, 2    reduce-scatter(grads) + all-gather(params)              2Ψ
    3       all-gather(fwd) + all-gather(bwd) + reduce-scatter      3Ψ

(the ZeRO paper, Rajbhandari et al. SC'20, sec. 7: the paper volume drops the (k-1)/k factor).

[Note: link classes]
Bytes are counted per link class: ``intra`` stays inside a node (NVLink), ``inter`` crosses nodes
(InfiniBand). A collective whose group spans nodes is counted wholly as ``inter`` per rank, the
convention of the ZeRO++ paper (Wang et al. 2023, sec. 3: "cross-node communication volume"); a group
inside one node is ``intra``. Its time is ``latency x log2(k) + bytes / bandwidth`` of its class.

[Note: ZeRO++ and hybrid sharding]
- qwZ: weight all-gathers send int8 codes plus one fp32 scale per block of 256 (1 + 4/256 B/element).
- hpZ: a secondary copy of the parameters sharded inside each node: the backward all-gather stays
  intra-node (costs Ψ b / gpus_per_node bytes of memory per GPU, not modelled here).
- qgZ: the gradient reduce-scatter sends int4 codes plus scales (0.5 + 4/256 B/element), reduced
  hierarchically (inside the node first, then across nodes) with fp32 accumulation.
- hybrid (FSDP2's HSDP, DeepSpeed MiCS; ``ZeroAdamW(mesh=)`` of shape (R, S), [Note: hybrid sharding]
  in zero/mesh.py): every collective inside a shard group of S ranks (``shard_size``; default one
  node), then an all-reduce of each rank's gradient shard (Ψ/S elements) across the R = n/S replicas.
  With S = one node that all-reduce is the only inter-node traffic; S = n is plain ZeRO, S = 1 is DDP's
  all-reduce.
The paper's baseline ZeRO-3 moves 3M across nodes per step and ZeRO++ 0.75M (M = model bytes in
fp16): a 4x reduction, checked in tests/test_step_time.py.

[Note: compute and overlap]
Compute is ``6 Ψ tokens`` FLOPs (x 4/3 with activation checkpointing) at the given achieved TFLOP/s,
one third forward and two thirds backward. Gradient reduction overlaps backward; stage-3 forward
gathers overlap forward (prefetch) and backward gathers overlap backward; the stage 1-2 parameter
all-gather is exposed after the step unless ``overlap_param_gather`` hides it behind the next forward.
Exposed communication = what does not fit under the compute it overlaps; step = compute + exposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Cluster", "Options", "Collective", "StepEstimate", "collectives", "estimate", "paper_volume",
           "QWZ_BYTES", "QGZ_BYTES"]

QUANT_BLOCK = 256
QWZ_BYTES = 1 + 4 / QUANT_BLOCK      # int8 code + fp32 scale per block, bytes per element
QGZ_BYTES = 0.5 + 4 / QUANT_BLOCK    # int4 code + fp32 scale per block


@dataclass(frozen=True)
class Cluster:
    """GPUs and their links. Defaults: DGX A100-like nodes (8 GPUs, NVLink 300 GB/s per GPU one way,
    one 200 Gb/s InfiniBand NIC = 25 GB/s per GPU), bf16 at 150 achieved TFLOP/s."""
    gpus: int
    gpus_per_node: int = 8
    intra_gbps: float = 300.0
    inter_gbps: float = 25.0
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    tflops: float = 150.0

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"Cluster.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"Cluster.gpus={self.gpus} is not a whole number of nodes of "
                             f"gpus_per_node={self.gpus_per_node}")
        for name in ("intra_gbps", "inter_gbps", "tflops"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"Cluster.{name} must be a positive number, got {getattr(self, name)!r}")
        for name in ("intra_latency_us", "inter_latency_us"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"Cluster.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def node_size(self) -> int:
        return min(self.gpus, self.gpus_per_node)


@dataclass(frozen=True)
class Options:
    """What the step does: ZeRO stage (0 = DDP) and the multi-node options of issue #12."""
    stage: int
    hybrid: bool = False               # shard inside a node, replicate across nodes (HSDP / MiCS)
    hpz: bool = False                  # ZeRO++ secondary partition: backward gathers inside the node
    quantize_weights: bool = False     # ZeRO++ qwZ
    quantize_grads: bool = False       # ZeRO++ qgZ
    overlap_param_gather: bool = False  # stages 1-2: the param all-gather hides behind the next forward
    param_bytes: int = 2
    checkpointing: bool = False
    shard_size: int | None = None      # hybrid: ranks per shard group S (None: one node)

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Options.stage must be 0 (DDP), 1, 2 or 3, got {self.stage!r}")
        if self.stage == 0 and (self.hybrid or self.hpz or self.quantize_weights or self.quantize_grads):
            raise ValueError("DDP (stage 0) has no sharding: hybrid/hpz/quantize_* need stage >= 1")
        if self.hpz and self.stage != 3:
            raise ValueError("hpz (secondary weight partition) applies to stage 3's backward all-gather only")
        if self.hpz and self.hybrid:
            raise ValueError("hpz and hybrid both keep gathers inside a node: choose one")
        if self.shard_size is not None and (not self.hybrid or not isinstance(self.shard_size, int)
                                            or isinstance(self.shard_size, bool) or self.shard_size < 1):
            raise ValueError(f"Options.shard_size must be a positive int and needs hybrid=True, got "
                             f"{self.shard_size!r} (hybrid={self.hybrid})")

    @property
    def name(self) -> str:
        base = "DDP" if self.stage == 0 else f"ZeRO-{self.stage}"
        extra = [x for x, on in (("hybrid", self.hybrid), ("hpZ", self.hpz), ("qwZ", self.quantize_weights),
                                 ("qgZ", self.quantize_grads)) if on]
        if self.shard_size is not None:
            extra[0] = f"hybrid S={self.shard_size}"
        return base + (" + " + " + ".join(extra) if extra else "")


@dataclass(frozen=True)
class Collective:
    """One collective of the step, per rank."""
    name: str
    kind: str            # "all_gather" | "reduce_scatter" | "all_reduce"
    phase: str           # "forward" | "backward" | "after_step"
    elements: float      # elements of the full (gathered / reduced) tensor, in units of parameters
    bytes_per_element: float
    group: int           # ranks in the collective's group
    link: str            # "intra" | "inter"  ([Note: link classes])

    @property
    def bytes_sent(self) -> float:
        """Bytes one rank sends: V (k-1)/k, twice that for an all-reduce."""
        frac = (self.group - 1) / self.group if self.group > 1 else 0.0
        return self.elements * self.bytes_per_element * frac * (2 if self.kind == "all_reduce" else 1)


def _link(group: int, cluster: Cluster) -> str:
    return "intra" if group <= cluster.node_size else "inter"


def _shard_size(cluster: Cluster, opt: Options) -> int:
    """Ranks per shard group: all of them, or (hybrid) ``shard_size`` / one node."""
    if not opt.hybrid:
        return cluster.gpus
    s = opt.shard_size if opt.shard_size is not None else cluster.node_size
    if s > cluster.gpus or cluster.gpus % s:
        raise ValueError(f"Options.shard_size={s} must divide the {cluster.gpus} GPUs (mesh shape (R, S) "
                         f"with R * S = {cluster.gpus})")
    return s


def collectives(psi: float, cluster: Cluster, opt: Options) -> list[Collective]:
    """Every collective one step issues, per rank ([Note: collectives of one step])."""
    n, b = cluster.gpus, float(opt.param_bytes)
    if n == 1:
        return []
    if opt.stage == 0:
        return [Collective("grad all-reduce", "all_reduce", "backward", psi, b, n, _link(n, cluster))]
    shard = _shard_size(cluster, opt)
    replicas = n // shard
    w_bytes = QWZ_BYTES if opt.quantize_weights else b
    g_bytes = QGZ_BYTES if opt.quantize_grads else b
    out = [Collective("grad reduce-scatter", "reduce_scatter", "backward", psi, g_bytes, shard,
                      _link(shard, cluster))]
    if opt.stage == 3:
        out.append(Collective("param all-gather (forward)", "all_gather", "forward", psi, w_bytes, shard,
                              _link(shard, cluster)))
        bwd_group = cluster.node_size if opt.hpz else shard
        out.append(Collective("param all-gather (backward)", "all_gather", "backward", psi, w_bytes, bwd_group,
                              _link(bwd_group, cluster)))
    else:
        out.append(Collective("param all-gather", "all_gather",
                              "forward" if opt.overlap_param_gather else "after_step", psi, w_bytes, shard,
                              _link(shard, cluster)))
    if replicas > 1:   # hybrid: each rank's reduced gradient shard, all-reduced across the replicas
        out.append(Collective("grad shard all-reduce (replicas)", "all_reduce", "backward", psi / shard, b,
                              replicas, "intra" if n <= cluster.node_size else "inter"))
    return out


def paper_volume(opt: Options) -> float:
    """The ZeRO paper's communication volume per step in units of Ψ (no (k-1)/k factor)."""
    if opt.hybrid or opt.hpz or opt.quantize_weights or opt.quantize_grads:
        raise ValueError("the ZeRO paper's volumes cover stages 0-3 without hybrid or ZeRO++ options")
    return 2.0 if opt.stage in (0, 1, 2) else 3.0


@dataclass(frozen=True)
class StepEstimate:
    options: Options
    compute_s: float
    comm_s: dict[str, float]                 # seconds per collective name
    exposed_s: float
    bytes_by_link: dict[str, float] = field(default_factory=dict)
    tokens_per_step: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def _seconds(c: Collective, cluster: Cluster) -> float:
    bw = (cluster.intra_gbps if c.link == "intra" else cluster.inter_gbps) * 1e9
    lat = (cluster.intra_latency_us if c.link == "intra" else cluster.inter_latency_us) * 1e-6
    return lat * math.ceil(math.log2(max(2, c.group))) + c.bytes_sent / bw


def estimate(psi: float, tokens_per_gpu: float, cluster: Cluster, opt: Options) -> StepEstimate:
    """Step time of one data-parallel step ([Note: compute and overlap])."""
    if not psi > 0 or not tokens_per_gpu > 0:
        raise ValueError(f"psi and tokens_per_gpu must be positive, got {psi!r}, {tokens_per_gpu!r}")
    flops = 6.0 * psi * tokens_per_gpu * (4 / 3 if opt.checkpointing else 1.0)
    compute = flops / (cluster.tflops * 1e12)
    fwd, bwd = compute / 3, 2 * compute / 3
    colls = collectives(psi, cluster, opt)
    secs = {c.name: _seconds(c, cluster) for c in colls}
    by_phase = {"forward": 0.0, "backward": 0.0, "after_step": 0.0}
    by_link = {"intra": 0.0, "inter": 0.0}
    for c in colls:
        by_phase[c.phase] += secs[c.name]
        by_link[c.link] += c.bytes_sent
    exposed = max(0.0, by_phase["forward"] - fwd) + max(0.0, by_phase["backward"] - bwd) + by_phase["after_step"]
    return StepEstimate(opt, compute, secs, exposed, by_link, tokens_per_gpu * cluster.gpus)
