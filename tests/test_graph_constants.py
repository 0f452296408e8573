"""Graph constants (lifted tensors read through ``get_attr``) and call targets made inside functions.

A Hugging Face KV cache holds ``torch.tensor([])``; that used to send the whole graph through aten
(the cache key read the real constant under the fake mode) and bypass the first cache level. Each
test runs a graph with constants through the backend and compares outputs and gradients with eager,
and checks that nothing fell back and nothing bypassed the cache.
"""

import pytest
import torch
import torch.nn.functional as F

from cgtrees.aot import constants
from cgtrees.cache.key import stable_name


def _check(fn, *inputs, counters, interpret=False):
    ins = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    ref_ins = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    compiled = torch.compile(fn, backend="cgtrees", options={"interpret": interpret})
    out, ref = compiled(*ins), fn(*ref_ins)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for a, b in zip(ins, ref_ins):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
    assert counters["graph_fallbacks"] == 0
    assert counters["cache_bypass"] == 0
    assert counters["graphs_compiled"] >= 1


@pytest.mark.parametrize("interpret", [False, True])
def test_issue_repro_lifted_constant(cgtrees_counters, interpret):
    _check(lambda x: x + torch.tensor([1., 2.]), torch.randn(2), counters=cgtrees_counters, interpret=interpret)
    if interpret:
        assert cgtrees_counters["kernels_generated"] >= 1


def test_empty_constant_concatenated_like_a_kv_cache(cgtrees_counters):
    def step(x):
        past = torch.tensor([])
        return torch.cat([past, x.flatten()]).tanh()

    _check(step, torch.randn(3, 4), counters=cgtrees_counters)


def test_scalar_and_integer_constants(cgtrees_counters):
    def fn(x):
        idx = torch.tensor([2, 0, 1])
        return (x[:, idx] * torch.tensor(0.5)).exp()

    _check(fn, torch.randn(4, 3), counters=cgtrees_counters)


def test_constant_values_are_part_of_the_cache_key(cgtrees_counters):
    """Graphs that differ only in a constant's value never share an entry at either level."""
    def run(c):
        torch._dynamo.reset()
        cgtrees_counters.clear()
        out = torch.compile(lambda x: x * torch.tensor([c, 2.0]), backend="cgtrees")(torch.arange(2.0))
        return out.tolist(), cgtrees_counters["cache_hit"], cgtrees_counters["cache_bypass"]

    assert run(3.0) == ([0.0, 2.0], 0, 0)
    assert run(3.0) == ([0.0, 2.0], 2, 0)  # the same graph and constant: level 1 hits, its module from level 2
    assert run(5.0) == ([0.0, 2.0], 0, 0)  # only the constant changed: no hit at any level


def test_constant_bytes_change_the_module_key():
    from cgtrees.cache.key import constants_text

    a = constants_text(["c"], [torch.tensor([1.0, 2.0])])
    assert a == constants_text(["c"], [torch.tensor([1.0, 2.0])])
    assert a != constants_text(["c"], [torch.tensor([1.0, 2.5])])


def test_lift_replaces_get_attr_by_trailing_inputs():
    root = torch.nn.Module()
    root.c = torch.tensor([1.0, 2.0])
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    c = graph.get_attr("c")
    graph.output(graph.call_function(torch.add, (x, c)))
    gm = torch.fx.GraphModule(root, graph)
    lifted = constants.lift(gm)
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "placeholder", "call_function", "output"]
    assert lifted.names == ("c",) and not hasattr(gm, "c")
    assert lifted.indices(1) == (1,)
    call = lifted.append(lambda args: gm(*args))
    torch.testing.assert_close(call([torch.ones(2)]), torch.tensor([2.0, 3.0]))


def test_wrappers_made_inside_functions_are_named_where_published():
    assert stable_name(F.max_pool2d) == "torch.nn.functional.max_pool2d"
    assert stable_name(F.adaptive_max_pool2d) == "torch.nn.functional.adaptive_max_pool2d"


def test_max_pool_graph_is_cached(cgtrees_counters):
    def fn(x):
        return F.max_pool2d(x, 2).relu()

    _check(fn, torch.randn(1, 2, 6, 6), counters=cgtrees_counters)
    assert cgtrees_counters["cache_miss_aot"] == 1


def test_level_1_hit_before_the_first_backward_lifts_the_backward_constants(cgtrees_counters, tmp_path,
                                                                            monkeypatch):
    """Three identical graphs between graph breaks: the second and third hit the first's level-1
    entry before any backward ran, so their backward compiles lazily from the entry's graph
    (``aot.rebuild.LazyBackward``), whose tensor constant must become an input as on a miss (it went
    through aten: "get_attr nodes are not written into kernel modules")."""
    monkeypatch.setenv("CGTREES_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    ref = [torch.nn.Linear(8, 8) for _ in range(3)]
    for a, b in zip(layers, ref):
        b.load_state_dict(a.state_dict())

    @torch._dynamo.disable
    def layer(i, x):
        return layers[i](x)

    def f(x):
        return torch.relu(layer(2, torch.relu(layer(1, torch.relu(layer(0, x))))))

    compiled = torch.compile(f, backend="cgtrees")
    weights = torch.arange(8.0)
    for _ in range(2):
        x = torch.randn(4, 8)
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        (compiled(ours) * weights).sum().backward()
        (torch.relu(ref[2](torch.relu(ref[1](torch.relu(ref[0](theirs)))))) * weights).sum().backward()
        torch.testing.assert_close(ours.grad, theirs.grad)
        for a, b in zip(layers, ref):
            torch.testing.assert_close(a.weight.grad, b.weight.grad)
    assert cgtrees_counters["cache_hit_aot"] >= 2, dict(cgtrees_counters)
    assert cgtrees_counters["graph_fallbacks"] == 0, dict(cgtrees_counters)


def test_lift_gives_one_input_to_an_attribute_read_twice():
    """A backward graph AOTAutograd traced reads a forward constant once per use: two ``get_attr``
    nodes of one attribute. Lifting the first deleted the attribute, and the second read None
    ("cannot create weak reference to 'NoneType' object": Mixtral's training on CPU)."""
    root = torch.nn.Module()
    root.c = torch.tensor([1.0, 2.0])
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    first, second = graph.get_attr("c"), graph.get_attr("c")
    graph.output(graph.call_function(torch.mul, (graph.call_function(torch.add, (x, first)), second)))
    gm = torch.fx.GraphModule(root, graph)
    lifted = constants.lift(gm)
    assert lifted.names == ("c",) and [n.op for n in gm.graph.nodes].count("placeholder") == 2
    call = lifted.append(lambda args: gm(*args))
    torch.testing.assert_close(call([torch.ones(2)]), torch.tensor([2.0, 6.0]))


def test_a_view_of_an_input_that_requires_grad_stays_in_autograd(cgtrees_counters):
    """A graph after a graph break that only reshapes an input which requires grad (Mixtral's
    ``final_hidden_states.reshape`` after its experts' loop) is an inference graph to AOTAutograd:
    its output is a view of the input, which AOTAutograd's wrapper makes again where autograd sees
    it. Our lean wrapper handed back the graph's own view, cut off from autograd: no gradient reached
    anything before it."""
    def f(h, w):
        out = torch.zeros_like(h)
        torch._dynamo.graph_break()
        out.index_add_(0, torch.tensor([0, 2]), (h[[0, 2]] @ w).sin())
        torch._dynamo.graph_break()
        return out.reshape(2, 3, 4)

    h, w = torch.randn(6, 4), torch.randn(4, 4)
    ins = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    ref_ins = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    out = torch.compile(f, backend="cgtrees")(*ins)
    ref = f(*ref_ins)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for a, b in zip(ins, ref_ins):
        torch.testing.assert_close(a.grad, b.grad)
    assert cgtrees_counters["graph_fallbacks"] == 0
