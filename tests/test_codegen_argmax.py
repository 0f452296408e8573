"""argmax and argmin, rows in one block and rows longer than one (``KernelWriter._arg_step``): each lane keeps its
best value and that value's first index across the loop, then the row takes the first index among
the lanes that hold its best; NaN counts as the extreme, as eager's. A decode loop's greedy argmax
over a 32000-token vocabulary was an aten call (12 us a token on an H200). A row with a NaN gives
the first NaN's index, even after an infinity (it gave the infinity's). Through Triton's interpreter,
against eager exactly."""

from __future__ import annotations

import pytest
import torch
from codegen_helpers import INTERPRET, aten_calls, compile_fn, run

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")


def _rows(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Three rows of ``n``: random; a tie of the maximum (and minimum) at a late index and an early
    one in another lane; a NaN after an infinity. Plus a row of -inf (argmax: index 0)."""
    torch.manual_seed(0)
    x = torch.randn(4, n).to(dtype)
    x[1, n - 3] = x[1, 5] = 10.0
    x[1, n - 7] = x[1, 9] = -10.0
    x[2, 3], x[2, n - 11] = float("inf"), float("nan")
    x[3] = float("-inf")
    return x


@pytest.mark.parametrize("n", [301, 9001, 20011])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", [torch.argmax, torch.argmin])
def test_a_long_rows_arg_reduction_is_generated_and_gives_eagers_index(n, dtype, op):
    x = _rows(n, dtype)
    module = compile_fn(lambda x: op(x, -1), x)
    assert not aten_calls(module), module.source
    torch.testing.assert_close(run(module, x)[0], op(x, -1), rtol=0, atol=0)


def test_a_long_rows_argmax_of_a_computed_value_over_a_whole_tensor():
    """dim=None: the index into the flattened tensor; the value is computed in the loop (a decode
    step's logits times a temperature)."""
    x = _rows(5003, torch.float32)[:2]
    module = compile_fn(lambda x: torch.argmax(x * 0.7 - 1.0), x)
    assert not aten_calls(module), module.source
    assert run(module, x)[0].item() == torch.argmax(x * 0.7 - 1.0).item()
