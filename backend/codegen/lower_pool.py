"""Lowerings of 2-D pooling: ``max_pool2d_with_indices``, ``avg_pool2d`` and their backwards,
as pointwise kernels over the output with the window unrolled (small windows) or as window
reductions (larger ones).

Window element ``(kh, kw)`` of output ``(oh, ow)`` reads the input at ``(oh * stride - pad + kh *
dilation, ...)``, only where that is inside the input (padding reads nothing). A small lazy input
fuses in (``relu -> max_pool`` is one kernel).

- **Unrolled** (at most ``UNROLL_LIMIT`` window elements, or covering windows for a backward): a
  pointwise computation over the output, one term per window element. A pointwise kernel walks its
  output in memory order (``kernel._follow_layout``), so on a channels-last tensor neighbouring
  threads read neighbouring channels: the loads coalesce. (A reduction's rows follow the logical
  NCHW order, which on channels-last reads addresses ``stride * C`` apart: 14x slower on an H100.)
  Each element's bounds checks are kept only where that element can fall outside the input.
- **Reduction** over the index space ``(*lead, OH, OW, KH, KW)`` with the window reduced.

- ``max_pool2d_with_indices``: the values are a (NaN-propagating) max. The indices follow eager's
  rule (it replaces its running max only on a strictly greater value, or on a NaN): the first
  element equal to the max, or where the max is NaN, the last NaN. Unrolled, that is a chain of
  selects over the window elements compared with the max (read back from its buffer, computed in
  the same kernel); as a reduction, the minimum flat position ``ih * W + iw`` among the hits (over
  negated positions for NaNs).
- ``avg_pool2d``: a sum divided by eager's divisor (``divisor_override``, or the window's size
  clipped to the padded input when ``count_include_pad``, else the count of elements inside the
  input); int64 divides truncating, as eager does.

The backward ops gather rather than scatter (as eager's CUDA kernel does): grad-input element
``(h, w)`` sums over the windows that can hold it, ``oh = (h + pad) // stride - a`` for ``a`` in
``[0, ceil(((k - 1) * dilation + 1) / stride))`` (likewise ``ow``): unrolled over ``(a, b)``, or a
reduction over them. Max pool's backward takes a window's gradient where its index names ``(h,
w)``; average pool's takes ``grad / divisor`` where the window covers ``(h, w)``. No atomics, no
zero fill, a deterministic sum (in float32 for half types), and consumers (a ReLU's backward) fuse
into it.

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

from cgtrees.codegen import ir
from cgtrees.codegen.ir import Const, IndexValue, Op
from cgtrees.codegen.lowering import (
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
# Windows of at most this many elements (backwards: this many covering windows) are unrolled into
# a pointwise kernel; larger ones are reductions (Inductor draws its line at the same place).
UNROLL_LIMIT = 25
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

    def outside(self, k: int | sympy.Expr) -> tuple[bool, bool]:
        """Whether window element ``k`` (a number, or a symbol standing for any of them) can fall
        before the input's start, and past its end (padding, or ceil mode's partial last window)."""
        first, last = (k, k) if isinstance(k, int) else (0, self.kernel - 1)
        ahead = sympy.sympify((self.out - 1) * self.stride - self.pad + last * self.dilation - self.size + 1)
        return first * self.dilation < self.pad, not (ahead.is_number and ahead <= 0)

    def beyond(self, a: int | sympy.Expr) -> tuple[bool, bool]:
        """Backward: whether covering window ``a`` of an input position (``o = (i + pad) // stride
        - a``; a symbol: any of them) can be before the first window, and past the last one."""
        last = FloorDiv(self.size - 1 + self.pad, self.stride) - (a if isinstance(a, int) else 0)
        ahead = sympy.sympify(last - self.out + 1)
        return not (isinstance(a, int) and a == 0), not (ahead.is_number and ahead <= 0)

    def covers(self, a: int | sympy.Expr) -> bool:
        """Backward, no dilation: whether covering window ``a`` of an input position holds it
        for every position (its start is ``(i + pad) % stride + a * stride`` before it)."""
        return isinstance(a, int) and (a + 1) * self.stride <= self.kernel

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


def fold(op: str, terms: list[ir.Expr], dtype: torch.dtype) -> ir.Expr | None:
    """``((t0 op t1) op t2) ...`` in the order given (None for no terms)."""
    out = None
    for t in terms:
        out = t if out is None else Op(op, (out, t), dtype)
    return out


def _all(conds: list[ir.Expr]) -> ir.Expr | None:
    return fold("and", conds, torch.bool)


def _inside(pos: sympy.Expr, checks: tuple[bool, bool], end: sympy.Expr) -> list[ir.Expr]:
    """``0 <= pos`` and ``pos < end``, each where ``checks`` says it can fail."""
    low, high = checks
    conds = [_cmp("ge", _index(pos), _int(0))] if low else []
    return conds + ([_cmp("lt", _index(pos), _int(end))] if high else [])


def _input_value(ctx: LowerCtx, x: TensorValue) -> TensorValue:
    """``x`` itself where it is small enough to compute in the pooling kernel, else a buffer."""
    return x if ir.size_of(x.body) <= FUSE_INPUT_LIMIT else ctx.realize_input(x)


@dataclass(frozen=True)
class Element:
    """Window element ``(kh, kw)`` of output ``(*lead, oh, ow)``: its ``value`` (read only inside
    the input), the condition that it is inside (None: always), its flat position ``ih * W + iw``."""

    value: ir.Expr
    inside: ir.Expr | None
    flat: sympy.Expr


def element(x: TensorValue, pool: Pool, kh: int | sympy.Expr, kw: int | sympy.Expr, dtype: torch.dtype) -> Element:
    """Over ``(*lead, OH, OW)`` (and the window's dimensions where ``kh``, ``kw`` are symbols):
    one window element of ``x`` as ``dtype``."""
    n = pool.lead
    s = ir.index_symbols(n + 2)
    ih, iw = pool.h.at(s[n], kh), pool.w.at(s[n + 1], kw)
    conds = _inside(ih, pool.h.outside(kh), pool.h.size) + _inside(iw, pool.w.outside(kw), pool.w.size)
    inside = _all(conds)
    value = cast(ir.map_indices(x.body, {s[n]: ih, s[n + 1]: iw}), dtype)
    if inside is not None:
        value = _mask_positional_loads(value, (ih.free_symbols | iw.free_symbols), inside)
    return Element(value, inside, ih * pool.w.size + iw)


def _mask_positional_loads(expr: ir.Expr, spatial: set[sympy.Symbol], cond: ir.Expr) -> ir.Expr:
    """``expr`` with the loads that read at the window position (their index holds a symbol of
    ``spatial``) done only where ``cond`` holds. A plain load that does not depend on the position (a
    per-channel scale) reads the same element, inside the tensor, for every window element: it
    stays unmasked, so the kernel loads it once rather than once per bounds condition."""
    if isinstance(expr, ir.Load) and expr.mask is None and not expr.indirect \
            and not (sympy.sympify(expr.index).free_symbols & spatial):
        return expr
    if isinstance(expr, (ir.Load, ir.Indirect)):
        return ir.mask_loads(expr, cond)
    return ir.map_children(expr, lambda e: _mask_positional_loads(e, spatial, cond))


def _elements(x: TensorValue, pool: Pool, dtype: torch.dtype) -> list[Element]:
    """Every element of the window, in eager's order (``kh`` outer, ``kw`` inner)."""
    return [element(x, pool, kh, kw, dtype) for kh in range(pool.h.kernel) for kw in range(pool.w.kernel)]


def _unrolled(pool: Pool) -> bool:
    return pool.h.kernel * pool.w.kernel <= UNROLL_LIMIT


def _lowest(dtype: torch.dtype) -> ir.Expr:
    return Const(float("-inf"), dtype) if dtype.is_floating_point else Const(torch.iinfo(dtype).min, dtype)


def where(cond: ir.Expr | None, a: ir.Expr, b: ir.Expr, dtype: torch.dtype) -> ir.Expr:
    return a if cond is None else Op("where", (cond, a, b), dtype)


# ------------------------------------------------------------------------------------------ max pool
@lowering(aten.max_pool2d_with_indices.default, can_lower=_forward_ok)
def _max_pool2d(ctx: LowerCtx, x: TensorValue, *args: Any, **kwargs: Any) -> tuple[TensorValue, TensorValue]:
    values_meta, indices_meta = ctx.out_meta(0), ctx.out_meta(1)
    pool = _pool(ctx.node, ctx.node.args[0].meta["val"], values_meta)
    x = _input_value(ctx, x)
    if _unrolled(pool):
        return _max_pool2d_unrolled(ctx, x, pool, values_meta)
    return _max_pool2d_reduction(ctx, x, pool, values_meta, indices_meta)


def _max_pool2d_unrolled(ctx: LowerCtx, x: TensorValue, pool: Pool,
                         meta: torch.Tensor) -> tuple[TensorValue, TensorValue]:
    """The max of the window's elements, written to a buffer laid out as eager's; the indices stay
    lazy (an inference graph never computes them), read where the values are written."""
    acc = compute_dtype(meta.dtype)
    elements = _elements(x, pool, acc)
    best = fold("fmax" if acc.is_floating_point else "imax",
                [where(e.inside, e.value, _lowest(acc), acc) for e in elements], acc)
    size = meta_size(meta)
    # a step with nothing reduced is a pointwise one; add_reduction is the context's one way to
    # write a value with a given layout (``realize`` lays a tuple-valued node's out contiguously)
    values = ctx.add_reduction(ctx.node.name, meta_layout(meta), meta.dtype, size, (), None, cast(best, meta.dtype))
    return values, TensorValue(size, torch.int64, _eager_index(elements, cast(values.body, acc)))


def _eager_index(elements: list[Element], best: ir.Expr) -> ir.Expr:
    """Eager's index of the max ``best``: the first element equal to it, or where it is NaN (only
    floats), the last NaN. Each chain's fallback is its last candidate, which must hit when none
    of the others did (the max is one of the window's elements)."""
    def chain(candidates: list[tuple[ir.Expr, Element]]) -> ir.Expr:  # the first hit wins
        out: ir.Expr = _index(candidates[-1][1].flat)
        for test, e in reversed(candidates[:-1]):
            out = Op("where", (_and(e.inside, test), _index(e.flat), out), torch.int64)
        return out

    first = chain([(_cmp("eq", e.value, best), e) for e in elements])
    if not best.dtype.is_floating_point:
        return first
    last_nan = chain([(Op("isnan", (e.value,), torch.bool), e) for e in reversed(elements)])
    return Op("where", (Op("isnan", (best,), torch.bool), last_nan, first), torch.int64)


def _max_pool2d_reduction(ctx: LowerCtx, x: TensorValue, pool: Pool, values_meta: torch.Tensor,
                          indices_meta: torch.Tensor) -> tuple[TensorValue, TensorValue]:
    acc = compute_dtype(values_meta.dtype)
    n = pool.lead
    s = ir.index_symbols(n + 4)
    e = element(x, pool, s[n + 2], s[n + 3], acc)
    ranges = (*meta_size(values_meta), pool.h.kernel, pool.w.kernel)
    reduced = (n + 2, n + 3)
    name = ctx.node.name
    best = ctx.add_reduction(name, meta_layout(values_meta), values_meta.dtype, ranges, reduced, ir.Reduce.MAX,
                             where(e.inside, e.value, _lowest(acc), acc))
    best_acc = cast(best.body, acc)  # its row's max, over the kernel's kept dims (the same symbols)
    hit = _cmp("eq", e.value, best_acc)
    key: ir.Expr = _index(e.flat)
    if acc.is_floating_point:  # a NaN max: the last NaN, the smallest of the negated positions
        hit = Op("or", (hit, Op("isnan", (e.value,), torch.bool)), torch.bool)
        key = where(Op("isnan", (best_acc,), torch.bool), _index(-e.flat), key, torch.int64)
    if e.inside is not None:
        hit = Op("and", (e.inside, hit), torch.bool)
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
    s = ir.index_symbols(n + 2)

    def term(c: Candidate, acc: torch.dtype) -> ir.Expr:
        index = _masked(ir.map_indices(indices.body, c.at), c.inside)
        here = _cmp("eq", cast(index, torch.int64), _index(s[n] * pool.w.size + s[n + 1]))
        value = _masked(cast(ir.map_indices(grad.body, c.at), acc), c.inside)
        return where(_and(c.inside, here), value, Const(0, acc), acc)

    return _gather(ctx, pool, meta, term)


@dataclass(frozen=True)
class Candidate:
    """Covering window ``(a, b)`` of input position ``(*lead, h, w)`` (numbers, or the symbols of
    a reduction over them): ``at`` maps a window-indexed value's ``(oh, ow)`` symbols to it,
    ``inside``: the window exists (None: always)."""

    a: int | sympy.Expr
    b: int | sympy.Expr
    at: dict
    inside: ir.Expr | None


def _gather(ctx: LowerCtx, pool: Pool, meta: torch.Tensor, term: Any) -> TensorValue:
    """The sum over the windows that can hold ``(h, w)``: ``term(candidate, acc)`` gives one
    window's contribution. Unrolled: the covering windows in ascending ``(oh, ow)`` order, as
    eager's CUDA kernel adds them; else a reduction over the index space ``(*lead, H, W, a, b)``."""
    n = pool.lead
    acc = compute_dtype(meta.dtype)
    if pool.h.covering() * pool.w.covering() > UNROLL_LIMIT:
        s = ir.index_symbols(n + 4)
        body = term(_candidate(pool, s[n + 2], s[n + 3]), acc)
        ranges = (*meta_size(meta), pool.h.covering(), pool.w.covering())
        return ctx.add_reduction(ctx.node.name, meta_layout(meta), meta.dtype, ranges, (n + 2, n + 3),
                                 ir.Reduce.SUM, body)
    total = fold("add", [term(_candidate(pool, a, b), acc)
                          for a in reversed(range(pool.h.covering())) for b in reversed(range(pool.w.covering()))], acc)
    return TensorValue(meta_size(meta), meta.dtype, cast(total, meta.dtype))


def _candidate(pool: Pool, a: int | sympy.Expr, b: int | sympy.Expr) -> Candidate:
    n = pool.lead
    s = ir.index_symbols(n + 2)
    oh = FloorDiv(s[n] + pool.h.pad, pool.h.stride) - a
    ow = FloorDiv(s[n + 1] + pool.w.pad, pool.w.stride) - b
    inside = _all(_inside(oh, pool.h.beyond(a), pool.h.out) + _inside(ow, pool.w.beyond(b), pool.w.out))
    return Candidate(a, b, {s[n]: oh, s[n + 1]: ow}, inside)


def _masked(value: ir.Expr, inside: ir.Expr | None) -> ir.Expr:
    return value if inside is None else ir.mask_loads(value, inside)


def _and(a: ir.Expr | None, b: ir.Expr) -> ir.Expr:
    return b if a is None else Op("and", (a, b), torch.bool)


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
    x = _input_value(ctx, x)
    n = pool.lead
    if _unrolled(pool):  # the window's sum in eager's order
        total = fold("add", [where(e.inside, e.value, Const(0, acc), acc) for e in _elements(x, pool, acc)], acc)
    else:
        s = ir.index_symbols(n + 4)
        e = element(x, pool, s[n + 2], s[n + 3], acc)
        ranges = (*meta_size(meta), pool.h.kernel, pool.w.kernel)
        layout = ir.Layout(meta_size(meta), ir.contiguous_strides(meta_size(meta)))
        total = ctx.add_reduction(ctx.node.name + "_sum", layout, acc, ranges, (n + 2, n + 3), ir.Reduce.SUM,
                                  where(e.inside, e.value, Const(0, acc), acc)).body
    s = ir.index_symbols(n + 2)
    mean = _divide(total, _divisor(ctx.node, pool, s[n], s[n + 1]), acc)
    return TensorValue(meta_size(meta), meta.dtype, cast(mean, meta.dtype))


@lowering(aten.avg_pool2d_backward.default, can_lower=_backward_ok)
def _avg_pool2d_backward(ctx: LowerCtx, grad: TensorValue, x: TensorValue, *args: Any) -> TensorValue:
    """``grad_input[h, w]``: the sum of ``grad[oh, ow] / divisor`` over the windows covering ``(h, w)``."""
    meta = ctx.out_meta()
    pool = _pool(ctx.node, ctx.node.args[1].meta["val"], ctx.node.args[0].meta["val"])
    n = pool.lead
    s = ir.index_symbols(n + 2)

    def term(c: Candidate, acc: torch.dtype) -> ir.Expr:
        oh, ow = c.at[s[n]], c.at[s[n + 1]]
        covers = [_cmp("lt", _index(s[n]), _index(pool.h.at(oh, 0) + pool.h.kernel)),
                  _cmp("lt", _index(s[n + 1]), _index(pool.w.at(ow, 0) + pool.w.kernel))]
        kept = [test for test, window, k in zip(covers, (pool.h, pool.w), (c.a, c.b)) if not window.covers(k)]
        valid = _all(([c.inside] if c.inside is not None else []) + kept)
        value = _masked(cast(ir.map_indices(grad.body, c.at), acc), valid)
        share = _divide(value, _divisor(ctx.node, pool, oh, ow), acc)
        return where(valid, share, Const(0, acc), acc)

    return _gather(ctx, pool, meta, term)
