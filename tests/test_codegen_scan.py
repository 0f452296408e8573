"""Scans (backend/codegen/lower_scan.py: cumsum, cumprod) through Triton's interpreter, against eager.

A scan is one kernel holding whole rows (its input fused into it); rows longer than
``heuristics.SCAN_LIMIT`` are scanned in chunks (three kernels), rows of symbolic length run
through aten. Float sums are taken in another order than eager's sequential one: the tolerance
grows with the row's length and magnitudes.
"""

from __future__ import annotations

import pytest
import torch
from codegen_helpers import HALF_TOL, INTERPRET, aten_calls, compile_fn, kernel_count, run

from cgtrees.codegen import heuristics, lower_scan

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")





def check(fn, *inputs, kernels: int | None = None, row: int = 1):
    module = compile_fn(fn, *[t.clone() for t in inputs])
    assert not aten_calls(module), aten_calls(module)
    if kernels is not None:
        assert kernel_count(module) == kernels, module.source
    actual = run(module, *[t.clone() for t in inputs])
    expected = fn(*inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    for a, e in zip(actual, expected):
        if e.dtype in HALF_TOL:
            tol = HALF_TOL[e.dtype]
        elif e.is_floating_point():
            eps = torch.finfo(e.dtype).eps
            tol = dict(rtol=4 * eps, atol=4 * eps * row * max(e.abs().max().item(), 1.0))
        else:
            tol = dict(rtol=0, atol=0)
        torch.testing.assert_close(a, e, **tol)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                                   torch.int64, torch.bool])
def test_cumsum_dtypes(dtype):
    """Ints and bool sum as int64 (eager's promotion), half types in float32."""
    x = (torch.randn(37, 53) * 5).to(dtype)
    check(lambda x: torch.cumsum(x, 1), x, kernels=1, row=53)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_cumsum_along_each_dim_of_a_non_contiguous_input(dim):
    x = torch.randn(11, 7, 19).permute(2, 0, 1)  # (19, 11, 7)
    check(lambda x: torch.cumsum(x * 2 + 1, dim), x, kernels=1, row=19)


def test_cumprod_and_consumers():
    x = torch.rand(9, 23) + 0.5
    check(lambda x: (torch.cumprod(x, -1) * 3, torch.cumsum(x, 0).sum(1)), x, row=23)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_row_past_the_limit_is_scanned_in_chunks(dtype):
    """Chunks scanned, their totals scanned, each element combined with the totals before its
    chunk: two scans and a pointwise value (fused into the consumer); a padded last chunk."""
    n = heuristics.SCAN_LIMIT + 3001
    x = (torch.randn(2, n) * 3).to(dtype)
    module = check(lambda x: torch.cumsum(x, 1) * 2, x, kernels=3, row=n)
    assert "_chunks" in module.source and "_totals" in module.source


def test_a_long_scan_along_a_middle_dim_and_a_product():
    n = heuristics.SCAN_LIMIT + 2 * lower_scan.LONG_CHUNK  # no padding
    x = torch.randn(2, n, 3).permute(1, 0, 2) * 0.01 + 1  # (n, 2, 3), scanned along a strided dim
    check(lambda x: (torch.cumsum(x, 0), torch.cumprod(x, 0)), x, row=n)


def test_a_row_of_symbolic_length_runs_through_aten():
    x = torch.randn(2, 37)
    module = compile_fn(lambda x: torch.cumsum(x, 1), x, dynamic=True)
    assert aten_calls(module) == ["aten.cumsum.default"]
    torch.testing.assert_close(module.call([x])[0], torch.cumsum(x, 1))


def test_a_long_row_fits_one_block():
    x = torch.randn(3, 5000)
    check(lambda x: torch.cumsum(x, 1), x, kernels=1, row=5000)
