"""The step-time model against published figures (not against itself): the ZeRO paper's communication
volumes (2Ψ for DDP and stages 1-2, 3Ψ for stage 3) exactly, and ZeRO++'s cross-node volume reduction
(3M -> 0.75M, about 4x) within 10%."""
import pytest

from zero_kernels.plan import main
from zero_kernels.step_time import Cluster, Options, QGZ_BYTES, QWZ_BYTES, collectives, estimate, paper_volume

PSI = 1.5e9


def _volume_in_psi(opt: Options, cluster: Cluster) -> float:
    """Σ elements moved per rank in units of Ψ, an all-reduce counting twice (the paper's convention)."""
    return sum(c.elements * (2 if c.kind == "all_reduce" else 1) for c in collectives(PSI, cluster, opt)) / PSI


@pytest.mark.parametrize("stage,expected", [(0, 2.0), (1, 2.0), (2, 2.0), (3, 3.0)])
@pytest.mark.parametrize("gpus", [2, 8, 64])
def test_zero_paper_volumes_exactly(stage, expected, gpus):
    cluster, opt = Cluster(gpus=gpus), Options(stage)
    assert paper_volume(opt) == expected
    assert _volume_in_psi(opt, cluster) == expected
    # bytes on the wire: the paper's volume x 2 bytes x (n-1)/n of a ring
    sent = sum(c.bytes_sent for c in collectives(PSI, cluster, opt))
    assert sent == pytest.approx(expected * PSI * 2 * (gpus - 1) / gpus, rel=1e-12)


def test_zeropp_cross_node_reduction_about_4x():
    cluster = Cluster(gpus=384, gpus_per_node=8)
    base = estimate(PSI, 2048, cluster, Options(3)).bytes_by_link["inter"]
    zpp = estimate(PSI, 2048, cluster, Options(3, hpz=True, quantize_weights=True, quantize_grads=True))
    ratio = base / zpp.bytes_by_link["inter"]
    assert abs(ratio - 4.0) / 4.0 <= 0.10, ratio
    # and its parts, as the ZeRO++ paper accounts them: fwd gather M -> 0.5M, bwd gather M -> 0, grads M -> 0.25M
    by = {c.name: c for c in collectives(PSI, cluster, zpp.options)}
    assert by["param all-gather (backward)"].link == "intra"
    assert by["param all-gather (forward)"].bytes_per_element == QWZ_BYTES
    assert by["grad reduce-scatter"].bytes_per_element == QGZ_BYTES


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
def test_qwz_at_stages_1_2_sends_int8_param_gathers(stage, overlap):
    """ZeroAdamW(stage=1 or 2, quantize_weights=True) sends its after-step parameter all-gather as int8
    codes + block scales (tests/test_zeropp.py measures the same ratio on the wire); the model agrees."""
    cluster = Cluster(gpus=16, gpus_per_node=8)
    plain = {c.name: c for c in collectives(PSI, cluster, Options(stage, overlap_param_gather=overlap))}
    qwz = {c.name: c for c in collectives(PSI, cluster, Options(stage, quantize_weights=True,
                                                                  overlap_param_gather=overlap))}
    assert qwz["param all-gather"].bytes_per_element == QWZ_BYTES
    assert qwz["param all-gather"].bytes_sent == pytest.approx(plain["param all-gather"].bytes_sent * QWZ_BYTES / 2)
    assert qwz["grad reduce-scatter"] == plain["grad reduce-scatter"]
    assert estimate(PSI, 2048, cluster, Options(stage, quantize_weights=True)).step_s < \
        estimate(PSI, 2048, cluster, Options(stage)).step_s


def test_hybrid_crosses_nodes_only_for_the_replica_all_reduce():
    cluster = Cluster(gpus=32, gpus_per_node=8)
    est = estimate(PSI, 2048, cluster, Options(3, hybrid=True))
    replicas = 4
    assert est.bytes_by_link["inter"] == pytest.approx(2 * (PSI / 8) * 2 * (replicas - 1) / replicas)
    assert estimate(PSI, 2048, Cluster(gpus=8), Options(3)).bytes_by_link["inter"] == 0


def test_slower_links_never_make_a_step_faster():
    fast = estimate(PSI, 512, Cluster(gpus=64, inter_gbps=50), Options(3))
    slow = estimate(PSI, 512, Cluster(gpus=64, inter_gbps=5), Options(3))
    assert slow.step_s > fast.step_s and slow.compute_s == fast.compute_s
    # negative control: inside one node the inter-node bandwidth does not matter
    a = estimate(PSI, 512, Cluster(gpus=8, inter_gbps=50), Options(3))
    b = estimate(PSI, 512, Cluster(gpus=8, inter_gbps=5), Options(3))
    assert a.step_s == b.step_s


@pytest.mark.parametrize("kw,msg", [
    (dict(stage=4), "stage"), (dict(stage=0, hybrid=True), "DDP"), (dict(stage=0, quantize_weights=True), "DDP"),
    (dict(stage=2, hpz=True), "hpz"),
    (dict(stage=3, hpz=True, hybrid=True), "choose one")])
def test_option_errors_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Options(**kw)


def test_cluster_errors():
    with pytest.raises(ValueError, match="whole number of nodes"):
        Cluster(gpus=12, gpus_per_node=8)
    with pytest.raises(ValueError, match="inter_gbps"):
        Cluster(gpus=8, inter_gbps=0)


def test_plan_simulate_cli(capsys, tmp_path):
    png = tmp_path / "p.png"
    assert main(["--model", "gpt2-xl", "--gpus", "384", "--stage", "3", "--simulate", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-3 + hpZ + qwZ + qgZ" in out and "3Ψ" in out
    assert (tmp_path / "p-scaling.png").stat().st_size > 10_000
    assert main(["--params", "1e9", "--gpus", "12", "--simulate"]) == 2
    assert "whole number of nodes" in capsys.readouterr().err
