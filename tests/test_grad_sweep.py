"""Gradient sweep: every differentiable op in torch's OpInfo database, through our pipeline.

For each op with autograd and a float32 CPU kernel, one OpInfo sample (the second: the first is
often 0-d) is traced by AOTAutograd
with OUR decomposition table and OUR partitioner, then every aten graph it hands over is run

- ``aten``: as the driver runs a CPU graph (codegen's module of aten calls), and
- ``interpret``: when its graphs hold an op we lower, through our generated Triton kernels under
  Triton's interpreter,

and the outputs and the gradient of every differentiable input (for random cotangents) are
compared with eager, within a tolerance scaled by the reference's magnitude. Every entry of our
decomposition table that an OpInfo sample reaches is so checked forward and backward; the
entries we add to torch's core table are asserted to fire (``OUR_DECOMPOSITIONS``).

Each op runs in float32 and, where it has a float64 kernel, in float64 too: float64's tighter
tolerance is what found both codegen bugs of the ``REGRESSIONS`` below. Not swept: ops without
autograd or without a float32 CPU kernel (nothing of theirs reaches a backward), and the ``SKIP``
list below, each with its reason. Time: about 2 minutes on the 2-core CI machine, most of it
AOTAutograd's tracing (about 0.1 s an op and dtype).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET
from grad_sweep_helpers import MODES, Case, NoSample, Pipeline, case, compare, eager, op_id
from torch.testing._internal.common_methods_invocations import op_db

from cgtrees.aot.decompositions import EXTRA_DECOMPOSED

aten = torch.ops.aten
DTYPES = (torch.float32, torch.float64)

RANDOM = "random output: eager and compiled draw different numbers (dropout: test_dropout_mask_and_gradient)"
DATA_DEPENDENT = "data-dependent output shape or value: AOTAutograd cannot trace it with static shapes"
SPARSE = "sparse tensors: AOTAutograd's fake tensors do not take sparse inputs"
SKIP = {
    "bernoulli": RANDOM,
    "normal": RANDOM,
    "normal.number_mean": RANDOM,
    "nn.functional.dropout": RANDOM,
    "nn.functional.dropout2d": RANDOM,
    "nn.functional.dropout3d": RANDOM,
    "nn.functional.alpha_dropout": RANDOM,
    "nn.functional.feature_alpha_dropout.with_train": RANDOM,
    "nn.functional.rrelu": RANDOM,
    "nn.functional.fractional_max_pool2d": RANDOM,
    "nn.functional.fractional_max_pool3d": RANDOM,
    "combinations": DATA_DEPENDENT,  # masked_select
    "masked_select": DATA_DEPENDENT,
    "corrcoef": DATA_DEPENDENT,  # aten.equal
    "cov": DATA_DEPENDENT,  # aten.equal
    "narrow": DATA_DEPENDENT,  # its start is a tensor
    "tensor_split": DATA_DEPENDENT,  # its indices are a tensor
    "index_fill": DATA_DEPENDENT,  # _unique
    "index_put": DATA_DEPENDENT,  # nonzero of a boolean index
    "nn.functional.ctc_loss": DATA_DEPENDENT,
    "nn.functional.gaussian_nll_loss": DATA_DEPENDENT,  # checks the variance's values
    "linalg.lstsq": DATA_DEPENDENT,
    "linalg.lstsq.grad_oriented": DATA_DEPENDENT,
    "sparse.sampled_addmm": SPARSE,
    "sparse.mm.reduce": SPARSE,
    "to_sparse": SPARSE,
}
if torch.__version__ < (2, 13):  # 2.11's quantile compares tensors (aten.equal) while tracing
    SKIP.update({"quantile": DATA_DEPENDENT, "nanquantile": DATA_DEPENDENT})
# Random inside, deterministic outside: the sample's matrix has rank <= q, so the random projection
# finds the same subspace whatever it draws (both modes match eager).
RANDOM_INSIDE = {"svd_lowrank": "randn projection", "pca_lowrank": "randn projection"}
# Keyword arguments that make a sample deterministic (its op is swept without its randomness).
OVERRIDES = {"nn.functional.multi_head_attention_forward": {"training": False}}  # dropout 0.5 otherwise
# Graphs codegen writes no module for (in either mode; the driver then runs the FX graph itself,
# which is what is checked), by the node that stops it. A graph given to aten without one fails.
# Torch 2.13 wraps linalg's error checks in with_effects (2.11 does not). Graph constants (masked.*
# ops keep their mask as one) are lifted to inputs first, as the driver does (aot/constants.py).
NOT_GENERATED = {
    "with_effects": "an effectful op (_linalg_check_errors) under with_effects: not written (graph.py, wrapper.py)",
}
# The entries we add to torch's core table, each with the swept sample that reaches it (asserted
# to fire there), or a case of its own below.
# Ops that every graph of the sweep gets as Triton code, never as aten calls (interpret mode).
ALWAYS_GENERATED = {
    "aten.embedding.default", "aten.gather.default", "aten.index.Tensor", "aten.index_select.default",
    "aten.cat.default", "aten.constant_pad_nd.default", "aten.slice_scatter.default",
    "aten.select_scatter.default", "aten.full_like.default", "aten.index_put.default",
    "aten.embedding_dense_backward.default", "aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default",
    "aten.cumsum.default", "aten.cumprod.default", "aten.max_pool2d_with_indices.default",
    "aten.max_pool2d_with_indices_backward.default", "aten.avg_pool2d.default", "aten.avg_pool2d_backward.default",
    "aten.as_strided_scatter.default",
}
OUR_DECOMPOSITIONS = {
    aten._softmax.default: "softmax",
    aten._log_softmax.default: "log_softmax",
    aten.native_layer_norm.default: "nn.functional.layer_norm",
    aten._native_batch_norm_legit.default: "nn.functional.batch_norm",
    aten._native_batch_norm_legit_no_training.default: "nn.functional.batch_norm",
    aten._native_batch_norm_legit_functional.default: "nn.functional.instance_norm",
    aten.gelu.default: "nn.functional.gelu",
    aten.hardtanh.default: "nn.functional.hardtanh",
    aten.hardsigmoid.default: "nn.functional.hardsigmoid",
    aten.hardswish.default: "nn.functional.hardswish",
}
OWN_CASES = {  # (function, input shapes); every input gets a gradient
    aten._native_batch_norm_legit.no_stats: (
        lambda x, w, b: (F.batch_norm(x, None, None, w, b, training=True),), [(6, 3, 5), (3,), (3,)]),
}
# Entries that nothing reaches through AOTAutograd: functionalization rewrites out= overloads to
# functional ones first, and native_batch_norm to _native_batch_norm_legit*. Dropout is random:
# test_dropout_mask_and_gradient checks it.
UNREACHED = {aten.native_batch_norm.default}
RANDOM_DECOMPOSITIONS = {aten.native_dropout.default}

OPS = {op_id(op): op for op in op_db if op.supports_autograd and DTYPES[0] in op.supported_dtypes("cpu")}


# Interpreted and compiled kernels never mix in one process: on a CUDA machine the interpret mode
# runs only when CGTREES_INTERPRET=1 asks for it (as the forward codegen sweep does).
_NO_INTERPRETER = pytest.mark.skip(reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")


def _marks(name: str, mode: str) -> list:
    if name in SKIP:
        return [pytest.mark.skip(reason=SKIP[name])]
    return [_NO_INTERPRETER] if mode == "interpret" and not INTERPRET else []


_MODE_PARAMS = [pytest.param(mode, marks=_marks("", mode)) for mode in MODES]


def _params():
    for name, op in OPS.items():
        for dtype in DTYPES:
            if dtype in op.supported_dtypes("cpu"):
                for mode in MODES:
                    case_id = f"{name}-{str(dtype)[6:]}-{mode}"
                    yield pytest.param(name, dtype, mode, id=case_id, marks=_marks(name, mode))


@functools.lru_cache(maxsize=1)  # the parameters run op by op: both modes share one trace
def _traced(name: str, dtype: torch.dtype):
    try:
        sample = case(OPS[name], dtype, overrides=OVERRIDES.get(name))
    except NoSample as exc:
        pytest.skip(str(exc))
    expected = eager(sample)
    pipeline = Pipeline(sample)
    return expected, pipeline, pipeline.run("aten")


@pytest.mark.parametrize("name,dtype,mode", list(_params()))
def test_grad(name, dtype, mode):
    expected, pipeline, actual = _traced(name, dtype)
    if name not in RANDOM_INSIDE:
        assert not pipeline.random_ops(), f"random ops in its graphs: {pipeline.random_ops()}; eager is no reference"
    if mode == "interpret":
        if not pipeline.lowered_ops():
            pytest.skip("no op of its graphs is lowered: the aten mode covers it")
        actual = pipeline.run("interpret")
    if mode == "interpret":
        assert not pipeline.aten_calls(mode) & ALWAYS_GENERATED, "lowered ops ran through aten"
    unexplained = {kind: why for kind, why in pipeline.gaps(mode).items() if not _known_gap(pipeline, kind)}
    assert not unexplained, f"codegen gave graphs to aten: {unexplained}"
    compare(actual, expected, mode)
    for op, swept in OUR_DECOMPOSITIONS.items():
        if swept == name:
            assert op in pipeline.decomposed, f"{op} is not decomposed in this sample any more"


def _known_gap(pipeline: Pipeline, kind: str) -> bool:
    """The graph holds a node of ``NOT_GENERATED``."""
    gm, _ = pipeline.graphs[kind]
    return any(n.target is torch.ops.higher_order.with_effects for n in gm.graph.nodes)


def test_our_decompositions_are_swept():
    """Every entry we add to torch's table is checked against eager by a swept sample or a case of
    its own (test_grad asserts that the entry fires there)."""
    ours = {op for packet in EXTRA_DECOMPOSED for op in (getattr(packet, name) for name in packet.overloads())}
    functional = {op for op in ours if not any(arg.is_out for arg in op._schema.arguments)}
    checked = set(OUR_DECOMPOSITIONS) | set(OWN_CASES) | UNREACHED | RANDOM_DECOMPOSITIONS
    assert functional - checked == set()
    assert not {op: name for op, name in OUR_DECOMPOSITIONS.items() if name not in OPS or name in SKIP}


@pytest.mark.parametrize("op", list(OWN_CASES), ids=str)
@pytest.mark.parametrize("mode", _MODE_PARAMS)
def test_own_case(op, mode):
    fn, shapes = OWN_CASES[op]
    sample = Case(str(op), fn, [torch.randn(s) for s in shapes], list(range(len(shapes))))
    pipeline = Pipeline(sample)
    compare(pipeline.run(mode), eager(sample), mode)
    assert op in pipeline.decomposed
    assert not pipeline.gaps(mode)


def test_skip_list_names_swept_ops():
    """A stale entry (an op renamed or gone) fails here, so the lists stay short and true."""
    assert set(SKIP) - set(OPS) == set()
    assert set(OVERRIDES) - set(OPS) == set()
    assert set(RANDOM_INSIDE) - set(OPS) == set()


@pytest.mark.parametrize("mode", _MODE_PARAMS)
def test_dropout_mask_and_gradient(mode):
    """Dropout is random, so eager cannot be its reference: its output must be the input, scaled,
    or zero, and its gradient the cotangent through the same mask (our table decomposes it)."""
    p = 0.3
    x = torch.randn(37, 29)
    sample = Case("dropout", lambda t: (F.dropout(t, p, training=True),), [x], [0])
    pipeline = Pipeline(sample)
    result = pipeline.run(mode)
    assert aten.native_dropout.default in pipeline.decomposed
    assert not pipeline.gaps(mode)
    (y,), (grad,), (cotangent,) = result.outputs, result.grads, result.cotangents
    kept = y != 0
    assert 0.2 < 1 - kept.float().mean().item() < 0.4, "the share of dropped elements is far from p"
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))
    torch.testing.assert_close(grad, cotangent * kept / (1 - p))


def _bfloat16_casts(x):
    return x.bfloat16().double() * 3, (x * 100).long().bfloat16().float(), x.half().bfloat16().float()


def _float64_literals(x, y):  # lerp decomposes to where(|w| >= 0.5, w - 1, w) on a 0-d full(w)
    return (torch.lerp(x, y, 0.4), torch.where(x > 0, 0.1, 0.7) * y)


REGRESSIONS = {  # cases the sweep found wrong once: (function, float64 input shapes)
    # Triton's interpreter cast bfloat16 to and from anything but float32 as its uint16 bits
    # (float64 8.4375 became 7.3e-40, others NaN); casts now go through float32, as eager's do.
    "bfloat16_casts": (_bfloat16_casts, [(5, 7)]),
    # Triton types a float literal as float32: literals that met only each other (0.4 - 1.0, a
    # where of two) were computed in float32 in float64 graphs (lerp: 3e-6 relative, 8.6e-8 at 7).
    "float64_literals": (_float64_literals, [(5, 7), (5, 7)]),
}


@pytest.mark.parametrize("name", list(REGRESSIONS))
@pytest.mark.parametrize("mode", _MODE_PARAMS)
def test_regression(name, mode):
    fn, shapes = REGRESSIONS[name]
    sample = Case(name, fn, [torch.randn(s, dtype=torch.float64) for s in shapes], list(range(len(shapes))))
    pipeline = Pipeline(sample)
    compare(pipeline.run(mode), eager(sample), mode)
    assert not pipeline.gaps(mode)
