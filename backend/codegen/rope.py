"""Rotary position embedding as Hugging Face's models write it, found in an aten graph.

``apply_rotary_pos_emb`` computes ``x * cos + rotate_half(x) * sin``, where ``rotate_half(x)`` is
``cat(-x[..., D/2:], x[..., :D/2])``; traced, that is

    add(mul(x, cos), mul(cat([neg(slice(x, -1, D/2, end)), slice(x, -1, 0, D/2)], -1), sin))

``match(node)`` says whether ``node`` is that (x, cos and sin of one dtype, D even), so a kernel
that reads the rotated value can read ``x``, ``cos`` and ``sin`` instead and rotate as it loads
(``decode_attention``: a decode step's query, whose only reader is the attention). Eager rounds
each product and the sum to that dtype; a kernel that rotates must round where it does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

aten = torch.ops.aten

_END = 2 ** 63 - 1  # a slice's "to the end"


@dataclass(frozen=True)
class Rope:
    """``node = x * cos + rotate_half(x) * sin``, and the nodes that compute it from x, cos and sin."""

    node: torch.fx.Node
    x: torch.fx.Node
    cos: torch.fx.Node
    sin: torch.fx.Node
    chain: tuple[torch.fx.Node, ...]  # add, the two muls, cat, neg, the two slices: the graph's order reversed


def match(node: object) -> Rope | None:
    if not isinstance(node, torch.fx.Node) or node.target is not aten.add.Tensor or node.kwargs.get("alpha", 1) != 1:
        return None
    for straight, rotated in (node.args[:2], node.args[1::-1]):
        if not all(isinstance(n, torch.fx.Node) and n.target is aten.mul.Tensor for n in (straight, rotated)):
            continue
        for x, cos in (straight.args, straight.args[::-1]):
            for cat, sin in (rotated.args, rotated.args[::-1]):
                halves = _rotated_halves(cat, x)
                if halves is not None and _same_dtype(node, x, cos, sin):
                    return Rope(node, x, cos, sin, (node, straight, rotated, cat, *halves))
    return None


def _rotated_halves(cat: object, x: object) -> tuple[torch.fx.Node, ...] | None:
    """(neg, its slice, the other slice) where ``cat`` is ``rotate_half(x)`` over x's last dimension."""
    if not isinstance(cat, torch.fx.Node) or cat.target is not aten.cat.default or not isinstance(x, torch.fx.Node):
        return None
    val = x.meta.get("val")
    if val is None or val.dim() == 0 or not isinstance(val.shape[-1], int) or val.shape[-1] % 2:
        return None
    last, half = val.dim() - 1, val.shape[-1] // 2
    parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    if dim not in (-1, last) or len(parts) != 2:
        return None
    neg, low = parts
    if not isinstance(neg, torch.fx.Node) or neg.target is not aten.neg.default:
        return None
    high = neg.args[0]
    if _slice_of(high, x, last) != (half, 2 * half) or _slice_of(low, x, last) != (0, half):
        return None
    return neg, high, low


def _slice_of(node: object, x: torch.fx.Node, last: int) -> tuple[int, int] | None:
    """(start, end) where ``node`` is ``x`` sliced over its last dimension with step 1."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.slice.Tensor or node.args[0] is not x:
        return None
    dim, start, end, step = (list(node.args[1:]) + [0, None, _END, 1][len(node.args) - 1:])[:4]
    if dim not in (-1, last) or step != 1:
        return None
    size = x.meta["val"].shape[-1]
    return start or 0, min(size if end is None else end, size)


def _same_dtype(*nodes: torch.fx.Node) -> bool:
    vals = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in nodes]
    return all(isinstance(v, torch.Tensor) for v in vals) and len({v.dtype for v in vals}) == 1
