"""Sizes taken from data (a mixture of experts' tokens per expert, ``.tolist()`` then ``split``: JetMoE) go
through our generated kernels, forward and backward, as eager computes them.

Such a graph holds ``aten._local_scalar_dense`` (each size, an unbacked ``u0``), checks on it
(``aten._assert_scalar(u0 >= 0)``, which have no meta value) and kernels sized by it. Three things sent
JetMoE's graphs through aten (2026-11-29): the meta values propagated again over the missing ones of
the checks, where a fresh fake mode cannot run ``.item()``; a check's ``u0 >= 0`` that the generated
code could not write; and ``u0`` deleted right after it was read, as a buffer with no later reader.
"""

from __future__ import annotations

import pytest
import torch
from codegen_helpers import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

ROWS, WIDTH, EXPERTS = 37, 13, 3


def routed(x: torch.Tensor, gates: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each expert scales its rows (sorted by expert) by its own weights; the counts come from data."""
    sizes = gates.long().sum(0).tolist()
    parts = x.split(sizes, dim=0)
    return torch.cat([torch.tanh(p * w[i]) for i, p in enumerate(parts)], 0)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    experts = torch.sort(torch.randint(0, EXPERTS, (ROWS,), generator=generator)).values
    gates = torch.nn.functional.one_hot(experts, EXPERTS)
    return torch.randn(ROWS, WIDTH, generator=generator), gates, torch.randn(EXPERTS, WIDTH, generator=generator)


def test_sizes_from_data_compile_into_kernels_forward_and_backward(cgtrees_counters):
    x, gates, w = _inputs()
    mine, theirs = (x.clone().requires_grad_(), w.clone().requires_grad_()), (x.clone().requires_grad_(),
                                                                              w.clone().requires_grad_())
    compiled = torch.compile(routed, backend="cgtrees", fullgraph=True, options={"interpret": True})
    got, want = compiled(mine[0], gates, mine[1]), routed(theirs[0], gates, theirs[1])
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    seen = dict(cgtrees_counters)
    assert seen.get("graph_fallbacks", 0) == 0 and seen.get("kernels_generated", 0) >= 2, seen
