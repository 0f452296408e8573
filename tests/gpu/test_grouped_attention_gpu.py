"""SDPA over grouped KV heads chosen by timing on the GPU (``backend/codegen/grouped_attention.py``),
default options: a decode step's attention (32 query heads on 4 KV heads, bf16, a static cache)
takes ``enable_gqa`` where the probe found it 5-28x faster than the expanded copies, the header says
both timings, and the values are eager's."""

from __future__ import annotations

import os
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
    (choice,) = [c for c in module.graph.gemm_choices if "attention" in c]
    assert "as traced" in choice and "enable_gqa" in choice and " us" in choice, choice  # both forms timed
    if batch == 8:  # 345 us against 16 us on an H200: the expanded copies of a 4096-token cache
        assert ": enable_gqa (" in choice and "enable_gqa=True" in module.source, choice
    got, want = module.call(list(inputs)), decode_attention(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2 * w.float().abs().max().item())
