"""Training graphs run in our own wrapper on a cache miss too, the one a level-1 hit builds
(``aot.rebuild.lean_training``): a cold process's calls then cost what a warm one's do. Its backward
is compiled at the first ``backward()``, as AOTAutograd's would be. Where level 1 does not take the
graph (cache off, outputs that alias an input), AOTAutograd's function stays; eager's results and
gradients either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from cgtrees.aot import wrappers


@pytest.fixture
def ours(monkeypatch):
    """The plans of the training functions our wrapper made."""
    made = []
    real = wrappers.training_function

    def spy(forward, backward, plan, detach, aot_attributes=None):
        made.append(plan)
        return real(forward, backward, plan, detach, aot_attributes)

    monkeypatch.setattr(wrappers, "training_function", spy)
    return made


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def _steps(model, f, steps=3):
    """Per step: the compiled and eager loss, output and every parameter's gradient."""
    ref = _model()
    ref.load_state_dict(model.state_dict())
    for step in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        got, want = f(x), ref(x)
        torch.testing.assert_close(got, want)
        got.square().sum().backward()
        want.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")
            p.grad = q.grad = None
    return got


def test_training_graph_on_a_miss_runs_in_our_wrapper(ours, monkeypatch, cgtrees_counters):
    monkeypatch.setenv("CGTREES_CACHE", "1")
    model = _model()
    out = _steps(model, torch.compile(model, backend="cgtrees"))
    assert len(ours) == 1, "one Dynamo graph, one wrapper of ours"
    assert type(out.grad_fn).__name__ == "CachedCompiledFunctionBackward"
    assert cgtrees_counters["graph_fallbacks"] == 0


def test_a_second_backward_raises_and_retain_graph_works_on_a_miss(ours, monkeypatch):
    monkeypatch.setenv("CGTREES_CACHE", "1")
    model = _model()
    f = torch.compile(model, backend="cgtrees")
    x = torch.randn(5, 8)
    loss = f(x).square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()  # retained: the same gradients again, accumulated
    for p, g in zip(model.parameters(), first):
        torch.testing.assert_close(p.grad, 2 * g)
    loss = f(x).square().sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    assert len(ours) == 1


def test_cache_off_keeps_aotautograds_function(ours, monkeypatch):
    monkeypatch.setenv("CGTREES_CACHE", "0")
    model = _model()
    out = _steps(model, torch.compile(model, backend="cgtrees"))
    assert not ours
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward"


def test_output_aliasing_an_input_keeps_aotautograds_function(ours, monkeypatch):
    monkeypatch.setenv("CGTREES_CACHE", "1")
    w = torch.randn(4, 4, requires_grad=True)

    def fn(x):
        return x.view(-1), (x @ w).sin()

    f = torch.compile(fn, backend="cgtrees")
    x = torch.randn(3, 4, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    got, want = f(x), fn(y)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    sum(t.sum() for t in got).backward()
    sum(t.sum() for t in want).backward()
    torch.testing.assert_close(x.grad, y.grad)
    assert not ours
