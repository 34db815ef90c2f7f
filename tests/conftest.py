"""Test-wide setup. TRITON_INTERPRET must be set before anything imports triton: the Triton kernels
run on CPU tensors in the interpreter here (no GPU), and they are the code under test."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from zero_kernels import backends  # noqa: E402


def available_backends() -> list:
    """Every concrete backend this machine can run on CPU tensors. ``cpu`` must be present when
    ZK_REQUIRE_CPU=1 (CI): a missing build is then a failure, not a skip."""
    out = []
    for name in ("reference", "triton", "cpu"):
        why = backends.why_unavailable(name, torch.device("cpu"))
        if why is None:
            out.append(pytest.param(name, id=name))
        elif name == "cpu" and os.environ.get("ZK_REQUIRE_CPU") == "1":
            raise RuntimeError(f"ZK_REQUIRE_CPU=1 but the cpu backend is unavailable: {why}")
        else:
            out.append(pytest.param(name, id=name, marks=pytest.mark.skip(reason=f"{name}: {why}")))
    return out


BACKENDS = available_backends()


def _check_installed() -> None:
    """ZK_REQUIRE_INSTALLED=1 (CI tests the built wheel): the package under test must be the installed one,
    with its prebuilt extension, never the source tree that the checkout would put first on sys.path."""
    if os.environ.get("ZK_REQUIRE_INSTALLED") != "1":
        return
    import zero_kernels
    from zero_kernels import _ext
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.abspath(zero_kernels.__file__)
    if here == os.path.join(root, "zero_kernels", "__init__.py"):
        raise RuntimeError(f"ZK_REQUIRE_INSTALLED=1 but zero_kernels was imported from the checkout ({here}); "
                           "run with PYTHONSAFEPATH=1 from the installed environment")
    mod = _ext.cpu_module()
    if mod is None or mod.__name__ != "zero_kernels._C":
        raise RuntimeError("ZK_REQUIRE_INSTALLED=1 but the installed wheel's extension zero_kernels._C did not "
                           f"load (got {getattr(mod, '__name__', None)}: {_ext.load_error()})")


_check_installed()


def pytest_configure(config):
    # Timing and resident-memory assertions depend on machine load: CI runs them as a separate
    # pytest invocation (`-m perf`) after the functional suite (`-m "not perf"`).
    config.addinivalue_line("markers", "perf: timing or resident-memory assertion (run with -m perf)")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped with a reason without one)")
    config.addinivalue_line("markers", "background: waits on a compile started after collection (runs last; "
                                       "[Note: background compiles] in tests/_background.py)")


def pytest_collection_modifyitems(config, items):
    """[Note: background compiles]: the tests that wait on a background compile run last (stable otherwise)."""
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)


def pytest_collection_finish(session):
    """[Note: background compiles] (tests/_background.py): each selected module's ``start_background``."""
    selected = {}
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and hasattr(mod, "start_background"):
            selected.setdefault(mod, set()).add(getattr(item, "originalname", None) or item.name)
    for mod, names in selected.items():
        mod.start_background(names)


def pytest_terminal_summary(terminalreporter):
    """Worlds of tests/_dist.py spawned instead of forked (slower, not wrong), with the variables that changed."""
    import _dist
    if _dist.SPAWNED:
        terminalreporter.write_line(f"{len(_dist.SPAWNED)} gloo world(s) spawned instead of forked (~3 s more each) "
                                    "because these environment variables changed since the first world:")
        for test, changed in _dist.SPAWNED[:20]:
            terminalreporter.write_line(f"  {test}: {', '.join(changed)}")


def pytest_sessionfinish(session, exitstatus):
    import _background
    _background.stop_all()
