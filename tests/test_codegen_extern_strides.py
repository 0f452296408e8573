"""An aten call that returns other strides than traced (backend/codegen/extern_strides.py).

cuDNN's convolution backward did this on the H100 in channels-last graphs; here a custom op whose
kernel and fake disagree stands for it: ``restrided(x, traced, actual)`` is ``2 * x`` in a buffer
of strides ``actual``, and its fake (what tracing sees) has strides ``traced``. Its result is read
by a generated kernel and returned as it is; both must equal eager's values, and what the module
returns has the strides it was traced with.
"""

from __future__ import annotations

import logging

import pytest
import torch
from codegen_helpers import INTERPRET, aten_call_targets, compile_fn, run

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")

SHAPE = (2, 3, 5, 4)
NCHW, NHWC = [60, 20, 4, 1], [60, 1, 12, 3]
# (2, 1, 5, 4): channels-last and contiguous differ only in the stride of the size-1 dimension
SIZE1_SHAPE, SIZE1_NCHW, SIZE1_NHWC = (2, 1, 5, 4), [20, 20, 4, 1], [20, 1, 4, 1]


CONTIGUOUS = torch.contiguous_format
RETURNED: list[torch.Tensor] = []  # what the custom ops' kernels returned, last call last


def _strided(x: torch.Tensor, stride: list[int], scale: float) -> torch.Tensor:
    RETURNED.append(torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device).copy_(scale * x))
    return RETURNED[-1]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@torch.library.custom_op("cgtrees_test::restrided", mutates_args=())
def restrided(x: torch.Tensor, traced: list[int], actual: list[int]) -> torch.Tensor:
    return _strided(x, actual, 2.0)


@restrided.register_fake
def _(x, traced, actual):
    return torch.empty_strided(x.shape, traced, dtype=x.dtype, device=x.device)


@torch.library.custom_op("cgtrees_test::restrided_pair", mutates_args=())
def restrided_pair(x: torch.Tensor, traced: list[int], actual: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two results, as ``convolution_backward`` has: the first strided as ``restrided``'s, the
    second (``3 * x``) contiguous as traced."""
    return _strided(x, actual, 2.0), 3.0 * x.contiguous()


@restrided_pair.register_fake
def _(x, traced, actual):
    return torch.empty_strided(x.shape, traced, dtype=x.dtype), torch.empty_like(x, memory_format=CONTIGUOUS)


def _one(x, traced, actual):
    y = torch.ops.cgtrees_test.restrided(x, traced, actual)
    return y * 3 + 1, y  # read by a kernel, and returned as it is


def _pair(x, traced, actual):
    a, b = torch.ops.cgtrees_test.restrided_pair(x, traced, actual)
    return a * b + 1, a, b


def _compile_and_compare(fn, x, traced, actual):
    m = compile_fn(lambda x: fn(x, traced, actual), x)
    out, expected = run(m, x), fn(x, traced, actual)
    assert len(out) == len(expected)
    for i, (o, e) in enumerate(zip(out, expected)):
        torch.testing.assert_close(o, e, msg=lambda msg, i=i: f"output {i}: {msg}")
    returned = out[1]  # the aten call's result itself: in the strides the graph was traced with
    assert returned.stride() == tuple(traced), f"returned with strides {returned.stride()}, traced {tuple(traced)}"
    return m


CASES = {
    "nhwc_traced_nchw": (SHAPE, NCHW, NHWC),  # meta says contiguous, aten returns channels-last
    "nchw_traced_nhwc": (SHAPE, NHWC, NCHW),  # the reverse (cuDNN's convolution backward on the H100)
    "size1_stride": (SIZE1_SHAPE, SIZE1_NCHW, SIZE1_NHWC),  # only a size-1 dimension's stride differs
}


@pytest.mark.parametrize("case", list(CASES))
def test_single_result_with_other_strides(case):
    shape, traced, actual = CASES[case]
    x = torch.randn(shape)
    m = _compile_and_compare(_one, x, traced, actual)
    assert m.source.count("with_traced_strides(") == 2  # the helper's definition, and its one check


@pytest.mark.parametrize("case", list(CASES))
def test_item_of_a_tuple_with_other_strides(case):
    shape, traced, actual = CASES[case]
    _compile_and_compare(_pair, torch.randn(shape), traced, actual)


@pytest.mark.parametrize("traced, actual, shape, copied", [
    (NHWC, NHWC, SHAPE, False),  # as traced: aten's tensor itself
    (SIZE1_NCHW, SIZE1_NHWC, SIZE1_SHAPE, False),  # only a size-1 stride differs: a view of it
    (NCHW, NHWC, SHAPE, True),  # a copy
])
def test_copied_only_where_strides_of_real_dimensions_differ(traced, actual, shape, copied):
    x = torch.randn(shape)
    m = compile_fn(lambda x: _one(x, traced, actual), x)
    returned = run(m, x)[1]
    assert returned.stride() == tuple(traced)
    assert (_storage(returned) != _storage(RETURNED[-1])) == copied


def test_a_copy_is_logged_once(caplog):
    x = torch.randn(SHAPE)
    m = compile_fn(lambda x: _one(x, NCHW, NHWC), x)
    with caplog.at_level(logging.DEBUG, logger="cgtrees.codegen"):
        run(m, x)
        run(m, x)
    said = [r.getMessage() for r in caplog.records if "came back from aten with strides" in r.getMessage()]
    assert len(said) == 1, said
    assert "(60, 1, 12, 3), traced (60, 20, 4, 1): copied into the traced strides" in said[0]


def test_trusted_aten_calls_are_not_checked():
    """A matrix product's result always has its meta's strides (extern_strides.TRUSTED): no check,
    and no helper in the module."""
    x, w = torch.randn(16, 32), torch.randn(32, 8)
    m = compile_fn(lambda x, w: torch.relu(x @ w) * 2, x, w)
    assert "aten.mm.default" in aten_call_targets(m)
    assert "with_traced_strides" not in m.source
    assert "import logging" not in m.source


def test_convolution_results_are_checked():
    """Convolutions choose their result's layout at run time: each result is checked, once."""
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    m = compile_fn(lambda x, w: torch.relu(torch.nn.functional.conv2d(x, w)), x, w)
    assert "aten.convolution.default" in aten_call_targets(m)
    call = m.source.split("\ndef call(")[1].split("\ndef call_aten(")[0]
    assert "    convolution = with_traced_strides(convolution, (144, 36, 6, 1), 'convolution')" in call
    torch.testing.assert_close(run(m, x, w)[0], torch.relu(torch.nn.functional.conv2d(x, w)))


def test_symbolic_strides_are_checked_with_the_sizes_of_the_call():
    """With dynamic shapes the traced strides are expressions of the sizes ``call`` reads."""
    f = lambda x, w: torch.relu(torch.nn.functional.conv2d(x, w))
    w = torch.randn(4, 5, 3, 3)
    m = compile_fn(f, torch.randn(2, 5, 8, 8), w, dynamic=True)
    assert "convolution = with_traced_strides(convolution, (" in m.source
    for shape in [(2, 5, 8, 8), (3, 5, 11, 11)]:
        x = torch.randn(shape)
        torch.testing.assert_close(run(m, x, w)[0], f(x, w))
