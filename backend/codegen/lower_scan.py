"""Lowerings of scans: ``cumsum`` and ``cumprod`` along one dimension.

A scan is a ``Compute`` whose reduction is a scan kind (``ir.Reduce.CUMSUM``, ``CUMPROD``): one
result per element, the running sum (product) along the scanned dimension. Its kernel holds whole
rows in one block and scans them with ``tl.cumsum`` (``tl.associative_scan`` for the product), so
rows are limited to ``heuristics.SCAN_LIMIT`` elements; a longer or symbolic row runs through aten
(a looped scan carrying the running value between blocks is not written yet). Its input fuses
into it; its consumers read its buffer. Float16 and bfloat16 accumulate in float32, integers (and
bool, which eager sums as int64) in the result's type, which eager's promotion already widened.
"""

from __future__ import annotations

from typing import Any

import torch

from backend.codegen import heuristics, ir
from backend.codegen.lowering import LowerCtx, TensorValue, cast, compute_dtype, lowering, meta_layout

aten = torch.ops.aten


def _fits(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    x = node.args[0].meta["val"]
    if x.dim() == 0:
        return None
    n = x.shape[node.args[1] % x.dim()]
    if not isinstance(n, int) or n > heuristics.SCAN_LIMIT:
        return f"a scan over rows of {n} elements (only rows of at most {heuristics.SCAN_LIMIT} are generated)"
    return None


@lowering(aten.cumsum.default, aten.cumprod.default, can_lower=_fits)
def _scan(ctx: LowerCtx, x: TensorValue, dim: int, *, dtype: Any = None) -> TensorValue:
    meta = ctx.out_meta()
    acc = compute_dtype(meta.dtype)
    if not x.size:  # a 0-d tensor scans to itself
        return TensorValue((), meta.dtype, cast(x.body, meta.dtype))
    kind = ir.Reduce.CUMSUM if ctx.node.target == aten.cumsum.default else ir.Reduce.CUMPROD
    return ctx.add_reduction(ctx.node.name, meta_layout(meta), meta.dtype, x.size, (dim % len(x.size),), kind,
                             cast(x.body, acc))
