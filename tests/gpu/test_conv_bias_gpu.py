"""A convolution's bias on CUDA is our add, fused into the convolution's consumer
(backend/aot/decompositions.py): no aten kernel beside cuDNN's, and eager's values and gradients,
NCHW and channels-last. Before, aten added each bias with a kernel of its own (40 a call, 0.3 ms, on
convnext_atto's inference)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from layout_helpers import train_against_eager  # noqa: E402
from speed_helpers import kernel_times  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

DEV = "cuda"


class ConvGelu(nn.Module):
    """A depthwise 7x7 and a 1x1 convolution, each with a bias, as in a ConvNeXt block."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.dw, self.pw = nn.Conv2d(c, c, 7, padding=3, groups=c), nn.Conv2d(c, 2 * c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.pw(self.dw(x)))


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_bias_add_is_ours_in_inference(memory_format, no_tf32):
    torch.manual_seed(0)
    model = ConvGelu().to(DEV).eval()
    x = torch.randn(4, 32, 28, 28, device=DEV).contiguous(memory_format=memory_format)
    compiled = torch.compile(model, backend="cgtrees", options={"cudagraphs": False, "cache": False})
    with torch.no_grad():
        want = model(x)
        for _ in range(2):
            got = compiled(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
        assert [name for name in kernel_times(lambda: compiled(x), calls=1) if "at::native" in name] == []


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_bias_add_apart_trains_as_eager(memory_format, no_tf32):
    model = ConvGelu().to(DEV)
    x = torch.randn(4, 32, 28, 28, device=DEV).contiguous(memory_format=memory_format)
    train_against_eager(model, x, {"cache": False}, steps=3, buffers_against_float64=False)
