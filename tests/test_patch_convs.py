"""A convolution over disjoint patches as one GEMM (``backend/codegen/patch_convs.py``) on CPU, through
Triton's interpreter: which convolutions qualify, the timed choice, and values and gradients against
eager where the rewrite is forced (``gemm_decisions=rewrite``). The timing itself needs a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, TimedPlan, aten_call_targets, compile_fn, config, run, trace

from cgtrees.codegen import patch_convs

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

aten = torch.ops.aten


class PatchEmbed(torch.nn.Module):
    """A ViT's input end: a patch convolution, its patches as tokens, a layer norm."""

    def __init__(self, patch: int = 4, dim: int = 24, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Conv2d(3, dim, patch, stride=patch, bias=bias)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))


def _close(got: torch.Tensor, want: torch.Tensor, terms: int) -> None:
    eps = torch.finfo(want.dtype).eps
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got, want, rtol=8 * eps, atol=8 * eps * terms * scale)


def _convolutions(module) -> int:
    return sum(t.startswith("aten.convolution") for t in aten_call_targets(module))


@pytest.mark.parametrize("bias", [True, False])
def test_a_patch_embedding_trains_as_eager_with_its_convolution_a_gemm(bias):
    """The forward runs no convolution (a GEMM over the patches instead); the backward's
    weight gradient is cuDNN's as traced. Outputs and every gradient, the input's too, as eager's."""
    model = PatchEmbed(bias=bias)
    x = torch.randn(2, 3, 16, 20)
    comp = Compiler(config(gemm_decisions="rewrite"))
    xc = x.clone().requires_grad_()
    out = torch.compile(model, backend=comp.backend)(xc)
    (out * out).sum().backward()
    comp.check()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    xe = x.clone().requires_grad_()
    ref = model(xe)
    (ref * ref).sum().backward()
    forward = comp.modules[0]
    assert _convolutions(forward) == 0, aten_call_targets(forward)
    assert {"aten.addmm.default", "aten.mm.default"} & set(aten_call_targets(forward))  # float32: the bias may
    # be added by the kernel that reads the product (``lower_addmm``)
    _close(out, ref, 48)
    for got, want in zip([*grads, xc.grad], [*[p.grad for p in model.parameters()], xe.grad]):
        _close(got, want, 2 * 48 * 20)


def test_a_result_that_leaves_the_graph_keeps_the_traced_strides():
    """The GEMM's result is channels-last; a graph output is copied back to eager's layout."""
    x, w, b = torch.randn(3, 4, 6, 10), torch.randn(8, 4, 2, 2), torch.randn(8)
    module = compile_fn(lambda t, w, b: F.conv2d(t, w, b, stride=2) * 2, x, w, b, cfg=config(gemm_decisions="rewrite"))
    (out,) = run(module, x, w, b)
    ref = F.conv2d(x, w, b, stride=2) * 2
    assert _convolutions(module) == 0
    assert out.stride() == ref.stride()
    _close(out, ref, 16)


def test_a_view_the_new_strides_cannot_express_reads_a_copy_in_the_traced_layout():
    """``view(N, O*Hp*Wp)`` of the result needs its traced (contiguous) strides: the rewrite copies
    the GEMM's result into them and the view reads that, where the channels-last result fails."""
    x, w, b = torch.randn(2, 3, 8, 12), torch.randn(8, 3, 4, 4), torch.randn(8)
    gm = trace(lambda t, w, b: F.conv2d(t, w, b, stride=4).view(2, -1).sin(), x, w, b)
    plan = TimedPlan({"as traced": 2.0, "patches": 1.0})
    rewritten = patch_convs.rewritten(gm, plan)
    targets = [n.target for n in rewritten.graph.nodes]
    assert aten.convolution.default not in targets and aten.addmm.default in targets
    clones = [n for n in rewritten.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == 2  # the patches laid out as rows, and the result in its traced layout
    torch.testing.assert_close(rewritten(x, w, b), F.conv2d(x, w, b, stride=4).view(2, -1).sin(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight, kw, why", [
    ((8, 3, 3, 3), dict(stride=2), "stride is not the kernel"),
    ((8, 3, 4, 4), dict(stride=4, padding=1), "padding"),
    ((8, 2, 4, 4), dict(stride=4, groups=2), "groups"),
    ((8, 4, 1, 1), dict(), "a 1x1 kernel is already a GEMM over pixels"),
    ((8, 4, 3, 3), dict(stride=3), "the kernel does not divide 16"),
    ((8, 4, 2, 2), dict(stride=2, dilation=2), "dilation"),
])
def test_convolutions_that_do_not_tile_their_input_stay(weight, kw, why):
    w = torch.randn(weight)
    gm = trace(lambda t, w: F.conv2d(t, w, **kw), torch.randn(2, 4 if weight[1] != 3 else 3, 16, 16), w)
    node = next(n for n in gm.graph.nodes if n.target is aten.convolution.default)
    assert not patch_convs.tiles_its_input(node), why


@pytest.mark.parametrize("us, rewritten", [({"as traced": 10.0, "patches": 5.0}, True),
                                           ({"as traced": 10.0, "patches": 9.9}, False),
                                           ({"as traced": 5.0, "patches": 10.0}, False)])
def test_the_timing_decides_with_a_margin(us, rewritten):
    """The GEMM form is taken only where it beats the convolution by more than ``MARGIN`` (2%); each
    choice is a note with both timings."""
    x, w = torch.randn(2, 3, 8, 8), torch.randn(8, 3, 4, 4)
    gm = trace(lambda t, w: F.conv2d(t, w, stride=4).relu(), x, w)
    plan = TimedPlan(us)
    out = patch_convs.rewritten(gm, plan)
    assert (aten.convolution.default not in [n.target for n in out.graph.nodes]) == rewritten
    (line,) = plan.notes
    assert line[2] == (patch_convs.PATCHES if rewritten else patch_convs.TRACED)
    assert dict(line[3]) == {patch_convs.TRACED: us["as traced"], patch_convs.PATCHES: us["patches"]}
    assert (out is gm) == (not rewritten)  # the graph handed in is never changed


def test_bfloat16_inference_matches_eager():
    model = PatchEmbed(patch=8, dim=32).to(torch.bfloat16).eval()
    x = torch.randn(2, 3, 32, 24, dtype=torch.bfloat16)
    comp = Compiler(config(gemm_decisions="rewrite"))
    with torch.no_grad():
        got = torch.compile(model, backend=comp.backend)(x)
        want = model(x)
    comp.check()
    assert _convolutions(comp.modules[0]) == 0
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
