"""Writes at indices taken from data (backend/codegen/lower_scatter.py) through Triton's interpreter,
against eager: index_put (accumulate or not), scatter / scatter_add / scatter_reduce, and
embedding_dense_backward. Each is a copy of the base, then a kernel that writes (``tl.store``) or
atomically adds (``tl.atomic_add``) its values where the indices say; the modules must hold that
kernel, never an aten call for the op. The OpInfo sweeps cover every op forward and backward;
these are the cases they miss: duplicate and negative indices, irregular and non-contiguous
inputs, every dtype's accumulation, indices out of range.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import HALF_TOL, INTERPRET, Compiler, aten_calls, compile_fn, run, sum_tolerance
from torch.fx.experimental.proxy_tensor import make_fx

from cgtrees import codegen
from cgtrees.context import GraphContext

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")

aten = torch.ops.aten






def generated(fn, *inputs, terms: int = 1, atomic: bool | None = None):
    """Compile ``fn``, check no aten call is left and the scatter kernel is there, compare with eager;
    the inputs must be left as they were (the base is copied, never written)."""
    module = compile_fn(fn, *[t.clone() for t in inputs])
    assert not aten_calls(module), aten_calls(module)
    if atomic is not None:
        assert ("tl.atomic_add(" in module.source) == atomic, module.source
    given = [t.clone() for t in inputs]
    actual = run(module, *given)
    for a, b in zip(given, inputs):
        assert torch.equal(a, b), "an input was written"
    expected = fn(*inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    if any(e.dtype in HALF_TOL for e in expected) and atomic:
        # Half types accumulate in float32 and round once (as eager's CUDA kernel does); eager's CPU
        # kernel rounds after every add. The reference: eager in float32, rounded.
        wide = fn(*[t.float() if t.dtype in HALF_TOL else t for t in inputs])
        wide = list(wide) if isinstance(wide, (tuple, list)) else [wide]
        expected = [w.to(e.dtype) for w, e in zip(wide, expected)]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **sum_tolerance(e, terms))
    return module


# ------------------------------------------------------------------------------------------ index_put
ACCUMULATED = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
               torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", ACCUMULATED)
def test_index_put_accumulates_duplicates(dtype):
    """Duplicate and negative indices, irregular sizes; half types and narrow integers accumulate in
    a float32 / int32 buffer (eager's int8 sums wrap; bool's is an or)."""
    x = (torch.randn(37, 13) * 10).to(dtype)
    rows = torch.tensor([0, 5, 5, -1, 36, 5, -37, 12, 0, 5] * 3)
    values = (torch.randn(30, 13) * 10).to(dtype)
    generated(lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True), x, rows, values, terms=8, atomic=True)


def test_index_put_without_accumulation():
    x, rows, values = torch.randn(37, 13), torch.tensor([3, -2, 0, 17, 30]), torch.randn(5, 13)
    generated(lambda x, i, v: torch.index_put(x, (i,), v) * 2, x, rows, values, atomic=False)


def test_index_put_duplicates_without_accumulation_keep_one_of_the_values():
    """Eager leaves which of several values lands undefined: each element is one of them."""
    x, rows = torch.zeros(4, 3), torch.tensor([1, 2, 1, 1, -3])
    values = torch.arange(15.0).view(5, 3) + 1
    module = compile_fn(lambda x, i, v: torch.index_put(x, (i,), v), x, rows, values)
    (out,) = run(module, x, rows, values)
    for r in range(4):
        candidates = [values[j] for j in range(5) if int(rows[j]) % 4 == r] or [x[r]]
        assert any(torch.equal(out[r], c) for c in candidates), (r, out[r], candidates)


def test_index_put_several_index_tensors_and_layouts():
    """Index tensors broadcast together; adjacent ones keep their place, separated ones go in front;
    a non-contiguous base, expanded values, values that broadcast along the indexed dims."""
    x = torch.randn(6, 5, 7).transpose(0, 2)  # (7, 5, 6), non-contiguous
    i, j = torch.tensor([[0], [-1], [3]]), torch.tensor([4, 2])  # broadcast to (3, 2)
    v = torch.randn(6).expand(3, 2, 6)

    def fn(x, i, j, v):  # aten's index_put takes None for a whole dimension (as AOTAutograd's graphs do)
        return (aten.index_put(x, [i, j], v, True), aten.index_put(x, [i, None, j], v[..., :5]),
                aten.index_put(x, [None, j], v[0, 0, 0]))

    generated(fn, x, i, j, v, terms=2)


def test_index_put_of_a_mask_is_a_where():
    """``x[mask] = v`` with one value for every selected element: no scatter at all (one kernel)."""
    x, mask = torch.randn(5, 6, 4), torch.rand(5, 6) > 0.5
    module = generated(lambda x, m, one, row: (torch.index_put(x, (m,), one),
                                               torch.index_put(x, (m,), row, accumulate=True)),
                       x, mask, torch.tensor(-1.0), torch.arange(4.0))
    assert "tl.atomic_add(" not in module.source and "tl.store(" in module.source


def test_index_put_of_a_mask_with_values_per_element_runs_through_aten():
    x, mask = torch.randn(5, 6), torch.zeros(5, dtype=torch.bool)
    mask[[1, 3]] = True
    module = compile_fn(lambda x, m, v: torch.index_put(x, (m,), v), x, mask, torch.randn(2, 6))
    assert aten_calls(module) == ["aten.index_put.default"]
    args = [x, mask, torch.randn(2, 6)]
    torch.testing.assert_close(run(module, *args)[0], torch.index_put(*args[:1], (mask,), args[2]))


def test_index_put_result_feeds_reductions_and_the_base_stays_readable():
    """The base is read after the scatter too (it was copied); the result is reduced."""
    x, rows, values = torch.randn(9, 31), torch.randint(-9, 9, (40,)), torch.randn(40, 31)

    def fn(x, i, v):
        y = torch.index_put(x, (i,), v, accumulate=True)
        return y.softmax(-1), y.sum(0) + x.sum(0), x * 3

    generated(fn, x, rows, values, terms=16)


# -------------------------------------------------------------------------------------------- scatter
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_add_with_a_smaller_index(dim):
    """The index may be smaller than src and the base in every dimension; duplicates add up."""
    base, src = torch.randn(11, 13), torch.randn(12, 14)
    index = torch.randint(0, base.shape[dim], (9, 10))
    generated(lambda b, i, s: (b.scatter_add(dim, i, s), torch.scatter_reduce(b, dim, i, s, "sum")),
              base, index, src, terms=12, atomic=True)


def test_scatter_without_accumulation_and_of_a_value():
    base, src = torch.randn(8, 6), torch.randn(8, 6)
    index = torch.stack([torch.randperm(8)[:3] for _ in range(6)], 1)  # no duplicates: defined result
    with warnings.catch_warnings():  # scatter's reduce= argument is deprecated (torch's notice): lowered all the same
        warnings.filterwarnings("ignore", message="The reduce argument of torch.scatter", category=UserWarning)
        generated(lambda b, i, s: (b.scatter(0, i, s) + 1, b.scatter(0, i, -2.0), b.scatter(0, i, s, reduce="add")),
                  base, index, src, terms=2)


def test_scatter_of_a_lazy_src_into_a_non_contiguous_base():
    base, src = torch.randn(7, 9).t(), torch.randn(9, 7)
    index = torch.randint(0, 7, (9, 7))
    generated(lambda b, i, s: b.scatter_add(1, i, torch.exp(s) * 2), base, index, src, terms=7, atomic=True)


def test_scatter_into_a_0d_tensor():
    """median's backward: a 0-d base holds one element, index 0."""
    base, src, index = torch.tensor(1.5), torch.tensor(-2.0), torch.tensor(0)
    generated(lambda b, i, s: (b.scatter(0, i, s), b.scatter_add(0, i, s) * 2), base, index, src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_mean_and_sum_count_their_values(dtype, include_self):
    """A mean (or a sum without self) adds the values and counts them; elements no index names
    keep self (rows 3 and 9 below); integers divide rounding down (negative sums included)."""
    base = (torch.randn(11, 6) * 20).to(dtype)
    src = (torch.randn(15, 6) * 20).to(dtype)
    index = torch.tensor([0, 5, 5, 1, 10, 5, 2, 4, 0, 6, 7, 8, 5, 1, 0])[:, None].expand(15, 6).contiguous()
    index[::3, 2] = 10

    def fn(b, i, s):
        return (torch.scatter_reduce(b, 0, i, s, "mean", include_self=include_self),
                torch.scatter_reduce(b, 0, i, s, "sum", include_self=include_self))

    module = generated(fn, base, index, src, terms=6, atomic=True)
    assert "_count" in module.source


def test_scatter_reduce_without_an_atomic_runs_through_aten():
    base, src, index = torch.randn(5, 4), torch.randn(6, 4), torch.randint(0, 5, (6, 4))
    def reducing(reduce):
        return lambda b, i, s: torch.scatter_reduce(b, 0, i, s, reduce)

    for reduce in ("amax", "amin", "prod"):
        module = compile_fn(reducing(reduce), base, index, src)
        assert aten_calls(module) == ["aten.scatter_reduce.two"], reduce
        torch.testing.assert_close(run(module, base, index, src)[0], torch.scatter_reduce(base, 0, index, src, reduce))


# ---------------------------------------------------------------------------------- embedding backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [-1, 3])
def test_embedding_dense_backward(dtype, padding_idx):
    """The op itself (traced without the decomposition table, which makes it an index_put)."""
    grad, ids = torch.randn(4, 9, 17).to(dtype), torch.randint(0, 11, (4, 9))
    ids[0, :3] = 3

    def fn(g, i):
        return (aten.embedding_dense_backward(g, i, 11, padding_idx, False),)

    gm = make_fx(fn)(grad, ids)
    assert any(n.target is aten.embedding_dense_backward.default for n in gm.graph.nodes)
    module = codegen.compile_graph(gm, [grad, ids], GraphContext(Compiler().cfg, "backward", "embedding_backward"))
    assert not aten_calls(module) and "tl.atomic_add(" in module.source
    (out,) = run(module, grad, ids)
    expected = fn(grad, ids)[0]
    torch.testing.assert_close(out, expected, **sum_tolerance(expected, 8))


def test_embedding_training_step_through_aot():
    """An embedding's weight gradient through AOTAutograd with our table: an index_put that adds."""
    weight = torch.randn(50, 24, requires_grad=True)
    ids = torch.randint(0, 50, (3, 40))
    compiler = Compiler()
    compiled = torch.compile(lambda w, i: (F.embedding(i, w, padding_idx=0) ** 2).sum(), backend=compiler.backend)
    compiled(weight, ids).backward()
    compiler.check()
    grad, weight.grad = weight.grad, None
    (F.embedding(ids, weight, padding_idx=0) ** 2).sum().backward()
    torch.testing.assert_close(grad, weight.grad, **sum_tolerance(weight.grad, 8))
    backward = compiler.modules[-1]
    assert "tl.atomic_add(" in backward.source and "index_put" not in " ".join(aten_calls(backward))


# ------------------------------------------------------------------------------------- index checks
@pytest.mark.parametrize("case", ["index_put", "index_put_negative", "scatter_add", "scatter_negative"])
def test_index_out_of_range_raises_in_the_kernel(case):
    """The scatter kernel itself raises (a device assert) and writes nothing out of range; the
    module then runs through aten, which raises eager's error. index_put wraps negative indices
    down to -size, scatter none."""
    x, src = torch.randn(5, 3), torch.randn(2, 3)
    fns = {
        "index_put": (lambda x, i, s: torch.index_put(x, (i,), s, accumulate=True), torch.tensor([5, 0])),
        "index_put_negative": (lambda x, i, s: torch.index_put(x, (i,), s), torch.tensor([-6, 0])),
        "scatter_add": (lambda x, i, s: x.scatter_add(0, i.view(2, 1).expand(2, 3), s), torch.tensor([0, 5])),
        "scatter_negative": (lambda x, i, s: x.scatter_add(0, i.view(2, 1).expand(2, 3), s), torch.tensor([-1, 0])),
    }
    fn, bad = fns[case]
    module = compile_fn(fn, x, torch.tensor([1, 4]), src)
    with pytest.raises(Exception, match="index out of range"):
        module.module.call([x, bad, src])  # the generated call, without the fallback to aten
    with pytest.raises((IndexError, RuntimeError)):
        module.call([x, bad, src])
    assert "index out of range" in (module.failure or "")


def test_a_reduction_we_do_not_lower_is_a_gap_counted_by_op():
    """scatter_reduce's amax runs through aten: counted in ``aten_gaps`` and, by op, in
    ``counters["cgtrees_aten_gap_ops"]`` (what the benchmark rows record to name a gap)."""
    from torch._dynamo.utils import counters

    counters["cgtrees"].clear()
    counters["cgtrees_aten_gap_ops"].clear()
    base, index, src = torch.zeros(4, 3), torch.tensor([[0, 1, 0], [3, 3, 2]]), torch.randn(2, 3)
    module = compile_fn(lambda b, i, s: b.scatter_reduce(0, i, s, "amax"), base, index, src)
    assert aten_calls(module)
    assert counters["cgtrees"]["aten_gaps"] == 1
    assert dict(counters["cgtrees_aten_gap_ops"]) == {"aten.scatter_reduce.two": 1}


def _compiled_writes(fn, *inputs):
    """``fn`` compiled as a decode step is (its writes into the inputs kept in the graph), run once on
    copies of ``inputs``: (the module, the inputs after the compiled run, after eager's)."""
    comp = Compiler()
    torch._dynamo.reset()
    got = [t.clone() for t in inputs]
    with torch.no_grad():
        torch.compile(fn, backend=comp.with_our_partition, fullgraph=True)(*got)
        want = [t.clone() for t in inputs]
        fn(*want)
    comp.check()
    (module,) = comp.modules
    return module, got, want


def test_writes_at_one_place_into_two_caches_share_a_kernel():
    """A decode step's K and V cache writes: two scatters over the same values' space, neither
    reading what the other writes, are one kernel with two stores; values as eager's."""
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(1, 2, 9, 4, generator=g), torch.randn(1, 2, 9, 4, generator=g)
    k, v, pos = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g), torch.tensor([5])

    def step(k_cache, v_cache, k, v, pos):
        k_cache.index_copy_(2, pos, k * 2)
        v_cache.index_copy_(2, pos, v)
        return k_cache.sum(2) + v_cache.sum(2)

    module, got, want = _compiled_writes(step, k_cache, v_cache, k, v, pos)
    kernels = [line.split("(")[0] for line in module.source.splitlines()
               if line.startswith("def ") and "index_put" in line.split("(")[0]]
    assert len(kernels) == 1, kernels
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_write_into_what_another_write_reads_waits_for_it():
    """The first write reads ``y``'s old values at data-given places, the second writes ``y``: the
    second goes to a copy of ``y`` made after the first ran (a kernel between them, so the writes do
    not share one: in one kernel a read could see a new value); values as eager's."""
    g = torch.Generator().manual_seed(0)
    x, y, s = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g), torch.randn(2, 3, generator=g)
    idx = torch.tensor([4, 1])

    def step(x, y, s, idx):
        x.index_copy_(0, idx, y[idx.flip(0)] * 2)
        y.index_copy_(0, idx, s)
        return x + y

    module, got, want = _compiled_writes(step, x, y, s, idx)
    kernels = [line.split("(")[0] for line in module.source.splitlines()
               if line.startswith("def ") and "index_put" in line.split("(")[0]]
    assert len(kernels) == 3, kernels  # x's write, the copy of y, y's write
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
