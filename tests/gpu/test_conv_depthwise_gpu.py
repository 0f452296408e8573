"""Our depthwise convolution kernels (backend/codegen/lower_conv.py) on the GPU: right, and not
slower than the library's.

mobilenet_v3_small's and convnext_atto's depthwise convolutions at batch 32, channels-last float32
as the layout pass gives them in inference, each followed by its batch norm (inference affine) and
activation. Against eager (cuDNN) within a tolerance for the window's sum, then per call against
Inductor's reduce-overhead (cuDNN's convolution and a fused pointwise kernel), both replaying CUDA
graphs. Bound: ours at most 1.3x Inductor's.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from speed_helpers import compiled, forward_step, medians_us  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BOUND = 1.3
CONFIGS = [  # channels, size, kernel, stride, activation
    (16, 112, 3, 2, "relu"),
    (72, 56, 3, 2, "relu"),
    (88, 28, 3, 1, "relu"),
    (96, 28, 5, 2, "hardswish"),
    (240, 14, 5, 1, "hardswish"),
    (576, 7, 5, 1, "hardswish"),
    (40, 56, 7, 1, "none"),
    (320, 7, 7, 1, "none"),
]


def block(activation: str, stride: int):
    def fn(x, w, scale, shift):
        y = F.conv2d(x, w, None, stride, w.shape[-1] // 2, 1, x.shape[1]) * scale + shift
        return {"relu": F.relu, "hardswish": F.hardswish, "none": lambda t: t}[activation](y)
    return fn


def inputs(channels: int, size: int, kernel: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    x = torch.randn(32, channels, size, size, device="cuda").to(memory_format=torch.channels_last)
    w = torch.randn(channels, 1, kernel, kernel, device="cuda").to(memory_format=torch.channels_last)
    scale, shift = torch.rand(1, channels, 1, 1, device="cuda") + 0.5, torch.randn(1, channels, 1, 1, device="cuda")
    return x, w, scale, shift


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"dw{c[2]}_s{c[3]}_{c[0]}x{c[1]}")
def test_depthwise_block_is_right_and_within_bound(config):
    channels, size, kernel, stride, activation = config
    fn = block(activation, stride)
    args = inputs(channels, size, kernel)
    ours = compiled(fn, "cgtrees")
    before = torch._dynamo.utils.counters["cgtrees"]["aten_fallbacks"]
    with torch.no_grad():
        torch.compiler.cudagraph_mark_step_begin()
        out = ours(*args).clone()
    assert torch._dynamo.utils.counters["cgtrees"]["aten_fallbacks"] == before  # no library call
    expected = fn(*[a.double() for a in args]).float()
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * kernel * kernel * scale)
    assert out.stride() == fn(*args).stride()
    times = medians_us({"cgtrees": forward_step(ours, args), "inductor": forward_step(compiled(fn, "inductor"), args)})
    ratio = times["cgtrees"] / times["inductor"]
    print(f"\ndepthwise {kernel}x{kernel} stride {stride} {channels}x{size}x{size} + {activation}: cgtrees "
          f"{times['cgtrees']:.1f} us, inductor {times['inductor']:.1f} us ({ratio:.2f}x)")
    assert times["cgtrees"] <= BOUND * times["inductor"], times
