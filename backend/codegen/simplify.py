"""Simplify a kernel's index space before it is written: drop size-1 dimensions and merge
neighbouring dimensions that every index expression walks as one (a contiguous ``[B, T, C]``
becomes one dimension of ``B*T*C``), so generated indexing is ``x0`` rather than div/mod chains.

Two neighbours ``i, i+1`` (both kept or both reduced) merge when, for every index expression,
substituting ``x_{i+1} = m - n_{i+1} * x_i`` makes ``x_i`` vanish: the expression then only depends
on the merged index ``m = n_{i+1} * x_i + x_{i+1}``.
"""

from __future__ import annotations

import sympy

from backend.codegen import ir


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
