"""A bf16 GEMM whose one reader casts it to float32 writes float32 itself (``backend/codegen/float_gemms.py``):
which casts qualify, the rewritten graph's dtypes and strides, and the choice's notes. ``aten.mm.dtype``
has no CPU kernel: values and timings are checked on the GPU (``tests/gpu/test_float_gemms_gpu.py``)."""

from __future__ import annotations

import torch
from codegen_helpers import trace

from cgtrees.codegen import float_gemms
from cgtrees.codegen.gemm_choice import GemmPlan

aten = torch.ops.aten
bf16 = torch.bfloat16


class Plan:
    """A ``GemmPlan`` stand-in on a CUDA device: ``how`` as ``other_choice`` says, or timed as ``us`` says."""

    device = torch.device("cuda")

    def __init__(self, how: str = "rewrite", us: dict[str, float] | None = None) -> None:
        self.how, self.us, self.notes = how, us or {}, []

    def other_choice(self):
        return (self.how, "") if self.how != "rewrite" else ("rewrite", "gemm_decisions=rewrite")

    def time_forms(self, forms, alone=False):
        return {name: self.us[name] for name in forms}

    def note(self, node, what, taken, timings=(), why="timed"):
        self.notes.append((node, what, taken, timings, why))


def _weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight gradient under autocast: bf16 product, transposed, cast to float32."""
    return torch.mm(x.t(), dy).t().to(torch.float32)


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _output(gm: torch.fx.GraphModule) -> torch.Tensor:
    out = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    return (out[0] if isinstance(out, (list, tuple)) else out).meta["val"]


def test_a_weight_gradient_cast_becomes_a_float32_product_with_the_casts_strides():
    gm = trace(_weight_grad, torch.randn(37, 24, dtype=bf16), torch.randn(37, 40, dtype=bf16))
    before = _output(gm)
    (mm,) = gm.graph.find_nodes(op="call_function", target=aten.mm.default)
    found = float_gemms.cast_of(mm)
    assert found is not None and len(found.views) >= 1, found
    plan = Plan()
    out = float_gemms.rewritten(gm, plan)
    assert out is not gm and aten.mm.default in _targets(gm)  # the graph handed in stays as it was
    assert aten.mm.dtype in _targets(out) and aten._to_copy.default not in _targets(out), out.graph
    after = _output(out)
    assert (after.dtype, after.shape, after.stride()) == (before.dtype, before.shape, before.stride())
    assert [n[2] for n in plan.notes] == [float_gemms.WIDE], plan.notes
    assert "cast to float32" in plan.notes[0][1]


def test_the_timed_choice_takes_the_float32_product_only_past_the_margin():
    gm = trace(_weight_grad, torch.randn(37, 24, dtype=bf16), torch.randn(37, 40, dtype=bf16))
    for wide_us, taken in ((9.0, float_gemms.WIDE), (9.9, float_gemms.TRACED)):
        plan = Plan("time", {float_gemms.TRACED: 10.0, float_gemms.WIDE: wide_us})
        out = float_gemms.rewritten(gm, plan)
        assert (out is not gm) == (taken == float_gemms.WIDE)
        assert plan.notes[0][2] == taken and plan.notes[0][4] == "timed", plan.notes


def test_casts_that_must_stay():
    x, dy = torch.randn(37, 40, dtype=bf16), torch.randn(37, 24, dtype=bf16)
    kept = {
        "float32 product": lambda dy, x: torch.mm(x.float().t(), dy.float()).double(),
        "a second reader": lambda dy, x: (lambda p: (p.float(), p * 2))(torch.mm(x.t(), dy)),
        "a cast to float16": lambda dy, x: torch.mm(x.t(), dy).half(),
        "arithmetic before the cast": lambda dy, x: (torch.mm(x.t(), dy) * 2).float(),
        "a cast a kernel reads": lambda dy, x: torch.mm(x.t(), dy).float() * 2,
        "a layout-changing cast": lambda dy, x: torch.mm(x.t(), dy).t().to(torch.float32,
                                                                          memory_format=torch.contiguous_format),
    }
    for why, fn in kept.items():
        gm = trace(fn, dy, x)
        for mm in gm.graph.find_nodes(op="call_function", target=aten.mm.default):
            assert float_gemms.cast_of(mm) is None, why
        assert float_gemms.rewritten(gm, Plan()) is gm, why


def test_nothing_is_rewritten_off_cuda():
    """``aten.mm.dtype`` has no CPU kernel: ``gemm_decisions=rewrite`` leaves a CPU graph as traced, noted."""
    gm = trace(_weight_grad, torch.randn(37, 24, dtype=bf16), torch.randn(37, 40, dtype=bf16))
    plan = GemmPlan(gm, "rewrite", torch.device("cpu"))
    assert float_gemms.rewritten(gm, plan) is gm
    (line,) = [c for c in plan.lines() if "cast to float32" in c]
    assert "as traced" in line and "CUDA only" in line, line


def test_a_float32_product_that_fails_to_run_keeps_the_cast():
    """Where cuBLAS cannot run the float32 product for the operands (its timing raises), the graph
    stays as traced and the note says why."""
    class Failing(Plan):
        def time_forms(self, forms, alone=False):
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore")

    gm = trace(_weight_grad, torch.randn(37, 24, dtype=bf16), torch.randn(37, 40, dtype=bf16))
    plan = Failing("time")
    assert float_gemms.rewritten(gm, plan) is gm
    assert plan.notes[0][2] == float_gemms.TRACED and "CUBLAS_STATUS_NOT_SUPPORTED" in plan.notes[0][4], plan.notes
