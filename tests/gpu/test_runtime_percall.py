"""Per-call cost independent of what ran before (issue 17): mlp_small inference, measured in a fresh
process after a dozen other compiled functions ran in it (inference, training, dynamic shapes, a
graph break, two threads, several models, ``torch._dynamo.reset()``), against the raw CUDA graph of
the same model in the same process. The figure is ``percall_mlp_small.py --history``'s."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("percall_mlp_small.py")
TARGET = 1.25


def _ratio(*flags: str) -> tuple[float, str]:
    env = {**os.environ, "CGTREES_CACHE": "0"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.search(r"cgtrees/raw_graph = ([0-9.]+)", proc.stdout)
    assert found, proc.stdout
    return float(found.group(1)), proc.stdout


@pytest.mark.timing
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["default", "aten"])
def test_per_call_after_history_within_target(path):
    """The best of three fresh processes (each figure a median of windows): the host of the GPU
    machine is shared, and a pytest-xdist run beside it slows every host-bound path (1.59x once
    in a ``-n 6`` run, 1.04-1.23x alone, the same day). Run it alone for a figure to quote.
    ``default``: as a user runs it (generated kernels, default options; issue 44 found it 4.8x
    the raw graph where the aten path was 1.02x: a float32 addmm turned into a slower mm).
    ``aten``: the runtime's own cost (the modules are the aten graphs)."""
    flags = ("--history",) if path == "default" else ("--history", "--aten")
    runs = [_ratio(*flags) for _ in range(3)]
    ratio, text = min(runs)
    print(text)
    assert ratio <= TARGET, f"mlp_small per call ({path} path) {ratio:.2f}x the raw graph after history " \
                            f"(target {TARGET})\n{text}"
