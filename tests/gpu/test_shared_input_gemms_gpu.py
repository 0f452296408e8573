"""Few-row GEMMs of one input chosen by timing on the GPU (``backend/codegen/shared_input_gemms.py``),
default options, on a 1.1B Llama's decode shapes (bf16, hidden 2048, 4 KV heads of 64): q, k and v
of one row cost cuBLAS three launches of ~5 us (15.5 us on an H200), the grouped kernel ~5 us. Each
group's header line holds both timings; where the grouped form was taken, it is within
``gemm_choice.MARGIN`` of the fastest form timed again afresh; values are eager's to bf16 rounding."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")


def projections(h, wq, wk, wv):
    x = h.view(-1, h.shape[-1])
    return x @ wq.t(), x @ wk.t(), x @ wv.t()


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_q_k_v_projections_are_timed_both_ways(rows):
    from codegen_helpers import compile_fn, config

    from cgtrees.codegen import shared_input_gemms

    g = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    args = (torch.randn(1, rows, 2048, **kw), torch.randn(2048, 2048, **kw) / 45,
            torch.randn(256, 2048, **kw) / 45, torch.randn(256, 2048, **kw) / 45)
    module = compile_fn(projections, *args, cfg=config(gemm_decisions="measure"))
    (choice,) = module.graph.gemm_choices
    timings = dict((name, float(us)) for name, us in re.findall(r"(as traced|grouped_mm \S+) ([\d.]+) us", choice))
    configs = shared_input_gemms.configs(rows, torch.bfloat16)
    assert "as traced" in timings and len(timings) == 1 + len(configs), choice  # cuBLAS and each config
    taken = choice.split(": ")[2].split(" (")[0]
    assert timings[taken] <= min(timings.values()) * 1.05, choice  # the fastest form, or within the margin
    if rows == 1:  # 15.5 us against 4.9 on an H200: one launch for three GEMMs of one row
        assert taken.startswith("grouped_mm"), choice
    for got, want in zip(module.call(list(args)), projections(*args)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
