"""Attention of a few query positions over grouped K and V as one ``cgtrees.decode_attention``
launch (``backend/codegen/decode_attention.py``) on CPU, through Triton's interpreter, against eager
SDPA with ``enable_gqa``: one query position and a few, R query heads a KV head from 1 to 8, head
sizes that are not powers of two, a cache length that is not a multiple of the block, no mask, a
boolean keep-mask (the static cache's: positions past the current one dropped) and a float mask,
queries transposed as a projection's view leaves them, float32 and bfloat16; the cache whole in a
program or split into slices (the last one partial, one wholly masked) added up by a second launch. The GPU times it
against SDPA (``tests/gpu/test_decode_attention_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")


def _inputs(b, heads, kv_heads, lq, length, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, heads, d, generator=g).to(dtype).transpose(1, 2)  # [B, H, Lq, D], a view
    k = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    v = torch.randn(b, kv_heads, length, d, generator=g).to(dtype)
    return q, k, v


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: a few ulps of the largest value (another order of sums); bfloat16: the probabilities
    rounded to bfloat16 before they weight the values (as flash attention does) and the output's
    rounding: a few bfloat16 ulps of the largest value."""
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().max().item()
    atol = (16 if want.dtype == torch.float32 else 4) * eps * scale
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)


def _eager(q, k, v, mask, scale):
    """Eager SDPA in float32 on the same (rounded) inputs, rounded once to their dtype."""
    m = mask if mask is None or mask.dtype == torch.bool else mask.float()
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=scale, enable_gqa=True)
    return out.to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, heads, kv_heads, lq, length, d", [
    (1, 8, 2, 1, 37, 16), (2, 4, 4, 1, 70, 24), (1, 8, 1, 3, 33, 32), (2, 6, 3, 2, 50, 20)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_the_op_matches_eager_sdpa(dtype, b, heads, kv_heads, lq, length, d, mask_kind):
    from cgtrees.codegen import decode_attention, interp  # noqa: F401 (registers the op)

    interp.enable()  # as codegen does before it loads a module that calls the op (on a CPU)
    q, k, v = _inputs(b, heads, kv_heads, lq, length, d, dtype)
    keep = torch.arange(length) < length - 17  # the cache's last positions are not written yet
    keep = keep.view(1, 1, 1, length).expand(b, 1, lq, length)
    mask = {"none": None, "bool": keep,
            "float": torch.where(keep, 0.0, float("-inf")).to(dtype) + 0.25 * torch.rand(b, 1, lq, length).to(dtype)}
    mask = mask[mask_kind]
    want = _eager(q, k, v, mask, 0.3)
    stride = list(want.transpose(1, 2).contiguous().transpose(1, 2).stride())  # cuDNN's layout: [B, Lq, H, D]
    for split_l in (0, 16, 32):
        got = torch.ops.cgtrees.decode_attention(q, k, v, mask, 0.3, stride, 16, 4, split_l)
        assert got.stride() == tuple(stride)
        _close(got, want)


def test_the_default_scale_is_one_over_the_root_of_the_head_size():
    from cgtrees.codegen import decode_attention, interp  # noqa: F401

    interp.enable()
    q, k, v = _inputs(1, 4, 2, 1, 40, 16, torch.float32)
    want = _eager(q, k, v, None, None)
    _close(torch.ops.cgtrees.decode_attention(q, k, v, None, None, list(want.stride()), 32, 4, 0), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq", [1, 2])
def test_rotating_q_as_it_loads_matches_eager_rope_then_sdpa(dtype, lq):
    """``cos`` and ``sin`` given: the kernel reads q unrotated and rotates it as Hugging Face's
    ``apply_rotary_pos_emb`` does, rounding each product and the sum as eager does (bf16: so the
    rotated q is eager's bit for bit, and the output within the attention's own tolerance)."""
    from cgtrees.codegen import decode_attention, interp  # noqa: F401

    interp.enable()
    q, k, v = _inputs(2, 8, 2, lq, 45, 16, dtype)
    g = torch.Generator().manual_seed(3)
    cos, sin = (torch.randn(2, 1, lq, 16, generator=g).to(dtype) for _ in range(2))
    rotated = q * cos + torch.cat((-q[..., 8:], q[..., :8]), -1) * sin
    want = _eager(rotated, k, v, None, None)
    for split_l in (0, 16):
        got = torch.ops.cgtrees.decode_attention(q, k, v, None, None, list(want.stride()), 16, 4, split_l, cos, sin)
        _close(got, want)
