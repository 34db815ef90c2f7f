"""GPU code generation checked without a GPU: every Triton kernel in kernels/ compiled ahead of time.

Each kernels module (``zero_kernels.kernels.<name>``, source in ``kernels/<name>.py``) exposes
``CODEGEN_CASES``, one entry per way the module launches a kernel (dtype combination, flags):

    CODEGEN_CASES = [
        (kernel,        # the @triton.jit kernel object
         signature,     # {arg: type} for every NON-constexpr argument, triton's strings:
                        #   "*fp32" "*bf16" "*fp16" "*i64" "*i32" "*u16" (pointers), "fp32" "i32" "i64"
         constexprs,    # {arg: value} for every tl.constexpr argument (tl.float32 etc. allowed)
         description,   # short text shown in the test id, e.g. "grad=bf16 p16=bf16 amsgrad"
         options),      # OPTIONAL dict, every key optional:
                        #   num_warps (4), num_stages (3), enable_fp_fusion (triton's default),
                        #     maxnreg (none: a register cap per thread):
                        #     as the launcher passes them (share one dict with the launch);
                        #   streaming (True): assert 128-bit global loads AND stores in the PTX;
                        #   min_wide_loads / min_wide_stores (1): how many 128-bit ld / st at least
                        #     (e.g. 4 fp32 arrays x 2 words per thread = 8);
                        #   max_shared (0): bytes of shared memory allowed (a block reduction
                        #     across warps needs some; 0 for pure streaming kernels);
                        #   max_spill (0): bytes of spill stores (and of spill loads) allowed; only
                        #     with a maxnreg cap measured to pay for its spills (say where);
                        #   max_regs (none): registers per thread allowed (ptxas -v);
                        #   host_aligned (False): the launcher checks the tensors' alignment on the
                        #     host and launches this variant only for aligned ones, so its PTX
                        #     need not test it ([Note: full and rest launches]);
                        #   divisible_by_16 (all pointer args): args given tt.divisibility=16,
                        #     like the JIT does for torch allocations; list the int args too if the
                        #     launcher guarantees it (multiples of 16), or [] for none.
        ...
    ]

For every case and for sm_80 and sm_90 (``GPUTarget("cuda", 80|90, 32)``) the test compiles with
``triton.compile(ASTSource(...))``, then
  * streaming cases: the PTX has 128-bit global loads and stores. 128 bits is ``.v4`` of a 32-bit
    type (``ld.global.v4.b32``: Triton packs 8 bf16/fp16 into 4 b32 registers, so 16-bit data is
    128-bit too) or ``.v2`` of a 64-bit type; masked tails may still be scalar;
  * IEEE fp32 numerics ([Note: IEEE numerics in the PTX] below): no fma, no .approx, no div.full,
    no .ftz, no NaN-dropping max/min, so the GPU computes the interpreter's bits;
  * no shared memory (``metadata.shared == 0``): a streaming kernel that needs some is converting
    register layouts between loads and stores of different widths;
  * every case streams (``streaming`` False is refused): alignment is decided per tensor inside the
    kernel, so no variant is compiled to scalar accesses only;
  * no kernel spills: Triton's own ptxas (``triton/backends/nvidia/bin``, the exact one
    triton.compile uses, same flags) is rerun with ``-v`` on the PTX and must report
    ``0 bytes spill stores, 0 bytes spill loads`` (at most ``max_spill`` each where a case allows
    some); registers are printed (``pytest -s``).
A further test fails when a module defines a kernel (a top-level @triton.jit function not called by
another one in the module) that no case covers.

TRITON_INTERPRET: with it set, ``@triton.jit`` returns interpreter objects that cannot be
compiled (``triton.compile`` fails: 'InterpretedFunction' object has no attribute 'cache_key').
CI runs other tests with TRITON_INTERPRET=1 in the environment, so the compiles always run in a
subprocess (this file run as a script) with TRITON_INTERPRET removed; this process only lists
the cases to name the tests.
"""
from __future__ import annotations

import glob
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS_DIR = os.path.join(ROOT, "kernels")
ARCHS = (80, 90)
WORKER_TIMEOUT_S = 600


def kernel_modules() -> list[str]:
    return sorted(os.path.splitext(os.path.basename(p))[0]
                  for p in glob.glob(os.path.join(KERNELS_DIR, "*.py"))
                  if not os.path.basename(p).startswith("_"))


def _fn_name(obj) -> str:
    fn = getattr(obj, "fn", obj)
    return getattr(fn, "__name__", repr(obj))


def normalize_case(case) -> dict:
    """A CODEGEN_CASES entry as a dict (validates the shape; see the module docstring)."""
    if not isinstance(case, (tuple, list)) or len(case) not in (4, 5):
        raise TypeError(f"a CODEGEN_CASES entry is (kernel, signature, constexprs, description[, options]), got {case!r}")
    kernel, signature, constexprs, description = case[:4]
    options = dict(case[4]) if len(case) == 5 else {}
    unknown = set(options) - {"num_warps", "num_stages", "enable_fp_fusion", "maxnreg", "streaming", "min_wide_loads",
                              "min_wide_stores", "divisible_by_16", "max_shared", "max_spill", "max_regs",
                              "host_aligned"}
    if unknown:
        raise ValueError(f"{description}: unknown options {sorted(unknown)}")
    return dict(kernel=kernel, signature=dict(signature), constexprs=dict(constexprs),
                description=str(description), options=options)


def jit_kernels(mod) -> list[str]:
    """Names of the module's own top-level @triton.jit functions that no other one calls."""
    jits = {name: obj for name, obj in vars(mod).items()
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction")
            and getattr(getattr(obj, "fn", None), "__module__", None) == mod.__name__}
    srcs = {name: getattr(obj, "src", "") or "" for name, obj in jits.items()}
    helpers = {name for name in jits for other, src in srcs.items()
               if other != name and re.search(rf"(?<![\w.]){re.escape(_fn_name(jits[name]))}\s*\(", src)}
    return sorted(_fn_name(jits[n]) for n in jits if n not in helpers)


# ---------------------------------------------------------------------------------------------
# Worker (runs in a subprocess without TRITON_INTERPRET): compile everything, write JSON.
# ---------------------------------------------------------------------------------------------
_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[A-Za-z0-9_:]+)*)")
_VEC = re.compile(r"\.v(\d+)\.[bfsu](\d+)$")
_SCALAR = re.compile(r"\.[bfsu](\d+)$")


def ptx_access_widths(ptx: str) -> dict:
    """{"ld": {bits: count}, "st": {bits: count}} over every global load / store of the PTX."""
    out = {"ld": {}, "st": {}}
    for op, quals in _ACCESS.findall(ptx):
        m = _VEC.search(quals)
        if m:
            bits = int(m.group(1)) * int(m.group(2))
        else:
            m = _SCALAR.search(quals)
            bits = int(m.group(1)) if m else 0
        out[op][bits] = out[op].get(bits, 0) + 1
    return out


# [Note: IEEE numerics in the PTX]
# The interpreter computes every fp32 operation correctly rounded (numpy), so the GPU gives the same
# bits only if the compiled kernel does too: no contracted multiply-add (``fma`` appears only where
# ``enable_fp_fusion`` is left on: kernels launch with it off), no approximate division or square
# root (``div.full``, ``div.approx``, ``sqrt.approx``, ``rsqrt.approx``: ``tl.div_rn`` /
# ``tl.sqrt_rn`` give ``div.rn.f32`` / ``sqrt.rn.f32``), no flush of subnormals (``.ftz``), and no
# NaN-dropping float max/min (``max.f32``; torch.maximum propagates NaN: ``max.NaN.f32``).
_IEEE_VIOLATIONS = {
    "fma": re.compile(r"\bfma\.[\w.]*f(?:16|32|64)\b"),
    "approx": re.compile(r"\.approx\b"),
    "div.full": re.compile(r"\bdiv\.full\b"),
    "ftz": re.compile(r"\.ftz\b"),
    "max/min without NaN": re.compile(r"\b(?:max|min)(?:\.ftz)?\.f(?:16|32|64)\b"),
}


def ptx_ieee_counts(ptx: str) -> dict:
    """{violation: count} over the PTX's instructions (comments and directives stripped)."""
    body = "\n".join(line.split("//")[0] for line in ptx.splitlines() if not line.lstrip().startswith("."))
    counts = {name: len(rx.findall(body)) for name, rx in _IEEE_VIOLATIONS.items()}
    counts["max.NaN"] = len(re.findall(r"\b(?:max|min)\.NaN\.f32\b", body))
    return counts


_ALIGN_TEST = re.compile(r"\band\.b(?:32|64)\s+%\w+,\s*%\w+,\s*15;")


def ptx_align_tests(ptx: str) -> int:
    """How many ``x & 15`` (a 16-byte alignment test of an address) the PTX computes."""
    return len(_ALIGN_TEST.findall(ptx))


def reads_pointer_table(case: dict) -> bool:
    """The kernel takes its tensors' addresses from a table (``*_table`` arguments)."""
    return any(n.endswith("_table") and t == "*i64" for n, t in case["signature"].items())


_PTXAS_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _ptxas_report(ptx: str, capability: int, enable_fp_fusion: bool) -> dict:
    """Rerun triton's ptxas (same binary and flags as its make_cubin) with -v."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    ptxas = get_ptxas(capability).path
    arch = sm_arch_from_capability(capability)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-lineinfo", *([] if enable_fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.cubin")]
        res = subprocess.run(cmd, capture_output=True, text=True)
    log = res.stdout + res.stderr
    props, regs = _PTXAS_PROPS.search(log), _PTXAS_REGS.search(log)
    return dict(ptxas=ptxas, gpu_name=arch, returncode=res.returncode, log=log[-4000:],
                regs=int(regs.group(1)) if regs else None,
                stack=int(props.group(1)) if props else None,
                spill_stores=int(props.group(2)) if props else None,
                spill_loads=int(props.group(3)) if props else None)


def compile_case(case: dict, capability: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, sig, constexprs, opts = case["kernel"], case["signature"], case["constexprs"], case["options"]
    names = list(kernel.arg_names)
    missing = [n for n in names if n not in sig and n not in constexprs]
    extra = [n for n in list(sig) + list(constexprs) if n not in names]
    if missing or extra:
        raise ValueError(f"arguments missing from signature/constexprs: {missing}; unknown: {extra}")
    full_sig = {n: ("constexpr" if n in constexprs else sig[n]) for n in names}
    div16 = opts.get("divisible_by_16")
    if div16 is None:
        div16 = [n for n, t in sig.items() if t.startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(kernel, full_sig, constexprs, attrs)
    target = GPUTarget("cuda", capability, 32)
    options = {"num_warps": opts.get("num_warps", 4), "num_stages": opts.get("num_stages", 3)}
    for k in ("enable_fp_fusion", "maxnreg"):
        if k in opts:
            options[k] = opts[k]
    compiled = triton.compile(src, target=target, options=options)
    ptx = compiled.asm["ptx"]
    fp_fusion = getattr(compiled.metadata, "enable_fp_fusion", True)
    return dict(widths=ptx_access_widths(ptx), ieee=ptx_ieee_counts(ptx), align_tests=ptx_align_tests(ptx),
                ptxas=_ptxas_report(ptx, capability, fp_fusion),
                shared=getattr(compiled.metadata, "shared", None), fp_fusion=fp_fusion,
                target=re.search(r"\.target\s+(\S+)", ptx).group(1))


def worker(out_path: str) -> None:
    import traceback
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "the worker must run without TRITON_INTERPRET"
    report = {"modules": {}, "results": {}}
    for name in kernel_modules():
        entry = report["modules"][name] = {"error": None, "kernels": [], "covered": [], "ncases": 0}
        try:
            mod = importlib.import_module(f"zero_kernels.kernels.{name}")
            entry["kernels"] = jit_kernels(mod)
            cases = [normalize_case(c) for c in getattr(mod, "CODEGEN_CASES", [])]
        except Exception:  # noqa: BLE001
            entry["error"] = traceback.format_exc()
            continue
        entry["ncases"] = len(cases)
        entry["covered"] = sorted({_fn_name(c["kernel"]) for c in cases})
        for i, case in enumerate(cases):
            for cc in ARCHS:
                key = f"{name}:{i}:sm_{cc}"
                try:
                    report["results"][key] = dict(ok=True, **compile_case(case, cc))
                except Exception:  # noqa: BLE001
                    report["results"][key] = dict(ok=False, error=traceback.format_exc())
                report["results"][key]["table"] = reads_pointer_table(case)
                report["results"][key]["host_aligned"] = bool(case["options"].get("host_aligned"))
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    worker(sys.argv[1])
    sys.exit(0)


# ---------------------------------------------------------------------------------------------
# Tests (this process: may have TRITON_INTERPRET=1; only lists cases)
# ---------------------------------------------------------------------------------------------
import pytest  # noqa: E402

import _background  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not installed: nothing to compile")
pytestmark = pytest.mark.background


def _listed_cases() -> list[tuple[str, int, str, dict]]:
    out = []
    for name in kernel_modules():
        try:
            mod = importlib.import_module(f"zero_kernels.kernels.{name}")
        except Exception:  # noqa: BLE001  (reported by test_kernel_modules_import)
            continue
        for i, case in enumerate(getattr(mod, "CODEGEN_CASES", [])):
            try:
                c = normalize_case(case)
            except Exception:  # noqa: BLE001
                c = dict(kernel=None, description=f"invalid case {i}", options={})
            out.append((name, i, c["description"], c["options"]))
    return out


CASES = _listed_cases()


def every_case_and_arch(test):
    """Parametrize a test over (module, index, description, options) x arch."""
    test = pytest.mark.parametrize("module,index,description,options", CASES,
                                   ids=[f"{m}:{i}:{d}" for m, i, d, _ in CASES])(test)
    return pytest.mark.parametrize("arch", [f"sm_{a}" for a in ARCHS])(test)


def compiled(report, module, index, arch, description) -> dict:
    """The worker's result for one case and arch; fails the test if the compile failed."""
    r = report["results"].get(f"{module}:{index}:{arch}")
    assert r is not None, f"no compile result for {module}:{index}:{arch}"
    assert r["ok"], f"triton.compile failed for {module} case {index} ({description}) on {arch}:\n{r.get('error')}"
    return r


_REPORT_PATH: list[str] = []


def start_background(selected=()):
    """[Note: background compiles] (tests/_background.py): the worker starts right after collection."""
    if _REPORT_PATH:
        return
    _REPORT_PATH.append(os.path.join(_background.tempdir("zk_codegen_"), "report.json"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _background.start("codegen", [sys.executable, os.path.abspath(__file__), _REPORT_PATH[0]], env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def report():
    start_background()
    res = _background.result("codegen", timeout=WORKER_TIMEOUT_S)
    out = _REPORT_PATH[0]
    assert res.returncode == 0 and os.path.exists(out), (
        f"codegen worker failed (rc={res.returncode})\n{res.output[-6000:]}")
    with open(out) as f:
        return json.load(f)


def test_kernel_modules_import(report):
    errors = {m: e["error"] for m, e in report["modules"].items() if e["error"]}
    assert not errors, "\n\n".join(f"kernels/{m}.py:\n{e}" for m, e in errors.items())


def test_every_kernel_has_codegen_cases(report):
    """Each module's kernels are all covered by its CODEGEN_CASES (see the module docstring)."""
    gaps = {m: sorted(set(e["kernels"]) - set(e["covered"])) for m, e in report["modules"].items()
            if not e["error"]}
    gaps = {m: ks for m, ks in gaps.items() if ks}
    assert not gaps, ("kernels without CODEGEN_CASES entries (add (kernel, signature, constexprs, "
                      f"description[, options]) tuples to the module, see tests/test_codegen.py): {gaps}")


@every_case_and_arch
def test_codegen(report, module, index, description, options, arch):
    r = compiled(report, module, index, arch, description)
    p = r["ptxas"]
    widths = {op: {int(b): n for b, n in d.items()} for op, d in r["widths"].items()}
    wide_ld = sum(n for b, n in widths["ld"].items() if b >= 128)
    wide_st = sum(n for b, n in widths["st"].items() if b >= 128)
    print(f"\n{module}:{index} {description} [{r['target']}] regs={p['regs']} stack={p['stack']}B "
          f"spills st/ld={p['spill_stores']}/{p['spill_loads']}B shared={r['shared']}B "
          f"ld bits:count={dict(sorted(widths['ld'].items()))} st={dict(sorted(widths['st'].items()))} "
          f"fp_fusion={r['fp_fusion']} ieee={r['ieee']}")
    assert p["returncode"] == 0, f"ptxas failed:\n{p['log']}"
    assert p["spill_stores"] is not None, f"could not parse ptxas -v output:\n{p['log']}"
    max_spill = options.get("max_spill", 0)
    assert p["spill_stores"] <= max_spill and p["spill_loads"] <= max_spill, (
        f"{description} on {arch} spills: {p['spill_stores']} B stores, {p['spill_loads']} B loads, "
        f"{max_spill} allowed ({p['regs']} registers)\n{p['log']}")
    max_regs = options.get("max_regs")
    assert max_regs is None or p["regs"] <= max_regs, (
        f"{description} on {arch}: {p['regs']} registers per thread, {max_regs} allowed\n{p['log']}")
    if options.get("streaming", True):
        need_ld, need_st = options.get("min_wide_loads", 1), options.get("min_wide_stores", 1)
        assert wide_ld >= need_ld and wide_st >= need_st, (
            f"{description} on {arch}: {wide_ld} 128-bit global loads (need {need_ld}) and {wide_st} "
            f"128-bit stores (need {need_st}); access widths in bits: loads {widths['ld']}, "
            f"stores {widths['st']}. Are the pointers hinted 16-byte aligned and the block unmasked?")


def test_codegen_keeps_the_alignment_branch(report):
    """A kernel reading addresses from a pointer table decides 128-bit accesses per tensor at run time: its
    PTX must still test the addresses' alignment (``& 15``). When a hint leaks into the unaligned branch
    the two branches are the same code, the compiler drops the test, and a misaligned tensor faults
    ([Note: hints mark the defining op] in kernels/_multi_tensor.py). Cases without a table are not
    concerned: Triton specializes pointer arguments on their alignment at launch; nor are variants the
    launcher runs only for tensors it found aligned on the host (``host_aligned``)."""
    tables = {k: r for k, r in report["results"].items()
              if r.get("ok") and r.get("table") and not r.get("host_aligned")}
    assert len(tables) >= 10, f"expected the adam, adam_coded and flatten table kernels, found {sorted(tables)}"
    lost = sorted(k for k, r in tables.items() if r["align_tests"] < 1)
    assert not lost, (f"no alignment test left in the PTX of {lost}: every tensor takes the 128-bit path; make each "
                      "branch's pointers inside it (typed_pointer / offset_pointer in kernels/_multi_tensor.py)")


@every_case_and_arch
def test_codegen_ieee_numerics(report, module, index, description, options, arch):
    """The interpreter's bits are the GPU's bits ([Note: IEEE numerics in the PTX])."""
    r = compiled(report, module, index, arch, description)
    bad = {k: n for k, n in r["ieee"].items() if n and k != "max.NaN"}
    assert not bad, (f"{description} on {arch}: non-IEEE instructions in the PTX {bad} (fp_fusion="
                     f"{r['fp_fusion']}); launch with enable_fp_fusion=False and use tl.div_rn / "
                     f"tl.sqrt_rn / tl.maximum(..., propagate_nan=tl.PropagateNan.ALL)")


@every_case_and_arch
def test_codegen_no_shared_memory(report, module, index, description, options, arch):
    """Streaming kernels need no shared memory: any is a layout conversion (a register round trip
    through shared memory between loads and stores of different widths)."""
    r = compiled(report, module, index, arch, description)
    limit = options.get("max_shared", 0)
    assert r["shared"] <= limit, (f"{description} on {arch} uses {r['shared']} B of shared memory (allowed "
                                  f"{limit}): give every load and store the same elements per thread")


def test_every_case_streams():
    """Every launch of every kernel can use 128-bit accesses: alignment is decided per tensor inside
    the kernel, so there is no 'unaligned' variant compiled to scalar code only."""
    scalar_only = [f"{m}:{i}:{d}" for m, i, d, o in CASES if not o.get("streaming", True)]
    assert not scalar_only, f"variants compiled without 128-bit accesses: {scalar_only}"


def test_ieee_parser():
    """What counts as non-IEEE (no compile involved); negative control for the PTX checks."""
    ptx = """
        .visible .entry k(  // fma.rn.f32 in a comment is ignored
        fma.rn.f32 %f3, %f1, %f2, %f0;
        div.full.f32 %f4, %f1, %f2;
        sqrt.approx.ftz.f32 %f5, %f4;
        max.f32 %f6, %f5, %f4;
        max.NaN.f32 %f7, %f5, %f4;
        div.rn.f32 %f8, %f1, %f2;
        sqrt.rn.f32 %f9, %f8;
        mad.lo.s32 %r1, %r2, %r3, %r4;
        max.s32 %r5, %r1, %r2;
    """
    assert ptx_ieee_counts(ptx) == {"fma": 1, "approx": 1, "div.full": 1, "ftz": 1,
                                    "max/min without NaN": 1, "max.NaN": 1}


def test_widths_parser():
    """What counts as 128-bit (no GPU or triton compile involved)."""
    ptx = """
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        ld.global.L1::evict_last.v2.b64 { %rd5, %rd6 }, [ %rd2 ];
        ld.global.nc.b16 %rs1, [ %rd3 ];
        st.global.v4.b32 [ %rd4 + 0 ], { %r1, %r2, %r3, %r4 };
        st.global.v2.b32 [ %rd4 + 0 ], { %r1, %r2 };
        st.global.b32 [ %rd4 + 0 ], %r1;
    """
    w = ptx_access_widths(ptx)
    assert w == {"ld": {128: 2, 16: 1}, "st": {128: 1, 64: 1, 32: 1}}
