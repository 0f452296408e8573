"""Our decomposition table's own entries (backend/aot/decompositions.py), beyond torch's core table.

convolution_backward's bias gradient is taken out as a sum that codegen fuses and lays out itself;
the weight and input gradients stay one aten call. Values against eager for convolutions and
transposed convolutions, NCHW and channels-last, with and without bias.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees.aot.decompositions import decomposition_table

aten = torch.ops.aten


def _conv_backward(mask):
    def fn(grad, x, w):
        return aten.convolution_backward.default(grad, x, w, [w.shape[0]], [1, 1], [1, 1], [1, 1], False,
                                                 [0, 0], 1, mask)
    return fn


def _calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def test_bias_gradient_is_a_sum_beside_the_convolution_backward():
    grad, x, w = torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3)
    gm = make_fx(_conv_backward([True, True, True]), decomposition_table=decomposition_table())(grad, x, w)
    backward = [n for n in _calls(gm) if n.target is aten.convolution_backward.default]
    sums = [n for n in _calls(gm) if n.target is aten.sum.dim_IntList]
    assert len(backward) == 1 and backward[0].args[-1] == [True, True, False]
    assert len(sums) == 1 and sums[0].args[0].name == "grad_1" and sums[0].args[1] == [0, 2, 3]
    expected = _conv_backward([True, True, True])(grad, x, w)
    for got, want in zip(gm(grad, x, w), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_no_bias_gradient_leaves_the_op_whole():
    grad, x, w = torch.randn(2, 4, 5, 5), torch.randn(2, 3, 5, 5), torch.randn(4, 3, 3, 3)
    gm = make_fx(_conv_backward([True, True, False]), decomposition_table=decomposition_table())(grad, x, w)
    targets = [n.target for n in _calls(gm)]
    assert aten.sum.dim_IntList not in targets
    assert targets.count(aten.convolution_backward.default) == 1


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("module", ["conv", "conv_transpose", "conv_no_bias"])
def test_convolution_gradients_match_eager(module, channels_last):
    torch.manual_seed(0)
    make = {"conv": lambda: nn.Conv2d(8, 6, 3, 1, 1), "conv_transpose": lambda: nn.ConvTranspose2d(8, 6, 3, 2, 1),
            "conv_no_bias": lambda: nn.Conv2d(8, 6, 3, 1, 1, bias=False)}[module]
    ours, ref = make(), make()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 8, 10, 10)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = torch.compile(ours, backend="cgtrees")(xo), ref(xr)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(xo.grad, xr.grad)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, n=name: f"{n}: {m}")


def _convolution(stride, padding, transposed, groups=1):
    def fn(x, w, b):
        nd = x.dim() - 2
        return aten.convolution.default(x, w, b, [stride] * nd, [padding] * nd, [1] * nd, transposed, [0] * nd,
                                        groups)
    return fn


CONVOLUTIONS = {  # name: (function, input, weight, bias shapes)
    "conv2d": (_convolution(1, 1, False), (2, 3, 8, 8), (4, 3, 3, 3), (4,)),
    "depthwise": (_convolution(1, 3, False, groups=6), (2, 6, 9, 9), (6, 1, 7, 7), (6,)),
    "transposed": (_convolution(2, 1, True), (2, 3, 5, 5), (3, 4, 3, 3), (4,)),
    "conv1d": (_convolution(2, 0, False), (2, 3, 11), (5, 3, 3), (5,)),
    "conv3d": (_convolution(1, 1, False), (1, 2, 4, 5, 6), (3, 2, 3, 3, 3), (3,)),
}


@pytest.mark.parametrize("name", list(CONVOLUTIONS))
def test_cuda_convolution_bias_is_added_apart(name):
    """Traced with CUDA (fake) tensors, a convolution's bias becomes a broadcast add after the
    convolution; the traced graph, run on real CPU tensors, gives aten's convolution with its bias."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fn, *shapes = CONVOLUTIONS[name]
    with FakeTensorMode():
        fake = [torch.empty(s, device="cuda") for s in shapes]
        gm = make_fx(fn, decomposition_table=decomposition_table())(*fake)
    convs = [n for n in _calls(gm) if n.target is aten.convolution.default]
    adds = [n for n in _calls(gm) if n.target is aten.add.Tensor]
    assert len(convs) == 1 and convs[0].args[2] is None
    assert len(adds) == 1 and adds[0].args[0] is convs[0]
    torch.manual_seed(0)
    real = [torch.randn(s) for s in shapes]
    torch.testing.assert_close(gm(*real), fn(*real))


def test_cpu_convolution_keeps_its_bias():
    fn, *shapes = CONVOLUTIONS["conv2d"]
    gm = make_fx(fn, decomposition_table=decomposition_table())(*[torch.randn(s) for s in shapes])
    convs = [n for n in _calls(gm) if n.target is aten.convolution.default]
    assert len(convs) == 1 and convs[0].args[2] is not None
    assert aten.add.Tensor not in [n.target for n in _calls(gm)]
