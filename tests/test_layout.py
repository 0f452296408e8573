"""Channels-last convolution graphs (backend/aot/layout.py).

On the CPU the pass runs only when forced (``layout_opt="force"``: its decision wants CUDA), and
oneDNN, like cuDNN, returns channels-last results for channels-last inputs, so the rewritten
graphs run as they would on the GPU: outputs, gradients and running statistics match eager,
every value the caller sees has eager's strides, and layouts are converted only where values
enter the graph (tests/gpu/test_layout_gpu.py checks the same on CUDA, and the kernels).
"""

import copy

import pytest
import torch
from codegen_helpers import INTERPRET, trace
from conv_models import BasicBlock, ConvBNReLU, ConvNeXtBlock, MobileBlock
from layout_helpers import same, train_against_eager
from torch._subclasses.fake_tensor import FakeTensorMode

from cgtrees.aot import layout
from cgtrees.aot.measure import run_partitioned
from cgtrees.aot.partition import partition
from cgtrees.config import Config

aten = torch.ops.aten

MODELS = {
    "conv_bn_relu": lambda: (ConvBNReLU(), torch.randn(2, 3, 16, 16)),
    "resnet_basic_block": lambda: (BasicBlock(), torch.randn(2, 8, 16, 16)),
    "mobilenet_block": lambda: (MobileBlock(), torch.randn(2, 8, 16, 16)),
    "convnext_block": lambda: (ConvNeXtBlock(), torch.randn(2, 16, 8, 8)),
}
OPTIONS = {"interpret": True, "cache": False, "layout_opt": "force"}

interpreted = pytest.mark.skipif(not INTERPRET,
                                 reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")


# ------------------------------------------------------------------------- end to end, training
@interpreted
@pytest.mark.parametrize("name", list(MODELS))
def test_training_channels_last_matches_eager(name, cgtrees_counters):
    # the second step reads the running statistics the first one wrote
    train_against_eager(*MODELS[name](), OPTIONS, steps=2, buffers_against_float64=False)
    assert cgtrees_counters["layout_channels_last"] == 1  # the joint graph was rewritten
    assert cgtrees_counters["graph_fallbacks"] == 0  # forward and backward generated, not run by aten


@interpreted
def test_inference_channels_last_matches_eager(cgtrees_counters):
    model, x = MODELS["resnet_basic_block"]()
    model.eval()
    compiled = torch.compile(model, backend="cgtrees", options=OPTIONS)
    with torch.no_grad():
        out, expected = compiled(x), model(x)
    same(out, expected, "output")
    assert cgtrees_counters["layout_channels_last"] == 1
    assert cgtrees_counters["graph_fallbacks"] == 0


@interpreted
def test_off_leaves_graphs_alone(cgtrees_counters):
    model, x = MODELS["conv_bn_relu"]()
    compiled = torch.compile(model, backend="cgtrees", options={**OPTIONS, "layout_opt": "off"})
    compiled(x).sum().backward()
    assert cgtrees_counters["layout_channels_last"] == 0


# ------------------------------------------------------------------- the rewritten joint graphs
def _rewritten_joint(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.fx.Graph, set[str]]:
    """Trace ``model``'s joint graph, partition it with the layout forced; returns the rewritten
    joint graph and the names of the nodes it had before."""
    seen = {}

    def spy(joint, joint_inputs, **kw):
        seen["before"] = {n.name for n in joint.graph.nodes}
        fw, bw = partition(joint, joint_inputs, layout_opt="force", **kw)
        seen["graph"] = joint.graph
        return fw, bw

    run_partitioned(model, (x.requires_grad_(),), spy)
    return seen["graph"], seen["before"]


CONVOLUTIONS = (aten.convolution.default, aten.convolution_backward.default)


def _memory_format(node: torch.fx.Node) -> torch.memory_format | None:
    return node.kwargs.get("memory_format")


@pytest.mark.parametrize("name", list(MODELS))
def test_conversions_only_where_values_enter_or_leave(name):
    """No conversion pairs around each convolution: a value is converted to NHWC once, where it
    enters the graph (an input, a weight, a tangent), and back only where the caller gets it."""
    graph, before = _rewritten_joint(*MODELS[name]())
    added = [n for n in graph.nodes if n.op == "call_function" and n.name not in before]
    assert all(n.target in (aten.clone.default, aten.as_strided.default) for n in added), \
        [n.format_node() for n in added]
    to_nhwc = [n for n in added if _memory_format(n) is torch.channels_last]
    assert to_nhwc, "nothing was converted"
    sources = [n.args[0] for n in to_nhwc]
    assert len(set(sources)) == len(sources), "a value converted twice"
    # An input, a weight, or the gradient that a tangent (eager's layout) enters the backward as:
    entering = [n for n in graph.find_nodes(op="placeholder") if getattr(n.meta["val"], "ndim", 0) == 4]
    assert len(to_nhwc) <= len(entering), [s.name for s in sources]
    assert not any(s.target in CONVOLUTIONS or s.meta["val"].is_contiguous(memory_format=torch.channels_last)
                   for s in sources)
    for n in added:
        if _memory_format(n) is not torch.channels_last:
            assert [u.op for u in n.users] == ["output"], f"{n.name} converts back a value the graph reads"
    for conv in graph.find_nodes(op="call_function", target=aten.convolution.default):
        x, w = conv.args[0].meta["val"], conv.args[1].meta["val"]
        assert x.is_contiguous(memory_format=torch.channels_last), f"{conv.name}: input {x.stride()}"
        assert w.is_contiguous(memory_format=torch.channels_last), f"{conv.name}: weight {w.stride()}"
    for conv in graph.find_nodes(op="call_function", target=aten.convolution_backward.default):
        for arg in conv.args[:3]:
            assert arg.meta["val"].is_contiguous(memory_format=torch.channels_last), f"{conv.name}: {arg.name}"


def test_saved_bytes_grow_by_no_more_than_the_converted_copies():
    """The layout changes strides and adds conversions. A convolution's backward reads the
    channels-last copies of its input and weight, so those are saved rather than converted again
    (cost.reads_from_memory); beyond them the partitioner saves no more than in eager's layout."""
    from cgtrees.aot.cost import saved_bytes
    from cgtrees.aot.measure import measure

    model, x = MODELS["resnet_basic_block"]()
    plain = measure(copy.deepcopy(model), (x.clone().requires_grad_(),), partition)
    copies: list[int] = []

    def forced_partition(*a, **kw):
        fw, bw = partition(*a, layout_opt="force", **kw)
        saved = list(fw.graph.find_nodes(op="output"))[0].args[0][kw["num_fwd_outputs"]:]
        converted = [n for n in saved if n.name.endswith("_nhwc")]
        copies.append(sum(saved_bytes(n) for n in set(converted)))
        return fw, bw

    forced = measure(model, (x.clone().requires_grad_(),), forced_partition)
    assert copies[0] > 0, "no channels-last copy saved: the test no longer tests what it says"
    assert plain <= forced <= plain + copies[0], (plain, forced, copies)


# ---------------------------------------------------------- ops that must see the traced strides
def _conv(x, w):
    return aten.convolution.default(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


@pytest.mark.parametrize("tail", [
    lambda y: y.view(y.shape[0], -1) * 2,  # NHWC cannot express this view: its input goes back to NCHW
    lambda y: y.as_strided((2, 4, 3, 3), (256, 16, 4, 1)) + 1,  # reads storage with the traced strides
    lambda y: torch.relu(y).sum((2, 3)),  # flows: no conversion back before the sum
])
def test_rewritten_graph_computes_eager_values(tail):
    x, w = torch.randn(2, 8, 16, 16), torch.randn(8, 8, 3, 3)
    gm = trace(lambda x, w: tail(_conv(x, w)), x, w)
    assert layout.optimize(gm, "force", inference=True)
    same(gm(x, w), tail(_conv(x, w)), "output")


def test_an_output_view_with_strides_no_copy_has_keeps_the_graph():
    """A strided view returned as an output cannot be converted back to eager's strides: the
    pass leaves the whole graph as it was."""
    x, w = torch.randn(2, 8, 16, 16), torch.randn(8, 8, 3, 3)
    gm = trace(lambda x, w: _conv(x, w)[:, :4], x, w)
    code = gm.code
    assert not layout.optimize(gm, "force", inference=True)
    assert gm.code == code


# --------------------------------------------------------------------------------- the decision
def _conv_graph(convs: list[tuple[int, int, int, int]], device: str = "cuda", size: int = 32) -> torch.fx.Graph:
    """A chain of convolutions ``(in_channels, out_channels, kernel, groups)`` on fake tensors."""
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    with mode:
        x = graph.placeholder("x")
        x.meta["val"] = torch.empty(8, convs[0][0], size, size, device=device)
        weights = []
        for i, (cin, cout, k, groups) in enumerate(convs):
            weights.append(graph.placeholder(f"w{i}"))
            weights[-1].meta["val"] = torch.empty(cout, cin // groups, k, k, device=device)
        for w, (_, _, k, groups) in zip(weights, convs):
            x_val = x.meta["val"]
            x = graph.call_function(aten.convolution.default,
                                    (x, w, None, [1, 1], [k // 2] * 2, [1, 1], False, [0, 0], groups))
            x.meta["val"] = aten.convolution.default(x_val, w.meta["val"], None, [1, 1], [k // 2] * 2, [1, 1],
                                                     False, [0, 0], groups)
    graph.output(x)
    return graph


RESNET = [(64, 128, 3, 1), (128, 128, 3, 1), (128, 256, 3, 1)]


@pytest.mark.parametrize("convs, device, inference, verdict", [
    (RESNET, "cuda", False, None),
    (RESNET, "cuda", True, None),
    (RESNET, "cpu", False, "not on CUDA"),
    ([(96, 96, 3, 96), (96, 192, 1, 1)], "cuda", False, None),  # depthwise: one channel per group
    ([(128, 128, 3, 2), (128, 256, 1, 1)], "cuda", False, "grouped"),  # 64 channels per group: slower
    ([(256, 64, 3, 1), (64, 128, 3, 1)], "cuda", False, "shrinks"),
    ([(16, 32, 3, 1), (32, 64, 3, 1)], "cuda", False, "at most 64 channels"),
    ([(16, 32, 3, 1), (32, 64, 3, 1)], "cuda", True, None),  # small convolutions gain in inference
    ([(256, 256, 3, 2)], "cuda", True, "grouped convolutions dominate"),
])
def test_decision(convs, device, inference, verdict):
    reason = layout._why_not(_conv_graph(convs, device), layout.Mode.AUTO, inference)
    if verdict is None:
        assert reason is None
    else:
        assert reason is not None and verdict in reason


def test_decision_modes():
    small_cpu = _conv_graph([(8, 8, 3, 1)], "cpu")
    assert layout._why_not(small_cpu, layout.Mode.FORCE, False) is None
    assert layout._why_not(_conv_graph(RESNET), layout.Mode.OFF, False) == "layout_opt is off"
    assert layout._why_not(torch.fx.Graph(), layout.Mode.FORCE, False) == "no convolution"


def test_option_values():
    assert Config().layout_opt == "auto"
    assert Config.resolve(environ={"CGTREES_LAYOUT_OPT": "0"}).layout_opt == "off"
    assert Config.resolve(options={"layout_opt": False}).layout_opt == "off"
    assert Config.resolve(options={"layout_opt": "force"}).layout_opt == "force"
    with pytest.raises(ValueError, match="valid values: auto, off, force"):
        Config.resolve(options={"layout_opt": "nhwc"})


# ------------------------------------------------------------------ our kernels follow the layout
@interpreted
def test_pointwise_kernel_walks_channels_last_memory_in_order():
    """A channels-last output is written in memory order: one flat index, no div/mod per element."""
    from codegen_helpers import compile_fn, run

    x, y = (torch.randn(4, 16, 5, 7).to(memory_format=torch.channels_last) for _ in range(2))
    fn = lambda x, y: x.relu() * 2 + y  # noqa: E731
    module = compile_fn(fn, x, y)
    kernels = module.source[module.source.find("@triton.jit"):module.source.find("def call(")]
    assert "//" not in kernels and "%" not in kernels, kernels
    same(run(module, x, y)[0], fn(x, y), "output")


@pytest.mark.parametrize("strides, reduced_innermost", [
    ((1, 16), False),  # sum over N, H, W of a channels-last tensor: C is adjacent in memory
    ((140, 1), True),  # the same sum over a contiguous tensor: each row is adjacent
])
def test_reductions_read_row_or_column_from_strides(strides, reduced_innermost):
    import sympy

    from cgtrees.codegen import ir
    from cgtrees.codegen.kernel_facts import reduces_innermost as _reduces_innermost

    x0, r0 = sympy.Symbol("x0", integer=True, nonnegative=True), sympy.Symbol("r0", integer=True, nonnegative=True)
    load = ir.Load("buf", strides[0] * x0 + strides[1] * r0, torch.float32)
    assert _reduces_innermost({"sum": load}, [(x0, 16, False), (r0, 140, True)]) is reduced_innermost


def test_kink_distance_finds_relu_inputs_at_the_kinks():
    """The precondition of the GPU training tests (layout_helpers.kink_distance)."""
    from layout_helpers import kink_distance

    x = torch.tensor([[-1.0, 2.0, 3e-9]])
    assert kink_distance(torch.nn.ReLU(), x) == pytest.approx(3e-9)
    assert kink_distance(torch.nn.ReLU6(), torch.tensor([[6.5, 6.0 - 2**-20, -2.0]])) == 2**-20  # exact in float32
    assert kink_distance(torch.nn.GELU(), x) == float("inf")  # no kink
