"""Long rows compiled on the GPU (``backend/codegen/online_softmax.py``, ``one_hot.py``): GPT-2's
loss at its vocabulary (bf16 logits, float32 cross-entropy, ignored targets) and a softmax and
log-softmax over 50257 columns, forward and backward, against eager and float64 at the scale of
the values; the loss is one forward kernel (its mean the row kernel's tail) and one backward kernel."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

VOCAB = 50257


def _check(fn, x: torch.Tensor, *rest):
    from codegen_helpers import Compiler, config

    comp = Compiler(config())
    compiled = torch.compile(fn, backend=comp.backend)
    xs = [x.detach().clone().requires_grad_() for _ in range(3)]
    xs[2] = x.detach().double().requires_grad_()
    outs = [compiled(xs[0], *rest), fn(xs[1], *rest), fn(xs[2], *rest)]
    for out in outs:
        (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
    comp.check()
    for got, eager, exact in ((outs[0], outs[1], outs[2]), (xs[0].grad, xs[1].grad, xs[2].grad)):
        exact = exact.detach()
        infinite = ~torch.isfinite(exact)  # log-softmax of -inf: -inf in eager and ours alike
        assert torch.equal(got.double()[infinite], exact[infinite])
        got, eager, exact = (v.double()[~infinite] for v in (got.detach(), eager.detach(), exact))
        eps = torch.finfo(x.dtype).eps
        ours, theirs = ((v - exact).abs().max().item() for v in (got, eager))
        assert ours <= 2 * theirs + 4 * eps * exact.abs().max().item(), (ours, theirs)
    return comp


def test_gpt2_loss_at_its_vocabulary_is_two_kernels_and_matches_eager():
    torch.manual_seed(0)
    logits = torch.randn(512, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    labels = torch.randint(0, VOCAB, (512,), device="cuda")
    labels[::7] = -100
    comp = _check(lambda x, y: F.cross_entropy(x.to(torch.promote_types(x.dtype, torch.float32)), y), logits, labels)
    forward, backward = comp.modules
    assert len(forward.graph.kernels) == 1 and len(backward.graph.kernels) == 1, \
        (forward.graph.kernels, backward.graph.kernels)


@pytest.mark.parametrize("kind", ["softmax", "log_softmax"])
def test_softmax_over_50257_columns_matches_eager(kind):
    torch.manual_seed(0)
    x = torch.randn(16, VOCAB, device="cuda") * 4
    x[3, ::5] = float("-inf")
    _check(lambda t: getattr(torch, kind)(t, -1), x)
