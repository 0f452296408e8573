"""A level-1 hit runs the compiled graphs through our own autograd wrapper (``aot/wrappers.py``):
its backward must treat what the forward saved as AOTAutograd's does, on a hit as on a miss."""

from __future__ import annotations

import pytest
import torch


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _loss(model: torch.nn.Module, x: torch.Tensor, hit: bool, counters) -> torch.Tensor:
    """The loss through a fresh Dynamo, compiled whole (the graph's backward is the only one):
    the first call misses the cache, a second one hits level 1."""
    torch._dynamo.reset()
    loss = torch.compile(lambda x: model(x).square().mean(), backend="cgtrees")(x)
    assert counters["cache_hit_aot"] == (1 if hit else 0), dict(counters)
    return loss


@pytest.mark.parametrize("hit", [False, True], ids=["miss", "hit"])
def test_a_second_backward_without_retain_graph_raises_as_eager(hit, cgtrees_counters):
    """What the forward saved is gone after a backward that keeps no graph: a second backward
    through the same graph raises, as eager's does. (That the backward releases it before its
    graph runs, so that a CUDA graph frees it at its last read, is a GPU test:
    ``test_runtime_memory.py::test_cache_hit_hands_the_activations_to_the_backward``.)"""
    model, x = _model(), torch.randn(5, 8)
    if hit:
        _loss(model, x, False, cgtrees_counters).backward()
    loss = _loss(model, x, hit, cgtrees_counters)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


@pytest.mark.parametrize("hit", [False, True], ids=["miss", "hit"])
def test_retain_graph_keeps_the_saved_activations(hit, cgtrees_counters):
    """With ``retain_graph=True`` the backward releases nothing: a second one reads the same saved
    activations, and the two accumulate eager's gradients twice."""
    model, x = _model(), torch.randn(5, 8)
    model(x).square().mean().backward()
    expected = [2 * p.grad for p in model.parameters()]
    if hit:
        _loss(model, x, False, cgtrees_counters).backward()
    model.zero_grad(set_to_none=True)
    loss = _loss(model, x, hit, cgtrees_counters)
    loss.backward(retain_graph=True)
    loss.backward()
    for p, want in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, want)
