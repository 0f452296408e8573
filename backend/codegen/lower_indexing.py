"""Lowerings of indexing ops: reads at indices taken from data, and pieces put side by side.

- ``embedding``, ``gather``, ``index.Tensor`` read their input at indices loaded from another
  tensor (``ir.Indirect``): ``out[i, j] = weight[ids[i], j]``. The input is realized first (a
  buffer), the index tensor stays lazy (it fuses). Kernels check every such index against the
  dimension's size and raise where eager raises (``x[idx]`` counts negative indices from the end,
  ``gather`` and ``embedding`` do not); an index out of range is never read. The check is a
  ``tl.device_assert``: Triton's interpreter runs it (``interp.enable``), compiled Triton only in
  debug mode (``TRITON_DEBUG=1``, or a kernel compiled with ``debug=True``); without it, an
  element at an index out of range reads nothing and is 0.
- ``cat``, ``constant_pad_nd``, ``slice_scatter``, ``select_scatter`` are a ``where`` over the
  output index, each input read only inside its own range (``ir.mask_loads``), so they fuse into
  their consumers: ``cat([-x2, x1]) * cos`` is one kernel.
- Writes at indices taken from data (``scatter``, ``index_put``, ``embedding_dense_backward``)
  are in ``lower_scatter.py``.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from cgtrees.codegen import ir
from cgtrees.codegen.ir import Const, IndexValue, Op
from cgtrees.codegen.lowering import (
    CannotLower,
    LowerCtx,
    TensorValue,
    broadcast,
    cast,
    compute_dtype,
    lowering,
    meta_size,
    sym,
)

aten = torch.ops.aten
INTEGER_INDEX = (torch.int64, torch.int32)


# ---------------------------------------------------------------------------------------- helpers
def _take(ctx: LowerCtx, x: TensorValue, coords: list[Any]) -> ir.Load:
    """``x`` (realized) at ``coords``: per dimension an index expression or an ``ir.Indirect``."""
    buf, layout = ctx.realize_input(x).view
    syms, indirect = [], []
    for c in coords:
        if isinstance(c, ir.Indirect):
            syms.append(ir.indirect_symbol(len(indirect)))
            indirect.append(c)
        else:
            syms.append(c)
    return ir.Load(buf, layout.index(tuple(syms)), x.dtype, None, tuple(indirect))


def _shift(x: TensorValue, subs: dict) -> ir.Expr:
    return ir.map_indices(x.body, subs)


def _index_at(d: int) -> IndexValue:
    return IndexValue(ir.index_symbol(d), torch.int64)


def _cmp(name: str, a: ir.Expr, b: Any) -> ir.Expr:
    return Op(name, (a, b if isinstance(b, (Op, IndexValue, ir.Indirect)) else Const(sym(b), torch.int64)), torch.bool)


def _all(conds: list[ir.Expr]) -> ir.Expr | None:
    out = None
    for c in conds:
        out = c if out is None else Op("and", (out, c), torch.bool)
    return out


def _where(cond: ir.Expr, a: ir.Expr, b: ir.Expr, dtype: torch.dtype) -> ir.Expr:
    return Op("where", (cond, a, b), dtype)


def _dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _int_indices(*positions: int, scalar_ok: bool = False):
    """``can_lower``: the index tensors (args at ``positions``, lists included) are integers (and
    the indexed tensor is not 0-d, unless ``scalar_ok``)."""

    def check(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
        for p in positions:
            arg = node.args[p] if p < len(node.args) else None
            for a in arg if isinstance(arg, (list, tuple)) else [arg]:
                if isinstance(a, torch.fx.Node) and a.meta["val"].dtype not in INTEGER_INDEX:
                    return f"a {a.meta['val'].dtype} index tensor (masks have data-dependent sizes)"
        if node.args[0].meta["val"].dim() == 0 and not scalar_ok:
            return "indexing a 0-d tensor"
        return None

    return check


# ------------------------------------------------------------------------------------ indirect reads
@lowering(aten.embedding.default, can_lower=_int_indices(1))
def _embedding(ctx: LowerCtx, weight: TensorValue, indices: TensorValue, padding_idx: int = -1,
               scale_grad_by_freq: bool = False, sparse: bool = False) -> TensorValue:
    if len(weight.size) != 2:
        raise CannotLower("embedding of a weight that is not 2-D")
    meta = ctx.out_meta()
    row = ir.Indirect(indices.body, weight.size[0], wrap=False)  # indices use the leading output symbols
    return TensorValue(meta_size(meta), meta.dtype, _take(ctx, weight, [row, ir.index_symbol(len(indices.size))]))


@lowering(aten.gather.default, can_lower=_int_indices(2, scalar_ok=True))
def _gather(ctx: LowerCtx, x: TensorValue, dim: int, index: TensorValue, sparse_grad: bool = False) -> TensorValue:
    meta = ctx.out_meta()
    if len(index.size) != len(x.size):
        raise CannotLower("gather with an index of another rank")
    return TensorValue(meta_size(meta), meta.dtype, _take(ctx, x, _along(x, dim, index.body)))


@lowering(aten.index_select.default, can_lower=_int_indices(2, scalar_ok=True))
def _index_select(ctx: LowerCtx, x: TensorValue, dim: int, index: TensorValue) -> TensorValue:
    meta = ctx.out_meta()
    dim = _dim(dim, len(x.size)) if x.size else 0
    at = ir.map_indices(index.body, {ir.index_symbol(0): ir.index_symbol(dim)}) if index.size else index.body
    return TensorValue(meta_size(meta), meta.dtype, _take(ctx, x, _along(x, dim, at)))


def _along(x: TensorValue, dim: int, index: ir.Expr) -> list[Any]:
    """Coordinates into ``x``: ``index`` (checked, not wrapped) along ``dim``, the output's own
    symbols along the others. A 0-d ``x`` counts as one element along dimension 0."""
    if not x.size:
        return [ir.Indirect(index, sympy.Integer(1), wrap=False)]
    dim = _dim(dim, len(x.size))
    return [ir.Indirect(index, x.size[d], wrap=False) if d == dim else ir.index_symbol(d) for d in range(len(x.size))]


@lowering(aten.index.Tensor, can_lower=_int_indices(1))
def _index(ctx: LowerCtx, x: TensorValue, indices: list[Any]) -> TensorValue:
    meta = ctx.out_meta()
    size = meta_size(meta)
    return TensorValue(size, meta.dtype, _take(ctx, x, advanced_coords(x.size, indices, size)))


def indexed_size(x_size: tuple, indices: list[Any]) -> tuple:
    """The size of ``x[indices]`` (``indices``: index tensors or None, as ``aten.index`` takes them)."""
    picked = [d for d, t in enumerate(indices) if t is not None]
    b_size: list = []
    for t in (indices[d] for d in picked):  # broadcast the index tensors' sizes (right-aligned)
        b_size = [sympy.Integer(1)] * (len(t.size) - len(b_size)) + b_size
        for j, n in enumerate(t.size, start=len(b_size) - len(t.size)):
            b_size[j] = n if b_size[j] == 1 else b_size[j]
    rest = [n for d, n in enumerate(x_size) if d not in picked]
    at = picked[0] if picked == list(range(picked[0], picked[-1] + 1)) else 0
    return tuple(rest[:at] + b_size + rest[at:])


def advanced_coords(x_size: tuple, indices: list[Any], size: tuple) -> list[Any]:
    """Coordinates into ``x`` of element ``(x0, x1, ...)`` of ``x[i0, :, i2]`` (of ``size``): the
    index tensors broadcast to one shape ``B``; its dims sit where the indexed dims were if those
    are adjacent, else in front (numpy's rule). Negative indices count from the end."""
    picked = [d for d, t in enumerate(indices) if t is not None]
    rank_b = len(size) - (len(x_size) - len(picked))
    adjacent = picked == list(range(picked[0], picked[-1] + 1))
    b_at = picked[0] if adjacent else 0  # where B's dims start in the output
    b_size = size[b_at:b_at + rank_b]
    shift = {ir.index_symbol(j): ir.index_symbol(b_at + j) for j in range(rank_b)}
    rest = iter([d for d in range(len(size)) if not b_at <= d < b_at + rank_b])  # output dims of x's others
    coords = []
    for d in range(len(x_size)):
        t = indices[d] if d < len(indices) else None
        if t is None:
            coords.append(ir.index_symbol(next(rest)))
        else:
            value = ir.map_indices(broadcast(t, b_size), shift)
            coords.append(ir.Indirect(value, x_size[d], wrap=True))
    return coords


# ------------------------------------------------------------------------------ pieces side by side
def _skipped_in_cat(t: TensorValue, rank: int, dim: int) -> bool:
    """Eager's cat skips empty pieces (a 1-D ``tensor([])`` among any others, too)."""
    return (len(t.size) == 1 and t.size[0] == 0 and rank != 1) or t.size[dim] == 0


@lowering(aten.cat.default)
def _cat(ctx: LowerCtx, tensors: list[TensorValue], dim: int = 0) -> TensorValue:
    meta = ctx.out_meta()
    size = meta_size(meta)
    dim = _dim(dim, len(size))
    compute = compute_dtype(meta.dtype)
    pieces = [t for t in tensors if not _skipped_in_cat(t, len(size), dim)]
    if not pieces:
        raise CannotLower("cat of empty tensors only")
    xd = _index_at(dim)
    starts, start = [], sympy.Integer(0)
    for t in pieces:
        starts.append(start)
        start = start + t.size[dim]
    body = None
    for t, begin in reversed(list(zip(pieces, starts))):  # innermost: the last piece
        value = cast(_shift(t, {ir.index_symbol(dim): ir.index_symbol(dim) - begin}), compute)
        if body is None:
            body = value if len(pieces) == 1 else ir.mask_loads(value, _cmp("ge", xd, begin))
            continue
        inside = _cmp("lt", xd, begin + t.size[dim])
        if begin != 0:
            inside = Op("and", (_cmp("ge", xd, begin), inside), torch.bool)
        body = _where(_cmp("lt", xd, begin + t.size[dim]), ir.mask_loads(value, inside), body, compute)
    return TensorValue(size, meta.dtype, cast(body, meta.dtype))


def _int_pads(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    if not all(isinstance(p, int) for p in node.args[1]):
        return "symbolic padding"
    return None


@lowering(aten.constant_pad_nd.default, can_lower=_int_pads)
def _constant_pad_nd(ctx: LowerCtx, x: TensorValue, pad: list[int], value: Any = 0) -> TensorValue:
    meta = ctx.out_meta()
    compute = compute_dtype(meta.dtype)
    n = len(x.size)
    subs, conds = {}, []
    for i in range(len(pad) // 2):
        d, lo, hi = n - 1 - i, pad[2 * i], pad[2 * i + 1]
        xd = ir.index_symbol(d)
        subs[xd] = xd - lo
        if lo > 0:
            conds.append(_cmp("ge", _index_at(d), lo))
        if hi > 0:
            conds.append(_cmp("lt", _index_at(d), x.size[d] + lo))
    body = cast(_shift(x, subs), compute)
    inside = _all(conds)
    if inside is not None:
        body = _where(inside, ir.mask_loads(body, inside), broadcast(value, (), compute), compute)
    return TensorValue(meta_size(meta), meta.dtype, cast(body, meta.dtype))


@lowering(aten.slice_scatter.default)
def _slice_scatter(ctx: LowerCtx, base: TensorValue, src: TensorValue, dim: int = 0, start: Any = None,
                   end: Any = None, step: int = 1) -> TensorValue:
    meta = ctx.out_meta()
    size = meta_size(meta)
    dim = _dim(dim, len(size))
    length = size[dim]
    start = 0 if start is None else start
    if not (isinstance(start, int) and length.is_number and isinstance(step, int)):
        raise CannotLower("slice_scatter with a symbolic start or size")
    start = min(max(start + int(length) if start < 0 else start, 0), int(length))
    xd, count = ir.index_symbol(dim), src.size[dim]
    inside = [_cmp("ge", _index_at(dim), start), _cmp("lt", _index_at(dim), start + step * (count - 1) + 1)]
    if step != 1:
        inside.append(_cmp("eq", IndexValue(sympy.Mod(xd - start, step), torch.int64), 0))
    from torch.utils._sympy.functions import FloorDiv

    at = xd - start if step == 1 else FloorDiv(xd - start, step)
    return _put(meta, base, _shift(src, {xd: at}), _all(inside))


@lowering(aten.select_scatter.default)
def _select_scatter(ctx: LowerCtx, base: TensorValue, src: TensorValue, dim: int, index: Any) -> TensorValue:
    meta = ctx.out_meta()
    size = meta_size(meta)
    dim = _dim(dim, len(size))
    index = sym(index)
    if index.is_number and index < 0:
        index = index + size[dim]
    subs = {ir.index_symbol(j): ir.index_symbol(j if j < dim else j + 1) for j in range(len(src.size))}
    return _put(meta, base, _shift(src, subs), _cmp("eq", _index_at(dim), index))


def _put(meta: torch.Tensor, base: TensorValue, src: ir.Expr, inside: ir.Expr) -> TensorValue:
    """``src`` (read only where it lands) where ``inside`` holds, ``base`` elsewhere."""
    compute = compute_dtype(meta.dtype)
    body = _where(inside, ir.mask_loads(cast(src, compute), inside), cast(base.body, compute), compute)
    return TensorValue(meta_size(meta), meta.dtype, cast(body, meta.dtype))
