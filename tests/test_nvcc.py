"""Every CUDA source in csrc/ compiles with nvcc for sm_80 and sm_90, without register spills.

Runs on machines without a GPU (only the CUDA toolkit's nvcc is needed); skipped, saying so, where
nvcc is absent. Two kinds of compile, started together right after collection (in the background:
[Note: background compiles] in tests/_background.py) and checked by separate tests:

* each ``csrc/*.cu`` as the build compiles it (``NVCC_FLAGS`` of zero_kernels/_build.py, torch's
  ``COMMON_NVCC_FLAGS``, ``-DZK_WITH_CUDA``), for sm_80 and sm_90, with ``-Xptxas -v``;
* each ``csrc/*.cuh`` alone, without torch headers, in a generated translation unit that expands
  the header's ``ZK_..._INSTANTIATE_ALL()`` macro (every template combination); its PTX is also
  checked: IEEE fp32 operations only, the header's NaN-propagating max (``NAN_MAX``), 128-bit
  global loads and stores, no shared memory; for the coded kernel, the arithmetic 8-bit moment codes
  (their rounding conversions in exactly the kernels with a uint8 moment, no code-book gather).

Why the second one, and the stub header. A CPU-only torch wheel ships the ATen/c10 CUDA headers
but not what some of them include: ``ATen/cuda/CUDAContext.h`` needs cuSPARSE/cuBLAS headers (not
part of a bare nvcc install) and every ``c10/cuda`` header needs ``c10/cuda/impl/
cuda_cmake_macros.h``, generated at torch's build time and absent from the CPU wheel. So
csrc/cuda_adam.cu includes only ATen + c10/cuda (no CUDAContext.h), keeps its kernels in the
torch-free csrc/cuda_adam_kernel.cuh, and this test supplies a one-line stub of the generated header
(``#define C10_CUDA_BUILD_SHARED_LIBS``, its content in CUDA wheels) when torch lacks it. If a
future torch breaks that, the .cu test fails with nvcc's message while the kernel-only test still
proves the device code.

Register counts are printed (``pytest -s``) for every kernel and architecture.
"""
from __future__ import annotations

import glob
import os
import re
import runpy
import shutil
import subprocess

import pytest

import _background

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
ARCHS = (80, 90)
# The .cu files hold the same kernels as the headers (they include them) plus the torch host code: their
# device code for every arch is already checked by the header compiles, so they compile for one arch
# (the suite's time: ~15 s less of nvcc on 2 cores).
CU_ARCHS = (90,)
TIMEOUT_S = 300

NVCC = shutil.which("nvcc")
if NVCC is None:
    _home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if _home and os.path.exists(os.path.join(_home, "bin", "nvcc")):
        NVCC = os.path.join(_home, "bin", "nvcc")

pytestmark = [pytest.mark.background, pytest.mark.skipif(
    NVCC is None, reason="nvcc not found (not on PATH, no CUDA_HOME/bin/nvcc): the CUDA toolkit is "
                         "needed to compile csrc/*.cu; this test does not need a GPU")]

CU_FILES = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
CUH_FILES = sorted(glob.glob(os.path.join(CSRC, "*.cuh")))


def _build_flags(archs=ARCHS) -> list[str]:
    """NVCC_FLAGS from zero_kernels/_build.py (one source of truth), minus its -gencode list."""
    cfg = runpy.run_path(os.path.join(ROOT, "zero_kernels", "_build.py"))
    flags = [f for f in cfg["NVCC_FLAGS"] if not f.startswith(("-gencode", "--generate-code", "-arch"))]
    try:  # what torch's CUDAExtension adds (no implicit half/bf16 conversions, relaxed constexpr)
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
        flags = list(COMMON_NVCC_FLAGS) + flags
    except ImportError:
        pass
    return flags + ["-Xcompiler", "-fPIC"] + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def _torch_includes(tmp: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths
    paths = list(include_paths())
    if not any(os.path.exists(os.path.join(p, "c10", "cuda", "impl", "cuda_cmake_macros.h")) for p in paths):
        stub = os.path.join(tmp, "stub", "c10", "cuda", "impl")
        os.makedirs(stub, exist_ok=True)
        with open(os.path.join(stub, "cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n// Stub for tests/test_nvcc.py: the CPU torch wheel lacks this generated header.\n"
                    "#define C10_CUDA_BUILD_SHARED_LIBS\n")
        paths.append(os.path.join(tmp, "stub"))
    return paths


def _kernel_only_tu(tmp: str, header: str) -> str:
    """A translation unit including `header` alone and instantiating all its kernels."""
    src = open(header).read()
    macros = re.findall(r"#define\s+(ZK_\w*INSTANTIATE_ALL)\(\)", src)
    tu = os.path.join(tmp, os.path.basename(header) + ".only.cu")
    with open(tu, "w") as f:
        f.write(f'#include "{os.path.basename(header)}"\n' + "".join(f"{m}()\n" for m in macros))
    return tu


_PTXAS_FN = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PTXAS_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> list[dict]:
    """[{kernel, arch, regs, stack, spill_stores, spill_loads}] from `-Xptxas -v` output."""
    out, cur = [], None
    for line in text.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            cur = dict(kernel=m.group(1), arch=m.group(2), regs=None, stack=None,
                       spill_stores=None, spill_loads=None)
            out.append(cur)
            continue
        if cur is None:
            continue
        m = _PTXAS_PROPS.search(line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = _PTXAS_REGS.search(line)
        if m:
            cur["regs"] = int(m.group(1))
    return out


def _demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    res = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    lines = res.stdout.splitlines()
    return dict(zip(names, lines)) if len(lines) == len(names) else {n: n for n in names}


_KEEP_DIRS: dict[str, str] = {}   # label -> nvcc -keep directory: its PTX is checked by test_kernel_ptx_is_ieee
_COMMANDS: dict[str, list[str]] = {}   # label -> nvcc command


def start_background(selected=()):
    """Start every compile at once ([Note: background compiles] in tests/_background.py: right after
    collection, at nice 19; they are independent and nvcc is mostly single-threaded)."""
    if NVCC is None or _COMMANDS:
        return
    tmp = _background.tempdir("zk_nvcc_")
    flags, cu_flags = _build_flags(), _build_flags(CU_ARCHS)
    torch_inc = _torch_includes(tmp)
    for cu in CU_FILES:
        _COMMANDS[os.path.basename(cu)] = [
            NVCC, "-c", *cu_flags, "-Xptxas", "-v", "-DZK_WITH_CUDA=1", f"-I{CSRC}",
            *[f"-I{p}" for p in torch_inc], cu, "-o", os.path.join(tmp, os.path.basename(cu) + ".o")]
    for cuh in CUH_FILES:
        tu = _kernel_only_tu(tmp, cuh)
        label = os.path.basename(cuh) + " (without torch)"
        _KEEP_DIRS[label] = os.path.join(tmp, os.path.basename(cuh) + ".keep")
        os.makedirs(_KEEP_DIRS[label])
        _COMMANDS[label] = [NVCC, "-c", *flags, "-Xptxas", "-v", "-keep", f"-keep-dir={_KEEP_DIRS[label]}",
                            f"-I{CSRC}", tu, "-o", os.path.join(tmp, os.path.basename(cuh) + ".o")]
    for label, cmd in _COMMANDS.items():
        _background.start(f"nvcc {label}", cmd)


@pytest.fixture(scope="module")
def compiles():
    """{label: (returncode, output, seconds, command)} of every compile, and {label PTX sm_XX: (.., ptx, ..)}."""
    start_background()
    results = {}
    for k, cmd in _COMMANDS.items():
        r = _background.result(f"nvcc {k}", timeout=TIMEOUT_S)
        results[k] = (r.returncode, r.output, r.seconds, " ".join(cmd))
        for ptx in glob.glob(os.path.join(_KEEP_DIRS[k], "*.compute_*.ptx")) if k in _KEEP_DIRS else ():
            arch = re.search(r"\.compute_(\d+)\.ptx$", ptx).group(1)
            with open(ptx) as f:
                results[f"{k} PTX sm_{arch}"] = (r.returncode, f.read(), 0.0, " ".join(cmd))
    return results


def _check(label: str, results: dict, archs=ARCHS) -> None:
    rc, out, secs, cmd = results[label]
    assert rc == 0, f"nvcc failed on {label} ({secs:.0f}s)\n$ {cmd}\n{out[-6000:]}"
    kernels = parse_ptxas(out)
    names = _demangle(sorted({k["kernel"] for k in kernels}))
    print(f"\n{label}: compiled in {secs:.0f}s; ptxas per kernel:")
    for k in kernels:
        print(f"  {k['arch']:7s} regs={k['regs']!s:>3} stack={k['stack']}B "
              f"spill st/ld={k['spill_stores']}/{k['spill_loads']}B  {names[k['kernel']]}")
    built = {k["arch"].rstrip("a") for k in kernels}
    assert built >= {f"sm_{a}" for a in archs}, (
        f"{label}: expected device code for {archs}, ptxas compiled only for {sorted(built)}\n{out[-3000:]}")
    spilled = [k for k in kernels if (k["spill_stores"] or 0) or (k["spill_loads"] or 0)]
    assert not spilled, "register spills (want '0 bytes spill stores, 0 bytes spill loads'):\n" + "\n".join(
        f"  {k['arch']} {names[k['kernel']]}: {k['spill_stores']} B stores, {k['spill_loads']} B loads, "
        f"{k['regs']} registers" for k in spilled)
    unparsed = [k for k in kernels if k["spill_stores"] is None or k["regs"] is None]
    assert not unparsed, f"could not parse ptxas output for {[k['kernel'] for k in unparsed]}"


def test_there_is_cuda_source():
    assert CU_FILES, f"no .cu files in {CSRC}"


@pytest.mark.parametrize("name", [os.path.basename(p) for p in CU_FILES])
def test_cu_compiles_without_spills(name, compiles):
    """The .cu as the build compiles it (torch headers; see the module docstring for the stub), for CU_ARCHS."""
    _check(name, compiles, CU_ARCHS)


@pytest.mark.parametrize("name", [os.path.basename(p) for p in CUH_FILES])
def test_kernel_header_compiles_without_torch(name, compiles):
    """The kernels alone, every template combination, no torch headers at all."""
    _check(name + " (without torch)", compiles)


# The NaN-propagating max each kernel header must show in its PTX (a header not listed fails: say
# which max it takes): torch.maximum for amsgrad, and the coded kernel's block absmax, taken on the
# bits as unsigned integers (every NaN lies above +inf) by one warp reduction.
NAN_MAX = {
    "cuda_adam_kernel.cuh": (r"\b(?:max|min)\.NaN\.f32\b", "amsgrad's max.NaN.f32"),
    "cuda_adam_coded_kernel.cuh": (r"\bredux\.sync\.max\.u32\b", "the block absmax's redux.sync.max.u32"),
}


def _ptx(name: str, arch: int, compiles: dict) -> str:
    label = f"{name} (without torch)"
    assert compiles[label][0] == 0, f"nvcc failed on {label}: see test_kernel_header_compiles_without_torch"
    ptx = compiles.get(f"{label} PTX sm_{arch}", (None, ""))[1]
    assert ptx, f"nvcc -keep left no compute_{arch} PTX for {label}"
    return ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [os.path.basename(p) for p in CUH_FILES])
def test_kernel_ptx_is_ieee(name, arch, compiles):
    """The CUDA kernels' PTX follows the Triton kernels' rule ([Note: IEEE numerics in the PTX] in
    tests/test_codegen.py, same checker): no fma, approximate or flush-to-zero fp32 instruction, and
    the header's max propagates NaN (NAN_MAX), under the build's flags."""
    from test_codegen import ptx_ieee_counts
    ptx = _ptx(name, arch, compiles)
    counts = ptx_ieee_counts(ptx)
    print(f"\n{name} sm_{arch}: {counts}")
    bad = {k: n for k, n in counts.items() if n and k != "max.NaN"}
    assert not bad, f"{name} sm_{arch}: non-IEEE instructions in the PTX: {bad}"
    assert name in NAN_MAX, f"{name}: add it to NAN_MAX (which NaN-propagating max its PTX must contain)"
    pattern, what = NAN_MAX[name]
    body = "\n".join(line.split("//")[0] for line in ptx.splitlines())
    assert re.search(pattern, body), f"{name} sm_{arch}: no NaN-propagating max ({what}) in the PTX"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", [os.path.basename(p) for p in CUH_FILES])
def test_kernel_ptx_streams(name, arch, compiles):
    """Streaming kernels: 128-bit global loads and stores on their vector paths, and no shared memory
    (the coded kernel's block absmax is a warp reduction, [Note: the coded CUDA kernel])."""
    body = "\n".join(line.split("//")[0] for line in _ptx(name, arch, compiles).splitlines())
    wide_ld = len(re.findall(r"\bld\.global(?:\.nc)?(?:\.L\w+::\w+)*\.v4\.", body))
    wide_st = len(re.findall(r"\bst\.global(?:\.L\w+::\w+)*\.v4\.", body))
    shared = len(re.findall(r"\.shared\b", body))
    print(f"\n{name} sm_{arch}: 128-bit loads {wide_ld}, stores {wide_st}, shared-memory references {shared}")
    assert wide_ld and wide_st, f"{name} sm_{arch}: no 128-bit global accesses in the PTX"
    assert shared == 0, f"{name} sm_{arch}: {shared} shared-memory references in the PTX"


# [Note: the coded CUDA kernel]: the uint8 moments are arithmetic codes ([Note: state codecs] 2). An
# entry's template arguments <master kind, exp_avg kind, exp_avg_sq kind> are in its mangled name
# (MomentKind: 0 fp32, 1 bf16, 2 uint8, 3 float8_e4m3fn).
_CODED_ENTRY = re.compile(r"\.entry\s+(_Z\w*fused_adam_coded_kernelILi(\d)ELi(\d)ELi(\d)EE\w*)")
_U8, _F8 = 2, 3
_SCALAR_F32_LOAD = re.compile(r"\bld\.global(?:\.nc)?(?:\.L\w+::\w+)*\.f32\b")


def _ptx_entries(ptx: str, entry: re.Pattern) -> dict[str, tuple[tuple[int, ...], str]]:
    """{mangled name: (integer template arguments, PTX body up to the next entry)}, comments stripped."""
    body = "\n".join(line.split("//")[0] for line in ptx.splitlines())
    found = list(entry.finditer(body))
    return {m.group(1): (tuple(int(g) for g in m.groups()[1:]), body[m.end():nxt.start() if nxt else len(body)])
            for m, nxt in zip(found, found[1:] + [None])}


@pytest.mark.parametrize("arch", ARCHS)
def test_coded_kernel_ptx_has_arithmetic_8bit_codes(arch, compiles):
    """The 8-bit moment codes are arithmetic (codecs.encode_m8 / encode_v8), with the right code for each
    moment: exp_avg's rounds half to even into an integer (``cvt.rni.s32.f32``), exp_avg_sq's is a log code on
    the bits of the denominator's own sqrt(v) (an arithmetic shift ``shr.s32`` by 19, no second square root): a
    kernel with a uint8 exp_avg has the rounding, one without has none; a uint8 exp_avg_sq has the shift and no
    more ``sqrt.rn.f32`` than the fp32 one. And no kernel gathers from a code book: its only scalar fp32 global
    loads are the 3 coefficients, the grad scale and one block scale per blockwise moment (a table decode adds
    one per element, a midpoint search 8 per element)."""
    name = "cuda_adam_coded_kernel.cuh"
    entries = _ptx_entries(_ptx(name, arch, compiles), _CODED_ENTRY)
    assert len(entries) == 32, f"{name} sm_{arch}: expected 32 coded kernels in the PTX, found {len(entries)}"
    bad = []
    count = lambda body: len(re.findall(r"\bsqrt\.rn\.f32\b", body))    # noqa: E731
    plain = {(mk, m): count(body) for (mk, m, v), body in entries.values() if v == 0}   # fp32 exp_avg_sq
    for (mk, m, v), body in sorted(entries.values()):
        rni = len(re.findall(r"\bcvt\.rni\.s32\.f32\b", body))
        shifts = len(re.findall(r"\bshr\.s32\s+%r\d+,\s*%r\d+,\s*19;", body))
        sqrts = count(body)
        f32_loads = len(_SCALAR_F32_LOAD.findall(body))
        most = 4 + (m in (_U8, _F8)) + (v in (_U8, _F8))
        # at most the fp32-v kernel's square roots: a second sqrt per element would add as many again. (Fewer: since
        # the cap on an 8-bit m, [Note: the bound on 8-bit m], nvcc unrolls one path of <fp32 master, u8, u8> less:
        # 15 sqrt.rn.f32 against 24 on sm_80, not yet timed on a GPU.)
        if (rni > 0) != (m == _U8) or (shifts > 0) != (v == _U8) or sqrts > plain[mk, m] or f32_loads > most:
            bad.append(f"  <master {mk}, exp_avg {m}, exp_avg_sq {v}>: cvt.rni.s32.f32 x{rni}, shr.s32 19 x{shifts}, "
                       f"sqrt.rn.f32 x{sqrts} (want {plain[mk, m]}), scalar fp32 loads {f32_loads} (at most {most})")
    print(f"\n{name} sm_{arch}: {len(entries)} coded kernels, 8-bit codes checked")
    assert not bad, (f"{name} sm_{arch}: want cvt.rni.s32.f32 iff exp_avg is uint8, shr.s32 19 iff exp_avg_sq is "
                     "uint8, no second sqrt, no code-book loads:\n" + "\n".join(bad))
