"""A write into a graph input goes just after what it writes is computed
(``backend/codegen/input_writes.py``): a training BatchNorm's running statistics update in the
kernel of the statistics, through Triton's interpreter: kernel counts with and without the pass,
eager's running statistics after two steps, and the writes it leaves where they are."""

from __future__ import annotations

import operator

import pytest
import torch
from codegen_helpers import INTERPRET, Compiler, kernel_count
from conv_models import BasicBlock, ConvBNReLU
from layout_helpers import train_against_eager

from cgtrees.codegen import input_writes

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

aten = torch.ops.aten
MODELS = {"conv_bn_relu": (ConvBNReLU, 3, 3), "resnet_basic_block": (BasicBlock, 8, 2)}


def forward_kernels(model: torch.nn.Module, x: torch.Tensor) -> int:
    comp = Compiler()
    torch._dynamo.reset()
    torch.compile(model, backend=comp.with_our_partition)(x)
    torch._dynamo.reset()
    [forward] = [m for m in comp.modules if "g_forward" in m.source.splitlines()[0]]
    return kernel_count(forward)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("channels_last", [False, True])
def test_running_statistics_update_inside_the_statistics_kernel(name, channels_last, monkeypatch):
    """Each BatchNorm's running mean and variance were one kernel at the end of the forward, and
    each ``num_batches_tracked += 1`` one more; now the statistics update in the kernel that
    reduces them, and the counters all in one kernel."""
    cls, channels, norms = MODELS[name]
    x = torch.randn(2, channels, 8, 8)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    model = cls().train()
    moved = forward_kernels(model, x)
    monkeypatch.setattr(input_writes, "placed", lambda gm: gm)
    before = forward_kernels(model, x)
    assert moved == before - norms - (norms - 1), (moved, before)


@pytest.mark.parametrize("name", list(MODELS))
def test_running_statistics_match_eager_after_two_steps(name):
    cls, channels, _ = MODELS[name]
    train_against_eager(cls().train(), torch.randn(2, channels, 8, 8),
                        {"interpret": True, "cache": False}, steps=2, buffers_against_float64=False)


def update_graph(read_elsewhere: bool) -> torch.fx.GraphModule:
    """``running = running * 0.9 + x.sum(0) * 0.1`` written into ``running`` at the end, after a
    relu of ``x``; ``read_elsewhere``: the relu's output also adds ``running``'s old value."""
    g = torch.fx.Graph()
    x, running = g.placeholder("x"), g.placeholder("running")
    total = g.call_function(aten.sum.dim_IntList, (x, [0]))
    new = g.call_function(aten.add.Tensor, (g.call_function(aten.mul.Tensor, (total, 0.1)),
                                            g.call_function(aten.mul.Tensor, (running, 0.9))))
    y = g.call_function(aten.relu.default, (x,))
    if read_elsewhere:
        y = g.call_function(aten.add.Tensor, (y, running))
    g.call_function(aten.copy_.default, (running, new))
    g.output((y, total))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_write_moves_with_what_only_it_reads_and_the_callers_graph_stays():
    gm = update_graph(read_elsewhere=False)
    text = gm.code
    out = input_writes.placed(gm)
    assert out is not gm and gm.code == text
    order = [n.target for n in out.graph.nodes if n.op == "call_function"]
    assert order == [aten.sum.dim_IntList, aten.mul.Tensor, aten.mul.Tensor, aten.add.Tensor,
                     aten.copy_.default, aten.relu.default], order
    x, running = torch.randn(4, 3), torch.randn(3)
    want_running = running.clone()
    want = gm(x, want_running)
    got = out(x, running)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(running, want_running)


def test_write_of_an_input_read_elsewhere_stays():
    gm = update_graph(read_elsewhere=True)
    assert input_writes.placed(gm) is gm


def test_write_already_in_place_leaves_the_graph_alone():
    gm = input_writes.placed(update_graph(read_elsewhere=False))
    assert input_writes.placed(gm) is gm


def test_getitem_of_a_multi_output_step_is_not_a_write():
    """Only ``aten.copy_`` into a placeholder moves (``operator.getitem`` is pure, stays a reader)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    vm = g.call_function(aten.var_mean.correction, (x, [0]), {"correction": 0})
    g.output((g.call_function(operator.getitem, (vm, 0)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert input_writes.placed(gm) is gm
