"""Depthwise convolutions (backend/codegen/lower_conv.py) through Triton's interpreter, against
eager computed in float64: kernel sizes up to convnext's 7x7, strides, paddings (wider than the
window too), dilation, channel multipliers, bias or none, NCHW and channels-last, every floating
dtype. A generated module holds no aten call for them, and a consumer (batch norm's affine, an
activation) is in the same kernel. Every other convolution stays a library call and stays right.
A mobilenet-like block trains through AOTAutograd: outputs and gradients against eager (the
backward's ``convolution_backward`` is aten's).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from codegen_helpers import (
    HALF_TOL,
    INTERPRET,
    aten_calls,
    compile_fn,
    run,
    sum_tolerance,
    trained_against_eager,
)

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")

# (channels, multiplier, kernel, stride, padding, dilation, bias, channels_last)
CONFIGS = [
    (4, 1, 3, 1, 1, 1, True, False),       # mobilenet's stride-1 block
    (4, 1, 3, 2, 1, 1, False, True),       # its stride-2 block, channels-last
    (6, 1, 5, 2, 2, 1, True, True),        # 5x5, stride 2
    (4, 1, 7, 1, 3, 1, True, True),        # convnext's 7x7
    (3, 2, 3, 1, 1, 1, True, False),       # two output channels per input channel
    (4, 1, (3, 5), (1, 2), (0, 2), 1, False, False),  # rectangular, no padding in one dimension
    (4, 1, 3, 1, 2, 2, True, False),       # dilated
    (2, 1, 3, 1, 4, 1, True, False),       # padding wider than the window: border outputs are the bias
]


def _depthwise(config):
    channels, _, _, stride, padding, dilation, bias, _ = config
    if bias:
        return lambda x, w, b: F.conv2d(x, w, b, stride, padding, dilation, channels)
    return lambda x, w: F.conv2d(x, w, None, stride, padding, dilation, channels)


def _inputs(config, dtype=torch.float32, size=(9, 11)):
    channels, multiplier, kernel, _, _, _, bias, channels_last = config
    kernel = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    x = torch.randn(2, channels, *size).to(dtype)
    w = torch.randn(channels * multiplier, 1, *kernel).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return (x, w, torch.randn(channels * multiplier).to(dtype)) if bias else (x, w)


def _check(fn, inputs, terms: int):
    module = compile_fn(fn, *[t.clone() for t in inputs])
    assert not aten_calls(module), aten_calls(module)
    (actual,) = run(module, *[t.clone() for t in inputs])
    eager = fn(*inputs)
    expected = fn(*[t.double() for t in inputs]).to(eager.dtype)
    torch.testing.assert_close(actual, expected, **sum_tolerance(expected, terms))
    assert actual.stride() == eager.stride()
    return module


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_depthwise_convolution(config):
    kernel = config[2] if isinstance(config[2], tuple) else (config[2], config[2])
    module = _check(_depthwise(config), _inputs(config), kernel[0] * kernel[1] + 1)
    assert re.search(r"def pw_fused_convolution_\d+\(", module.source), module.source


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_depthwise_convolution_dtypes(dtype):
    """Half types are summed in float32 and rounded once: against the float64 result rounded."""
    config = CONFIGS[2]
    inputs = _inputs(config, dtype)
    module = compile_fn(_depthwise(config), *inputs)
    assert not aten_calls(module)
    (actual,) = run(module, *inputs)
    expected = _depthwise(config)(*[t.double() for t in inputs]).to(dtype)
    tol = HALF_TOL.get(dtype) or sum_tolerance(expected, 26)
    torch.testing.assert_close(actual, expected, **tol)


def test_consumers_fuse_into_the_convolution():
    """Depthwise conv -> batch norm (inference) -> hardswish: one kernel, nothing written between
    (and, channels-last, a small one before it that lays the weights out channels-innermost)."""
    config = CONFIGS[1]
    stats = (torch.randn(4), torch.rand(4) + 0.5, torch.randn(4), torch.randn(4))

    def fn(x, w, mean, var, gamma, beta):
        y = F.conv2d(x, w, None, 2, 1, 1, 4)
        return F.hardswish(F.batch_norm(y, mean, var, gamma, beta, False, 0.1, 1e-5))

    module = _check(fn, (*_inputs(config), *stats), 10)
    assert module.source.count("@triton.jit") == 2, module.source
    assert "convolution_weights_ptr + (x0*4 + x1)" in module.source, module.source  # (KH*KW, C)
    assert re.search(r"def pw_fused_convolution_\w+\(\w+, convolution_weights_ptr, ", module.source), module.source


def _kernels(source: str) -> dict[str, str]:
    """Each kernel's name -> the aten nodes listed above it (its origins)."""
    found = re.finditer(r"^# (?:pointwise|reduction)[^\n]*\n((?:#[^\n]*\n)*)@triton.jit\ndef (\w+)\(", source, re.M)
    return {m.group(2): m.group(1) for m in found}


def test_a_reduction_across_the_channels_stride_leaves_the_window_out():
    """Squeeze-excite's mean over (H, W) of a channels-last convolution reads each row across the
    channels' stride: the convolution stays in a pointwise kernel (memory order) and the mean reads
    its output. A sum over the channels reads along them and takes it in."""
    x, w = _inputs(CONFIGS[1])

    def excite(x, w):
        y = F.relu(F.conv2d(x, w, None, 2, 1, 1, 4))
        return y * y.mean((2, 3), keepdim=True).sigmoid()

    kernels = _kernels(_check(excite, (x, w), 10).source)
    mean = [k for k, origins in kernels.items() if "aten.mean" in origins]
    assert len(mean) == 1 and "aten.convolution" not in kernels[mean[0]], kernels
    assert any("aten.convolution" in o and k.startswith("pw_") for k, o in kernels.items()), kernels

    def across_channels(x, w):
        y = F.conv2d(x, w, None, 2, 1, 1, 4)
        return y * y.sum(1, keepdim=True)

    kernels = _kernels(_check(across_channels, (x, w), 40).source)
    assert [k for k, o in kernels.items() if "aten.convolution" in o and k.startswith("red_")], kernels


@pytest.mark.parametrize("case", ["ordinary", "grouped", "transposed", "1d", "window_9x9"])
def test_other_convolutions_stay_library_calls(case):
    x = torch.randn(2, 4, 12, 12)
    fn, inputs = {
        "ordinary": (lambda x, w: F.conv2d(x, w, padding=1), (x, torch.randn(6, 4, 3, 3))),
        "grouped": (lambda x, w: F.conv2d(x, w, padding=1, groups=2), (x, torch.randn(4, 2, 3, 3))),
        "transposed": (lambda x, w: F.conv_transpose2d(x, w, groups=4), (x, torch.randn(4, 1, 3, 3))),
        "1d": (lambda x, w: F.conv1d(x, w, groups=4), (torch.randn(2, 4, 12), torch.randn(4, 1, 3))),
        "window_9x9": (lambda x, w: F.conv2d(x, w, padding=4, groups=4), (x, torch.randn(4, 1, 9, 9))),
    }[case]
    module = compile_fn(fn, *inputs)
    assert any("convolution" in c for c in aten_calls(module)), module.source
    (actual,) = run(module, *inputs)
    torch.testing.assert_close(actual, fn(*inputs), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ training
class Block(nn.Module):
    """mobilenet_v3's inverted residual: expand (1x1), depthwise 3x3 stride 2, squeeze-excite,
    project (1x1), each with batch norm; hardswish and ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.expand, self.bn1 = nn.Conv2d(3, 12, 1, bias=False), nn.BatchNorm2d(12)
        self.depthwise, self.bn2 = nn.Conv2d(12, 12, 3, 2, 1, groups=12, bias=False), nn.BatchNorm2d(12)
        self.se1, self.se2 = nn.Conv2d(12, 4, 1), nn.Conv2d(4, 12, 1)
        self.project, self.bn3 = nn.Conv2d(12, 6, 1, bias=False), nn.BatchNorm2d(6)
        self.wide = nn.Conv2d(6, 12, 5, padding=2, groups=6)  # multiplier 2, with bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.hardswish(self.bn1(self.expand(x)))
        y = F.relu(self.bn2(self.depthwise(y)))
        y = y * F.hardsigmoid(self.se2(F.relu(self.se1(y.mean((2, 3), keepdim=True)))))
        return self.wide(self.bn3(self.project(y)))


@pytest.mark.parametrize("channels_last", [False, True])
def test_mobilenet_block_trains(channels_last):
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 3, 15, 15)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    compiler, out, expected, grads = trained_against_eager(model, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    for (name, p), g in zip(model.named_parameters(), grads):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4 * max(p.grad.abs().max().item(), 1.0), msg=name)
    forward = compiler.modules[0]
    assert len([c for c in aten_calls(forward) if "convolution" in c]) == 4, aten_calls(forward)  # the 1x1s
    # the two depthwise ones are in kernels (the first in batch norm's statistics, which it feeds)
    in_kernels = set(re.findall(r"^#   (\w+) = aten\.convolution\.default\(.*, (\d+)\)$", forward.source, re.M))
    assert sorted(groups for _, groups in in_kernels) == ["12", "6"], forward.source
