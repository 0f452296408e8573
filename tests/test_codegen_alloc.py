"""Allocations and functional copies (backend/codegen/lower_pointwise.py) through Triton's interpreter.

``empty_strided``, ``new_empty_strided``, ``new_empty``, ``empty.memory_format``, ``empty_like``
are buffers ``call`` allocates and no kernel fills (``torch.empty_strided`` in the module), or
nothing at all where only ``copy``s write into them. ``copy(self, src)`` is ``src`` broadcast to
``self``'s size, cast to its dtype as eager casts, laid out with ``self``'s strides, fused with its
source's producer: accumulate-grad's ``copy(new_empty_strided(grad, ...), grad)``, in every
compiled-autograd backward, is one kernel with whatever computed the gradient. Values of an
allocation are garbage, so OpInfo's value sweep cannot take them: their OpInfo samples are checked
here for size, strides, dtype and device.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.utils._pytree as pytree
from codegen_helpers import INTERPRET, aten_calls, compile_fn, kernel_count, run
from torch.testing._internal.common_methods_invocations import op_db

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")
aten = torch.ops.aten




def compile_whole(fn, *inputs, kernels: int | None = None, dynamic: bool = False):
    """Compile ``fn``; no aten call may be left in ``call`` (and ``kernels`` kernels, if given)."""
    module = compile_fn(fn, *[t.clone() for t in inputs], dynamic=dynamic)
    assert not aten_calls(module), aten_calls(module)
    if kernels is not None:
        assert kernel_count(module) == kernels, module.source
    return module


def assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor, exact: bool = True) -> None:
    """Equal values (exactly, unless a kernel computes math eager computes another way), size,
    strides and dtype."""
    assert actual.stride() == expected.stride(), (actual.stride(), expected.stride())
    tol = dict(rtol=0, atol=0) if exact else {}
    torch.testing.assert_close(actual, expected, equal_nan=True, **tol)


# ------------------------------------------------------------------------------------------- copy
def _grad_clone(grad: torch.Tensor) -> torch.Tensor:
    """Accumulate-grad's clone of a gradient with the parameter's strides (here transposed ones)."""
    return aten.copy(aten.new_empty_strided(grad, [13, 7], [1, 13]), grad)


def test_copy_into_new_empty_strided_fuses_with_its_producer():
    x = torch.randn(13, 7)
    module = compile_whole(lambda x: _grad_clone(torch.tanh(x) * 3.0), x, kernels=1)
    assert "new_empty_strided" not in module.source.split("\ndef call(")[1].split("\ndef call_aten(")[0]
    assert_same_tensor(run(module, x.clone())[0], _grad_clone(torch.tanh(x) * 3.0), exact=False)


def test_copy_of_a_reduction_joins_its_kernel():
    x = torch.randn(5, 3, 7)

    def fn(x):
        s = x.sum((0, 1))
        return aten.copy(aten.new_empty_strided(s, [7], [1]), s)

    module = compile_whole(fn, x, kernels=1)
    torch.testing.assert_close(run(module, x.clone())[0], fn(x))


def test_copy_of_a_graph_input_is_a_copy_not_an_alias():
    x = torch.randn(13, 7)
    module = compile_whole(_grad_clone, x, kernels=1)
    out = run(module, x)[0]
    assert out.data_ptr() != x.data_ptr()
    assert_same_tensor(out, _grad_clone(x))


@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
    (torch.float32, torch.int32), (torch.float32, torch.bool), (torch.int64, torch.float32),
    (torch.bool, torch.float32), (torch.float16, torch.int64), (torch.int32, torch.int8),
])
def test_copy_converts_dtype_as_eager(src_dtype, dst_dtype):
    src = (torch.randn(6, 11) * 100).to(src_dtype)
    src[0, :3] = 0  # zeros for the bool conversions
    dst = torch.empty(6, 11, dtype=dst_dtype)
    module = compile_whole(aten.copy, dst, src, kernels=1)
    assert_same_tensor(run(module, dst.clone(), src.clone())[0], aten.copy(dst, src))


def test_copy_broadcasts_src_into_self_strides():
    dst = torch.randn(7, 5).t()  # (5, 7), strides (1, 5)
    src = torch.randn(7)
    module = compile_whole(aten.copy, dst, src, kernels=1)
    out = run(module, dst.clone(), src.clone())[0]
    assert_same_tensor(out, aten.copy(dst, src))
    assert out.stride() == (1, 5)


def test_copy_with_dynamic_sizes():
    def fn(x):
        n = x.shape[0]
        return aten.copy(aten.new_empty_strided(x, [n, 3], [1, n], dtype=torch.float16), x * 2)

    module = compile_whole(fn, torch.randn(9, 3), kernels=1, dynamic=True)
    for rows in (9, 4):
        x = torch.randn(rows, 3)
        assert_same_tensor(run(module, x.clone())[0], fn(x))


# ------------------------------------------------------------------------------------ allocations
def test_empty_returned_is_an_allocation_without_kernel():
    def fn(x):
        return torch.empty_strided((4, 6), (1, 4), dtype=torch.float16), x + 1

    x = torch.randn(3)
    module = compile_whole(fn, x, kernels=1)
    call_body = module.source.split("\ndef call(")[1].split("\ndef call_aten(")[0]
    assert re.search(r"= torch\.empty_strided\(\[4, 6\], \[1, 4\], dtype=torch\.float16", call_body), call_body
    empty, plus = run(module, x.clone())
    assert (empty.shape, empty.stride(), empty.dtype) == ((4, 6), (1, 4), torch.float16)
    torch.testing.assert_close(plus, x + 1)


def test_empty_returned_and_copied_into():
    """An allocation that is returned too is allocated; the copy into it is a buffer of its own."""
    def fn(x):
        e = torch.empty_like(x.t())
        return aten.copy(e, x.t().exp()), e

    x = torch.randn(5, 4)
    module = compile_whole(fn, x, kernels=1)
    copied, empty = run(module, x.clone())
    assert_same_tensor(copied, fn(x)[0], exact=False)
    assert (empty.shape, empty.stride(), empty.dtype) == ((4, 5), (1, 4), torch.float32)  # like x.t()
    assert empty.data_ptr() != copied.data_ptr()


def test_empty_with_dynamic_sizes_is_allocated_at_each_call():
    def fn(x):
        return aten.new_empty_strided(x, [x.shape[0], 2], [1, x.shape[0]]), x.sum()

    module = compile_whole(fn, torch.randn(6), dynamic=True)
    for n in (6, 10):
        empty, total = run(module, torch.ones(n))
        assert (empty.shape, empty.stride(), empty.dtype) == ((n, 2), (1, n), torch.float32)
        assert total.item() == n


ALLOCATION_OPS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)


def _allocation_cases():
    for op in op_db:
        if op.name in ALLOCATION_OPS and not op.variant_test_name:
            for dtype in DTYPES:
                if dtype in op.supported_dtypes("cpu"):
                    yield pytest.param(op, dtype, id=f"{op.name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("op,dtype", list(_allocation_cases()))
def test_opinfo_allocation_metadata(op, dtype):
    """OpInfo's samples of the allocation ops: generated without an aten call, the result laid out
    as eager lays it out (values are garbage in both)."""
    for sample in list(op.sample_inputs("cpu", dtype, requires_grad=False))[:4]:
        leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def fn(*tensors, leaves=leaves, spec=spec, positions=positions):
            values = list(leaves)
            for i, t in zip(positions, tensors):
                values[i] = t
            inp, args, kwargs = pytree.tree_unflatten(values, spec)
            return op.op(inp, *args, **kwargs), torch.zeros(1)  # a second output: a graph with a kernel

        tensors = [leaves[i] for i in positions]
        expected = fn(*tensors)[0]
        module = compile_whole(fn, *tensors)
        actual = run(module, *[t.clone() for t in tensors])[0]
        assert (actual.shape, actual.stride(), actual.dtype, actual.device) == \
            (expected.shape, expected.stride(), expected.dtype, expected.device), sample


def test_copy_from_another_device_is_left_to_aten():
    from cgtrees.codegen.lowering import why_not_lowered

    graph = torch.fx.Graph()
    dst, src = graph.placeholder("dst"), graph.placeholder("src")
    copy = graph.call_function(aten.copy.default, (dst, src))
    dst.meta["val"], src.meta["val"] = torch.empty(3), torch.empty(3, device="meta")
    copy.meta["val"] = torch.empty(3)
    assert why_not_lowered(copy, None) == "copy to another device (meta -> cpu)"
    src.meta["val"] = torch.empty(3)
    assert why_not_lowered(copy, None) is None
