"""Graphs with no CUDA tensor run as Dynamo captured them (``cgtrees.aot.as_captured``, issue 54,
item 4): eager's ops, so eager's outputs and gradients to the bit, counted and explained; the
pipeline still runs where it is asked for (``cpu_pipeline``, ``interpret``)."""

from __future__ import annotations

import logging

import pytest
import torch

from cgtrees.aot import as_captured
from cgtrees.config import Config

pytestmark = pytest.mark.cpu_default


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(23)
        self.fc = torch.nn.Linear(23, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(self.norm(x))).softmax(-1)


def _train_step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = model(x)
    (out * torch.arange(9.0)).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_cpu_graph_runs_as_captured_with_eager_results_and_gradients(cgtrees_counters, caplog):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(37, 23)
    compiled = torch.compile(model, backend="cgtrees")
    with caplog.at_level(logging.INFO, logger="cgtrees"):
        got, got_grads = _train_step(compiled, x)
    want, want_grads = _train_step(model, x)
    assert torch.equal(got, want)  # the same ops in the same order: bit for bit
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads))
    assert cgtrees_counters["graphs_as_captured"] == 1
    assert cgtrees_counters["graphs_compiled"] == 0 and cgtrees_counters["cache_miss"] == 0
    assert cgtrees_counters["cudagraph_skips"] == 1  # DESIGN: one skip per function on CPU tensors
    assert "run without CUDA graphs" in caplog.text


def test_cpu_pipeline_option_compiles_through_aot_autograd(cgtrees_counters):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(37, 23)
    compiled = torch.compile(model, backend="cgtrees", options={"cpu_pipeline": True})
    got, got_grads = _train_step(compiled, x)
    want, want_grads = _train_step(model, x)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)
    assert cgtrees_counters["graphs_compiled"] == 1 and cgtrees_counters["graphs_as_captured"] == 0


def _graph_with(value: torch.Tensor) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.add, (x, 1))
    y.meta["example_value"] = value
    graph.output(y)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_only_graphs_without_a_device_tensor_and_without_the_interpreter_apply():
    cpu = torch.empty(3)
    assert as_captured.applies(_graph_with(cpu), [cpu], Config())
    assert not as_captured.applies(_graph_with(cpu), [cpu], Config(interpret=True))
    assert not as_captured.applies(_graph_with(cpu), [cpu], Config(cpu_pipeline=True))
    # a value made on a device inside the graph (no device tensor among the inputs): the pipeline
    assert not as_captured.applies(_graph_with(torch.empty(3, device="meta")), [cpu], Config())
    assert not as_captured.applies(_graph_with(cpu), [[torch.empty(3, device="meta")], 2], Config())


def test_env_var_asks_for_the_pipeline(monkeypatch):
    monkeypatch.setenv("CGTREES_CPU_PIPELINE", "1")
    assert Config.resolve().cpu_pipeline is True
