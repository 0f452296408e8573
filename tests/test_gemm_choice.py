"""GEMM forms (``backend/codegen/gemm_choice.py``) on CPU, through Triton's interpreter: rows padded
to 16 bytes where a GEMM's matrix has unaligned rows (``gemm_decisions=align`` forces the form that
the GPU would time), the generated code that results, and values and gradients against eager. The
timing itself needs a GPU (``tests/gpu/test_gemm_choice_gpu.py``)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, Compiler, compile_fn, config

from backend.codegen import gemm_choice
from backend.compiled import CompiledGraph
from backend.config import Config

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")

VOCAB = 1001  # not a multiple of 4: float32 rows of 4004 bytes


def test_padded_meta_pads_the_last_dimension_to_16_bytes():
    bf16 = torch.empty(8, 1024, 50257, dtype=torch.bfloat16, device="meta")
    assert gemm_choice.padded_meta(bf16).stride() == (1024 * 50264, 50264, 1)
    f32 = torch.empty(16, VOCAB, device="meta")
    assert gemm_choice.padded_meta(f32).stride() == (1004, 1)
    assert gemm_choice.padded_meta(torch.empty(16, 1024, device="meta")) is None  # aligned already
    assert gemm_choice.padded_meta(torch.empty(VOCAB, 16, device="meta").t()) is None  # not contiguous


@pytest.mark.parametrize("meta, aligned", [
    (torch.empty(16, 64), True), (torch.empty(16, VOCAB), False),
    (torch.empty(VOCAB, 16).t(), True), (torch.empty(16, VOCAB).t(), False),  # column-major: ld 16, then 1001
    (torch.empty(1, VOCAB), True),  # one row: no leading dimension to align
    (torch.empty_strided((16, VOCAB), (1004, 1)), True),
    (torch.empty(16, 64, dtype=torch.bfloat16)[:, 1:], False),  # the address is off by two bytes
])
def test_aligned_reads_the_leading_dimension_and_the_address(meta, aligned):
    assert gemm_choice._aligned(meta) is aligned


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


def _padded_buffers(source: str) -> list[str]:
    """The strides of buffers ``call`` allocates with rows of 1004 (1001 padded to 16 bytes)."""
    return re.findall(r"torch\.empty_strided\(\(?\[?[0-9, ]+\]?\)?, \(?\[?([0-9, ]*1004[0-9, ]*)", source)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_with_aligned_rows_trains_as_eager(dtype):
    """The forward writes the logits into rows of 1004 (``mm.out``) and copies them to their traced
    layout where they leave the graph; the backward's kernel writes the logits' gradient padded, and
    both of its GEMMs read it so. Values and every gradient as eager's."""
    vocab = VOCAB if dtype == torch.float32 else 1003  # bfloat16 rows: a multiple of 8 pads
    model = LMHead(vocab).to(dtype)
    ids, labels = torch.randint(0, vocab, (2, 6)), torch.randint(0, vocab, (2, 6))
    want = _train(model, model, ids, labels)
    comp = Compiler(config(gemm_decisions="align"))
    got = _train(model, torch.compile(model, backend=comp.backend), ids, labels)
    comp.check()
    forward, backward = comp.modules
    assert "aten.mm.out(" in forward.source and "_rows = torch.empty_strided(" in forward.source, forward.source
    assert "aligned rows" in forward.source.split("\nimport")[0], forward.source
    padded = 1004 if dtype == torch.float32 else 1008
    assert f", {padded}, 1)" in backward.source or f"({padded}, 1)" in backward.source, backward.source
    assert got[1].stride() == want[1].stride() == (6 * vocab, vocab, 1)  # the output in its traced layout
    for g, w in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        _close(g.float(), w.float()) if dtype == torch.float32 else \
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * max(w.abs().max().item(), 1.0))


def test_keep_and_default_on_cpu_leave_rows_as_traced():
    model = LMHead()
    ids, labels = torch.randint(0, VOCAB, (2, 6)), torch.randint(0, VOCAB, (2, 6))
    for mode in ("keep", "measure"):
        comp = Compiler(config(gemm_decisions=mode))
        torch._dynamo.reset()
        _train(model, torch.compile(model, backend=comp.backend), ids, labels)
        comp.check()
        assert all("aten.mm.out(" not in m.source and "1004" not in m.source for m in comp.modules)
    assert all(line.endswith("rows as traced (no GPU to time on (cpu))") for line in comp.modules[0].graph.gemm_choices)


def test_a_padded_value_leaving_the_graph_is_copied_to_its_traced_strides():
    """The product is the output itself and, through a view, a second output."""

    def f(a, b):
        p = a @ b
        return p, p.view(2, 3, VOCAB)

    a, b = torch.randn(6, 16), torch.randn(16, VOCAB)
    m = compile_fn(f, a, b, cfg=config(gemm_decisions="align"))
    outs = m.call([a, b])
    assert [o.stride() for o in outs] == [(VOCAB, 1), (3 * VOCAB, VOCAB, 1)]
    for got, want in zip(outs, f(a, b)):
        _close(got, want)


def test_a_storage_with_another_view_or_an_output_is_not_padded():
    """An operand whose rows could be padded only if every reader takes the padded strides: a
    graph output, or a view gemm_choice does not replay (``as_strided``), keeps them traced."""

    def as_output(x, w):
        g = x.exp()  # [6, VOCAB], unaligned rows, read by the GEMM and returned
        return g @ w, g

    def strided_view(x, w):
        g = x.exp()
        return g @ w, g.as_strided((3, 2), (1, 5)).sum()

    x, w = torch.randn(6, VOCAB), torch.randn(VOCAB, 8)
    for f in (as_output, strided_view):
        m = compile_fn(f, x, w, cfg=config(gemm_decisions="align"))
        assert "1004" not in m.source.split("def call")[1], m.source
        for got, want in zip(m.call([x, w]), f(x, w)):
            _close(got, want)


def test_choices_travel_in_the_record_and_the_mode_is_checked():
    graph = CompiledGraph("x = 1", gemm_choice_facts(), gemm_choices=("mm: mm [2, 3] x [3, 5] float32: aligned rows",))
    assert CompiledGraph.from_record(graph.as_record()).gemm_choices == graph.gemm_choices
    old = {k: v for k, v in graph.as_record().items() if k != "gemm_choices"}  # a record from before
    assert CompiledGraph.from_record(old).gemm_choices == ()
    with pytest.raises(ValueError, match="gemm_decisions='fastest'; valid values: measure, keep"):
        Config(gemm_decisions="fastest")


def gemm_choice_facts():
    from backend.compiled import GraphFacts

    return GraphFacts()
