"""GPU tier: every test here needs CUDA and is skipped cleanly without it."""

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

    import backend

    backend.reset()
    counters["cgtrees"].clear()
    yield
    backend.reset()
    torch._dynamo.reset()


@pytest.fixture
def aten_kernels(monkeypatch):
    """Runtime tests run the aten graphs as kernel modules (codegen's placeholder behaviour), so a
    codegen bug cannot hide a runtime result; CGTREES_RUNTIME_TESTS_CODEGEN=1 keeps real codegen."""
    import os

    monkeypatch.setenv("CGTREES_CACHE", "0")
    if os.environ.get("CGTREES_RUNTIME_TESTS_CODEGEN") == "1":
        return
    from backend import codegen

    monkeypatch.setattr(codegen, "compile_graph", lambda gm, example_inputs, ctx: codegen.AtenModule(gm))
