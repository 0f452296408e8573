"""Lowerings of scans: ``cumsum`` and ``cumprod`` along one dimension.

A scan is a ``Compute`` whose reduction is a scan kind (``ir.Reduce.CUMSUM``, ``CUMPROD``): one
result per element, the running sum (product) along the scanned dimension. Its kernel holds whole
rows in one block and scans them with ``tl.cumsum`` (``tl.associative_scan`` for the product), so
rows are limited to ``heuristics.SCAN_LIMIT`` elements. Its input fuses into it; its consumers
read its buffer. Float16 and bfloat16 accumulate in float32, integers (and bool, which eager sums
as int64) in the result's type, which eager's promotion already widened.

A longer row is scanned in two levels: the row split into ``parts`` chunks of ``LONG_CHUNK``
elements (the last one padded with the identity), each chunk scanned on its own; then the chunks'
totals (each chunk's last element) scanned; then each element combined with the running total of
the chunks before its own (a pointwise value, which fuses into its consumers). Rows of more than
``LONG_CHUNK * SCAN_LIMIT`` elements, and rows of symbolic length, run through aten.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.utils._sympy.functions import FloorDiv

from cgtrees.codegen import heuristics, ir
from cgtrees.codegen.ir import Const, IndexValue, Op
from cgtrees.codegen.lowering import LowerCtx, TensorValue, cast, compute_dtype, lowering, meta_layout

aten = torch.ops.aten

LONG_CHUNK = 2048  # elements per chunk of a row longer than SCAN_LIMIT


def _fits(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    x = node.args[0].meta["val"]
    if x.dim() == 0:
        return None
    n = x.shape[node.args[1] % x.dim()]
    limit = LONG_CHUNK * heuristics.SCAN_LIMIT
    if not isinstance(n, int) or n > limit:
        return f"a scan over rows of {n} elements (only rows of at most {limit} are generated)"
    return None


@lowering(aten.cumsum.default, aten.cumprod.default, can_lower=_fits)
def _scan(ctx: LowerCtx, x: TensorValue, dim: int, *, dtype: Any = None) -> TensorValue:
    meta = ctx.out_meta()
    acc = compute_dtype(meta.dtype)
    if not x.size:  # a 0-d tensor scans to itself
        return TensorValue((), meta.dtype, cast(x.body, meta.dtype))
    kind = ir.Reduce.CUMSUM if ctx.node.target == aten.cumsum.default else ir.Reduce.CUMPROD
    dim = dim % len(x.size)
    if int(x.size[dim]) > heuristics.SCAN_LIMIT:
        return _long_scan(ctx, TensorValue(x.size, acc, cast(x.body, acc)), dim, kind, meta)
    return ctx.add_reduction(ctx.node.name, meta_layout(meta), meta.dtype, x.size, (dim,), kind, cast(x.body, acc))


def _long_scan(ctx: LowerCtx, x: TensorValue, dim: int, kind: ir.Reduce, meta: torch.Tensor) -> TensorValue:
    """Scan chunks, scan the chunks' totals, combine: ``out[i] = chunks[p, c] (+ or *) totals[p - 1]``
    for ``i = p * LONG_CHUNK + c``."""
    n, acc, chunk = int(x.size[dim]), x.dtype, LONG_CHUNK
    parts = -(-n // chunk)
    identity = Const(0 if kind == ir.Reduce.CUMSUM else 1, acc)
    combine = "add" if kind == ir.Reduce.CUMSUM else "mul"
    name = ctx.node.name
    rest = len(x.size) - dim - 1
    s = ir.index_symbols(len(x.size) + 1)  # over (*before, parts, chunk, *after)
    split = {ir.index_symbol(dim + 1 + j): s[dim + 2 + j] for j in range(rest)}
    split[ir.index_symbol(dim)] = s[dim] * chunk + s[dim + 1]
    element = ir.map_indices(x.body, split)
    if parts * chunk != n:  # the last chunk's padding scans the identity
        inside = Op("lt", (IndexValue(s[dim] * chunk + s[dim + 1], torch.int64), Const(n, torch.int64)), torch.bool)
        element = Op("where", (inside, ir.mask_loads(element, inside), identity), acc)
    ranges = (*x.size[:dim], sympy.Integer(parts), sympy.Integer(chunk), *x.size[dim + 1:])
    chunks = ctx.add_reduction(name + "_chunks", ir.Layout(ranges, ir.contiguous_strides(ranges)), acc, ranges,
                               (dim + 1,), kind, element)
    # each chunk's total: its last element, over (*before, parts, *after)
    last = {s[dim + 1]: sympy.Integer(chunk - 1)}
    last.update({s[dim + 2 + j]: s[dim + 1 + j] for j in range(rest)})
    totals_size = (*x.size[:dim], sympy.Integer(parts), *x.size[dim + 1:])
    totals = ctx.add_reduction(name + "_totals", ir.Layout(totals_size, ir.contiguous_strides(totals_size)), acc,
                               totals_size, (dim,), kind, ir.map_indices(chunks.body, last))
    # element i of the row: its chunk's scan, combined with the totals of the chunks before it
    i = ir.index_symbol(dim)
    back = {ir.index_symbol(dim + 2 + j): ir.index_symbol(dim + 1 + j) for j in range(rest)}
    back.update({ir.index_symbol(dim): FloorDiv(i, chunk), ir.index_symbol(dim + 1): sympy.Mod(i, chunk)})
    within = ir.map_indices(chunks.body, back)
    before = ir.map_indices(totals.body, {ir.index_symbol(dim): FloorDiv(i, chunk) - 1})
    later = Op("gt", (IndexValue(i, torch.int64), Const(chunk - 1, torch.int64)), torch.bool)
    carried = Op("where", (later, ir.mask_loads(before, later), identity), acc)
    return TensorValue(x.size, meta.dtype, cast(Op(combine, (within, carried), acc), meta.dtype))
