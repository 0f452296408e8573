"""A reshape that merges dimensions of a value not yet in memory, as a remap of its index expressions.

``view(x, [B*T, V])`` of a lazy ``x`` of size ``[B, T, V]`` would need ``t = y0 % T`` and ``b = y0 // T``
in general. But where every index expression of ``x`` (each load's, each index value's, masks
included) is affine in the merged dimensions with the strides of a contiguous run (the coefficient
of ``b`` is ``T`` times that of ``t``: ``b*T*V + t*V + v``), the merged dimension reads as one,
``y0*V + y1``, with no division. That is the case that matters: a loss reshapes the float32 copy of
the logits (``logits.float().view(-1, V)``); realized, the copy is a write and a read of the
logits' size in float32 (1.6 GB at GPT-2's 8 x 1024 x 50257) where the kernels that use it could
read the bfloat16 logits themselves. Anything else (a mask on one of the merged dimensions, a
permuted source, an index read from data) gives None, and the caller realizes the value first.
"""

from __future__ import annotations

import sympy

from cgtrees.codegen import ir


def merged_body(body: ir.Expr, src: tuple, dst: tuple) -> ir.Expr | None:
    """``body`` (over ``src``'s index symbols) reshaped to ``dst``, where ``dst`` merges runs of
    ``src``'s dimensions and every index expression allows it; else None."""
    groups = _groups(src, dst)
    if groups is None:
        return None
    exprs = [e.index for e in ir.walk(body) if isinstance(e, (ir.Load, ir.IndexValue))]
    subs: dict[sympy.Symbol, sympy.Expr] = {}
    for k, dims in groups:
        y = ir.index_symbol(k)
        for a, b in zip(dims, dims[1:]):
            if not all(_linear_run(sympy.sympify(e), a, b, src[b]) for e in exprs):
                return None
        subs.update({ir.index_symbol(d): sympy.Integer(0) for d in dims[:-1]})
        subs[ir.index_symbol(dims[-1])] = y
    for d, n in enumerate(src):
        if n == 1:
            subs[ir.index_symbol(d)] = sympy.Integer(0)
    return ir.map_indices(body, subs)


def _linear_run(expr: sympy.Expr, outer: int, inner: int, inner_size: sympy.Expr) -> bool:
    """Whether ``expr`` is affine in dimensions ``outer`` and ``inner`` (adjacent in a merged run)
    with the outer coefficient ``inner_size`` times the inner one."""
    xo, xi = ir.index_symbol(outer), ir.index_symbol(inner)
    co, ci = sympy.diff(expr, xo), sympy.diff(expr, xi)
    if any(ir.is_kernel_symbol(s) for s in (co.free_symbols | ci.free_symbols)):
        return False  # not affine (a product of indices, a division)
    if any(isinstance(f, (sympy.floor, sympy.Mod)) or type(f).__name__ in ("FloorDiv", "ModularIndexing")
           for f in sympy.preorder_traversal(expr) if f.free_symbols & {xo, xi}):
        return False
    return sympy.expand(co - ci * inner_size) == 0


def _groups(src: tuple, dst: tuple) -> list[tuple[int, list[int]]] | None:
    """For each dimension of ``dst`` larger than 1, the run of ``src`` dimensions (larger than 1)
    it merges; None where ``dst`` is not such a merge (a split, or sizes that do not line up) or
    merges nothing."""
    ins = [(d, n) for d, n in enumerate(src) if n != 1]
    out, i, merges = [], 0, False
    for k, n in enumerate(dst):
        if n == 1:
            continue
        run, product = [], sympy.Integer(1)
        while i < len(ins) and sympy.expand(product - n) != 0:
            run.append(ins[i][0])
            product *= ins[i][1]
            i += 1
        if not run or sympy.expand(product - n) != 0:
            return None
        merges |= len(run) > 1
        out.append((k, run))
    return out if i == len(ins) and merges else None
