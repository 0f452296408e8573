"""Pooling (backend/codegen/lower_pool.py) through Triton's interpreter, against eager:
max_pool2d_with_indices, avg_pool2d and their backwards, for kernel sizes, strides, paddings,
dilations and ceil mode, every dtype eager pools, non-contiguous inputs. These windows are small:
each op is an unrolled pointwise kernel (tests/test_codegen_pool_layout.py covers the reduction
form of larger ones). Max pool's indices must equal eager's exactly: the first max in window
order, the last NaN where a window holds one. The modules must hold the pooling kernels, never an
aten call for them; the one case generated code cannot match (a window with no element inside the
input) runs through aten. A small conv net trains through AOTAutograd with our table: outputs and
gradients against eager.
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

aten = torch.ops.aten

# (kernel, stride, padding, dilation, ceil_mode): resnet's stem, overlapping and disjoint windows,
# rectangular ones, dilation, ceil mode with a partial last window, padding with ceil mode.
MAX_CONFIGS = [
    ((3, 3), (2, 2), (1, 1), (1, 1), False),
    ((2, 2), (2, 2), (0, 0), (1, 1), False),
    ((3, 2), (1, 2), (1, 0), (1, 1), False),
    ((3, 3), (2, 1), (1, 1), (2, 1), False),
    ((2, 3), (2, 2), (0, 1), (1, 2), True),
    ((3, 3), (3, 3), (1, 1), (1, 1), True),
]






def generated(fn, *inputs, terms: int = 1, wide_reference: bool = False):
    """Compile ``fn``, check that no aten call is left, compare with eager (exactly for max pool's
    values and indices: ``terms=1`` on a max is exact). ``wide_reference``: half types are summed
    in float32 and rounded once (eager's CPU kernels round after every add)."""
    module = compile_fn(fn, *[t.clone() for t in inputs])
    assert not aten_calls(module), aten_calls(module)
    actual = run(module, *[t.clone() for t in inputs])
    expected = fn(*inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    if wide_reference and expected[0].dtype in HALF_TOL:
        wide = fn(*[t.float() if t.dtype in HALF_TOL else t for t in inputs])
        wide = list(wide) if isinstance(wide, (tuple, list)) else [wide]
        expected = [w.to(e.dtype) for w, e in zip(wide, expected)]
    for a, e in zip(actual, expected):
        tol = sum_tolerance(e, terms) if terms > 1 else dict(atol=0, rtol=0)
        torch.testing.assert_close(a, e, equal_nan=True, **tol)
    return module


def max_pool(config):
    k, s, p, d, ceil = config
    return lambda x: F.max_pool2d(x, k, s, p, d, ceil_mode=ceil, return_indices=True)


# ------------------------------------------------------------------------------------------ max pool
@pytest.mark.parametrize("config", MAX_CONFIGS, ids=str)
def test_max_pool_values_and_indices(config):
    """Every window geometry, irregular sizes, values with many ties (indices: the first max)."""
    x = torch.randint(-4, 5, (2, 3, 13, 11)).float()
    module = generated(max_pool(config), x)
    assert re.search(r"def pw_fused_max_pool2d_\d+\(", module.source), module.source


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8,
                                   torch.uint8])
def test_max_pool_dtypes(dtype):
    """Integer windows start from the type's lowest value (a window of negatives picks one)."""
    x = (torch.randn(2, 5, 9, 10) * 50).to(dtype)
    generated(max_pool(MAX_CONFIGS[0]), x)


def test_max_pool_ties_nan_and_infinity():
    """Ties: the first max in window order; NaN: the last NaN of the window (eager replaces its
    running max on every NaN); a window of -inf and padding: its first element inside."""
    x = torch.randint(0, 3, (1, 2, 9, 9)).float()
    x[0, 0, 1, 1] = x[0, 0, 2, 3] = x[0, 0, 3, 2] = float("nan")
    x[0, 1, :4, :4] = float("-inf")
    x[0, 1, 6, 7] = float("inf")
    for config in MAX_CONFIGS[:3]:
        generated(max_pool(config), x)


def test_max_pool_channels_last_and_3d_inputs():
    x = torch.randn(2, 6, 10, 7).to(memory_format=torch.channels_last)
    generated(max_pool(MAX_CONFIGS[0]), x)
    generated(max_pool(MAX_CONFIGS[4]), torch.randn(4, 9, 8))  # (C, H, W): no batch dimension


def test_max_pool_of_a_lazy_input_is_one_kernel():
    """relu -> max pool: the ReLU is computed in the pooling kernel, not written first."""
    x = torch.randn(2, 3, 12, 12)
    module = generated(lambda x: F.max_pool2d(torch.relu(x * 2), 3, 2, 1, return_indices=True), x)
    assert module.source.count("@triton.jit") == 1, module.source


def test_a_window_outside_the_input_runs_through_aten():
    """Dilation 5 with padding 1 on 4 rows: the first window holds no element of the input (eager
    gives -inf and an index past the plane); codegen hands that op to aten, values still right."""
    x = torch.randn(1, 2, 4, 4)
    fn = max_pool(((2, 2), (1, 1), (1, 1), (5, 5), False))
    module = compile_fn(fn, x)
    assert aten_calls(module) == ["aten.max_pool2d_with_indices.default"]
    for a, e in zip(run(module, x), fn(x)):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("config", MAX_CONFIGS, ids=str)
def test_max_pool_backward(config):
    """The gradient of each window lands on its argmax; overlapping windows that pick one element
    add up (ties make many such elements)."""
    k, s, p, d, ceil = config
    x = torch.randint(-3, 4, (2, 3, 13, 11)).float()
    _, indices = F.max_pool2d(x, k, s, p, d, ceil_mode=ceil, return_indices=True)
    grad = torch.randn(indices.shape)
    fn = lambda g, x, i: aten.max_pool2d_with_indices_backward(g, x, k, s, p, d, ceil, i)  # noqa: E731
    module = generated(fn, grad, x, indices, terms=9)
    assert re.search(r"def pw_fused_max_pool2d_backward_\d+\(", module.source), module.source


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_max_pool_backward_dtypes(dtype):
    """Half types sum in float32 and round once; tolerances scale with the values (x100)."""
    x = torch.randint(-2, 3, (2, 4, 11, 11)).to(dtype)
    _, indices = F.max_pool2d(x, 3, 1, 1, return_indices=True)
    grad = (torch.randn(indices.shape) * 100).to(dtype)
    fn = lambda g, x, i: aten.max_pool2d_with_indices_backward(g, x, [3, 3], [1, 1], [1, 1], [1, 1], False, i)  # noqa: E731
    generated(fn, grad, x, indices, terms=9, wide_reference=True)


# ------------------------------------------------------------------------------------------ avg pool
# (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
AVG_CONFIGS = [
    ((2, 2), (2, 2), (0, 0), False, True, None),
    ((3, 3), (2, 2), (1, 1), False, True, None),
    ((3, 3), (2, 2), (1, 1), False, False, None),
    ((3, 2), (2, 1), (1, 0), True, True, None),
    ((3, 3), (2, 3), (1, 1), True, False, None),
    ((2, 3), (1, 2), (1, 1), False, True, 5),
]


def avg_pool(config):
    k, s, p, ceil, include, divisor = config
    return lambda x: F.avg_pool2d(x, k, s, p, ceil, include, divisor)


@pytest.mark.parametrize("config", AVG_CONFIGS, ids=str)
def test_avg_pool(config):
    x = torch.randn(2, 3, 13, 11)
    module = generated(avg_pool(config), x, terms=6)
    assert re.search(r"def pw_fused_avg_pool2d_\d+\(", module.source), module.source


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_avg_pool_dtypes(dtype):
    """int64 divides truncating toward zero, as eager does."""
    x = (torch.randn(2, 3, 10, 9) * 20).to(dtype)
    generated(avg_pool(AVG_CONFIGS[3]), x, terms=6)
    generated(avg_pool(AVG_CONFIGS[5]), x.to(memory_format=torch.channels_last), terms=6)


@pytest.mark.parametrize("config", AVG_CONFIGS, ids=str)
def test_avg_pool_backward(config):
    k, s, p, ceil, include, divisor = config
    x = torch.randn(2, 3, 13, 11)
    grad = torch.randn(avg_pool(config)(x).shape)
    fn = lambda g, x: aten.avg_pool2d_backward(g, x, k, s, p, ceil, include, divisor)  # noqa: E731
    module = generated(fn, grad, x, terms=6)
    assert re.search(r"def pw_fused_avg_pool2d_backward_\d+\(", module.source), module.source


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_avg_pool_backward_half(dtype):
    x = torch.randn(2, 3, 12, 12).to(dtype)
    grad = (torch.randn(2, 3, 6, 6) * 100).to(dtype)
    fn = lambda g, x: aten.avg_pool2d_backward(g, x, [3, 3], [2, 2], [1, 1], False, True, None)  # noqa: E731
    generated(fn, grad, x, terms=4, wide_reference=True)


# ------------------------------------------------------------------------------------------ training
class PoolNet(nn.Module):
    """conv -> BN -> ReLU -> max pool (resnet's stem), conv -> ReLU -> avg pool, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 3, 2, 1)
        y = F.avg_pool2d(F.relu(self.conv2(y)), 3, 2, 1, count_include_pad=False)
        return self.head(y.flatten(1))


def test_conv_net_trains_with_generated_pooling():
    torch.manual_seed(0)
    model = PoolNet()
    x = torch.randn(4, 3, 11, 11)
    compiler, out, expected, grads = trained_against_eager(model, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4 * max(p.grad.abs().max().item(), 1.0))
    sources = "\n".join(m.source for m in compiler.modules)
    calls = {c for m in compiler.modules for c in aten_calls(m)}
    assert not {c for c in calls if "pool" in c}, calls
    for op in ("max_pool2d_with_indices", "avg_pool2d", "max_pool2d_with_indices_backward", "avg_pool2d_backward"):
        assert re.search(rf"^#   \w+ = aten\.{op}\.default\(", sources, re.M), op  # a kernel's origins
