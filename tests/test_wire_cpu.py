"""The ZeRO++ int8 wire codec in C++ (csrc/cpu_quant.cpp: qwZ / qgZ on CPU tensors, zero_kernels.zero.qwz with
WIRE_BACKEND "auto" or "cpu") against the codec reference zero_kernels.codecs.encode_q8 / decode_q8, bit for bit
(codes, scales and decoded values compared as bits, NaNs included): fp32, bf16 and fp16 inputs of odd sizes
(partial last block, below one block), all-zero and -0.0 blocks, values exactly on the code book's midpoints
and their fp32 neighbours (the ties), +-inf and NaN blocks, subnormal blocks, decode and decode-accumulate,
1 and 2 threads, every SIMD path (ZERO_KERNELS_CPU_ISA, in subprocesses); the backend choice and its
fallback warning; the front end's argument errors; negative controls (wrong midpoints, wrong code book).
The collectives with WIRE_BACKEND="cpu" are tests/test_zeropp.py's test_wire_kernels_in_the_collectives_world2."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from zero_kernels import _ext
from zero_kernels.codecs import BLOCK, CODE_BOOKS, decode_q8, encode_q8, midpoints
from zero_kernels.zero import qwz

CPP = qwz.wire_module()
pytestmark = pytest.mark.skipif(CPP is None and os.environ.get("ZK_REQUIRE_CPU") != "1",
                                reason=f"C++ wire codec unavailable: {_ext.load_error()}")

TABLE = CODE_BOOKS[qwz.QWZ_CODE]
MID = midpoints(TABLE)
SIZES = [1, 255, 256, 257, 1000, 70001]
INF, NAN = float("inf"), float("nan")


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1).contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def special_blocks() -> torch.Tensor:
    """Whole blocks of the edge cases, one after the other."""
    g = torch.Generator().manual_seed(3)
    up, down = torch.nextafter(MID, torch.tensor(2.0)), torch.nextafter(MID, torch.tensor(-2.0))
    blocks = [
        # the book spans [-1, 128/127]: every midpoint but the top one (above 1, out of reach of y) is a tie
        torch.cat([MID[:254], torch.tensor([1.0, -1.0])]),     # scale 1: y = x, exactly on the midpoints
        torch.cat([MID[:254] * 4, torch.tensor([-4.0, 4.0])]),  # scale 4 (a power of 2): y = the midpoints again
        torch.cat([up, torch.tensor([1.0])]),                  # one ulp above each midpoint
        torch.cat([down, torch.tensor([-1.0])]),               # one ulp below
        torch.cat([TABLE[:255], torch.tensor([1.0])]),         # the book's own values
        torch.zeros(BLOCK),                                    # scale 0: y = 0
        -torch.zeros(BLOCK),                                   # -0.0: scale 0 too
        torch.randn(BLOCK, generator=g) * 1e-39,               # subnormal values, subnormal scale
        torch.cat([torch.randn(BLOCK - 1, generator=g) * 1e-40, torch.tensor([3.0])]),  # subnormal y
        torch.cat([torch.randn(BLOCK - 2, generator=g), torch.tensor([INF, -5.0])]),   # +inf: scale inf
        torch.cat([torch.randn(BLOCK - 2, generator=g), torch.tensor([-INF, INF])]),   # inf / inf = NaN
        torch.cat([torch.randn(BLOCK - 1, generator=g), torch.tensor([NAN])]),         # NaN: scale NaN
        torch.cat([-torch.full((3,), NAN), torch.tensor([INF]), torch.randn(BLOCK - 4, generator=g)]),
        (torch.rand(BLOCK, generator=g) * 2 - 1) * 3.4e38,     # up to the largest finite fp32
    ]
    return torch.cat(blocks)


def values(n: int, seed: int) -> torch.Tensor:
    """Random values with varied block scales, the special blocks laid over the start where they fit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 3, n)
    sp = special_blocks()
    k = min(n // BLOCK, sp.numel() // BLOCK) * BLOCK
    x[:k] = sp[:k]
    return x


def cpp_encode(x: torch.Tensor, mid: torch.Tensor = MID):
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    scales = torch.empty(-(-x.numel() // BLOCK), dtype=torch.float32)
    CPP.q8_encode_cpu(x, mid, codes, scales)
    return codes, scales


def cpp_decode(codes, scales, table=TABLE, acc=None):
    out = torch.empty(codes.numel(), dtype=torch.float32) if acc is None else acc
    CPP.q8_decode_cpu(codes, scales, table, out, acc is not None)
    return out


def check_equal(x: torch.Tensor, book: str = qwz.QWZ_CODE) -> None:
    table = CODE_BOOKS[book]
    c_ref, s_ref = encode_q8(x, table)
    c, s = cpp_encode(x, midpoints(table))
    assert torch.equal(bits(s), bits(s_ref)), (s, s_ref)
    assert torch.equal(c, c_ref.reshape(-1)), int((c != c_ref.reshape(-1)).sum())
    want = decode_q8(c_ref, s_ref, table).reshape(-1)
    assert torch.equal(bits(cpp_decode(c, s, table)), bits(want))
    acc0 = torch.randn(x.numel(), generator=torch.Generator().manual_seed(x.numel())) * 2
    acc0[::97] = -want[::97]                               # sums that cancel exactly
    acc = cpp_decode(c, s, table, acc0.clone())
    assert torch.equal(bits(acc), bits(acc0.clone().add_(want)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_encode_decode_equal_the_codec(n, dtype):
    x = values(n, seed=n).to(dtype)
    check_equal(x)


def test_special_blocks_and_shifted_views():
    """Every edge block, then the same values shifted by odd offsets (other block boundaries, NaN and inf in
    partial blocks), fp32 and bf16; another code book (the codec takes any midpoint table)."""
    sp = special_blocks()
    assert sp.isnan().any() and sp.isinf().any() and bool(((sp != 0) & (sp.abs() < 1.1754944e-38)).any())
    for t in (sp, sp[7:], sp[:-77], sp[BLOCK - 1:BLOCK + 3]):
        check_equal(t)
        check_equal(t.bfloat16())
    check_equal(sp, "dynamic_signed")
    c, s = cpp_encode(sp)
    assert bits(s)[11] == 0x7FC00000 and s[9] == INF and s[5] == 0     # NaN / inf / zero blocks did occur
    assert torch.equal(c[:254].long(), torch.arange(254)), "a tie takes the lower code"
    assert torch.equal(c[BLOCK:BLOCK + 254].long(), torch.arange(254))
    assert int(c[5 * BLOCK]) == 127 and int(c[11 * BLOCK]) == 255


def test_threads_give_the_same_bits():
    x = values(300 * BLOCK + 5, seed=9)                    # several chunks of 128 blocks
    before = torch.get_num_threads()
    try:
        out = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            c, s = cpp_encode(x)
            out.append((c, bits(s), bits(cpp_decode(c, s))))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*out))
    c_ref, s_ref = encode_q8(x, TABLE)
    assert torch.equal(out[0][0], c_ref) and torch.equal(out[0][1], bits(s_ref))


def isa_hash() -> str:
    """sha256 of the codes, scales, decodes and accumulates of a few inputs (run once per SIMD path)."""
    h = hashlib.sha256()
    for x in (special_blocks(), special_blocks()[7:], values(70001, 1), values(1000, 2).bfloat16(),
              values(257, 3).half()):
        c, s = cpp_encode(x)
        for t in (c, s, cpp_decode(c, s), cpp_decode(c, s, acc=torch.ones(x.numel()))):
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


ISA_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_wire_cpu import CPP, isa_hash
    print(json.dumps({{"isa": CPP.cpu_isa(), "hash": isa_hash()}}))
""")


def test_every_simd_path_gives_the_same_bits():
    """avx512, avx2 and portable scalar (ZERO_KERNELS_CPU_ISA caps the path; an unsupported one is lowered)
    hash alike, and like this process (which the tests above compare with the reference)."""
    script = ISA_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    results = {}
    for isa in ("avx512", "avx2", "scalar"):
        env = dict(os.environ, ZERO_KERNELS_CPU_ISA=isa)
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout.strip().splitlines()[-1])
        results[res["isa"]] = res["hash"]
    assert "scalar" in results, results
    assert set(results.values()) == {isa_hash()}, results


def test_wire_functions_use_the_cpp_codec():
    """qwz.wire_encode / wire_decode: "auto" picks the C++ codec on CPU; "cpu" and "torch" give the same bits,
    with and without ``out`` / ``acc``; bf16 input (qwZ gathers bf16 buckets)."""
    x = values(5 * BLOCK + 3, seed=4)
    assert qwz.WIRE_BACKEND == "auto" and qwz.wire_backend(x) == "cpu"
    got = {}
    try:
        for backend in ("cpu", "torch"):
            qwz.WIRE_BACKEND = backend
            for t in (x, x.bfloat16()):
                c, s = qwz.wire_encode(t, TABLE)
                out = (torch.empty(t.numel(), dtype=torch.uint8), torch.empty(s.numel()))
                qwz.wire_encode(t, TABLE, out=out)
                acc = torch.linspace(-1, 1, t.numel())
                qwz.wire_decode(c, s, TABLE, acc)
                got.setdefault(backend, []).extend([c, bits(s), out[0], bits(out[1]),
                                                    bits(qwz.wire_decode(c, s, TABLE)), bits(acc)])
    finally:
        qwz.WIRE_BACKEND = "auto"
    assert len(got["cpu"]) == len(got["torch"]) == 12
    for a, b in zip(got["cpu"], got["torch"]):
        assert torch.equal(a, b)


def test_backend_choice_fallback_and_errors(monkeypatch):
    """Without the codec in the extension "auto" warns once and uses torch ops (never silently); "cpu" is an
    error; an unknown name is an error."""
    x = values(300, seed=5)
    monkeypatch.setattr(qwz, "wire_module", lambda: None)
    monkeypatch.setattr(qwz, "_warned", False)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ wire codec is unavailable"):
        assert qwz.wire_backend(x) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c, s = qwz.wire_encode(x, TABLE)                   # warned once already
    assert torch.equal(c, encode_q8(x, TABLE)[0])
    monkeypatch.setattr(qwz, "WIRE_BACKEND", "cpu")
    with pytest.raises(RuntimeError, match="WIRE_BACKEND='cpu' but the C\\+\\+ wire codec is unavailable"):
        qwz.wire_encode(x, TABLE)
    monkeypatch.setattr(qwz, "WIRE_BACKEND", "gpu")
    with pytest.raises(ValueError, match="expected one of"):
        qwz.wire_decode(c, s, TABLE)


def test_negative_controls():
    """What the comparisons above would catch: midpoints one ulp low (the ties take the upper code), another book's
    midpoints, another book or a dropped scale at decode, an accumulate that overwrites."""
    x = special_blocks()
    c_ref, s_ref = encode_q8(x, TABLE)
    assert not torch.equal(cpp_encode(x, torch.nextafter(MID, torch.tensor(-2.0)))[0], c_ref)
    assert not torch.equal(cpp_encode(x, midpoints(CODE_BOOKS["dynamic_signed"]))[0], c_ref)
    want = bits(decode_q8(c_ref, s_ref, TABLE))
    assert not torch.equal(bits(cpp_decode(c_ref, s_ref, CODE_BOOKS["dynamic_signed"])), want)
    assert not torch.equal(bits(cpp_decode(c_ref, torch.ones_like(s_ref))), want)
    acc = torch.ones(x.numel())
    assert not torch.equal(bits(cpp_decode(c_ref, s_ref, acc=acc)), want)


def test_front_end_refusals():
    x = torch.randn(1000)
    c, s = cpp_encode(x)
    nb = s.numel()
    enc = [
        (dict(x=torch.randn(1000, 2)[:, 0]), "q8_encode_cpu: x is not contiguous"),
        (dict(x=torch.randn(1000, dtype=torch.float64)), "q8_encode_cpu: x must be float32, bfloat16 or float16"),
        (dict(mid=TABLE), "q8_encode_cpu: mid has 256 elements; expected 255"),
        (dict(mid=MID.double()), "q8_encode_cpu: mid has dtype Double; expected Float"),
        (dict(codes=torch.empty(1000, dtype=torch.int8)), "q8_encode_cpu: codes has dtype Char; expected Byte"),
        (dict(codes=torch.empty(999, dtype=torch.uint8)), "q8_encode_cpu: codes has 999 elements; expected 1000"),
        (dict(scales=torch.empty(nb + 1)), f"q8_encode_cpu: scales has {nb + 1} elements; expected {nb}"),
        (dict(scales=torch.empty(2 * nb)[::2]), "q8_encode_cpu: scales is not contiguous"),
    ]
    for change, msg in enc:
        args = dict(x=x, mid=MID, codes=torch.empty(1000, dtype=torch.uint8), scales=torch.empty(nb)) | change
        with pytest.raises(RuntimeError, match=msg):
            CPP.q8_encode_cpu(**args)
    dec = [
        (dict(codes=c.to(torch.int16)), "q8_decode_cpu: codes has dtype Short; expected Byte"),
        (dict(scales=s[:-1]), f"q8_decode_cpu: scales has {nb - 1} elements; expected {nb}"),
        (dict(table=MID), "q8_decode_cpu: table has 255 elements; expected 256"),
        (dict(out=torch.empty(1000, dtype=torch.bfloat16)), "q8_decode_cpu: out has dtype BFloat16; expected Float"),
        (dict(out=torch.empty(1001)), "q8_decode_cpu: out has 1001 elements; expected 1000"),
        (dict(out=torch.empty(2000)[::2], accumulate=True), "q8_decode_cpu: out is not contiguous"),
    ]
    for change, msg in dec:
        args = dict(codes=c, scales=s, table=TABLE, out=torch.empty(1000), accumulate=False) | change
        with pytest.raises(RuntimeError, match=msg):
            CPP.q8_decode_cpu(**args)
    with pytest.raises(RuntimeError, match="q8_decode_cpu: out has dtype Double"):      # wire_decode's acc
        qwz.WIRE_BACKEND = "cpu"
        try:
            qwz.wire_decode(c, s, TABLE, torch.zeros(1000, dtype=torch.float64))
        finally:
            qwz.WIRE_BACKEND = "auto"
