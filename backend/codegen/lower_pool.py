"""Lowerings of 2-D pooling as window reductions: ``max_pool2d_with_indices``, ``avg_pool2d``
and their backwards.

The forward ops reduce each output element's window: the index space is ``(*lead, OH, OW, KH,
KW)`` with the window ``(KH, KW)`` reduced; window element ``(kh, kw)`` of output ``(oh, ow)``
reads the input at ``(oh * stride - pad + kh * dilation, ...)``, only where that is inside the
input (padding reads nothing). A small lazy input fuses in (``relu -> max_pool`` is one kernel).

- ``max_pool2d_with_indices``: the values are a (NaN-propagating) max; the indices are a second
  reduction in the same kernel, the minimum flat position ``ih * W + iw`` among the window's
  elements equal to that max. Positions grow in window order, so that is the first max, as eager
  picks (it replaces its running max only on a strictly greater value); where the max is NaN,
  eager keeps the *last* NaN, so there the minimum is taken over negated positions of the NaNs.
- ``avg_pool2d``: a sum divided by eager's divisor (``divisor_override``, or the window's size
  clipped to the padded input when ``count_include_pad``, else the count of elements inside the
  input); int64 divides truncating, as eager does.

The backward ops gather rather than scatter (as eager's CUDA kernel does): grad-input element
``(h, w)`` sums over the windows that can hold it, ``oh = (h + pad) // stride - a`` for ``a`` in
``[0, ceil(((k - 1) * dilation + 1) / stride))`` (likewise ``ow``), a reduction over ``(a, b)``.
Max pool's backward takes a window's gradient where its index names ``(h, w)``; average pool's
takes ``grad / divisor`` where the window covers ``(h, w)``. No atomics, no zero fill, a
deterministic sum (in float32 for half types), and consumers (a ReLU's backward) fuse into it.

Run through aten, with the reason: a window that holds no element of the input (dilation larger
than one with left padding: eager then reports an index outside the input), an empty input,
symbolic spatial sizes where that check needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree
from torch.utils._sympy.functions import FloorDiv

from backend.codegen import ir
from backend.codegen.ir import Const, IndexValue, Op
from backend.codegen.lowering import (
    LowerCtx,
    TensorValue,
    cast,
    compute_dtype,
    lowering,
    meta_layout,
    meta_size,
    sym,
)

aten = torch.ops.aten

# A lazy input of at most this many expression nodes is computed inside the pooling kernel (once
# per window that reads it) rather than written to memory first.
FUSE_INPUT_LIMIT = 32
BIG = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class Window:
    """One spatial dimension's pooling geometry: input ``size``, output ``out`` elements."""

    kernel: int
    stride: int
    pad: int
    dilation: int
    size: sympy.Expr
    out: sympy.Expr

    def at(self, o: sympy.Expr, k: sympy.Expr) -> sympy.Expr:
        """The input position of window element ``k`` of output ``o``."""
        return o * self.stride - self.pad + k * self.dilation

    def covering(self) -> int:
        """How many windows can hold one input position."""
        return -(-((self.kernel - 1) * self.dilation + 1) // self.stride)

    def empty_window(self) -> bool | None:
        """Whether some window holds no input position (None: cannot tell, the size is symbolic).
        Only a window starting in the left padding can (the last window starts inside the input,
        as eager's output size ensures): its first position at or past 0 is ``start % dilation``
        (eager's ``pad <= kernel / 2`` keeps that within the window), which must be inside."""
        first = max((start % self.dilation for start in range(-self.pad, 0, self.stride)), default=0)
        if first == 0:
            return False
        if not sympy.sympify(self.size).is_number:
            return None
        return first >= int(self.size)


@dataclass(frozen=True)
class Pool:
    h: Window
    w: Window
    lead: int  # dimensions before (H, W): (N, C) or (C,)


def _bound(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        else:
            out[arg.name] = node.kwargs.get(arg.name, arg.default_value)
    return out


def _pair(v: Any, default: list[int] | None = None) -> tuple[int, int]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    if not v and default is not None:
        v = default
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _pool(node: torch.fx.Node, x: torch.Tensor, out: torch.Tensor) -> Pool:
    """The geometry of a pooling node: input ``x`` and output ``out`` (metas)."""
    a = _bound(node)
    kernel = _pair(a["kernel_size"])
    stride, pad = _pair(a["stride"], list(kernel)), _pair(a["padding"])
    dilation = _pair(a.get("dilation", 1))
    windows = [Window(kernel[i], stride[i], pad[i], dilation[i], sym(x.shape[-2 + i]), sym(out.shape[-2 + i]))
               for i in range(2)]
    return Pool(windows[0], windows[1], x.dim() - 2)


def _val(a: Any) -> Any:
    return a.meta["val"] if isinstance(a, torch.fx.Node) else a


def _geometry_ok(node: torch.fx.Node, x: torch.Tensor, out: torch.Tensor) -> str | None:
    if x.dim() not in (3, 4):
        return f"pooling a {x.dim()}-d tensor"
    a = _bound(node)
    given = [a[k] for k in ("kernel_size", "stride", "padding", "dilation") if k in a]
    if not all(isinstance(v, int) for v in pytree.tree_leaves(given)):
        return "symbolic kernel size, stride, padding or dilation"
    if x.numel() == 0 or out.numel() == 0:
        return "pooling an empty tensor"
    pool = _pool(node, x, out)
    for window in (pool.h, pool.w):
        empty = window.empty_window()
        if empty is None:
            return "a symbolic spatial size with dilation and padding (a window might hold no input element)"
        if empty:
            return "a window holds no element of the input (eager then reports an index outside it)"
    return None


def _forward_ok(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    x, out = _val(node.args[0]), node.meta["val"]
    return _geometry_ok(node, x, out[0] if isinstance(out, (tuple, list)) else out)


def _backward_ok(node: torch.fx.Node, ctx: LowerCtx) -> str | None:
    return _geometry_ok(node, _val(node.args[1]), _val(node.args[0]))


# ---------------------------------------------------------------------------------------- helpers
def _index(e: sympy.Expr) -> IndexValue:
    return IndexValue(e, torch.int64)


def _int(v: Any) -> ir.Expr:
    return Const(v, torch.int64)


def _cmp(name: str, a: ir.Expr, b: ir.Expr) -> ir.Expr:
    return Op(name, (a, b), torch.bool)


def _all(conds: list[ir.Expr]) -> ir.Expr | None:
    out = None
    for c in conds:
        out = c if out is None else Op("and", (out, c), torch.bool)
    return out


def _inside(pos: sympy.Expr, low: bool, high: Any) -> list[ir.Expr]:
    """``0 <= pos`` (where ``low``) and ``pos < high`` (where ``high`` is not None)."""
    conds = [_cmp("ge", _index(pos), _int(0))] if low else []
    return conds + ([_cmp("lt", _index(pos), _int(high))] if high is not None else [])


def _reaches_past_end(window: Window) -> bool:
    """Whether the last window may reach past the input's end (padding, or ceil mode)."""
    last = (window.out - 1) * window.stride - window.pad + (window.kernel - 1) * window.dilation
    ahead = sympy.sympify(last - window.size + 1)
    return not (ahead.is_number and ahead <= 0)


def _input_value(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    """``x`` itself where it is small enough to compute in the pooling kernel, else a buffer."""
    return x if ir.size_of(x.body) <= FUSE_INPUT_LIMIT else ctx.realize_input(x)


def _window_element(x: TensorValue, pool: Pool, dtype: torch.dtype) -> tuple[ir.Expr, ir.Expr | None, sympy.Expr]:
    """Over ``(*lead, OH, OW, KH, KW)``: the input element at window position ``(kh, kw)``
    (read only inside the input), the condition that it is inside (None: always), and its flat
    position ``ih * W + iw`` in its plane."""
    n = pool.lead
    s = ir.index_symbols(n + 4)
    ih, iw = pool.h.at(s[n], s[n + 2]), pool.w.at(s[n + 1], s[n + 3])
    conds = _inside(ih, pool.h.pad > 0, pool.h.size if _reaches_past_end(pool.h) else None)
    conds += _inside(iw, pool.w.pad > 0, pool.w.size if _reaches_past_end(pool.w) else None)
    value = cast(ir.map_indices(x.body, {s[n]: ih, s[n + 1]: iw}), dtype)
    inside = _all(conds)
    if inside is not None:
        value = ir.mask_loads(value, inside)
    return value, inside, ih * pool.w.size + iw


def _lowest(dtype: torch.dtype) -> ir.Expr:
    return Const(float("-inf"), dtype) if dtype.is_floating_point else Const(torch.iinfo(dtype).min, dtype)


def _where(cond: ir.Expr | None, a: ir.Expr, b: ir.Expr, dtype: torch.dtype) -> ir.Expr:
    return a if cond is None else Op("where", (cond, a, b), dtype)


# ------------------------------------------------------------------------------------------ max pool
@lowering(aten.max_pool2d_with_indices.default, can_lower=_forward_ok)
def _max_pool2d(ctx: LowerCtx, x: TensorValue, *args: Any, **kwargs: Any) -> tuple[TensorValue, TensorValue]:
    values_meta, indices_meta = ctx.out_meta(0), ctx.out_meta(1)
    pool = _pool(ctx.node, ctx.node.args[0].meta["val"], values_meta)
    acc = compute_dtype(values_meta.dtype)
    element, inside, flat = _window_element(_input_value(ctx, x), pool, acc)
    ranges = (*meta_size(values_meta), pool.h.kernel, pool.w.kernel)
    reduced = (pool.lead + 2, pool.lead + 3)
    name = ctx.node.name
    best = ctx.add_reduction(name, meta_layout(values_meta), values_meta.dtype, ranges, reduced, ir.Reduce.MAX,
                             _where(inside, element, _lowest(acc), acc))
    best_acc = cast(best.body, acc)  # its row's max, over the kernel's kept dims (the same symbols)
    hit = _cmp("eq", element, best_acc)
    key: ir.Expr = _index(flat)
    if acc.is_floating_point:  # a NaN max: the last NaN, the smallest of the negated positions
        hit = Op("or", (hit, Op("isnan", (element,), torch.bool)), torch.bool)
        key = _where(Op("isnan", (best_acc,), torch.bool), _index(-flat), key, torch.int64)
    if inside is not None:
        hit = Op("and", (inside, hit), torch.bool)
    first = ctx.add_reduction(name + "_indices", meta_layout(indices_meta), torch.int64, ranges, reduced,
                              ir.Reduce.MIN, Op("where", (hit, key, _int(BIG)), torch.int64))
    if acc.is_floating_point:
        first = TensorValue(first.size, torch.int64, Op("abs", (first.body,), torch.int64))
    return best, first


@lowering(aten.max_pool2d_with_indices_backward.default, can_lower=_backward_ok)
def _max_pool2d_backward(ctx: LowerCtx, grad: TensorValue, x: TensorValue, *args: Any) -> TensorValue:
    """``grad_input[h, w]``: the sum of ``grad[oh, ow]`` over the windows whose index is ``h * W + w``."""
    indices = args[-1]
    meta = ctx.out_meta()
    pool = _pool(ctx.node, ctx.node.args[1].meta["val"], ctx.node.args[0].meta["val"])
    n = pool.lead
    s = ir.index_symbols(n + 4)

    def term(at: dict, inside: ir.Expr, acc: torch.dtype) -> ir.Expr:
        index = ir.mask_loads(ir.map_indices(indices.body, at), inside)
        here = _cmp("eq", cast(index, torch.int64), _index(s[n] * pool.w.size + s[n + 1]))
        value = ir.mask_loads(cast(ir.map_indices(grad.body, at), acc), inside)
        return Op("where", (Op("and", (inside, here), torch.bool), value, Const(0, acc)), acc)

    return _gather(ctx, pool, meta, term)


def _gather(ctx: LowerCtx, pool: Pool, meta: torch.Tensor, term: Any) -> TensorValue:
    """The sum over the windows that can hold ``(h, w)``: ``term(at, inside, acc)`` gives one
    window's contribution (``at`` maps a window-indexed value's ``(oh, ow)`` symbols to that
    window, ``inside``: the window exists); the index space is ``(*lead, H, W, a, b)``."""
    n = pool.lead
    s = ir.index_symbols(n + 4)
    oh = FloorDiv(s[n] + pool.h.pad, pool.h.stride) - s[n + 2]
    ow = FloorDiv(s[n + 1] + pool.w.pad, pool.w.stride) - s[n + 3]
    inside = _all(_inside(oh, True, pool.h.out) + _inside(ow, True, pool.w.out))
    acc = compute_dtype(meta.dtype)
    body = term({s[n]: oh, s[n + 1]: ow}, inside, acc)
    ranges = (*meta_size(meta), pool.h.covering(), pool.w.covering())
    return ctx.add_reduction(ctx.node.name, meta_layout(meta), meta.dtype, ranges, (n + 2, n + 3), ir.Reduce.SUM,
                             body)


# ------------------------------------------------------------------------------------------ avg pool
def _divisor(node: torch.fx.Node, pool: Pool, oh: sympy.Expr, ow: sympy.Expr) -> ir.Expr:
    """Eager's divisor of window ``(oh, ow)`` (an int64 value)."""
    a = _bound(node)
    if a["divisor_override"] is not None:
        return _int(a["divisor_override"])
    sizes = []
    for window, o in ((pool.h, oh), (pool.w, ow)):
        start = _index(o * window.stride - window.pad)
        end = Op("imin", (_index(o * window.stride - window.pad + window.kernel), _int(window.size + window.pad)),
                 torch.int64)
        if not a["count_include_pad"]:
            start = Op("imax", (start, _int(0)), torch.int64)
            end = Op("imin", (end, _int(window.size)), torch.int64)
        sizes.append(Op("sub", (end, start), torch.int64))
    return Op("mul", tuple(sizes), torch.int64)


def _divide(total: ir.Expr, divisor: ir.Expr, acc: torch.dtype) -> ir.Expr:
    if acc.is_floating_point:
        return Op("truediv", (total, cast(divisor, acc)), acc)
    return Op("itruncdiv", (total, cast(divisor, acc)), acc)  # eager's integer division truncates


@lowering(aten.avg_pool2d.default, can_lower=_forward_ok)
def _avg_pool2d(ctx: LowerCtx, x: TensorValue, *args: Any, **kwargs: Any) -> TensorValue:
    meta = ctx.out_meta()
    pool = _pool(ctx.node, ctx.node.args[0].meta["val"], meta)
    acc = compute_dtype(meta.dtype)
    element, inside, _ = _window_element(_input_value(ctx, x), pool, acc)
    ranges = (*meta_size(meta), pool.h.kernel, pool.w.kernel)
    n = pool.lead
    layout = ir.Layout(meta_size(meta), ir.contiguous_strides(meta_size(meta)))
    total = ctx.add_reduction(ctx.node.name + "_sum", layout, acc, ranges, (n + 2, n + 3), ir.Reduce.SUM,
                              _where(inside, element, Const(0, acc), acc))
    s = ir.index_symbols(n + 2)
    mean = _divide(total.body, _divisor(ctx.node, pool, s[n], s[n + 1]), acc)
    return TensorValue(meta_size(meta), meta.dtype, cast(mean, meta.dtype))


@lowering(aten.avg_pool2d_backward.default, can_lower=_backward_ok)
def _avg_pool2d_backward(ctx: LowerCtx, grad: TensorValue, x: TensorValue, *args: Any) -> TensorValue:
    """``grad_input[h, w]``: the sum of ``grad[oh, ow] / divisor`` over the windows covering ``(h, w)``."""
    meta = ctx.out_meta()
    pool = _pool(ctx.node, ctx.node.args[1].meta["val"], ctx.node.args[0].meta["val"])
    n = pool.lead
    s = ir.index_symbols(n + 4)

    def term(at: dict, inside: ir.Expr, acc: torch.dtype) -> ir.Expr:
        oh, ow = at[s[n]], at[s[n + 1]]
        covers = _all([_cmp("lt", _index(s[n]), _index(pool.h.at(oh, 0) + pool.h.kernel)),
                       _cmp("lt", _index(s[n + 1]), _index(pool.w.at(ow, 0) + pool.w.kernel))])
        where = Op("and", (inside, covers), torch.bool)
        value = ir.mask_loads(cast(ir.map_indices(grad.body, at), acc), where)
        share = _divide(value, _divisor(ctx.node, pool, oh, ow), acc)
        return Op("where", (where, share, Const(0, acc)), acc)

    return _gather(ctx, pool, meta, term)
