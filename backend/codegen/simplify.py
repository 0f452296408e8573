"""Simplify a kernel before it is written: its index space, and its values.

``merge_dims`` drops size-1 dimensions and merges neighbouring dimensions that every index
expression walks as one (a contiguous ``[B, T, C]`` becomes one dimension of ``B*T*C``), so
generated indexing is ``x0`` rather than div/mod chains. Two neighbours ``i, i+1`` (both kept or
both reduced) merge when, for every index expression, substituting ``x_{i+1} = m - n_{i+1} * x_i``
makes ``x_i`` vanish: the expression then only depends on the merged index ``m = n_{i+1} * x_i + x_{i+1}``.

``fold`` computes constant arithmetic (a variance's divisor ``max(64.0 - 0.0, 0.0)`` is ``64.0``)
and drops identities (``x * 1.0``, ``x - 0.0``), only where the result is the kernel's to the bit:
the same dtype, NaN, infinity and signed zero. So ``x + 0.0`` stays (``-0.0 + 0.0`` is ``0.0``) while
``x - 0.0`` goes, and a float32 constant is folded only from operands that float32 holds exactly
(Triton computes ``0.1 - 0.2`` in double, then rounds once; float32 operands make that rounding the
same as float32 arithmetic's).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import sympy
import torch

from cgtrees.codegen import ir


def merge_dims(ranges: tuple[sympy.Expr, ...], reduced: tuple[int, ...],
               indices: list[sympy.Expr]) -> tuple[list[tuple[sympy.Symbol, sympy.Expr, bool]], dict]:
    """Returns the kernel's dimensions ``[(symbol, size, is_reduced)]`` (x* kept, r* reduced) and the
    substitution from the original ``x{i}`` symbols (apply it, then expand)."""
    dims = [(ir.index_symbol(i), sympy.sympify(n), i in reduced) for i, n in enumerate(ranges)]
    exprs = [sympy.expand(sympy.sympify(e)) for e in indices]
    total = {s: s for s, _, _ in dims}

    def apply(subs: dict) -> None:
        nonlocal exprs
        exprs = [sympy.expand(e.xreplace(subs)) for e in exprs]
        for k in total:
            total[k] = sympy.expand(total[k].xreplace(subs))

    apply({s: sympy.Integer(0) for s, n, _ in dims if n == 1})  # size-1 dimensions index nothing
    dims = [d for d in dims if d[1] != 1]
    fresh = 0
    i = len(dims) - 2
    while i >= 0:
        (a, na, ra), (b, nb, rb) = dims[i], dims[i + 1]
        if ra == rb:
            m = sympy.Symbol(f"m{fresh}", integer=True, nonnegative=True)
            trial = [sympy.expand(e.xreplace({b: m - nb * a})) for e in exprs]
            if all(a not in e.free_symbols for e in trial):
                fresh += 1
                apply({b: m - nb * a})
                dims[i:i + 2] = [(m, na * nb, ra)]
        i -= 1
    # final names: kept dims x0, x1, ... and reduced dims r0, r1, ... (in dimension order)
    rename, out, kx, kr = {}, [], 0, 0
    for s, n, red in dims:
        new = sympy.Symbol(f"r{kr}" if red else f"x{kx}", integer=True, nonnegative=True)
        kr, kx = (kr + 1, kx) if red else (kr, kx + 1)
        rename[s] = new
        out.append((new, n, red))
    # simultaneous renaming through placeholders: ``x1 -> x0`` must not capture another ``x0``
    hold = {s: sympy.Symbol(f"_hold{j}", integer=True, nonnegative=True) for j, s in enumerate(rename)}
    apply(hold)
    apply({hold[s]: new for s, new in rename.items()})
    return out, total


# ------------------------------------------------------------------------------------------- values
def fold(e: ir.Expr) -> ir.Expr:
    """``e`` with constant arithmetic computed and exact identities dropped, bottom-up."""
    memo: dict[int, ir.Expr] = {}  # by identity: a body shares its subtrees, and hashing one walks it all

    def visit(x: ir.Expr) -> ir.Expr:
        done = memo.get(id(x))
        if done is None:
            done = ir.map_children(x, visit)
            if isinstance(done, ir.Op):
                done = _fold_op(done)
            memo[id(x)] = done
        return done

    return visit(e)


_NUMERIC = (torch.float32, torch.float64, torch.int32, torch.int64)  # the dtypes whose constants are folded
# op -> (what it computes on 0-d tensors of its dtype, on python ints, which dtypes it applies to)
_ARITHMETIC: dict[str, tuple[Callable, Callable | None, str]] = {
    "add": (torch.add, operator.add, "any"),
    "sub": (torch.sub, operator.sub, "any"),
    "mul": (torch.mul, operator.mul, "any"),
    "neg": (torch.neg, operator.neg, "any"),
    "truediv": (torch.true_divide, None, "float"),
    "fmax": (torch.maximum, None, "float"),  # NaN-propagating, as the kernel's ``propagate_nan=ALL``
    "fmin": (torch.minimum, None, "float"),
    "imax": (torch.maximum, max, "int"),
    "imin": (torch.minimum, min, "int"),
}


def _fold_op(e: ir.Op) -> ir.Expr:
    values = [_constant(a) for a in e.args]
    if None not in values and e.name in _ARITHMETIC and all(a.dtype == e.dtype for a in e.args):
        folded = _evaluate(e.name, values, e.dtype)
        if folded is not None:
            return folded
    return _identity(e)


def _constant(e: ir.Expr) -> Any:
    """The value of a constant (``Const``, or a float64 one in ``fp64_const``), else None."""
    if isinstance(e, ir.Op) and e.name == "fp64_const":
        e = e.args[0]
    return e.value if isinstance(e, ir.Const) else None


def _evaluate(name: str, values: list[Any], dtype: torch.dtype) -> ir.Expr | None:
    on_tensors, on_ints, applies = _ARITHMETIC[name]
    if any(isinstance(v, sympy.Expr) for v in values):  # symbolic sizes: integer arithmetic in sympy
        if dtype.is_floating_point or on_ints is None or name in ("imax", "imin"):
            return None
        return ir.Const(sympy.expand(on_ints(*(sympy.sympify(v) for v in values))), dtype)
    if dtype not in _NUMERIC or applies not in ("any", "float" if dtype.is_floating_point else "int"):
        return None
    if dtype.is_floating_point:
        tensors = [torch.tensor(float(v), dtype=dtype) for v in values]
        if any(t.item() != float(v) and not math.isnan(float(v)) for t, v in zip(tensors, values)):
            return None  # an operand the dtype does not hold: the kernel rounds it after computing
        if name in ("fmax", "fmin") and len({math.copysign(1.0, float(v)) for v in values if float(v) == 0}) > 1:
            return None  # max(0.0, -0.0): the GPU's max says 0.0, numpy's and torch's CPU max the first or second
        result = on_tensors(*tensors).item()
        return ir.Op("fp64_const", (ir.Const(result, dtype),), dtype) if dtype == torch.float64 \
            else ir.Const(result, dtype)
    exact = on_ints(*(int(v) for v in values))
    info = torch.iinfo(dtype)
    return ir.Const(exact, dtype) if info.min <= exact <= info.max else None  # an overflow is left to the kernel


def _identity(e: ir.Op) -> ir.Expr:
    """``x`` for ``x + -0.0``, ``x - 0.0``, ``x * 1``, ``x / 1.0``, ``-(-x)``, a cast to ``x``'s own dtype
    and, on bools, ``x & True`` and ``x | False``; ``e`` otherwise. (``x + 0.0`` is not ``x`` for
    ``x = -0.0``, nor ``x - -0.0``.)"""
    args = e.args
    if e.name == "cast" and args[0].dtype == e.dtype:
        return args[0]
    if e.name == "neg" and isinstance(args[0], ir.Op) and args[0].name == "neg" and args[0].args[0].dtype == e.dtype:
        return args[0].args[0]
    if len(args) != 2 or any(a.dtype != e.dtype for a in args):
        return e
    x, y = args
    if e.dtype == torch.bool and e.name in ("and", "or"):  # x & True, x | False
        unit = e.name == "and"
        if _constant(y) is not None and not isinstance(_constant(y), sympy.Expr) and bool(_constant(y)) == unit:
            return x
        if _constant(x) is not None and not isinstance(_constant(x), sympy.Expr) and bool(_constant(x)) == unit:
            return y
        return e
    if e.name == "add" and _is(x, -0.0):
        return y
    if e.name in ("add", "sub") and _is(y, -0.0 if e.name == "add" else 0.0):
        return x
    if e.name == "mul" and _is(x, 1):
        return y
    if e.name in ("mul", "truediv") and _is(y, 1) and (e.name == "mul" or e.dtype.is_floating_point):
        return x
    return e


def _is(e: ir.Expr, target: float) -> bool:
    """Whether ``e`` is the constant ``target`` of its dtype (a float zero's sign included; an integer
    zero is any zero)."""
    value = _constant(e)
    if value is None or isinstance(value, sympy.Expr) or e.dtype == torch.bool:
        return False
    if not e.dtype.is_floating_point:
        return value == target
    value = float(value)
    return value == target and math.copysign(1.0, value) == math.copysign(1.0, target)
