"""The partitioner's cost model: what a value costs to keep, and what may be recomputed.

Recomputing is allowed for ops that are cheap next to a memory round trip and deterministic:
pointwise math, reductions, views, casts and constants. Never recomputed: matrix products,
convolutions, attention, random ops, in-place/mutating ops, and anything we do not know.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten

_RECOMPUTABLE_PACKETS = {
    # reductions
    aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.var, aten.var_mean, aten.std,
    aten.argmax, aten.argmin, aten.max, aten.min, aten.logsumexp, aten.any, aten.all,
    # views and layout
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.expand,
    aten.squeeze, aten.unsqueeze, aten.slice, aten.select, aten.alias, aten.as_strided,
    aten.clone, aten._to_copy, aten.cat, aten.split, aten.split_with_sizes, aten.unbind,
    aten.constant_pad_nd, aten.flip, aten.repeat,
    # constants
    aten.full, aten.full_like, aten.zeros, aten.zeros_like, aten.ones, aten.ones_like,
    aten.scalar_tensor, aten.arange, aten.empty, aten.empty_like,
}
_NEVER = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.convolution,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention, aten.copy_, aten.native_dropout,
}


def is_recomputable(node: torch.fx.Node) -> bool:
    """May the backward recompute ``node`` from its inputs instead of having it saved?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target.overloadpacket in _NEVER or target._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return torch.Tag.pointwise in target.tags or target.overloadpacket in _RECOMPUTABLE_PACKETS


def saved_bytes(node: torch.fx.Node) -> int | None:
    """Bytes a saved value of ``node`` keeps alive, or None if it cannot be saved as one value."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _hint(val.numel()) * val.element_size()
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return 8
    return None


def _hint(n: int | torch.SymInt) -> int:
    if isinstance(n, int):
        return n
    hint = n.node.hint
    return int(hint) if hint is not None else 4096  # unbacked: a guess, only used for ranking
