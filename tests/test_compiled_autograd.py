"""Compiled autograd's backward graphs through our pipeline (``cgtrees.aot.compiled_autograd``).

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


@needs_interpreter
def test_backward_is_generated_whole(cgtrees_counters):
    """Accumulate-grad's ``copy(new_empty_strided(grad, ...), grad)`` per parameter is generated
    code (the copy's own buffer, filled by a kernel), not aten: no aten gap in the
    compiled-autograd backward, with eager's gradients."""
    inputs = [torch.randn(6, 13) for _ in range(3)]
    _train(_mlp, "context", {"interpret": True}, inputs, ["step", "accumulate", "step"])
    _assert_all_compiled(cgtrees_counters, backward_graphs=2)
    assert cgtrees_counters["kernels_generated"] > 0
    assert cgtrees_counters.get("aten_gaps", 0) == 0, dict(cgtrees_counters)


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


def test_warm_process_hits_both_cache_levels_for_compiled_autograd(tmp_path):
    """A cold process compiles the forward and the compiled-autograd backward graphs (keyed at
    level 1 like any graph: compiled autograd's ops by name, the AOT backward prologue by its
    trace); a warm process loads the forward and every backward graph from level 1, whose entries
    read their kernel modules from level 2, without tracing them through AOTAutograd, with eager's
    gradients over steps with SGD, accumulation and hooks. The forward's entry keeps AOTAutograd's
    backward graph and metadata, so compiled autograd inlines the same backward graph as in the
    cold process. The step's ``loss.detach()``, whose output aliases its input, hits too (it
    bypassed the first level until issue 46): the warm process bypasses nothing."""
    from ca_warm_helpers import check_cold_and_warm, cold_and_warm

    cold, warm = cold_and_warm(tmp_path, "cpu")
    check_cold_and_warm(cold, warm)
    assert warm["bypassed"] == {}, warm


def test_forward_entry_written_under_compiled_autograd_serves_a_plain_backward(tmp_path):
    """The forward's entry written under compiled autograd holds no compiled backward (compiled
    autograd inlined it): a warm process that runs the same forward with a plain ``backward()``
    hits it, traces nothing through AOTAutograd, compiles the backward from the entry's graph at
    the first backward, and gets eager's gradients over steps with SGD, accumulation and hooks."""
    from ca_warm_helpers import check_both_match_eager, cold_and_warm

    cold, warm = cold_and_warm(tmp_path, "cpu", enable=("config", "plain"))
    check_both_match_eager(cold, warm)
    assert warm["aot_hits"] == ["g0"] and warm["calls"]["aot"] == 0 and not warm["backward"], warm
    assert warm["counters"]["cache_miss_module"] == 1, warm  # the backward, compiled lazily (never before)


def test_context_manager_default_dynamic_hits_level_one(tmp_path):
    """``compiled_autograd._enable(torch.compile(backend="cgtrees"))`` traces the backward with
    symbolic sizes (its default ``dynamic=True``). Those graphs bypassed level 1 until issue 46
    ("level 1 keeps static shapes only"); now their entries keep the guards on their sizes, and a
    warm process loads the forward and every backward graph from level 1."""
    from ca_warm_helpers import check_both_match_eager, cold_and_warm

    cold, warm = cold_and_warm(tmp_path, "cpu", enable=("context", "context"))
    check_both_match_eager(cold, warm)
    # (the cold process traces its first backward graph twice: Dynamo restarts it, old code or new)
    assert warm["counters"]["compiled_autograd_graphs"] == len(warm["backward"]) >= 2, warm
    assert set(warm["backward"]) <= set(warm["aot_hits"]), warm
    assert warm["bypassed"] == {} and warm["calls"]["aot"] == 0, warm


def test_context_manager_warm_start_with_other_batch_sizes(tmp_path):
    """The same with other batch sizes in the warm process than in the cold one: the graphs of the
    cold process's batch hit level 1, those of the new batches (a symbolic forward, whose backward
    prologue takes a size, and the backward graphs around it) are compiled, and every step gets
    eager's gradients; no graph bypasses level 1."""
    from ca_warm_helpers import check_other_sizes, cold_and_warm

    cold, warm = cold_and_warm(tmp_path, "cpu", enable=("context", "context"), sizes=("6,6,6,6", "6,9,9,4"))
    check_other_sizes(cold, warm)


def test_context_manager_with_static_sizes_hits_level_one(tmp_path):
    """With ``_enable(..., dynamic=False)`` the backward is traced with static sizes: the warm
    process loads the forward and the backward from level 1 while the batch size is the cold one's;
    a new batch size is traced again (Dynamo's guards; the forward's recompile is symbolic, a miss
    written to level 1 since issue 46, a bypass before) and gives eager's gradients."""
    from ca_warm_helpers import check_other_sizes, cold_and_warm

    cold, warm = cold_and_warm(tmp_path, "cpu", enable=("context-static", "context-static"),
                               sizes=("6,6,6,6", "6,6,9,9"))
    check_other_sizes(cold, warm)


def _op(name: str, fn: Callable[..., Any], custom: bool) -> Any:
    """One of compiled autograd's ``ops``, bound as compiled autograd binds them."""
    from torch._dynamo.compiled_autograd import ops

    if not custom and hasattr(ops, name):
        return ops.get(name)
    return ops.get(ops.add(name, fn, is_custom_function=custom, is_traceable=True))


def _backward_graph(op: Any) -> torch.fx.GraphModule:
    """A compiled-autograd-like graph: ``inputs`` (grad, x) -> op(grad, x)[0]."""
    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    grad = graph.call_function(operator.getitem, (inputs, 0))
    x = graph.call_function(operator.getitem, (inputs, 1))
    result = graph.call_function(op, ([grad], x))
    graph.output((graph.call_function(operator.getitem, (result, 0)),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _compile_and_check(op: Any, graph_id: int) -> None:
    from cgtrees.aot.compiled_autograd import compile_backward_graph
    from cgtrees.config import Config

    grad, x = torch.randn(5, 3), torch.randn(5, 3)
    gm = _backward_graph(op)
    # As Dynamo calls a backend: inside a tracing context (AOTAutograd leaves its metadata there),
    # and as compiled autograd runs its graphs, with grad mode off.
    with torch._guards.tracing(torch._guards.TracingContext(None)), torch.no_grad():
        fn = compile_backward_graph(gm, [[grad, x]], Config.resolve(), graph_id)
        listed = [grad, x]
        out = fn(listed)
    assert listed == []  # stolen
    torch.testing.assert_close(out[0], 2 * x * grad, rtol=0, atol=0)


def _double(grads: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    return [2 * x * grads[0]]


def test_graph_with_a_cpp_custom_function_bypasses_level_one(cgtrees_counters, caplog):
    """A C++ custom autograd Function's backward is an op compiled autograd names per process
    (``CppNode<Name><n>``, numbered in the order it meets them): such a graph bypasses level 1
    with that reason, logged, and is still compiled, right, and cached at level 2."""
    op = _op("CgtreesTestSquare", _double, custom=True)
    with caplog.at_level(logging.WARNING, logger="cgtrees"):
        _compile_and_check(op, 0)
    assert cgtrees_counters["cache_bypass_aot"] == 1 and cgtrees_counters["cache_miss_aot"] == 0
    assert f"calls {op.__name__}, the backward of a C++ custom autograd Function" in caplog.text
    assert cgtrees_counters["cache_miss_module"] == 1 and cgtrees_counters["graph_fallbacks"] == 0


def test_graph_of_torch_backward_ops_is_cached_at_level_one(cgtrees_counters, monkeypatch):
    """The same graph calling one of torch's own backward ops (named by the C++ node, the same in
    every process): level 1 keys it by that name, records it, and a second compile hits it; both
    times the runtime is handed a backward, and the list input is stolen."""
    from cgtrees.aot import driver

    kinds, wrap = [], driver.Compilers.wrap

    def spy(self: Any, module: Any, example_inputs: list[Any], ctx: Any) -> Any:
        kinds.append(ctx.kind)
        return wrap(self, module, example_inputs, ctx)

    monkeypatch.setattr(driver.Compilers, "wrap", spy)
    op = _op("CgtreesTestBuiltinSquare", _double, custom=False)
    _compile_and_check(op, 0)
    assert cgtrees_counters["cache_miss_aot"] == 1 and cgtrees_counters.get("cache_bypass_aot", 0) == 0
    _compile_and_check(op, 1)
    assert cgtrees_counters["cache_hit_aot"] == 1 and cgtrees_counters["graph_fallbacks"] == 0
    assert kinds == ["backward", "backward"]  # compiled, then rebuilt from level 1


def test_forward_from_level_one_then_compiled_autograd(cgtrees_counters):
    """A forward whose level-1 entry was written by a plain backward, then trained with compiled
    autograd: compiled autograd inlines the backward graph the entry keeps, as it would
    AOTAutograd's; gradients stay eager's."""
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
    from cgtrees.aot.compiled_autograd import flatten

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
    from cgtrees.aot.compiled_autograd import is_backward_graph

    assert not is_backward_graph([torch.randn(2)])
    assert not is_backward_graph([[torch.randn(2)]])  # a list, but compiled autograd is not tracing
