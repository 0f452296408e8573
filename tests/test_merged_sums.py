"""A sum over a view that merges dimensions (a Linear's bias gradient, ``grad.view(B*T, C).sum(0)``)
reads the unmerged value and fuses into the kernel that computes it
(``backend/codegen/merged_sums.py``), through Triton's interpreter: kernel counts, eager's values,
and the cases it leaves alone."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, compile_fn, kernel_count, run, sum_tolerance, trace

from cgtrees.codegen import merged_sums

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

aten = torch.ops.aten

CASES = {
    # name: (function of x, x's shape, rewritten)
    "bias gradient": (lambda x: x.view(-1, x.shape[-1]).sum(0), (2, 7, 48), True),
    "keepdim": (lambda x: x.view(14, 48).sum(0, keepdim=True), (2, 7, 48), True),
    "kept dimension merged too": (lambda x: x.view(6, 20).sum(0), (2, 3, 4, 5), True),
    "last dimension": (lambda x: x.view(14, 48).sum(-1), (2, 7, 48), True),
    "float64 sum of float32": (lambda x: x.view(14, 48).sum(0, dtype=torch.float64), (2, 7, 48), True),
    "a merge of a merge": (lambda x: x.view(2, 7, 48).view(14, 48).sum(0), (2, 7, 4, 12), True),
    "a split, left alone": (lambda x: x.view(2, 7, 48).sum(0), (14, 48), False),
    "size 1, left alone": (lambda x: x.view(7, 48).sum(0), (1, 7, 48), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sum_of_merged_view_fuses_with_its_input_and_gives_eagers_values(name):
    fn, shape, rewritten = CASES[name]
    def f(x):
        y = torch.sin(x) * 2
        return y, fn(y)

    x = torch.randn(shape)
    gm = trace(f, x)
    text = gm.code
    assert (merged_sums.rewritten(gm) is not gm) == rewritten
    assert gm.code == text  # the caller's graph as it was
    m = compile_fn(f, x)
    if rewritten:
        assert kernel_count(m) == 1, m.source
    got, want = run(m, x), f(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        # the summed values are float32 (our sin against eager's differs in the last bit), also
        # where the sum is taken in float64
        torch.testing.assert_close(g, w, **sum_tolerance(w.float(), 14))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def test_training_fuses_fc1s_bias_gradient_into_the_gelu_backward_kernel():
    torch.manual_seed(0)
    model, eager = MLP(), MLP()
    eager.load_state_dict(model.state_dict())
    comp = Compiler()
    x = torch.randn(3, 9, 32)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [torch.compile(model, backend=comp.with_our_partition, fullgraph=True)(xs[0]), eager(xs[1])]
    for out in outs:
        out.pow(2).sum().backward()
    comp.check()
    head = comp.modules[1].source.split("\ndef call(")[0]
    gelu = [k for k in re.split(r"\n\n\n(?=# )", head) if "aten.erf" in k]
    assert len(gelu) == 1 and re.search(r"= aten\.sum\.dim_IntList\(\w+, \[0, 1\]", gelu[0]), gelu
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(xs[0].grad, xs[1].grad)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
