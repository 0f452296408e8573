"""Few-row GEMMs of one input in one ``cgtrees.grouped_mm`` launch (``backend/codegen/
shared_input_gemms.py``, ``grouped_gemv.py``) on CPU, through Triton's interpreter:
``gemm_decisions=rewrite`` takes the grouped form the GPU would time; the op's values against
``x @ w.t()``; what does not qualify stays as traced. Timing needs a GPU
(``tests/gpu/test_shared_input_gemms_gpu.py``)."""

from __future__ import annotations

import re

import pytest
import torch
from codegen_helpers import INTERPRET, compile_fn, config

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: a few ulps of the largest value; 16-bit: one rounding of the result (eager's mm
    rounds its float32 sum too, possibly the other way)."""
    eps = torch.finfo(want.dtype).eps * (8 if want.dtype == torch.float32 else 1)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2 * eps * scale)


def projections(h, wq, wk, wv, wo):
    """A decode step's attention projections: q, k, v from one input, o from another."""
    x = h.view(-1, h.shape[-1])
    q, k, v = x @ wq.t(), x @ wk.t(), x @ wv.t()
    return (q.sum(-1, keepdim=True) * q) @ wo.t(), k * 2, v


def _weights(rows: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, rows, 48, generator=g, dtype=dtype), *(torch.randn(n, k, generator=g, dtype=dtype)
                                                                for n, k in ((40, 48), (8, 48), (8, 48), (24, 40))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5])
def test_rewrite_runs_q_k_v_in_one_launch_with_eager_values(rows, dtype):
    args = _weights(rows, dtype)
    module = compile_fn(projections, *args, cfg=config(gemm_decisions="rewrite"))
    name = str(dtype).removeprefix("torch.")
    config_text = {1: "2x2048/2"}.get(rows, "16x256/2" if dtype != torch.float32 else "4x512/2")
    taken = f"grouped_mm {config_text} (gemm_decisions=rewrite)"
    assert list(module.graph.gemm_choices) == [
        f"mm/mm_1/mm_2: mm [{rows}, 48] x 3 weights [40|8|8, 48] {name}: {taken}",
        f"mm_3: mm [{rows}, 40] x 1 weights [24, 40] {name}: {taken}"]
    call = module.source.split("\ndef call(")[1]
    assert len(re.findall(r"grouped_gemv\.grouped_mm_direct\(", call)) == 2, call
    assert "aten.mm" not in call, call
    assert "import cgtrees.codegen.grouped_gemv" in module.source
    for got, want in zip(module.call(list(args)), projections(*args)):
        _close(got, want)


@pytest.mark.parametrize("mode", ["keep", "measure"])
def test_keep_and_measure_without_a_gpu_keep_cublas(mode):
    args = _weights(1, torch.float32)
    module = compile_fn(projections, *args, cfg=config(gemm_decisions=mode))
    assert "grouped_mm" not in module.source.split("\ndef call(")[1]
    why = "gemm_decisions=keep" if mode == "keep" else "no GPU to time on (cpu)"
    assert all(c.endswith(f"as traced ({why})") for c in module.graph.gemm_choices), module.graph.gemm_choices


def test_what_does_not_qualify_stays_as_traced():
    """More than 64 rows; a weight the graph computes (its layout is ours, not a parameter's); a
    weight stored transposed (column-major [N, K])."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(65, 48, generator=g), torch.randn(40, 48, generator=g)
    for fn, args in ((lambda x, w: x @ w.t(), (x, w)),
                     (lambda x, w: x @ (w * 2).t(), (x[:3], w)),
                     (lambda x, w: x @ w.t(), (x[:3], w.t().contiguous().t()))):
        module = compile_fn(fn, *args, cfg=config(gemm_decisions="rewrite"))
        assert "grouped_mm" not in module.source and not module.graph.gemm_choices, module.graph.gemm_choices
        _close(module.call(list(args))[0], fn(*args))


def test_a_weight_the_graph_writes_does_not_qualify():
    """Our GEMVs load their weights before waiting for the kernel before them (``codegen/pdl.py``):
    a weight the graph writes back (AOTAutograd's ``copy_`` into a mutated input) stays with aten."""
    from cgtrees.codegen.shared_input_gemms import weight

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["val"], w.meta["val"] = torch.empty(1, 48), torch.empty(40, 48)
    mm = graph.call_function(aten.mm.default, (x, graph.call_function(aten.t.default, (w,))))
    assert weight(mm) is w
    graph.call_function(aten.copy_.default, (w, graph.call_function(aten.mul.Tensor, (w, 2))))
    assert weight(mm) is None


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 1), (torch.float32, 7), (torch.float16, 5),
                                         (torch.bfloat16, 3)])
@pytest.mark.parametrize("widths", [(37,), (37, 5), (37, 5, 130)])
def test_the_op_computes_each_product(dtype, rows, widths):
    """One to three weights of irregular widths (blocks past a weight's last row are masked), K not
    a multiple of the block: ``grouped_mm(x, ws) == [x @ w.t() for w in ws]``."""
    from cgtrees.codegen import grouped_gemv, interp  # noqa: F401 - registers the op

    interp.enable()  # as codegen does before it loads a module that calls the op (on a CPU)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 83, generator=g, dtype=dtype)
    weights = [torch.randn(n, 83, generator=g, dtype=dtype) for n in widths]
    for form in ((4, 32, 2, 1), (16, 64, 4, 1)):
        outs = torch.ops.cgtrees.grouped_mm(x, weights, *form)
        assert [o.shape for o in outs] == [(rows, n) for n in widths]
        for out, w in zip(outs, weights):
            _close(out, x @ w.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [83, 96])
def test_one_row_split_over_k(dtype, k):
    """One row, K split over 2 to 4 programs a block of rows (83: the last block partly past K; 96:
    whole blocks, masked by one value a block; a split of 4 where K has 3 blocks of 32 takes 3):
    each product against eager's in float64, every element written (outputs start as NaN)."""
    from cgtrees.codegen import grouped_gemv, interp

    interp.enable()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, k, generator=g, dtype=dtype)
    weights = [torch.randn(n, k, generator=g, dtype=dtype) for n in (37, 5, 130)]
    for form in ((4, 16, 2, 2), (2, 16, 1, 3), (8, 32, 2, 4)):
        outs = [torch.full((1, w.shape[0]), float("nan"), dtype=dtype) for w in weights]
        grouped_gemv.launch(x, weights, outs, *form)
        for out, w in zip(outs, weights):
            _close(out, (x.double() @ w.double().t()).to(dtype))


def test_split_over_k_needs_one_row():
    from cgtrees.codegen import grouped_gemv

    x, w = torch.randn(2, 32), torch.randn(8, 32)
    with pytest.raises(ValueError, match="split_k=2 needs one row, not 2"):
        grouped_gemv.launch(x, [w], [torch.empty(2, 8)], 4, 16, 2, 2)
