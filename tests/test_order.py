"""Where the partition's halves compute what crossed the cut (``backend/aot/order.py``): values the
forward computes only for the backward next to their inputs, what the backward recomputes next to
its first reader; and, through codegen (Triton's interpreter), that the backward's LayerNorm
statistics are recomputed inside the LayerNorm backward's kernel, not in a kernel of their own."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees.aot import compat, order


def _names(graph: torch.fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes]


def test_hoist_puts_a_value_for_the_backward_after_its_last_input():
    def f(x, w):
        a = torch.mm(x, w)
        b = torch.mm(torch.sin(a), w)  # the forward's output
        return b, torch.cos(a) * 2  # cos(a) * 2: only for the backward
    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4))
    names = _names(gm.graph)
    assert names.index("cos") > names.index("mm_1"), names  # traced after the second product
    output = next(iter(gm.graph.find_nodes(op="output")))
    order.hoist(gm.graph, keep=order.ancestors([output.args[0][0]]))
    names = _names(gm.graph)
    assert names[names.index("mm") + 1: names.index("mm") + 3] == ["cos", "mul"], names
    assert names[:2] == ["x_1", "w_1"]  # the inputs' order is the calling convention
    gm.recompile()
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(gm(x, w), f(x, w))


def test_hoist_keeps_values_after_the_inputs():
    def f(x, w):
        return torch.mm(x, w), x.exp()
    gm = make_fx(f)(torch.randn(4, 4), torch.randn(4, 4))
    output = next(iter(gm.graph.find_nodes(op="output")))
    order.hoist(gm.graph, keep=order.ancestors([output.args[0][0]]))
    assert _names(gm.graph)[:3] == ["x_1", "w_1", "exp"], _names(gm.graph)


def test_sink_puts_a_recomputed_value_before_its_first_reader():
    def g(saved, tangents_1):
        r = saved.exp() + 1  # from saved values alone: a recomputation
        v = torch.mm(tangents_1 * 2, tangents_1)
        return v * r, r.sum()
    gm = make_fx(g)(torch.randn(4, 4), torch.randn(4, 4))
    names = _names(gm.graph)
    assert names.index("exp") < names.index("mm"), names
    order.sink(gm.graph, anchors=order.descendants(n for n in gm.graph.nodes if compat.is_tangent(n)))
    names = _names(gm.graph)
    assert names[names.index("mm") + 1: names.index("mm") + 4] == ["exp", "add", "mul_1"], names
    gm.recompile()
    s, t = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(gm(s, t), g(s, t))


class Block(torch.nn.Module):
    """A pre-norm MLP block, as in every transformer: x + fc2(gelu(fc1(layernorm(x))))."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def _kernels(module) -> list[str]:
    """Each kernel's comment: the aten nodes it came from."""
    head = module.source.split("\ndef call(")[0]
    return [k for k in re.split(r"\n\n\n(?=# )", head) if re.search(r"\ndef (pw|red)_", k)]


@pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")
def test_backward_recomputes_layernorm_statistics_in_the_layernorm_backward_kernel():
    torch.manual_seed(0)
    model, eager = Block(), Block()
    eager.load_state_dict(model.state_dict())
    comp = Compiler()
    compiled = torch.compile(model, backend=comp.with_our_partition, fullgraph=True)
    x = torch.randn(2, 5, 32)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [compiled(xs[0]), eager(xs[1])]
    for out in outs:
        out.pow(2).sum().backward()
    comp.check()
    backward = comp.modules[1]
    # One kernel computes the statistics (stores them); a column-sum kernel may read them and
    # recompute the normalized input from them (graph._widens: cheaper than writing it).
    statistics = [k for k in _kernels(backward) if re.search(r"tl\.store\(var_mean\w*_ptr", k)]
    assert len(statistics) == 1, backward.source
    assert re.search(r"aten\.sum\.dim_IntList\(\w+, \[2\]", statistics[0]), statistics[0]  # the backward's rows
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
