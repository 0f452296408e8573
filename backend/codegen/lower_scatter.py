"""Lowerings of writes at indices taken from data: ``index_put``, ``scatter`` (``scatter_add``,
``scatter_reduce`` of a sum), ``embedding_dense_backward``; and ``as_strided_scatter``.

Each is two steps: a new buffer filled with the base (a copy of the input, or zeros), then a
scatter step (``ir.Compute`` with ``scatter``) over the space of the values written, which writes
each value at the place its indices give. Indices are checked as eager checks them (an index out
of range raises in the kernel, through ``tl.device_assert``, and is never written; ``index_put``
counts negative indices from the end, ``scatter`` does not). The scatter is a kernel of its own
(the scheduler never fuses a step that reads its buffer into it); the values it writes are
computed in it (a lazy ``src`` fuses). An in-place write of the program into a graph input
(``cache.index_copy_(...)``, which AOTAutograd makes a write into a copy and a copy back) is the
scatter step alone, into the input, where nothing else reads the input's old value
(``GraphBuilder.in_place_target``); an accumulation (``index_put_(..., accumulate=True)``) keeps
the copy: a first call that fails later reruns through aten on the input, and must not add twice.

- Without accumulation, several values landing on one place leave one of them there (eager
  documents that as undefined; on CPU the last one wins).
- With accumulation the writes are atomic adds (``tl.atomic_add``): eager's sum, in another order
  (float results differ in rounding only). Atomics exist for 32- and 64-bit types; float16 and
  bfloat16 accumulate in a float32 buffer (also what eager's CUDA kernel does: no rounding per
  add) and 8/16-bit integers and bool in an int32 one (wrapping, or ``!= 0`` for bool, as eager's
  sums do), cast back afterwards. So every dtype we generate is lowered.
- A scatter whose index holds one entry per row along ``dim`` (the one-hot of a loss's backward:
  ``zeros.scatter(1, target[:, None], -1.0)``) is a ``where`` instead, which fuses into its
  consumers: ``out[i, j] = src[i] if j == index[i, 0] else base[i, j]``.

``index_put`` with a boolean mask (``x[mask] = v``) is a ``where`` when ``v`` is one value for
every selected element (it does not vary along the selection's count).

``as_strided_scatter`` (the backward of an ``as_strided`` view) is a copy of its base and a write of
``src`` at the storage elements the view addresses; a view whose elements overlap runs through aten.

``scatter_reduce`` of a mean, or of a sum without ``self``, adds the values and counts them (two
scatters), then combines them with ``self`` pointwise as eager does.

Run through aten, each with its reason: other boolean mask indices (how many values a mask takes
is data-dependent), ``scatter_reduce`` of a product, max or min (no atomic product; Triton's
atomic max and min on floats do not propagate NaN), ``embedding_dense_backward`` scaled by
frequency.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from cgtrees.codegen import ir
from cgtrees.codegen.ir import Const, IndexValue, Op
from cgtrees.codegen.lower_indexing import INTEGER_INDEX, advanced_coords, indexed_size
from cgtrees.codegen.lowering import (
    LowerCtx,
    TensorValue,
    broadcast,
    cast,
    compute_dtype,
    lowering,
    meta_size,
)

aten = torch.ops.aten

# Atomic adds exist for 32- and 64-bit types: narrower ones accumulate in these.
ACCUMULATE_IN = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.int8: torch.int32,
                 torch.uint8: torch.int32, torch.int16: torch.int32, torch.bool: torch.int32}


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def write_at(ctx: LowerCtx, base: TensorValue, ranges: tuple, value: ir.Expr, coords: list[Any],
             mode: ir.Write, in_place: bool = False) -> TensorValue:
    """The node's result: ``base`` with ``value`` (an element over ``ranges``) written, or added,
    at ``coords`` (per dimension of ``base``: an index expression over ``ranges`` or an
    ``ir.Indirect``). ``in_place``: ``base`` is the node's first argument, and the scatter writes
    into it where the graph allows (``LowerCtx.in_place_target``) instead of into a copy; not
    where values are added (an accumulation applied twice would double them)."""
    dtype = ctx.out_meta().dtype
    acc = ACCUMULATE_IN.get(dtype, dtype) if mode == ir.Write.ADD else dtype
    # Only plain writes: written twice they leave the same values, and a first call whose later
    # kernel fails reruns the whole graph through aten on the input this one already wrote.
    if in_place and mode == ir.Write.STORE and ctx.in_place_target() is base:
        return scatter_into(ctx, base, ranges, cast(value, dtype), coords, mode)
    target = scatter_buffer(ctx, base, ranges, value, coords, mode, acc, "" if acc == dtype else "_acc")
    return target if acc == dtype else TensorValue(target.size, dtype, cast(target.body, dtype))


def scatter_buffer(ctx: LowerCtx, base: TensorValue, ranges: tuple, value: ir.Expr, coords: list[Any],
                   mode: ir.Write, acc: torch.dtype, suffix: str) -> TensorValue:
    """A new buffer of type ``acc`` (named after the node plus ``suffix``) holding ``base`` with
    ``value`` written, or added, at ``coords``."""
    target = ctx.fresh(TensorValue(base.size, acc, cast(base.body, acc)), suffix=suffix)
    return scatter_into(ctx, target, ranges, cast(value, acc), coords, mode)


def scatter_into(ctx: LowerCtx, target: TensorValue, ranges: tuple, value: ir.Expr, coords: list[Any],
                 mode: ir.Write) -> TensorValue:
    """A step writing ``value`` (of ``target``'s type), or adding it, into buffer ``target`` at ``coords``."""
    buf, layout = target.view
    syms, indirect = [], []
    for c in coords:
        if isinstance(c, ir.Indirect):
            syms.append(ir.indirect_symbol(len(indirect)))
            indirect.append(c)
        else:
            syms.append(c)
    ctx.scatter_into(buf, target.dtype, ranges, value, ir.Scatter(layout.index(tuple(syms)), tuple(indirect), mode))
    return target


def _arg(node: torch.fx.Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _val(a: Any) -> Any:
    return a.meta["val"] if isinstance(a, torch.fx.Node) else a


# ----------------------------------------------------------------------------------------- index_put
def _index_put_ok(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    x, indices, values = _val(node.args[0]), [_val(t) for t in node.args[1]], _val(node.args[2])
    if x.dim() == 0:
        return "index_put into a 0-d tensor"
    if all(t is None for t in indices):
        return "index_put without an index tensor"
    if any(t is not None and t.dtype == torch.bool for t in indices):
        return _mask_ok(x, indices, values)
    if any(t is not None and t.dtype not in INTEGER_INDEX for t in indices):
        return "index_put with an index that is neither an integer tensor nor a mask"
    return None


def _mask_ok(x: torch.Tensor, indices: list[Any], values: torch.Tensor) -> str | None:
    """``x[mask] = v`` is a ``where`` when ``v`` is the same for every selected element."""
    at = next(d for d, t in enumerate(indices) if t is not None)
    mask = indices[at]
    if sum(t is not None for t in indices) != 1 or mask.dtype != torch.bool or tuple(mask.shape) != \
            tuple(x.shape[at:at + mask.dim()]):
        return "index_put with a mask among other indices"
    trailing = x.dim() - at - mask.dim()  # dims of the selection after its (data-dependent) count
    if values.dim() > trailing and values.shape[values.dim() - trailing - 1] != 1:
        return "index_put of a mask with values that differ along the selected elements (their count is " \
               "data-dependent)"
    return None


@lowering(aten.index_put.default, aten._unsafe_index_put.default, can_lower=_index_put_ok)
def _index_put(ctx: LowerCtx, x: TensorValue, indices: list[Any], values: TensorValue,
               accumulate: bool = False) -> TensorValue:
    """``out = x.clone(); out[indices] = values`` (``+=`` where ``accumulate``): the values,
    broadcast to the size of ``x[indices]``, written where ``x[indices]`` reads."""
    if any(t is not None and t.dtype == torch.bool for t in indices):
        return _index_put_mask(ctx, x, indices, values, accumulate)
    size = indexed_size(x.size, indices)
    value = broadcast(values, size, compute_dtype(x.dtype))
    mode = ir.Write.ADD if accumulate else ir.Write.STORE
    return write_at(ctx, x, size, value, advanced_coords(x.size, indices, size), mode, in_place=True)


def _index_put_mask(ctx: LowerCtx, x: TensorValue, indices: list[Any], values: Any, accumulate: bool) -> TensorValue:
    """``x[mask] = v`` (one value for every selected element): ``where(mask, v, x)`` (``x + v``
    where accumulating), a pointwise value that fuses."""
    meta = ctx.out_meta()
    at = next(d for d, t in enumerate(indices) if t is not None)
    mask, n, k = indices[at], len(x.size), len(indices[at].size)
    compute = torch.int32 if meta.dtype == torch.bool else compute_dtype(meta.dtype)
    # the values over the selection's size with its count as 1: (x.size[:at], 1, x.size[at + k:])
    value = broadcast(values, (*x.size[:at], sympy.Integer(1), *x.size[at + k:]), compute)
    to_x = {ir.index_symbol(i): ir.index_symbol(i) for i in range(at)}
    to_x[ir.index_symbol(at)] = sympy.Integer(0)
    to_x.update({ir.index_symbol(at + 1 + j): ir.index_symbol(at + k + j) for j in range(n - at - k)})
    value = ir.map_indices(value, to_x)
    picked = ir.map_indices(mask.body, {ir.index_symbol(j): ir.index_symbol(at + j) for j in range(k)})
    base = cast(x.body, compute)
    if accumulate:
        value = Op("add", (base, value), compute)
    return TensorValue(x.size, meta.dtype, cast(Op("where", (picked, value, base), compute), meta.dtype))


# ------------------------------------------------------------------------------------------- scatter
def _scatter_ok(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    base, dim, index = (_val(a) for a in node.args[:3])
    if index.dim() != base.dim():
        return "scatter with an index of another rank"
    if index.dtype not in INTEGER_INDEX:
        return f"scatter with a {index.dtype} index"
    if _mode(node) is None:
        return f"scatter_reduce {_arg(node, 4, 'reduce')!r}: only sums and means are generated (atomic adds; " \
               "no atomic product, nor a NaN-propagating atomic max or min)"
    return None


def _mode(node: torch.fx.Node) -> ir.Write | None:
    """How a scatter writes, or None for a reduction we do not generate."""
    if node.target == aten.scatter_add.default:
        return ir.Write.ADD
    if node.target == aten.scatter_reduce.two:
        return ir.Write.ADD if _arg(node, 4, "reduce") in ("sum", "mean") else None
    reduce = node.kwargs.get("reduce")  # scatter.reduce / scatter.value_reduce: "add" or "multiply"
    return {None: ir.Write.STORE, "add": ir.Write.ADD}.get(reduce)


def _one_per_row(node: torch.fx.Node) -> bool:
    """The index holds one entry per row along ``dim`` and covers every other dimension."""
    if node.target not in (aten.scatter.value, aten.scatter.src, aten.scatter_add.default):
        return False
    base, dim, index = (_val(a) for a in node.args[:3])
    dim = _dim(dim, base.dim())
    return index.shape[dim] == 1 and all(index.shape[d] == base.shape[d] for d in range(base.dim()) if d != dim)


@lowering(aten.scatter.value, aten.scatter.src, aten.scatter.reduce, aten.scatter.value_reduce,
          aten.scatter_add.default, aten.scatter_reduce.two, can_lower=_scatter_ok)
def _scatter(ctx: LowerCtx, base: TensorValue, dim: int, index: TensorValue, src: Any, *args: Any,
             **kwargs: Any) -> TensorValue:
    """``out[.., index[i, j, k], ..] = src[i, j, k]`` (at ``dim``; ``+=`` for scatter_add) over
    the index's elements; the index is checked against the dimension's size, not wrapped."""
    if not base.size:
        return _scatter_scalar(ctx, base, index, src)
    if _one_per_row(ctx.node):
        return _scatter_one_per_row(ctx, base, dim, index, src)
    dim = _dim(dim, len(base.size))
    compute = compute_dtype(base.dtype)
    coords = [ir.Indirect(index.body, base.size[dim], wrap=False) if d == dim else ir.index_symbol(d)
              for d in range(len(base.size))]
    value = cast(src.body, compute) if isinstance(src, TensorValue) else broadcast(src, (), compute)
    if _counted(ctx.node):
        return _scatter_counted(ctx, base, index, value, coords)
    return write_at(ctx, base, index.size, value, coords, _mode(ctx.node), in_place=True)


def _counted(node: torch.fx.Node) -> bool:
    """A scatter_reduce that needs how many values land on each element: a mean, or a sum
    without ``self``."""
    return node.target == aten.scatter_reduce.two and (
        _arg(node, 4, "reduce") == "mean" or not node.kwargs.get("include_self", True))


def _scatter_counted(ctx: LowerCtx, base: TensorValue, index: TensorValue, value: ir.Expr,
                     coords: list[Any]) -> TensorValue:
    """Eager's ``scatter_reduce`` sum without ``self`` and mean: ``total`` (the values landing on
    each element, added up) and ``count`` (how many), two scatters that add, then pointwise:
    ``(self + total) / (count + 1)`` for a mean with ``self``, and without ``self`` ``total`` (or
    ``total / count``) where ``count > 0``, ``self`` elsewhere. Integers divide rounding down,
    the sum and count wrapping in the result's type, as eager's do."""
    meta = ctx.out_meta()
    dtype, include_self = meta.dtype, ctx.node.kwargs.get("include_self", True)
    acc = ACCUMULATE_IN.get(dtype, dtype)
    zeros = TensorValue(base.size, dtype, Const(0, dtype))
    total = scatter_buffer(ctx, zeros, index.size, value, coords, ir.Write.ADD, acc, "_total")
    count = scatter_buffer(ctx, zeros, index.size, Const(1, torch.int32), coords, ir.Write.ADD, torch.int32,
                           "_count")
    compute = compute_dtype(dtype)
    own = cast(base.body, compute)
    result = cast(total.body, compute)
    n = cast(count.body, compute)  # eager counts in the result's type too
    if include_self:
        result = cast(cast(Op("add", (own, result), compute), dtype), compute)
        n = Op("add", (n, Const(1, compute)), compute)
    if _arg(ctx.node, 4, "reduce") == "mean":
        n = cast(cast(n, dtype), compute)
        divide = "truediv" if compute.is_floating_point else "ifloordiv"
        result = Op(divide, (result, Op("where", (Op("eq", (n, Const(0, compute)), torch.bool), Const(1, compute), n),
                                      compute)), compute)
    if not include_self:
        hit = Op("ne", (count.body, Const(0, torch.int32)), torch.bool)
        result = Op("where", (hit, result, own), compute)
    return TensorValue(base.size, dtype, cast(result, dtype))


def _scatter_scalar(ctx: LowerCtx, base: TensorValue, index: TensorValue, src: Any) -> TensorValue:
    """A 0-d base holds one element (index 0): ``src`` (plus ``base`` where adding) there."""
    meta = ctx.out_meta()
    compute = compute_dtype(meta.dtype)
    value = cast(src.body, compute) if isinstance(src, TensorValue) else broadcast(src, (), compute)
    base_value = cast(base.body, compute)
    if _mode(ctx.node) == ir.Write.ADD:
        value = Op("add", (base_value, value), compute)
    here = Op("eq", (ir.Indirect(index.body, sympy.Integer(1), wrap=False), Const(0, torch.int64)), torch.bool)
    return TensorValue((), meta.dtype, cast(Op("where", (here, value, base_value), compute), meta.dtype))


def _scatter_one_per_row(ctx: LowerCtx, base: TensorValue, dim: int, index: TensorValue, src: Any) -> TensorValue:
    """``out[.., j, ..] = src[.., 0, ..]`` where ``j == index[.., 0, ..]`` (plus ``base`` for
    scatter_add), ``base`` elsewhere: a ``where``, which fuses."""
    meta = ctx.out_meta()
    size = meta_size(meta)
    dim = _dim(dim, len(size))
    compute = compute_dtype(meta.dtype)
    row = {ir.index_symbol(dim): sympy.Integer(0)}
    target = ir.Indirect(ir.map_indices(index.body, row), size[dim], wrap=False)
    value = cast(ir.map_indices(src.body, row), compute) if isinstance(src, TensorValue) else \
        broadcast(src, (), compute)
    base_value = cast(base.body, compute)
    if ctx.node.target == aten.scatter_add.default:
        value = Op("add", (base_value, value), compute)
    here = Op("eq", (IndexValue(ir.index_symbol(dim), torch.int64), target), torch.bool)
    return TensorValue(size, meta.dtype, cast(Op("where", (here, value, base_value), compute), meta.dtype))


# ---------------------------------------------------------------------------- embedding_dense_backward
def _embedding_backward_ok(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    grad, indices = _val(node.args[0]), _val(node.args[1])
    if _arg(node, 4, "scale_grad_by_freq", False):
        return "embedding_dense_backward scaled by frequency (counts the indices first)"
    if indices.dtype not in INTEGER_INDEX or grad.dim() != indices.dim() + 1:
        return "embedding_dense_backward of a weight that is not 2-D"
    return None


@lowering(aten.embedding_dense_backward.default, can_lower=_embedding_backward_ok)
def _embedding_dense_backward(ctx: LowerCtx, grad: TensorValue, indices: TensorValue, num_weights: Any,
                              padding_idx: int, scale_grad_by_freq: bool) -> TensorValue:
    """``zeros(num_weights, D)`` with row ``grad[i, :]`` added at row ``indices[i]``, except
    where ``indices[i] == padding_idx``."""
    meta = ctx.out_meta()
    size = meta_size(meta)
    compute = compute_dtype(meta.dtype)
    keep = Op("ne", (cast(indices.body, torch.int64), Const(padding_idx, torch.int64)), torch.bool)
    value = Op("where", (keep, cast(grad.body, compute), Const(0, compute)), compute)
    zeros = TensorValue(size, meta.dtype, Const(0, meta.dtype))
    row = ir.Indirect(indices.body, size[0], wrap=False)
    return write_at(ctx, zeros, grad.size, value, [row, ir.index_symbol(len(indices.size))], ir.Write.ADD)


# -------------------------------------------------------------------------------- as_strided_scatter
def _as_strided_scatter_ok(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    size, stride = _arg(node, 2, "size"), _arg(node, 3, "stride")
    offset = _arg(node, 4, "storage_offset")
    if not all(isinstance(v, int) for v in [*size, *stride, offset or 0]):
        return "as_strided_scatter with a symbolic size, stride or offset"
    if any(st == 0 and n > 1 for n, st in zip(size, stride)):
        return "as_strided_scatter into a view with a zero stride (its elements overlap)"
    return None


@lowering(aten.as_strided_scatter.default, can_lower=_as_strided_scatter_ok)
def _as_strided_scatter(ctx: LowerCtx, base: TensorValue, src: TensorValue, size: list[int], stride: list[int],
                        storage_offset: int | None = None) -> TensorValue:
    """``out = base.clone(); out.as_strided(size, stride, storage_offset).copy_(src)``: a copy of
    ``base`` laid out as the result (the strides the view addresses), then ``src`` written at
    storage element ``storage_offset + sum(i * stride)`` (the backward of an ``as_strided`` view,
    a write through a view that functionalisation could not express with slices)."""
    dtype = ctx.out_meta().dtype
    ranges = tuple(sympy.Integer(n) for n in size)
    target = ctx.fresh(TensorValue(base.size, dtype, cast(base.body, dtype)))
    buf, layout = target.view
    where = sum((ir.index_symbol(d) * st for d, st in enumerate(stride)), sympy.Integer(storage_offset or 0))
    ctx.scatter_into(buf, dtype, ranges, broadcast(src, ranges, dtype), ir.Scatter(where, (), ir.Write.STORE))
    return target
