"""Buffers that ``realize`` shares (backend/codegen/graph.py): a value realized twice in one layout
(a softmax saved for the backward and its expand read by a bmm) is stored once; two graph outputs
and outputs that view one shared buffer never share memory (``lower_scatter``'s fresh copies are
never shared either: ``LowerCtx.fresh``)."""

from __future__ import annotations

import re

import pytest
import torch
from codegen_helpers import INTERPRET, compile_fn, run

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")
aten = torch.ops.aten


def _allocations(module, size: tuple) -> int:
    """Buffers of ``size`` that ``call`` allocates."""
    return len(re.findall(re.escape(f"torch.empty_strided({size}"), module.source.split("\ndef call(")[1]))


def _saved_softmax(s, v):
    p = torch.softmax(s, -1)
    o = torch.bmm(p.expand(3, 5, 17, 17).reshape(15, 17, 17), v)
    return o, aten.alias(p)


def test_a_value_saved_and_read_by_an_aten_call_is_stored_once():
    s, v = torch.randn(3, 5, 17, 17), torch.randn(15, 17, 9)
    module = compile_fn(_saved_softmax, s, v)
    assert _allocations(module, (3, 5, 17, 17)) == 1, module.source
    for got, want in zip(run(module, s, v), _saved_softmax(s, v)):
        torch.testing.assert_close(got, want)


def test_two_outputs_of_one_value_are_two_tensors():
    s = torch.randn(3, 5, 17, 17)

    def fn(s):
        p = torch.softmax(s, -1)
        return p.expand(3, 5, 17, 17), aten.alias(p)

    a, b = run(compile_fn(fn, s), s)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    a.add_(1.0)
    torch.testing.assert_close(b, torch.softmax(s, -1))


def test_outputs_viewing_one_shared_buffer_are_two_tensors():
    s, v = torch.randn(3, 5, 17, 17), torch.randn(15, 17, 9)

    def fn(s, v):
        p = torch.softmax(s, -1)
        a = p.expand(3, 5, 17, 17)
        o = torch.bmm(a.reshape(15, 17, 17), v)
        return o, aten.alias(p), a.transpose(2, 3)

    o, b, c = run(compile_fn(fn, s, v), s, v)
    assert b.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()
    c.mul_(0.0)
    want = fn(s, v)
    torch.testing.assert_close(o, want[0])
    torch.testing.assert_close(b, want[1])



def test_a_value_realized_after_its_input_is_written_gets_a_buffer_of_its_own():
    """Two values with one body share a buffer only while nothing wrote what the body reads: after a
    write into that input (a scatter in place, a copy into a graph input) the body computes another
    value (``GraphLowerer._written``)."""
    from codegen_helpers import config, trace

    from cgtrees.codegen import ir
    from cgtrees.codegen.graph import GraphLowerer
    from cgtrees.codegen.lowering import TensorValue, load_buffer

    gm = trace(lambda x: x * 2.0, torch.randn(5, 3))
    lowerer = GraphLowerer(gm, config())
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    x = load_buffer("x_1", ir.Layout((5, 3), (3, 1)), torch.float32)
    value = TensorValue(x.size, torch.float32, ir.Op("mul", (x.body, ir.Const(2.0, torch.float32)), torch.float32))
    first, again = lowerer.realize(value, node, "_src"), lowerer.realize(value, node, "_src")  # not an output
    assert again.view[0] == first.view[0]
    lowerer._written("x_1")
    assert lowerer.realize(value, node, "_src").view[0] != first.view[0]
