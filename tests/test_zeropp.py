"""ZeRO++ quantized collectives: qwZ (the parameter all-gathers of every stage with int8 blockwise codes,
[Note: quantized weight all-gather]) and qgZ (the gradient reduce-scatter with int8 codes and fp32
accumulation, [Note: quantized gradient reduce-scatter]).

Checked against the codec reference (zero_kernels/codecs.py encode_q8/decode_q8, linear_signed code
book) bit for bit, against the exact values within half a code step per contribution, and in training
against the exact collectives (loss within 1% at every step; masters exact in the state dicts).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_world  # noqa: E402
from test_zero import B, batch, loss_fn, make_model  # noqa: E402

import zero_kernels as zk  # noqa: E402
from zero_kernels.zero import collectives as C  # noqa: E402
from zero_kernels.codecs import BLOCK, CODE_BOOKS, decode_q8, encode_q8  # noqa: E402
from zero_kernels.zero.qgz import quantized_average, quantized_average_reference, quantized_reduce_scatter  # noqa: E402
from zero_kernels.zero.qwz import QWZ_CODE, encode_wire, quantized_all_gather  # noqa: E402


def _values(shard: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * shard, generator=g) * torch.linspace(0.01, 3.0, n * shard)   # varied block scales
    x[-5:] = 0.0                                                                          # padding
    x[BLOCK:2 * BLOCK] = 0.0                                                              # an all-zero block
    return x


def test_encode_wire_equals_codec_bit_for_bit():
    """qwZ/qgZ's arithmetic encoder == codecs.encode_q8 (torch.bucketize over the midpoints) on random
    values, every midpoint and its fp32 neighbours (the ties), the book's own values, zeros, +-inf and
    NaN in blocks, odd sizes; negative control: the plain rounding guess without the midpoint
    correction differs."""
    table = CODE_BOOKS[QWZ_CODE]
    mid = (table[:-1] + table[1:]) / 2
    edge = torch.cat([mid, torch.nextafter(mid, torch.tensor(2.0)), torch.nextafter(mid, torch.tensor(-2.0)),
                      table, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    edge = edge[edge.abs() <= 1]                        # so that a block's scale is 1 and y = x exactly
    g = torch.Generator().manual_seed(11)
    blocks = [edge[i:i + BLOCK - 1] for i in range(0, edge.numel(), BLOCK - 1)]
    x = torch.cat([torch.cat([b, torch.tensor([1.0])]) for b in blocks])          # absmax 1: y = x exactly
    x = torch.cat([x, torch.randn(5 * BLOCK + 77, generator=g) * 3, torch.zeros(BLOCK),
                   torch.tensor([float("nan"), 1.0, float("inf"), -2.0])])
    for t in (x, x[:BLOCK - 3], x.view(-1)[7:]):
        c_ref, s_ref = encode_q8(t, table)
        c, s = encode_wire(t, table)
        assert torch.equal(s, s_ref) or torch.equal(s.nan_to_num(), s_ref.nan_to_num())
        assert torch.equal(c, c_ref), int((c != c_ref).sum())
    y = x[:len(blocks) * BLOCK]
    guess = torch.floor(y * 127.0 + 127.5).clamp(0, 255).to(torch.uint8)
    assert not torch.equal(guess, encode_q8(y, table)[0]), "negative control: the ties need the correction"


def _gather_cases(rank, world):
    table = CODE_BOOKS[QWZ_CODE]
    for shard, dtype in ((3 * BLOCK + 77, torch.float32), (BLOCK - 3, torch.float32), (2 * BLOCK + 1, torch.bfloat16)):
        exact = _values(shard, world, seed=shard).to(dtype)
        flat = torch.zeros_like(exact)
        own = slice(rank * shard, (rank + 1) * shard)
        flat[own] = exact[own]
        res = quantized_all_gather(flat, rank, async_op=True, tag=("t", shard))
        C.wait(res)
        assert torch.equal(flat[own], exact[own]), "own slice must stay exact"
        changed = 0
        for j in range(world):
            if j == rank:
                continue
            sl = slice(j * shard, (j + 1) * shard)
            codes, scales = encode_q8(exact[sl], table)                       # the reference
            want = decode_q8(codes, scales, table).to(dtype)
            assert torch.equal(flat[sl], want), f"slice {j}: not the codec reference"
            err = (flat[sl].float() - exact[sl].float()).abs()
            step = scales.repeat_interleave(BLOCK)[:shard] / 127                 # one code step per block
            bound = step / 2 * (1 + 1e-6) if dtype == torch.float32 else step  # bf16: + one cast
            assert bool((err <= bound + 1e-30).all()), (j, float((err - bound).max()))
            assert bool((flat[sl][exact[sl] == 0] == 0).all()), "zeros must stay exact"
            changed += int((flat[sl] != exact[sl]).sum())
        assert changed > 0, "negative control: the other slices must carry quantization error"


def _rs_cases(rank, world):
    table = CODE_BOOKS[QWZ_CODE]
    for shard in (3 * BLOCK + 77, BLOCK - 3):
        flats = [_values(shard, world, seed=100 * j + shard) for j in range(world)]
        out = torch.empty(shard)
        C.wait(quantized_reduce_scatter(flats[rank].clone(), out, async_op=True, tag=("g", shard)))
        assert torch.equal(out, quantized_average_reference(flats, rank)), "not the codec reference"
        sl = slice(rank * shard, (rank + 1) * shard)
        exact = torch.stack([f[sl] for f in flats]).sum(0) / world
        bound = sum(encode_q8(flats[j][sl], table)[1].repeat_interleave(BLOCK)[:shard] / 254
                    for j in range(world) if j != rank) / world
        err = (out - exact).abs()
        assert bool((err <= bound * (1 + 1e-5) + 1e-6 * exact.abs() + 1e-30).all()), float((err - bound).max())
        assert bool((err > 0).any()), "negative control: the peers' contributions must carry quantization error"
        out2 = flats[rank].clone()                    # in place: the output is the flat's own slice
        C.wait(quantized_reduce_scatter(out2, out2[sl], async_op=False, tag=("g2", shard)))
        assert torch.equal(out2[sl], out)


def test_qgz_reduce_scatter_world3():
    run_world(_rs_cases, 3, timeout=300)


def _replica_average_cases(rank, world):
    """Hierarchical qgZ's replica exchange ([Note: hierarchical qgZ]): every rank ends with the same bits,
    within the two quantization steps of the exact average, and the values did change (negative control:
    not the exact all-reduce)."""
    for numel in (2 * BLOCK * world + 37, BLOCK - 3):
        mine = _values(numel, 1, seed=7 * rank + numel)
        t = mine.clone()
        quantized_average(t, None)
        everyone = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(everyone, t)
        assert all(torch.equal(e, t) for e in everyone), "ranks must hold bit-identical averages"
        inputs = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(inputs, mine)
        exact = torch.stack(inputs).sum(0) / world
        m = torch.stack(inputs).abs().max()
        err = (t - exact).abs()
        assert float(err.max()) <= 2 * float(m) / 254, float(err.max())
        assert bool((err > 0).any()), "negative control: the codes must carry quantization error"
        assert not torch.equal(t, mine)


def test_qgz_replica_average_world3():
    run_world(_replica_average_cases, 3, timeout=300)


def _train_cases(rank, world, options):
    options = dict(options)
    where = {}
    if options.pop("hybrid", False):
        where["mesh"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

    def run(quantize):
        model = make_model()
        opt = zk.ZeroAdamW(model, bucket_size=256, backend="reference", timeout=60, lr=1e-3, weight_decay=0.1,
                           **where, **(options if quantize else {"stage": options["stage"]}))
        losses = []
        for s in range(12):
            idx, tgt = batch(s, world)
            rows = slice(rank * B, (rank + 1) * B)
            loss = loss_fn(model, idx[rows], tgt[rows])
            loss.backward()
            opt.step()
            opt.zero_grad()
            t = loss.detach().reshape(1).clone()
            dist.all_reduce(t)
            losses.append(float(t) / world)
        full = opt.full_model_state_dict()
        with opt.gathered():
            seen = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.remove_hooks()
        return losses, full, seen

    exact, full_e, seen_e = run(False)
    quant, full_q, seen_q = run(True)
    for a, b in zip(exact, quant):
        assert abs(a - b) <= 0.01 * abs(a), (exact, quant)
    if not options.get("quantize_weights"):
        assert any(not torch.equal(full_q[n], full_e[n]) for n in full_q)    # qgZ changed the training
        return
    # the masters (state dict) are exact fp32 values, never quantized: they equal what the exact
    # all-gather shows of them, while the quantized gather shows other values (negative control)
    assert any(not torch.equal(seen_q[n], full_q[n]) for n in seen_q if n != "pos")
    assert all(torch.equal(seen_e[n], full_e[n]) for n in seen_e)


def test_qwz_gather_world2():
    run_world(_gather_cases, 2, timeout=300)


def _wire_kernel_cases(rank, world, backend):
    """The same checks with each wire codec forced: the Triton kernels (kernels/quant.py, interpreted),
    the C++ codec (csrc/cpu_quant.cpp) and the torch ops; all compare with the codec reference, so
    they give the same bits. (The other tests here run "auto": the C++ codec on CPU tensors.)"""
    from zero_kernels.zero import qwz
    qwz.WIRE_BACKEND = backend
    try:
        _gather_cases(rank, world)
        _rs_cases(rank, world)
        _replica_average_cases(rank, world)
    finally:
        qwz.WIRE_BACKEND = "auto"


@pytest.mark.parametrize("backend", ["triton", "cpu", "torch"])
def test_wire_kernels_in_the_collectives_world2(backend):
    run_world(_wire_kernel_cases, 2, backend, timeout=300)


def test_qwz_gather_world3():
    run_world(_gather_cases, 3, timeout=300)


@pytest.mark.parametrize("options", [dict(stage=3, quantize_weights=True), dict(stage=2, quantize_grads=True),
                                     dict(stage=3, quantize_weights=True, quantize_grads=True),
                                     dict(stage=1, quantize_weights=True), dict(stage=2, quantize_weights=True),
                                     dict(stage=2, quantize_weights=True, overlap_param_gather=True)],
                         ids=["qwZ", "qgZ", "qwZ+qgZ", "stage1-qwZ", "stage2-qwZ", "stage2-qwZ-overlap"])
def test_zeropp_training_world2(options):
    run_world(_train_cases, 2, options, timeout=400)


def test_zeropp_hybrid_training_world4():
    """qwZ + qgZ on a 2x2 mesh (hybrid sharding) against the exact collectives on the same mesh."""
    run_world(_train_cases, 4, dict(stage=3, quantize_weights=True, quantize_grads=True, hybrid=True), timeout=500)


def test_qwz_stages_and_argument_errors():
    """qwZ runs at stages 1, 2 and 3 (there is no stage 0: DDP is not ZeroAdamW); sync_exact_params() is
    for the stages that keep parameters; the flags must be bools."""
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        zk.ZeroAdamW(torch.nn.Linear(3, 3), stage=0, quantize_weights=True)
    for stage in (1, 2):
        m = torch.nn.Linear(3, 3)
        zopt = zk.ZeroAdamW(m, stage=stage, quantize_weights=True, backend="reference")
        before = [p.detach().clone() for p in m.parameters()]
        zopt.sync_exact_params()                # one process: nothing is quantized, nothing changes
        assert all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
        zopt.remove_hooks()
    m = torch.nn.Linear(3, 3)
    zopt = zk.ZeroAdamW(m, stage=3, quantize_weights=True, backend="reference")
    with pytest.raises(ValueError, match="full_model_state_dict"):
        zopt.sync_exact_params()
    zopt.remove_hooks()
    with pytest.raises(TypeError, match="quantize_weights"):
        zk.ZeroAdamW(m, stage=3, quantize_weights=1)
    with pytest.raises(TypeError, match="quantize_grads"):
        zk.ZeroAdamW(m, stage=2, quantize_grads="yes")


def _exact_flat(b) -> torch.Tensor:
    """Bucket b's values as their owners hold them (fp32 masters), gathered exactly by the test itself: an
    all-reduce of zero-filled buffers, not the product's all-gather."""
    flat = torch.zeros(b.spec.padded_numel, dtype=torch.float32)
    flat[b.slice_start:b.slice_end] = b.master_fp32()
    dist.all_reduce(flat)
    return flat


def _all_gather_bytes(zopt, which="last_step") -> int:
    k = zopt.comm_report()[which]["by_kind"].get("all_gather", {})
    return sum(k.values())


def _stage12_qwz_cases(rank, world, stage, dtype, overlap):
    """[Note: quantized weight all-gather] at stages 1-2: after a few steps every parameter element is
    within half a code step (plus one cast) of its owner's exact value, this rank's own slice is exact,
    some elements do differ (negative control); the state dicts are the exact masters; comm_report counts
    the int8 codes; sync_exact_params() makes the parameters bit-equal to the exact gather."""
    model = make_model()
    with pytest.warns(UserWarning, match="sync_exact_params"):
        zopt = zk.ZeroAdamW(model, stage=stage, bucket_size=4096, backend="reference", timeout=60, lr=1e-2,
                            param_dtype=dtype, quantize_weights=True, overlap_param_gather=overlap)
    for s in range(4):
        idx, tgt = batch(s, world)
        rows = slice(rank * B, (rank + 1) * B)
        loss_fn(model, idx[rows], tgt[rows]).backward()
        zopt.step()
        zopt.zero_grad()
    zopt.wait_for_params()                      # overlap_param_gather: the last step's gathers are in flight
    n = world
    changed, stepped_sn = 0, []
    exact = {b.index: _exact_flat(b) for b in zopt.buckets}
    for b in zopt.buckets:
        sn = b.spec.shard_numel
        assert sn % BLOCK, "the test wants slices that are not whole blocks"
        if any(zopt.steps[i] for i in b.spec.params):
            stepped_sn.append(sn)
        want = exact[b.index].to(b.dtype)        # the owners' working values (the masters' 16-bit rounding)
        got = b.param_flat
        own = slice(b.slice_start, b.slice_end)
        assert torch.equal(got[own], want[own]), "this rank's own slice must be exact"
        for j in range(n):
            if j == rank:
                continue
            sl = slice(j * sn, (j + 1) * sn)
            x = want[sl].float()
            pad = -sn % BLOCK
            scale = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, BLOCK).amax(1).repeat_interleave(BLOCK)[:sn]
            # half a code step, plus one cast to bf16 (unit roundoff 2^-8 of the decode, |decode| <= scale)
            bound = scale / 254 * (1 + 1e-6) + (scale * 2.0 ** -8 if dtype == torch.bfloat16 else 0.0) + 1e-30
            err = (got[sl].float() - x).abs()
            assert bool((err <= bound).all()), (b.index, j, float((err - bound).max()))
            changed += int((got[sl] != want[sl]).sum())
    assert changed > 0, "negative control: the other ranks' slices must be quantized copies"
    # the optimizer's state is exact: the shard state dict holds the masters, the full state dict the
    # exact gather of them (fp32 parameters included, whose param_flat holds quantized copies)
    full = zopt.full_model_state_dict()
    shard = zopt.state_dict()
    for b, st in zip(zopt.buckets, shard["state"]):
        assert torch.equal(st["master"], exact[b.index][b.slice_start:b.slice_end])
        for ps in b.param_specs:
            assert torch.equal(full[ps.name], exact[b.index][ps.offset:ps.offset + ps.numel].view(ps.shape)), ps.name
    # comm_report: the last step's gathers sent codes + scales, about (1 + 4/256) / 2 of the 16-bit bytes
    sent = _all_gather_bytes(zopt)
    assert sent == sum((n - 1) * (sn + 4 * -(-sn // BLOCK)) for sn in stepped_sn), sent
    if dtype == torch.bfloat16:
        plain = sum((n - 1) * 2 * sn for sn in stepped_sn)
        assert sent / plain == pytest.approx((1 + 4 / BLOCK) / 2, rel=0.01), (sent, plain)
    # sync_exact_params: every parameter bit-equal to the exact gather, over the exact (16-bit) wire
    before = _all_gather_bytes(zopt, "total")
    zopt.sync_exact_params()
    assert _all_gather_bytes(zopt, "total") - before == sum(
        (n - 1) * b.spec.shard_numel * b.param_flat.element_size() for b in zopt.buckets)
    for b in zopt.buckets:
        assert torch.equal(b.param_flat, exact[b.index].to(b.dtype))
        for p, ps in zip(b.params, b.param_specs):
            assert torch.equal(p.detach(), exact[b.index][ps.offset:ps.offset + ps.numel].view(ps.shape).to(b.dtype))
    zopt.remove_hooks()


@pytest.mark.parametrize("world,stage,dtype,overlap", [
    (2, 1, torch.bfloat16, False), (3, 2, torch.bfloat16, False), (2, 2, torch.float32, True),
    (3, 1, torch.float32, True)], ids=["w2-stage1-bf16", "w3-stage2-bf16", "w2-stage2-fp32-overlap",
                                       "w3-stage1-fp32-overlap"])
def test_qwz_stage12_params_within_a_half_step(world, stage, dtype, overlap):
    run_world(_stage12_qwz_cases, world, stage, dtype, overlap, timeout=400)
