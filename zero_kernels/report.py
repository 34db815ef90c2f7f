"""``python -m zero_kernels.report``: what this installation can run, and why not (as ``ds_report`` and
``torch.utils.collect_env`` are to their users). Paste its output into a bug report.

    python -m zero_kernels.report             # human-readable table
    python -m zero_kernels.report --json      # the same facts as JSON
    python -m zero_kernels.report --no-compile   # skip the Triton ahead-of-time compile probe (a few s)

It reports: Python, torch (and its CUDA), Triton and numpy versions; the C++ extension (installed at
build time, JIT-built, or missing and why) and the SIMD path the CPU kernel dispatches to on this CPU;
the CUDA kernel and the architectures it was built for; which GPU targets Triton can compile for; which
fused-Adam backend ``backend="auto"`` picks on each device and why each other one cannot run; and the
``torch.distributed`` process-group backends usable here.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from typing import Any

import torch

from . import __version__, _build, _ext, backends
from ._cli import until_reader_leaves

__all__ = ["collect", "main"]

# Compiled in a subprocess (the probe must not run in Triton's interpreter, which TRITON_INTERPRET=1 selects).
_TRITON_PROBE = r"""
import json, sys, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def _probe(x, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < n) * 2.0, mask=offs < n)

out = {}
for cc in (80, 90):
    try:
        src = ASTSource(fn=_probe, signature={"x": "*fp32", "n": "i32"}, constexprs={"BLOCK": 128})
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32))
        out[f"sm_{cc}"] = "ok" if "ld.global" in k.asm["ptx"] else "compiled, but no global load in the PTX"
    except Exception as e:  # noqa: BLE001 - reported, not raised
        out[f"sm_{cc}"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}"
print(json.dumps(out))
"""


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512_bf16") if x in have]
    except OSError:
        pass
    return []


def _extension() -> dict[str, Any]:
    try:
        mod = _ext.cpu_module()
    except ValueError as e:     # a variable the kernel reads itself is not understood (_env): a finding here
        return {"loaded": False, "why": str(e), "fix": "correct or unset that environment variable"}
    if mod is None:
        return {"loaded": False, "why": _ext.load_error(),
                "fix": "pip install --no-build-isolation . with a C++ compiler and ninja (see README), "
                       "or leave ZERO_KERNELS_NO_JIT unset so it JIT-builds on first use"}
    origin = "installed (built by pip)" if mod.__name__ == _build.EXT_NAME else "JIT-built (torch extensions cache)"
    info = {"loaded": True, "module": mod.__name__, "origin": origin, "file": getattr(mod, "__file__", None),
            "cpu_simd_path": mod.cpu_isa() if hasattr(mod, "cpu_isa") else "unknown",
            "cuda_kernel": hasattr(mod, "fused_adam_cuda")}
    if os.environ.get("ZERO_KERNELS_CPU_ISA"):
        info["cpu_simd_cap"] = os.environ["ZERO_KERNELS_CPU_ISA"] + " (ZERO_KERNELS_CPU_ISA)"
    return info


def _triton(compile_probe: bool) -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        return {"installed": False, "fix": "pip install triton (CUDA GPUs; on CPU only the interpreter runs it)"}
    import triton
    info: dict[str, Any] = {"installed": True, "version": triton.__version__,
                            "interpreter": backends.triton_interpret()}
    if compile_probe:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        try:  # @triton.jit reads its function's source: the probe must be a file
            with tempfile.TemporaryDirectory() as d:
                probe = os.path.join(d, "zk_triton_probe.py")
                with open(probe, "w") as f:
                    f.write(_TRITON_PROBE)
                r = subprocess.run([sys.executable, probe], env=env, capture_output=True, text=True, timeout=300)
            info["compiles_for"] = (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0
                                    else {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][:300]})
        except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
            info["compiles_for"] = {"error": f"{type(e).__name__}: {e}"}
    return info


def _backends() -> dict[str, Any]:
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if torch.cuda.is_available() else [])
    out = {}
    for dev in devices:
        try:
            why = {name: backends.why_unavailable(name, dev) for name in backends.BACKENDS if name != "auto"}
            auto = backends.resolve("auto", dev)
        except ValueError as e:  # a mis-set environment variable (_env), reported under "extension" too
            out[str(dev)] = {"error": str(e)}
            continue
        out[str(dev)] = {"auto": auto, "available": [n for n, w in why.items() if w is None],
                         "unavailable": {n: w for n, w in why.items() if w is not None}}
    if not torch.cuda.is_available():
        out["cuda"] = {"unavailable": "no CUDA device visible to torch "
                       f"(torch {'has no CUDA' if torch.version.cuda is None else 'built for CUDA ' + torch.version.cuda})"}
    return out


def _distributed() -> dict[str, Any]:
    import torch.distributed as dist
    if not dist.is_available():
        return {"available": False}
    usable = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    notes = {}
    if usable["nccl"] and not torch.cuda.is_available():
        usable["nccl"] = False
        notes["nccl"] = "built in, but no CUDA device: NCCL takes only CUDA tensors"
    return {"available": True, "backends": usable, "notes": notes}


def collect(compile_probe: bool = True) -> dict[str, Any]:
    """Every fact the report prints, as a dict (what ``--json`` writes)."""
    cuda = {"torch_built_with": torch.version.cuda, "available": torch.cuda.is_available(),
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [],
            "nvcc_flags": list(_build.NVCC_FLAGS)}
    return {
        "zero_kernels": {"version": __version__, "file": os.path.dirname(os.path.abspath(__file__))},
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "numpy": _version_of("numpy"),
        "cpu": {"machine": platform.machine(), "simd_flags": _cpu_flags(), "threads": torch.get_num_threads()},
        "extension": _extension(), "cuda": cuda, "triton": _triton(compile_probe),
        "backends": _backends(), "distributed": _distributed(),
    }


def _version_of(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # noqa: BLE001
        return None


def _lines(d: dict[str, Any], indent: int = 0) -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out.append(" " * indent + f"{k}:")
            out.extend(_lines(v, indent + 2))
        else:
            out.append(" " * indent + f"{k}: {', '.join(map(str, v)) if isinstance(v, list) else v}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zero_kernels.report",
                                 description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--no-compile", action="store_true", help="skip the Triton ahead-of-time compile probe")
    args = ap.parse_args(argv)
    facts = collect(compile_probe=not args.no_compile)

    def show() -> int:
        print(json.dumps(facts, indent=2) if args.json else "\n".join(_lines(facts)))
        return 0
    return until_reader_leaves(show)      # `report | head`


if __name__ == "__main__":
    sys.exit(main())
