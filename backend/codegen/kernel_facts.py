"""What a kernel writer reads off a scheduled kernel's IR: the size symbols it takes as
arguments, the memory order of a store, whether a reduction's reduced elements are adjacent in
memory, and which block dimensions ("x" rows or elements, "r" reduced columns) a value walks.
Pure functions of the IR; ``kernel.KernelWriter`` turns their answers into Triton source.
"""

from __future__ import annotations

import sympy

from cgtrees.codegen import ir
from cgtrees.codegen.scheduler import Kernel


def size_symbols(kernel: Kernel, xnumel: sympy.Expr, rnumel: sympy.Expr | None) -> set[sympy.Symbol]:
    out: set[sympy.Symbol] = set()
    for e in [*kernel.ranges, xnumel, rnumel or 0]:
        out |= sympy.sympify(e).free_symbols
    for m in kernel.members:
        targets = m.step.scatter.indirect if m.step.scatter is not None else ()
        if m.step.scatter is not None:
            out |= sympy.sympify(m.step.scatter.index).free_symbols
        for ld in [ld for e in [m.step.body, *targets] for ld in ir.loads(e)]:
            out |= sympy.sympify(ld.index).free_symbols
        for c in consts(m.step.body):
            out |= c.value.free_symbols
        for e in [e for t in [m.step.body, *targets] for e in ir.walk(t)]:
            if isinstance(e, ir.Indirect):
                out |= sympy.sympify(e.size).free_symbols
            elif isinstance(e, ir.IndexValue):
                out |= sympy.sympify(e.index).free_symbols
        out |= sympy.sympify(m.step.layout.index(ir.index_symbols(len(m.step.layout.size)))).free_symbols
    return {s for s in out if not ir.is_kernel_symbol(s)}


def memory_order(index: sympy.Expr, ranges: tuple[sympy.Expr, ...]) -> list[int]:
    """The dimensions of ``ranges`` by decreasing stride in ``index`` (a store's), the order they
    already have where a stride is not a positive number (symbolic, or a dimension not indexed)."""
    index = sympy.expand(sympy.sympify(index))
    strides = []
    for d, n in enumerate(ranges):
        stride = index.coeff(ir.index_symbol(d)) if n != 1 else sympy.Integer(0)
        if n != 1 and not (stride.is_number and stride > 0):
            return list(range(len(ranges)))
        strides.append(int(stride) if n != 1 else 0)
    return sorted(range(len(ranges)), key=lambda d: -strides[d])


def reduces_innermost(bodies: dict, dims: list) -> bool:
    """Whether a reduction's reduced elements are adjacent in memory (a row reduction) rather than
    its rows (a column reduction: batch norm's statistics over N, H, W of a channels-last tensor).
    Read from the load that walks the most dimensions: is its smallest stride a reduced one?"""
    if not dims or not any(red for _, _, red in dims):
        return False
    loads = [ld for b in bodies.values() for ld in ir.loads(b) if not ld.indirect]
    if not loads:
        return dims[-1][2]
    index = sympy.expand(sympy.sympify(max(loads, key=lambda ld: len(ld.index.free_symbols)).index))
    strides = [(index.coeff(s), red) for s, _, red in dims]
    known = [(st, red) for st, red in strides if st.is_number and st > 0]
    if len(known) != len(strides):
        return dims[-1][2]  # symbolic strides: the last dimension is innermost, as when contiguous
    return min(known, key=lambda t: t[0])[1]


def symbol_kinds(index: sympy.Expr) -> set[str]:
    """Which block dimensions an index walks: "x" (rows/elements), "r" (reduced columns)."""
    return {s.name[0] for s in sympy.sympify(index).free_symbols if s.name[0] in "xr" and s.name[1:].isdigit()}


def kinds(e: ir.Expr) -> set[str]:
    """Which block dimensions a value varies along (its loads', index values' and row values')."""
    out: set[str] = set()
    for v in ir.walk(e):
        if isinstance(v, (ir.Load, ir.IndexValue)):
            out |= symbol_kinds(v.index)
        elif isinstance(v, ir.Ref):
            out.add("x")
    return out


def consts(e: ir.Expr) -> list[ir.Const]:
    return [c for c in ir.walk(e) if isinstance(c, ir.Const) and isinstance(c.value, sympy.Expr)]


def index_values(e: ir.Expr) -> list[ir.IndexValue]:
    return [v for v in ir.walk(e) if isinstance(v, ir.IndexValue)]


def refs(e: ir.Expr) -> set[str]:
    return {v.name for v in ir.walk(e) if isinstance(v, ir.Ref)}


def spans_block(two_d: bool, e: ir.Expr, full: bool) -> bool:
    """Whether value ``e`` has its block's shape already: ``[XBLOCK, RBLOCK]`` (``full``) or
    ``[XBLOCK, 1]`` in a reduction kernel (``two_d``), ``[XBLOCK]`` in a pointwise one. A load has
    its mask's shape (``xmask & rmask`` where its index walks the row, else ``xmask``), a
    reduction's result is ``[XBLOCK, 1]``, and an op has its operands' broadcast shape; where no
    operand shows the shape, the value is broadcast (a constant, an index, a load of one address)."""
    if two_d and full:
        return any(isinstance(v, ir.Load) and "r" in kinds(v) for v in ir.walk(e))
    if two_d:
        return any(isinstance(v, ir.Ref) or (isinstance(v, ir.Load) and "x" in kinds(v)) for v in ir.walk(e))
    return any(isinstance(v, ir.Load) and "x" in kinds(v) for v in ir.walk(e))


def loop_levels(members: tuple, bodies: dict, together: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
    """A looped reduction kernel's loops over the row: ``loop_of`` (the loop each member other than
    a row member is computed in: one past the last loop whose results it reads) and ``avail`` (the
    loop before which each reduction's or row member's value is known). A member of ``together``
    (a sum of ``exp(a - max)``, ``online_softmax``) is reduced in the loop of its partner."""
    loop_of: dict[str, int] = {}
    avail: dict[str, int] = {}
    for m in members:
        if m.name in together:  # its other reads are its partner's: known by the partner's loop
            level = loop_of[together[m.name]]
        else:
            level = max((avail[r] for r in refs(bodies[m.name])), default=0)
        if m.role == "row":
            avail[m.name] = level
        else:
            loop_of[m.name] = level
            if m.role == "reduce":
                avail[m.name] = level + 1
    return loop_of, avail
