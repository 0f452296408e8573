"""Pooling kernels that follow the layout they are given (backend/codegen/lower_pool.py).

Windows of at most ``UNROLL_LIMIT`` elements (backwards: covering windows) are pointwise kernels
over the output with the window unrolled, so a channels-last tensor is walked channels fastest:
neighbouring threads read and write neighbouring addresses. Checked here through Triton's
interpreter: the generated kernels' indexing, eager's values and indices exactly (NaNs, -inf,
ties, padding, ceil mode, dilation) in NCHW and channels-last for float32/float16/bfloat16,
backwards, eager's output strides, fusion with the ops around, symbolic sizes, larger windows in
the reduction form, and a channels-last conv net trained against eager.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from codegen_helpers import INTERPRET, aten_calls, compile_fn, kernel_count, run, sum_tolerance
from layout_helpers import train_against_eager
from test_codegen_pool import MAX_CONFIGS

from cgtrees.codegen.lower_pool import UNROLL_LIMIT

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")

aten = torch.ops.aten
CL = torch.channels_last
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def kernels(module) -> str:
    return module.source[module.source.find("@triton.jit"):module.source.find("\ndef call(")]


def check_outputs(actual, expected, terms: int = 1) -> None:
    """Values (exactly where ``terms == 1``: a max, or indices) and eager's strides."""
    for a, e in zip(actual, expected):
        tol = sum_tolerance(e, terms) if terms > 1 else dict(atol=0, rtol=0)
        torch.testing.assert_close(a, e, equal_nan=True, **tol)
        assert a.stride() == e.stride(), (a.stride(), e.stride())


def generated(fn, *inputs, terms: int = 1):
    module = compile_fn(fn, *[t.clone() for t in inputs])
    assert not aten_calls(module), aten_calls(module)
    expected = fn(*inputs)
    check_outputs(run(module, *[t.clone() for t in inputs]), expected if isinstance(expected, tuple) else [expected],
                  terms)
    return module


def special_values(dtype: torch.dtype, memory_format: torch.memory_format) -> torch.Tensor:
    """Many ties, a window with several NaNs, a block of -inf (padding around it), an inf."""
    x = torch.randint(0, 3, (2, 5, 11, 9)).to(dtype)
    x[0, 0, 1, 1] = x[0, 0, 2, 3] = x[0, 0, 3, 2] = x[1, 4, 10, 8] = float("nan")
    x[0, 1, :4, :4] = float("-inf")
    x[1, 2, 6, 7] = float("inf")
    return x.contiguous(memory_format=memory_format)


def max_pool(config):
    k, s, p, d, ceil = config
    return lambda x: F.max_pool2d(x, k, s, p, d, ceil_mode=ceil, return_indices=True)


def max_pool_backward(config):
    k, s, p, d, ceil = config
    return lambda g, x, i: aten.max_pool2d_with_indices_backward(g, x, k, s, p, d, ceil, i)


# ------------------------------------------------------------------------------ memory order
def innermost_symbol(source: str, channels: int) -> str:
    m = re.search(rf"\b(x\d+) = xindex % {channels}\n", source)
    assert m, f"the channels are not the fastest dimension:\n{source}"
    return m.group(1)


def assert_unit_stride(source: str, symbol: str, pointers: tuple[str, ...]) -> None:
    """Every load from and store to ``pointers`` moves one element per step of ``symbol``."""
    for ptr in pointers:
        accesses = re.findall(rf"tl\.(?:load|store)\({ptr}_ptr \+ \((.*?)\), ", source)
        assert accesses, f"no access to {ptr}:\n{source}"
        for index in accesses:
            assert re.search(rf"(?<![\w*]){symbol}(?![\w*])", index), f"{ptr}[{index}]: {symbol} is not unit-stride"


def test_channels_last_max_pool_walks_channels_fastest():
    """The resnet stem's max pool, fused after a BN-style scale and shift and a ReLU: one pointwise
    kernel whose threads run along the channels, for every input load and both outputs' stores."""
    x = torch.randn(2, 6, 13, 9).to(memory_format=CL)
    scale, shift = torch.randn(6, 1, 1), torch.randn(6, 1, 1)
    fn = lambda x, a, b: F.max_pool2d(torch.relu(x * a + b), 3, 2, 1, return_indices=True)  # noqa: E731
    module = generated(fn, x, scale, shift)
    source = kernels(module)
    assert kernel_count(module) == 1 and "def pw_" in source, source
    assert_unit_stride(source, innermost_symbol(source, 6), ("x_1", "max_pool2d_with_indices", "getitem_1"))
    assert source.count("tl.load(a_1_ptr") == source.count("tl.load(b_1_ptr") == 1, source  # per channel: once


def test_fused_input_that_masks_its_own_loads():
    """A padded input (its loads masked to its own range) fused into the window: read where both
    its range and the window's bounds allow, the pad value elsewhere inside the window."""
    x = torch.randn(2, 6, 9, 7).to(memory_format=CL)
    fn = lambda x: F.max_pool2d(F.pad(x, (2, 0), value=-0.5), 3, 2, 1, return_indices=True)  # noqa: E731
    module = generated(fn, x)
    assert kernel_count(module) == 1, module.source


def test_channels_last_avg_pool_walks_channels_fastest():
    x = torch.randn(2, 6, 13, 9).to(memory_format=CL)
    module = generated(lambda x: F.avg_pool2d(x, 3, 2, 1), x, terms=9)
    source = kernels(module)
    assert "def pw_fused_avg_pool2d_" in source, source
    assert_unit_stride(source, innermost_symbol(source, 6), ("x_1", "avg_pool2d"))


def test_channels_last_backwards_walk_channels_fastest():
    """Max pool's backward reads the gradient and the indices, average pool's the gradient, at
    unit stride along the channels; each is one pointwise kernel writing grad-input."""
    x = torch.randn(2, 6, 13, 9).to(memory_format=CL)
    _, indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    grad = torch.randn(indices.shape).to(memory_format=CL)
    module = generated(max_pool_backward(MAX_CONFIGS[0]), grad, x, indices, terms=4)
    source = kernels(module)
    assert kernel_count(module) == 1 and "def pw_fused_max_pool2d_backward_" in source, source
    assert_unit_stride(source, innermost_symbol(source, 6), ("g_1", "i_1", "max_pool2d_with_indices_backward"))

    fn = lambda g, x: aten.avg_pool2d_backward(g, x, [3, 3], [2, 2], [1, 1], False, True, None)  # noqa: E731
    module = generated(fn, grad, x, terms=4)
    source = kernels(module)
    assert kernel_count(module) == 1 and "def pw_fused_avg_pool2d_backward_" in source, source
    assert_unit_stride(source, innermost_symbol(source, 6), ("g_1", "avg_pool2d_backward"))


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("config", MAX_CONFIGS, ids=str)
def test_max_pool_values_and_indices_are_eagers(config, dtype, memory_format):
    """Every window geometry of test_codegen_pool (padding, dilation, ceil mode), ties (the first
    max), NaNs (the last NaN of a window), -inf windows (their first element inside)."""
    generated(max_pool(config), special_values(dtype, memory_format))


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_max_pool_backward_is_eagers(dtype, memory_format):
    """Gradients of windows that overlap and pick one element (ties) add up; half types sum in
    float32 and round once (eager's CPU kernel rounds after each add: the tolerance is HALF_TOL)."""
    for config in (MAX_CONFIGS[0], MAX_CONFIGS[3], MAX_CONFIGS[4]):
        x = special_values(dtype, memory_format)
        _, indices = F.max_pool2d(x, *config[:4], ceil_mode=config[4], return_indices=True)
        grad = torch.randn(indices.shape).to(dtype).contiguous(memory_format=memory_format)
        generated(max_pool_backward(config), grad, x, indices, terms=9)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("include_pad, ceil, divisor", [(True, False, None), (False, True, None), (True, True, 5)])
def test_avg_pool_forward_and_backward_are_eagers(dtype, memory_format, include_pad, ceil, divisor):
    x = torch.randn(2, 5, 11, 9).to(dtype).contiguous(memory_format=memory_format)
    args = ([3, 3], [2, 2], [1, 1], ceil, include_pad, divisor)
    generated(lambda x: aten.avg_pool2d(x, *args), x, terms=9)
    grad = torch.randn(aten.avg_pool2d(x, *args).shape).to(dtype).contiguous(memory_format=memory_format)
    generated(lambda g, x: aten.avg_pool2d_backward(g, x, *args), grad, x, terms=4)


def test_symbolic_sizes():
    """Bounds checks that cannot be settled on sizes are kept; values and indices stay eager's."""
    for memory_format in (torch.contiguous_format, CL):
        for config in (MAX_CONFIGS[0], MAX_CONFIGS[5]):  # padding; ceil mode (no dilation: see _geometry_ok)
            x = special_values(torch.float32, memory_format)
            module = compile_fn(max_pool(config), x, dynamic=True)
            assert not aten_calls(module) and "def pw_" in kernels(module), module.source
            check_outputs(run(module, x), max_pool(config)(x))


# ------------------------------------------------------------------------------ fusion
def test_relu_backward_fuses_into_max_pool_backward():
    """max pool's backward gathered and a ReLU's backward applied in one kernel, channels-last."""
    x = torch.randn(2, 6, 12, 10).to(memory_format=CL)
    _, indices = F.max_pool2d(x.relu(), 3, 2, 1, return_indices=True)
    grad = torch.randn(indices.shape).to(memory_format=CL)

    def fn(g, x, i):
        dx = aten.max_pool2d_with_indices_backward(g, x.relu(), [3, 3], [2, 2], [1, 1], [1, 1], False, i)
        return aten.threshold_backward(dx, x.relu(), 0)

    module = generated(fn, grad, x, indices, terms=4)
    assert kernel_count(module) == 1, module.source


# ------------------------------------------------------------------------------ large windows
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, CL], ids=["nchw", "nhwc"])
def test_windows_past_the_unroll_limit_are_reductions(memory_format):
    """A 5x5 window is unrolled, 2x13 (26 elements) is a window reduction, values and indices
    eager's either way; a backward with more covering windows than the limit (6x6 stride 1: 36)
    is a reduction over them."""
    assert UNROLL_LIMIT == 25
    x = special_values(torch.float32, memory_format)
    wide = F.pad(x, (4, 4)).contiguous(memory_format=memory_format)  # 17 columns for a 13-wide window
    module = generated(max_pool(((5, 5), (2, 2), (2, 2), (1, 1), False)), x)
    assert re.search(r"def pw_fused_max_pool2d_\d+\(", kernels(module)), kernels(module)
    module = generated(max_pool(((2, 13), (1, 2), (1, 6), (1, 1), True)), wide)
    assert re.search(r"def red_fused_max_pool2d_\d+\(", kernels(module)), kernels(module)
    plain = torch.randn(wide.shape).contiguous(memory_format=memory_format)
    module = generated(lambda x: F.avg_pool2d(x, (2, 13), (1, 2), (1, 6), True, False), plain, terms=26)
    assert re.search(r"def red_fused_avg_pool2d_\d+\(", kernels(module)), kernels(module)

    config = ((6, 6), (1, 1), (2, 3), (1, 1), False)
    _, indices = F.max_pool2d(x, *config[:4], return_indices=True)
    grad = torch.randn(indices.shape).contiguous(memory_format=memory_format)
    module = generated(max_pool_backward(config), grad, x, indices, terms=36)
    assert re.search(r"def red_fused_max_pool2d_backward_\d+\(", kernels(module)), kernels(module)
    fn = lambda g, x: aten.avg_pool2d_backward(g, x, [6, 6], [1, 1], [2, 3], False, True, None)  # noqa: E731
    module = generated(fn, grad, x, terms=36)
    assert re.search(r"def red_fused_avg_pool2d_backward_\d+\(", kernels(module)), kernels(module)


# ------------------------------------------------------------------------------ training
class Stem(nn.Module):
    """resnet's stem (conv -> BN -> ReLU -> max pool 3x3/2), a conv -> ReLU -> avg pool, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 3, 2, 1)
        y = F.avg_pool2d(F.relu(self.conv2(y)), 3, 2, 1, count_include_pad=False)
        return self.head(y.mean((2, 3)))


def test_channels_last_training_matches_eager(cgtrees_counters):
    """The graphs rewritten channels-last: outputs, gradients (values and strides) and running
    statistics against eager over two steps, every graph generated."""
    train_against_eager(Stem(), torch.randn(2, 3, 15, 13), {"interpret": True, "cache": False, "layout_opt": "force"},
                        steps=2, buffers_against_float64=False)
    assert cgtrees_counters["layout_channels_last"] == 1
    assert cgtrees_counters["graph_fallbacks"] == 0
