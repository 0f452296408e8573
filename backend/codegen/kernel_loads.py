"""How a generated kernel reads memory: ``KernelWriter``'s loads (``kernel.py``), one concept apart.

A load without a mask reads its block at its index (``xmask``, and ``rmask`` where it walks the
columns). A guarded load reads only where its mask holds and its indirect indices are in range
(each index asserted with ``tl.device_assert``, the check masking the loads that use it). A row's
value under a mask of columns alone (the pad of a row-wise value into a padded GEMM's layout) is
loaded once a row, a ``[XBLOCK, 1]`` block, then masked by the columns.

``LoadWriter`` is a mixin: the writer gives it ``value``, ``_var``, ``_ptr``, ``two_d`` and
``interpret``.
"""

from __future__ import annotations

import sympy
import torch

from cgtrees.codegen import ir, printer
from cgtrees.codegen import kernel_facts as facts
from cgtrees.codegen.kernel_text import Scope, is_literal, plus


class LoadWriter:
    def _load_text(self, e: ir.Load, scope: Scope) -> str:
        ptr = self._ptr(e.buf, e.dtype)
        split = self._row_load_under_column_mask(e)
        if split is not None:
            return self._row_load_then_mask(e, ptr, split, scope)
        if e.mask is not None or e.indirect:
            return self._guarded_load_text(e, ptr, scope)
        index = printer.expr(e.index, triton=True)
        names = facts.symbol_kinds(e.index)
        if not names and self.interpret:  # the interpreter mixes 0-d and block values badly: load a block
            shape = "[XBLOCK, 1]" if self.two_d else "[XBLOCK]"
            return f"tl.load({ptr} + {plus(index, f'tl.zeros({shape}, tl.int32)')}, xmask, other=0)"
        if not names:
            return f"tl.load({ptr} + {index})" if index != "0" else f"tl.load({ptr})"
        mask = "xmask & rmask" if "r" in names else "xmask"
        return f"tl.load({ptr} + ({index}), {mask}, other=0)"

    def _row_load_under_column_mask(self, e: ir.Load) -> tuple[list[ir.Expr], list[ir.Expr]] | None:
        """A load of one value a row (a row's statistic, a label) under a mask with factors of the
        columns (the pad of a row-wise value: ``constant_pad_nd`` of a gradient into a padded GEMM's
        layout): the mask's factors of rows, and those of columns; None where it is not that."""
        if not (self.two_d and e.mask is not None and not e.indirect) or "r" in facts.symbol_kinds(e.index):
            return None
        factors = _and_factors(e.mask)
        rows = [f for f in factors if "r" not in facts.kinds(f)]
        columns = [f for f in factors if facts.kinds(f) == {"r"}]
        return (rows, columns) if columns and len(rows) + len(columns) == len(factors) else None

    def _row_load_then_mask(self, e: ir.Load, ptr: str, split: tuple, scope: Scope) -> str:
        """The row's value loaded once, a ``[XBLOCK, 1]`` block, then masked by the columns: a load
        of the full block would load the same address for every column (on an H200, GPT-2's padded
        loss gradient took 2.0 ms so, five row values an element). The address is read wherever the
        row is in the mask, as the guarded load reads it wherever some column of the row is."""
        rows, columns = split
        index = printer.expr(e.index, triton=True)
        mask = " & ".join(["xmask", *(self.value(f, scope) for f in rows)])
        row = self._var(scope, f"tl.load({ptr} + {plus(index, 'tl.zeros([XBLOCK, 1], tl.int32)')}, {mask}, other=0)")
        keep = " & ".join(self.value(f, scope) for f in columns)
        return f"tl.where({keep}, {row}, tl.zeros_like({row}))"

    def _guarded_load_text(self, e: ir.Load, ptr: str, scope: Scope) -> str:
        """A load that reads only where its mask holds and its indirect indices are in range."""
        need = facts.kinds(e) | {"x"}  # the mask has xmask's shape at least
        subs, conds = {}, [self._mask(need)]
        for k, ind in enumerate(e.indirect):
            index, ok = self._indirect(ind, scope)
            subs[ir.indirect_symbol(k)] = sympy.Symbol(index, integer=True)
            conds.append(ok)
        if e.mask is not None:
            conds.append(self.value(e.mask, scope))
        offset = printer.expr(sympy.sympify(e.index).xreplace(subs), triton=True)
        if need - facts.kinds(ir.Load(e.buf, e.index, e.dtype, None, e.indirect)):  # pointers must span the mask
            offset = plus(offset, f"tl.zeros({self._shape(need)}, tl.int32)")
        return f"tl.load({ptr} + ({offset}), {' & '.join(conds)}, other=0)"

    def _indirect(self, e: ir.Indirect, scope: Scope) -> tuple[str, str]:
        """The index as int64 (negative ones wrapped where allowed), asserted to be in range, and
        its range check, which masks the loads that use it. Two indices of one value into
        dimensions of other sizes share the variable, not the check: hence cached per ``Indirect``."""
        hit = scope.find(e)
        if hit is None:
            hit = scope.cache[e] = self._indirect_vars(e, scope)
        return hit

    def _indirect_vars(self, e: ir.Indirect, scope: Scope) -> tuple[str, str]:
        value = self.value(e.value, scope)
        if is_literal(value):
            value = f"tl.full([1], {value}, tl.int64)"
        size = printer.expr(e.size, triton=True)
        index = value if e.value.dtype == torch.int64 else self._var(scope, f"{value}.to(tl.int64)")
        if e.wrap:
            index = self._var(scope, f"tl.where({index} < 0, {index} + {size}, {index})")
        ok = self._var(scope, f"(0 <= {index}) & ({index} < {size})")
        mask = self._mask(facts.kinds(e)) + (f" & {self.value(e.mask, scope)}" if e.mask is not None else "")
        low = f"-{printer.expr(e.size)}" if e.wrap else "0"
        message = f"index out of range: an index is outside [{low}, {printer.expr(e.size)})"
        scope.lines.append(f'tl.device_assert({ok}, "{message}", {mask})')
        return index, ok

    def _mask(self, kinds: set[str]) -> str:
        return "xmask & rmask" if "r" in kinds else "xmask"

    def _shape(self, kinds: set[str]) -> str:
        if not self.two_d:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if "r" in kinds else "[XBLOCK, 1]"


def _and_factors(e: ir.Expr) -> list[ir.Expr]:
    """The conjuncts of a mask: ``a & (b & c)`` is ``[a, b, c]``."""
    if isinstance(e, ir.Op) and e.name == "and":
        return [f for a in e.args for f in _and_factors(a)]
    return [e]
