"""Render sympy index/size expressions and python values as source text (for kernels and ``call``)."""

from __future__ import annotations

import math
from typing import Any

import sympy
import torch
from torch.utils._sympy.functions import CleanDiv, FloorDiv, ModularIndexing, PythonMod
from torch.utils._sympy.functions import Max as TorchMax
from torch.utils._sympy.functions import Min as TorchMin


def expr(e: Any, *, triton: bool = False) -> str:
    """An integer expression as Python (or Triton) source. Symbols print as their names."""
    e = sympy.sympify(e)
    return _print(e, triton)


def _print(e: sympy.Expr, triton: bool) -> str:
    if isinstance(e, sympy.Integer):
        return str(int(e))
    if isinstance(e, sympy.Symbol):
        return e.name
    if isinstance(e, sympy.Rational):
        return f"({e.p} / {e.q})"
    if isinstance(e, sympy.Float):
        return repr(float(e))
    if isinstance(e, sympy.Add):
        terms = sorted(e.args, key=_order)
        out = _print(terms[0], triton)
        for t in terms[1:]:
            coeff, rest = t.as_coeff_Mul()
            if coeff < 0:
                out += " - " + _print(-t, triton)
            else:
                out += " + " + _print(t, triton)
        return out
    if isinstance(e, sympy.Mul):
        coeff, rest = e.as_coeff_Mul()
        if coeff == -1:
            return "-" + _wrap(rest, triton)
        factors = sorted(e.args, key=_order)
        return "*".join(_wrap(f, triton) for f in factors)
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
        return "*".join([_wrap(e.base, triton)] * int(e.exp))
    if isinstance(e, (FloorDiv, CleanDiv)):
        return f"({_wrap(e.args[0], triton)} // {_wrap(e.args[1], triton)})"
    if isinstance(e, ModularIndexing):
        base, div, mod = e.args
        inner = _wrap(base, triton) if div == 1 else f"({_wrap(base, triton)} // {_wrap(div, triton)})"
        return f"({inner} % {_wrap(mod, triton)})"
    if isinstance(e, (sympy.Mod, PythonMod)):
        return f"({_wrap(e.args[0], triton)} % {_wrap(e.args[1], triton)})"
    if isinstance(e, sympy.floor) and isinstance(e.args[0], sympy.Mul):
        num, den = e.args[0].as_numer_denom()
        return f"({_wrap(num, triton)} // {_wrap(den, triton)})"
    if isinstance(e, (sympy.Max, TorchMax, sympy.Min, TorchMin)):
        fn = ("tl.maximum" if isinstance(e, (sympy.Max, TorchMax)) else "tl.minimum") if triton else \
            ("max" if isinstance(e, (sympy.Max, TorchMax)) else "min")
        out = _print(e.args[0], triton)
        for a in e.args[1:]:
            out = f"{fn}({out}, {_print(a, triton)})"
        return out
    raise NotImplementedError(f"cannot print index expression {e} ({type(e).__name__})")


def _wrap(e: sympy.Expr, triton: bool) -> str:
    text = _print(e, triton)
    if isinstance(e, (sympy.Add,)) or (isinstance(e, sympy.Mul) and text.startswith("-")):
        return f"({text})"
    return text


def _order(e: sympy.Expr) -> tuple:
    return (0 if e.free_symbols else 1, str(e))


def literal(value: Any) -> str:
    """A python scalar as source text (inf and nan spelled so the text is valid Python)."""
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    if isinstance(value, sympy.Expr):
        return expr(value)
    raise TypeError(f"not a scalar: {value!r}")


def value(v: Any) -> str:
    """Any argument of an aten call (scalars, lists, dtypes, devices, ...) as python source."""
    if v is None or isinstance(v, (bool, int, float, str, sympy.Expr)):
        return repr(v) if isinstance(v, str) or v is None else literal(v)
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value(v.node.expr)
    if isinstance(v, sympy.core.relational.Relational):  # a check on a data-dependent size: ``u0 >= 0``
        return f"({expr(v.lhs)} {v.rel_op} {expr(v.rhs)})"
    if isinstance(v, sympy.logic.boolalg.BooleanAtom):
        return repr(bool(v))
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, torch.device):
        return f"torch.device({str(v)!r})"
    if isinstance(v, torch.layout):
        return str(v)
    if isinstance(v, torch.memory_format):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, tuple):
        return "(" + "".join(value(x) + ", " for x in v) + ")"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} into generated code")


TRITON_DTYPES = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
    torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}
