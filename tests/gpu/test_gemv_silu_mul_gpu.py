"""The Llama MLP's gate, up and SiLU-and-multiply, fused or not by timing on the GPU
(``backend/codegen/gate_up_gemms.py``), default options, at a 1.1B Llama's decode shapes (bf16,
hidden 2048, intermediate 5632): the header line holds the unfused forms' timings (cuBLAS, and
``grouped_mm`` with each of its block sizes, then the pointwise kernel) and the fused ones'; the form
taken is within ``gemm_choice.MARGIN`` of the fastest; values are eager's to bf16 rounding, and the
compiled op's (``tl.dot`` for a few rows) are eager's where the sums are exact."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")


def mlp(h, w_gate, w_up, w_down):
    x = h.view(-1, h.shape[-1])
    return (F.silu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()


@pytest.mark.parametrize("rows", [1, 8])
def test_gate_up_silu_mul_is_timed_both_ways(rows):
    from codegen_helpers import compile_fn, config

    g = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    args = (torch.randn(1, rows, 2048, **kw), torch.randn(5632, 2048, **kw) / 45, torch.randn(5632, 2048, **kw) / 45,
            torch.randn(2048, 5632, **kw) / 75)
    module = compile_fn(mlp, *args, cfg=config(gemm_decisions="measure"))
    choice = next(c for c in module.graph.gemm_choices if "silu(mm)" in c)
    timings = dict((name, float(us)) for name, us in re.findall(
        r"(unfused as traced|unfused grouped_mm \S+|mm_silu_mul \S+) ([\d.]+) us", choice))
    assert "unfused as traced" in timings and any(n.startswith("mm_silu_mul") for n in timings), choice
    taken = choice.split(": ")[2].split(" (")[0]
    fastest_unfused = min(t for n, t in timings.items() if n.startswith("unfused"))
    if taken == "unfused":
        assert min(timings.values()) >= fastest_unfused * 0.97, choice
    else:
        assert timings[taken] <= min(timings.values()) * 1.05, choice
    call = module.source.split("\ndef call(")[1]
    assert ("mm_silu_mul" in call) == (taken != "unfused"), call
    (got,) = module.call(list(args))
    want = mlp(*args)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_compiled_op_rounds_where_eager_rounds(rows):
    """Small integers, so every sum is exact: the compiled kernels (``tl.dot`` past one row) give
    eager's bf16 chain bit for bit, at an irregular N and K."""
    from cgtrees.codegen import gemv_silu_mul

    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randint(-3, 4, (rows, 333), device="cuda", generator=g).bfloat16()
    wg, wu = (torch.randint(-3, 4, (1111, 333), device="cuda", generator=g).bfloat16() for _ in range(2))
    gate, up = ((x.float() @ w.float().t()).bfloat16() for w in (wg, wu))  # eager's products, whatever cuBLAS sums in
    want = F.silu(gate) * up
    for form in (*gemv_silu_mul_configs(rows), (4, 64, 2)):
        out = torch.full_like(want, float("nan"))
        gemv_silu_mul.launch(x, wg, wu, out, *form)
        assert torch.equal(out, want), form


def gemv_silu_mul_configs(rows: int):
    from cgtrees.codegen import gate_up_gemms

    return gate_up_gemms._fused_configs(rows, torch.bfloat16)
