"""A sum over a dimension of a one-hot picks one element: ``sum_j where(j == t, v(j), 0) = v(t)``.

A loss over classes meets this twice. Its forward picks the target's log-probability
(``aot/decompositions.nll_loss_picks`` writes that pick as a one-hot sum), and the backward of a
log-softmax sums its incoming gradient over the row, which for a negative log-likelihood is the
one-hot of the target times a per-row scale (``_log_softmax_backward_data(grad, out) = grad -
exp(out) * sum(grad)``). Reduced as written, each is a pass over the whole row: the forward's would
read the logits again (or need the log-softmax written whole), the backward's would walk the row
once more before its gradient can be written. ``picked`` turns such a sum into the value it picks, a
value per row: the forward reads one logit per row, the backward's gradient becomes one pointwise
pass over the logits.

The sum's body must be, up to factors (``mul``), signs, casts and masks that do not vary along the
summed dimension ``d`` (``where(c, ., 0)``), a ``where(x_d == t, v, 0)`` (or ``x_d == t`` cast to
numbers: ``F.one_hot``) whose ``t`` does not vary along ``d`` either (``eq`` of the dimension's
index, or the ``where`` of a one-hot scatter). The value is ``v`` (times the factors) at ``x_d = t``:
every load that walks ``d`` reads at the indirect index ``t``. A ``t`` that is already a checked
index (``ir.Indirect``, a one-hot scatter's: eager raises on one out of range, our kernel asserts)
is used as it is; any other ``t`` is checked only to mask its loads, and where it is out of range
the sum is 0, as written. A buffer computed pointwise over the same space (a product the backward
reads twice is written to memory first) is looked through.

Not kept: a factor that is infinite or NaN where the one-hot is 0 turns the sum's zeros into NaN
(``0 * inf``), while the picked value only sees the factor at ``t``, as eager's own
``nll_loss_backward`` does (its zeros are zeros).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch

from cgtrees.codegen import ir
from cgtrees.codegen.ir import Const, IndexValue, Op

_CASTS = ("cast", "to_bf16")


def picked(builder: Any, body: ir.Expr, size: tuple[sympy.Expr, ...], dim: int) -> ir.Expr | None:
    """The value ``sum(body, dim)`` picks (indexed by the symbols of ``size``, ``x_dim`` gone), or
    None where ``body`` is not a one-hot along ``dim``. ``builder`` holds the steps so far."""
    sym = ir.index_symbol(dim)
    found = _one_hot(_looked_through(builder, body, size), sym)
    if found is None:
        return None
    target, value = found
    index = target if _checked(target, size[dim]) else \
        ir.Indirect(target, size[dim], wrap=False, mask=_in_range(target, size[dim]))
    value = _at(_inlined(builder, value, size, sym), sym, index)
    if value is None or _varies(value, sym):
        return None
    if index is target:
        return value
    return Op("where", (_in_range(target, size[dim]), value, Const(_zero(value.dtype), value.dtype)), value.dtype)


# ------------------------------------------------------------------------------------ the pattern
def _one_hot(e: ir.Expr, sym: sympy.Symbol) -> tuple[ir.Expr, ir.Expr] | None:
    """``(t, v)`` such that ``e == where(x_d == t, v, 0)`` along ``x_d``, or None."""
    if not isinstance(e, Op):
        return None
    args = e.args
    if e.name == "where" and _is_zero(args[2]):
        target = _target(args[0], sym)
        if target is not None and not _varies(target, sym):
            return target, args[1]
        if not _varies(args[0], sym):  # a mask of the row (an ignored target's row)
            inner = _one_hot(args[1], sym)
            return None if inner is None else (inner[0], Op("where", (args[0], inner[1], args[2]), e.dtype))
        return None
    if e.name == "mul":  # the other factor is taken at x_d = t too, whether it varies along d or not
        for hot, factor in ((0, 1), (1, 0)):
            inner = _one_hot(args[hot], sym)
            if inner is not None:
                pair = (inner[1], args[factor]) if hot == 0 else (args[factor], inner[1])
                return inner[0], Op("mul", pair, e.dtype)
        return None
    if e.name in _CASTS and e.args[0].dtype == torch.bool and e.dtype != torch.bool:  # a one-hot as numbers
        target = _target(args[0], sym)
        if target is not None and not _varies(target, sym):
            return target, Const(1.0 if e.dtype.is_floating_point else 1, e.dtype)
        return None
    if e.name == "neg" or (e.name in _CASTS and e.dtype != torch.bool):
        inner = _one_hot(args[0], sym)
        return None if inner is None else (inner[0], Op(e.name, (inner[1],), e.dtype))
    return None


def _target(cond: ir.Expr, sym: sympy.Symbol) -> ir.Expr | None:
    """``t`` where ``cond`` is ``x_d == t`` (or a bool one-hot scatter's ``where(x_d == t, True, False)``)."""
    if not isinstance(cond, Op):
        return None
    if cond.name == "where" and _is_const(cond.args[1], True) and _is_const(cond.args[2], False):
        return _target(cond.args[0], sym)
    if cond.name != "eq":
        return None
    a, b = cond.args
    if _is_index(a, sym):
        return b
    if _is_index(b, sym):
        return a
    return None


def _is_index(e: ir.Expr, sym: sympy.Symbol) -> bool:
    while isinstance(e, Op) and e.name in _CASTS and e.dtype.is_floating_point is False and e.dtype != torch.bool:
        e = e.args[0]
    return isinstance(e, IndexValue) and sympy.sympify(e.index) == sym


def _checked(target: ir.Expr, size: sympy.Expr) -> bool:
    """A one-hot scatter's index: checked by the kernel (a target out of range raises there)."""
    return isinstance(target, ir.Indirect) and target.mask is None and not target.wrap and \
        sympy.sympify(target.size) == sympy.sympify(size)


# ---------------------------------------------------------------------------------- substitution
def _at(e: ir.Expr, sym: sympy.Symbol, index: ir.Expr) -> ir.Expr | None:
    """``e`` with ``x_d`` replaced by ``index`` (loads read at it indirectly), None if it cannot be."""
    if isinstance(e, IndexValue):
        if sym not in sympy.sympify(e.index).free_symbols:
            return e
        if sympy.sympify(e.index) != sym:
            return None  # an index computed from x_d: not an indirect load
        return index if e.dtype == index.dtype else Op("cast", (index,), e.dtype)
    if isinstance(e, ir.Load):
        return _load_at(e, sym, index)
    parts: list[ir.Expr | None] = []

    def sub(child: ir.Expr) -> ir.Expr:
        parts.append(_at(child, sym, index))
        return parts[-1] if parts[-1] is not None else child

    out = ir.map_children(e, sub)
    return None if any(p is None for p in parts) else out


def _load_at(e: ir.Load, sym: sympy.Symbol, index: ir.Expr) -> ir.Expr | None:
    mask = _at(e.mask, sym, index) if e.mask is not None else None
    indirect = tuple(_at(i, sym, index) for i in e.indirect)
    if (e.mask is not None and mask is None) or any(i is None for i in indirect):
        return None
    position = sympy.sympify(e.index)
    if sym in position.free_symbols:
        if not isinstance(index, ir.Indirect):
            return None
        position = sympy.expand(position.xreplace({sym: ir.indirect_symbol(len(indirect))}))
        indirect = (*indirect, index)
    return ir.Load(e.buf, position, e.dtype, mask, indirect)


def _looked_through(builder: Any, e: ir.Expr, size: tuple[sympy.Expr, ...]) -> ir.Expr:
    """``e``, or where it is a whole read of a buffer computed pointwise over ``size``, its body."""
    if not isinstance(e, ir.Load) or e.mask is not None or e.indirect:
        return e
    step = next((s for s in reversed(builder.steps) if getattr(s, "name", None) == e.buf), None)
    if not isinstance(step, ir.Compute) or step.is_reduction or step.writes_input or step.scatter is not None:
        return e
    syms = ir.index_symbols(len(size))
    if step.ranges != size or sympy.expand(step.layout.index(syms) - e.index) != 0 or step.dtype != e.dtype:
        return e
    return step.body


def _inlined(builder: Any, e: ir.Expr, size: tuple[sympy.Expr, ...], sym: sympy.Symbol) -> ir.Expr:
    """``e`` with every read along ``x_d`` of a buffer computed pointwise over ``size`` replaced by
    its body: picked at one index, it is computed there (log-softmax's ``x - max``, which its
    ``exp`` reads too and is therefore a buffer, is not then written whole for one element a row)."""
    if isinstance(e, ir.Load) and sym in sympy.sympify(e.index).free_symbols:
        inner = _looked_through(builder, e, size)
        return e if inner is e else _inlined(builder, inner, size, sym)
    return ir.map_children(e, lambda child: _inlined(builder, child, size, sym))


# ------------------------------------------------------------------------------------------ facts
def _varies(e: ir.Expr, sym: sympy.Symbol) -> bool:
    """Whether ``e`` depends on ``x_d`` (through a load's index or an index value)."""
    for v in ir.walk(e):
        if isinstance(v, (ir.Load, IndexValue)) and sym in sympy.sympify(v.index).free_symbols:
            return True
    return False


def _in_range(t: ir.Expr, size: sympy.Expr) -> ir.Expr:
    value = t if t.dtype == torch.int64 else Op("cast", (t,), torch.int64)
    low = Op("ge", (value, Const(0, torch.int64)), torch.bool)
    high = Op("lt", (value, Const(sympy.sympify(size), torch.int64) if not sympy.sympify(size).is_number
                     else Const(int(size), torch.int64)), torch.bool)
    return Op("and", (low, high), torch.bool)


def _is_zero(e: ir.Expr) -> bool:
    return isinstance(e, Const) and not isinstance(e.value, sympy.Expr) and e.value == 0


def _is_const(e: ir.Expr, value: bool) -> bool:
    return isinstance(e, Const) and e.dtype == torch.bool and e.value is value


def _zero(dtype: torch.dtype) -> Any:
    return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
