"""Channels-last convolution graphs on CUDA (backend/aot/layout.py): the four conv nets trained
against eager (outputs, gradients, running statistics, eager's strides), the decision taken by
itself on a net with enough channels, and no cuDNN layout conversion kernels around convolutions
in a compiled training step (kernel names from torch.profiler; the names each run saw are printed).
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from conv_models import BasicBlock, ConvBNReLU, ConvNeXtBlock, MobileBlock  # noqa: E402
from layout_helpers import kink_distance, train_against_eager  # noqa: E402
from speed_helpers import kernel_times  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")

DEV = "cuda"
MODELS = {
    # not the global generator's input: one of its third ReLU's inputs is 8e-8 from the kink (see
    # kink_distance), where a forward whose statistics summed in another order took the other side
    "conv_bn_relu": lambda: (ConvBNReLU(), torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))),
    "resnet_basic_block": lambda: (BasicBlock(), torch.randn(8, 8, 32, 32)),
    "mobilenet_block": lambda: (MobileBlock(), torch.randn(8, 8, 32, 32)),
    "convnext_block": lambda: (ConvNeXtBlock(), torch.randn(8, 16, 16, 16)),
}
# cuDNN's own NCHW <-> NHWC conversion kernels (cudnn 8 and 9 name them so, in namespaces that
# change between releases); matched case-insensitively.
CONVERSION_KERNELS = ("nchwtonhwc", "nhwctonchw", "nchwtonhwckernel", "nhwctonchwkernel")


class WideNet(nn.Module):
    """A small ResNet stem and stage at 64-128 channels: the decision takes NHWC by itself here."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        self.block = BasicBlock(64)
        self.down = nn.Sequential(nn.Conv2d(64, 128, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(128),
                                  nn.ReLU())
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(self.block(self.stem(x)))
        return self.head(y.mean((2, 3)))



# mobilenet_block: one element of bn0.weight's gradient (a sum that cancels to ~3e-3 from terms of
# 1e2) is 1.31e-4 from cuDNN's where 1.25e-4 is allowed. Measured on the H100 against float64, in
# this block's batch-norm weight gradients the compiled kernels have 3-6x cuDNN's error, Inductor's
# as much as ours (bn1.weight: cuDNN 1.6e-5, Inductor 8.8e-5, cgtrees 1.0e-4), while the same math
# in plain eager float32 ops stays at cuDNN's. Measured since (benchmarks/results/check-bn-precision-
# mobilenet_block-at-88624dc.txt): the sum is not the cause (the same float32 terms summed in float64
# are as far off); the incoming gradient's float32 rounding, amplified ~450x by the cancellation,
# is. Triton's FMA contraction off changes nothing, and on the CPU aten's own float32 is as far off.
_BN_CANCELLATION = pytest.mark.xfail(strict=True, reason=(
    "issue 18, open: batch-norm weight gradients in compiled kernels have 3-6x cuDNN's float32 error "
    "(Inductor's too); mobilenet_block's bn0.weight exceeds 3x eager's error by 5%"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=_BN_CANCELLATION) if n == "mobilenet_block" else n
                                  for n in MODELS])
def test_training_channels_last_matches_eager(name, no_tf32):
    from torch._dynamo.utils import counters

    # forced: the small nets among these stay NCHW under the decision (at most 64 channels);
    # conv_bn_relu's input gradients were wrong here before the module checked aten's result strides
    model, x = MODELS[name]()
    model, x = model.to(DEV), x.to(DEV)
    assert kink_distance(model, x) > 1e-6, "an input at a ReLU's kink: gradients cannot be compared there"
    train_against_eager(model, x, {"layout_opt": "force"}, steps=3, buffers_against_float64=True)
    assert counters["cgtrees"]["layout_channels_last"] == 1
    assert counters["cgtrees"]["graph_fallbacks"] == 0


def test_decision_takes_training_channels_last(no_tf32):
    """Under the default ``auto``, a training graph with enough channels goes channels-last."""
    from torch._dynamo.utils import counters

    train_against_eager(WideNet().to(DEV), torch.randn(8, 3, 32, 32, device=DEV), {}, steps=3,
                        buffers_against_float64=True)
    assert counters["cgtrees"]["layout_channels_last"] == 1
    assert counters["cgtrees"]["graph_fallbacks"] == 0


def test_inference_channels_last_matches_eager(no_tf32):
    from torch._dynamo.utils import counters

    model, x = WideNet().to(DEV).eval(), torch.randn(8, 3, 32, 32, device=DEV)
    compiled = torch.compile(model, backend="cgtrees")
    with torch.no_grad():
        for _ in range(3):
            out, expected = compiled(x), model(x)
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
            assert out.stride() == expected.stride()
    assert counters["cgtrees"]["layout_channels_last"] == 1


def _kernel_names(model: nn.Module, x: torch.Tensor, options: dict) -> list[str]:
    """The GPU kernels of a training step after warmup (CUDA graphs off: one launch per kernel)."""
    compiled = torch.compile(model, backend="cgtrees", options={**options, "cudagraphs": False})
    for _ in range(2):
        compiled(x).sum().backward()
    return list(kernel_times(lambda: compiled(x).sum().backward(), calls=2))


def _conversions(names: list[str]) -> list[str]:
    return sorted({n for n in names if any(k in n.lower() for k in CONVERSION_KERNELS)})


def test_no_layout_conversion_kernels_around_convolutions():
    """With the layout on, cuDNN runs NHWC convolutions with no conversion kernel of its own; the
    same net with the layout off shows what cuDNN did before (printed, for the record)."""
    model, x = WideNet().to(DEV), torch.randn(32, 3, 64, 64, device=DEV)
    before = _kernel_names(copy.deepcopy(model), x, {"layout_opt": "off"})
    torch._dynamo.reset()
    after = _kernel_names(model, x, {})
    print(f"\nlayout off: {len(before)} distinct kernels, conversions {_conversions(before)}")
    print(f"layout on: {len(after)} distinct kernels, conversions {_conversions(after)}")
    print("layout on, kernels with nchw/nhwc/transpose in their names:",
          sorted({n for n in after if any(k in n.lower() for k in ("nchw", "nhwc", "transpose"))}))
    assert not _conversions(after)
