"""Our GEMVs launched early inside a CUDA graph (``backend/codegen/pdl.py``): a chain of a Llama
layer's GEMV ops at TinyLlama's decode shapes (bf16, hidden 2048), each reading the one before it,
captured and replayed with new inputs, gives eager's values bit for bit (the kernels compute the same
sums in the same order either way; only the launch and the wait differ), and the capture launched
them early while an eager run does not."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    or (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9),
    reason="needs a Hopper (or later) GPU and compiled Triton kernels")

HIDDEN, KV, INTERMEDIATE, EPS, LAYERS = 2048, 256, 5632, 1e-5, 4


def _weights(seed: int = 0):
    g = torch.Generator("cuda").manual_seed(seed)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    return [dict(nw1=1 + torch.randn(HIDDEN, **kw) / 4, wq=torch.randn(HIDDEN, HIDDEN, **kw) / 45,
                 wk=torch.randn(KV, HIDDEN, **kw) / 45, wv=torch.randn(KV, HIDDEN, **kw) / 45,
                 wo=torch.randn(HIDDEN, HIDDEN, **kw) / 45, nw2=1 + torch.randn(HIDDEN, **kw) / 4,
                 wg=torch.randn(INTERMEDIATE, HIDDEN, **kw) / 45, wu=torch.randn(INTERMEDIATE, HIDDEN, **kw) / 45,
                 wd=torch.randn(HIDDEN, INTERMEDIATE, **kw) / 75) for _ in range(LAYERS)]


def _step(x: torch.Tensor, residual: torch.Tensor, layers: list[dict]) -> list[torch.Tensor]:
    """Every GEMV op back to back: norm+q/k/v, o (one weight), norm+gate/up+SiLU-mul, down split over K."""
    ops, outs = torch.ops.cgtrees, []
    for w in layers:
        q, k, v, h = ops.add_rmsnorm_grouped_mm(x, residual, w["nw1"], EPS, [w["wq"], w["wk"], w["wv"]], 16, 8)
        o, = ops.grouped_mm(q, [w["wo"]], 2, 1024, 4, 1)
        a, h = ops.add_rmsnorm_mm_silu_mul(o, h, w["nw2"], EPS, w["wg"], w["wu"], 4, 8)
        x, = ops.grouped_mm(a, [w["wd"]], 2, 512, 4, 4)
        gu = ops.mm_silu_mul(x, w["wg"], w["wu"], 2, 1024, 4)  # the unfused gate/up form, read by nothing
        residual = h
        outs += [k, v, gu]
    return outs + [x, residual]


def test_a_captured_chain_of_early_launched_gemvs_gives_eagers_values():
    from cgtrees.codegen import gemv_add_rmsnorm, gemv_silu_mul, grouped_gemv, pdl  # noqa: F401 (registers the ops)

    layers = _weights()
    g = torch.Generator("cuda").manual_seed(1)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    residual = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    before = pdl.early_launches
    _step(x, residual, layers)  # compiles every kernel, launched the plain way
    assert pdl.early_launches == before
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _step(x, residual, layers)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _step(x, residual, layers)
    assert pdl.early_launches - before == 5 * LAYERS
    for seed in range(2, 6):
        g = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
        residual.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
        graph.replay()
        want = _step(x, residual, layers)
        for got, expected in zip(outs, want):
            assert torch.equal(got, expected)
