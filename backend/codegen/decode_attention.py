"""``torch.ops.cgtrees.decode_attention``: attention of a few query positions over grouped K and V
(``scaled_dot_product_attention(..., enable_gqa=True)``), one Triton launch (two over a split cache).

A decode step's attention is small: a 1.1B Llama at batch 1 has one query position, 32 query heads
over 4 KV heads and a cache of a few hundred positions, 160 KB of K and V a layer. cuDNN's kernel
for it takes 6.3 us on an H200 (``benchmarks/results/serving/``), most of it its launch and ramp.
Here one program owns a batch row's KV head and all the query rows that read it (its R query heads
times the query positions), walks the cache in blocks of ``BLOCK_L`` keys, and keeps an online
softmax (a running maximum, a running sum, the weighted values rescaled when the maximum grows):
each key and value is read once for the R heads that share it. A long cache leaves too few programs
to keep the memory busy (4 at batch 1): there the cache is split into slices of ``split_l``
positions, a program a slice, and a second launch adds the slices' partial softmaxes up, a program
a query row (flash decoding). ``grouped_attention`` times its forms against SDPA on the device and
calls the fastest.

The scores and the softmax are float32; the probabilities are rounded to the values' dtype before
they weight the values (``tl.dot`` on bf16, as flash attention does), the sum stays float32. A
boolean mask keeps where it is true; a float mask is added to the scores.

Generated modules that call the op import this module, which registers it.
"""

from __future__ import annotations

import math

import torch
import triton

from cgtrees.codegen import interp, pdl

MAX_ROWS = 64  # query rows a program: R query heads x the query positions


def _kernels():
    """The kernel's module, imported at the first launch (``decode_attention_kernels``)."""
    from cgtrees.codegen import decode_attention_kernels

    return decode_attention_kernels


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the op takes these shapes: [B, H, Lq, D] queries over [B, Hkv, L, D] keys with H a
    multiple of Hkv, at most ``MAX_ROWS`` query rows a KV head, heads of at most 256."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3]:
        return False
    heads, kv_heads = q.shape[1], k.shape[1]
    return kv_heads > 0 and heads % kv_heads == 0 and (heads // kv_heads) * q.shape[2] <= MAX_ROWS and \
        q.shape[3] == k.shape[3] and q.shape[3] <= 256 and v.shape[3] <= 256


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           out: torch.Tensor, block_l: int, warps: int, split_l: int, cos: torch.Tensor | None = None,
           sin: torch.Tensor | None = None) -> None:
    """``out = softmax(q @ k.T * scale + mask) @ v`` with each KV head shared by H / Hkv query heads;
    ``split_l`` > 0 gives each program that many cached positions (whole blocks of ``block_l``) and
    adds the slices up in a second launch; with ``cos`` and ``sin``, q is rotated first
    (``q * cos + rotate_half(q) * sin``)."""
    b, heads, lq, d = q.shape
    kv_heads, length, dv = k.shape[1], k.shape[2], v.shape[3]
    groups = heads // kv_heads
    interpret = interp.active()
    dot = not interpret  # the interpreter computes a bfloat16 tl.dot wrongly (numpy has no bfloat16)
    kind = 0 if mask is None else 1 if mask.dtype == torch.bool else 2
    mask = mask.expand(b, heads, lq, length) if mask is not None else q
    rope = cos is not None
    cos, sin = (cos.expand(q.shape), sin.expand(q.shape)) if rope else (q, q)
    minimum = 16 if dot else 1
    block_m, block_dv = max(minimum, triton.next_power_of_2(groups * lq)), max(minimum, triton.next_power_of_2(dv))
    l_split = triton.cdiv(split_l if split_l > 0 else length, block_l) * block_l  # whole blocks a program
    splits = triton.cdiv(length, l_split)
    part = torch.empty((b * kv_heads, splits, block_m, 2 + block_dv), dtype=torch.float32, device=q.device) \
        if splits > 1 else out
    early = pdl.on(q.device)
    kernels = _kernels()
    kernels.decode_attention_kernel[(b * kv_heads, splits)](
        q, k, v, mask, out, part, cos, sin, scale, *q.stride(), *k.stride(), *v.stride(), *mask.stride(),
        *out.stride(), *cos.stride(), *sin.stride(), L=length, L_SPLIT=l_split, SPLITS=splits, HKV=kv_heads,
        R=groups, LQ=lq, D=d, DV=dv, BLOCK_M=block_m, BLOCK_L=block_l, BLOCK_D=max(minimum, triton.next_power_of_2(d)),
        BLOCK_DV=block_dv, MASK=kind, ROPE=rope, DOT=dot, PDL=early, INTERPRET=interpret, num_warps=warps,
        launch_pdl=early)
    if splits > 1:
        kernels.combine_kernel[(b * kv_heads, groups * lq)](
            part, out, *out.stride(), HKV=kv_heads, R=groups, LQ=lq, DV=dv, SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_M=block_m, BLOCK_DV=block_dv, PDL=early, num_warps=4,
            launch_pdl=early)


def decode_attention_direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            scale: float | None, out_stride: list[int], block_l: int, warps: int, split_l: int,
                            cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)`` of
    [B, H, Lq, D] queries over [B, Hkv, L, D] keys and values, written with strides ``out_stride``
    (the traced call's); ``split_l`` > 0 splits the cache into slices of that many positions; with
    ``cos`` and ``sin`` (broadcast to q's shape), of ``q * cos + rotate_half(q) * sin`` instead of q."""
    out = torch.empty_strided((*q.shape[:3], v.shape[3]), out_stride, dtype=q.dtype, device=q.device)
    launch(q, k, v, mask, scale if scale is not None else 1 / math.sqrt(q.shape[3]), out, block_l, warps, split_l,
           cos, sin)
    return out


decode_attention = torch.library.custom_op("cgtrees::decode_attention", decode_attention_direct, mutates_args=())


@decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None,
      out_stride: list[int], block_l: int, warps: int, split_l: int, cos: torch.Tensor | None = None,
      sin: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_strided((*q.shape[:3], v.shape[3]), out_stride, dtype=q.dtype, device=q.device)
