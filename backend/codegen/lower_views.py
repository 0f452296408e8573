"""Lowerings of view ops.

A view of a materialized buffer is exact and free: its size, strides and storage offset come from
the node's meta (which matches the buffer, since every buffer we allocate follows its node's meta),
so any view op works, ``as_strided`` included. A view of a value that is not materialized remaps
the index symbols (permute, expand, unsqueeze, squeeze, select, slice, transpose, and reshapes that
split dimensions or add or drop size-1 ones, or merge dimensions its index expressions read as one:
``merge_views``); other reshapes of such values realize the value first.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from cgtrees.codegen import ir, merge_views
from cgtrees.codegen.lowering import (
    LOWERINGS,
    LowerCtx,
    TensorValue,
    is_library_op,
    lowering,
    meta_layout,
    meta_size,
    sym,
)

aten = torch.ops.aten
_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def _buffer_view(ctx: LowerCtx, x: TensorValue, meta: torch.Tensor) -> TensorValue:
    buf, _ = x.view
    layout = meta_layout(meta)
    offset = sym(meta.storage_offset()) - ctx.meta_offset(buf)
    layout = ir.Layout(layout.size, layout.stride, sympy.expand(offset))
    syms = ir.index_symbols(len(layout.size))
    return TensorValue(layout.size, meta.dtype, ir.Load(buf, layout.index(syms), meta.dtype), view=(buf, layout))


def _remap(x: TensorValue, size: tuple, subs: dict) -> TensorValue:
    """``subs`` maps each input symbol to an expression of the output symbols."""
    return TensorValue(size, x.dtype, ir.map_indices(x.body, subs))


def view_op(remap):
    """Wrap a lazy remap: buffers take the exact meta view, lazy values remap or realize."""

    def lower(ctx: LowerCtx, x: TensorValue, *args: Any, **kwargs: Any) -> TensorValue:
        meta = ctx.out_meta()
        if x.view is not None:
            return _buffer_view(ctx, x, meta)
        subs = remap(x, meta_size(meta), *args, **kwargs)
        if subs is None and ctx.node.target in _RESHAPES and _kernels_read(ctx.node):  # a merge (merge_views)
            body = merge_views.merged_body(x.body, x.size, meta_size(meta))
            if body is not None:
                return TensorValue(meta_size(meta), x.dtype, body)
        if subs is None:  # not a pure index remap: materialize, then view the buffer
            return _buffer_view(ctx, ctx.realize_input(x), meta)
        return _remap(x, meta_size(meta), subs)

    return lower


def _kernels_read(node: torch.fx.Node) -> bool:
    """Whether only our kernels read ``node`` (a library call, or a graph output, would have it
    written in the merged shape, apart from the kernel of the value it merges)."""
    return all(user.op == "call_function" and user.target in LOWERINGS and not is_library_op(user.target)
               for user in node.users)


def _xs(n: int) -> tuple[sympy.Symbol, ...]:
    return ir.index_symbols(n)


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


@lowering(aten.permute.default)
@view_op
def _permute(x: TensorValue, size: tuple, dims: list[int]) -> dict:
    ys = _xs(len(size))
    return {ir.index_symbol(_dim(d, len(size))): ys[i] for i, d in enumerate(dims)}


@lowering(aten.transpose.int)
@view_op
def _transpose(x: TensorValue, size: tuple, d0: int, d1: int) -> dict:
    n = len(size)
    order = list(range(n))
    a, b = _dim(d0, n), _dim(d1, n)
    order[a], order[b] = order[b], order[a]
    return {ir.index_symbol(order[i]): _xs(n)[i] for i in range(n)}


@lowering(aten.t.default)
@view_op
def _t(x: TensorValue, size: tuple) -> dict:
    ys = _xs(len(size))
    return {ir.index_symbol(i): ys[len(size) - 1 - i] for i in range(len(size))}


@lowering(aten.expand.default)
@view_op
def _expand(x: TensorValue, size: tuple, *args: Any, **kwargs: Any) -> dict:
    ys = _xs(len(size))
    lead = len(size) - len(x.size)
    return {ir.index_symbol(j): (sympy.Integer(0) if n == 1 and size[lead + j] != 1 else ys[lead + j])
            for j, n in enumerate(x.size)}


@lowering(aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
          aten.view.default, aten._unsafe_view.default, aten.reshape.default)
@view_op
def _reshape_split(x: TensorValue, size: tuple, *args: Any, **kwargs: Any) -> dict | None:
    return split_remap(x.size, size)


def split_remap(src: tuple, dst: tuple) -> dict | None:
    """A reshape from ``src`` to ``dst`` sizes where each input dimension is the product of a run of
    consecutive output dimensions (a split, ``[B*T, N] -> [B, T, N]``, or size-1 dimensions added or
    dropped), as an index remap: ``x0 = T*y0 + y1``. None for any other reshape (a merge would need
    division and remainder in the index)."""
    ys = _xs(len(dst))
    outs = [(i, n) for i, n in enumerate(dst) if n != 1]
    subs, k = {}, 0
    for j, n in enumerate(src):
        run, product = [], sympy.Integer(1)
        while n != 1 and k < len(outs) and sympy.expand(product - n) != 0:
            run.append(outs[k])
            product *= outs[k][1]
            k += 1
        if sympy.expand(product - n) != 0:
            return None
        index, step = sympy.Integer(0), sympy.Integer(1)
        for i, m in reversed(run):
            index, step = index + step * ys[i], step * m
        subs[ir.index_symbol(j)] = index
    return subs if k == len(outs) else None


@lowering(aten.select.int)
@view_op
def _select(x: TensorValue, size: tuple, dim: int, index: Any) -> dict:
    n = len(x.size)
    dim = _dim(dim, n)
    index = sym(index)
    if index.is_number and index < 0:
        index = index + x.size[dim]
    ys = _xs(len(size))
    subs = {}
    for j in range(n):
        subs[ir.index_symbol(j)] = index if j == dim else ys[j if j < dim else j - 1]
    return subs


@lowering(aten.slice.Tensor)
@view_op
def _slice(x: TensorValue, size: tuple, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> dict:
    n = len(x.size)
    dim = _dim(dim, n)
    length = x.size[dim]
    start = sympy.Integer(0) if start is None else sym(start)
    if start.is_number and length.is_number:
        start = sympy.Integer(min(max(int(start) + (int(length) if start < 0 else 0), 0), int(length)))
    ys = _xs(n)
    return {ir.index_symbol(j): (start + int(step) * ys[j] if j == dim else ys[j]) for j in range(n)}


def _realize_first(x: TensorValue, size: tuple, *args: Any, **kwargs: Any) -> None:
    return None  # no remap: realize the input, then take the exact view of the buffer


lowering(aten.as_strided.default, aten.diagonal.default, aten.unfold.default)(view_op(_realize_first))


@lowering(aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int)
def _split(ctx: LowerCtx, x: TensorValue, *args: Any, **kwargs: Any) -> tuple[TensorValue, ...]:
    x = ctx.realize_input(x)
    return tuple(_buffer_view(ctx, x, meta) for meta in ctx.out_meta())
