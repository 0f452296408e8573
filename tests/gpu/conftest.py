"""GPU tier: every test here needs CUDA and is skipped cleanly without it."""

import re

import pytest
import torch

collect_ignore = ["percall_mlp_small.py"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    marker = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(marker)


@pytest.fixture(autouse=True)
def _fresh_runtime():
    """Each test starts and ends with no trees, counters cleared."""
    if not torch.cuda.is_available():
        yield
        return
    from torch._dynamo.utils import counters

    import cgtrees

    cgtrees.reset()
    counters["cgtrees"].clear()
    yield
    cgtrees.reset()
    torch._dynamo.reset()


@pytest.fixture
def no_tf32():
    """Full float32 convolutions and matrix products in eager and compiled alike (TF32's 1e-3 would
    hide a wrong value)."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    old = matmul.allow_tf32
    matmul.allow_tf32 = False
    # through flags(): torch's test utilities, imported by other test modules of this process,
    # forbid setting cuDNN's flags directly (disable_global_flags)
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        yield
    matmul.allow_tf32 = old


@pytest.fixture(params=["aten", "codegen"])
def kernel_modules(request, monkeypatch):
    """Every runtime test runs twice: with the aten graphs as kernel modules (codegen's placeholder
    behaviour, so a codegen bug cannot hide a runtime result) and with our generated modules (the
    path users take). The cache is off, so each test compiles what it runs."""
    monkeypatch.setenv("CGTREES_CACHE", "0")
    if request.param == "codegen":
        return
    from cgtrees import codegen

    monkeypatch.setattr(codegen, "compile_graph", lambda gm, example_inputs, ctx: codegen.AtenModule(gm))


_RATIO = re.compile(r"\d\.\d+x\b")
_MEASURED: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    """Keep what a passing timing test printed where it holds a ratio ("1.03x"): pytest shows a
    passing test's output nowhere, and the GPU timing logs must record the ratios they measured."""
    if report.when == "call" and report.passed:
        lines = [line for line in report.capstdout.splitlines() if _RATIO.search(line)]
        if lines:
            _MEASURED.append((report.nodeid, "\n".join(lines)))


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section(f"ratios measured by {len(_MEASURED)} passing tests", sep="-")
        for nodeid, lines in _MEASURED:
            terminalreporter.write_line(f"{nodeid}:")
            for line in lines.splitlines():
                terminalreporter.write_line(f"  {line.strip()}")
