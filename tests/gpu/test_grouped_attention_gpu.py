"""SDPA over grouped KV heads chosen by timing on the GPU (``backend/codegen/grouped_attention.py``),
default options: a decode step's attention (32 query heads on 4 KV heads, bf16, a static cache)
takes a grouped form (``enable_gqa``, or our ``decode_attention``), never the expanded copies, which
the probe found 5-28x slower at batch 8 over 4096 positions; the header gives every form's timing,
the form taken is the fastest within ``gemm_choice.MARGIN`` of it, and the values are eager's."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from test_grouped_attention import decode_attention  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")


def _inputs(batch: int, cache: int):
    g = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch, 32, 1, 64, **kw)
    k, v = torch.randn(batch, 4, cache, 64, **kw), torch.randn(batch, 4, cache, 64, **kw)
    k_new = torch.randn(batch, 4, 1, 64, **kw)
    pos = torch.tensor([cache - 9], device="cuda")
    mask = (torch.arange(cache, device="cuda") <= cache - 9)[None, None, None, :].expand(batch, 1, 1, cache)
    return q, k, v, k_new, pos, mask


@pytest.mark.parametrize("batch, cache", [(8, 4096), (1, 160)])
def test_a_decode_step_takes_enable_gqa_by_timing(batch, cache):
    from codegen_helpers import compile_fn, config

    inputs = _inputs(batch, cache)
    module = compile_fn(decode_attention, *inputs, cfg=config(gemm_decisions="measure"))
    from cgtrees.codegen.gemm_choice import MARGIN

    (choice,) = [c for c in module.graph.gemm_choices if "attention" in c]
    taken, timed = re.fullmatch(r"[^:]+: .+?: (.+?) \((.*)\)", choice).groups()
    timings = {form: float(us) for form, us in re.findall(r"(?:, )?(.+?) ([\d.]+) us", timed)}
    assert {"as traced", "enable_gqa", "decode_attention 32/4", "decode_attention 128/4"} <= set(timings), choice
    assert ("decode_attention 64/4 split 256" in timings) == (cache > 256), choice
    assert "decode_attention 32/4 split 64" in timings, choice
    assert timings[taken] <= min(timings.values()) / (1 - MARGIN), choice
    if batch == 8:  # 345 us against 16 us on an H200: the expanded copies of a 4096-token cache
        assert taken != "as traced", choice
    got, want = module.call(list(inputs)), decode_attention(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * w.float().abs().max().item())
