"""One node per value computed twice (``backend/aot/cse.py``): autocast's casts, one per reader,
become one; random ops, outputs and reads across a write stay apart. Through codegen (Triton's
interpreter): a tensor cast once per reader is one kernel's work, and the result is eager's."""

from __future__ import annotations

import pytest
import torch
from codegen_helpers import INTERPRET, Compiler
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees.aot import cse

aten = torch.ops.aten


def _count(gm: torch.fx.GraphModule, target) -> int:
    return sum(n.target is target for n in gm.graph.nodes)


def test_a_value_cast_once_per_reader_is_cast_once():
    def f(x, w1, w2, w3):  # as autocast traces a layer norm's output read by three projections
        return x.to(torch.bfloat16) @ w1, x.to(torch.bfloat16) @ w2, x.to(torch.bfloat16) @ w3

    args = (torch.randn(7, 13), *(torch.randn(13, 5, dtype=torch.bfloat16) for _ in range(3)))
    gm = make_fx(f)(*args)
    assert _count(gm, aten._to_copy.default) == 3
    assert cse.eliminate(gm.graph)
    gm.recompile()
    assert _count(gm, aten._to_copy.default) == 1
    for got, want in zip(gm(*args), f(*args)):
        torch.testing.assert_close(got, want)
    assert not cse.eliminate(gm.graph)  # nothing left to merge: the pass says so


def test_chains_merge_through_their_merged_inputs():
    def f(x):
        return (x.exp() * 2).sum(0) + (x.exp() * 2).sum(0), x.sin() + x.sin()

    gm = make_fx(f)(torch.randn(9, 23))
    cse.eliminate(gm.graph)
    gm.recompile()
    assert _count(gm, aten.exp.default) == _count(gm, aten.mul.Tensor) == _count(gm, aten.sin.default) == 1
    assert _count(gm, aten.sum.dim_IntList) == 1
    x = torch.randn(9, 23)
    for got, want in zip(gm(x), f(x)):
        torch.testing.assert_close(got, want)


def test_random_ops_draw_twice():
    def f(x):
        return torch.rand_like(x) + torch.rand_like(x), torch.nn.functional.dropout(x, 0.5) - \
            torch.nn.functional.dropout(x, 0.5)

    gm = make_fx(f)(torch.randn(8, 8))
    before = [n.target for n in gm.graph.nodes]
    assert not cse.eliminate(gm.graph)
    assert [n.target for n in gm.graph.nodes] == before


def test_outputs_stay_separate_tensors():
    """Two gradients computed alike must not be one tensor: accumulating into one would change the other."""
    def f(x):
        return x * 2, x * 2, (x * 2).view(-1)

    gm = make_fx(f)(torch.randn(4, 4))
    assert _count(gm, aten.mul.Tensor) == 3
    cse.eliminate(gm.graph)
    assert _count(gm, aten.mul.Tensor) == 3
    gm.recompile()
    a, b, c = gm(torch.ones(4, 4))
    assert a.data_ptr() != b.data_ptr() != c.data_ptr()


def test_a_read_after_a_write_is_not_the_read_before_it():
    def f(x, y):
        before = x * 3
        x.copy_(y)
        return before, x * 3

    gm = make_fx(f)(torch.randn(5), torch.randn(5))
    assert not cse.eliminate(gm.graph)
    gm.recompile()
    x, y = torch.randn(5), torch.randn(5)
    before, after = gm(x.clone(), y)
    torch.testing.assert_close(before, x * 3)
    torch.testing.assert_close(after, y * 3)


@pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")
def test_three_projections_of_one_norm_cast_it_once():
    """Under autocast, each projection casts the norm's output to bf16: one kernel writes that cast,
    not one kernel per projection (each reading the float32 norm output); gradients are eager's."""
    torch.manual_seed(0)
    norm, q, k, v = torch.nn.LayerNorm(24), *(torch.nn.Linear(24, 24) for _ in range(3))
    params = [*norm.parameters(), *q.parameters(), *k.parameters(), *v.parameters()]

    def f(x):
        h = norm(x)
        return (q(h) * k(h) + v(h)).float().pow(2).mean()

    comp = Compiler()
    compiled = torch.compile(f, backend=comp.with_our_partition, fullgraph=True)
    x = torch.randn(3, 11, 24)
    grads = []
    for fn in (compiled, f):
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(x)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in params]))
    comp.check()
    forward = comp.modules[0].source
    # The norm's kernel writes the one cast; without the merge, a kernel per other projection
    # would read the float32 norm output again to cast it (a pointwise kernel over the activations).
    assert "# pointwise (3, 11, 24)" not in forward, forward
    (got_loss, got), (want_loss, want) = grads
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-2, atol=1e-3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * max(1.0, w.abs().max().item()))
