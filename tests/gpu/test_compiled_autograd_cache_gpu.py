"""Compiled autograd's graphs from the cache on CUDA (issues 19 and 20): a warm process loads the
forward and the backward graphs from level 1 (their kernel modules from level 2), and they still
run in CUDA graphs, replayed, with eager's gradients over SGD steps, accumulation and hooks; the
forward's entry, written under compiled autograd, also serves a plain ``backward()``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from ca_warm_helpers import check_both_match_eager, check_cold_and_warm, cold_and_warm  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_warm_process_replays_compiled_autograd_backward_from_the_cache(tmp_path):
    cold, warm = cold_and_warm(tmp_path, "cuda")
    check_cold_and_warm(cold, warm, tolerance=1e-4)  # GPU kernels reassociate float32 sums
    for run in (cold, warm):
        assert run["counters"].get("cudagraph_skips", 0) == 0, run["counters"]
        assert run["counters"].get("cudagraph_replayed", 0) > 0, run["counters"]
        assert len(run["backward"]) == 2, run  # as on the CPU: replays hand it the same saved tensors


def test_warm_plain_backward_through_an_entry_written_under_compiled_autograd(tmp_path):
    cold, warm = cold_and_warm(tmp_path, "cuda", enable=("config", "plain"))
    check_both_match_eager(cold, warm, tolerance=1e-4)
    assert warm["aot_hits"] == ["g0"] and warm["calls"]["aot"] == 0, warm  # the backward: from its graph
    assert warm["counters"].get("cudagraph_skips", 0) == 0, warm["counters"]
    assert warm["counters"].get("cudagraph_replayed", 0) > 0, warm["counters"]
