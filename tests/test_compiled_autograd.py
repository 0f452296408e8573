"""Compiled autograd's backward graphs through our pipeline (``backend.aot.compiled_autograd``).

A model compiled with ``backend="cgtrees"`` is trained with its backward captured by compiled
autograd and compiled by cgtrees too, turned on both ways torch offers: the context manager
``torch._dynamo.compiled_autograd._enable(torch.compile(backend="cgtrees"))`` around
``loss.backward()`` (its sizes dynamic by default), and ``torch._dynamo.config.compiled_autograd``
with the training step compiled (torch enters compiled autograd around a compiled frame, so the
``backward()`` must run inside one). Every parameter's gradient and value is compared with eager on
a deep copy over several steps: SGD updates, gradients accumulated without ``zero_grad``, a tensor
hook (``register_hook``) and post-accumulate-grad hooks. No graph may fall back; every backward
must reach us as a compiled-autograd graph. Aten mode and Triton's interpreter (``interpret``).
"""

from __future__ import annotations

import copy
import logging
import operator
from typing import Any, Callable

import pytest
import torch
import torch._dynamo
from codegen_helpers import INTERPRET
from hf_helpers import assert_close, assert_grads_close

needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="a CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1 (never mixed)")
MODES = ["aten", pytest.param("interpret", marks=needs_interpreter)]
LR = 0.1


def _mlp() -> torch.nn.Module:
    # irregular sizes; a division by a Python scalar and a tanh so the backward holds more than matmuls
    return torch.nn.Sequential(torch.nn.Linear(13, 24), torch.nn.Tanh(), torch.nn.Linear(24, 7))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out / 3.0).pow(2).mean()


def _add_hooks(model: torch.nn.Module) -> None:
    """A tensor hook that rescales a gradient before it is accumulated, and post-accumulate-grad
    hooks that change the accumulated ``.grad`` in place."""
    model[0].weight.register_hook(lambda g: g * 2.0)

    def halve(p: torch.Tensor) -> None:
        p.grad.mul_(0.5)

    model[2].bias.register_post_accumulate_grad_hook(halve)
    model[0].bias.register_post_accumulate_grad_hook(halve)


class Trainer:
    """One model trained eagerly or with compiled autograd, enabled one of the two ways."""

    def __init__(self, model: torch.nn.Module, enable: str | None, options: dict[str, Any],
                 loss: Callable[[torch.Tensor], torch.Tensor] = _loss) -> None:
        self.model = model
        self.loss = loss
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)
        self.enable = enable
        self.options = options
        if enable == "context":
            self.forward = torch.compile(model, backend="cgtrees", options=options)
        elif enable == "config":  # read when torch.compile wraps the function: it adds an enter hook
            with torch._dynamo.config.patch(compiled_autograd=True):
                self.step_fn = torch.compile(self._step, backend="cgtrees", options=options)

    def _step(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.loss(self.model(x))
        loss.backward()
        return loss.detach()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        if self.enable is None:
            return self._step(x)
        if self.enable == "config":
            return self.step_fn(x)
        loss = self.loss(self.forward(x))
        compiler = torch.compile(backend="cgtrees", options=self.options)
        with torch._dynamo.compiled_autograd._enable(compiler):
            loss.backward()
        return loss.detach()


def _train(make: Callable[[], torch.nn.Module], enable: str, options: dict[str, Any], inputs: list[torch.Tensor],
           schedule: list[str], hooks: bool = False,
           loss: Callable[[torch.Tensor], torch.Tensor] = _loss) -> None:
    """Run both trainers through ``schedule``: "step" (backward, optimizer step, zero_grad) or
    "accumulate" (backward only), and compare after each."""
    model = make()
    ref = copy.deepcopy(model)
    if hooks:
        _add_hooks(model)
        _add_hooks(ref)
    ours, eager = Trainer(model, enable, options, loss), Trainer(ref, None, options, loss)
    for i, (x, what) in enumerate(zip(inputs, schedule)):
        assert_close(ours.step(x), eager.step(x), f"step {i} loss")
        assert_grads_close(model, ref, f"step {i} ({what})")
        if what == "step":
            ours.opt.step()
            eager.opt.step()
            ours.opt.zero_grad(set_to_none=True)
            eager.opt.zero_grad(set_to_none=True)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.detach(), q.detach(), f"step {i}: parameter {name}")


def _assert_all_compiled(counters: Any, backward_graphs: int) -> None:
    seen = dict(counters)
    assert seen.get("graph_fallbacks", 0) == 0, seen
    assert seen.get("compiled_autograd_graphs", 0) == backward_graphs, seen
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= backward_graphs


SCHEDULE = ["step", "accumulate", "accumulate", "step", "step"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("enable", ["context", "config"])
def test_mlp_matches_eager(enable, mode, cgtrees_counters):
    torch._dynamo.utils.counters["compiled_autograd"].clear()
    inputs = [torch.randn(6, 13) for _ in SCHEDULE]
    _train(_mlp, enable, {"interpret": mode == "interpret"}, inputs, SCHEDULE, hooks=True)
    # two backward graphs: without gradients to accumulate into, then with them
    _assert_all_compiled(cgtrees_counters, backward_graphs=2)
    if mode == "interpret":
        assert cgtrees_counters["kernels_generated"] > 0


def test_mlp_with_new_batch_sizes_matches_eager(cgtrees_counters):
    """Compiled autograd passes sizes as inputs (dynamic by default under the context manager): we
    turn them into size arguments, and a new batch size gives eager's gradients."""
    inputs = [torch.randn(n, 13) for n in (6, 6, 9, 9, 4)]
    _train(_mlp, "context", {}, inputs, ["accumulate", "step", "step", "accumulate", "step"])
    assert dict(cgtrees_counters).get("graph_fallbacks", 0) == 0, dict(cgtrees_counters)
    assert cgtrees_counters["compiled_autograd_graphs"] >= 2


def test_gpt2_matches_eager(cgtrees_counters):
    pytest.importorskip("transformers")
    from hf_helpers import CASES, build

    case = CASES["gpt2"]

    class LossOnly(torch.nn.Module):  # the loss as the output: Trainer takes a tensor
        def __init__(self) -> None:
            super().__init__()
            self.inner = build("gpt2").train()

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            ids, mask, labels = batch.unbind(0)
            return self.inner(input_ids=ids, attention_mask=mask, labels=labels).loss

    batches = []
    for _ in range(3):
        b = case.inputs()
        batches.append(torch.stack([b["input_ids"], b["attention_mask"], b["labels"]]))
    _train(LossOnly, "context", {}, batches, ["step", "accumulate", "step"], loss=lambda out: out)
    assert dict(cgtrees_counters).get("graph_fallbacks", 0) == 0, dict(cgtrees_counters)
    assert cgtrees_counters["compiled_autograd_graphs"] >= 2


def test_warm_start_hits_the_kernel_cache_and_bypasses_level_one(cgtrees_counters, caplog):
    """After ``reset()`` (as in a new process) the backward graphs' kernel modules load from disk;
    level 1 is bypassed with its reason logged (it would key on per-process op names)."""
    inputs = [torch.randn(6, 13) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="backend"):
        _train(_mlp, "context", {}, inputs, ["accumulate", "accumulate"])
    assert "compiled-autograd graph calls ops" in caplog.text
    assert cgtrees_counters["cache_bypass_aot"] == 2
    cold_hits = cgtrees_counters["cache_hit_module"]
    torch._dynamo.reset()
    _train(_mlp, "context", {}, inputs, ["accumulate", "accumulate"])
    assert cgtrees_counters["cache_hit_module"] - cold_hits >= 3  # the forward and both backward graphs
    assert cgtrees_counters["graph_fallbacks"] == 0


def test_forward_from_level_one_then_compiled_autograd(cgtrees_counters):
    """A forward whose level-1 entry was written by a plain backward, then trained with compiled
    autograd: compiled autograd traces our cached wrapper's backward; gradients stay eager's."""
    inputs = [torch.randn(6, 13) for _ in range(3)]
    model = _mlp()
    ref = copy.deepcopy(model)
    plain = torch.compile(model, backend="cgtrees")
    _loss(plain(inputs[0])).backward()  # writes the forward's level-1 entry
    _loss(ref(inputs[0])).backward()
    torch._dynamo.reset()
    assert cgtrees_counters["cache_hit_aot"] == 0
    ours, eager = Trainer(model, "context", {}), Trainer(ref, None, {})
    for i, x in enumerate(inputs[1:]):
        assert_close(ours.step(x), eager.step(x), f"step {i} loss")
        assert_grads_close(model, ref, f"step {i}")
    assert cgtrees_counters["cache_hit_aot"] >= 1
    assert cgtrees_counters["graph_fallbacks"] == 0


# ------------------------------------------------------------------ the flattening pass itself
def test_flatten_replaces_list_reads_and_rebuilds_other_uses():
    from backend.aot.compiled_autograd import flatten

    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    scale = graph.placeholder("scale")
    a = graph.call_function(operator.getitem, (inputs, 0))
    b = graph.call_function(operator.getitem, (inputs, 1))
    stacked = graph.call_function(torch.stack, (inputs,))  # a use other than inputs[i]
    total = graph.call_function(torch.add, (a, b))
    graph.output((graph.call_function(torch.mul, (total, scale)), stacked))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x, y, s = torch.randn(3), torch.randn(3), torch.randn(3)
    expected = gm([x, y], s)

    flat = flatten(gm, [[x, y], s])
    placeholders = list(flat.gm.graph.find_nodes(op="placeholder"))
    assert len(placeholders) == 3 and flat.num_listed == 2
    assert not any(n.target is operator.getitem for n in flat.gm.graph.nodes)
    got = flat.gm(x, y, s)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)

    listed = [x, y]
    call = flat.caller(lambda *args: flat.gm(*args))
    out = call(listed, s)
    assert listed == []  # stolen: emptied before the call
    torch.testing.assert_close(out[0], expected[0], rtol=0, atol=0)


def test_a_graph_of_user_code_is_not_taken_for_a_backward():
    from backend.aot.compiled_autograd import is_backward_graph

    assert not is_backward_graph([torch.randn(2)])
    assert not is_backward_graph([[torch.randn(2)]])  # a list, but compiled autograd is not tracing
