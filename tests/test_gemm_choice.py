"""GEMM forms (``backend/codegen/gemm_choice.py``) on CPU, through Triton's interpreter: rows padded
to 16 bytes where a GEMM's matrix has unaligned rows (``gemm_decisions=align`` forces the form that
the GPU would time), the generated code that results, and values and gradients against eager. The
timing itself needs a GPU (``tests/gpu/test_gemm_choice_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, compile_fn, config

from cgtrees.codegen import gemm_choice
from cgtrees.compiled import CompiledGraph
from cgtrees.config import Config

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

VOCAB = 1001  # not a multiple of 4: float32 rows of 4004 bytes


def _gemm_node(fn, *inputs):
    from codegen_helpers import trace

    gm = trace(fn, *inputs)
    return next(n for n in gm.graph.nodes if n.target in gemm_choice.GEMMS)


@pytest.mark.parametrize("a, b, want", [
    (torch.randn(16, 32), torch.randn(32, VOCAB), (16, 32, 1004)),  # N
    (torch.randn(16, VOCAB), torch.randn(VOCAB, 8), (16, 1004, 8)),  # K
    (torch.randn(VOCAB, 16).t(), torch.randn(VOCAB, 8), (16, 1004, 8)),  # K; M = 16 column-major: aligned
    (torch.randn(16, VOCAB).t(), torch.randn(16, 8), (1004, 16, 8)),  # M, column-major: its leading dimension
    (torch.randn(VOCAB, 16), torch.randn(16, 8), None),  # M row-major: rows only, nothing to pad
    (torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 1003, dtype=torch.bfloat16), (8, 16, 1008)),
])
def test_padded_sizes_are_the_unaligned_sizes_rounded_to_16_bytes(a, b, want):
    assert gemm_choice.padded_sizes(_gemm_node(torch.mm, a, b)) == want


class LMHead(torch.nn.Module):
    """Embedding, a layer norm, a tied LM head and cross-entropy: GPT-2's output end in small."""

    def __init__(self, vocab: int = VOCAB, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm = torch.nn.Embedding(vocab, d), torch.nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.norm(self.emb(ids)) @ self.emb.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()), logits


def _train(model: torch.nn.Module, compiled, ids, labels):
    loss, logits = compiled(ids, labels)
    (loss + logits.float().pow(2).mean()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), logits.detach(), grads


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, rtol=8 * eps, atol=8 * eps * max(want.abs().max().item(), 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_with_aligned_rows_trains_as_eager(dtype):
    """Each of the three GEMMs runs at padded sizes (the forward's N, the backward's K and M), the
    pads are written by the kernels that compute them or copy the weight, and the logits leave the
    graph in their traced layout. Values and every gradient as eager's."""
    vocab = VOCAB if dtype == torch.float32 else 1003  # bfloat16 rows: a multiple of 8 pads
    padded = 1004 if dtype == torch.float32 else 1008
    model = LMHead(vocab).to(dtype)
    ids, labels = torch.randint(0, vocab, (2, 6)), torch.randint(0, vocab, (2, 6))
    want = _train(model, model, ids, labels)
    comp = Compiler(config(gemm_decisions="align"))
    got = _train(model, torch.compile(model, backend=comp.backend), ids, labels)
    comp.check()
    forward, backward = comp.modules
    lines = [line for m in comp.modules for line in m.graph.gemm_choices]
    rows = 12 if dtype == torch.float32 else 16  # 2 x 6 tokens: a multiple of 4, not of 8
    name = str(dtype).removeprefix("torch.")
    assert lines == [f"mm: mm [12, 32] x [32, {vocab}] {name}: padded to 12x32x{padded} (gemm_decisions=align)",
                     f"mm_1: mm [{vocab}, 12] x [12, 32] {name}: padded to {padded}x{rows}x32 (gemm_decisions=align)",
                     f"mm_2: mm [12, {vocab}] x [{vocab}, 32] {name}: padded to 12x{padded}x32 (gemm_decisions=align)"]
    assert all(f"#   {line}" in m.source for m in comp.modules for line in m.graph.gemm_choices)
    assert f"(32, {padded}), (1, 32)" in forward.source, forward.source  # the weight, padded by a copy
    assert f"(12, {padded}), ({padded}, 1)" in backward.source, backward.source  # the gradient, written padded
    assert got[1].stride() == want[1].stride() == (6 * vocab, vocab, 1)  # the output in its traced layout
    for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        _close(g.float(), w.float()) if dtype == torch.float32 else \
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * max(w.abs().max().item(), 1.0))


def test_keep_and_default_on_cpu_leave_gemms_as_traced():
    model = LMHead()
    ids, labels = torch.randint(0, VOCAB, (2, 6)), torch.randint(0, VOCAB, (2, 6))
    for mode in ("keep", "measure"):
        comp = Compiler(config(gemm_decisions=mode))
        torch._dynamo.reset()
        _train(model, torch.compile(model, backend=comp.backend), ids, labels)
        comp.check()
        assert all("1004" not in m.source for m in comp.modules)
    assert all(line.endswith("as traced (no GPU to time on (cpu))") for line in comp.modules[0].graph.gemm_choices)


def test_a_padded_result_leaving_the_graph_is_copied_to_its_traced_strides():
    """The product is the output itself and, through a view, a second output."""

    def f(a, b):
        p = a @ b
        return p, p.view(2, 3, VOCAB)

    a, b = torch.randn(6, 16), torch.randn(16, VOCAB)
    m = compile_fn(f, a, b, cfg=config(gemm_decisions="align"))
    assert m.graph.gemm_choices == ("mm: mm [6, 16] x [16, 1001] float32: padded to 6x16x1004 (gemm_decisions=align)",)
    outs = m.call([a, b])
    assert [o.stride() for o in outs] == [(VOCAB, 1), (3 * VOCAB, VOCAB, 1)]
    for got, want in zip(outs, f(a, b)):
        _close(got, want)


def test_a_transposed_output_keeps_the_traced_form():
    """An output traced non-contiguous (the product's transpose) cannot be restored by a contiguous
    copy: the GEMM stays as traced, and its line says why."""

    def f(a, b):
        return (a @ b).t()

    a, b = torch.randn(6, 16), torch.randn(16, VOCAB)
    m = compile_fn(f, a, b, cfg=config(gemm_decisions="align"))
    assert "not padded: output 0 was traced with strides (1, 1001)" in m.graph.gemm_choices[0], m.graph.gemm_choices
    _close(m.call([a, b])[0], f(a, b))


def test_choices_travel_in_the_record_and_the_mode_is_checked():
    graph = CompiledGraph("x = 1", gemm_choice_facts(), gemm_choices=("mm: mm [2, 3] x [3, 5] float32: aligned rows",))
    assert CompiledGraph.from_record(graph.as_record()).gemm_choices == graph.gemm_choices
    old = {k: v for k, v in graph.as_record().items() if k != "gemm_choices"}  # a record from before
    assert CompiledGraph.from_record(old).gemm_choices == ()
    with pytest.raises(ValueError, match="gemm_decisions='fastest'; valid values: measure, keep"):
        Config(gemm_decisions="fastest")


def gemm_choice_facts():
    from cgtrees.compiled import GraphFacts

    return GraphFacts()


def test_a_timing_asks_for_the_gil_back_within_a_tenth_of_a_millisecond():
    """While a candidate is timed another thread gives the GIL back within 0.1 ms, and the process's
    switch interval is what it was afterwards, after an error too, and after two overlapping timings
    that end in either order (``gemm_timing._gil_back_soon``;
    the timing itself needs a GPU: ``tests/gpu/test_gemm_timing_gpu.py``)."""
    import sys

    from cgtrees.codegen import gemm_timing

    before = sys.getswitchinterval()
    with gemm_timing._gil_back_soon():
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    assert sys.getswitchinterval() == before
    with pytest.raises(RuntimeError), gemm_timing._gil_back_soon():
        raise RuntimeError("a candidate failed")
    assert sys.getswitchinterval() == before
    # two threads timing at once, the first one out before the second: the last one out restores it
    first, second = gemm_timing._gil_back_soon(), gemm_timing._gil_back_soon()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(1e-4)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
