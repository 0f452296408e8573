"""The precompile API on CUDA (issue 19): a function compiled with ``aot_compile`` and saved in one
process, loaded in another with an empty cache, runs with no AOT trace and no codegen (kernels
launch from the saved binaries), records CUDA graphs on its first calls there, and gives the saving
process's outputs and gradients, also after the weights changed. The load-and-first-call time
against compile-and-first-call is printed for the record (it is asserted on the CPU, in aten mode:
tests/test_precompile.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from test_precompile import _run, snapshot  # noqa: E402,F401 - the fixture is used by name

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")


def test_saved_function_loads_with_cuda_graphs_and_no_compile(snapshot, tmp_path):  # noqa: F811
    first = _run(snapshot, tmp_path / "cache", False, role="save", dir=str(tmp_path), device="cuda")
    assert first["error_vs_eager"] < 1e-5
    assert first["calls"]["aot"] == 3 and first["calls"]["generate"] > 0
    loaded = _run(snapshot, tmp_path / "empty-cache", False, role="load", dir=str(tmp_path), device="cuda")
    assert loaded["calls"] == {"aot": 0, "generate": 0}, loaded  # no AOT trace, no codegen
    assert loaded["counters"]["kernels_generated"] == 0 and loaded["counters"]["graphs_compiled"] == 0
    assert loaded["counters"]["precompile_loaded"] == 2
    assert loaded["counters"]["cudagraph_skips"] == 0
    assert loaded["counters"]["cudagraph_recorded"] >= 2 and loaded["counters"]["cudagraph_replayed"] >= 1, loaded
    assert loaded["error_vs_eager"] < 1e-5
    assert loaded["error_after_new_weights"] < 1e-5
    a, b = torch.load(tmp_path / "saved.pt"), torch.load(tmp_path / "loaded.pt")
    torch.testing.assert_close(b["out"], a["out"], rtol=0, atol=0)
    torch.testing.assert_close(b["inference"], a["inference"], rtol=0, atol=0)
    for x, y in zip(a["grads"], b["grads"], strict=True):
        torch.testing.assert_close(y, x, rtol=0, atol=0)
    print(f"\nprecompile on CUDA: compile + first call {first['compile_first_s']:.3f} s, load + first call "
          f"{loaded['load_first_s']:.3f} s ({loaded['load_first_s'] / first['compile_first_s']:.3f}x); "
          f"counters after load {loaded['counters']}")
