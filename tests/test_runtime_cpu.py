"""The runtime on CPU (CI): skips explained and counted once per function, describe(), options."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn

import backend
import backend.runtime as runtime
from backend.codegen.module import GraphFacts
from backend.config import Config
from backend.context import GraphContext
from backend.runtime import compat
from backend.runtime.function import _changing_dims


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_cpu_inputs_skip_counted_per_function_logged_once_at_info(cgtrees_counters, caplog):
    model = _model()
    f = torch.compile(model, backend="cgtrees")
    with caplog.at_level(logging.INFO, logger="backend"):
        for _ in range(3):
            x = torch.randn(4, 8)
            f(x).sum().backward()  # forward + backward: two functions
        with torch.no_grad():
            for _ in range(3):
                f(torch.randn(4, 8))  # inference: a third
    assert cgtrees_counters["cudagraph_skips"] == 3
    cpu = [r for r in caplog.records if "CPU inputs" in r.getMessage()]
    assert len(cpu) == 1 and cpu[0].levelno == logging.INFO, [r.getMessage() for r in cpu]
    assert cgtrees_counters["cudagraph_replayed"] == 0


def test_describe_names_skipped_functions():
    f = torch.compile(_model(), backend="cgtrees")
    with torch.no_grad():
        f(torch.randn(2, 8))
    text = runtime.describe()
    assert "_inference: no CUDA graphs: CPU inputs" in text, text
    backend.reset()
    assert runtime.describe() == "no CUDA graph trees"


def test_cudagraphs_option_off_counts_no_skip(cgtrees_counters):
    f = torch.compile(_model(), backend="cgtrees", options={"cudagraphs": False})
    with torch.no_grad():
        f(torch.randn(2, 8))
    assert cgtrees_counters["cudagraph_skips"] == 0


def test_wrap_returns_call_for_cpu_inputs(cgtrees_counters):
    def call(args):
        return [args[0] * 2]

    module = SimpleNamespace(call=call, facts=GraphFacts(), source=None)  # a hand-made CompiledModule
    ctx = GraphContext(config=Config.resolve(), kind="inference", name="hand_made")
    assert runtime.wrap(module, [torch.ones(2)], ctx) is call
    assert cgtrees_counters["cudagraph_skips"] == 1
    off = GraphContext(config=Config.resolve(options={"cudagraphs": False}), kind="inference", name="off")
    assert runtime.wrap(module, [torch.ones(2)], off) is call


def test_compat_on_a_cpu_build():
    report = compat.report()
    assert "_cuda_getCheckpointState" in report
    if not torch.cuda.is_available():
        assert not compat.supported()
    assert isinstance(compat.mark_step_counter(), int)


def test_mark_step_counter_does_not_import_inductor_trees():
    code = ("import sys, torch\nfrom backend.runtime import compat\ncompat.mark_step_counter()\n"
            "print('torch._inductor.cudagraph_trees' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_changing_dimension_is_named():
    keys = [(2, (2, 32), (64, 32)), (3, (3, 32), (64, 32)), (4, (4, 32), (64, 32))]
    text = _changing_dims(keys)
    assert "input 1 dimension 0" in text and "input 0" in text
    assert "input 2" not in text
