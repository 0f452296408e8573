"""R6 on a GPU: a static input (parameter) at a new address re-records or runs right, never replays
stale addresses (issue 17: `weight.data = ...` after three calls gave other values than eager)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import cgtrees.runtime as runtime

DEV = "cuda"
pytestmark = pytest.mark.usefixtures("kernel_modules")
GRAD = pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])


def linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16)).to(DEV).eval()


def stat(key: str) -> int:
    return counters["cgtrees"][key]


def _check(f, model, x) -> None:
    out = f(x)
    torch.testing.assert_close(out, model(x), msg=lambda m: f"{m}\n{runtime.describe()}")


def _replace(model: nn.Module, how: str) -> None:
    new = torch.randn_like(model[0].weight) * 0.1
    if how == "data":
        model[0].weight.data = new
    else:
        model[0].weight = nn.Parameter(new)


@GRAD
@pytest.mark.parametrize("how", ["data", "parameter"])
def test_replaced_parameter_gives_eager_values(grad, how):
    """Three calls, an in-place update (same address), then a new address for the same parameter."""
    model = linears()
    f = torch.compile(model, backend="cgtrees")
    x = torch.randn(8, 64, device=DEV)
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            _check(f, model, x)
        with torch.no_grad():
            model[0].weight.add_(0.5)
        _check(f, model, x)
        _replace(model, how)
        for _ in range(4):
            _check(f, model, x)
        replayed = stat("cudagraph_replayed")
        _check(f, model, x)
    assert stat("cudagraph_replayed") == replayed + 1, runtime.describe()  # re-recorded, replays again
    assert stat("cudagraph_skips") == 0, runtime.describe()


@GRAD
def test_replaced_parameter_kept_output(grad):
    """The previous output is still held (a loop variable) when the parameter moves."""
    model = linears()
    f = torch.compile(model, backend="cgtrees")
    x = torch.randn(8, 64, device=DEV)
    y = None
    with torch.set_grad_enabled(grad):
        for i in range(8):
            if i == 4:
                _replace(model, "data")
            y = f(x)
            torch.testing.assert_close(y, model(x), msg=lambda m: f"{m}\n{runtime.describe()}")


def test_replaced_parameter_training_gradients():
    """Forward and backward both read the moved weight: gradients and outputs stay eager's."""
    model, ref = linears().train(), linears().train()
    f = torch.compile(model, backend="cgtrees")
    for step in range(6):
        if step == 3:
            new = torch.randn_like(model[0].weight) * 0.1
            model[0].weight.data = new
            ref[0].weight.data = new.clone()
        x = torch.randn(8, 64, device=DEV)
        out, expected = f(x), ref(x)
        torch.testing.assert_close(out, expected)
        out.square().mean().backward()
        expected.square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{m}\n{runtime.describe()}")
            p.grad = q.grad = None


def test_static_input_moving_every_call_is_copied():
    """A parameter at a new address at every call (FSDP2 gathers its parameters anew each step):
    once a re-recording never replayed either, the parameter is copied into the graph's slot, and
    the function replays, right, without counting more re-records."""
    model = linears()
    f = torch.compile(model, backend="cgtrees", options={"max_rerecords_per_function": 2})
    x = torch.randn(8, 64, device=DEV)
    kept = []  # every old weight stays allocated: each call sees a new address
    with torch.no_grad():
        for _ in range(10):
            kept.append(model[0].weight.data)
            _replace(model, "data")
            _check(f, model, x)
    text = runtime.describe()
    assert stat("cudagraph_skips") == 0 and stat("cudagraph_recorded") == 3, text
    assert stat("cudagraph_replayed") == 10 - 1 - 3, text
    assert re.search(r"inputs \[\d+\] copied after they moved", text), text


def test_static_input_moving_now_and_then_gives_up_right():
    """A parameter replaced every other call: each recording replays once, so it stays a static
    input, and past max_rerecords_per_function the function runs without graphs, still right."""
    model = linears()
    f = torch.compile(model, backend="cgtrees", options={"max_rerecords_per_function": 2})
    x = torch.randn(8, 64, device=DEV)
    kept = []
    with torch.no_grad():
        for i in range(12):
            if i % 2:
                kept.append(model[0].weight.data)
                _replace(model, "data")
            _check(f, model, x)
    assert stat("cudagraph_skips") == 1, runtime.describe()
