"""A convolution over disjoint patches as one GEMM (``backend/codegen/patch_convs.py``) on CPU, through
Triton's interpreter: which convolutions qualify, the timed choice, and values and gradients against
eager where the rewrite is forced (``gemm_decisions=rewrite``). The timing itself needs a GPU."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, TimedPlan, aten_call_targets, compile_fn, config, run, trace
from layout_helpers import train_against_eager
from torch.fx.experimental.proxy_tensor import make_fx

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
    """Convolutions and their backwards that ``call`` runs."""
    return sum(t.startswith("aten.convolution") for t in aten_call_targets(module))


@pytest.mark.parametrize("bias", [True, False])
def test_a_patch_embedding_trains_as_eager_with_its_convolution_a_gemm(bias):
    """The forward runs no convolution (a GEMM over the patches instead), nor does the backward
    (the input's and the weight's gradients are GEMMs over the same patches). Outputs and every
    gradient, the input's too, as eager's."""
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
    forward, backward = comp.modules
    assert _convolutions(forward) == 0, aten_call_targets(forward)
    assert _convolutions(backward) == 0 and aten_call_targets(backward).count("aten.mm.default") == 2, \
        aten_call_targets(backward)
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


def test_the_weight_gradient_under_autocast_is_a_gemm_as_close_as_eagers():
    """A ViT's case: the image needs no gradient, so the backward computes the weight's only, from
    bf16 patches. Against float64, as close as eager's bf16 is."""
    model = PatchEmbed(patch=4, dim=32)
    x = torch.randn(3, 3, 16, 24)
    r = torch.randn(3, 24, 32)  # a loss whose gradient is not ~0 (a layer norm's squares sum to a constant)
    comp = Compiler(config(gemm_decisions="rewrite"))
    compiled = torch.compile(model, backend=comp.backend)
    grads = []
    for m in (compiled, model):
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            out = m(x)
        (out.float() * r).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    (model.double()(x.double()) * r.double()).sum().backward()
    exact = [p.grad for p in model.parameters()]
    backward = comp.modules[1]
    assert _convolutions(backward) == 0 and aten_call_targets(backward).count("aten.mm.default") == 1, \
        aten_call_targets(backward)
    for ours, eager, want in zip(*grads, exact):  # bf16 values rounded in other places than eager's: one
        err, eager_err = ((g.double() - want).abs().max().item() for g in (ours, eager))  # rounding more
        assert err <= eager_err + 2 ** -8 * want.abs().max().item(), (err, eager_err)


@pytest.mark.parametrize("channels_last", [False, True])
def test_the_backward_reads_a_channels_last_gradient_as_rows_in_place(channels_last):
    """Both gradients as aten's; the output gradient is copied to rows only where it is not
    channels-last (the clones: the patches, the input gradient put back, and those rows)."""
    g, x, w = torch.randn(2, 8, 4, 5), torch.randn(2, 3, 16, 20), torch.randn(8, 3, 4, 4)
    if channels_last:
        g = g.to(memory_format=torch.channels_last)

    def grads(g, x, w):
        return aten.convolution_backward(g, x, w, None, [4, 4], [0, 0], [1, 1], False, [0, 0], 1,
                                         [True, True, False])[:2]

    gm = trace(grads, g, x, w)
    out = patch_convs.rewritten(gm, TimedPlan({"as traced": 2.0, "patches": 1.0}))
    assert aten.convolution_backward.default not in [n.target for n in out.graph.nodes]
    clones = [n for n in out.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == (2 if channels_last else 3), out.graph
    for got, want in zip(out(g, x, w), grads(g, x, w)):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _backward(g, x, w, mask):
    out = aten.convolution_backward(g, x, w, [8], [4, 4], [0, 0], [1, 1], False, [0, 0], 1, mask)
    return [t for t in out if t is not None]


def test_a_backward_that_computes_the_bias_gradient_stays():
    """``aot.decompositions`` takes a bias gradient out of ``convolution_backward`` as a sum; where one
    is left in (``output_mask[2]``), the node is not rewritten."""
    g, x, w = torch.randn(2, 8, 4, 5), torch.randn(2, 3, 16, 20), torch.randn(8, 3, 4, 4)
    for mask, tiles in (([False, True, True], False), ([True, True, False], True), ([False, False, False], False)):
        gm = make_fx(functools.partial(_backward, mask=mask), tracing_mode="fake")(g, x, w)  # no decompositions
        (node,) = gm.graph.find_nodes(op="call_function", target=aten.convolution_backward.default)
        assert patch_convs.tiles_its_input(node) == tiles, mask


def test_channels_last_weights_from_the_layout_pass_train_as_eager_with_no_convolution(tmp_path):
    """The layout pass gives a convolution-heavy graph's weights channels-last strides; the patches'
    columns then run (kh, kw, C), the weight's memory order, and neither module runs a convolution."""
    options = {"interpret": True, "cache": False, "layout_opt": "force", "gemm_decisions": "rewrite",
               "debug_dir": str(tmp_path)}
    train_against_eager(PatchEmbed(), torch.randn(2, 3, 16, 20), options, steps=2, buffers_against_float64=False)
    modules = [p.read_text() for p in tmp_path.glob("g*_*ward_*.py")]
    assert len(modules) == 2 and all("aten.mm." in m or "aten.addmm." in m for m in modules), modules
    assert not any("aten.convolution" in m for m in modules)


@pytest.mark.parametrize("mask", [[True, True, False], [False, True, False]])
def test_a_channels_last_weight_forward_and_backward_as_aten(mask):
    """Values and strides as aten's convolution and convolution_backward, with a channels-last weight."""
    x, w, b = torch.randn(2, 3, 16, 20), torch.randn(8, 3, 4, 4).to(memory_format=torch.channels_last), torch.randn(8)
    g = torch.randn(2, 8, 4, 5)
    plan = TimedPlan({"as traced": 2.0, "patches": 1.0})
    conv = patch_convs.rewritten(trace(lambda x, w, b: F.conv2d(x, w, b, stride=4).sin(), x, w, b), plan)
    assert aten.convolution.default not in [n.target for n in conv.graph.nodes]
    torch.testing.assert_close(conv(x, w, b), F.conv2d(x, w, b, stride=4).sin(), rtol=1e-5, atol=1e-5)
    backward = patch_convs.rewritten(trace(functools.partial(_backward, mask=mask), g, x, w), plan)
    assert aten.convolution_backward.default not in [n.target for n in backward.graph.nodes]
    for got, want in zip(backward(g, x, w), _backward(g, x, w, mask)):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
