"""The partitioner's cost model: what a value costs to keep, and what may be recomputed.

Recomputing is allowed for ops that are cheap next to a memory round trip and deterministic:
pointwise math, views, casts, constants, a scatter of one value (a loss's one-hot: codegen writes
it as a ``where``), and *row* reductions. Never recomputed: matrix products, convolutions,
attention, random ops, in-place/mutating ops, anything we do not know, and reductions that are not
row reductions.

A row reduction reduces the trailing dimensions of its input, at most ``ROW_LIMIT`` elements per
output (layer norm's statistics, softmax's max and sum over an attention row): codegen holds each
row in registers, and the backward reads that row anyway, so recomputing it costs little. A longer
row (a language model's vocabulary, 50257 logits) is reduced in a loop of its own over the row: a
backward that recomputed its max and sum of exponentials would read the logits twice, so its
per-row statistics are saved instead (a float32 per row). A reduction over leading dimensions
(batch norm's per-channel statistics over N, H, W) is a pass of its own over the whole tensor too.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from cgtrees.codegen.heuristics import PERSISTENT_LIMIT

aten = torch.ops.aten

ROW_LIMIT = PERSISTENT_LIMIT  # the longest row codegen reduces in registers, without a loop

_REDUCTIONS = {
    aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.var, aten.var_mean, aten.std,
    aten.argmax, aten.argmin, aten.max, aten.min, aten.logsumexp, aten.any, aten.all,
}
_RECOMPUTABLE_PACKETS = {
    # views and layout
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.expand,
    aten.detach, aten.squeeze, aten.unsqueeze, aten.slice, aten.select, aten.alias, aten.as_strided,
    aten.clone, aten._to_copy, aten.cat, aten.split, aten.split_with_sizes, aten.unbind,
    aten.constant_pad_nd, aten.flip, aten.repeat,
    # constants
    aten.full, aten.full_like, aten.zeros, aten.zeros_like, aten.ones, aten.ones_like,
    aten.scalar_tensor, aten.arange, aten.empty, aten.empty_like,
}
# Library kernels: they read their inputs from memory, so nothing is fused into them.
_LIBRARY = {
    aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.convolution,
    aten.convolution_backward,
    aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
}
_NEVER = _LIBRARY | {aten.copy_, aten.native_dropout}
_VIEWS = {
    aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.transpose, aten.t, aten.expand,
    aten.detach, aten.squeeze, aten.unsqueeze, aten.slice, aten.select, aten.alias, aten.as_strided,
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
    if target is aten.scatter.value:  # one value written wherever the index says: deterministic
        return True
    if torch.Tag.pointwise in target.tags or target.overloadpacket in _RECOMPUTABLE_PACKETS:
        return True
    return target.overloadpacket in _REDUCTIONS and _is_row_reduction(node)


def reads_from_memory(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The values a library call ``node`` (a matrix product, a convolution, attention) reads
    whole from memory: its tensor arguments, seen through views to the value they view. A value a
    backward library call reads must exist in memory there: recomputing it is a kernel of its own
    that writes it again, while saving it costs nothing more when the forward wrote it anyway."""
    if node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in _LIBRARY:
        return set()
    out: set[torch.fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        value = todo.pop()
        if value in out:
            continue
        out.add(value)
        if is_view(value):
            todo.extend(value.all_input_nodes)
    return out


def is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _VIEWS


def splits_kernels(node: torch.fx.Node) -> bool:
    """Whether a value that may not be recomputed lies between kernels: a library call, a column
    reduction. A reduction over a long row (saved rather than recomputed: ``ROW_LIMIT``) does not:
    codegen reduces the row in the kernel that reads it, beside its pointwise readers."""
    if node.op != "call_function" or is_recomputable(node):
        return False
    packet = getattr(node.target, "overloadpacket", None)
    return not (packet in _REDUCTIONS and _is_row_reduction(node, limit=None))


def _is_row_reduction(node: torch.fx.Node, limit: int | None = ROW_LIMIT) -> bool:
    """Does ``node`` reduce only trailing dimensions, at most ``limit`` elements per output (None:
    any number), and keep some? A reduction of every dimension (a loss's count of its targets) is
    one value: recomputed, it is a kernel of its own in the backward; saved, it is a few bytes."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    dims = _reduced_dims(node, val.dim())
    extent = 1
    for d in dims:
        extent *= _hint(val.shape[d])
    trailing = dims == list(range(val.dim() - len(dims), val.dim()))
    return trailing and (limit is None or extent <= limit) and (len(dims) < val.dim() or extent <= 1)


def _reduced_dims(node: torch.fx.Node, ndim: int) -> list[int]:
    """The dimensions a reduction reduces, sorted and non-negative (no ``dim``: all of them)."""
    dim = _argument(node, "dim")
    if dim is None or dim == []:
        return list(range(ndim))
    if ndim == 0:  # a 0-d input: ``dim`` 0 or -1 names the tensor itself, nothing to index
        return []
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % ndim for d in dims})


def _argument(node: torch.fx.Node, name: str) -> Any:
    """``node``'s argument ``name``, given by position or keyword; None where it is not given."""
    if name in node.kwargs:
        return node.kwargs[name]
    names = [a.name for a in node.target._schema.arguments]
    index = names.index(name) if name in names else len(node.args)
    return node.args[index] if index < len(node.args) else None


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
