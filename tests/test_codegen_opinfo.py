"""Op sweep driven by PyTorch's OpInfo samples: for every op we lower, one sample per dtype,
compiled through ``cgtrees.codegen`` (Triton's interpreter on CPU), compared with eager within the
dtype's tolerance. An op that codegen hands to aten is still run (and must still be right)."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from codegen_helpers import INTERPRET, aten_calls, compile_fn, run
from grad_sweep_helpers import torch_op_notices_quiet
from torch.testing._internal.common_methods_invocations import op_db

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: the sweep runs compiled in tests/gpu")

OPS = {
    # pointwise
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "maximum", "minimum", "pow",
    "atan2", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "logical_not",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "where", "clamp", "clamp_min", "clamp_max", "neg",
    "abs", "exp", "exp2", "log", "log2", "log10", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh",
    "sigmoid", "erf", "floor", "ceil", "trunc", "round", "reciprocal", "sign", "square", "lerp", "addcmul",
    "addcdiv", "masked_fill", "isnan", "isinf", "nan_to_num", "nn.functional.relu", "nn.functional.gelu",
    "nn.functional.silu", "nn.functional.hardtanh", "nn.functional.leaky_relu", "nn.functional.elu",
    "nn.functional.softplus", "nn.functional.mish", "nn.functional.hardswish", "nn.functional.hardsigmoid",
    "sinh", "cosh", "asin", "acos", "atan", "xlogy", "hypot", "frac", "deg2rad", "rad2deg", "full_like", "zeros_like",
    "ones_like", "clone", "contiguous",
    # reductions and normalizations
    "sum", "mean", "amax", "amin", "prod", "var", "var_mean", "std", "std_mean", "argmax", "argmin", "any", "all",
    "softmax", "log_softmax", "nn.functional.softmin", "nn.functional.layer_norm", "nn.functional.rms_norm",
    "logsumexp", "norm", "nn.functional.normalize", "max.reduction_with_dim", "min.reduction_with_dim",
    "nn.functional.cross_entropy", "nansum",
    # views
    "permute", "transpose", "t", "expand", "unsqueeze", "squeeze", "select", "narrow", "view", "reshape", "flatten",
    "movedim", "split", "chunk", "unbind", "diagonal", "as_strided", "expand_as", "view_as", "flip", "roll", "cat",
    "stack", "tril", "triu",
    # indexing (lower_indexing.py)
    "nn.functional.embedding", "gather", "take_along_dim", "index_select", "__getitem__", "constant_pad_nd",
    "nn.functional.pad.constant", "slice_scatter", "select_scatter", "scatter", "scatter_add", "as_strided_scatter",
    # writes at indices from data (lower_scatter.py)
    "index_put", "_unsafe_masked_index_put_accumulate", "index_add", "index_copy", "scatter_reduce.sum",
    "scatter_reduce.prod", "scatter_reduce.mean", "scatter_reduce.amax", "scatter_reduce.amin",
    # scans (lower_scan.py)
    "cumsum", "cumprod",
    # pooling (lower_pool.py)
    "nn.functional.max_pool2d", "nn.functional.avg_pool2d", "nn.functional.max_pool1d", "nn.functional.avg_pool1d",
    "max_pool2d_with_indices_backward",
    # library calls (lower_addmm.py: the product's own output keeps addmm)
    "addmm", "addmm.decomposed", "baddbmm",
}
# Ops whose sample graph must be generated whole: no aten call is left in the module's ``call``.
GENERATED = {
    "nn.functional.embedding", "gather", "take_along_dim", "index_select", "__getitem__", "constant_pad_nd",
    "nn.functional.pad.constant", "slice_scatter", "select_scatter", "cat", "full_like", "as_strided_scatter",
    "scatter", "scatter_add", "scatter_reduce.sum", "scatter_reduce.mean", "index_add", "index_copy",
    "_unsafe_masked_index_put_accumulate",
    "index_put", "cumsum", "cumprod", "nn.functional.max_pool2d", "nn.functional.avg_pool2d",
    "nn.functional.max_pool1d", "nn.functional.avg_pool1d", "max_pool2d_with_indices_backward",
}
# Graphs codegen does not generate on purpose (the whole graph then runs through aten, still checked):
WHOLE_GRAPH_ATEN = {"narrow"}  # its sample takes the start from a tensor: data-dependent sizes
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool)


def _cases():
    for op in op_db:
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if name not in OPS:
            continue
        supported = op.supported_dtypes("cpu")
        for dtype in DTYPES:
            if dtype in supported:
                yield pytest.param(op, dtype, id=f"{name}-{str(dtype)[6:]}")


def _tolerance(dtype: torch.dtype) -> dict:
    return {torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}.get(
        dtype, dict(atol=1e-5, rtol=1.3e-6 * 10))


@pytest.mark.parametrize("op,dtype", list(_cases()))
def test_opinfo(op, dtype):
    check_sample(op, dtype, "cpu")


def check_sample(op, dtype: torch.dtype, device: str) -> None:
    """One OpInfo sample through codegen, against eager."""
    torch.manual_seed(0)
    samples = list(op.sample_inputs(device, dtype, requires_grad=False))
    if not samples:
        pytest.skip("no sample")
    sample = samples[min(1, len(samples) - 1)]  # the first is often a 0-d tensor; the second is more typical
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def fn(*tensors):
        values = list(leaves)
        for i, t in zip(positions, tensors):
            values[i] = t
        inp, args, kwargs = pytree.tree_unflatten(values, spec)
        return op.op(inp, *args, **kwargs)

    tensors = [leaves[i] for i in positions]
    with torch_op_notices_quiet():
        try:
            expected = fn(*[t.clone() for t in tensors])
        except Exception as exc:  # noqa: BLE001
            pytest.skip(f"eager fails on this sample: {exc}")
        module = compile_fn(fn, *[t.clone() for t in tensors], name=op.name.replace(".", "_"))
        if op.name in WHOLE_GRAPH_ATEN:
            actual = module.call([t.clone() for t in tensors])
        else:
            actual = run(module, *[t.clone() for t in tensors])
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    if name in GENERATED and len({t.device for t in tensors}) == 1:
        # a graph whose inputs are on several devices (a CPU index into CUDA values) runs through
        # aten by design (codegen.generate logs "mixes devices"); on one device it must be generated
        assert not aten_calls(module), f"{name} runs through aten: {aten_calls(module)}"
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    actual = list(actual) if isinstance(actual, (tuple, list)) else [actual]
    torch.testing.assert_close(actual, list(expected), equal_nan=True, **_tolerance(dtype))
