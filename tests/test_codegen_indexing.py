"""Indexing lowerings (backend/codegen/lower_indexing.py) through Triton's interpreter, against eager.

Indirect reads (embedding, gather, index_select, ``x[idx]``) check each index against its
dimension: an index out of range makes the generated kernel itself raise (never a read of other
memory); negative indices count from the end only where eager allows it (``x[idx]``). Pieces put
side by side (cat, constant_pad_nd, slice_scatter) fuse into their consumer: one kernel, no aten
call. The OpInfo sweeps cover every op forward and backward; these are the cases they miss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import HALF_TOL, INTERPRET, aten_calls, compile_fn, kernel_count, run

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: interpreted kernels only with CGTREES_INTERPRET=1")





def generated(fn, *inputs, kernels: int | None = None):
    """Compile ``fn``, check it has no aten call left (and ``kernels`` kernels), compare with eager."""
    module = compile_fn(fn, *[t.clone() for t in inputs])
    assert not aten_calls(module), aten_calls(module)
    if kernels is not None:
        assert kernel_count(module) == kernels, module.source
    actual = run(module, *[t.clone() for t in inputs])
    expected = fn(*inputs)
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    tol = HALF_TOL.get(expected[0].dtype, {})
    torch.testing.assert_close(list(actual), expected, **tol)
    return module


# ------------------------------------------------------------------------------------ indirect reads
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_embedding_dtypes(dtype):
    weight = (torch.randn(37, 13) * 10).to(dtype)
    ids = torch.randint(0, 37, (3, 11))
    generated(lambda w, i: F.embedding(i, w) * 2, weight, ids, kernels=1)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_and_index_select_index_dtypes(index_dtype):
    x = torch.randn(9, 23)
    index = torch.randint(0, 23, (9, 5), dtype=index_dtype)
    rows = torch.randint(0, 9, (4,), dtype=index_dtype)
    generated(lambda x, i, r: (torch.gather(x, 1, i) + 1, x.index_select(0, r) * 3), x, index, rows)


def test_gathered_values_feed_a_reduction():
    """A cross-entropy forward: log_softmax's row reduction and the gather of the target in one graph."""
    logits, target = torch.randn(7, 19), torch.randint(0, 19, (7,))
    generated(lambda x, t: F.cross_entropy(x, t), logits, target)


def test_negative_indices_wrap_for_getitem():
    x = torch.randn(6, 8)
    generated(lambda x, i: x[i] + 1, x, torch.tensor([-6, -1, 0, 5, -3]), kernels=1)


def test_advanced_indexing_layouts():
    """Index tensors broadcast together; their dims replace adjacent indexed dims in place, and go
    in front when a slice separates the indexed dims (numpy's rule)."""
    x = torch.randn(4, 5, 6, 7)
    i, j = torch.randint(-4, 4, (3, 1)), torch.randint(0, 6, (2,))
    generated(lambda x, i, j: (x[:, i.view(-1)], x[:, :, j, i[0]], x[i, :, j], x[i, 1:3, j]), x, i, j)


@pytest.mark.parametrize("case", ["embedding", "gather", "index_select", "getitem", "scatter"])
def test_index_out_of_range_raises_in_the_kernel(case):
    """The generated code itself raises (a device assert), rather than reading another tensor's
    memory; the module then runs through aten, which raises eager's error."""
    x, good = torch.randn(5, 3), torch.tensor([[0], [4]])
    fns = {
        "embedding": (lambda x, i: F.embedding(i.view(-1), x), torch.tensor([[5], [0]])),
        "gather": (lambda x, i: torch.gather(x, 0, i.expand(2, 3)), torch.tensor([[-1], [0]])),  # no wrap
        "index_select": (lambda x, i: x.index_select(0, i.view(-1)), torch.tensor([[0], [7]])),
        "getitem": (lambda x, i: x[i.view(-1)], torch.tensor([[-6], [0]])),  # wraps down to -5 only
        "scatter": (lambda x, i: torch.zeros(2, 3).scatter(1, i, 1.0), torch.tensor([[3], [0]])),
    }
    fn, bad = fns[case]
    module = compile_fn(fn, x, good)
    with pytest.raises(Exception, match="index out of range"):
        module.module.call([x, bad])  # the generated call, without the fallback to aten
    with pytest.raises((IndexError, RuntimeError)):
        module.call([x, bad])
    assert "index out of range" in (module.failure or "")


def test_one_entry_per_row_scatters():
    """The one-hot of a loss's backward, and scatter_add of one entry per row, as a where."""
    base, target, src = torch.randn(6, 10), torch.randint(0, 10, (6, 1)), torch.randn(6, 1)
    generated(lambda b, t, s: (torch.zeros_like(b).scatter(1, t, -1.0), b.scatter_add(1, t, s), b.scatter(1, t, s)),
              base, target, src, kernels=1)


# -------------------------------------------------------------------------------- pieces side by side
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_cat_fuses_into_its_consumer(dtype):
    """Rotary embedding's rotate_half: a cat of two halves of a view, times cos: one kernel."""
    x = (torch.randn(2, 3, 5, 8) * 10).to(dtype)
    cos = (torch.randn(5, 8) * 10).to(dtype)

    def rotate(x, cos):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1) * cos

    generated(rotate, x, cos, kernels=1)


def test_cat_of_three_and_of_an_empty_tensor():
    a, b, c = torch.randn(3, 2), torch.randn(3, 5), torch.randn(3, 1)
    generated(lambda a, b, c, e: (torch.cat([a, b, c], 1) + 1, torch.cat([e, a.t()]) * 2), a, b, c, torch.tensor([]))


@pytest.mark.parametrize("pad", [(1, 2), (2, 0, 1, 3), (-1, 2, 0, -2)])
def test_constant_pad(pad):
    x = torch.randn(4, 6)
    generated(lambda x: F.pad(x, pad, value=-1.5) * 2, x, kernels=1)


def test_slice_scatter_with_a_step():
    base, src = torch.randn(10, 4), torch.randn(4, 4)
    generated(lambda b, s: torch.slice_scatter(b, s, 0, 1, 9, 2) + 1, base, src, kernels=1)


def test_dynamic_shapes():
    """Symbolic sizes: index checks against a symbolic dimension, and kernel dimensions such as
    ``s0 + 2`` (a padded or concatenated size; ``xindex // s0 + 2`` once divided by ``s0`` alone)."""
    def fn(w, ids, a, b):
        return F.embedding(ids, w) * 2, torch.cat([a, -b], 0) + 1, F.pad(a, (1, 1)), a[ids.view(-1) % a.shape[0]]

    def inputs(vocab, n, m):
        return torch.randn(vocab, 7), torch.randint(0, vocab, (2, n)), torch.randn(m, 7), torch.randn(3, 7)

    module = compile_fn(fn, *inputs(10, 5, 4), dynamic=True)
    assert not aten_calls(module), aten_calls(module)
    for sizes in [(10, 5, 4), (12, 3, 6)]:
        args = inputs(*sizes)
        torch.testing.assert_close(list(run(module, *args)), list(fn(*args)))
