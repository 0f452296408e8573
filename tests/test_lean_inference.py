"""Inference graphs run in our own wrapper, not AOTAutograd's, also on a cache miss (issue 17: its
runtime wrappers cost ~20 us a call). Where AOTAutograd's wrappers do something ours does not
(outputs that alias an input, subclasses, merged inputs), they stay; either way eager's results."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from cgtrees.aot import wrappers


@pytest.fixture
def ours(monkeypatch):
    """How many inference functions our wrapper made."""
    made = []
    real = wrappers.inference_function

    def spy(call, plan):
        made.append(plan)
        return real(call, plan)

    monkeypatch.setattr(wrappers, "inference_function", spy)
    return made


@pytest.mark.parametrize("cache", ["0", "1"])
def test_plain_inference_graph_runs_in_our_wrapper(ours, monkeypatch, cgtrees_counters, cache):
    monkeypatch.setenv("CGTREES_CACHE", cache)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    f = torch.compile(model, backend="cgtrees")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 8)
            torch.testing.assert_close(f(x), model(x))
    assert len(ours) == 1
    assert cgtrees_counters["graph_fallbacks"] == 0


def test_no_output_requires_grad_records_no_history(ours):
    """Inputs that require grad, grad mode on, no output requiring grad: AOTAutograd makes an
    inference graph, and its aten calls must not record autograd history."""
    w = torch.randn(8, 4, requires_grad=True)

    def fn(x):
        return (x @ w).detach().relu(), (x @ w).argmax(-1)

    f = torch.compile(fn, backend="cgtrees")
    x = torch.randn(3, 8)
    got, want = f(x), fn(x)
    assert len(ours) == 1
    for g, e in zip(got, want):
        assert not g.requires_grad and g.grad_fn is None
        torch.testing.assert_close(g, e)


def test_input_mutation_bumps_version(ours):
    def fn(x):
        x.mul_(2)
        return x.sum(0)

    f = torch.compile(fn, backend="cgtrees")
    x = torch.randn(4, 3)
    y = x.clone()
    before = x._version
    with torch.no_grad():
        out = f(x)
    torch.testing.assert_close(out, fn(y))
    torch.testing.assert_close(x, y)
    assert x._version > before
    assert len(ours) == 1


def test_output_aliasing_an_input_is_a_view_of_it_in_our_wrapper(ours):
    """Our wrapper returns the module's view, which the runtime builds over the caller's input (as
    AOTAutograd's wrapper regenerates it): the first cache level keeps such graphs (issue 46)."""
    def fn(x):
        return x.view(-1)[:5], x.sin()

    f = torch.compile(fn, backend="cgtrees")
    x = torch.randn(4, 3)
    want = x.sin()
    with torch.no_grad():
        view, s = f(x)
    torch.testing.assert_close(s, want)
    assert view.data_ptr() == x.data_ptr() and view._base is x  # a view of the input, as in eager
    x[0, 0] = 7.0
    assert view[0].item() == 7.0
    assert len(ours) == 1
