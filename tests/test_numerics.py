"""End to end through torch.compile(backend="cgtrees"): outputs and every gradient match eager."""

import copy
import logging

import pytest
import torch
from models import MLP, ConvBN, GPTBlock, GraphBreak


def _check_training(model, *inputs, atol=1e-5, rtol=1e-4, steps=2):
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="cgtrees")
    for _ in range(steps):
        ins = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        ref_ins = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out, ref = compiled(*ins), ref_model(*ref_ins)
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
        out.square().mean().backward()
        ref.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=f"grad of {name}")
        for a, b in zip(ins, ref_ins):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, atol=atol, rtol=rtol)
        for (name, b), rb in zip(model.named_buffers(), ref_model.buffers()):
            torch.testing.assert_close(b, rb, atol=atol, rtol=rtol, msg=f"buffer {name}")


def test_mlp_training():
    _check_training(MLP(), torch.randn(32, 64))


def test_conv_batchnorm_training_mode_updates_running_stats():
    _check_training(ConvBN().train(), torch.randn(4, 3, 12, 12))


def test_gpt_block_training():
    _check_training(GPTBlock(), torch.randn(2, 16, 64))


def test_graph_break(cgtrees_counters):
    _check_training(GraphBreak(), torch.randn(8, 16))
    assert cgtrees_counters["graphs_compiled"] >= 2


def test_inference_under_no_grad():
    model = GPTBlock().eval()
    compiled = torch.compile(model, backend="cgtrees")
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)


def test_dynamic_batch_sizes(cgtrees_counters):
    model = MLP()
    compiled = torch.compile(model, backend="cgtrees", dynamic=True)
    for batch in (3, 7, 12):
        x = torch.randn(batch, 64)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-4)
    assert cgtrees_counters["graphs_compiled"] == 1


def test_input_mutation_matches_eager():
    def f(x, buf):
        buf.add_(x)
        return x * buf

    x, buf, ref_buf = torch.randn(6), torch.randn(6), None
    ref_buf = buf.clone()
    out = torch.compile(f, backend="cgtrees")(x, buf)
    torch.testing.assert_close(out, f(x, ref_buf))
    torch.testing.assert_close(buf, ref_buf)


def test_codegen_failure_falls_back_to_aten(monkeypatch, caplog, cgtrees_counters):
    from cgtrees import codegen

    def broken(*args, **kwargs):
        raise RuntimeError("lowering exploded")

    monkeypatch.setattr(codegen, "compile_graph", broken)
    monkeypatch.setattr(codegen, "generate", broken, raising=False)
    f = torch.compile(lambda x: torch.tanh(x) * 3, backend="cgtrees")
    x = torch.randn(4)
    with caplog.at_level(logging.WARNING, logger="cgtrees"):
        torch.testing.assert_close(f(x), torch.tanh(x) * 3)
    assert cgtrees_counters["graph_fallbacks"] == 1
    assert "lowering exploded" in caplog.text and "runs through aten" in caplog.text


def test_aot_failure_runs_eagerly(monkeypatch, caplog, cgtrees_counters):
    from cgtrees.aot import driver

    def broken(*args, **kwargs):
        raise RuntimeError("tracing exploded")

    monkeypatch.setattr(driver, "compile_dynamo_graph", broken)
    f = torch.compile(lambda x: x.exp() + 1, backend="cgtrees")
    x = torch.randn(4)
    with caplog.at_level(logging.WARNING, logger="cgtrees"):
        torch.testing.assert_close(f(x), x.exp() + 1)
    assert cgtrees_counters["graph_fallbacks"] == 1 and "tracing exploded" in caplog.text


@pytest.mark.parametrize("reset", ["backend", "dynamo"])
def test_reset_hooks(reset, monkeypatch):
    import cgtrees
    from cgtrees import runtime

    calls = []
    monkeypatch.setattr(runtime, "reset", lambda: calls.append(1))
    torch.compile(lambda x: x + 1, backend="cgtrees")(torch.ones(2))
    cgtrees.reset() if reset == "backend" else torch._dynamo.reset()
    assert calls


def test_dynamic_layernorm_is_compiled_not_run_eagerly(cgtrees_counters):
    """Dynamo asks for a second trace (a RestartAnalysis raised through the backend) when a float
    becomes a tensor; swallowed as a failure, every dynamic LayerNorm model ran eagerly."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    compiled = torch.compile(model, backend="cgtrees", dynamic=True)
    for batch in (3, 5):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(compiled(x), model(x))
    assert cgtrees_counters["graph_fallbacks"] == 0
    assert cgtrees_counters["graphs_compiled"] >= 1
