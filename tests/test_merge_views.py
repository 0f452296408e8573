"""Values not written to memory where writing them costs a pass of their size (CPU, Triton's
interpreter): a reshape that merges dimensions of a lazy value (``backend/codegen/merge_views.py``:
GPT-2's loss reads ``logits.float().view(-1, V)``), and a value that reads one element per row
read by several kernels (the loss backward's one-hot times a row's scale, ``graph._should_realize``).
Before, GPT-2's loss wrote the float32 logits in the forward and again in the backward, and the
one-hot in the backward: three passes of 1.6 GB each at 8 x 1024 x 50257."""

from __future__ import annotations

import functools
import re

import pytest
import sympy
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, config

from cgtrees.codegen import ir, merge_views

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

V = 1001
LONG = 50257  # GPT-2's vocabulary: rows that loop (shorter rows save the log-softmax, by the partition's rule)
X = ir.index_symbols(3)


def _load(index: sympy.Expr, mask: ir.Expr | None = None) -> ir.Expr:
    return ir.Op("cast", (ir.Load("logits", index, torch.bfloat16, mask),), torch.float32)


def test_a_contiguous_run_merges_into_one_index():
    body = _load(X[0] * 16 * V + X[1] * V + X[2])
    merged = merge_views.merged_body(body, (2, 16, V), (32, V))
    y = ir.index_symbols(2)
    assert ir.loads(merged)[0].index == y[0] * V + y[1]


@pytest.mark.parametrize("why, body", [
    ("a permuted source", _load(X[1] * 2 * V + X[0] * V + X[2])),
    ("a mask on a merged dimension", _load(X[0] * 16 * V + X[1] * V + X[2],
                                           ir.Op("lt", (ir.IndexValue(X[1], torch.int64), ir.Const(8, torch.int64)),
                                                 torch.bool))),
])
def test_anything_else_is_not_merged(why, body):
    assert merge_views.merged_body(body, (2, 16, V), (32, V)) is None, why


def test_a_split_or_a_reshape_that_merges_nothing_is_not_a_merge():
    body = _load(X[0] * 16 * V + X[1] * V + X[2])
    assert merge_views.merged_body(body, (2, 16, V), (2, 16, V)) is None
    assert merge_views.merged_body(body, (2, 16, V), (4, 8, V)) is None


def _float_buffers(source: str, columns: int) -> list[str]:
    """The buffers ``call`` allocates with ``columns`` in their sizes, in float32."""
    call = source.split("\ndef call(")[1]
    return [m for m in re.findall(r"torch\.empty_strided\(([^\n]*)\)", call) if str(columns) in m and "float32" in m]


@pytest.mark.parametrize("labels_ignored", [False, True])
def test_the_loss_of_bf16_logits_writes_no_float32_copy_and_no_one_hot(labels_ignored):
    """GPT-2's loss as transformers writes it (upcast, reshape, cross-entropy): the forward reads the
    bf16 logits in its one long-row kernel, the backward writes only the bf16 gradient; values and
    gradients as eager's."""

    def loss(logits, labels):
        return F.cross_entropy(logits.float().view(-1, LONG), labels.view(-1))

    torch.manual_seed(0)
    logits = (torch.randn(2, 4, LONG) * 3).bfloat16()
    labels = torch.randint(0, LONG, (2, 4))
    if labels_ignored:
        labels[0, :3] = -100
    comp = Compiler(config())
    xs = [logits.clone().requires_grad_() for _ in range(2)]
    got = torch.compile(loss, backend=comp.with_our_partition)(xs[0], labels)
    want = loss(xs[1], labels)
    got.backward()
    want.backward()
    comp.check()
    forward, backward = comp.modules
    assert _float_buffers(forward.source, LONG) == [], forward.source
    assert _float_buffers(backward.source, LONG) == [], backward.source
    assert len(backward.graph.kernels) == 1, backward.source
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs[0].grad.float(), xs[1].grad.float(), rtol=1e-2, atol=1e-2 * xs[1].grad.abs().max())


def test_a_per_row_value_read_twice_is_recomputed_not_written():
    """A one-hot times a row's scale, summed and used elementwise through a reshape (as the loss's
    backward uses it): not a buffer of its own."""

    def f(x, t, s):
        hot = F.one_hot(t.view(-1), V).float() * s.view(-1, 1)
        return x * hot.view(2, 4, V) + hot.sum(1).view(2, 4, 1)

    x, t, s = torch.randn(2, 4, V), torch.randint(0, V, (2, 4)), torch.randn(2, 4)
    comp = Compiler(config())
    got = torch.compile(f, backend=comp.backend)(x, t, s)
    comp.check()
    (module,) = comp.modules
    assert len(_float_buffers(module.source, V)) == 1, module.source  # the output alone
    torch.testing.assert_close(got, f(x, t, s))


def test_a_widening_cast_read_by_two_kernels_is_recomputed_not_written():
    """A bf16 tensor cast to float32 and read by two kernels (one before a matrix product, one
    after): each kernel reads the bf16 tensor and casts it (``graph._widens``), where writing the
    float32 cast would cost a write of 4 bytes per element and a read of 4 per reader, not 2."""
    def f(x, w):
        y = x.float()
        return y.exp() @ w, y.sin().sum(-1)

    comp = Compiler(config())
    compiled = torch.compile(f, backend=comp.backend, fullgraph=True)
    x, w = torch.randn(9, 23, dtype=torch.bfloat16), torch.randn(23, 5)
    for got, want in zip(compiled(x, w), f(x, w)):
        torch.testing.assert_close(got, want)
    call = comp.modules[0].source.split("\ndef call(")[1]
    written = re.findall(r"(\w+) = torch\.empty_strided", call)
    assert written == ["exp", "sum_1"], call  # no float32 ``_to_copy`` buffer


def test_a_row_kernels_output_viewed_with_merged_dimensions_joins_its_kernel():
    """BERT's attention backward (the math path): the softmax gradient ``g * p - p * sum(g * p)``
    over (B, H, S, S), cast to bf16 as a (B*H, S, S) view for the matrix product. One kernel
    (``scheduler._Open.merged``): before, the row sum wrote ``g * p`` in float32 and a second
    kernel read it back to finish the gradient, 3 passes of 4 bytes an element more."""
    def f(g, p, v):
        m = g.float() * p
        d = m - p * m.sum(-1, keepdim=True)
        return d.view(-1, 37, 37).to(torch.bfloat16) @ v

    comp = Compiler(config())
    compiled = torch.compile(f, backend=comp.backend, fullgraph=True)
    g, p = torch.randn(2, 3, 37, 37, dtype=torch.bfloat16), torch.rand(2, 3, 37, 37)
    v = torch.randn(6, 37, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(compiled(g, p, v), f(g, p, v))
    source = comp.modules[0].source
    assert len(re.findall(r"^def (?:pw|red)_\w+\(", source, re.M)) == 1, source
    assert "m = torch.empty_strided" not in source.split("\ndef call(")[1]  # g * p stays in registers


def test_a_view_that_splits_a_kernels_dimension_is_not_a_merge():
    """(3, 74) from (2, 3, 37) is no run of whole dimensions (a merge maps each of its dimensions
    onto adjacent ones of the kernel): the step keeps a kernel of its own; the values are eager's.
    (2, 111), a merge with the reduced dimension, joins the row kernel."""
    def f(x, shape):
        y = x * x.sum(-1, keepdim=True)
        return y.view(shape).exp()

    for shape, kernels in (((3, 74), 2), ((2, 111), 1)):
        comp = Compiler(config())
        compiled = torch.compile(functools.partial(f, shape=shape), backend=comp.backend, fullgraph=True)
        x = torch.randn(2, 3, 37)
        torch.testing.assert_close(compiled(x), f(x, shape))
        source = comp.modules[0].source
        assert len(re.findall(r"^def (?:pw|red)_\w+\(", source, re.M)) == kernels, source


@pytest.mark.parametrize("transposed", [False, True])
def test_a_view_that_cuts_a_kernels_dimension_joins_its_kernel(transposed):
    """BERT's masked-LM loss backward: the log-softmax recomputed over (B*T, V), then the gradient
    over (B, T, V), added to the logits' own gradient. The step over the cut dimensions joins the
    kernel (``scheduler._Open.split``: each of its dimensions the quotient and remainder of the
    kernel's): before, the first kernel wrote its bf16 result and a second read it back (0.37 ms of
    BERT-base's step on an H200). Values as eager's, the added tensor read in order or transposed."""
    def f(x, t):
        y = x * x.sum(-1, keepdim=True)
        return y.view(2, 3, 37).exp() + (t.transpose(0, 1) if transposed else t)

    comp = Compiler(config())
    compiled = torch.compile(f, backend=comp.backend, fullgraph=True)
    x, t = torch.randn(6, 37) * 0.2, torch.randn(*((3, 2) if transposed else (2, 3)), 37)
    torch.testing.assert_close(compiled(x, t), f(x, t))
    source = comp.modules[0].source
    assert len(re.findall(r"^def (?:pw|red)_\w+\(", source, re.M)) == 1, source
    assert source.split("\ndef call(")[1].count("torch.empty_strided") == 1, source  # the output alone


def test_a_table_of_cosines_read_by_two_kernels_is_written_once():
    """RoPE's cos of a (positions, dims) table, read by every layer's q and k: each reader loading
    it costs less than each evaluating cos per element of its (batch, heads, positions, dims)
    operand, so it is written once (``graph._widens`` takes no transcendental)."""
    def f(x, y, angles, w):
        c = angles.cos()
        return (x * c).exp() @ w, (y * c).sum(-1)

    comp = Compiler(config())
    compiled = torch.compile(f, backend=comp.backend, fullgraph=True)
    x, y, angles, w = torch.randn(3, 9, 23), torch.randn(3, 9, 23), torch.randn(9, 23), torch.randn(23, 4)
    for got, want in zip(compiled(x, y, angles, w), f(x, y, angles, w)):
        torch.testing.assert_close(got, want)
    source = comp.modules[0].source
    assert len(re.findall(r"tl\.cos\(", source)) == 1, source


def test_a_merged_view_written_transposed_keeps_its_own_kernel():
    """BERT's forward: the softmax probabilities over (B, H, S, S), cast to bf16 as a (B*H, S, S)
    value stored transposed (the layout its backward matrix product reads). Joining the row
    kernel, it would write each row a column apart (0.7 ms a step more on BERT-base); a merged step
    joins only where its stores run along the kernel's rows (``scheduler._Open._stores_along``)."""
    from cgtrees.codegen import scheduler

    x, y = ir.index_symbols(4), ir.index_symbols(3)
    size = (2, 3, 37, 37)
    g = ir.Load("g", x[0] * 4107 + x[1] * 1369 + x[2] * 37 + x[3], torch.float32)
    total = ir.Compute("total", ir.Layout((2, 3, 37, 1), ir.contiguous_strides((2, 3, 37, 1))), torch.float32,
                       size, g, (3,), ir.Reduce.SUM)
    scaled = ir.Op("mul", (ir.Load("g", y[0] * 1369 + y[1] * 37 + y[2], torch.float32),
                           ir.Load("total", y[0] * 37 + y[1], torch.float32)), torch.float32)
    for strides, joins in (((1369, 37, 1), True), ((1369, 1, 37), False)):
        out = ir.Compute("out", ir.Layout((6, 37, 37), strides), torch.bfloat16, (6, 37, 37),
                         ir.Op("cast", (scaled,), torch.bfloat16))
        kernel = scheduler._Open(size)
        assert kernel.try_add(total)
        assert kernel.try_add(out) == joins, strides


def test_softmax_saved_and_cast_transposed_for_the_backward_is_one_kernel():
    """BERT's forward on the math attention path: the softmax over (B, H, S, S) is saved in float32,
    read by the bmm as (B*H, S, S), and cast to bf16 as the (B*H, S, S) transpose the backward's
    matrix product reads, whose memory order is the softmax's own. One kernel storing the float32
    probabilities once and the bf16 copy along the rows (``_Open.regrouped``, and the bmm waits
    for the kernel without cutting it: ``scheduler._fill``); it was the row kernel writing the
    float32 probabilities twice and a second kernel reading them back for the cast, 226 us a
    layer on an H200 at 16 x 512."""
    def f(s, v):
        p = torch.softmax(s, -1)
        pe = p.expand(2, 3, 37, 37)
        o = torch.bmm(pe.reshape(6, 37, 37), v)
        return o, pe.reshape(6, 37, 37).transpose(1, 2).to(torch.bfloat16), torch.ops.aten.alias(p)

    comp = Compiler(config())
    compiled = torch.compile(f, backend=comp.backend, fullgraph=True)
    s, v = torch.randn(2, 3, 37, 37), torch.randn(6, 37, 8)
    for got, want in zip(compiled(s, v), f(s, v)):
        torch.testing.assert_close(got, want)
    source = comp.modules[0].source
    assert len(re.findall(r"^def (?:pw|red)_\w+\(", source, re.M)) == 1, source
    assert len(re.findall(r"torch\.empty_strided\(\(2, 3, 37, 37\)", source)) == 1, source


def test_a_regrouped_step_reading_another_tensor_transposed_keeps_its_own_kernel():
    """A (B*H, S, S) step stored transposed could map its dimensions swapped onto a row kernel's so
    that its stores run along the rows; where it reads another tensor in its own order, its loads
    would then be a column apart (``_Open._loads_along``): it keeps its own kernel."""
    from cgtrees.codegen import scheduler

    x, y = ir.index_symbols(4), ir.index_symbols(3)
    size = (2, 3, 37, 37)
    g = ir.Load("g", x[0] * 4107 + x[1] * 1369 + x[2] * 37 + x[3], torch.float32)
    total = ir.Compute("total", ir.Layout((2, 3, 37, 1), ir.contiguous_strides((2, 3, 37, 1))), torch.float32,
                       size, g, (3,), ir.Reduce.SUM)
    for other, joins in (("h", False), ("total", True)):
        read = ir.Load("h", y[0] * 1369 + y[1] * 37 + y[2], torch.float32) if other == "h" else \
            ir.Load("total", y[0] * 37 + y[2], torch.float32)
        out = ir.Compute("out", ir.Layout((6, 37, 37), (1369, 1, 37)), torch.bfloat16, (6, 37, 37),
                         ir.Op("cast", (read,), torch.bfloat16))
        kernel = scheduler._Open(size)
        assert kernel.try_add(total)
        assert kernel.try_add(out) == joins, other


@pytest.mark.parametrize("shape", [(1, 5, 48), (1, 1, 48), (3, 1, 48)])
def test_a_decode_steps_norm_viewed_for_its_matrix_product_is_one_kernel(shape):
    """A Llama decode step: the residual add and RMSNorm over (batch, 1 token, d), viewed as
    (batch, d) for the projection that reads it. A dimension of size 1 has only index 0 and any
    stride, so the merged view reads each element the row kernel computes (``_Open._same_element``):
    one kernel, where it was a row kernel writing the sum and a second reading it back."""
    def f(h, r, w, proj):
        h = h + r
        y = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
        return y @ proj.t(), h

    comp = Compiler(config())
    compiled = torch.compile(f, backend=comp.backend, fullgraph=True)
    args = torch.randn(*shape), torch.randn(*shape), torch.randn(48), torch.randn(32, 48)
    for got, want in zip(compiled(*args), f(*args)):
        torch.testing.assert_close(got, want)
    source = comp.modules[0].source
    assert len(re.findall(r"^def (?:pw|red)_\w+\(", source, re.M)) == 1, source
