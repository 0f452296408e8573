"""How a pointwise step over a view of a kernel's index space maps onto the kernel's dimensions.

The scheduler (``scheduler._Open.try_add``) asks these when a step's ranges are not the kernel's:
each returns the substitutions (the step's own index symbols -> expressions in the kernel's) under
which the step computes one element per element of the kernel, and the scheduler keeps the first
whose reads line up with the members' stores. Each is a pure function of the kernel's ranges and the
step; which kernels may take such a step (a reduction kernel's, one with members) the scheduler says.

- ``permuted``: the kernel's dimensions in another order (a channels-first layer norm's output);
- ``merged``: runs of adjacent dimensions merged (a view for a matrix product);
- ``split``: a dimension cut into several (merged's inverse: a (B*T, V) result viewed as (B, T, V));
- ``regrouped``: merged runs in another order (BERT's softmax cast to the (B*H, S, S) transpose).
"""

from __future__ import annotations

import itertools

import sympy

from cgtrees.codegen import ir

MAX_PERMUTATIONS = 24  # ways to map a permuted step onto a kernel's dimensions that are tried


def permuted(ranges: tuple[sympy.Expr, ...], step: ir.Compute) -> list[dict]:
    """A pointwise step over the kernel's dimensions in another order (a channels-first layer
    norm's output, permuted back after the normalisation) as a ``full`` member of a reduction
    kernel: each way to map the step's dimensions onto equal-sized ones of the kernel, those
    that keep equal sizes in order first (``try_add`` keeps the first whose reads line up)."""
    if step.is_reduction or step.scatter is not None:
        return []  # a reduction (a column sum of the permuted output) keeps its own kernel
    if len(step.ranges) != len(ranges) or step.ranges == ranges:
        return []
    own = ir.index_symbols(len(step.ranges))
    kernel = ir.index_symbols(len(ranges))
    found: list[dict] = []

    def assign(i: int, taken: tuple[int, ...]) -> None:  # own dimension i onto a free kernel one
        if len(found) == MAX_PERMUTATIONS:
            return
        if i == len(own):
            found.append({own[k]: kernel[d] for k, d in enumerate(taken)})
            return
        for d, n in enumerate(ranges):
            if d not in taken and n == step.ranges[i]:
                assign(i + 1, (*taken, d))

    assign(0, ())
    return found


def merged(ranges: tuple[sympy.Expr, ...], step: ir.Compute) -> list[dict]:
    """A pointwise step over the kernel's dimensions with runs of adjacent ones merged (BERT's
    softmax gradient, viewed as (B*H, S, S) for the matrix product that reads it, after a row
    sum over (B, H, S, S)) as a ``full`` member: each of its dimensions is the run's linear
    index. One mapping or none."""
    if step.is_reduction or step.scatter is not None:
        return []
    if len(step.ranges) >= len(ranges) or not step.ranges:
        return []
    own = ir.index_symbols(len(step.ranges))
    kernel = ir.index_symbols(len(ranges))
    subs: dict = {}
    d = 0
    for i, size in enumerate(step.ranges):
        run, linear = sympy.Integer(1), sympy.Integer(0)
        while d < len(ranges) and run != size:
            run, linear = run * ranges[d], linear * ranges[d] + kernel[d]
            d += 1
        if run != size:
            return []
        subs[own[i]] = linear
    return [subs] if d == len(ranges) else []


def split(ranges: tuple[sympy.Expr, ...], step: ir.Compute) -> list[dict]:
    """A pointwise step over the kernel's dimensions with some cut into runs of adjacent ones (a
    masked-LM loss's gradient over (B, T, V), added to the logits' own, after the log-softmax over
    (B*T, V) it reads) as a ``full`` member: each dimension of a run is its quotient and remainder
    of the kernel's. The inverse of ``merged``; sizes known, one mapping or none."""
    if step.is_reduction or step.scatter is not None:
        return []
    if len(step.ranges) <= len(ranges) or not all(sympy.sympify(n).is_number for n in step.ranges):
        return []
    own, kernel = ir.index_symbols(len(step.ranges)), ir.index_symbols(len(ranges))
    subs: dict = {}
    i = 0
    for d, size in enumerate(ranges):
        run, product = [], sympy.Integer(1)
        while i < len(step.ranges) and (product != size or not run):
            run.append(i)
            product, i = product * step.ranges[i], i + 1
        if product != size:
            return []
        inner = sympy.Integer(1)
        for j in reversed(run):  # own[j] = (kernel[d] // inner) % step.ranges[j]
            whole, outer = sympy.floor(kernel[d] / inner), inner * step.ranges[j]
            subs[own[j]] = whole if j == run[0] else whole - step.ranges[j] * sympy.floor(kernel[d] / outer)
            inner = outer
    if any(step.ranges[j] != 1 for j in range(i, len(step.ranges))):
        return []
    subs.update({own[j]: sympy.Integer(0) for j in range(i, len(step.ranges))})
    return [subs]


def regrouped(ranges: tuple[sympy.Expr, ...], step: ir.Compute) -> list[dict]:
    """A pointwise step over runs of the kernel's adjacent dimensions merged, in another order, as
    a ``full`` member of a reduction kernel (BERT's softmax over (B, H, S, S), cast to bf16 as the
    (B*H, S, S) transpose the backward's matrix product reads): each way to cut the kernel's
    dimensions into as many runs as the step has and to map the step's onto runs of its sizes,
    each the run's linear index."""
    if step.is_reduction or step.scatter is not None:
        return []
    n, m = len(ranges), len(step.ranges)
    if not 0 < m < n:
        return []
    own, kernel = ir.index_symbols(m), ir.index_symbols(n)
    found: list[dict] = []
    for cuts in itertools.combinations(range(1, n), m - 1):
        bounds = (0, *cuts, n)
        runs = [range(bounds[i], bounds[i + 1]) for i in range(m)]
        sizes = [sympy.prod([ranges[d] for d in run]) for run in runs]
        linear = [sum((kernel[d] * sympy.prod([ranges[e] for e in run if e > d]) for d in run),
                      sympy.Integer(0)) for run in runs]
        for order in itertools.permutations(range(m)):
            if all(step.ranges[i] == sizes[order[i]] for i in range(m)):
                found.append({own[i]: linear[order[i]] for i in range(m)})
            if len(found) == MAX_PERMUTATIONS:
                return found
    return found
