import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory, monkeypatch):
    """Every test compiles into a cache of its own: no hit left by another test (or by a user's cache)."""
    monkeypatch.setenv("CGTREES_CACHE_DIR", str(tmp_path_factory.mktemp("cgtrees_cache")))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """A clean Dynamo and the same random inputs on every run: a test that fails, fails again."""
    import torch

    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def cgtrees_counters():
    """The cgtrees counters, cleared before the test."""
    from torch._dynamo.utils import counters

    counters["cgtrees"].clear()
    return counters["cgtrees"]
