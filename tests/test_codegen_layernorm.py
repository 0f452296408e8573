"""Layer norms through codegen (Triton's interpreter on CPU): each one kernel, forward and
backward, a channels-first one (permuted to channels last and back) included; values and every
gradient against eager."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, compile_fn, kernel_count, run, trained_against_eager

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")


def close(a, b, **kw):
    torch.testing.assert_close(a, b, **kw)


def test_layernorm_forward_is_one_kernel():
    x, w, b = torch.randn(123, 781), torch.randn(781), torch.randn(781)
    f = lambda x, w, b: F.layer_norm(x, (781,), w, b)
    m = compile_fn(f, x, w, b)
    assert kernel_count(m) == 1, m.source
    close(run(m, x, w, b)[0], f(x, w, b), atol=1e-5, rtol=1e-5)


def _layer_norm_2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A channels-first layer norm as timm's ConvNeXt writes it: over C of an (N, C, H, W) tensor,
    through a permute to channels last and back."""
    return F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), w, b, 1e-6).permute(0, 3, 1, 2)


@pytest.mark.parametrize("channels_last", [True, False], ids=["channels_last", "nchw"])
def test_channels_first_layernorm_is_one_kernel(channels_last):
    """The normalisation, over the kernel's dimensions permuted back, joins the statistics'
    kernel: one kernel, whose output has the input's layout (it was a statistics kernel and a
    pointwise one reading the input again)."""
    x, w, b = torch.randn(3, 37, 9, 11), torch.randn(37), torch.randn(37)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    m = compile_fn(_layer_norm_2d, x, w, b)
    assert kernel_count(m) == 1 and "def red_fused_layernorm_0(" in m.source, m.source
    out = run(m, x, w, b)[0]
    want = _layer_norm_2d(x, w, b)
    close(out, want, atol=1e-5, rtol=1e-5)
    assert out.stride() == want.stride()


def test_channels_first_layernorm_training():
    """Forward and backward of a channels-first layer norm between two convolutions: eager's
    output and every gradient."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(24, 24, 3, padding=1, groups=24)
            self.norm = torch.nn.LayerNorm(24)
            self.fc = torch.nn.Conv2d(24, 48, 1)

        def forward(self, x):
            x = self.conv(x)
            return self.fc(_layer_norm_2d(x, self.norm.weight, self.norm.bias)).sin()

    model = Block().to(memory_format=torch.channels_last)
    x = torch.randn(2, 24, 10, 12).to(memory_format=torch.channels_last).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    comp, out, ref, grads = trained_against_eager(model, x, x2)
    comp.check()
    close(out, ref, atol=1e-5, rtol=1e-5)
    close(x.grad, x2.grad, atol=1e-4 * x2.grad.abs().max().item(), rtol=1e-4)
    for (name, p), got in zip(model.named_parameters(), grads):
        close(got, p.grad, atol=1e-4 * p.grad.abs().max().item(), rtol=1e-4, msg=name)
    fw = comp.modules[0]
    # the depthwise convolution (its channels-last weights, then the convolution: a saved
    # activation, written where computed), the norm, the sin
    assert kernel_count(fw) == 4 and re.search(r"def red_fused_layernorm_\w*\d+\(", fw.source), fw.source
    assert len(re.findall(r"def pw_fused_convolution_\d+\(", fw.source)) == 2, fw.source


def test_training_layernorm_gelu_forward_and_backward():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(96), torch.nn.GELU())
    comp = Compiler()
    cmodel = torch.compile(model, backend=comp.backend)
    x = torch.randn(33, 96, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = cmodel(x)
    out.sum().backward()
    ref = model(x2)
    ref.sum().backward()
    close(out, ref, atol=1e-5, rtol=1e-5)
    close(x.grad, x2.grad, atol=1e-5, rtol=1e-4)
    assert len(comp.modules) == 2
    comp.check()
    fw, bw = comp.modules
    assert kernel_count(fw) == 1, fw.source


def test_weight_gradients_do_not_split_the_row_kernel():
    """A LayerNorm backward over many rows: the column sums of its weight gradients sit between
    the steps of the row computation in program order. The row work stays one kernel (the steps
    after the column sums join it), and the sibling column sums share their two stages: three
    kernels (it was ten before the scheduler looked past steps that do not fit)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.LayerNorm(32))
    x = torch.randn(8192, 32)
    comp, out, ref, grads = trained_against_eager(model, x, x)
    close(out, ref, atol=1e-5, rtol=1e-5)
    for got, p in zip(grads, model.parameters()):
        close(got, p.grad, atol=1e-3, rtol=1e-4)
    comp.check()
    fw, bw = comp.modules
    assert "_part_ptr" in bw.source, bw.source  # the column sums over 8192 rows are split
    assert kernel_count(bw) == 3, bw.source
