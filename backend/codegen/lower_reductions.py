"""Lowerings of reductions: sum, mean, prod, amax, amin, argmax, argmin, any/all, var, var_mean.

A sum of a one-hot along its dimension is the element it picks, no reduction (``one_hot``).

Each reduction becomes a ``Compute`` step over the input's index space with some dimensions
reduced; float inputs accumulate in float32 (half types) or their own type. ``mean`` is a sum
followed by a pointwise division; ``var``/``var_mean`` are two passes (the mean, then the sum of
squared deviations), which the scheduler puts in one kernel. A long reduction with few output rows
is split in two stages (``heuristics.split_reduction``): partial results over chunks, then the
reduction of the partials; whether it is a row or a column reduction is read off the input's
strides (a channels-last BatchNorm's statistics are columns). A softmax's max and sum are not split:
they are one pass over the row (``online_softmax``).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from cgtrees.codegen import heuristics, ir, one_hot, online_softmax
from cgtrees.codegen import kernel_facts as facts
from cgtrees.codegen.ir import Op
from cgtrees.codegen.lowering import (
    CannotLower,
    LowerCtx,
    TensorValue,
    broadcast,
    cast,
    compute_dtype,
    lowering,
    meta_layout,
    meta_size,
)

aten = torch.ops.aten

# Reductions whose partial results combine with the same reduction (argmax/argmin do not).
SPLITTABLE = (ir.Reduce.SUM, ir.Reduce.PROD, ir.Reduce.MAX, ir.Reduce.MIN)


def _dims(x: TensorValue, dims: Any) -> tuple[int, ...]:
    n = len(x.size)
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(n))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({(d + n if d < 0 else d) if n else 0 for d in dims}))


def _reduce(ctx: LowerCtx, x: TensorValue, dims: tuple[int, ...], kind: ir.Reduce, acc: torch.dtype,
            layout: ir.Layout, name: str, out: torch.dtype) -> TensorValue:
    if not x.size:  # a 0-d tensor reduces to itself (its arg-extreme is index 0)
        if kind in (ir.Reduce.ARGMAX, ir.Reduce.ARGMIN):
            return TensorValue((), out, ir.Const(0, out))
        return TensorValue((), out, cast(x.body, out))
    body = cast(x.body, acc)
    whole = kind not in SPLITTABLE or online_softmax.in_softmax(ctx.node)  # one pass over the row: not split
    split = None if whole else heuristics.split_reduction(x.size, dims, _reduces_rows(x, dims))
    if split is None:
        return ctx.add_reduction(name, layout, out, x.size, dims, kind, body)
    return _split_reduce(ctx, TensorValue(x.size, acc, body), dims, kind, layout, name, out, split)


def _reduces_rows(x: TensorValue, dims: tuple[int, ...]) -> bool:
    """Whether the reduced elements are adjacent in memory, read off the strides of the input's
    loads (a channels-last tensor reduced over N, H, W is a column reduction: C is adjacent)."""
    space = [(ir.index_symbol(d), n, d in dims) for d, n in enumerate(x.size) if n != 1]
    return facts.reduces_innermost({"x": x.body}, space)


def _split_reduce(ctx: LowerCtx, x: TensorValue, dims: tuple[int, ...], kind: ir.Reduce, layout: ir.Layout,
                  name: str, out: torch.dtype, split: heuristics.Split) -> TensorValue:
    """Stage 1 cuts ``split.dim`` into (parts, chunk) and reduces every reduced dim but ``parts``
    and ``split.keep``: one partial per part and kept index. Stage 2 reduces the partials over
    them into ``layout``."""
    n, dim = len(x.size), split.dim
    chunk = x.size[dim] // split.parts
    # Stage 1's dimensions, each (kind, original dim): "parts" and "chunk" cut ``dim``.
    if split.outer:
        space = [("parts", dim), *(("whole", d) for d in split.keep)]
        space += [("chunk", d) if d == dim else ("whole", d) for d in range(n) if d not in split.keep]
    else:
        space = [e for d in range(n) for e in ([("parts", d), ("chunk", d)] if d == dim else [("whole", d)])]
    pos = {e: i for i, e in enumerate(space)}
    subs = {ir.index_symbol(d): ir.index_symbol(pos["whole", d]) for d in range(n) if d != dim}
    subs[ir.index_symbol(dim)] = ir.index_symbol(pos["parts", dim]) * chunk + ir.index_symbol(pos["chunk", dim])
    size = {"parts": sympy.Integer(split.parts), "chunk": chunk}
    ranges = tuple(size.get(k, x.size[d]) for k, d in space)
    reduced = tuple(i for i, (k, d) in enumerate(space)
                    if k == "chunk" or (k == "whole" and d in dims and d not in split.keep))
    kept_space = [e for i, e in enumerate(space) if i not in reduced]
    kept = tuple(ranges[pos[e]] for e in kept_space)
    partial = ctx.add_reduction(name + "_part", ir.Layout(kept, ir.contiguous_strides(kept)), x.dtype, ranges,
                                reduced, kind, ir.map_indices(x.body, subs))
    again = (dim, *split.keep)  # the original dims that stage 2 reduces
    if len(layout.size) != n:
        return ctx.add_reduction(name, layout, out, kept, tuple(i for i, (_, d) in enumerate(kept_space) if d in again),
                                 kind, partial.body)
    # keepdim: stage 2 keeps every dim (the others reduced in stage 1 as size 1) so ``layout`` fits it.
    ranges = tuple(size["parts"] if d == dim else x.size[d] if d in again or d not in dims else sympy.Integer(1)
                   for d in range(n))
    body = ir.map_indices(partial.body, {ir.index_symbol(j): ir.index_symbol(d) for j, (_, d) in enumerate(kept_space)})
    return ctx.add_reduction(name, layout, out, ranges, tuple(sorted(again)), kind, body)


def _keepdim_layout(x: TensorValue, dims: tuple[int, ...]) -> ir.Layout:
    size = tuple(sympy.Integer(1) if d in dims else n for d, n in enumerate(x.size))
    return ir.Layout(size, ir.contiguous_strides(size))


def _acc_dtype(dtype: torch.dtype, out: torch.dtype) -> torch.dtype:
    return compute_dtype(out) if out.is_floating_point else out


@lowering(aten.sum.dim_IntList, aten.sum.default)
def _sum(ctx: LowerCtx, x: TensorValue, dims: Any = None, keepdim: bool = False, *,
         dtype: torch.dtype | None = None) -> TensorValue:
    meta = ctx.out_meta()
    dims, acc = _dims(x, dims), _acc_dtype(x.dtype, meta.dtype)
    pick = one_hot.picked(ctx.builder, x.body, x.size, dims[0]) if len(dims) == 1 and x.size else None
    if pick is not None:  # a one-hot's sum: the one element it picks
        size = tuple(sympy.Integer(1) if d in dims else n for d, n in enumerate(x.size))
        return _from_keepdim(TensorValue(size, acc, cast(pick, acc)), meta, dims, meta.dtype)
    return _reduce(ctx, x, dims, ir.Reduce.SUM, acc, meta_layout(meta), ctx.node.name, meta.dtype)


@lowering(aten.prod.dim_int, aten.prod.default)
def _prod(ctx: LowerCtx, x: TensorValue, dim: Any = None, keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> TensorValue:
    meta = ctx.out_meta()
    return _reduce(ctx, x, _dims(x, dim), ir.Reduce.PROD, _acc_dtype(x.dtype, meta.dtype), meta_layout(meta),
                   ctx.node.name, meta.dtype)


def _extreme(kind: ir.Reduce):
    def lower(ctx: LowerCtx, x: TensorValue, dims: Any = None, keepdim: bool = False) -> TensorValue:
        meta = ctx.out_meta()
        acc = compute_dtype(meta.dtype) if meta.dtype != torch.bool else torch.int8
        return _reduce(ctx, x, _dims(x, dims), kind, acc, meta_layout(meta), ctx.node.name, meta.dtype)

    return lower


def _nonempty(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    if node.args[0].meta["val"].numel() == 0:
        return "max/min over an empty tensor (eager raises)"
    return None


lowering(aten.amax.default, can_lower=_nonempty)(_extreme(ir.Reduce.MAX))
lowering(aten.amin.default, can_lower=_nonempty)(_extreme(ir.Reduce.MIN))


def _arg_fits(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    x = node.args[0].meta["val"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    n = x.numel() if dim is None or x.dim() == 0 else x.shape[dim]
    if not isinstance(n, int) or n == 0:
        return f"argmax/argmin over {n} elements (eager raises on none; symbolic rows are not generated)"
    return None


def _arg(kind: ir.Reduce):
    def lower(ctx: LowerCtx, x: TensorValue, dim: Any = None, keepdim: bool = False) -> TensorValue:
        meta = ctx.out_meta()
        acc = compute_dtype(x.dtype) if x.dtype != torch.bool else torch.int8
        return _reduce(ctx, x, _dims(x, dim), kind, acc, meta_layout(meta), ctx.node.name, meta.dtype)

    return lower


lowering(aten.argmax.default, can_lower=_arg_fits)(_arg(ir.Reduce.ARGMAX))
lowering(aten.argmin.default, can_lower=_arg_fits)(_arg(ir.Reduce.ARGMIN))


def _truth(x: TensorValue) -> TensorValue:
    if x.dtype == torch.bool:
        return x
    return TensorValue(x.size, torch.bool, Op("ne", (x.body, broadcast(0, (), x.dtype)), torch.bool))


@lowering(aten.any.default, aten.any.dim, aten.any.dims)
def _any(ctx: LowerCtx, x: TensorValue, dims: Any = None, keepdim: bool = False) -> TensorValue:
    meta = ctx.out_meta()
    return _reduce(ctx, _truth(x), _dims(x, dims), ir.Reduce.MAX, torch.int8, meta_layout(meta), ctx.node.name,
                   meta.dtype)


@lowering(aten.all.default, aten.all.dim, aten.all.dims)
def _all(ctx: LowerCtx, x: TensorValue, dims: Any = None, keepdim: bool = False) -> TensorValue:
    meta = ctx.out_meta()
    return _reduce(ctx, _truth(x), _dims(x, dims), ir.Reduce.MIN, torch.int8, meta_layout(meta), ctx.node.name,
                   meta.dtype)


def _float_input(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    if not node.args[0].meta["val"].is_floating_point():
        return "mean/var of a non-float tensor"
    return None


def _count(x: TensorValue, dims: tuple[int, ...]) -> sympy.Expr:
    n = sympy.Integer(1)
    for d in dims:
        n = n * x.size[d]
    return n


def _row_mean(ctx: LowerCtx, x: TensorValue, dims: tuple[int, ...], acc: torch.dtype, name: str) -> TensorValue:
    """The mean of ``x`` over ``dims`` as a keepdim value (a sum buffer divided by the count)."""
    total = _reduce(ctx, x, dims, ir.Reduce.SUM, acc, _keepdim_layout(x, dims), name, acc)
    count = broadcast(_count(x, dims), (), acc)
    return TensorValue(total.size, acc, Op("truediv", (total.body, count), acc))


def _from_keepdim(value: TensorValue, meta: torch.Tensor, dims: tuple[int, ...], out: torch.dtype) -> TensorValue:
    """A keepdim value as the node's result (dims dropped when the op was not keepdim)."""
    size = meta_size(meta)
    if len(size) == len(value.size):
        return TensorValue(size, out, cast(value.body, out))
    kept = [d for d in range(len(value.size)) if d not in dims]
    subs = {ir.index_symbol(d): sympy.Integer(0) for d in dims}
    subs.update({ir.index_symbol(d): ir.index_symbol(i) for i, d in enumerate(kept)})
    return TensorValue(size, out, cast(ir.map_indices(value.body, subs), out))


@lowering(aten.mean.dim, aten.mean.default, can_lower=_float_input)
def _mean(ctx: LowerCtx, x: TensorValue, dims: Any = None, keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> TensorValue:
    meta = ctx.out_meta()
    dims = _dims(x, dims)
    acc = compute_dtype(meta.dtype)
    if not x.size:
        return TensorValue((), meta.dtype, cast(x.body, meta.dtype))
    return _from_keepdim(_row_mean(ctx, x, dims, acc, ctx.node.name + "_sum"), meta, dims, meta.dtype)


def _variance(ctx: LowerCtx, x: TensorValue, dims: tuple[int, ...], correction: Any, acc: torch.dtype,
              name: str) -> tuple[TensorValue, TensorValue]:
    mean = _row_mean(ctx, x, dims, acc, name + "_sum")
    diff = Op("sub", (cast(x.body, acc), broadcast(mean, x.size, acc)), acc)
    sq = TensorValue(x.size, acc, Op("mul", (diff, diff), acc))
    m2 = _reduce(ctx, sq, dims, ir.Reduce.SUM, acc, _keepdim_layout(x, dims), name + "_m2", acc)
    correction = 1 if correction is None else correction
    denom = Op("fmax", (Op("sub", (broadcast(_count(x, dims), (), acc), broadcast(correction, (), acc)), acc),
                        broadcast(0, (), acc)), acc)
    var = TensorValue(m2.size, acc, Op("truediv", (m2.body, denom), acc))
    return var, mean


@lowering(aten.var_mean.correction, aten.var.correction, can_lower=_float_input)
def _var_mean(ctx: LowerCtx, x: TensorValue, dims: Any = None, *, correction: Any = None,
              keepdim: bool = False) -> Any:
    if not x.size:
        raise CannotLower("var of a 0-d tensor")
    dims = _dims(x, dims)
    metas = ctx.out_meta()
    metas = metas if isinstance(metas, (tuple, list)) else (metas,)
    acc = compute_dtype(metas[0].dtype)
    var, mean = _variance(ctx, x, dims, correction, acc, ctx.node.name)
    if ctx.node.target == aten.var.correction:
        return _from_keepdim(var, metas[0], dims, metas[0].dtype)
    return (_from_keepdim(var, metas[0], dims, metas[0].dtype), _from_keepdim(mean, metas[1], dims, metas[1].dtype))
