"""``cgtrees.decode_attention`` compiled on the GPU (``backend/codegen/decode_attention.py``) at a
1.1B Llama's decode shapes (bf16, 32 query heads on 4 KV heads of 64, one query position, a static
cache of 160 and 4096 positions with its boolean mask, batch 1 and 8; whole or split over the
cache), eagerly and captured in a CUDA graph (launched early there, ``codegen/pdl.py``), against
SDPA with ``enable_gqa``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA (and compiled, not interpreted, Triton kernels)")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """SDPA's kernels and ours round the probabilities to bf16 at different points: a few bf16 ulps
    of the largest value."""
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=4 * torch.finfo(torch.bfloat16).eps * scale)


@pytest.mark.parametrize("batch, cache", [(1, 160), (8, 160), (1, 4096)])
@pytest.mark.parametrize("block_l, split_l", [(32, 0), (128, 0), (64, 256), (128, 1024)])
def test_matches_sdpa_eagerly_and_captured(batch, cache, block_l, split_l):
    from cgtrees.codegen import decode_attention  # noqa: F401 (registers the op)

    g = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(batch, 1, 32, 64, **kw).transpose(1, 2)  # as the projection's view leaves it
    k, v = torch.randn(batch, 4, cache, 64, **kw), torch.randn(batch, 4, cache, 64, **kw)
    keep = (torch.arange(cache, device="cuda") <= cache - 9)[None, None, None, :].expand(batch, 1, 1, cache)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    stride = [32 * 64, 64, 32 * 64, 1]  # [B, Lq, H, D] laid out, as cuDNN returns it
    _close(torch.ops.cgtrees.decode_attention(q, k, v, keep, None, stride, block_l, 4, split_l), want)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.cgtrees.decode_attention(q, k, v, keep, None, stride, block_l, 4, split_l)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = torch.ops.cgtrees.decode_attention(q, k, v, keep, None, stride, block_l, 4, split_l)
    k.copy_(torch.randn(k.shape, **kw))
    graph.replay()
    _close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True))


@pytest.mark.parametrize("split_l", [0, 64])
def test_rotating_q_as_it_loads_matches_eager_rope_then_sdpa(split_l):
    """The query's RoPE in the kernel (``codegen/rope.py``): q unrotated with cos and sin, against
    Hugging Face's rotation in bf16 and then SDPA."""
    from cgtrees.codegen import decode_attention  # noqa: F401

    g = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(1, 1, 32, 64, **kw).transpose(1, 2)
    k, v = torch.randn(1, 4, 160, 64, **kw), torch.randn(1, 4, 160, 64, **kw)
    cos, sin = torch.randn(1, 1, 1, 64, **kw), torch.randn(1, 1, 1, 64, **kw)
    keep = (torch.arange(160, device="cuda") <= 150)[None, None, None, :]
    rotated = q * cos + torch.cat((-q[..., 32:], q[..., :32]), -1) * sin
    want = F.scaled_dot_product_attention(rotated, k, v, attn_mask=keep, enable_gqa=True)
    got = torch.ops.cgtrees.decode_attention(q, k, v, keep, None, [32 * 64, 64, 32 * 64, 1], 32, 4, split_l, cos, sin)
    _close(got, want)
